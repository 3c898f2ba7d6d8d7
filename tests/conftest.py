"""Shared pytest set-up: full-precision float32 matmuls, `gpu` tests skipped without a GPU."""

import os
import tempfile

import jax
import pytest

# Tests compile into a fresh process state; the persistent caches are tested on their own
# (tests patch kernels at run time, which the step cache's key cannot see).
os.environ.setdefault("SWAJAX_COMPILATION_CACHE", "0")
os.environ.setdefault("SWAJAX_STEP_CACHE", "0")
# XLA's CPU back end without LLVM optimisation (`jax_disable_most_optimizations`: backend
# optimisation level 0, LLVM's expensive passes off; the HLO passes run as before, and with
# fast-math off LLVM does not reassociate or contract floating-point operations at any level).
# Most of the suite's time is compiling engine steps and running them on a few tokens: the
# engine tests compile about 20 % faster (test_engine.py with test_adaptive_split.py, the two
# side by side on 2 cores: 593 s -> 535 s, compile 495 s -> 406 s); the interpret-mode kernel
# tests, which spend their time in the interpreter, take about as long. Set in
# the environment too, so that the child processes of tests (a second process reading the
# persistent cache, the 8-device process) compile alike; SWAJAX_TEST_FULL_OPT=1 turns it off.
if os.environ.get("SWAJAX_TEST_FULL_OPT") != "1":
    os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
    jax.config.update(
        "jax_disable_most_optimizations", os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] == "1"
    )

jax.config.update("jax_default_matmul_precision", "highest")


def _session_compilation_cache() -> None:
    """JAX's persistent compilation cache in a directory of this test session, shared by the
    xdist workers (opt-in: SWAJAX_TEST_COMPILATION_CACHE=1). Off by default: few of the
    suite's programs are compiled twice (test_engine.py with test_speculative.py on 2 workers:
    333 s with the cache, 336 s without), and writing an executable to the cache crashed XLA
    now and then (segmentation faults in `put_executable_and_time`, an abort of the 8-device
    child process: `experiments/notes/engine.md` v22, v26). The step cache stays off either
    way: it keys on the source, and tests patch kernels at run time."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID") or f"pid{os.getpid()}"
    path = os.path.join(tempfile.gettempdir(), f"swajax-test-jax-cache-{run}")
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    # Only programs that took a while to compile: the thousands of small ops a suite compiles
    # cost more to serialise and write than to compile again.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    # A size bound turns on the cache's file lock around every read and write: without it
    # one worker can read an entry another is still writing.
    jax.config.update("jax_compilation_cache_max_size", 16 << 30)


if os.environ.get("SWAJAX_TEST_COMPILATION_CACHE", "0") == "1":
    _session_compilation_cache()


@pytest.fixture
def no_persistent_cache_writes():
    """Compiles without writing JAX's persistent cache (reads still hit) for the test, when
    the session cache is on. For whole engine steps that run the Mosaic GPU kernels in
    interpret mode: serialising such an executable (its race-detection host callbacks)
    aborted the XLA process in two of five suite runs (`experiments/notes/engine.md` v22)."""
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


# The longest tests of a CPU run (about 45 to 150 s each), collected first: xdist hands out
# the rest to whichever worker is free, so the two workers end together instead of one running
# a two-minute test alone at the end. They hold no state other tests of their file use.
SLOW_FIRST = (
    "tests/test_tensor_parallel.py::test_in_eight_device_process[engines]",
    "tests/test_experiments.py::test_swa_scratch_throughput_quick",
    "tests/test_tensor_parallel.py::test_in_eight_device_process[loading-and-lowering]",
    "tests/test_scan_layers.py::test_scanned_decode_runs_the_stacked_kernel_in_interpret_mode",
    "tests/test_paged_attention.py::test_prefill_output_does_not_depend_on_a_tile_aligned_chunk"
    "_start[q16kv1d512-full-gemma4_12b]",
    "tests/test_grouped_matmul.py::test_tile_kernel_splits_tiles_at_the_preset_geometry_in"
    "_interpret_mode",
)


def pytest_collection_modifyitems(config, items):
    rank = {nodeid: i for i, nodeid in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid, len(rank)))  # stable: the rest in order
    if HAS_GPU:
        return
    skip_gpu = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
