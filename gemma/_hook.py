"""The attention-hook contract between a model and the KV pool: a per-layer attention spec.

A model (e.g. `gemma.Transformer`) describes each attention layer with a
`LayerSpec`; the pool layout, budget and paged forward are derived from the
tuple of specs alone. `LayerRef` is how the model names the layer an attention
hook runs, also inside a `lax.scan` over layers.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple


class LayerRef(NamedTuple):
    """The layer an attention hook call runs.

    Attributes:
      like: a static layer index whose `LayerSpec`, pool and KV source are this layer's (the
        first layer of its scanned run at the same position in the period; the layer itself
        when unrolled). Everything static (window, scale, pool, writer) comes from it.
      index: the layer's own index: an int for an unrolled layer, a traced int32 scalar inside
        a `lax.scan` over layers. Only per-layer data (its page table) is indexed with it.
    """

    like: int
    index: Any  # int | jax.Array

    @classmethod
    def of(cls, layer: int) -> LayerRef:
        """The reference of an unrolled layer."""
        return cls(layer, layer)


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """Attention geometry and staleness rule of one layer.

    Attributes:
      window: sliding-window length W in tokens (a query at position i sees keys
        at positions > i - W), or None for a full (global) layer.
      num_kv_heads: KV heads stored for this layer.
      head_dim: width of one K/V head.
      kv_source: index of the layer whose K/V this layer reads. Equal to the
        layer's own index for layers that write KV; Gemma 4 shared-KV layers
        name their writer.
      scale: multiplier of q.k logits (Gemma 3: query_pre_attn_scalar**-0.5,
        Gemma 4: 1.0).
      softcap: optional logit soft-cap (tanh(s / c) * c), None for none.
      sink_blocks: leading blocks that never go stale (0 for Gemma).
    """

    window: int | None
    num_kv_heads: int
    head_dim: int
    kv_source: int
    scale: float = 1.0
    softcap: float | None = None
    sink_blocks: int = 0

    def __post_init__(self):
        if self.window is not None and self.window <= 0:
            raise ValueError(f"window must be a positive int or None, got {self.window}")
        if self.num_kv_heads <= 0 or self.head_dim <= 0:
            raise ValueError(
                f"num_kv_heads and head_dim must be positive, got {self.num_kv_heads}, "
                f"{self.head_dim}"
            )
        if self.kv_source < 0:
            raise ValueError(f"kv_source must be a layer index >= 0, got {self.kv_source}")
        if self.sink_blocks < 0:
            raise ValueError(f"sink_blocks must be >= 0, got {self.sink_blocks}")

    @property
    def life_cycle(self) -> tuple[int | None, int]:
        """The staleness rule `(window, sink_blocks)` this layer shares with others."""
        return (self.window, self.sink_blocks)

    @property
    def is_sliding(self) -> bool:
        return self.window is not None
