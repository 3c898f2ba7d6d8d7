"""What every benchmark JSON records about its run: device, versions, git commit, arguments."""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import subprocess
import sys

PACKAGES = ("jax", "jaxlib", "flax", "numpy", "torch", "transformers")


def git_commit() -> str | None:
    """HEAD of the checkout, or $SWAJAX_GIT_COMMIT (the device machine gets no .git)."""
    env = os.environ.get("SWAJAX_GIT_COMMIT")
    if env:
        return env
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True, timeout=10
        )
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def versions() -> dict[str, str | None]:
    out = {}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    out["python"] = sys.version.split()[0]
    return out


def run_metadata(**parameters) -> dict:
    """device, platform, versions, git_commit, argv, utc time and the run's parameters."""
    import jax

    dev = jax.devices()[0]
    return dict(
        device=dev.device_kind,
        platform=dev.platform,
        versions=versions(),
        git_commit=git_commit(),
        argv=sys.argv[1:],
        utc=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        parameters=parameters,
    )
