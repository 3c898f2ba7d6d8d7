"""JAX's persistent compilation cache, on by default for swajax engines.

The first `Engine` of a process turns the cache on in a per-user directory unless the user
chose otherwise: `$SWAJAX_COMPILATION_CACHE_DIR`, else `$XDG_CACHE_HOME/swajax/jax` (default
`~/.cache/swajax/jax`). A directory the user already set (`JAX_COMPILATION_CACHE_DIR` or
`jax.config.update("jax_compilation_cache_dir", ...)`) is kept as it is. Set
`SWAJAX_COMPILATION_CACHE=0` to leave JAX's setting untouched (the cache off unless configured).

The compiled steps, Mosaic GPU kernels included, are then read back in a new process instead of
being compiled again. The step cache (`swajax._step_cache`, a `swajax-steps/` directory inside
this one, off with `SWAJAX_STEP_CACHE=0`) spares that process tracing and lowering the steps as
well.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax

_DONE = [False]


def default_cache_dir() -> Path:
    if os.environ.get("SWAJAX_COMPILATION_CACHE_DIR"):
        return Path(os.environ["SWAJAX_COMPILATION_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "swajax" / "jax"


def enable_default_cache() -> str | None:
    """Turns the persistent cache on (once per process); returns the directory in use."""
    current = jax.config.jax_compilation_cache_dir
    if _DONE[0] or current or os.environ.get("SWAJAX_COMPILATION_CACHE", "1") == "0":
        _DONE[0] = True
        return current or None
    _DONE[0] = True
    path = default_cache_dir()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None  # read-only home: no cache, compile as before
    jax.config.update("jax_compilation_cache_dir", str(path))
    # Steps compile in seconds; the default threshold (1 s) would skip small models' steps.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.1)
    return str(path)
