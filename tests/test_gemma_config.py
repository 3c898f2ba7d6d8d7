"""Configs and presets: HF config parity, overrides, validation errors, per-layer specs."""

import json
from pathlib import Path

import chex
import jax.numpy as jnp
import pytest

import gemma
from gemma import configs

FIXTURES = Path(__file__).parent / "fixtures"
HF_PRESETS = json.loads((FIXTURES / "hf_presets.json").read_text())
PRESETS = {
    "gemma3_270m": configs.gemma3_270m,
    "gemma3_1b": configs.gemma3_1b,
    "gemma3_4b": configs.gemma3_4b,
    "gemma3_12b": configs.gemma3_12b,
    "gemma3_27b": configs.gemma3_27b,
    "gemma4_e2b": configs.gemma4_e2b,
    "gemma4_e4b": configs.gemma4_e4b,
    "gemma4_12b": configs.gemma4_12b,
    "gemma4_26b_a4b": configs.gemma4_26b_a4b,
    "gemma4_31b": configs.gemma4_31b,
}


def test_every_preset_has_an_hf_config():
    assert sorted(PRESETS) == sorted(HF_PRESETS) == sorted(configs.PRESET_NAMES)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_equals_hf_config(name):
    assert PRESETS[name]() == gemma.config_from_hf(HF_PRESETS[name])


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_layer_specs_follow_hf_config(name):
    hf = HF_PRESETS[name]
    config = PRESETS[name]()
    full = [t == "full_attention" for t in hf["layer_types"]]
    assert [s.window is None for s in config.layer_specs] == full
    assert {s.window for s in config.layer_specs if s.window} == {hf["sliding_window"]}
    assert config.max_context == hf["max_position_embeddings"]
    assert config.vocab_size == hf["vocab_size"]
    for spec, is_full in zip(config.layer_specs, full, strict=True):
        if hf["model_type"] == "gemma3_text":
            assert spec.scale == pytest.approx(hf["query_pre_attn_scalar"] ** -0.5)
            assert spec.head_dim == hf["head_dim"]
        else:
            assert spec.scale == 1.0
            assert spec.head_dim == (hf["global_head_dim"] if is_full else hf["head_dim"])
        assert spec.softcap is None


def test_gemma3_pattern_and_specs():
    config = configs.gemma3_1b()
    assert [i for i, s in enumerate(config.layer_specs) if s.window is None] == [5, 11, 17, 23]
    assert all(s.window == 512 for s in config.layer_specs if s.window is not None)
    assert [s.kv_source for s in config.layer_specs] == list(range(26))
    assert config.layer_specs[0].scale == pytest.approx(1 / 16)
    assert configs.gemma3_27b().layer_specs[0].scale == pytest.approx(168**-0.5)
    assert configs.gemma3_4b().sliding_window == 1024
    assert configs.gemma3_4b().rope_full == gemma.RopeConfig(1e6, "linear", factor=8.0)
    assert configs.gemma3_1b().rope_full == gemma.RopeConfig(1e6)
    assert configs.gemma3_1b().rope_sliding == gemma.RopeConfig(1e4)


def test_gemma4_e2b_kv_sharing():
    config = configs.gemma4_e2b()
    specs = config.layer_specs
    full = [i for i, s in enumerate(specs) if s.window is None]
    assert full == [4, 9, 14, 19, 24, 29, 34]
    # Layers 15..34 read the last non-shared layer of their type: 13 (sliding), 14 (full).
    assert [s.kv_source for s in specs[:15]] == list(range(15))
    assert [s.kv_source for s in specs[15:]] == [14 if i in full else 13 for i in range(15, 35)]
    assert {(s.head_dim, s.num_kv_heads) for s in specs if s.window} == {(256, 1)}
    assert {(s.head_dim, s.num_kv_heads) for s in specs if s.window is None} == {(512, 1)}
    assert [config.mlp_width(i) for i in (0, 14, 15, 34)] == [6144, 6144, 12288, 12288]
    assert config.kv_layer_counts == {"sliding": 12, "full": 3}


