"""Logits of `gemma` against Hugging Face transformers (float32, relative error <= 1e-4).

The fixture cases in tests/fixtures/hf/ always run; the live twin builds the
same kinds of models with torch + transformers when both import (Python 3.12
on the GPU machine) and is skipped elsewhere.
"""

import functools
import json
from pathlib import Path

import chex
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import gemma

HF_CASES_DIR = Path(__file__).parent / "fixtures" / "hf"
# Text models; the Gemma 4 assistants (model_type gemma4_assistant) have their own oracle
# format and test (tests/test_gemma_assistant.py).
HF_CASES = sorted(
    p.name
    for p in HF_CASES_DIR.iterdir()
    if (p / "oracle.npz").exists()
    and json.loads((p / "config.json").read_text()).get("model_type") != "gemma4_assistant"
)
RTOL = 1e-4


def assert_logits_close(actual, expected, what: str) -> None:
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    chex.assert_equal_shape([actual, expected])
    rel = np.linalg.norm(actual - expected) / np.linalg.norm(expected)
    max_abs = np.max(np.abs(actual - expected))
    assert rel <= RTOL, f"{what}: relative error {rel:.3e} > {RTOL:g} (max abs error {max_abs:.3e})"


@functools.cache
def load_case(case: str):
    oracle = np.load(HF_CASES_DIR / case / "oracle.npz")
    model = gemma.from_pretrained(HF_CASES_DIR / case, dtype=jnp.float32)
    return model, oracle["input_ids"], oracle["logits"]


def test_fixture_cases_present():
    assert {
        "gemma3_linear",
        "gemma3_sharded",
        "gemma3_cond",
        "gemma4_ple_shared",
        "gemma4_keqv",
        "gemma4_moe",
        "gemma4_cond",
    } <= set(HF_CASES)


@pytest.mark.parametrize("case", HF_CASES)
def test_logits_match_hf(case):
    model, input_ids, expected = load_case(case)
    assert_logits_close(model(jnp.asarray(input_ids)), expected, case)


def test_packed_one_sequence_matches_batched_hf():
    """Packed tokens i32[T] of one sequence give the logits of that row of the batch."""
    model, input_ids, expected = load_case("gemma3_linear")
    assert_logits_close(model(jnp.asarray(input_ids[0])), expected[0], "packed one sequence")


