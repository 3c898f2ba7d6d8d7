"""`swajax.generate` and the paged forward against the dense (cache-free) model.

The oracle is the dense forward `model(tokens)` run on the whole sequence each step
(greedy), which shares no code with the pool, the page tables or the paged kernels.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import gemma
import swajax
import swajax._runner

VOCAB = 128


def tiny_gemma3(**kw):
    base = dict(
        num_layers=7,
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        sliding_window=16,
        max_context=512,
    )
    base.update(kw)
    return gemma.configs.gemma3_1b(**base)


def tiny_gemma4(**kw):
    base = dict(
        num_layers=8,
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        global_head_dim=32,
        num_global_kv_heads=1,
        sliding_window=16,
        num_kv_shared_layers=3,
        per_layer_input_dim=8,
        max_context=512,
    )
    base.update(kw)
    return gemma.configs.gemma4_e2b(**base)


@functools.cache
def make_model(family: str):
    config = tiny_gemma3() if family == "gemma3" else tiny_gemma4()
    return gemma.Transformer(config, rngs=nnx.Rngs(7), dtype=jnp.float32)


def dense_greedy(model, prompts, max_new_tokens, *, with_logits=False):
    """Greedy generation by re-running the dense forward over the padded sequence.

    With `with_logits`, also returns {(prompt index, k): logits f32[V] that chose token k}.
    """
    longest = max(len(p) for p in prompts) + max_new_tokens
    graphdef, params = nnx.split(model)
    forward = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))
    outs, step_logits = [], {}
    for i, prompt in enumerate(prompts):
        seq = list(prompt)
        for k in range(max_new_tokens):
            padded = np.zeros((1, longest), np.int32)
            padded[0, : len(seq)] = seq
            logits = np.asarray(forward(params, jnp.asarray(padded))[0, len(seq) - 1])
            step_logits[i, k] = logits
            seq.append(int(np.argmax(logits)))
        outs.append(seq[len(prompt) :])
    return (outs, step_logits) if with_logits else outs


def prompts_of(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, VOCAB, size=n).tolist() for n in lengths]


def kv_config(scratch, **kw):
    return swajax.KVCacheConfig(
        page_size=kw.pop("page_size", 16),
        dtype=kw.pop("dtype", jnp.float32),
        enable_swa_scratch_reuse=scratch,
        max_gpu_total_bytes=kw.pop("max_gpu_total_bytes", 64 << 20),
        **kw,
    )


def run_engine(
    model,
    prompts,
    max_new,
    *,
    scratch,
    chunk,
    max_batch=None,
    collect=False,
    implementation="reference",
    poison=True,
    engine_kw=None,
    **kw,
):
    max_batch = max_batch or len(prompts)
    engine = swajax.Engine(
        model,
        kv_config(scratch, **kw),
        max_context=128,
        max_batch=max_batch,
        prefill_chunk_size=chunk,
        implementation=implementation,
        min_prefill_bucket=max_batch * chunk,
        **(engine_kw or {}),
    )
    if poison:
        # Every page starts as NaN: a read of a page nobody wrote this run poisons the logits.
        # The Pallas kernels read whole pages and need finite values in the rows they mask
        # (their contract; pools start zeroed and reused pages hold old finite K/V), so they
        # get large finite garbage instead: an unmasked read of it still wrecks the logits.
        fill = jnp.nan if implementation == "reference" else 300.0
        engine.state = dataclasses.replace(
            engine.state, pools=tuple(jnp.full_like(p, fill) for p in engine.state.pools)
        )
    outputs, stats = engine.run(prompts, max_new, collect_logits=collect)
    return engine, outputs, stats


def _logits_by_token(stats):
    return {(i, k): logit for i, k, logit in stats.step_logits}


# Ragged prompts longer than the window (16), decode past the window; chunk below, equal to
# and above the window; Gemma 3 and Gemma 4 with KV sharing and per-layer embeddings.
CASES = [
    ("gemma3", 16, [40, 23, 9]),
    ("gemma4", 8, [37, 20, 5]),
    ("gemma4", 64, [100, 17]),
]


@pytest.mark.parametrize("family, chunk, lengths", CASES)
def test_scratch_on_off_parity_and_dense_oracle(family, chunk, lengths):
    model = make_model(family)
    prompts = prompts_of(lengths, seed=chunk)
    max_new = 7
    expected, dense_logits = dense_greedy(model, prompts, max_new, with_logits=True)
    runs = {}
    for scratch in (False, True):
        # Prefix caching off: its rewind pages (two past the window) never go to scratch,
        # and at a window of 16 they would take the saving the last assertion checks.
        engine, outputs, stats = run_engine(
            model,
            prompts,
            max_new,
            scratch=scratch,
            chunk=chunk,
            collect=True,
            engine_kw=dict(enable_prefix_caching=False),
        )
        assert engine.layout.scratch is scratch
        assert outputs == expected, f"scratch={scratch}: paged greedy differs from dense greedy"
        # One prefill variant, one decode variant: decode steps never recompile.
        assert engine.trace_count == 2, engine.trace_count
        # Every slot is back on the free stacks after the run.
        engine.clear_prefix_cache()  # parked prefixes hold slots by design
        np.testing.assert_array_equal(np.asarray(engine.state.free_count), engine.num_slots)
        runs[scratch] = stats
    off, on = (_logits_by_token(runs[s]) for s in (False, True))
    assert off.keys() == on.keys() == dense_logits.keys()
    for key in off:
        np.testing.assert_allclose(on[key], off[key], rtol=1e-5, atol=1e-5)
        # The paged forward equals the dense forward (float32; different summation order).
        np.testing.assert_allclose(on[key], dense_logits[key], rtol=1e-4, atol=1e-4)
    # Scratch never holds more, and is not inert once a chunk outgrows the window (16) by a
    # page: the sliding group holds fewer slots over the run with it on.
    on_stats, off_stats = runs[True], runs[False]
    assert all(a <= b for a, b in zip(on_stats.peak_slots, off_stats.peak_slots, strict=True))
    if chunk >= 32:
        assert on_stats.slot_steps[0] < off_stats.slot_steps[0], (
            on_stats.slot_steps,
            off_stats.slot_steps,
        )


def test_batch_larger_than_pool_is_served_in_waves():
    model = make_model("gemma3")
    prompts = prompts_of([30, 25, 33, 12, 28], seed=3)
    expected = dense_greedy(model, prompts, 4)
    probe = swajax.Engine(
        model, kv_config(True), max_context=128, max_batch=5, prefill_chunk_size=16
    )
    need = np.asarray(swajax.pool.request_slots(probe.layout, 33, chunk=16, max_new_tokens=3))
    slot_bytes = [probe.layout.slot_bytes(g) for g in range(len(need))]
    # Room for about two requests at a time.
    quota = int(sum(2 * n * b for n, b in zip(need, slot_bytes, strict=True)) * 1.05)
    ratio = tuple(float(n * b) for n, b in zip(need, slot_bytes, strict=True))
    engine, outputs, stats = run_engine(
        model,
        prompts,
        4,
        scratch=True,
        chunk=16,
        max_batch=5,
        max_gpu_total_bytes=quota,
        pool_ratio=ratio,
    )
    assert outputs == expected
    assert 1 <= stats.max_concurrent < len(prompts)
    # Jit replay: the same engine serves the batch again from its compiled steps, identically.
    traces = engine.trace_count
    again, _ = engine.run(prompts, 4)
    assert again == expected and engine.trace_count == traces
    assert all(p <= n for p, n in zip(stats.peak_slots, stats.num_slots, strict=True))


def test_generate_public_entry_point_and_sampling():
    model = make_model("gemma3")
    prompts = prompts_of([20, 6], seed=5)
    cfg = kv_config(None)
    greedy = swajax.generate(model, prompts, 3, kv_cache=cfg, prefill_chunk_size=16)
    assert greedy == dense_greedy(model, prompts, 3)
    # A second call with the same shapes reuses the compiled steps.
    traces = sum(swajax._runner._TRACES.values())
    again = swajax.generate(model, prompts, 3, kv_cache=cfg, prefill_chunk_size=16)
    assert again == greedy and sum(swajax._runner._TRACES.values()) == traces
    sampling = swajax.SamplingParams(temperature=1.0, top_k=20, top_p=0.9)
    a = swajax.generate(model, prompts, 3, kv_cache=cfg, sampling=sampling, seed=1)
    b = swajax.generate(model, prompts, 3, kv_cache=cfg, sampling=sampling, seed=1)
    assert a == b  # an explicit seed reproduces the draw
    assert all(len(o) == 3 and all(0 <= t < VOCAB for t in o) for o in a)


@pytest.mark.parametrize(
    "prompts, max_new, match",
    [
        ([], 4, "empty"),
        ([[1, 2], []], 4, "prompt 1 is empty"),
        ([[1, VOCAB + 3]], 4, r"outside \[0, 128\)"),
        ([[1, -1]], 4, "outside"),
        ([[1] * 500], 20, "exceeds the model's context of 512"),
        ([[1, 2]], 0, "max_new_tokens"),
    ],
)
def test_bad_input_raises_value_error(prompts, max_new, match):
    with pytest.raises(ValueError, match=match):
        swajax.generate(make_model("gemma3"), prompts, max_new, kv_cache=kv_config(True))


def test_pool_too_small_for_one_sequence_raises():
    with pytest.raises(ValueError, match="slots"):
        swajax.generate(
            make_model("gemma3"),
            [[1] * 100],
            10,
            kv_cache=kv_config(True, max_gpu_total_bytes=40_000),
        )


@pytest.mark.parametrize(
    "implementation, kv_dtype",
    [("reference", jnp.float32), pytest.param("pallas", jnp.bfloat16, marks=pytest.mark.gpu)],
)
@pytest.mark.parametrize("step_cache", [False, True], ids=["jit", "step_cache"])
def test_compiled_step_updates_pool_roots_in_place(
    implementation, kv_dtype, step_cache, tmp_path, monkeypatch
):
    """The step donates the pool state: its HLO aliases every pool root and copies none, also
    with the layers under `lax.scan` (the pools are the scan's carry), the Pallas kernels
    writing them, and the step read back from the step cache (exported by one engine, loaded
    by the next, as in a new process)."""
    model = make_model("gemma4")
    if implementation == "pallas":  # the kernels' head dims
        config = tiny_gemma4(head_dim=128, global_head_dim=256, hidden_size=128)
        model = gemma.Transformer(config, rngs=nnx.Rngs(3), dtype=jnp.float32)
    assert any(run.scanned for run in model.layer_runs)

    def make_engine():
        return swajax.Engine(
            model,
            kv_config(True, max_gpu_total_bytes=32 << 20, dtype=kv_dtype),
            max_context=512,
            max_batch=2,
            prefill_chunk_size=32,
            implementation=implementation,
        )

    swajax._runner.step_function.cache_clear()
    if step_cache:
        monkeypatch.setenv("SWAJAX_STEP_CACHE", "1")
        monkeypatch.setenv("SWAJAX_STEP_CACHE_DIR", str(tmp_path))
        for num_tokens, decode in ((64, False), (8, True)):  # exported and stored
            make_engine().lower_step(num_tokens, decode=decode)
        assert len(list(tmp_path.glob("*.exported"))) == 2
        swajax._runner.step_function.cache_clear()
    engine = make_engine()
    pools = engine.state.pools
    dtype = {jnp.dtype(jnp.float32): "f32", jnp.dtype(jnp.bfloat16): "bf16"}
    root_shapes = [f"{dtype[p.dtype]}[{','.join(map(str, p.shape))}]" for p in pools]
    for decode, num_tokens in ((False, 64), (True, 8)):
        hlo = engine.lower_step(num_tokens, decode=decode).compile().as_text()
        copies = [
            line
            for line in hlo.splitlines()
            if "copy(" in line and any(f"= {s}" in line for s in root_shapes)
        ]
        assert not copies, copies
        assert "input_output_alias" in hlo
    if step_cache:
        assert engine.trace_count == 0  # both steps above came from the cache
    before = [p.unsafe_buffer_pointer() for p in pools]
    engine.run([[1, 2, 3, 4, 5]], 2)
    assert [p.unsafe_buffer_pointer() for p in engine.state.pools] == before
    swajax._runner.step_function.cache_clear()


def test_fp8_kv_within_tolerance_of_float32():
    """fp8 (e4m3) KV: the same greedy run's logits stay within 5% (relative L2) of float32 KV."""
    model = make_model("gemma3")
    prompts = prompts_of([30, 12], seed=11)

    def logits(dtype):
        cfg = swajax.KVCacheConfig(
            page_size=16, dtype=dtype, enable_swa_scratch_reuse=True, max_gpu_total_bytes=16 << 20
        )
        engine = swajax.Engine(
            model,
            cfg,
            max_context=64,
            max_batch=2,
            prefill_chunk_size=16,
            implementation="reference",
            min_prefill_bucket=32,
        )
        _, stats = engine.run(prompts, 1, collect_logits=True)
        return np.stack([x for *_, x in sorted(stats.step_logits, key=lambda r: r[:2])])

    ref, fp8 = logits(jnp.float32), logits(jnp.float8_e4m3fn)
    rel = np.linalg.norm(fp8 - ref) / np.linalg.norm(ref)
    assert 0 < rel < 0.05, rel


def _round_queries_to_bf16(patch):
    """The paged forward's attention sees its queries rounded to bf16 (then widened back)."""
    import swajax._paged as paged

    for name in ("ragged_paged_attention", "paged_decode_attention"):
        fn = getattr(paged, name)

        def rounded(q, *args, _fn=fn, **kwargs):
            return _fn(q.astype(jnp.bfloat16).astype(q.dtype), *args, **kwargs)

        patch.setattr(paged, name, rounded)
    swajax._runner.step_function.cache_clear()


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["gemma3", "gemma4"])
def test_pallas_generation_matches_reference_on_gpu(family, monkeypatch):
    """The Mosaic GPU kernels (decode, prefill, KV write) inside generation, bf16 KV.

    The kernels feed the queries to WGMMA in the KV compute dtype (bf16), so the oracle is the
    reference attention on bf16-rounded queries.

    Gemma 4 attends at scale 1 and relies on trained q-norm weights for the logits' size. With
    the initial weights (1) the logits of head_dim 128-256 have a spread of ~11-16, every
    softmax is near one-hot and the random model is chaotic: rounding q alone moved its logits
    by 8-16 % (relative L2) and a bf16 P by as much. The q-norm scales are set to 1/sqrt(D)
    (unit-size logits, as a trained model has); rounding q then moves the logits by 0.2-0.5 %.
    """
    kw = dict(head_dim=128, num_heads=4, num_kv_heads=2, hidden_size=128)
    if family == "gemma4":
        kw.update(global_head_dim=256)
        config = tiny_gemma4(**kw)
    else:
        config = tiny_gemma3(**kw)
    model = gemma.Transformer(config, rngs=nnx.Rngs(3), dtype=jnp.float32)
    if family == "gemma4":
        for blocks in model.blocks:
            for block in blocks:
                norm = block.attn.q_norm
                norm.scale[...] = jnp.full_like(norm.scale[...], norm.scale.shape[-1] ** -0.5)
    prompts = prompts_of([100, 37, 64], seed=2)
    runs = {}
    for impl in ("reference", "pallas"):
        with monkeypatch.context() as patch:
            if impl == "reference":
                _round_queries_to_bf16(patch)
            try:
                _, outputs, stats = run_engine(
                    model,
                    prompts,
                    6,
                    scratch=True,
                    chunk=64,
                    collect=True,
                    implementation=impl,
                    page_size=32,
                    dtype=jnp.bfloat16,
                )
            finally:
                swajax._runner.step_function.cache_clear()  # no patched step outlives the test
        runs[impl] = (outputs, _logits_by_token(stats))
    (ref_tokens, ref), (pallas_tokens, pallas) = runs["reference"], runs["pallas"]
    assert len(ref_tokens) == len(pallas_tokens) == len(prompts)
    compared = 0
    for i, (want, got) in enumerate(zip(ref_tokens, pallas_tokens, strict=True)):
        # Teacher forcing ends at the first differing token: the kernels' bf16 rounding may
        # flip a near tie (then the reference's top-2 margin must be small), never more.
        for k in range(len(want)):
            np.testing.assert_allclose(
                pallas[i, k], ref[i, k], rtol=2e-2, atol=2e-2, err_msg=f"sequence {i} token {k}"
            )
            compared += 1
            if got[k] != want[k]:
                row = np.asarray(ref[i, k], np.float32)
                top2 = np.sort(row)[-2:]
                assert top2[1] - top2[0] < 0.05, (i, k, top2)
                assert row[got[k]] >= top2[1] - 0.05, (i, k, got[k])
                break
    assert compared >= len(prompts) * 3