def test_gemma4_e4b_and_moe_and_keqv_specs():
    e4b = configs.gemma4_e4b()
    assert e4b.first_kv_shared_layer == 24
    assert {e4b.kv_sources[i] for i in range(24, 42)} == {22, 23}
    assert e4b.mlp_width(41) == e4b.intermediate_size  # no double-wide MLP
    moe = configs.gemma4_26b_a4b()
    assert (moe.num_experts, moe.num_experts_per_token, moe.moe_intermediate_size) == (128, 8, 704)
    full = [s for s in moe.layer_specs if s.window is None]
    assert {(s.head_dim, s.num_kv_heads) for s in full} == {(512, 2)}
    assert moe.layer_uses_k_eq_v(5) and not moe.layer_uses_k_eq_v(0)
    assert moe.final_logit_softcap == 30.0
    assert configs.gemma4_31b().rope_full == gemma.RopeConfig(
        1e6, "proportional", partial_rotary_factor=0.25
    )


def test_kv_bytes_per_token():
    assert configs.gemma4_e2b().kv_bytes_per_token(jnp.bfloat16) == {"sliding": 1024, "full": 2048}
    assert configs.gemma4_31b().kv_bytes_per_token(jnp.float32) == {
        "sliding": 2 * 16 * 256 * 4,
        "full": 2 * 4 * 512 * 4,
    }
    assert configs.gemma3_27b().kv_bytes_per_token(jnp.bfloat16) == {
        "sliding": 2 * 16 * 128 * 2,
        "full": 2 * 16 * 128 * 2,
    }


def test_overrides_rebuild_pattern_and_sharing():
    c = configs.gemma3_1b(num_layers=8, hidden_size=64, vocab_size=300)
    assert c.layer_types == ("sliding",) * 5 + ("full",) + ("sliding",) * 2
    assert (c.hidden_size, c.vocab_size, c.head_dim) == (64, 300, 256)
    # Gemma 4: the last layer is full; sharing shrinks until each shared type has a writer.
    c = configs.gemma4_e2b(num_layers=6, vocab_size=512)
    assert c.layer_types == ("sliding",) * 4 + ("full", "full")
    assert c.num_kv_shared_layers == 1 and c.kv_sources == (0, 1, 2, 3, 4, 4)
    c = configs.gemma4_e2b(num_layers=10, num_kv_shared_layers=4)
    assert c.kv_sources == (0, 1, 2, 3, 4, 5, 5, 5, 5, 4)
    c = configs.gemma4_e4b(num_layers=12)
    assert c.num_kv_shared_layers == 5 and c.kv_sources[-1] == 5
    explicit = ("sliding", "full", "sliding", "full")
    assert configs.gemma4_31b(num_layers=4, layer_types=explicit).layer_types == explicit
    assert configs.gemma3_1b().replace(sliding_window=7).sliding_window == 7


