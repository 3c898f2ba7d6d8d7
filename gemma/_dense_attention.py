"""The dense (cache-free) attention of `Transformer.__call__`, the numerical reference.

It plugs into the model's attention hook (`Transformer.forward(...,
attention_fn, attention_state)`) exactly as the paged KV pool does: the model
hands over q, k, v of each layer and this module attends over the keys of the
current call only. KV-shared layers read their writer's k/v from the state.

Axes: B batch (absent in the packed form), T query tokens, S key tokens,
N query heads, K KV heads, G = N // K query heads per KV head, H head dim.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from gemma._hook import LayerRef, LayerSpec
from pallas_kernels._contract import MASK_VALUE  # the kernels' masked logit


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DenseAttentionState:
    """What the dense attention needs beside q, k, v.

    Attributes:
      positions: i32[B, T] or i32[T], the token positions of the call.
      segment_ids: same shape or None; tokens attend only within their segment
        (several sequences packed in one row).
      kv: writer layer -> (k, v) kept for the KV-shared layers that read it.
    """

    positions: jax.Array
    segment_ids: jax.Array | None = None
    kv: dict[int, tuple[jax.Array, jax.Array]] = dataclasses.field(default_factory=dict)


def dense_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    q_positions: jax.Array,
    k_positions: jax.Array,
    window: int | None,
    scale: float,
    softcap: float | None = None,
    q_segment_ids: jax.Array | None = None,
    k_segment_ids: jax.Array | None = None,
) -> jax.Array:
    """Causal (optionally sliding-window) GQA attention with float32 softmax.

    Args:
      q: [..., T, N, H]; k, v: [..., S, K, H] with N % K == 0.
      q_positions: i32[..., T]; k_positions: i32[..., S]. Key s is visible to
        query t iff k_pos <= q_pos and (window is None or q_pos - k_pos < window).
      window, scale, softcap: as `gemma.LayerSpec`.
      q_segment_ids, k_segment_ids: optional, same shapes as the positions.

    Returns:
      [..., T, N, H] in q's dtype.
    """
    *_, t, n, h = q.shape
    kv_heads = k.shape[-2]
    if n % kv_heads:
        raise ValueError(f"query heads ({n}) must be a multiple of KV heads ({kv_heads})")
    qg = q.reshape(*q.shape[:-2], kv_heads, n // kv_heads, h)  # [..., T, K, G, H]
    logits = jnp.einsum(
        "...tkgh,...skh->...kgts", qg, k, preferred_element_type=jnp.float32
    )  # [..., K, G, T, S]
    logits = logits * jnp.float32(scale)
    if softcap is not None:
        logits = jnp.tanh(logits / softcap) * softcap
    q_pos = q_positions[..., :, None]  # [..., T, 1]
    k_pos = k_positions[..., None, :]  # [..., 1, S]
    mask = k_pos <= q_pos  # [..., T, S]
    if window is not None:
        mask = mask & (q_pos - k_pos < window)
    if q_segment_ids is not None or k_segment_ids is not None:
        if q_segment_ids is None or k_segment_ids is None:
            raise ValueError("give both q_segment_ids and k_segment_ids, or neither")
        mask = mask & (q_segment_ids[..., :, None] == k_segment_ids[..., None, :])
    logits = jnp.where(mask[..., None, None, :, :], logits, MASK_VALUE)
    probs = jax.nn.softmax(logits, axis=-1).astype(q.dtype)  # [..., K, G, T, S]
    out = jnp.einsum("...kgts,...skh->...tkgh", probs, v)  # [..., T, K, G, H]
    return out.reshape(*out.shape[:-3], n, h)


AttentionFn = Callable[..., tuple[jax.Array, object]]


def dense_attention_fn(layer_specs: Sequence[LayerSpec]) -> AttentionFn:
    """The attention hook `fn(layer, q, k, v, state) -> (out, state)` over `DenseAttentionState`.

    `layer` is a `gemma.LayerRef`; window, scale and soft-cap come from
    `layer_specs[layer.like]`. Layers that write KV keep it in `state.kv` when a
    KV-shared layer reads it later; KV-shared layers (k = v = None) read their
    writer's k/v from there.
    """
    specs = tuple(layer_specs)
    read_later = {spec.kv_source for i, spec in enumerate(specs) if spec.kv_source != i}

    def attention_fn(layer: LayerRef, q, k, v, state: DenseAttentionState):
        i = layer.like  # static facts are the same for every layer of a scanned position
        spec = specs[i]
        if spec.kv_source != i:
            if k is not None or v is not None:
                raise ValueError(f"layer {i} is KV-shared (reads layer {spec.kv_source}): no k/v")
            if spec.kv_source not in state.kv:
                raise ValueError(f"layer {i} reads the KV of layer {spec.kv_source}, not written")
            k, v = state.kv[spec.kv_source]
        elif i in read_later:
            # A layer whose KV is read later has a signature of its own: never scanned.
            assert layer.index == i, (layer, i)
            state = dataclasses.replace(state, kv={**state.kv, i: (k, v)})
        out = dense_attention(
            q,
            k,
            v,
            q_positions=state.positions,
            k_positions=state.positions,
            window=spec.window,
            scale=spec.scale,
            softcap=spec.softcap,
            q_segment_ids=state.segment_ids,
            k_segment_ids=state.segment_ids,
        )
        return out, state

    return attention_fn
