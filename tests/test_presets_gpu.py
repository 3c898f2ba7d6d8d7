"""Every preset generates on the GPU through the Pallas kernels (`gpu` tests).

Each preset runs as `gemma.configs.small_preset` (the real attention geometry, KV sharing,
K=V, PLE and MoE; width, MLP and vocabulary shrunk) with bf16 weights and a bf16 KV pool.
Ragged prompts longer than the sliding window are prefilled in chunks larger than the window,
then decoded; `Engine(implementation="pallas")` with scratch reuse on and off must give the
greedy tokens of `implementation="reference"` up to near ties.

Oracle: the reference attention on bf16-rounded queries (the kernels feed queries to WGMMA in
bf16; `tests/test_generate.py::_round_queries_to_bf16`). The q-norm scales are set so that the
attention logits are unit-size, as in a trained model (random Gemma 4 weights at attention
scale 1 give near one-hot softmaxes that amplify any rounding; see the Gemma 4 test there).
MoE presets route every token to the same experts (a zero router; `fixed_routing`): a random
router's top-k margins reach 6e-7 (gemma4_26b_a4b's prompts here), below the rounding of any
two float32 implementations, and a flipped expert changes a token's output by O(1), so the
reference on the GPU and on the CPU already disagree. The kernels under test are attention,
KV write and gather; routing is checked against Hugging Face in the CPU parity tests, the
grouped matmul on skewed groups in `test_grouped_matmul.py`.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_generate import _logits_by_token, _round_queries_to_bf16

import gemma
import swajax
import swajax._runner

MAX_NEW = 6


@functools.cache
def preset_model(name: str):
    config = gemma.configs.small_preset(name)
    model = gemma.Transformer(
        config, rngs=nnx.Rngs(11), dtype=jnp.float32, param_dtype=jnp.bfloat16
    )
    gemma.set_unit_size_attention_logits(model)
    fixed_routing(model)
    return model


def fixed_routing(model) -> None:
    """Zero router weights: equal scores, so `lax.top_k` takes the lowest expert ids for every
    token on any backend (ties go to the lower index), with equal weights. In place."""
    for blocks in model.blocks:
        for block in blocks:
            if block.moe is not None:
                block.moe.router_proj[...] = jnp.zeros_like(block.moe.router_proj[...])


def preset_prompts(config, seed: int):
    w = config.sliding_window
    rng = np.random.default_rng(seed)
    lengths = [w + 300, 2 * w + 77, 150]
    return [rng.integers(1, config.vocab_size, size=n).tolist() for n in lengths]


def make_engine(model, prompts, *, implementation, scratch):
    config = model.config
    chunk = config.sliding_window + 512  # larger than the window: scratch is used
    kv = swajax.KVCacheConfig(
        page_size=32,
        dtype=jnp.bfloat16,
        enable_swa_scratch_reuse=scratch,
        max_gpu_total_bytes=256 << 20,
    )
    longest = max(len(p) for p in prompts) + MAX_NEW
    engine = swajax.Engine(
        model,
        kv,
        max_context=-(-longest // 512) * 512,
        max_batch=len(prompts),
        prefill_chunk_size=chunk,
        implementation=implementation,
        min_prefill_bucket=len(prompts) * chunk,  # one prefill variant
    )
    return engine


def generate(model, prompts, *, implementation, scratch):
    engine = make_engine(model, prompts, implementation=implementation, scratch=scratch)
    outputs, stats = engine.run(prompts, MAX_NEW, collect_logits=True)
    return outputs, _logits_by_token(stats)


def assert_same_up_to_near_ties(want_tokens, want_logits, got_tokens, got_logits):
    """Token by token until the first difference, which must be a near tie of the oracle."""
    compared = 0
    for i, (want, got) in enumerate(zip(want_tokens, got_tokens, strict=True)):
        for k in range(len(want)):
            w, g = np.asarray(want_logits[i, k]), np.asarray(got_logits[i, k])
            rel = np.linalg.norm(g - w) / np.linalg.norm(w)
            assert rel < 2e-2, (i, k, rel)
            compared += 1
            if got[k] != want[k]:
                top2 = np.sort(w)[-2:]
                assert top2[1] - top2[0] < 0.05 * max(1.0, abs(top2[1])), (i, k, top2)
                break
    assert compared >= len(want_tokens) * 3


@pytest.mark.gpu
@pytest.mark.parametrize("name", gemma.configs.PRESET_NAMES)
def test_preset_generates_with_pallas_kernels(name, monkeypatch):
    model = preset_model(name)
    prompts = preset_prompts(model.config, seed=len(name))
    with monkeypatch.context() as patch:
        _round_queries_to_bf16(patch)
        try:
            ref_tokens, ref_logits = generate(
                model, prompts, implementation="reference", scratch=True
            )
        finally:
            swajax._runner.step_function.cache_clear()  # no patched step outlives this
    for scratch in (True, False):
        tokens, logits = generate(model, prompts, implementation="pallas", scratch=scratch)
        assert_same_up_to_near_ties(ref_tokens, ref_logits, tokens, logits)


@pytest.mark.gpu
def test_steps_compile_without_rematerialization_under_memory_pressure(monkeypatch):
    """XLA's memory limit forced to zero (`xla_gpu_memory_limit_slop_factor=0`: every program
    is over it, as a full-size model plus its KV pool nearly was): the steps still compile
    without rematerialization clones (they once read the donated page tables after the step
    had updated them; `swajax._runner.STEP_COMPILER_OPTIONS`), the device holds the slots the
    ledger planned (the engine checks every step) and the tokens equal the default compile's."""
    model = preset_model("gemma4_31b")
    prompts = preset_prompts(model.config, seed=3)
    engine = make_engine(model, prompts, implementation="pallas", scratch=True)
    want, _ = engine.run(prompts, MAX_NEW)
    options = {**swajax._runner.STEP_COMPILER_OPTIONS, "xla_gpu_memory_limit_slop_factor": 0}
    monkeypatch.setattr(swajax._runner, "STEP_COMPILER_OPTIONS", options)
    swajax._runner.step_function.cache_clear()
    try:
        engine = make_engine(model, prompts, implementation="pallas", scratch=True)
        got, _ = engine.run(prompts, MAX_NEW)
        assert got == want
        assert engine.runner.ran
        for num_tokens, decode, logits, mode in engine.runner.ran:
            text = engine.runner.lower(num_tokens, decode, mode, logits=logits).compile()
            text = text.as_text()
            assert ".remat" not in text, (num_tokens, decode)
    finally:
        swajax._runner.step_function.cache_clear()
