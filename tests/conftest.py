"""Shared pytest set-up: full-precision float32 matmuls, `gpu` tests skipped without a GPU."""

import os

import jax
import pytest

# Tests compile into a fresh process state; the persistent caches are tested on their own
# (tests patch kernels at run time, which the step cache's key cannot see).
os.environ.setdefault("SWAJAX_COMPILATION_CACHE", "0")
os.environ.setdefault("SWAJAX_STEP_CACHE", "0")

jax.config.update("jax_default_matmul_precision", "highest")


def _has_gpu() -> bool:
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


HAS_GPU = _has_gpu()


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip_gpu = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
