"""The model configuration: one frozen dataclass for Gemma 3 and Gemma 4 text models.

`TransformerConfig` holds the architecture as Hugging Face describes it (field
names follow `Gemma3TextConfig` / `Gemma4TextConfig` where they exist) and
derives everything per layer from it: attention type, window, head geometry,
RoPE, the KV writer of KV-shared layers, MLP width. `layer_specs` is the one
thing the KV pool reads (`gemma.LayerSpec` per layer).

Layer types are 'sliding' (window `sliding_window`) and 'full' (global).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping

import jax.numpy as jnp
import numpy as np

from gemma._hook import LayerSpec

FAMILIES = ("gemma3", "gemma4")
LAYER_TYPES = ("sliding", "full")
ROPE_TYPES = ("default", "linear", "proportional")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary position embedding of one layer type, as HF `rope_parameters[layer_type]`.

    Attributes:
      theta: base wavelength (`rope_theta`).
      rope_type: 'default', 'linear' (frequencies divided by `factor`) or
        'proportional' (Gemma 4 global layers: only the first
        `partial_rotary_factor` of the head is rotated, with exponents over the
        whole head_dim; the rest of the head passes unrotated).
      factor: frequency divisor of 'linear' and 'proportional'.
      partial_rotary_factor: rotated fraction of the head ('proportional' only).
    """

    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    partial_rotary_factor: float = 1.0

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_type must be one of {ROPE_TYPES}, got {self.rope_type!r}")
        if not self.theta > 0:
            raise ValueError(f"rope theta must be > 0, got {self.theta}")
        if not self.factor > 0:
            raise ValueError(f"rope factor must be > 0, got {self.factor}")
        if not 0.0 < self.partial_rotary_factor <= 1.0:
            raise ValueError(
                f"partial_rotary_factor must be in (0, 1], got {self.partial_rotary_factor}"
            )
        if self.rope_type != "proportional" and self.partial_rotary_factor != 1.0:
            # HF's 'default' ignores it and 'linear' would build a cos/sin narrower than the head.
            raise ValueError(
                f"partial_rotary_factor {self.partial_rotary_factor} is only supported with "
                f"rope_type 'proportional', got rope_type {self.rope_type!r}"
            )
        if self.rope_type == "default" and self.factor != 1.0:
            raise ValueError(f"rope_type 'default' takes no factor, got factor={self.factor}")

    def inv_freq(self, head_dim: int) -> np.ndarray:
        """f32[head_dim // 2]: inverse frequencies as HF computes them (float32).

        A zero frequency leaves its pair of dimensions unrotated (proportional RoPE).
        """
        base = np.float32(self.theta)
        if self.rope_type == "proportional":
            rope_angles = int(self.partial_rotary_factor * head_dim // 2)
            exponents = np.arange(0, 2 * rope_angles, 2, dtype=np.float32) / np.float32(head_dim)
            rotated = np.float32(1.0) / (base**exponents)
            inv_freq = np.zeros(head_dim // 2, np.float32)
            inv_freq[:rope_angles] = rotated
        else:
            exponents = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
            inv_freq = (np.float32(1.0) / (base**exponents)).astype(np.float32)
        return (inv_freq / np.float32(self.factor)).astype(np.float32)


def _positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


@dataclasses.dataclass(frozen=True)
class LayerRun:
    """Consecutive layers that repeat one period: `count` times the `period` layers from `first`.

    A run with count > 1 is executed as a `lax.scan` over its repetitions with stacked
    parameters (position r of every repetition has the same structure and attention spec); a
    run with count 1 is unrolled.
    """

    first: int
    period: int
    count: int

    @property
    def stop(self) -> int:
        return self.first + self.period * self.count

    @property
    def layers(self) -> range:
        return range(self.first, self.stop)

    @property
    def scanned(self) -> bool:
        return self.count > 1


def layer_runs(signatures: tuple, max_period: int = 16) -> tuple[LayerRun, ...]:
    """Split layers into runs of a repeating period of equal per-layer signatures.

    For each candidate period p the layers are cut greedily (a run as long as the next p
    signatures repeat the current p, else one unrolled layer); the period that puts the most
    layers in scanned runs wins (ties: fewer runs, then the shorter period). Consecutive
    unrolled layers merge into one run of count 1.
    """
    n = len(signatures)

    def cut(p):
        runs, i = [], 0
        while i < n:
            k = 1
            while i + (k + 1) * p <= n and signatures[i + k * p : i + (k + 1) * p] == tuple(
                signatures[i : i + p]
            ):
                k += 1
            if k >= 2:
                runs.append(LayerRun(i, p, k))
                i += k * p
            elif runs and not runs[-1].scanned:
                runs[-1] = LayerRun(runs[-1].first, runs[-1].period + 1, 1)
                i += 1
            else:
                runs.append(LayerRun(i, 1, 1))
                i += 1
        return tuple(runs)

    best, best_key = (LayerRun(0, n, 1),) if n else (), None
    for p in range(1, min(max_period, n // 2) + 1):
        runs = cut(p)
        scanned = sum(r.period * r.count for r in runs if r.scanned)
        key = (scanned, -len(runs), -p)
        if scanned and (best_key is None or key > best_key):
            best, best_key = runs, key
    return best


@dataclasses.dataclass(frozen=True, kw_only=True)
class TransformerConfig:
    """Architecture of a Gemma 3 or Gemma 4 text model.

    Attributes (HF name in brackets where it differs):
      family: 'gemma3' or 'gemma4'.
      num_layers [num_hidden_layers], hidden_size, intermediate_size, num_heads
        [num_attention_heads], num_kv_heads [num_key_value_heads], head_dim,
        vocab_size: the usual geometry. head_dim and num_kv_heads are those of
        sliding layers (and of all layers in Gemma 3).
      layer_types: 'sliding' or 'full' per layer [layer_types].
      sliding_window: window W of sliding layers; a query at position i sees
        keys at positions > i - W.
      max_context [max_position_embeddings].
      rope_sliding, rope_full: RoPE of each layer type [rope_parameters].
      rms_norm_eps: epsilon of every RMSNorm.
      query_pre_attn_scalar: Gemma 3 only; the softmax scale is its inverse
        square root. Gemma 4 uses scale 1.0 (None here).
      final_logit_softcap [final_logit_softcapping]: tanh soft-cap of the logits.
      tie_word_embeddings: the output projection is the input embedding.
      global_head_dim, num_global_kv_heads: Gemma 4 full-layer geometry, None
        when equal to head_dim / num_kv_heads.
      attention_k_eq_v: Gemma 4 full layers use the key projection as values.
      num_kv_shared_layers: the last N layers read the KV of the last earlier
        layer of the same type (the writer) instead of computing their own.
      use_double_wide_mlp: KV-shared layers have an MLP twice as wide.
      per_layer_input_dim [hidden_size_per_layer_input]: width of the
        per-layer embeddings (PLE), 0 for none.
      per_layer_input_vocab_size [vocab_size_per_layer_input]: PLE vocabulary,
        None for vocab_size.
      num_experts: experts of the MoE block run beside the dense MLP in every
        layer, 0 for none [enable_moe_block, num_experts].
      num_experts_per_token [top_k_experts], moe_intermediate_size: the MoE block.
      is_multimodal, has_external_kv_draft: policy inputs of the KV pool (the
        pool turns SWA scratch reuse off for either); the model is text only.
    """

    family: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    layer_types: tuple[str, ...]
    sliding_window: int
    max_context: int
    rope_sliding: RopeConfig
    rope_full: RopeConfig
    rms_norm_eps: float = 1e-6
    query_pre_attn_scalar: float | None = None
    final_logit_softcap: float | None = None
    tie_word_embeddings: bool = True
    global_head_dim: int | None = None
    num_global_kv_heads: int | None = None
    attention_k_eq_v: bool = False
    num_kv_shared_layers: int = 0
    use_double_wide_mlp: bool = False
    per_layer_input_dim: int = 0
    per_layer_input_vocab_size: int | None = None
    num_experts: int = 0
    num_experts_per_token: int = 0
    moe_intermediate_size: int = 0
    is_multimodal: bool = False
    has_external_kv_draft: bool = False

    def __post_init__(self):
        set_ = functools.partial(object.__setattr__, self)
        set_("layer_types", tuple(self.layer_types))
        if self.global_head_dim == self.head_dim:
            set_("global_head_dim", None)
        if self.num_global_kv_heads == self.num_kv_heads:
            set_("num_global_kv_heads", None)
        if self.per_layer_input_vocab_size == self.vocab_size:
            set_("per_layer_input_vocab_size", None)
        self._validate()

    # ------------------------------------------------------------------ checks

    def _validate(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"family must be one of {FAMILIES}, got {self.family!r}")
        for name in (
            "num_layers",
            "hidden_size",
            "intermediate_size",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "vocab_size",
            "max_context",
        ):
            _positive_int(name, getattr(self, name))
        if isinstance(self.sliding_window, bool) or not isinstance(
            self.sliding_window, int | np.integer
        ):
            raise ValueError(f"sliding_window must be a positive int, got {self.sliding_window!r}")
        if self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be > 0, got {self.sliding_window}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be divisible by num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if len(self.layer_types) != self.num_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries, num_layers is {self.num_layers}"
            )
        bad = [t for t in self.layer_types if t not in LAYER_TYPES]
        if bad:
            raise ValueError(f"layer_types entries must be one of {LAYER_TYPES}, got {bad[0]!r}")
        for name in ("rope_sliding", "rope_full"):
            if not isinstance(getattr(self, name), RopeConfig):
                raise ValueError(f"{name} must be a RopeConfig, got {getattr(self, name)!r}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if self.final_logit_softcap is not None and not self.final_logit_softcap > 0:
            raise ValueError(
                f"final_logit_softcap must be None or > 0, got {self.final_logit_softcap}"
            )
        if self.global_head_dim is not None:
            _positive_int("global_head_dim", self.global_head_dim)
        if self.num_global_kv_heads is not None:
            _positive_int("num_global_kv_heads", self.num_global_kv_heads)
            if self.num_heads % self.num_global_kv_heads:
                raise ValueError(
                    f"num_heads ({self.num_heads}) must be divisible by num_global_kv_heads "
                    f"({self.num_global_kv_heads})"
                )
        for name, dim in (("head_dim", self.head_dim), ("global_head_dim", self.global_head_dim)):
            if dim is not None and dim % 2:
                raise ValueError(f"{name} must be even for RoPE, got {dim}")
        if not 0 <= self.num_kv_shared_layers < self.num_layers:
            raise ValueError(
                f"num_kv_shared_layers must be in [0, num_layers={self.num_layers}), "
                f"got {self.num_kv_shared_layers}"
            )
        if self.per_layer_input_dim < 0:
            raise ValueError(f"per_layer_input_dim must be >= 0, got {self.per_layer_input_dim}")
        if self.per_layer_input_vocab_size is not None:
            _positive_int("per_layer_input_vocab_size", self.per_layer_input_vocab_size)
        if self.num_experts < 0:
            raise ValueError(f"num_experts must be >= 0, got {self.num_experts}")
        if self.num_experts:
            if not 1 <= self.num_experts_per_token <= self.num_experts:
                raise ValueError(
                    f"num_experts_per_token must be in [1, num_experts={self.num_experts}], "
                    f"got {self.num_experts_per_token}"
                )
            _positive_int("moe_intermediate_size", self.moe_intermediate_size)
        elif self.num_experts_per_token or self.moe_intermediate_size:
            raise ValueError(
                "num_experts_per_token and moe_intermediate_size need num_experts > 0, got "
                f"num_experts_per_token={self.num_experts_per_token}, "
                f"moe_intermediate_size={self.moe_intermediate_size}"
            )
        if self.family == "gemma3":
            if self.query_pre_attn_scalar is None or not self.query_pre_attn_scalar > 0:
                raise ValueError(
                    f"gemma3 needs query_pre_attn_scalar > 0, got {self.query_pre_attn_scalar}"
                )
            gemma4_only = {
                "global_head_dim": None,
                "num_global_kv_heads": None,
                "attention_k_eq_v": False,
                "num_kv_shared_layers": 0,
                "use_double_wide_mlp": False,
                "per_layer_input_dim": 0,
                "per_layer_input_vocab_size": None,
                "num_experts": 0,
            }
            for name, off in gemma4_only.items():
                if getattr(self, name) != off:
                    raise ValueError(
                        f"{name}={getattr(self, name)!r} is a Gemma 4 feature; family 'gemma3' "
                        f"needs {off!r}"
                    )
        elif self.query_pre_attn_scalar is not None:
            raise ValueError(
                "gemma4 uses attention scale 1.0; query_pre_attn_scalar must be None, got "
                f"{self.query_pre_attn_scalar}"
            )
        i = first_layer_without_writer(self.layer_types, self.num_kv_shared_layers)
        if i is not None:
            raise ValueError(
                f"KV-shared layer {i} ({self.layer_types[i]}) has no writer: no "
                f"{self.layer_types[i]} layer among the first {self.first_kv_shared_layer} "
                f"layers (num_kv_shared_layers={self.num_kv_shared_layers})"
            )

    # ----------------------------------------------------------------- derived

    @property
    def first_kv_shared_layer(self) -> int:
        return self.num_layers - self.num_kv_shared_layers

    @property
    def kv_writers(self) -> dict[str, int]:
        """Layer type -> the last layer of that type before the KV-shared block."""
        writers = {}
        for i in range(self.first_kv_shared_layer):
            writers[self.layer_types[i]] = i
        return writers

    @functools.cached_property
    def kv_sources(self) -> tuple[int, ...]:
        """Per layer: the layer whose K/V it reads (itself unless KV-shared)."""
        writers = self.kv_writers
        return tuple(
            i if i < self.first_kv_shared_layer else writers[self.layer_types[i]]
            for i in range(self.num_layers)
        )

    @property
    def attn_scale(self) -> float:
        if self.family == "gemma3":
            return float(self.query_pre_attn_scalar) ** -0.5
        return 1.0

    @property
    def embed_scale(self) -> float:
        return float(self.hidden_size) ** 0.5

    @property
    def has_per_layer_inputs(self) -> bool:
        return self.per_layer_input_dim > 0

    @property
    def has_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def input_vocab_size(self) -> int:
        """Token ids must lie in [0, input_vocab_size) (the PLE table can be smaller)."""
        if self.has_per_layer_inputs and self.per_layer_input_vocab_size is not None:
            return min(self.vocab_size, self.per_layer_input_vocab_size)
        return self.vocab_size

    def type_head_dim(self, layer_type: str) -> int:
        if layer_type == "full" and self.global_head_dim is not None:
            return self.global_head_dim
        return self.head_dim

    def type_num_kv_heads(self, layer_type: str) -> int:
        if layer_type == "full" and self.num_global_kv_heads is not None:
            return self.num_global_kv_heads
        return self.num_kv_heads

    def type_rope(self, layer_type: str) -> RopeConfig:
        return self.rope_full if layer_type == "full" else self.rope_sliding

    def layer_uses_k_eq_v(self, i: int) -> bool:
        return self.attention_k_eq_v and self.layer_types[i] == "full"

    def mlp_width(self, i: int) -> int:
        """Dense MLP width of layer i (double in KV-shared layers with use_double_wide_mlp)."""
        # HF: `layer_idx >= first_kv_shared_layer_idx > 0`.
        shared = 0 < self.first_kv_shared_layer <= i
        return self.intermediate_size * (2 if self.use_double_wide_mlp and shared else 1)

    def layer_signature(self, i: int) -> tuple:
        """What layer i's parameters and attention hook depend on (equal => scannable together).

        Layer type (head geometry, RoPE, window, K=V), MLP width, the writer a KV-shared layer
        reads, and whether KV-shared layers read this layer's KV (the dense hook keeps it).
        """
        source = self.kv_sources[i]
        read_later = any(s == i for j, s in enumerate(self.kv_sources) if j != i)
        return (
            self.layer_types[i],
            self.mlp_width(i),
            None if source == i else source,
            read_later,
        )

    @functools.cached_property
    def layer_runs(self) -> tuple[LayerRun, ...]:
        """The layers cut into runs of a repeating period (`lax.scan` over each run's repeats)."""
        return layer_runs(tuple(self.layer_signature(i) for i in range(self.num_layers)))

    @functools.cached_property
    def layer_specs(self) -> tuple[LayerSpec, ...]:
        specs = []
        for i, layer_type in enumerate(self.layer_types):
            specs.append(
                LayerSpec(
                    window=self.sliding_window if layer_type == "sliding" else None,
                    num_kv_heads=self.type_num_kv_heads(layer_type),
                    head_dim=self.type_head_dim(layer_type),
                    kv_source=self.kv_sources[i],
                    scale=self.attn_scale,
                    softcap=None,
                )
            )
        return tuple(specs)

    def kv_bytes_per_token(self, dtype) -> dict[str, int]:
        """K+V bytes one token costs in one KV-writing layer of each type ('sliding', 'full')."""
        itemsize = jnp.dtype(dtype).itemsize
        return {
            t: 2 * self.type_num_kv_heads(t) * self.type_head_dim(t) * itemsize for t in LAYER_TYPES
        }

    @property
    def kv_layer_counts(self) -> dict[str, int]:
        """Layers of each type that write KV (KV-shared layers write none)."""
        counts = dict.fromkeys(LAYER_TYPES, 0)
        for i in range(self.first_kv_shared_layer):
            counts[self.layer_types[i]] += 1
        return counts

    def replace(self, **overrides) -> TransformerConfig:
        """A copy with `overrides` applied and validated (unknown fields -> ValueError)."""
        check_fields(overrides)
        return dataclasses.replace(self, **overrides)


FIELD_NAMES = frozenset(f.name for f in dataclasses.fields(TransformerConfig))


def check_fields(overrides: Mapping[str, object]) -> None:
    unknown = sorted(set(overrides) - FIELD_NAMES)
    if unknown:
        raise ValueError(
            f"unknown TransformerConfig field(s) {unknown}; known fields: {sorted(FIELD_NAMES)}"
        )


def pattern_layer_types(family: str, num_layers: int, period: int) -> tuple[str, ...]:
    """Layer i is full iff (i + 1) % period == 0; Gemma 4 forces the last layer full (as HF)."""
    types = ["full" if (i + 1) % period == 0 else "sliding" for i in range(num_layers)]
    if family == "gemma4" and types:
        types[-1] = "full"
    return tuple(types)


def first_layer_without_writer(
    layer_types: tuple[str, ...], num_kv_shared_layers: int
) -> int | None:
    """The first KV-shared layer with no layer of its type before the shared block, or None.

    Every KV-shared layer reads the KV of the last earlier layer of its type (its writer).
    """
    first = len(layer_types) - num_kv_shared_layers
    written = set(layer_types[:first])
    return next((i for i in range(first, len(layer_types)) if layer_types[i] not in written), None)