@pytest.mark.parametrize("family", ["gemma4", "gemma3"])
def test_cached_prefix_reuse_with_scratch_on_and_off(family):
    """Prompts sharing a 40-token prefix: the first parks 32 tokens (two blocks), the others
    start from them. Tokens equal dense greedy, logits equal the dense forward's and match
    between scratch ON and OFF; every slot returns once the prefix cache is cleared."""
    model = make_model(family)
    rng = np.random.default_rng(4)
    shared = rng.integers(1, VOCAB, size=40).tolist()
    prompts = [shared + rng.integers(1, VOCAB, size=n).tolist() for n in (15, 9, 20)]
    expected, dense_logits = dense_greedy(model, prompts, 5, with_logits=True)
    logits = {}
    for scratch in (False, True):
        engine = swajax.Engine(
            model,
            kv_config(scratch),
            max_context=128,
            max_batch=1,
            prefill_chunk_size=32,  # > window: the first chunk of the prefix is scratch-backed
            implementation="reference",
            min_prefill_bucket=32,
        )
        outputs, stats = engine.run(prompts, 5, collect_logits=True)
        assert outputs == expected
        assert (stats.prefix_hits, stats.prefix_tokens) == (2, 64)
        logits[scratch] = _logits_by_token(stats)
        for key, value in logits[scratch].items():
            np.testing.assert_allclose(value, dense_logits[key], rtol=1e-4, atol=1e-4)
        assert engine.trace_count == 2
        engine.clear_prefix_cache()
        np.testing.assert_array_equal(np.asarray(engine.state.free_count), engine.num_slots)
    for key in logits[False]:
        np.testing.assert_allclose(logits[True][key], logits[False][key], rtol=1e-5, atol=1e-5)


def test_shared_page_table_mode_generates_dense_greedy_tokens():
    """page_table_mode="shared" (one table per pool, rebuilt every step, none carried between
    steps): several prefill and decode steps give the dense forward's greedy tokens."""
    model = make_model("gemma3")
    prompts = prompts_of([30, 9, 21], seed=4)
    engine = swajax.Engine(
        model,
        kv_config(False, page_table_mode="shared"),
        max_context=128,
        max_batch=3,
        prefill_chunk_size=16,
        max_num_tokens=48,
        implementation="reference",
    )
    assert engine.layout.page_table_mode == "shared"
    out, stats = engine.run(prompts, 5)
    assert out == dense_greedy(model, prompts, 5) and stats.steps > 2
