"""Compile once: engines share compiled steps, layouts are deterministic, steps can be compiled
ahead of time, and the persistent compilation cache serves a second process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from flax import nnx
from test_generate import dense_greedy, kv_config, make_model, prompts_of

import swajax
import swajax._generate
import swajax._runner
from pallas_kernels import _checks
from swajax import _runner, _step_cache
from swajax._budget import round_quota
from swajax._model_runner import StepShape


def _engine(model, **kw):
    return swajax.Engine(
        model,
        kv_config(True, max_gpu_total_bytes=None, free_gpu_memory_fraction=0.05),
        max_context=128,
        max_batch=3,
        prefill_chunk_size=16,
        max_num_tokens=48,
        implementation="reference",
        **kw,
    )


def test_quota_rounding_gives_the_same_layout_for_nearby_free_memory():
    gib = 1 << 30
    # 64 GiB <= quota < 128 GiB: steps of 2 GiB
    assert round_quota(100 * gib + 12345) == round_quota(101 * gib + (5 << 20)) == 100 * gib
    assert round_quota(3 * gib + (70 << 20)) == 3 * gib + (64 << 20)
    assert round_quota(10 << 20) == 10 << 20  # tiny quotas are kept
    assert round_quota(2 * gib - 1) <= 2 * gib - 1


def test_two_engines_of_one_model_trace_once_and_precompile_covers_the_run():
    # Steps are shared by every engine of a model structure and layout in the process: start
    # from none, whatever other tests of this worker compiled.
    _runner.step_function.cache_clear()
    model = make_model("gemma3")
    prompts = prompts_of([30, 9, 21], seed=2)
    expected = dense_greedy(model, prompts, 5)
    first = _engine(model, precompile=True)
    traced = first.trace_count
    assert traced == len(first.step_buckets())  # one per step shape, compiled up front
    assert first.run(prompts, 5)[0] == expected
    assert first.trace_count == traced  # the run compiled nothing more
    compiled = first.runner._compiled
    assert [f._cache_size() for f in compiled.values()] == [1] * len(compiled)
    second = _engine(model)
    assert second.layout == first.layout
    assert second.run(prompts, 5)[0] == expected
    assert second.trace_count == 0 and first.trace_count == traced


def test_generate_reuses_its_engine():
    model = make_model("gemma4")
    prompts = prompts_of([20, 7], seed=3)
    cfg = kv_config(True)
    swajax.generate(model, prompts, 3, kv_cache=cfg, prefill_chunk_size=16)
    engine = swajax._generate.ENGINE_CACHE.engine
    again = swajax.generate(model, prompts[:1], 2, kv_cache=cfg, prefill_chunk_size=16)
    assert swajax._generate.ENGINE_CACHE.engine is engine
    assert again == dense_greedy(model, prompts[:1], 2)
    swajax._generate.ENGINE_CACHE.clear()


def test_generate_builds_anew_when_the_model_structure_changes():
    """A static setting of the model (in its GraphDef, e.g. the MoE layers' in-place bound) is
    part of the engine's steps: a changed one gets a new engine, not the old steps."""
    from test_scan_layers import CONFIGS

    import gemma

    model = gemma.Transformer(CONFIGS["gemma4_moe"](), rngs=nnx.Rngs(3))
    prompts = prompts_of([20, 7], seed=3)
    kw = dict(kv_cache=kv_config(True), prefill_chunk_size=16)
    first = swajax.generate(model, prompts, 3, **kw)
    engine = swajax._generate.ENGINE_CACHE.engine
    gemma.set_experts_in_place_max_rows(model, 0)
    try:
        assert swajax.generate(model, prompts, 3, **kw) == first == dense_greedy(model, prompts, 3)
        assert swajax._generate.ENGINE_CACHE.engine is not engine
    finally:
        swajax._generate.ENGINE_CACHE.clear()


SCRIPT = textwrap.dedent(
    """
    import logging, sys
    sys.path.insert(0, {tests!r})
    from test_generate import make_model, prompts_of, kv_config
    import swajax
    hits = []
    class Hits(logging.Handler):
        def emit(self, record):
            if "cache hit" in record.getMessage().lower():
                hits.append(record.getMessage())
    logging.getLogger("jax._src.compilation_cache").addHandler(Hits())
    logging.getLogger("jax._src.compilation_cache").setLevel(logging.DEBUG)
    logging.getLogger("jax._src.compiler").addHandler(Hits())
    logging.getLogger("jax._src.compiler").setLevel(logging.DEBUG)
    engine = swajax.Engine(make_model("gemma3"), kv_config(True), max_context=64, max_batch=2,
                           prefill_chunk_size=16, max_num_tokens=32, implementation="reference")
    print(engine.run(prompts_of([20, 5]), 3)[0])
    print("TRACES", engine.trace_count)
    print("HITS", len(hits))
    """
)


def test_second_process_compiles_from_the_persistent_cache(tmp_path):
    env = dict(
        os.environ,
        SWAJAX_COMPILATION_CACHE="1",
        SWAJAX_COMPILATION_CACHE_DIR=str(tmp_path),
        SWAJAX_STEP_CACHE="1",
    )
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    script = SCRIPT.format(tests=str(Path(__file__).parent))
    runs = [
        subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
        ).stdout.splitlines()
        for _ in range(2)
    ]
    assert runs[0][0] == runs[1][0]  # same tokens
    assert any(tmp_path.iterdir())  # the first process filled the cache
    first_hits, second_hits = (int(r[-1].split()[-1]) for r in runs)
    assert second_hits > first_hits, (first_hits, second_hits)
    # the step cache beside it: the first process traced its steps, the second none
    first_traces, second_traces = (int(r[-2].split()[-1]) for r in runs)
    assert first_traces >= 2 and second_traces == 0, (first_traces, second_traces)
    assert len(list((tmp_path / "swajax-steps").glob("*.exported"))) == first_traces


