"""`KVPoolState`: the changing data of the paged KV cache, a registered dataclass pytree.

Axis names: B batch rows (layout.max_batch), NB blocks per row (layout.max_blocks),
N slots of a pool group (group.num_slots), S scratch slots per row (group.scratch_slots),
G pool groups, P pools, C cached blocks (layout.cache_nodes). Static facts (shapes,
converters, page size) live in `KVLayout`.

Invariants kept by the transforms (tested):
  - group g's slots are partitioned into free (`free_stack[g][:free_count[g]]`, refcount 0) and
    held (refcount >= 1: by base-table entries and prefix-cache entries (`cached`), one
    reference per entry, or by one row's scratch).
  - a row's base-table entry is BAD for unallocated, released and scratch-backed blocks.
  - `history <= cap`; cap > history only between `reserve` and `advance` (a step in flight);
    scratch descriptors are non-empty only then.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from swajax._layout import KVLayout
from swajax._scratch import BAD


@dataclasses.dataclass(frozen=True)
class KVPoolState:
    """Changing data of the KV cache; every leaf is an array (no Python scalars).

    Attributes:
      pools: per pool p, the pool root [num_slots * scale, page_size, kv_heads, head_dim].
      k_scales, v_scales: f32[P] dequantisation scales per pool root (1.0 unless fp8).
      free_stack: per group, i32[N]; entries [0, free_count[g]) are the free slot ids (top last).
      free_count: i32[G] free slots per group.
      refcount: per group, i32[N] references per slot (0 = free).
      base_tables: per group (life cycle), i32[B, NB] slot ids, BAD = -1 where no normal slot.
      history: i32[B] tokens whose K/V are committed.
      cap: i32[B] capacity this step (history + new tokens reserved); == history when idle.
      scratch_range: per group, i32[B, 2] this step's scratch range [begin, end), (BAD, BAD) when
        none.
      scratch_slots: per group, i32[B, S] this step's scratch slot ids, BAD-padded.
      cached: per group, i32[C] the slot of each block the prefix cache names (the host's node
        ids index it), BAD where none; each entry holds one reference.
    """

    pools: tuple[jax.Array, ...]
    k_scales: jax.Array
    v_scales: jax.Array
    free_stack: tuple[jax.Array, ...]
    free_count: jax.Array
    refcount: tuple[jax.Array, ...]
    base_tables: tuple[jax.Array, ...]
    history: jax.Array
    cap: jax.Array
    scratch_range: tuple[jax.Array, ...]
    scratch_slots: tuple[jax.Array, ...]
    cached: tuple[jax.Array, ...]

    def bookkeeping(self) -> dict:
        """Every field except the pool roots and scales (what the transforms change)."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name not in ("pools", "k_scales", "v_scales")
        }


jax.tree_util.register_dataclass(
    KVPoolState, data_fields=[f.name for f in dataclasses.fields(KVPoolState)], meta_fields=[]
)


def init_state(layout: KVLayout, *, k_scales=None, v_scales=None) -> KVPoolState:
    """A fresh state: zero pool roots, every slot free, every row empty.

    `k_scales` / `v_scales`: optional f32[P] (or scalar) fp8 scales per pool root; default 1.0.
    """
    num_pools = len(layout.pools)
    b, nb = layout.max_batch, layout.max_blocks

    def scales(x):
        if x is None:
            return jnp.ones((num_pools,), jnp.float32)
        return jnp.broadcast_to(jnp.asarray(x, jnp.float32), (num_pools,))

    return KVPoolState(
        pools=tuple(jnp.zeros(p.shape(layout.page_size), jnp.dtype(p.dtype)) for p in layout.pools),
        k_scales=scales(k_scales),
        v_scales=scales(v_scales),
        # reversed so that the first allocations get slots 0, 1, 2, ... (readable tables)
        free_stack=tuple(
            jnp.arange(g.num_slots - 1, -1, -1, dtype=jnp.int32) for g in layout.groups
        ),
        free_count=jnp.array([g.num_slots for g in layout.groups], jnp.int32),
        refcount=tuple(jnp.zeros((g.num_slots,), jnp.int32) for g in layout.groups),
        base_tables=tuple(jnp.full((b, nb), BAD, jnp.int32) for _ in layout.groups),
        history=jnp.zeros((b,), jnp.int32),
        cap=jnp.zeros((b,), jnp.int32),
        scratch_range=tuple(jnp.full((b, 2), BAD, jnp.int32) for _ in layout.groups),
        scratch_slots=tuple(jnp.full((b, g.scratch_slots), BAD, jnp.int32) for g in layout.groups),
        cached=tuple(jnp.full((layout.cache_nodes,), BAD, jnp.int32) for _ in layout.groups),
    )


def initial_tables(layout: KVLayout):
    """All-BAD per-pool page tables, the `tables` of a first step (None in shared mode)."""
    if layout.page_table_mode != "per_layer":
        return None
    shape = (layout.max_batch, 2, layout.max_blocks)
    return tuple(jnp.full((p.num_layers, *shape), BAD, jnp.int32) for p in layout.pools)
