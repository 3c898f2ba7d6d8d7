"""`config_from_hf`: a Hugging Face Gemma 3 / Gemma 4 config dict -> `TransformerConfig`.

Reproduces what transformers 5.17 derives from a config.json, defaults
included (hub configs of multimodal checkpoints store only the text fields
that differ from the `Gemma3TextConfig` / `Gemma4TextConfig` defaults): layer
pattern, RoPE per layer type (legacy `rope_theta` / `rope_local_base_freq` /
`rope_scaling` of Gemma 3), Gemma 4 global geometry from `global_head_dim` /
`num_global_key_value_heads` or from a saved `per_layer_config`, and the last
Gemma 4 layer forced to full attention.
"""

from __future__ import annotations

from collections.abc import Mapping

from gemma._config import RopeConfig, TransformerConfig, pattern_layer_types

_FAMILY_OF_MODEL_TYPE = {
    "gemma3_text": "gemma3",
    "gemma3": "gemma3",
    "gemma4_text": "gemma4",
    "gemma4": "gemma4",
    "gemma4_unified_text": "gemma4",
    "gemma4_unified": "gemma4",
}
_TEXT_MODEL_TYPE = {
    "gemma3": "gemma3_text",
    "gemma4": "gemma4_text",
    "gemma4_unified": "gemma4_unified_text",
}
_ACTIVATIONS = ("gelu_pytorch_tanh",)

# Text-config defaults of transformers 5.17 (`Gemma3TextConfig`, `Gemma4TextConfig`,
# `Gemma4UnifiedTextConfig`) for the fields the model uses.
_COMMON_DEFAULTS = dict(
    hidden_size=2304,
    intermediate_size=9216,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=256,
    hidden_activation="gelu_pytorch_tanh",
    max_position_embeddings=131_072,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    attention_bias=False,
    final_logit_softcapping=None,
)
_DEFAULTS = {
    "gemma3_text": dict(
        _COMMON_DEFAULTS,
        vocab_size=262_208,
        num_hidden_layers=26,
        query_pre_attn_scalar=256,
        sliding_window=4096,
        use_bidirectional_attention=False,
    ),
    "gemma4_text": dict(
        _COMMON_DEFAULTS,
        vocab_size=262_144,
        num_hidden_layers=30,
        sliding_window=512,
        use_bidirectional_attention=None,
        vocab_size_per_layer_input=262_144,
        hidden_size_per_layer_input=256,
        attention_k_eq_v=False,
        num_kv_shared_layers=0,
        enable_moe_block=False,
        use_double_wide_mlp=False,
        num_experts=None,
        top_k_experts=None,
        moe_intermediate_size=None,
    ),
}
_DEFAULTS["gemma4_unified_text"] = dict(
    _DEFAULTS["gemma4_text"],
    sliding_window=1024,
    max_position_embeddings=262_144,
    use_bidirectional_attention="vision",
    hidden_size_per_layer_input=0,
    enable_moe_block=False,
)
_HF_LAYER_TYPE = {"sliding_attention": "sliding", "full_attention": "full"}


def text_config_dict(hf: Mapping) -> dict:
    """The text config of a config.json dict (its `text_config`, or itself), with model_type."""
    if not isinstance(hf, Mapping):
        raise TypeError(f"expected a config dict, got {type(hf).__name__}")
    if "text_config" in hf:
        outer_type = hf.get("model_type")
        text = dict(hf["text_config"] or {})
        if "model_type" not in text:
            if outer_type not in _TEXT_MODEL_TYPE:
                raise ValueError(
                    f"cannot tell the text model type: model_type {outer_type!r}, expected one "
                    f"of {sorted(_TEXT_MODEL_TYPE)}"
                )
            text["model_type"] = _TEXT_MODEL_TYPE[outer_type]
        return text
    return dict(hf)


