"""Named presets of every Gemma 3 / Gemma 4 text variant, with keyword overrides.

Values are the text configs of the released Hugging Face checkpoints
(`tests/fixtures/hf_presets.json` holds them and a test checks each preset
against `config_from_hf` of its dict).

Overrides: any `TransformerConfig` field. Unless `layer_types` is given, it is
rebuilt from the preset's sliding/full period for the (possibly overridden)
`num_layers`. Unless `num_kv_shared_layers` is given, a preset with KV sharing
keeps the same fraction of shared layers when `num_layers` changes, reduced
until every shared layer type has a writer. Unknown fields and inconsistent
values raise `ValueError`.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from gemma._config import (
    RopeConfig,
    TransformerConfig,
    check_fields,
    first_layer_without_writer,
    pattern_layer_types,
)

_G3_LOCAL = RopeConfig(theta=10_000.0)
_G3_GLOBAL = RopeConfig(theta=1_000_000.0)
_G3_GLOBAL_LINEAR8 = RopeConfig(theta=1_000_000.0, rope_type="linear", factor=8.0)
_G4_SLIDING = RopeConfig(theta=10_000.0)
_G4_FULL = RopeConfig(theta=1_000_000.0, rope_type="proportional", partial_rotary_factor=0.25)

_GEMMA3 = dict(
    family="gemma3",
    head_dim=256,
    query_pre_attn_scalar=256,
    rms_norm_eps=1e-6,
    rope_sliding=_G3_LOCAL,
    rope_full=_G3_GLOBAL_LINEAR8,
    max_context=131_072,
    vocab_size=262_208,
    sliding_window=1024,
)
_GEMMA4 = dict(
    family="gemma4",
    head_dim=256,
    global_head_dim=512,
    rms_norm_eps=1e-6,
    rope_sliding=_G4_SLIDING,
    rope_full=_G4_FULL,
    vocab_size=262_144,
    final_logit_softcap=30.0,
)

# name -> (base fields, sliding/full period)
_PRESETS: dict[str, tuple[dict, int]] = {
    "gemma3_270m": (
        dict(
            _GEMMA3,
            num_layers=18,
            hidden_size=640,
            intermediate_size=2048,
            num_heads=4,
            num_kv_heads=1,
            vocab_size=262_144,
            sliding_window=512,
            max_context=32_768,
            rope_full=_G3_GLOBAL,
        ),
        6,
    ),
    "gemma3_1b": (
        dict(
            _GEMMA3,
            num_layers=26,
            hidden_size=1152,
            intermediate_size=6912,
            num_heads=4,
            num_kv_heads=1,
            vocab_size=262_144,
            sliding_window=512,
            max_context=32_768,
            rope_full=_G3_GLOBAL,
        ),
        6,
    ),
    "gemma3_4b": (
        dict(
            _GEMMA3,
            num_layers=34,
            hidden_size=2560,
            intermediate_size=10240,
            num_heads=8,
            num_kv_heads=4,
        ),
        6,
    ),
    "gemma3_12b": (
        dict(
            _GEMMA3,
            num_layers=48,
            hidden_size=3840,
            intermediate_size=15360,
            num_heads=16,
            num_kv_heads=8,
        ),
        6,
    ),
    "gemma3_27b": (
        dict(
            _GEMMA3,
            num_layers=62,
            hidden_size=5376,
            intermediate_size=21504,
            num_heads=32,
            num_kv_heads=16,
            head_dim=128,
            query_pre_attn_scalar=168,
        ),
        6,
    ),
    "gemma4_e2b": (
        dict(
            _GEMMA4,
            num_layers=35,
            hidden_size=1536,
            intermediate_size=6144,
            num_heads=8,
            num_kv_heads=1,
            sliding_window=512,
            max_context=131_072,
            num_kv_shared_layers=20,
            use_double_wide_mlp=True,
            per_layer_input_dim=256,
        ),
        5,
    ),
    "gemma4_e4b": (
        dict(
            _GEMMA4,
            num_layers=42,
            hidden_size=2560,
            intermediate_size=10240,
            num_heads=8,
            num_kv_heads=2,
            sliding_window=512,
            max_context=131_072,
            num_kv_shared_layers=18,
            per_layer_input_dim=256,
        ),
        6,
    ),
    "gemma4_12b": (
        dict(
            _GEMMA4,
            num_layers=48,
            hidden_size=3840,
            intermediate_size=15360,
            num_heads=16,
            num_kv_heads=8,
            num_global_kv_heads=1,
            attention_k_eq_v=True,
            sliding_window=1024,
            max_context=262_144,
        ),
        6,
    ),
    "gemma4_26b_a4b": (
        dict(
            _GEMMA4,
            num_layers=30,
            hidden_size=2816,
            intermediate_size=2112,
            num_heads=16,
            num_kv_heads=8,
            num_global_kv_heads=2,
            attention_k_eq_v=True,
            sliding_window=1024,
            max_context=262_144,
            num_experts=128,
            num_experts_per_token=8,
            moe_intermediate_size=704,
        ),
        6,
    ),
    "gemma4_31b": (
        dict(
            _GEMMA4,
            num_layers=60,
            hidden_size=5376,
            intermediate_size=21504,
            num_heads=32,
            num_kv_heads=16,
            num_global_kv_heads=4,
            attention_k_eq_v=True,
            sliding_window=1024,
            max_context=262_144,
        ),
        6,
    ),
}

PRESET_NAMES: tuple[str, ...] = tuple(_PRESETS)


def preset(name: str, **overrides) -> TransformerConfig:
    """The config of preset `name` with `overrides` applied."""
    if name not in _PRESETS:
        raise ValueError(f"unknown preset {name!r}; presets: {list(PRESET_NAMES)}")
    check_fields(overrides)
    base, period = _PRESETS[name]
    kwargs = {**base, **overrides}
    num_layers = kwargs["num_layers"]
    if "layer_types" not in overrides and isinstance(num_layers, int) and num_layers > 0:
        kwargs["layer_types"] = pattern_layer_types(kwargs["family"], num_layers, period)
    base_shared = base.get("num_kv_shared_layers", 0)
    if (
        base_shared
        and "num_kv_shared_layers" not in overrides
        and ("num_layers" in overrides or "layer_types" in overrides)
        and isinstance(num_layers, int)
        and num_layers > 0
    ):
        layer_types = tuple(kwargs["layer_types"])
        shared = min(base_shared * num_layers // base["num_layers"], num_layers - 1)
        while shared > 0 and first_layer_without_writer(layer_types, shared) is not None:
            shared -= 1
        kwargs["num_kv_shared_layers"] = shared
    kwargs.setdefault("layer_types", ())  # an invalid num_layers is reported by the config
    return TransformerConfig(**kwargs)


def gemma3_270m(**overrides) -> TransformerConfig:
    """Gemma 3 270M: 18 layers, width 640, window 512."""
    return preset("gemma3_270m", **overrides)


def gemma3_1b(**overrides) -> TransformerConfig:
    """Gemma 3 1B: 26 layers, width 1152, window 512."""
    return preset("gemma3_1b", **overrides)


def gemma3_4b(**overrides) -> TransformerConfig:
    """Gemma 3 4B (text): 34 layers, width 2560, window 1024, linear RoPE x8 on full layers."""
    return preset("gemma3_4b", **overrides)


def gemma3_12b(**overrides) -> TransformerConfig:
    """Gemma 3 12B (text): 48 layers, width 3840, window 1024, linear RoPE x8 on full layers."""
    return preset("gemma3_12b", **overrides)


def gemma3_27b(**overrides) -> TransformerConfig:
    """Gemma 3 27B (text): 62 layers, width 5376, head_dim 128, window 1024."""
    return preset("gemma3_27b", **overrides)


def gemma4_e2b(**overrides) -> TransformerConfig:
    """Gemma 4 E2B (text): 35 layers, PLE, last 20 layers KV-shared, double-wide MLP there."""
    return preset("gemma4_e2b", **overrides)


def gemma4_e4b(**overrides) -> TransformerConfig:
    """Gemma 4 E4B (text): 42 layers, PLE, last 18 layers KV-shared."""
    return preset("gemma4_e4b", **overrides)


def gemma4_12b(**overrides) -> TransformerConfig:
    """Gemma 4 12B (text of `gemma4_unified`): 48 layers, width 3840, K=V full layers, 1 KV head."""
    return preset("gemma4_12b", **overrides)


def gemma4_26b_a4b(**overrides) -> TransformerConfig:
    """Gemma 4 26B-A4B (text): 30 layers, dense MLP + 128-expert top-8 MoE, K=V full layers."""
    return preset("gemma4_26b_a4b", **overrides)


def gemma4_31b(**overrides) -> TransformerConfig:
    """Gemma 4 31B (text): 60 layers, width 5376, K=V full layers with 4 KV heads."""
    return preset("gemma4_31b", **overrides)


@dataclasses.dataclass(frozen=True)
class AttentionGeometry:
    """What the attention kernels see of a layer: heads, head width, window, logit scale.

    `presets` names every preset with a layer of this geometry, in `PRESET_NAMES` order.
    """

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    window: int | None
    scale: float
    softcap: float | None
    presets: tuple[str, ...]

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def id(self) -> str:
        """A short name for test ids and benchmark records, e.g. 'q8kv1d512-full'."""
        w = "full" if self.window is None else f"w{self.window}"
        return f"q{self.num_q_heads}kv{self.num_kv_heads}d{self.head_dim}-{w}"


def attention_geometries(names: tuple[str, ...] = PRESET_NAMES) -> tuple[AttentionGeometry, ...]:
    """Every distinct attention geometry of the named presets (default: all ten).

    Derived from each preset's `layer_specs`, so a new preset or a changed one is covered by
    every test and benchmark that iterates over this list.
    """
    found: dict[tuple, list[str]] = {}
    for name in names:
        config = preset(name)
        for spec in config.layer_specs:
            key = (
                config.num_heads,
                spec.num_kv_heads,
                spec.head_dim,
                spec.window,
                spec.scale,
                spec.softcap,
            )
            users = found.setdefault(key, [])
            if name not in users:
                users.append(name)
    return tuple(AttentionGeometry(*key, presets=tuple(users)) for key, users in found.items())


@dataclasses.dataclass(frozen=True)
class MoEGeometry:
    """What the grouped matmul sees of an MoE layer: widths, experts, and how many layers'
    experts one scanned run stacks (`stack_layers`, the largest run's count).

    `presets` names every preset with this geometry, in `PRESET_NAMES` order.
    """

    hidden: int
    moe_ff: int
    experts: int
    per_token: int
    stack_layers: int
    presets: tuple[str, ...]

    @property
    def id(self) -> str:
        """A short name for test ids and benchmark records, e.g. 'd2816f704e128k8'."""
        return f"d{self.hidden}f{self.moe_ff}e{self.experts}k{self.per_token}"


def moe_geometries(names: tuple[str, ...] = PRESET_NAMES) -> tuple[MoEGeometry, ...]:
    """Every distinct MoE geometry of the named presets (default: all ten; dense ones have
    none), derived from each preset's config as `attention_geometries` is."""
    found: dict[tuple, list[str]] = {}
    for name in names:
        c = preset(name)
        if not c.num_experts:
            continue
        stack = max(run.count for run in c.layer_runs)
        key = (c.hidden_size, c.moe_intermediate_size, c.num_experts, c.num_experts_per_token)
        found.setdefault((*key, stack), []).append(name)
    return tuple(MoEGeometry(*key, presets=tuple(users)) for key, users in found.items())


def small_preset(name: str, *, num_layers: int | None = None, **overrides) -> TransformerConfig:
    """Preset `name` with its attention geometry kept and everything else shrunk.

    Heads, head widths, windows, RoPE, K=V, KV sharing, PLE and MoE stay as in the preset (so
    kernels and the pool see the real geometry); width, MLP, vocabulary, experts and the PLE
    width shrink so the model builds in seconds. `num_layers` defaults to the fewest layers
    that keep the preset's features: one sliding/full period, plus as many again for presets
    with KV-shared layers (which then keep a shared layer of each type).
    """
    if name not in _PRESETS:
        raise ValueError(f"unknown preset {name!r}; presets: {list(PRESET_NAMES)}")
    base, period = _PRESETS[name]
    if num_layers is None:
        num_layers = 2 * period if base.get("num_kv_shared_layers") else period
    small = dict(num_layers=num_layers, hidden_size=128, intermediate_size=256, vocab_size=512)
    if base.get("per_layer_input_dim"):
        small["per_layer_input_dim"] = 16
    if base.get("num_experts"):
        small.update(num_experts=4, num_experts_per_token=2, moe_intermediate_size=64)
    if base.get("num_kv_shared_layers") and "num_kv_shared_layers" not in overrides:
        shared = num_layers - period if num_layers >= 2 * period else 0
        layer_types = pattern_layer_types(base["family"], num_layers, period)
        while shared > 0 and first_layer_without_writer(layer_types, shared) is not None:
            shared -= 1
        small["num_kv_shared_layers"] = shared
    return preset(name, **{**small, **overrides})


@dataclasses.dataclass(frozen=True)
class StackedGeometry:
    """A weight matrix that a layer-scanned decode step multiplies in its stack: the product
    [rows, k] x [k, n], and the most layers (`stack_layers`) any preset stacks it over.

    `presets` names every preset with this geometry, in `PRESET_NAMES` order.
    """

    k: int
    n: int
    stack_layers: int
    presets: tuple[str, ...]

    @property
    def id(self) -> str:
        """A short name for test ids and benchmark records, e.g. 'k3840n15360'."""
        return f"k{self.k}n{self.n}"


def stacked_geometries(names: tuple[str, ...] = PRESET_NAMES) -> tuple[StackedGeometry, ...]:
    """Every distinct (k, n) of the matrices that the named presets' scanned runs stack
    (attention projections, MLP, router, per-layer-input maps; MoE experts excepted, which
    the grouped matmul reads: `moe_geometries`), read off each preset's abstract model, so a
    new preset or a changed one is covered by every test and benchmark that iterates over it."""
    from gemma._checkpoint import abstract_model  # imports the model, which imports this module

    found: dict[tuple[int, int], list] = {}
    for name in names:
        model = abstract_model(preset(name), jnp.bfloat16)
        for run, blocks in zip(model.layer_runs, model.blocks, strict=True):
            if not run.scanned:
                continue
            for path, leaf in jax.tree_util.tree_leaves_with_path(nnx.state(blocks)):
                keys = [str(getattr(p, "key", p)) for p in path]
                shape = leaf.shape
                if len(shape) < 3 or ("moe" in keys and len(shape) == 4):
                    continue
                if "o_proj" in keys:  # [R, N, H, D]
                    k, n = shape[1] * shape[2], shape[3]
                else:  # q / k / v [R, D, N, H]; matrices [R, K, N]
                    k, n = shape[1], math.prod(shape[2:])
                layers, users = found.setdefault((k, n), [0, []])
                found[k, n] = [max(layers, shape[0]), users + [name] * (name not in users)]
    return tuple(
        StackedGeometry(k, n, layers, tuple(users))
        for (k, n), (layers, users) in sorted(found.items())
    )
