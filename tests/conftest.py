"""Shared pytest set-up: full-precision float32 matmuls, `gpu` tests skipped without a GPU."""

import os
import tempfile

import jax
import pytest

# Tests compile into a fresh process state; the persistent caches are tested on their own
# (tests patch kernels at run time, which the step cache's key cannot see).
os.environ.setdefault("SWAJAX_COMPILATION_CACHE", "0")
os.environ.setdefault("SWAJAX_STEP_CACHE", "0")

jax.config.update("jax_default_matmul_precision", "highest")


def _session_compilation_cache() -> None:
    """JAX's persistent compilation cache in a directory of this test session, shared by the
    xdist workers: a program two tests (or two workers) compile alike is compiled once. The
    cache keys on the compiled program itself, so a test that patches a kernel compiles its
    own; the step cache (keyed on the source, not the program) stays off."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID") or f"pid{os.getpid()}"
    path = os.path.join(tempfile.gettempdir(), f"swajax-test-jax-cache-{run}")
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    # Only programs that took a while to compile: the thousands of small ops a suite compiles
    # cost more to serialise and write than to compile again.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    # A size bound turns on the cache's file lock around every read and write: without it
    # one worker can read an entry another is still writing (a torn executable; the suite
    # lost workers to aborts and segmentation faults in compile and cache write).
    jax.config.update("jax_compilation_cache_max_size", 16 << 30)


if os.environ.get("SWAJAX_TEST_COMPILATION_CACHE", "1") != "0":
    _session_compilation_cache()


@pytest.fixture
def no_persistent_cache_writes():
    """Compiles without writing JAX's persistent cache (reads still hit) for the test. For
    whole engine steps that run the Mosaic GPU kernels in interpret mode: serialising such an
    executable (its race-detection host callbacks) aborted the XLA process in two of five
    suite runs (`experiments/notes/engine.md` v22)."""
    key = "jax_persistent_cache_min_compile_time_secs"
    before = getattr(jax.config, key)
    jax.config.update(key, float("inf"))
    yield
    jax.config.update(key, before)


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
