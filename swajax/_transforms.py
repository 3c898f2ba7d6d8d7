"""Pure bookkeeping transforms of the KV pool: `op(layout, state, ...) -> state | (out, state)`.

Every transform is jit-compilable with `layout` static (hashable) and every changing value an
array: one compilation serves every call of the same layout. Failures are values (`ok`, with
the state returned unchanged and no slot leaked) or ValueError at trace time.

The transforms never touch the pool roots (they pass them through); donate the state at the
jit boundary of a step so that XLA neither copies a pool root nor keeps two alive.

Axis names: B batch rows, NB blocks per row, N slots of a group, S scratch slots per row,
G pool groups, L layers of a pool, C blocks the prefix cache names (`KVPoolState.cached`).

A step of the engine:
  ok, state = reserve(layout, state, new_tokens)   # grow each row h -> cap = h + n
  tables = step_page_tables(layout, state)         # per pool i32[L_p, B, 2, NB]
  meta = step_metadata(layout, state)              # q_lens, q_starts, kv_lens (= cap)
  ...attention: layer l uses layer_page_table(layout, tables, l) on state.pools[pool]...
  state = advance(layout, state)                   # history := cap; release stale + scratch

The prefix cache's references: `park` (a row's blocks become cached blocks), `adopt` (an empty
row starts from cached blocks), `release_cached` (the cache lets blocks go).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from gemma._hook import LayerRef
from pallas_kernels.page_table_gather import page_table_gather
from swajax._layout import KVLayout
from swajax._scratch import BAD, ceil_div, scratch_range, scratch_slot_count, stale_range
from swajax._state import KVPoolState

__all__ = [
    "StepMetadata",
    "adopt",
    "advance",
    "free_rows",
    "free_slots",
    "layer_page_table",
    "needed_blocks",
    "park",
    "release_cached",
    "reserve",
    "resize",
    "rewind",
    "row_slots",
    "slots_needed",
    "step_metadata",
    "step_page_tables",
]


# ----------------------------------------------------------------------------- helpers


def _rows(layout: KVLayout, x, name: str, dtype=jnp.int32) -> jax.Array:
    x = jnp.asarray(x)
    if x.shape != (layout.max_batch,):
        raise ValueError(f"{name} must have shape [max_batch={layout.max_batch}], got {x.shape}")
    if dtype == jnp.bool_:
        if x.dtype != jnp.bool_:
            raise TypeError(f"{name} must be bool, got {x.dtype}")
        return x
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{name} must be an integer array, got {x.dtype}")
    return x.astype(jnp.int32)


def _scalar(x, name: str) -> jax.Array:
    x = jnp.asarray(x)
    if x.shape != () or not jnp.issubdtype(x.dtype, jnp.integer):
        raise ValueError(f"{name} must be an integer scalar (array), got {x.dtype}{x.shape}")
    return x.astype(jnp.int32)


def _blocks(layout: KVLayout) -> jax.Array:
    return jnp.arange(layout.max_blocks, dtype=jnp.int32)[None, :]  # [1, NB]


def _allocate(stack, count, refcount, need):
    """Pops one slot per True of `need` (flat, in order); returns (slots, total, count, refcount).

    Request r takes stack[count - 1 - r]. If total > count the results are garbage: callers
    check `total <= count` and discard the new state.
    """
    n = stack.shape[0]
    need_i = need.astype(jnp.int32)
    rank = jnp.cumsum(need_i) - need_i
    total = jnp.sum(need_i)
    slots = jnp.where(need, stack[jnp.clip(count - 1 - rank, 0, n - 1)], BAD)
    refcount = refcount.at[jnp.where(need, slots, n)].set(1, mode="drop")
    return slots, total, count - total, refcount


def _release(stack, count, refcount, slots, mask):
    """Drops one reference per True of `mask`; slots reaching 0 are pushed once on the stack."""
    n = stack.shape[0]
    slots = slots.reshape(-1)
    mask = mask.reshape(-1) & (slots != BAD)
    idx = jnp.where(mask, slots, n)
    refcount = refcount.at[idx].add(-1, mode="drop")
    # a slot named by several candidates (shared prefix freed by two rows) is pushed by the last
    cand = jnp.arange(slots.shape[0], dtype=jnp.int32)
    winner = jnp.full((n,), -1, jnp.int32).at[idx].max(cand, mode="drop")
    safe = jnp.clip(slots, 0, n - 1)
    push = mask & (refcount[safe] == 0) & (winner[safe] == cand)
    push_i = push.astype(jnp.int32)
    rank = jnp.cumsum(push_i) - push_i
    stack = stack.at[jnp.where(push, count + rank, n)].set(slots, mode="drop")
    return stack, count + jnp.sum(push_i), refcount


def _select(ok, new: KVPoolState, old: KVPoolState) -> KVPoolState:
    """`new` where ok else `old`, bookkeeping only (pool roots are never changed here)."""
    picked = jax.tree.map(lambda a, b: jnp.where(ok, a, b), new.bookkeeping(), old.bookkeeping())
    return dataclasses.replace(old, **picked)


class _GroupPlan(NamedTuple):
    need: jax.Array  # bool[B, NB] blocks that get a new normal slot
    need_scratch: jax.Array  # bool[B, S] scratch slots to allocate
    begin: jax.Array  # i32[B] scratch range begin (== end when empty)
    end: jax.Array  # i32[B]
    total: jax.Array  # i32[] slots this group must hand out


class _Plan(NamedTuple):
    grow: jax.Array  # bool[B]
    row_ok: jax.Array  # bool[B]
    cap: jax.Array  # i32[B]
    groups: tuple[_GroupPlan, ...]


def _plan_reserve(layout: KVLayout, state: KVPoolState, n: jax.Array) -> _Plan:
    tpb = layout.page_size
    h, c = state.history, state.cap
    grow = n > 0
    row_ok = (n >= 0) & (~grow | (c == h)) & (h + n <= layout.max_context)
    cap = jnp.where(grow, h + n, c)
    blk = _blocks(layout)
    lo = (h // tpb)[:, None]  # the partial block of history (if any) is already held
    hi = ceil_div(cap, tpb)[:, None]
    plans = []
    for g, group in enumerate(layout.groups):
        base = state.base_tables[g]
        zero = jnp.zeros_like(h)
        if layout.scratch and group.is_sliding and group.scratch_slots > 0:
            begin, end = scratch_range(
                h, cap, group.window, group.sink_blocks, tpb, layout.max_rewind, xp=jnp
            )
            # blocks still held past a rolled-back history keep their normal slots (scratch
            # blocks are BAD in the base table); past the static per-row capacity the range
            # stays in normal pages too
            held_end = jnp.max(jnp.where(base != BAD, blk + 1, 0), axis=1)
            begin = jnp.maximum(begin, held_end)
            end = jnp.maximum(begin, jnp.minimum(end, begin + group.scratch_blocks))
            begin, end = jnp.where(grow, begin, zero), jnp.where(grow, end, zero)
            n_scratch = scratch_slot_count(end - begin, layout.min_scale(g))
        else:
            begin = end = n_scratch = zero
        in_scratch = (blk >= begin[:, None]) & (blk < end[:, None])
        need = grow[:, None] & (blk >= lo) & (blk < hi) & ~in_scratch & (base == BAD)
        s_idx = jnp.arange(group.scratch_slots, dtype=jnp.int32)[None, :]
        need_scratch = s_idx < n_scratch[:, None]
        total = jnp.sum(need.astype(jnp.int32)) + jnp.sum(need_scratch.astype(jnp.int32))
        plans.append(_GroupPlan(need, need_scratch, begin, end, total))
    return _Plan(grow, row_ok, cap, tuple(plans))


# ----------------------------------------------------------------------------- transforms


def reserve(layout: KVLayout, state: KVPoolState, new_tokens) -> tuple[jax.Array, KVPoolState]:
    """Reserves the blocks of this step's chunk: row b grows from history h to cap = h + n_b.

    Args:
      new_tokens: i32[B] new tokens per row this step (0: the row does not grow).

    Blocks [floor(h/tpb), ceil(cap/tpb)) outside the row's scratch range get normal slots (those
    already held are kept); the scratch range (docs/design.md: stale(cap - max_rewind) ∩
    [ceil(h/tpb), ceil(cap/tpb)), at most group.scratch_blocks long) gets
    ceil(|R| * 2 / scale) scratch slots and stays BAD in the base table.

    Returns:
      (ok, state): ok bool[] is False, and the state unchanged, if any row fails (n_b < 0,
      cap > max_context, a growing row with a step already in flight) or a group lacks free
      slots. All or nothing per call.
    """
    n = _rows(layout, new_tokens, "new_tokens")
    plan = _plan_reserve(layout, state, n)
    ok = jnp.all(plan.row_ok)
    b, nb = layout.max_batch, layout.max_blocks
    grow = plan.grow[:, None]
    stacks, counts, refcounts, bases, ranges, scratch = [], [], [], [], [], []
    for g, gp in enumerate(plan.groups):
        count = state.free_count[g]
        request = jnp.concatenate([gp.need.reshape(-1), gp.need_scratch.reshape(-1)])
        slots, total, new_count, refcount = _allocate(
            state.free_stack[g], count, state.refcount[g], request
        )
        ok &= total <= count
        stacks.append(state.free_stack[g])
        counts.append(new_count)
        refcounts.append(refcount)
        bases.append(jnp.where(gp.need, slots[: b * nb].reshape(b, nb), state.base_tables[g]))
        scratch_slots = slots[b * nb :].reshape(b, layout.groups[g].scratch_slots)
        scratch.append(jnp.where(grow, scratch_slots, state.scratch_slots[g]))
        has = (gp.end > gp.begin)[:, None]
        rng = jnp.stack([gp.begin, gp.end], axis=1)
        ranges.append(
            jnp.where(grow, jnp.where(has, rng, BAD), state.scratch_range[g]).astype(jnp.int32)
        )
    new = dataclasses.replace(
        state,
        free_stack=tuple(stacks),
        free_count=jnp.stack(counts).astype(jnp.int32),
        refcount=tuple(refcounts),
        base_tables=tuple(bases),
        cap=plan.cap,
        scratch_range=tuple(ranges),
        scratch_slots=tuple(scratch),
    )
    return ok, _select(ok, new, state)


def advance(layout: KVLayout, state: KVPoolState, new_history=None) -> KVPoolState:
    """Ends the step: history := cap (or new_history), then releases what is no longer needed.

    Args:
      new_history: optional i32[B] accepted history per row, clamped to [history, cap]
        (speculative decoding rolls back at most max_rewind tokens); default cap.

    Out-of-window release: per sliding group, blocks in stale(history - max_rewind) become BAD and
    drop one reference (slot back to the free stack at 0). Every row's scratch slots are released
    and its scratch range cleared. Blocks reserved past a rolled-back history stay held (the next
    reserve reuses them).
    """
    h, c = state.history, state.cap
    hn = c if new_history is None else jnp.clip(_rows(layout, new_history, "new_history"), h, c)
    blk = _blocks(layout)
    stacks, counts, refcounts, bases = [], [], [], []
    for g, group in enumerate(layout.groups):
        base = state.base_tables[g]
        if group.is_sliding:
            start, end = stale_range(
                hn - layout.max_rewind, group.window, group.sink_blocks, layout.page_size, jnp
            )
            release = (blk >= start[:, None]) & (blk < end[:, None]) & (base != BAD)
        else:
            release = jnp.zeros(base.shape, jnp.bool_)
        sslots = state.scratch_slots[g]
        stack, count, refcount = _release(
            state.free_stack[g],
            state.free_count[g],
            state.refcount[g],
            jnp.concatenate([base.reshape(-1), sslots.reshape(-1)]),
            jnp.concatenate([release.reshape(-1), (sslots != BAD).reshape(-1)]),
        )
        stacks.append(stack)
        counts.append(count)
        refcounts.append(refcount)
        bases.append(jnp.where(release, BAD, base))
    return dataclasses.replace(
        state,
        free_stack=tuple(stacks),
        free_count=jnp.stack(counts).astype(jnp.int32),
        refcount=tuple(refcounts),
        base_tables=tuple(bases),
        history=hn,
        cap=hn,
        scratch_range=tuple(jnp.full_like(r, BAD) for r in state.scratch_range),
        scratch_slots=tuple(jnp.full_like(s, BAD) for s in state.scratch_slots),
    )


def rewind(layout: KVLayout, state: KVPoolState, history) -> tuple[jax.Array, KVPoolState]:
    """Rows whose `history` entry is >= 0 go back to that history (speculative decoding: the
    tokens a verification kept). Blocks past it stay held and the next `reserve` reuses them;
    nothing is released. The out-of-window release of the step that fed the drafts kept
    `max_rewind` tokens before its end, so the window of the kept history is whole when at
    most `max_rewind` tokens go back.

    Returns (ok, state): ok is False, and the state unchanged, where a row would go forward,
    goes back more than max_rewind tokens, or a step is in flight.
    """
    h = _rows(layout, history, "history")
    back = h >= 0
    ok = jnp.all(
        ~back
        | (
            (h <= state.history)
            & (state.cap == state.history)
            & (state.history - h <= layout.max_rewind)
        )
    )
    hn = jnp.where(back, h, state.history)
    new = dataclasses.replace(state, history=hn, cap=hn)
    return ok, _select(ok, new, state)


def free_rows(layout: KVLayout, state: KVPoolState, rows) -> KVPoolState:
    """Frees the sequences of the rows where `rows` (bool[B]) is True.

    Every held block drops one reference (shared prefix blocks stay with their other owners),
    scratch slots are released, and the rows become empty (history = cap = 0, tables BAD).
    """
    rows = _rows(layout, rows, "rows", jnp.bool_)
    r2 = rows[:, None]
    stacks, counts, refcounts, bases, ranges, scratch = [], [], [], [], [], []
    for g in range(len(layout.groups)):
        base, sslots = state.base_tables[g], state.scratch_slots[g]
        stack, count, refcount = _release(
            state.free_stack[g],
            state.free_count[g],
            state.refcount[g],
            jnp.concatenate([base.reshape(-1), sslots.reshape(-1)]),
            jnp.concatenate([(r2 & (base != BAD)).reshape(-1), (r2 & (sslots != BAD)).reshape(-1)]),
        )
        stacks.append(stack)
        counts.append(count)
        refcounts.append(refcount)
        bases.append(jnp.where(r2, BAD, base))
        ranges.append(jnp.where(r2, BAD, state.scratch_range[g]))
        scratch.append(jnp.where(r2, BAD, sslots))
    return dataclasses.replace(
        state,
        free_stack=tuple(stacks),
        free_count=jnp.stack(counts).astype(jnp.int32),
        refcount=tuple(refcounts),
        base_tables=tuple(bases),
        history=jnp.where(rows, 0, state.history),
        cap=jnp.where(rows, 0, state.cap),
        scratch_range=tuple(ranges),
        scratch_slots=tuple(scratch),
    )


def _cache_ops(ops, width: int, name: str) -> jax.Array:
    ops = jnp.asarray(ops)
    if ops.ndim != 2 or ops.shape[1] != width or not jnp.issubdtype(ops.dtype, jnp.integer):
        raise ValueError(f"{name} must be an integer array of shape [n, {width}], got {ops.shape}")
    return ops.astype(jnp.int32)


def needed_blocks(layout: KVLayout, group, k) -> jax.Array:
    """bool[NB]: the blocks a row of history k (a multiple of the page size) reads in `group`:
    every block below k, less, for a sliding group, stale(k - max_rewind)."""
    tpb = layout.page_size
    blk = _blocks(layout)[0]
    needed = blk < k // tpb
    if group.is_sliding:
        start, end = stale_range(k - layout.max_rewind, group.window, group.sink_blocks, tpb, jnp)
        needed &= ~((blk >= start) & (blk < end))
    return needed


def release_cached(layout: KVLayout, state: KVPoolState, nodes) -> KVPoolState:
    """Drops the prefix cache's reference to the blocks it names `nodes` (i32[E], distinct;
    -1 = none) in every group: slots reaching 0 references go back to the free stack."""
    nodes = jnp.asarray(nodes).astype(jnp.int32).reshape(-1)
    c = layout.cache_nodes
    if nodes.shape[0] == 0 or c == 0:
        return state
    valid = (nodes >= 0) & (nodes < c)
    stacks, counts, refcounts, cached = [], [], [], []
    for g in range(len(layout.groups)):
        table = state.cached[g]
        slots = jnp.where(valid, table[jnp.clip(nodes, 0, c - 1)], BAD)
        stack, count, refcount = _release(
            state.free_stack[g], state.free_count[g], state.refcount[g], slots, valid
        )
        stacks.append(stack)
        counts.append(count)
        refcounts.append(refcount)
        cached.append(table.at[jnp.where(valid, nodes, c)].set(BAD, mode="drop"))
    return dataclasses.replace(
        state,
        free_stack=tuple(stacks),
        free_count=jnp.stack(counts).astype(jnp.int32),
        refcount=tuple(refcounts),
        cached=tuple(cached),
    )


def park(layout: KVLayout, state: KVPoolState, ops) -> tuple[jax.Array, KVPoolState]:
    """The prefix cache takes a reference to blocks that rows hold.

    Args:
      ops: i32[S, 2 + 2 * NB], one row per park, applied in order: (row, k, nodes[NB],
        masks[NB]); row -1 = none. Block i < k / page_size of the row is named node nodes[i]
        in every group g whose bit is set in masks[i]: `cached[g][node]` becomes the row's slot
        of that block, which gains a reference.

    Returns (ok, state): ok is False, and that park not applied, where a named block is not
    held by the row (BAD), its node already names a block, k is not a whole number of blocks
    within the row's history, or an index is out of range.
    """
    nb, b, c = layout.max_blocks, layout.max_batch, layout.cache_nodes
    ops = _cache_ops(ops, 2 + 2 * nb, "park ops")
    if ops.shape[0] == 0 or c == 0:
        return jnp.bool_(True), state
    blk = _blocks(layout)[0]

    def body(i, carry):
        ok, st = carry
        row, k = ops[i, 0], ops[i, 1]
        nodes, masks = ops[i, 2 : 2 + nb], ops[i, 2 + nb :]
        active = row >= 0
        r = jnp.clip(row, 0, b - 1)
        good = (row < b) & (k >= 0) & (k % layout.page_size == 0) & (k <= st.history[r])
        safe = jnp.clip(nodes, 0, c - 1)
        cached, refcounts = [], []
        for g in range(len(layout.groups)):
            sel = active & (((masks >> g) & 1) == 1)  # [NB]
            slot = st.base_tables[g][r]
            good &= jnp.all(~sel | ((blk < k // layout.page_size) & (nodes >= 0) & (nodes < c)))
            good &= jnp.all(~sel | ((slot != BAD) & (st.cached[g][safe] == BAD)))
            n = st.refcount[g].shape[0]
            cached.append(st.cached[g].at[jnp.where(sel, nodes, c)].set(slot, mode="drop"))
            refcounts.append(st.refcount[g].at[jnp.where(sel, slot, n)].add(1, mode="drop"))
        new = dataclasses.replace(st, cached=tuple(cached), refcount=tuple(refcounts))
        good |= ~active
        return ok & good, _select(good & active, new, st)

    return jax.lax.fori_loop(0, _ops_in_use(ops), body, (jnp.bool_(True), state))


def _ops_in_use(ops) -> jax.Array:
    """How many leading rows of an op list to run: up to its last row with row >= 0. A step's
    lists are mostly empty, and each loop trip is several small device kernels (on a GPU,
    tens of microseconds), so the loop runs only as far as its last real op."""
    real = ops[:, 0] >= 0
    return jnp.max(jnp.where(real, jnp.arange(1, ops.shape[0] + 1, dtype=jnp.int32), 0))


def adopt(layout: KVLayout, state: KVPoolState, ops) -> tuple[jax.Array, KVPoolState]:
    """Empty rows start from cached blocks.

    Args:
      ops: i32[S, 2 + NB], one row per adoption, applied in order: (row, k, nodes[NB]); row
        -1 = none. The row's history becomes k (a multiple of the page size) and, in every
        group, its base table the cached slots of the blocks it reads at k
        (`needed_blocks`: block i is node nodes[i]), each gaining a reference.

    Returns (ok, state): ok is False, and that adoption not applied, where the row is not
    empty, a needed block is not cached, k is not a whole number of blocks within
    max_context, or an index is out of range.
    """
    nb, b, c = layout.max_blocks, layout.max_batch, layout.cache_nodes
    ops = _cache_ops(ops, 2 + nb, "adopt ops")
    if ops.shape[0] == 0 or c == 0:
        return jnp.bool_(True), state

    def body(i, carry):
        ok, st = carry
        row, k, nodes = ops[i, 0], ops[i, 1], ops[i, 2:]
        active = row >= 0
        r = jnp.clip(row, 0, b - 1)
        good = (row < b) & (k >= 0) & (k % layout.page_size == 0) & (k <= layout.max_context)
        good &= (st.history[r] == 0) & (st.cap[r] == 0)
        safe = jnp.clip(nodes, 0, c - 1)
        bases, refcounts = [], []
        for g, group in enumerate(layout.groups):
            base = st.base_tables[g]
            good &= jnp.all(base[r] == BAD) & jnp.all(st.scratch_slots[g][r] == BAD)
            needed = needed_blocks(layout, group, k)
            slot = st.cached[g][safe]
            good &= jnp.all(~needed | ((nodes >= 0) & (nodes < c) & (slot != BAD)))
            n = st.refcount[g].shape[0]
            refcounts.append(st.refcount[g].at[jnp.where(needed, slot, n)].add(1, mode="drop"))
            bases.append(base.at[r].set(jnp.where(needed, slot, BAD)))
        new = dataclasses.replace(
            st,
            base_tables=tuple(bases),
            refcount=tuple(refcounts),
            history=st.history.at[r].set(k),
            cap=st.cap.at[r].set(k),
        )
        good |= ~active
        return ok & good, _select(good & active, new, st)

    return jax.lax.fori_loop(0, _ops_in_use(ops), body, (jnp.bool_(True), state))


def resize(old: KVLayout, new: KVLayout, state: KVPoolState) -> tuple[jax.Array, KVPoolState]:
    """The state of layout `old` moved into layout `new` (the same layout but for its slot
    counts per group): the one transform that moves pool pages.

    Every group's held slots (refcount >= 1) are compacted, in id order, to ids 0 .. held - 1
    of the new group; their pages move with them (pool root rows slot * scale + j), base
    tables, refcounts and the prefix cache's `cached` are renamed, the new ids held .. N' - 1
    are free. Rows keep their history, so running requests and cached blocks carry on reading
    the same KV. Only between steps (cap == history, no scratch slot held). Returns (ok, state
    of `new`); ok is False where a group holds more slots than `new` has or a step is in
    flight (then the returned state is not to be used). Page tables gathered for `old` are
    stale: start from `initial_tables`.
    """
    if (
        len(old.groups) != len(new.groups)
        or len(old.pools) != len(new.pools)
        or old.max_batch != new.max_batch
        or old.max_blocks != new.max_blocks
        or old.cache_nodes != new.cache_nodes
    ):
        raise ValueError("resize needs two layouts that differ only in their slot counts")
    ok = jnp.all(state.cap == state.history)
    stacks, counts, refcounts, bases, perms, cached = [], [], [], [], [], []
    for g, (og, ng) in enumerate(zip(old.groups, new.groups, strict=True)):
        n_old, n_new = og.num_slots, ng.num_slots
        held = state.refcount[g] > 0  # [N]
        num_held = jnp.sum(held, dtype=jnp.int32)
        ok &= num_held <= n_new
        ok &= jnp.all(state.scratch_slots[g] == BAD)
        rename = jnp.where(held, jnp.cumsum(held, dtype=jnp.int32) - 1, BAD)  # old id -> new id
        # new id -> old id (the held slots in order; free new ids read slot 0, unused)
        (src,) = jnp.nonzero(held, size=n_new, fill_value=0)
        perms.append(src.astype(jnp.int32))
        base = state.base_tables[g]
        bases.append(jnp.where(base == BAD, BAD, rename[jnp.clip(base, 0, n_old - 1)]))
        table = state.cached[g]
        cached.append(jnp.where(table == BAD, BAD, rename[jnp.clip(table, 0, n_old - 1)]))
        ids = jnp.arange(n_new, dtype=jnp.int32)
        refcounts.append(jnp.where(ids < num_held, state.refcount[g][src], 0).astype(jnp.int32))
        # free ids num_held .. N' - 1, the lowest on top (popped first), as `init_state` orders
        stacks.append(jnp.maximum(n_new - 1 - ids, num_held).astype(jnp.int32))
        counts.append(n_new - num_held)
    pools = []
    for p, (op, np_) in enumerate(zip(old.pools, new.pools, strict=True)):
        root, src, scale = state.pools[p], perms[op.group], op.scale
        rows = (src[:, None] * scale + jnp.arange(scale, dtype=jnp.int32)).reshape(-1)
        pools.append(root[rows])
        assert pools[-1].shape[0] == np_.num_pages
    return ok, dataclasses.replace(
        state,
        pools=tuple(pools),
        free_stack=tuple(stacks),
        free_count=jnp.stack(counts).astype(jnp.int32),
        refcount=tuple(refcounts),
        base_tables=tuple(bases),
        cached=tuple(cached),
    )


# ----------------------------------------------------------------------------- queries


def free_slots(layout: KVLayout, state: KVPoolState) -> jax.Array:
    """i32[G] free slots per pool group."""
    del layout
    return state.free_count


def slots_needed(
    layout: KVLayout, state: KVPoolState, new_tokens, *, per_row: bool = False
) -> jax.Array:
    """Slots `reserve(layout, state, new_tokens)` would take: i32[G] per group, or with
    per_row=True i32[G, B] per group and row (to pick which rows fit)."""
    plan = _plan_reserve(layout, state, _rows(layout, new_tokens, "new_tokens"))
    if per_row:
        return jnp.stack(
            [
                jnp.sum(gp.need, axis=1, dtype=jnp.int32)
                + jnp.sum(gp.need_scratch, axis=1, dtype=jnp.int32)
                for gp in plan.groups
            ]
        )
    return jnp.stack([gp.total for gp in plan.groups]).astype(jnp.int32)


def row_slots(layout: KVLayout, state: KVPoolState) -> jax.Array:
    """i32[G, B] slots each row references now (shared prefix blocks count in every row)."""
    del layout
    return jnp.stack(
        [
            jnp.sum(base != BAD, axis=1, dtype=jnp.int32)
            + jnp.sum(scratch != BAD, axis=1, dtype=jnp.int32)
            for base, scratch in zip(state.base_tables, state.scratch_slots, strict=True)
        ]
    )


class StepMetadata(NamedTuple):
    """Ragged-batch metadata of the step in flight (see the `pallas_kernels` docstring)."""

    q_lens: jax.Array  # i32[B] new tokens per row (cap - history)
    q_starts: jax.Array  # i32[B + 1] cumulative starts of each row's packed new tokens
    kv_lens: jax.Array  # i32[B] context length after the step (cap)


def step_metadata(layout: KVLayout, state: KVPoolState) -> StepMetadata:
    """q_lens, q_starts (rows packed in batch order) and kv_lens = cap of the step in flight."""
    del layout
    q_lens = state.cap - state.history
    q_starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(q_lens).astype(jnp.int32)])
    return StepMetadata(q_lens, q_starts, state.cap)


def step_page_tables(
    layout: KVLayout, state: KVPoolState, *, implementation: str = "auto", out=None
) -> tuple[jax.Array, ...]:
    """Page tables of the step in flight, one array per pool.

    page_table_mode "per_layer": pool p's entry is i32[L_p, B, 2, NB], [j] the table of the
    pool's layer j (scratch rotation included). "shared": i32[1, B, 2, NB], the table of layer
    j = 0; layer j adds its offset 2*j (see `layer_page_table`). Only blocks < ceil(cap/tpb) are
    set; BAD elsewhere.

    out: optional previous step's tables (per_layer mode; DONATED): the Pallas gather rewrites
    only what changed in place (see `page_table_gather`); the reference ignores it.
    """
    if out is not None and layout.page_table_mode != "per_layer":
        raise ValueError("out= (in-place page tables) needs page_table_mode='per_layer'")
    tables = []
    for p, pool in enumerate(layout.pools):
        g = pool.group
        t = page_table_gather(
            state.base_tables[g],
            state.cap,
            state.scratch_range[g],
            state.scratch_slots[g],
            num_layers=pool.num_layers,
            page_size=layout.page_size,
            implementation=implementation,
            out=None if out is None else out[p],
        )
        tables.append(t if layout.page_table_mode == "per_layer" else t[:1])
    return tuple(tables)


def layer_page_table(layout: KVLayout, tables, layer: int | LayerRef) -> jax.Array:
    """i32[B, 2, NB]: the page table model layer `layer` reads (the writer's for KV-shared).

    `layer` is a layer index or a `LayerRef`, whose index may be traced (a `lax.scan` over
    layers): its pool is `layer.like`'s, its position in the pool is looked up on the device.
    """
    like, index = layer if isinstance(layer, LayerRef) else (layer, layer)
    pool, j = layout.layer_table_index(like)
    if isinstance(index, int):  # a static index: its own position (the pool is like's)
        assert layout.layer_table_index(index)[0] == pool, (like, index)
        j = layout.layer_table_index(index)[1]
    else:
        positions = np.asarray([j for _, j in layout.layer_pool], np.int32)  # [L]
        j = jnp.asarray(positions)[index]
    t = tables[pool]
    if layout.page_table_mode == "per_layer":
        return jax.lax.dynamic_index_in_dim(t, j, 0, keepdims=False)
    return jnp.where(t[0] == BAD, BAD, t[0] + 2 * j)
