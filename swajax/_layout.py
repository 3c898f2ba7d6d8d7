"""The static KV layout: life cycles, pool groups, pools, converters (frozen, hashable).

A `KVLayout` is derived from a tuple of `LayerSpec`s and a `KVCacheConfig` by `make_layout`.
It holds every static fact of the paged KV cache (shapes, converters, slot counts) and is passed
as a static (hashable) argument to every transform; the changing data live in `KVPoolState`.

Structure (docs/design.md "The KV memory model"):
  - life cycle `(window, sink_blocks)`: layers sharing a staleness rule.
  - pool group g: one life cycle with all its pools. The pools of a group share one slot
    allocator, so one slot id is valid in every pool of the group and a sequence has one base
    table per group (= per life cycle). `layout.groups[g]`.
  - pool p: the writer layers of one (life cycle, kv_heads, head_dim) with one pool root
    `[num_slots * scale, page_size, kv_heads, head_dim]` (KV dtype of the config),
    `scale = 2 * len(layers)`. Pools of different geometry never share an array shape.
  - converter of (layer, role): `(pool, scale, layer_offset)`, `layer_offset = 2*j + role` for
    the layer's position j in its pool; page = slot * scale + layer_offset, V = K + 1.
    KV-shared layers (spec.kv_source != own index) own no pages and use their writer's converter.

Engine interface (all in `swajax`):
  layout = build_layout(specs, KVCacheConfig(...), max_context=..., max_batch=...)
  state = init_state(layout)
  ok, state = reserve(layout, state, new_tokens)       # i32[batch]; before the forward
  tables = step_page_tables(layout, state)             # per pool i32[L_p, batch, 2, max_blocks]
  pool, j = layout.layer_table_index(layer)            # which table serves model layer `layer`
  meta = step_metadata(layout, state)                  # q_lens, q_starts, kv_lens
  ... forward writes K/V into state.pools[p] via tables ...
  state = advance(layout, state)                       # history := cap, out-of-window release
  state = free_rows(layout, state, rows)               # bool[batch]
Admission and sharing: free_slots(layout, state) -> i32[G]; slots_needed(layout, state, n) ->
i32[G] (per_row=True: i32[G, B]); row_slots(layout, state) -> i32[G, B]; request_slots(layout,
input_len, chunk=, max_new_tokens=) -> peak slots per group of one request (static);
The prefix cache: park(layout, state, ops) caches blocks rows hold, adopt(layout, state, ops)
starts empty rows from cached blocks, release_cached(layout, state, nodes) lets them go. To
keep a cached prefix usable with scratch on, end a step exactly at the reusable boundary k (the
window ending at k is then not stale, so never scratch) and park right after that step's
advance.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import ml_dtypes  # noqa: F401  (numpy learns bfloat16 and float8)
import numpy as np

from gemma._hook import LayerSpec
from gemma._mesh import stored_kv_heads
from swajax._config import KVCacheConfig, resolve_scratch_policy
from swajax._scratch import ceil_div, scratch_slot_count


@dataclasses.dataclass(frozen=True)
class Converter:
    """Base slot -> page of one (layer, role): page = slot * scale + layer_offset."""

    pool: int
    scale: int
    layer_offset: int

    def page(self, slot):
        """The page of base slot `slot` (int or array); BAD passes through unchanged."""
        import jax.numpy as jnp  # the pool's bookkeeping on the host imports no JAX

        return jnp.where(slot == -1, -1, slot * self.scale + self.layer_offset)


@dataclasses.dataclass(frozen=True)
class PoolSpec:
    """One pool root: the writer layers of one (life cycle, head geometry).

    With `tp` > 1 tensor-parallel devices the root holds `stored_kv_heads` heads, sharded over
    them (`device_kv_heads` each; see `stored_kv_heads`); byte counts are per device.
    """

    group: int
    layers: tuple[int, ...]  # model layer indices of the writers, in order (j = position)
    num_kv_heads: int
    head_dim: int
    dtype: str
    num_slots: int
    tp: int = 1

    @property
    def scale(self) -> int:
        """Pages per slot: one per (layer, role)."""
        return 2 * len(self.layers)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def num_pages(self) -> int:
        return self.num_slots * self.scale

    @property
    def stored_kv_heads(self) -> int:
        """KV heads of the pool root (the model's, or repeated up to `tp`)."""
        return stored_kv_heads(self.num_kv_heads, self.tp)

    @property
    def device_kv_heads(self) -> int:
        """KV heads of the pool root on one device."""
        return self.stored_kv_heads // self.tp

    def shape(self, page_size: int) -> tuple[int, int, int, int]:
        """Pool root shape [num_slots * scale, page_size, stored_kv_heads, head_dim] (global)."""
        return (self.num_pages, page_size, self.stored_kv_heads, self.head_dim)

    def bytes_per_token_per_layer(self) -> int:
        """K + V bytes of one token of one layer of this pool, on one device."""
        return 2 * self.device_kv_heads * self.head_dim * np.dtype(self.dtype).itemsize


@dataclasses.dataclass(frozen=True)
class GroupSpec:
    """A pool group: one life cycle, its pools, one slot allocator."""

    window: int | None
    sink_blocks: int
    pools: tuple[int, ...]
    num_slots: int
    scratch_slots: int  # S: static per-row capacity of scratch slot ids (0 without scratch)
    scratch_blocks: int  # static per-row bound of |R|; longer scratch ranges are truncated

    @property
    def life_cycle(self) -> tuple[int | None, int]:
        return (self.window, self.sink_blocks)

    @property
    def is_sliding(self) -> bool:
        return self.window is not None


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """Static facts of the paged KV cache; hashable, so usable as a jit static argument.

    Attributes:
      layer_specs: the model's per-layer specs.
      page_size: tokens per block (tpb).
      max_batch: rows of the batch axis of every per-row array (the rows that serve requests).
      max_context: longest sequence (history + new tokens), tokens.
      max_chunk: static bound on new tokens per row per step used to size scratch descriptors.
      max_rewind: see `KVCacheConfig.max_rewind`.
      dtype: KV dtype name of every pool root.
      page_table_mode: "per_layer" or "shared".
      scratch: whether SWA scratch reuse is on (resolved policy).
      groups: pool groups (one per life cycle that owns pages), in order of first layer.
      pools: pool roots, in order of first layer.
      layer_pool: per model layer, (pool, j) of the pages it reads (the writer's for KV-shared
        layers).
      tp: tensor-parallel devices the pool roots' KV heads are split over (`PoolSpec.tp`);
        every byte count of the layout (`slot_bytes`, `pool_bytes`) is per device.
      cache_nodes: C, the length of each group's `KVPoolState.cached` array: the most blocks
        the prefix cache names at once (`swajax._prefix_cache`); 0 with prefix caching off.
        Fixed for an engine (a re-split keeps it).
    """

    layer_specs: tuple[LayerSpec, ...]
    page_size: int
    max_batch: int
    max_context: int
    max_chunk: int
    max_rewind: int
    dtype: str
    page_table_mode: str
    scratch: bool
    groups: tuple[GroupSpec, ...]
    pools: tuple[PoolSpec, ...]
    layer_pool: tuple[tuple[int, int], ...]
    tp: int = 1
    cache_nodes: int = 0

    @property
    def cache_releases(self) -> int:
        """E, the most cached blocks one step releases (the length of its release list)."""
        return 2 * self.max_blocks + 64 if self.cache_nodes else 0

    @property
    def max_blocks(self) -> int:
        return ceil_div(self.max_context, self.page_size)

    @property
    def num_layers(self) -> int:
        return len(self.layer_specs)

    def layer_table_index(self, layer: int) -> tuple[int, int]:
        """(pool, j): model layer `layer` uses `step_page_tables(...)[pool][j]`."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must be in [0, {self.num_layers}), got {layer}")
        return self.layer_pool[layer]

    def converter(self, layer: int, role: int) -> Converter:
        """Converter (pool, scale, layer_offset) of (layer, role); role 0 = K, 1 = V."""
        if role not in (0, 1):
            raise ValueError(f"role must be 0 (K) or 1 (V), got {role}")
        pool, j = self.layer_table_index(layer)
        return Converter(pool, self.pools[pool].scale, 2 * j + role)

    def is_writer(self, layer: int) -> bool:
        return self.layer_specs[layer].kv_source == layer

    def slot_bytes(self, group: int) -> int:
        """Bytes of one slot of group `group` (over all its pools) on one device."""
        return sum(
            self.pools[p].scale * self.page_size * self.pools[p].bytes_per_token_per_layer() // 2
            for p in self.groups[group].pools
        )

    def pool_bytes(self) -> int:
        """Bytes of all pool roots on one device."""
        return sum(g.num_slots * self.slot_bytes(i) for i, g in enumerate(self.groups))

    def min_scale(self, group: int) -> int:
        return min(self.pools[p].scale for p in self.groups[group].pools)


def _validate_specs(layer_specs) -> tuple[LayerSpec, ...]:
    specs = tuple(layer_specs)
    if not specs:
        raise ValueError("layer_specs must name at least one layer")
    for i, s in enumerate(specs):
        if not isinstance(s, LayerSpec):
            raise TypeError(f"layer_specs[{i}] must be a LayerSpec, got {type(s).__name__}")
        w = s.kv_source
        if w == i:
            continue
        if not 0 <= w < i:
            raise ValueError(
                f"layer {i} reads KV of layer {w}: a KV-shared layer's kv_source must be an "
                f"earlier layer, in [0, {i})"
            )
        writer = specs[w]
        if writer.kv_source != w:
            raise ValueError(
                f"layer {i} reads KV of layer {w}, which itself reads layer {writer.kv_source}; "
                "kv_source must name a layer that writes its own KV"
            )
        if (s.num_kv_heads, s.head_dim, s.life_cycle) != (
            writer.num_kv_heads,
            writer.head_dim,
            writer.life_cycle,
        ):
            raise ValueError(
                f"layer {i} reads KV of layer {w} but differs in (kv_heads, head_dim, "
                f"life cycle): {(s.num_kv_heads, s.head_dim, s.life_cycle)} vs "
                f"{(writer.num_kv_heads, writer.head_dim, writer.life_cycle)}"
            )
    return specs


def _check_shared_kv_scratch(specs, layer_pool, pools) -> None:
    """With scratch on, a reader's writer must be the last scratch writer of its pool before it.

    Rotation makes writers of one pool overwrite each other's scratch pages (at other block
    positions), so a writer w's scratch pages are intact for reader r only if no other writer of
    the same pool runs in between (layers run in index order).
    """
    for r, s in enumerate(specs):
        w = s.kv_source
        if w == r or s.window is None:
            continue
        pool, _ = layer_pool[w]
        between = [l for l in pools[pool].layers if w < l < r]
        if between:
            raise ValueError(
                f"with SWA scratch reuse on, KV-shared layer {r} reads layer {w}, but layers "
                f"{between} of the same pool write scratch in between and may overwrite its "
                "pages; the writer must be the last scratch-writing layer of its life cycle "
                "before any reader (or set enable_swa_scratch_reuse=False)"
            )


def build_layout(
    layer_specs: Sequence[LayerSpec],
    kv_cache_config: KVCacheConfig | None = None,
    *,
    max_context: int,
    max_batch: int | None = None,
    max_chunk: int | None = None,
    num_slots: int | Sequence[int] | None = None,
    scratch: bool | None = None,
    tp: int = 1,
    cache_nodes: int = 0,
) -> KVLayout:
    """Builds the layout of a model's KV cache with `num_slots` (1 per group by default; the
    byte budget's counts: `swajax._budget.make_layout`).

    Args:
      layer_specs: one `LayerSpec` per model layer, in execution order.
      kv_cache_config: user settings (default `KVCacheConfig()`).
      max_context: longest sequence, tokens (history + new tokens of a step).
      max_batch: rows of the batch; default `kv_cache_config.max_batch` (one must be given).
      max_chunk: bound on new tokens per row per step for scratch descriptors; default
        `kv_cache_config.chunk_size`, else max_context.
      num_slots: slots per pool group, or one int for every group (default 1).
      scratch: the resolved scratch policy; None -> `resolve_scratch_policy(kv_cache_config)`
        for a text model with a per-layer backend.
      tp: tensor-parallel devices each pool root's KV heads are split over (see
        `stored_kv_heads`); the byte budget is then per device (`max_gpu_total_bytes` is a
        per-device quota) and slot counts come from the per-device bytes of a slot.
      cache_nodes: blocks the prefix cache may name at once (`KVLayout.cache_nodes`).

    Raises:
      ValueError: on inconsistent specs or settings, a KV-shared reader whose writer's scratch
        pages may be overwritten before it runs, a budget too small for one slot per group, or
        a tp that neither divides nor is a multiple of a pool's KV heads.
    """
    cfg = KVCacheConfig() if kv_cache_config is None else kv_cache_config
    if not isinstance(cfg, KVCacheConfig):
        raise TypeError(f"kv_cache_config must be a KVCacheConfig, got {type(cfg).__name__}")
    specs = _validate_specs(layer_specs)
    max_batch, max_chunk, scratch = _checked_sizes(
        cfg, max_context, max_batch, max_chunk, tp, scratch
    )
    if not isinstance(cache_nodes, int) or isinstance(cache_nodes, bool) or cache_nodes < 0:
        raise ValueError(f"cache_nodes must be an int >= 0, got {cache_nodes!r}")
    dtype = cfg.dtype.name
    life_cycles, pool_keys, pool_layers, layer_pool = _pools_of(specs)
    groups = _groups(life_cycles, pool_keys, pool_layers, max_chunk, cfg.page_size, scratch)
    pools = tuple(
        PoolSpec(life_cycles.index(key[0]), tuple(pool_layers[p]), key[1], key[2], dtype, 0, tp)
        for p, key in enumerate(pool_keys)
    )
    for pool in pools:  # ValueError for a tp that gives some device a part of a KV head
        stored_kv_heads(pool.num_kv_heads, tp)
    if scratch:
        _check_shared_kv_scratch(specs, layer_pool, pools)

    layout = KVLayout(
        layer_specs=specs,
        page_size=cfg.page_size,
        max_batch=max_batch,
        max_context=max_context,
        max_chunk=max_chunk,
        max_rewind=cfg.max_rewind,
        dtype=dtype,
        page_table_mode=cfg.page_table_mode,
        scratch=scratch,
        groups=groups,
        pools=pools,
        layer_pool=layer_pool,
        tp=tp,
        cache_nodes=cache_nodes,
    )
    return with_num_slots(layout, 1 if num_slots is None else num_slots)


def _checked_sizes(cfg: KVCacheConfig, max_context, max_batch, max_chunk, tp, scratch):
    """(max_batch, max_chunk, scratch) resolved from the config and checked (ValueError)."""
    if not isinstance(max_context, int) or max_context < 1:
        raise ValueError(f"max_context must be an int >= 1, got {max_context!r}")
    max_batch = cfg.max_batch if max_batch is None else max_batch
    if not isinstance(max_batch, int) or isinstance(max_batch, bool) or max_batch < 1:
        raise ValueError(
            "max_batch must be an int >= 1 (argument or KVCacheConfig.max_batch), got "
            f"{max_batch!r}"
        )
    if max_chunk is None:
        max_chunk = min(cfg.chunk_size or max_context, max_context)
    if not isinstance(max_chunk, int) or max_chunk < 1:
        raise ValueError(f"max_chunk must be an int >= 1, got {max_chunk!r}")
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ValueError(f"tp must be an int >= 1, got {tp!r}")
    if scratch is None:
        scratch = resolve_scratch_policy(cfg)
    elif scratch and cfg.page_table_mode != "per_layer":
        raise ValueError(
            "SWA scratch reuse needs page_table_mode='per_layer', got "
            f"page_table_mode={cfg.page_table_mode!r}"
        )
    return max_batch, max_chunk, bool(scratch)


def _pools_of(specs):
    """Writer layers grouped into pools by (life cycle, KV heads, head_dim): (life cycles in
    order of first use, pool keys, each pool's writer layers, each layer's (pool, index))."""
    life_cycles: list[tuple[int | None, int]] = []
    pool_keys: list[tuple[tuple[int | None, int], int, int]] = []
    pool_layers: list[list[int]] = []
    writer_pool: dict[int, tuple[int, int]] = {}
    for i, s in enumerate(specs):
        if s.kv_source != i:
            continue
        if s.life_cycle not in life_cycles:
            life_cycles.append(s.life_cycle)
        key = (s.life_cycle, s.num_kv_heads, s.head_dim)
        if key not in pool_keys:
            pool_keys.append(key)
            pool_layers.append([])
        p = pool_keys.index(key)
        writer_pool[i] = (p, len(pool_layers[p]))
        pool_layers[p].append(i)
    return life_cycles, pool_keys, pool_layers, tuple(writer_pool[s.kv_source] for s in specs)


def _groups(life_cycles, pool_keys, pool_layers, max_chunk, page_size, scratch):
    """One `GroupSpec` per life cycle (0 slots until `with_num_slots`), with its scratch."""
    max_chunk_blocks = ceil_div(max_chunk, page_size)
    groups = []
    for lc in life_cycles:
        pools_of = tuple(p for p, key in enumerate(pool_keys) if key[0] == lc)
        min_scale = min(2 * len(pool_layers[p]) for p in pools_of)
        if scratch and lc[0] is not None:
            n_scratch = scratch_slot_count(max_chunk_blocks, min_scale)
            # every slot of a row's scratch serves scale/2 blocks in each pool of the group
            scratch_blocks = n_scratch * min_scale // 2
        else:
            n_scratch = scratch_blocks = 0
        groups.append(GroupSpec(lc[0], lc[1], pools_of, 0, n_scratch, scratch_blocks))
    return tuple(groups)


def with_num_slots(layout: KVLayout, num_slots: int | Sequence[int]) -> KVLayout:
    """The layout with `num_slots[g]` slots in pool group g (each >= 1; an int: every group)."""
    if isinstance(num_slots, int) and not isinstance(num_slots, bool):
        num_slots = (num_slots,) * len(layout.groups)
    num_slots = tuple(num_slots)
    if len(num_slots) != len(layout.groups):
        raise ValueError(
            f"num_slots must give one count per pool group ({len(layout.groups)} groups: "
            f"{[g.life_cycle for g in layout.groups]}), got {num_slots}"
        )
    for g, n in enumerate(num_slots):
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"num_slots[{g}] must be an int >= 1, got {n!r}")
    groups = tuple(
        dataclasses.replace(g, num_slots=n) for g, n in zip(layout.groups, num_slots, strict=True)
    )
    pools = tuple(dataclasses.replace(p, num_slots=num_slots[p.group]) for p in layout.pools)
    return dataclasses.replace(layout, groups=groups, pools=pools)
