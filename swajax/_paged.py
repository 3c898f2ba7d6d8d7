"""The paged forward: a model's attention layers run on the KV pool.

Owns the attention hook handed to `model.forward` (write the chunk's K/V into the layer's
pages, then attend through the layer's page table), its per-shard form under tensor
parallelism, and the positions of a ragged batch.

Axis names: T packed new tokens of the step, B batch rows, Hq query heads, Hkv KV heads,
D head_dim, V vocabulary.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from gemma._hook import LayerRef
from gemma._mesh import MODEL
from pallas_kernels.kv_write import kv_write
from pallas_kernels.paged_attention import paged_decode_attention, ragged_paged_attention
from swajax._layout import KVLayout, PoolSpec
from swajax._transforms import StepMetadata, layer_page_table


def token_rows(meta: StepMetadata, num_tokens: int) -> tuple[jax.Array, jax.Array]:
    """(row, valid): the batch row owning each packed token, and whether it is a real token."""
    t = jnp.arange(num_tokens, dtype=jnp.int32)  # [T]
    # One fused compare-and-count: the default binary search is a while loop, which on a GPU
    # runs as several small kernels and copies per iteration.
    row = jnp.searchsorted(meta.q_starts[1:], t, side="right", method="compare_all")
    row = row.astype(jnp.int32)
    valid = t < meta.q_starts[-1]
    return jnp.minimum(row, meta.kv_lens.shape[0] - 1), valid


def token_positions(meta: StepMetadata, num_tokens: int) -> jax.Array:
    """i32[T] absolute position of each packed token (0 for padding)."""
    row, valid = token_rows(meta, num_tokens)
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    pos = meta.kv_lens[row] - meta.q_lens[row] + (t - meta.q_starts[row])
    return jnp.where(valid, pos, 0)


def make_attention_fn(
    layout: KVLayout,
    tables: tuple[jax.Array, ...],
    meta: StepMetadata,
    k_scales: jax.Array,
    v_scales: jax.Array,
    *,
    decode: bool,
    implementation: str = "auto",
):
    """The `attention_fn(layer, q, k, v, pools) -> (out, pools)` hook of `model.forward`.

    Layers that write KV (k is not None) first write the step's new K/V into their pages, then
    every layer attends through its page table; KV-shared layers read their writer's pages.
    `decode=True` (every row has at most one new token) uses the decode kernel: the packed
    queries are gathered into one row per sequence and scattered back.

    With `layout.tp` > 1 (traced under a mesh with a "model" axis, see `swajax._sharding`) the
    layer's page table is taken once, replicated, and the KV write and attention run per shard
    under `jax.shard_map`: each device sees its query heads and its KV heads of the pool root.
    """

    def attention_fn(layer: LayerRef, q, k, v, pools):
        # Static facts from `like`; the page table from the layer's own (maybe traced) index.
        spec = layout.layer_specs[layer.like]
        pool_index, _ = layout.layer_table_index(layer.like)
        page_table = layer_page_table(layout, tables, layer)  # [B, 2, NB]
        ks, vs = k_scales[pool_index], v_scales[pool_index]
        run = functools.partial(
            _layer_attention, spec, decode=decode, implementation=implementation
        )
        pools = list(pools)
        args = (pools[pool_index], page_table, meta, ks, vs)
        if layout.tp == 1:
            out, pools[pool_index] = run(q, k, v, *args)
        else:
            out, pools[pool_index] = _per_shard(run, layout.pools[pool_index], q, k, v, *args)
        return out, tuple(pools)

    return attention_fn


def _layer_attention(spec, q, k, v, pool, page_table, meta, ks, vs, *, decode, implementation):
    """One layer on one pool root: write k, v (unless None), attend q. Returns (out, pool)."""
    if k is not None:
        pool = kv_write(
            pool,
            page_table,
            k,
            v,
            meta.q_starts,
            meta.kv_lens,
            k_scale=ks,
            v_scale=vs,
            implementation=implementation,
        )
    kw = dict(
        scale=spec.scale,
        window=spec.window,
        softcap=spec.softcap,
        k_scale=ks,
        v_scale=vs,
        implementation=implementation,
    )
    if decode:
        num_tokens = q.shape[0]
        active = meta.q_lens > 0  # [B]
        first = jnp.clip(meta.q_starts[:-1], 0, num_tokens - 1)
        q_rows = q[first]  # [B, Hq, D]
        out_rows = paged_decode_attention(
            q_rows, pool, page_table, jnp.where(active, meta.kv_lens, 0), **kw
        )
        row, valid = token_rows(meta, num_tokens)
        out = jnp.where(valid[:, None, None], out_rows[row], 0).astype(q.dtype)  # [T, Hq, D]
    else:
        out = ragged_paged_attention(q, pool, page_table, meta.q_starts, meta.kv_lens, **kw)
    return out, pool


def _per_shard(run, pool_spec: PoolSpec, q, k, v, pool, page_table, meta, ks, vs):
    """`run` on each "model" shard: q [T, Hq, D] and the pool root split over heads, k / v over
    KV heads after repeating them up to the root's stored heads (`PoolSpec.stored_kv_heads`),
    the page table, metadata and scales replicated. The kernels see local shapes only. Every
    array goes in as an argument: a closed-over one would belong to the enclosing mesh
    context."""
    heads = P(None, MODEL, None)  # [T, heads, D]
    pool_heads = P(None, None, MODEL, None)  # [pages, page_size, heads, D]
    repeat = pool_spec.stored_kv_heads // pool_spec.num_kv_heads
    if k is not None and repeat > 1:
        k, v = jnp.repeat(k, repeat, axis=1), jnp.repeat(v, repeat, axis=1)  # [T, stored, D]
    kv = () if k is None else (k, v)

    def local(q, pool, page_table, meta, ks, vs, *kv):
        k, v = kv if kv else (None, None)
        return run(q, k, v, pool, page_table, meta, ks, vs)

    return jax.shard_map(
        local,
        mesh=jax.sharding.get_abstract_mesh(),
        in_specs=(heads, pool_heads, P(), P(), P(), P()) + (heads,) * len(kv),
        out_specs=(heads, pool_heads),
        axis_names={MODEL},
        check_vma=False,
    )(q, pool, page_table, meta, ks, vs, *kv)
