"""Full-size presets build abstractly (nnx.eval_shape) with Hugging Face's parameter counts."""

import functools
import json
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import gemma

FIXTURES = Path(__file__).parent / "fixtures"
PARAM_COUNTS = json.loads((FIXTURES / "param_counts.json").read_text())
HF_PRESETS = json.loads((FIXTURES / "hf_presets.json").read_text())
NAMES = list(gemma.configs.PRESET_NAMES)


@functools.cache
def abstract_model(name: str) -> gemma.Transformer:
    config = gemma.configs.preset(name)
    return nnx.eval_shape(
        lambda: gemma.Transformer(config, rngs=nnx.Rngs(0), param_dtype=jnp.bfloat16)
    )


@pytest.mark.parametrize("name", NAMES)
def test_param_count_matches_hf(name):
    model = abstract_model(name)
    assert model.num_params == PARAM_COUNTS[name]["num_params"], name
    embeddings = model.embedding.size
    if model.per_layer_embedding is not None:
        embeddings += model.per_layer_embedding.size
    assert embeddings == PARAM_COUNTS[name]["num_params_embeddings"], name


def _hf_kv_bytes(hf: dict, itemsize: int) -> dict[str, int]:
    """K+V bytes per token and layer from the HF config alone (Hub key form)."""
    full_kv = hf["num_key_value_heads"]
    if hf.get("attention_k_eq_v") and hf.get("num_global_key_value_heads"):
        full_kv = hf["num_global_key_value_heads"]
    return {
        "sliding": 2 * hf["num_key_value_heads"] * hf["head_dim"] * itemsize,
        "full": 2 * full_kv * hf.get("global_head_dim", hf["head_dim"]) * itemsize,
    }


def test_eval_shape_table():
    """Preset, parameters and bf16 KV bytes per token per layer type (printed with -s)."""
    rows = []
    for name in NAMES:
        config = gemma.configs.preset(name)
        kv = config.kv_bytes_per_token(jnp.bfloat16)
        assert kv == _hf_kv_bytes(HF_PRESETS[name], 2), name
        rows.append((name, abstract_model(name).num_params, kv, config.kv_layer_counts))
    header = f"{'preset':16s} {'params':>15s} {'KV B/tok sliding':>17s} {'KV B/tok full':>14s}"
    print(f"\n{header}  KV layers")
    for name, params, kv, counts in rows:
        print(
            f"{name:16s} {params:15,d} {kv['sliding']:17,d} {kv['full']:14,d}  "
            f"{counts['sliding']} sliding / {counts['full']} full"
        )
    assert len(rows) == 10


@pytest.mark.parametrize("name", ["gemma4_e2b", "gemma4_26b_a4b"])
def test_full_size_forward_shapes(name):
    """The dense forward of a full-size preset traces abstractly to f32 logits [B, T, V]."""
    model = abstract_model(name)
    graphdef, state = nnx.split(model)
    tokens = jax.ShapeDtypeStruct((1, 8), jnp.int32)

    def logits(state, tokens):
        return nnx.merge(graphdef, state)(tokens)

    out = jax.eval_shape(logits, state, tokens)
    chex.assert_shape(out, (1, 8, model.config.vocab_size))
    chex.assert_type(out, jnp.float32)


def test_layer_parameter_shapes():
    """Per-layer geometry of the 26B-A4B and E2B presets (HF tensor shapes, einsum layouts)."""
    moe = abstract_model("gemma4_26b_a4b")
    chex.assert_shape(moe.layer_param(5, "attn.q_proj"), (2816, 16, 512))  # full
    chex.assert_shape(moe.layer_param(5, "attn.k_proj"), (2816, 2, 512))
    assert moe.layer_param(5, "attn.v_proj") is None
    chex.assert_shape(moe.layer_param(0, "attn.v_proj"), (2816, 8, 256))  # sliding
    chex.assert_shape(moe.layer_param(0, "moe.gate_proj"), (128, 2816, 704))
    chex.assert_shape(moe.layer_param(0, "moe.down_proj"), (128, 704, 2816))
    # Stacked storage: the 30 layers are one scanned run of 5 periods of 6.
    assert [(r.first, r.period, r.count) for r in moe.layer_runs] == [(0, 6, 5)]
    chex.assert_shape(moe.blocks[0][5].attn.q_proj, (5, 2816, 16, 512))
    e2b = abstract_model("gemma4_e2b")
    assert e2b.layer_param(15, "attn.k_proj") is None  # KV-shared
    chex.assert_shape(e2b.layer_param(15, "mlp.gate_proj"), (1536, 2 * 6144))
    chex.assert_shape(e2b.per_layer_embedding, (262_144, 35 * 256))
    chex.assert_shape(e2b.layer_param(0, "layer_scalar"), (1,))