def test_configs_are_hashable_and_frozen():
    c = configs.gemma4_e2b()
    assert hash(c) == hash(configs.gemma4_e2b())
    with pytest.raises(AttributeError):
        c.num_layers = 3


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: configs.gemma3_4b(num_heads=6), r"num_heads \(6\).*num_kv_heads \(4\)"),
        (lambda: configs.gemma4_31b(num_heads=6), r"num_heads \(6\)"),
        (lambda: configs.gemma3_1b(sliding_window=0), "sliding_window must be > 0, got 0"),
        (lambda: configs.gemma3_1b(sliding_window=-4), "got -4"),
        (lambda: configs.gemma3_1b(foo=1), r"unknown TransformerConfig field\(s\) \['foo'\]"),
        (lambda: configs.gemma3_1b().replace(bar=2), r"\['bar'\]"),
        (
            lambda: configs.gemma4_e2b(num_layers=4, num_kv_shared_layers=4),
            r"num_kv_shared_layers must be in \[0, num_layers=4\), got 4",
        ),
        (lambda: configs.gemma3_1b(num_layers=0), "num_layers must be a positive int, got 0"),
        (lambda: configs.gemma3_1b(layer_types=("sliding",) * 3), "layer_types has 3 entries"),
        (
            lambda: configs.gemma3_1b(num_layers=2, layer_types=("sliding", "global")),
            "got 'global'",
        ),
        (lambda: configs.gemma3_1b(num_kv_shared_layers=2), "Gemma 4 feature"),
        (lambda: configs.gemma4_e2b(query_pre_attn_scalar=256), "query_pre_attn_scalar"),
        (
            lambda: configs.gemma4_e4b(
                num_layers=4, layer_types=("sliding",) * 3 + ("full",), num_kv_shared_layers=1
            ),
            r"KV-shared layer 3 \(full\) has no writer",
        ),
        (lambda: configs.gemma4_26b_a4b(num_experts_per_token=200), r"\[1, num_experts=128\]"),
        (lambda: configs.gemma4_31b(num_experts_per_token=2), "need num_experts > 0"),
        (lambda: configs.gemma3_1b(head_dim=15), "head_dim must be even"),
        (lambda: configs.preset("gemma5_1b"), "unknown preset 'gemma5_1b'"),
        (lambda: gemma.RopeConfig(1e4, "yarn"), "rope_type must be one of"),
        (lambda: gemma.RopeConfig(1e4, "linear", partial_rotary_factor=0.5), "only supported"),
        (lambda: gemma.RopeConfig(-1.0), "theta must be > 0"),
    ],
)
def test_inconsistent_values_raise(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def _hf_gemma3_hub_form():
    """Gemma 3 4B text config as the Hub stores it: legacy RoPE keys, defaults left out."""
    return {
        "model_type": "gemma3",
        "architectures": ["Gemma3ForConditionalGeneration"],
        "text_config": {
            "hidden_size": 2560,
            "intermediate_size": 10240,
            "model_type": "gemma3_text",
            "num_hidden_layers": 34,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
            "sliding_window": 1024,
        },
        "vision_config": {"hidden_size": 1152},
    }


def test_config_from_hf_hub_forms():
    assert gemma.config_from_hf(_hf_gemma3_hub_form()) == configs.gemma3_4b()
    legacy = {
        "model_type": "gemma3_text",
        "num_hidden_layers": 6,
        "rope_theta": 5e5,
        "rope_local_base_freq": 100.0,
        "sliding_window_pattern": 3,
    }
    c = gemma.config_from_hf(legacy)
    assert c.layer_types == ("sliding", "sliding", "full") * 2
    assert (c.rope_full, c.rope_sliding) == (gemma.RopeConfig(5e5), gemma.RopeConfig(100.0))
    # Gemma 4: `global_head_dim` / `num_global_key_value_heads` (Hub) == `per_layer_config` (5.17).
    base = dict(
        model_type="gemma4_text",
        num_hidden_layers=6,
        hidden_size_per_layer_input=0,
        attention_k_eq_v=True,
        num_key_value_heads=2,
    )
    hub = gemma.config_from_hf({**base, "global_head_dim": 64, "num_global_key_value_heads": 1})
    saved = gemma.config_from_hf(
        {**base, "per_layer_config": {"5": {"head_dim": 64, "num_key_value_heads": 1}}}
    )
    assert hub == saved
    assert (hub.global_head_dim, hub.num_global_kv_heads) == (64, 1)
    assert hub.layer_types[-1] == "full"
    # Without K=V, num_global_key_value_heads is ignored (HF); global head_dim defaults to 512.
    no_keqv = gemma.config_from_hf(
        {**base, "attention_k_eq_v": False, "num_global_key_value_heads": 1}
    )
    assert (no_keqv.global_head_dim, no_keqv.num_global_kv_heads) == (512, None)
    # HF forces the last Gemma 4 layer to full attention.
    forced = gemma.config_from_hf({**base, "layer_types": ["sliding_attention"] * 6})
    assert forced.layer_types == ("sliding",) * 5 + ("full",)


@pytest.mark.parametrize(
    "hf, match",
    [
        ({"model_type": "llama"}, "unsupported model_type 'llama'"),
        ({"model_type": "gemma4_text", "use_bidirectional_attention": "all"}, "'all'"),
        ({"model_type": "gemma3_text", "use_bidirectional_attention": True}, "True"),
        ({"model_type": "gemma3_text", "hidden_activation": "silu"}, "'silu'"),
        ({"model_type": "gemma3_text", "attention_bias": True}, "attention_bias"),
        (
            {"model_type": "gemma3_text", "rope_scaling": {"rope_type": "yarn", "factor": 2.0}},
            "rope_type 'yarn'",
        ),
        (
            {"model_type": "gemma4_text", "per_layer_config": {"1": {"intermediate_size": 8}}},
            r"\['intermediate_size'\]",
        ),
        (
            {"model_type": "gemma4_text", "per_layer_config": {"0": {"head_dim": 64}}},
            "sliding layers",
        ),
    ],
)
def test_config_from_hf_rejects(hf, match):
    with pytest.raises(ValueError, match=match):
        gemma.config_from_hf(hf)


def test_gemma4_proportional_rope_frequencies():
    # HF _compute_proportional_rope_parameters for head_dim 512, partial 0.25, base 1e6.
    inv = configs.gemma4_e2b().rope_full.inv_freq(512)
    chex.assert_shape(inv, (256,))
    assert (inv[64:] == 0).all() and (inv[:64] > 0).all()
    assert inv[1] == pytest.approx(1e6 ** (-2 / 512), rel=1e-6)
    linear = configs.gemma3_4b().rope_full.inv_freq(256)
    assert linear[1] == pytest.approx(1e6 ** (-2 / 256) / 8, rel=1e-6)


def test_attention_geometries_cover_every_preset_layer():
    geos = gemma.configs.attention_geometries()
    keys = {(g.num_q_heads, g.num_kv_heads, g.head_dim, g.window, g.scale) for g in geos}
    assert len(keys) == len(geos)
    for name in gemma.configs.PRESET_NAMES:
        c = gemma.configs.preset(name)
        for s in c.layer_specs:
            assert (c.num_heads, s.num_kv_heads, s.head_dim, s.window, s.scale) in keys
    # Gemma 4 full layers: head_dim 512 with 1, 2 or 4 KV heads
    assert {(g.num_kv_heads, g.head_dim) for g in geos if g.window is None} >= {
        (1, 512),
        (2, 512),
        (4, 512),
    }


def test_moe_geometries_cover_every_moe_preset():
    """Every preset with experts has its geometry, and `stack_layers` is the largest stack of
    the built (abstract) model's scanned runs."""
    from gemma._checkpoint import abstract_model

    geos = gemma.configs.moe_geometries()
    users = [n for g in geos for n in g.presets]
    moe = [n for n in gemma.configs.PRESET_NAMES if gemma.configs.preset(n).num_experts]
    assert moe and sorted(users) == sorted(moe)
    for g in geos:
        for name in g.presets:
            c = gemma.configs.preset(name)
            assert (g.hidden, g.moe_ff, g.experts, g.per_token) == (
                c.hidden_size,
                c.moe_intermediate_size,
                c.num_experts,
                c.num_experts_per_token,
            )
            model = abstract_model(c, jnp.bfloat16)
            assert g.stack_layers == max(run.count for run in model.layer_runs) > 1


@pytest.mark.parametrize("name", gemma.configs.PRESET_NAMES)
def test_small_preset_keeps_attention_geometry(name):
    full, small = gemma.configs.preset(name), gemma.configs.small_preset(name)
    geo = lambda c: {
        (c.num_heads, s.num_kv_heads, s.head_dim, s.window, s.scale) for s in c.layer_specs
    }
    assert geo(small) == geo(full)
    assert small.hidden_size < full.hidden_size and small.vocab_size < full.vocab_size
    assert (small.num_kv_shared_layers > 0) == (full.num_kv_shared_layers > 0)
    assert small.attention_k_eq_v == full.attention_k_eq_v
    assert (small.num_experts > 0) == (full.num_experts > 0)
    assert (small.per_layer_input_dim > 0) == (full.per_layer_input_dim > 0)