def test_step_cache_serves_steps_without_tracing_and_updates_pools_in_place(tmp_path, monkeypatch):
    """A second engine whose in-memory steps are gone (as in a new process) loads the exported
    steps the first one stored: no trace, the dense forward's greedy tokens, the pool roots
    still donated and updated in place; a changed key (another layout) exports anew."""
    monkeypatch.setenv("SWAJAX_STEP_CACHE", "1")
    monkeypatch.setenv("SWAJAX_STEP_CACHE_DIR", str(tmp_path))
    model = make_model("gemma4")
    prompts = prompts_of([30, 9, 21], seed=4)
    expected = dense_greedy(model, prompts, 5)
    swajax._runner.step_function.cache_clear()
    try:
        first = _engine(model)
        assert first.run(prompts, 5)[0] == expected
        compiled = first.runner._compiled
        assert [f._cache_size() for f in compiled.values()] == [1] * len(compiled)
        traced = first.trace_count
        stored = sorted(tmp_path.glob("*.exported"))
        assert traced >= 2 and len(stored) == traced
        swajax._runner.step_function.cache_clear()  # the in-memory steps of this process
        second = _engine(model)
        pools = second.state.pools
        before = [p.unsafe_buffer_pointer() for p in pools]
        assert second.run(prompts, 5)[0] == expected
        assert second.trace_count == 0
        # one executable per variant: the first step's inputs are committed like the later ones
        assert [f._cache_size() for f in second.runner._compiled.values()] == [1] * len(
            second.runner._compiled
        )
        assert [p.unsafe_buffer_pointer() for p in second.state.pools] == before
        assert all(p.is_deleted() for p in pools)  # donated
        assert sorted(tmp_path.glob("*.exported")) == stored
        # lowering for another platform bypasses the cache (it stores this backend's steps)
        second.lower_step(16, decode=False, lowering_platforms=("cuda",)).as_text()
        assert sorted(tmp_path.glob("*.exported")) == stored
        with _checks.force_interpret():  # a forced Pallas mode: not cached either
            step = second.runner._step_function(StepShape(16, False, False, "greedy"))
            args = second.runner.step_args(16)
            assert _step_cache.resolve(step, args) is step.jitted
        third = swajax.Engine(
            model,
            kv_config(True, max_gpu_total_bytes=None, free_gpu_memory_fraction=0.05),
            max_context=128,
            max_batch=2,  # another layout: other steps
            prefill_chunk_size=16,
            max_num_tokens=48,
            implementation="reference",
        )
        assert third.run(prompts[:2], 5)[0] == expected[:2]
        assert third.trace_count >= 2
        assert len(list(tmp_path.glob("*.exported"))) == len(stored) + third.trace_count
    finally:
        swajax._runner.step_function.cache_clear()


def test_a_step_loaded_for_the_gpu_imports_the_mosaic_gpu_runtime():
    """A process that loads its steps from the step cache lowers no Pallas kernel, so nothing
    else imports `jax.experimental.mosaic.gpu`, which points Mosaic GPU's custom calls at their
    runtime library (without it the first GPU step fails: "Symbols not found"). A fresh
    process: swajax alone does not import it, loading a CUDA step does."""
    script = textwrap.dedent(
        """
        import sys
        import jax, jax.numpy as jnp
        from swajax import _runner, _step_cache
        spec = jax.ShapeDtypeStruct((4,), jnp.float32)
        for platform in ("cpu", "cuda"):
            exported = jax.export.export(jax.jit(lambda x: x + 1), platforms=(platform,))(spec)
            _step_cache.call_exported(exported, jax.tree.structure(0), (), {})
            print(platform, "jax.experimental.mosaic.gpu" in sys.modules)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    ).stdout.split()
    assert out == ["cpu", "False", "cuda", "True"], out


def test_step_cache_is_on_by_default_and_off_with_zero(tmp_path, monkeypatch):
    monkeypatch.delenv("SWAJAX_STEP_CACHE", raising=False)
    monkeypatch.setenv("SWAJAX_STEP_CACHE_DIR", str(tmp_path))
    assert _step_cache.cache_dir() == tmp_path
    for off in ("0", "off", "False"):
        monkeypatch.setenv("SWAJAX_STEP_CACHE", off)
        assert _step_cache.cache_dir() is None
    monkeypatch.setenv("SWAJAX_STEP_CACHE", "1")
    assert _step_cache.cache_dir() == tmp_path