def test_packed_two_sequences_match_hf():
    """Two sequences packed in one row (positions restart, segment ids apart) match HF's rows."""
    model, input_ids, expected = load_case("gemma4_ple_shared")
    t = input_ids.shape[1]
    tokens = jnp.asarray(np.concatenate([input_ids[0], input_ids[1, : t // 2]]))
    positions = jnp.asarray(np.concatenate([np.arange(t), np.arange(t // 2)]), jnp.int32)
    segments = jnp.asarray(np.repeat([0, 1], [t, t // 2]), jnp.int32)
    both = model(tokens, positions, segment_ids=segments)  # [T + T/2, V]
    assert_logits_close(both[:t], expected[0], "packed first sequence")
    assert_logits_close(both[t:], expected[1, : t // 2], "packed second sequence")


def test_dense_moe_reference_matches_hf():
    """The all-experts MoE reference agrees with HF as the default ragged path does."""
    _, input_ids, expected = load_case("gemma4_moe")
    model = gemma.from_pretrained(HF_CASES_DIR / "gemma4_moe", moe_implementation="dense")
    assert model.layer_block(0)[0].moe.implementation == "dense"
    assert_logits_close(model(jnp.asarray(input_ids)), expected, "dense MoE")
    with pytest.raises(ValueError, match="moe_implementation must be one of"):
        gemma.Transformer(model.config, rngs=nnx.Rngs(0), moe_implementation="sparse")


def test_logits_indices_select_tokens():
    """forward(logits_indices=...) returns HF's logits of the chosen tokens, batched and packed."""
    model, input_ids, expected = load_case("gemma3_linear")
    tokens = jnp.asarray(input_ids)
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    fn = gemma.dense_attention_fn(model.config.layer_specs)
    rows = np.array([[t - 1, 3], [0, 17]])
    logits, _ = model.forward(
        tokens,
        positions,
        attention_fn=fn,
        attention_state=gemma.DenseAttentionState(positions=positions),
        logits_indices=jnp.asarray(rows),
    )
    assert_logits_close(logits, np.take_along_axis(expected, rows[..., None], 1), "batched")
    logits, _ = model.forward(
        tokens[1],
        positions[1],
        attention_fn=fn,
        attention_state=gemma.DenseAttentionState(positions=positions[1]),
        logits_indices=jnp.array([t - 1]),
    )
    assert_logits_close(logits, expected[1, -1:], "packed")


def test_offset_positions_match_hf():
    """Shifting every position leaves the logits unchanged (RoPE and masks are relative)."""
    model, input_ids, expected = load_case("gemma4_keqv")
    positions = jnp.broadcast_to(jnp.arange(input_ids.shape[1]) + 1000, input_ids.shape)
    shifted = model(jnp.asarray(input_ids), positions)
    rel = np.linalg.norm(np.asarray(shifted) - expected) / np.linalg.norm(expected)
    assert rel <= 1e-3, rel


@pytest.mark.parametrize("scan_layers", [True, False])
def test_attention_hook_sees_every_layer_with_hf_geometry(scan_layers):
    """forward() calls attention_fn for every layer, in order, with each layer's q/k/v shapes:
    once per layer unrolled; inside a scanned run once per position of the period, standing for
    that position in every repetition."""
    _, input_ids, expected = load_case("gemma4_ple_shared")
    model = gemma.from_pretrained(
        HF_CASES_DIR / "gemma4_ple_shared", dtype=jnp.float32, scan_layers=scan_layers
    )
    config = model.config
    dense = gemma.dense_attention_fn(config.layer_specs)
    runs = {i: run for run in model.layer_runs for i in run.layers}
    calls = []

    def recording_fn(layer, q, k, v, state):
        run = runs[layer.like]
        if isinstance(layer.index, int):
            assert layer.index == layer.like and not run.scanned
            layers = [layer.like]
        else:  # traced: the position `like` of every repetition of the run
            assert run.scanned and layer.like < run.first + run.period
            layers = list(range(layer.like, run.stop, run.period))
        kv = (None if k is None else k.shape, None if v is None else v.shape)
        calls.extend((i, q.shape, *kv) for i in layers)
        return dense(layer, q, k, v, state)

    tokens = jnp.asarray(input_ids)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    state = gemma.DenseAttentionState(positions=positions)
    forward = nnx.jit(
        lambda m, t, p, s: m.forward(t, p, attention_fn=recording_fn, attention_state=s)[0]
    )
    logits = forward(model, tokens, positions, state)  # the hook runs while tracing
    assert_logits_close(logits, expected, "forward with recording hook")
    b, t = tokens.shape
    # The HF case: 8 layers S S S F S S S F, head_dim 16 / 32, 1 KV head, last 3 layers shared.
    assert sorted(c[0] for c in calls) == list(range(8))
    if scan_layers:  # the writer layers 0-2 are one scanned run
        assert [(r.first, r.period, r.count) for r in model.layer_runs][0] == (0, 1, 3)
    else:
        assert [c[0] for c in calls] == list(range(8))
    for i, q_shape, k_shape, v_shape in calls:
        h = 32 if i in (3, 7) else 16
        assert q_shape == (b, t, 4, h)
        if i >= 5:
            assert k_shape is None and v_shape is None
        else:
            assert k_shape == v_shape == (b, t, 1, h)


# --------------------------------------------------------------- live twin


def _randomise(model, torch):
    """Norm scales, layer scalars and router scales away from their init (all tiny models)."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(("router.scale", "per_expert_scale")):
                p.copy_(p + 0.3 * torch.randn(p.shape, generator=gen))
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(0.75 + 0.5 * torch.rand(b.shape, generator=gen))


def _live_models(transformers):
    common = dict(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        num_attention_heads=4,
        head_dim=8,
        sliding_window=6,
        max_position_embeddings=256,
        attn_implementation="eager",
    )
    g3 = transformers.Gemma3TextConfig(
        **common,
        num_hidden_layers=5,
        num_key_value_heads=2,
        query_pre_attn_scalar=12,
        sliding_window_pattern=3,
        rope_scaling={"rope_type": "linear", "factor": 4.0},
    )
    g4 = dict(common, global_head_dim=16, final_logit_softcapping=30.0, num_key_value_heads=2)
    return {
        "gemma3": transformers.Gemma3ForCausalLM(g3),
        "gemma4_ple_shared": transformers.Gemma4ForCausalLM(
            transformers.Gemma4TextConfig(
                **g4,
                num_hidden_layers=6,
                layer_types=["sliding_attention"] * 2
                + ["full_attention"]
                + ["sliding_attention"] * 2
                + ["full_attention"],
                hidden_size_per_layer_input=4,
                vocab_size_per_layer_input=96,
                num_kv_shared_layers=3,
                use_double_wide_mlp=True,
            )
        ),
        "gemma4_moe_keqv": transformers.Gemma4ForCausalLM(
            transformers.Gemma4TextConfig(
                **g4,
                num_hidden_layers=4,
                hidden_size_per_layer_input=0,
                attention_k_eq_v=True,
                num_global_key_value_heads=1,
                enable_moe_block=True,
                num_experts=4,
                top_k_experts=2,
                moe_intermediate_size=8,
            )
        ),
    }


def test_live_hf_models(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    for name, hf_model in _live_models(transformers).items():
        _randomise(hf_model, torch)
        hf_model.eval()
        hf_model.save_pretrained(tmp_path / name)
        ids = torch.randint(3, 96, (2, 20), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            expected = hf_model(input_ids=ids).logits.float().numpy()
        model = gemma.from_pretrained(tmp_path / name, dtype=jnp.float32)
        assert_logits_close(model(jnp.asarray(ids.numpy(), jnp.int32)), expected, f"live {name}")


def test_bfloat16_load_stays_close():
    _, input_ids, expected = load_case("gemma3_linear")
    bf16 = gemma.from_pretrained(HF_CASES_DIR / "gemma3_linear", dtype=jnp.bfloat16)
    assert bf16.embedding[...].dtype == jnp.bfloat16
    assert bf16.layer_param(0, "attn.q_proj").dtype == jnp.bfloat16
    logits = bf16(jnp.asarray(input_ids))
    assert logits.dtype == jnp.float32
    rel = np.linalg.norm(np.asarray(logits) - expected) / np.linalg.norm(expected)
    assert rel < 5e-2, rel