def _rope(params: Mapping, where: str) -> RopeConfig:
    if not isinstance(params, Mapping):
        raise ValueError(f"rope_parameters[{where!r}] must be a dict, got {params!r}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "linear", "proportional"):
        raise ValueError(
            f"rope_type {rope_type!r} of {where} is not supported (default, linear, proportional)"
        )
    if params.get("rope_theta") is None:
        raise ValueError(f"rope_parameters[{where!r}] has no rope_theta: {dict(params)}")
    kwargs = dict(theta=float(params["rope_theta"]), rope_type=rope_type)
    if rope_type in ("linear", "proportional"):
        kwargs["factor"] = float(params.get("factor", 1.0))
    if rope_type == "proportional":
        kwargs["partial_rotary_factor"] = float(params.get("partial_rotary_factor") or 1.0)
    return RopeConfig(**kwargs)


def _gemma3_ropes(d: Mapping) -> tuple[RopeConfig, RopeConfig]:
    # Gemma3TextConfig.convert_rope_params_to_dict
    params = {
        k: dict(v) for k, v in (d.get("rope_parameters") or {}).items() if isinstance(v, dict)
    }
    full = params.get("full_attention") or {"rope_type": "default"}
    sliding = params.get("sliding_attention") or {"rope_type": "default"}
    if d.get("rope_scaling"):
        full.update(d["rope_scaling"])
    full.setdefault("rope_theta", d.get("rope_theta") or 1_000_000.0)
    sliding.setdefault("rope_theta", d.get("rope_local_base_freq") or 10_000.0)
    return _rope(sliding, "sliding_attention"), _rope(full, "full_attention")


def _gemma4_ropes(d: Mapping) -> tuple[RopeConfig, RopeConfig]:
    params = d.get("rope_parameters") or {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {
            "rope_type": "proportional",
            "partial_rotary_factor": 0.25,
            "rope_theta": 1_000_000.0,
        },
    }
    for key in ("sliding_attention", "full_attention"):
        if key not in params:
            raise ValueError(f"rope_parameters has no {key!r} entry: {params}")
    return _rope(params["sliding_attention"], "sliding_attention"), _rope(
        params["full_attention"], "full_attention"
    )


def _full_layer_geometry(d: Mapping, layer_types: list[str], head_dim: int, kv_heads: int):
    """(global_head_dim, num_global_kv_heads) of Gemma 4 full layers, as HF resolves them."""
    if "per_layer_config" in d:
        overrides = {}
        for key, value in (d["per_layer_config"] or {}).items():
            i = int(key)
            if not 0 <= i < len(layer_types):
                raise ValueError(f"per_layer_config layer {key!r} outside [0, {len(layer_types)})")
            value = {k: v for k, v in dict(value).items() if not (k == "skip" and not v)}
            unsupported = sorted(set(value) - {"head_dim", "num_key_value_heads"})
            if unsupported:
                raise ValueError(
                    f"per_layer_config of layer {i} overrides {unsupported}; only head_dim and "
                    "num_key_value_heads per layer are supported"
                )
            overrides[i] = value
        per_type = {}
        for i, t in enumerate(layer_types):
            geometry = (
                overrides.get(i, {}).get("head_dim", head_dim),
                overrides.get(i, {}).get("num_key_value_heads", kv_heads),
            )
            if per_type.setdefault(t, geometry) != geometry:
                raise ValueError(
                    f"per_layer_config gives {t} layers different geometries "
                    f"({per_type[t]} and {geometry} at layer {i}); one per layer type is supported"
                )
        if per_type.get("sliding", (head_dim, kv_heads)) != (head_dim, kv_heads):
            raise ValueError(
                f"per_layer_config overrides sliding layers to {per_type['sliding']}; "
                "only full layers may differ"
            )
        return per_type.get("full", (head_dim, kv_heads))
    global_head_dim = d.get("global_head_dim", 512)
    num_global_kv = d.get("num_global_key_value_heads")
    # HF applies num_global_key_value_heads only with attention_k_eq_v.
    if not d.get("attention_k_eq_v", False):
        num_global_kv = None
    return global_head_dim, num_global_kv


def config_from_hf(hf: Mapping) -> TransformerConfig:
    """A `TransformerConfig` from a Hugging Face config dict (config.json or its text_config).

    Accepts Gemma 3 (`gemma3_text`, `gemma3`) and Gemma 4 (`gemma4_text`,
    `gemma4`, `gemma4_unified_text`, `gemma4_unified`) model types; the text
    part of a multimodal config is used. Raises ValueError for anything the
    model cannot reproduce (bidirectional attention, biases, other
    activations or RoPE types).
    """
    text = text_config_dict(hf)
    model_type = text.get("model_type")
    if model_type not in _FAMILY_OF_MODEL_TYPE:
        raise ValueError(
            f"unsupported model_type {model_type!r}; supported: {sorted(_FAMILY_OF_MODEL_TYPE)}"
        )
    model_type = _TEXT_MODEL_TYPE.get(model_type, model_type)
    family = _FAMILY_OF_MODEL_TYPE[model_type]
    d = {**_DEFAULTS[model_type], **text}
    # A multimodal config.json may keep tie_word_embeddings at its top level.
    if "text_config" in hf and "tie_word_embeddings" in hf and "tie_word_embeddings" not in text:
        d["tie_word_embeddings"] = hf["tie_word_embeddings"]

    if d["hidden_activation"] not in _ACTIVATIONS:
        raise ValueError(
            f"hidden_activation {d['hidden_activation']!r} is not supported ({_ACTIVATIONS})"
        )
    if d.get("attention_bias"):
        raise ValueError("attention_bias=True is not supported (Gemma has no biases)")
    bidirectional = d.get("use_bidirectional_attention")
    if bidirectional not in (None, False, "vision"):
        raise ValueError(
            f"use_bidirectional_attention={bidirectional!r} is not supported (causal text only)"
        )

    num_layers = d["num_hidden_layers"]
    num_heads = d["num_attention_heads"]
    head_dim = d.get("head_dim") or d["hidden_size"] // num_heads
    kv_heads = d["num_key_value_heads"]
    if d.get("layer_types") is not None:
        unknown = sorted(set(d["layer_types"]) - set(_HF_LAYER_TYPE))
        if unknown:
            raise ValueError(f"layer_types {unknown} not supported ({sorted(_HF_LAYER_TYPE)})")
        layer_types = [_HF_LAYER_TYPE[t] for t in d["layer_types"]]
    else:
        period = d.get("sliding_window_pattern", 6) if family == "gemma3" else 6
        layer_types = list(pattern_layer_types(family, num_layers, period))
    if family == "gemma4" and layer_types:
        layer_types[-1] = "full"

    common = dict(
        family=family,
        num_layers=num_layers,
        hidden_size=d["hidden_size"],
        intermediate_size=d["intermediate_size"],
        num_heads=num_heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=d["vocab_size"],
        layer_types=tuple(layer_types),
        sliding_window=d["sliding_window"],
        max_context=d["max_position_embeddings"],
        rms_norm_eps=float(d["rms_norm_eps"]),
        final_logit_softcap=(
            None
            if d.get("final_logit_softcapping") is None
            else float(d["final_logit_softcapping"])
        ),
        tie_word_embeddings=bool(d["tie_word_embeddings"]),
    )
    if family == "gemma3":
        rope_sliding, rope_full = _gemma3_ropes(d)
        # attn_logit_softcapping is not applied by HF's Gemma 3 attention; ignored likewise.
        return TransformerConfig(
            **common,
            rope_sliding=rope_sliding,
            rope_full=rope_full,
            query_pre_attn_scalar=d["query_pre_attn_scalar"],
        )

    rope_sliding, rope_full = _gemma4_ropes(d)
    global_head_dim, num_global_kv = _full_layer_geometry(d, layer_types, head_dim, kv_heads)
    use_moe = bool(d.get("enable_moe_block"))
    ple_dim = d.get("hidden_size_per_layer_input") or 0
    return TransformerConfig(
        **common,
        rope_sliding=rope_sliding,
        rope_full=rope_full,
        global_head_dim=global_head_dim,
        num_global_kv_heads=num_global_kv,
        attention_k_eq_v=bool(d.get("attention_k_eq_v")),
        num_kv_shared_layers=d.get("num_kv_shared_layers") or 0,
        use_double_wide_mlp=bool(d.get("use_double_wide_mlp")),
        per_layer_input_dim=ple_dim,
        per_layer_input_vocab_size=d.get("vocab_size_per_layer_input") if ple_dim else None,
        num_experts=d["num_experts"] if use_moe else 0,
        num_experts_per_token=d["top_k_experts"] if use_moe else 0,
        moe_intermediate_size=d["moe_intermediate_size"] if use_moe else 0,
    )
