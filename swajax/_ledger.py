"""`SlotLedger`: the host's exact count of the slots the pool transforms hold, per row.

The scheduler decides every step before the device runs it, so it must know what `reserve`
will take and what `advance` and `free_rows` will give back without reading the device. The
ledger replays the transforms' slot arithmetic on Python ints, block by block: the same
formulas (`stale_range`, `scratch_range`, `scratch_slot_count` of `swajax._scratch`), the same
truncation of a scratch range at `group.scratch_blocks`, the same refcounted sharing. It holds
no slot ids, only which blocks each row holds (each held block an opaque id, so a shared prefix
block counts once), which blocks the prefix cache names (`cached`: node -> block id, as the
device's `KVPoolState.cached`) and how many slots each group has free. `tests/test_ledger.py`
checks it against the transforms' `free_count` on random schedules.

Axis names as in `swajax._transforms`: B rows, G pool groups.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Mapping, Sequence

from swajax._layout import KVLayout
from swajax._scratch import INTS, ceil_div, scratch_range, scratch_slot_count, stale_range


class SlotLedger:
    """Slots held per (group, row) and free per group, mirroring the pool transforms.

    Rows are batch rows of the layout. Every mutating method keeps the transforms' contract:
    `reserve` is all or nothing and returns False (nothing changed) where the device `reserve`
    would fail.

    mode: "scratch" / "release" (the transforms with scratch reuse on / off; default: as the
    layout) or "full" (nothing is ever released out of window: what a cache without release
    would hold, for reports).
    """

    MODES = ("scratch", "release", "full")

    def __init__(self, layout: KVLayout, mode: str | None = None):
        mode = mode or ("scratch" if layout.scratch else "release")
        if mode not in self.MODES:
            raise ValueError(f"mode must be one of {self.MODES}, got {mode!r}")
        if mode == "scratch" and not layout.scratch:
            raise ValueError("mode='scratch' needs a layout built with scratch reuse on")
        self.layout = layout
        self.mode = mode
        self.free = [g.num_slots for g in layout.groups]
        self.history = [0] * layout.max_batch
        self.cap = [0] * layout.max_batch
        # blocks[g][b]: block index -> block id; refs[g]: block id -> references
        self.blocks: list[list[dict[int, int]]] = [
            [{} for _ in range(layout.max_batch)] for _ in layout.groups
        ]
        self.refs: list[dict[int, int]] = [{} for _ in layout.groups]
        self.scratch = [[0] * layout.max_batch for _ in layout.groups]
        # cached[g]: prefix-cache node -> block id (one reference each)
        self.cached: list[dict[int, int]] = [{} for _ in layout.groups]
        self._ids = itertools.count()
        # per group: (window, sink blocks, scratch blocks, min scale) when it rotates scratch
        self._rotating = [
            (g.window, g.sink_blocks, g.scratch_blocks, layout.min_scale(i))
            if self.mode == "scratch" and g.is_sliding and g.scratch_slots > 0
            else None
            for i, g in enumerate(layout.groups)
        ]

    # ------------------------------------------------------------------ queries

    @property
    def num_slots(self) -> tuple[int, ...]:
        return tuple(g.num_slots for g in self.layout.groups)

    def used(self) -> tuple[int, ...]:
        """Slots held per group."""
        return tuple(n - f for n, f in zip(self.num_slots, self.free, strict=True))

    def row_slots(self, row: int) -> tuple[int, ...]:
        """Slots row `row` references per group (shared blocks count in every owner)."""
        return tuple(len(self.blocks[g][row]) + self.scratch[g][row] for g in range(len(self.free)))

    def prefill_peak(self, length: int, chunk: int) -> tuple[int, ...]:
        """Most slots per group one row holds while it is prefilled from empty to `length`
        tokens in steps of `chunk` (scratch included, as the transforms hold it)."""
        return _prefill_peak(self.layout, self.mode, length, chunk)

    def is_empty(self, row: int) -> bool:
        return self.history[row] == 0 and self.cap[row] == 0 and not any(self.row_slots(row))

    # ------------------------------------------------------------------ reserve / advance

    def _plan(self, new_tokens: Mapping[int, int]):
        """(ok, per group: (row -> blocks needing a slot, row -> scratch slots), totals)."""
        lay, tpb = self.layout, self.layout.page_size
        ok = True
        plans, totals = [], []
        for b, n in new_tokens.items():
            h, c = self.history[b], self.cap[b]
            if n < 0 or (n > 0 and c != h) or h + n > lay.max_context:
                ok = False
        for g, rotating in enumerate(self._rotating):
            need, scratch, total = {}, {}, 0
            held_g = self.blocks[g]
            for b, n in new_tokens.items():
                if n <= 0:
                    continue
                h = self.history[b]
                cap = h + n
                held = held_g[b]
                begin = end = n_scratch = 0
                if rotating is not None:
                    window, sinks, most, scale = rotating
                    begin, end = scratch_range(h, cap, window, sinks, tpb, lay.max_rewind, INTS)
                    held_end = max(held) + 1 if held else 0
                    begin = max(begin, held_end)
                    end = max(begin, min(end, begin + most))
                    n_scratch = scratch_slot_count(end - begin, scale)
                blocks = [
                    o
                    for o in range(h // tpb, ceil_div(cap, tpb))
                    if not begin <= o < end and o not in held
                ]
                need[b], scratch[b] = blocks, n_scratch
                total += len(blocks) + n_scratch
            plans.append((need, scratch))
            totals.append(total)
        return ok, plans, totals

    def slots_needed(self, new_tokens: Mapping[int, int]) -> tuple[int, ...] | None:
        """Slots per group `reserve(new_tokens)` would take, or None if a row cannot grow."""
        ok, _, totals = self._plan(new_tokens)
        return tuple(totals) if ok else None

    def fits(self, new_tokens: Mapping[int, int], headroom: Sequence[int] = ()) -> bool:
        """Whether `reserve(new_tokens)` succeeds leaving at least `headroom[g]` slots free."""
        need = self.slots_needed(new_tokens)
        if need is None:
            return False
        room = tuple(headroom) or (0,) * len(need)
        return all(n + r <= f for n, r, f in zip(need, room, self.free, strict=True))

    def reserve(self, new_tokens: Mapping[int, int]) -> bool:
        """Grows row b by new_tokens[b] tokens (rows not named do not grow); all or nothing."""
        ok, plans, totals = self._plan(new_tokens)
        if not ok or any(t > f for t, f in zip(totals, self.free, strict=True)):
            return False
        for g, (need, scratch) in enumerate(plans):
            for b, blocks in need.items():
                for o in blocks:
                    block_id = next(self._ids)
                    self.blocks[g][b][o] = block_id
                    self.refs[g][block_id] = 1
                self.scratch[g][b] = scratch[b]
            self.free[g] -= totals[g]
        for b, n in new_tokens.items():
            if n > 0:
                self.cap[b] = self.history[b] + n
        return True

    def _drop(self, g: int, row: int, blocks: Sequence[int]) -> None:
        for o in blocks:
            block_id = self.blocks[g][row].pop(o)
            self.refs[g][block_id] -= 1
            if self.refs[g][block_id] == 0:
                del self.refs[g][block_id]
                self.free[g] += 1

    def advance(self) -> None:
        """history := cap; out-of-window release of stale blocks; scratch slots back."""
        lay = self.layout
        self.history[:] = self.cap
        for g, group in enumerate(lay.groups):
            scratch_g, blocks_g = self.scratch[g], self.blocks[g]
            self.free[g] += sum(scratch_g)
            scratch_g[:] = [0] * lay.max_batch
            if not group.is_sliding or self.mode == "full":
                continue
            for b, held in enumerate(blocks_g):
                if not held:
                    continue
                start, end = stale_range(
                    self.history[b] - lay.max_rewind,
                    group.window,
                    group.sink_blocks,
                    lay.page_size,
                    INTS,
                )
                stale = [o for o in held if start <= o < end]
                if stale:
                    self._drop(g, b, stale)

    def rewind(self, row: int, history: int) -> None:
        """Mirrors `rewind`: the row's history goes back to `history` (between steps; blocks
        past it stay held, and the next reserve reuses them)."""
        back = self.history[row] - history
        if self.cap[row] != self.history[row] or not 0 <= back <= self.layout.max_rewind:
            raise ValueError(
                f"row {row} cannot rewind to {history} from history {self.history[row]} "
                f"(cap {self.cap[row]})"
            )
        self.history[row] = self.cap[row] = history

    def free_rows(self, rows: Sequence[int]) -> None:
        """Frees every block and scratch slot of `rows`; the rows become empty."""
        for b in rows:
            for g in range(len(self.free)):
                self._drop(g, b, list(self.blocks[g][b]))
                self.free[g] += self.scratch[g][b]
                self.scratch[g][b] = 0
            self.history[b] = self.cap[b] = 0

    def resize(self, layout: KVLayout) -> None:
        """The same rows in `layout`'s slot counts (mirrors `swajax._transforms.resize`: held
        blocks keep their ids here, the device renames their slots). Between steps only."""
        used = self.used()
        if self.cap != self.history or any(
            self.scratch[g][b] for g in range(len(used)) for b in range(len(self.cap))
        ):
            raise RuntimeError("resize needs the pool between steps (a step is in flight)")
        new = tuple(g.num_slots for g in layout.groups)
        if len(new) != len(used) or any(u > n for u, n in zip(used, new, strict=False)):
            raise ValueError(f"slots per group {list(new)} cannot hold the {list(used)} in use")
        self.layout = layout
        self.free = [n - u for n, u in zip(new, used, strict=True)]

    # ------------------------------------------------------------------ prefix cache

    def needed(self, g: int, k: int) -> list[int]:
        """Blocks a row of history k (whole blocks) reads in group g (`needed_blocks`)."""
        lay, tpb = self.layout, self.layout.page_size
        group = lay.groups[g]
        blocks = range(k // tpb)
        if not group.is_sliding:
            return list(blocks)
        start, end = stale_range(k - lay.max_rewind, group.window, group.sink_blocks, tpb, INTS)
        return [o for o in blocks if not start <= o < end]

    def park(self, row: int, k: int, nodes: Sequence[int]) -> list[int]:
        """Mirrors `park`: block i < k / page_size of `row` becomes cached node nodes[i] (-1:
        none) in each group where the row holds it and the node names no block yet; returns
        the group bit masks per block (the device's op)."""
        masks = []
        for i in range(k // self.layout.page_size):
            mask = 0
            node = nodes[i]
            for g in range(len(self.free)):
                block_id = self.blocks[g][row].get(i)
                if node < 0 or block_id is None or node in self.cached[g]:
                    continue
                self.cached[g][node] = block_id
                self.refs[g][block_id] += 1
                mask |= 1 << g
            masks.append(mask)
        return masks

    def can_adopt(self, k: int, nodes: Sequence[int]) -> bool:
        """Whether every block a row of history k reads is cached (block i as nodes[i])."""
        return all(
            i < len(nodes) and nodes[i] in self.cached[g]
            for g in range(len(self.free))
            for i in self.needed(g, k)
        )

    def adopt(self, row: int, k: int, nodes: Sequence[int]) -> bool:
        """Mirrors `adopt`: empty row `row` starts from the cached blocks of history k."""
        if not self.is_empty(row) or not self.can_adopt(k, nodes):
            return False
        for g in range(len(self.free)):
            for i in self.needed(g, k):
                block_id = self.cached[g][nodes[i]]
                self.blocks[g][row][i] = block_id
                self.refs[g][block_id] += 1
        self.history[row] = self.cap[row] = k
        return True

    def release_cached(self, node: int) -> None:
        """Mirrors `release_cached`: the cache lets node's blocks go, in every group."""
        for g in range(len(self.free)):
            block_id = self.cached[g].pop(node, None)
            if block_id is not None:
                self.refs[g][block_id] -= 1
                if self.refs[g][block_id] == 0:
                    del self.refs[g][block_id]
                    self.free[g] += 1

    def cached_groups(self, node: int) -> int:
        """Bit mask of the groups in which `node` names a block."""
        return sum(1 << g for g in range(len(self.free)) if node in self.cached[g])

    def frees_of(self, node: int) -> int:
        """Slots (all groups) that releasing node would free: its blocks no row holds."""
        return sum(
            1
            for g in range(len(self.free))
            if node in self.cached[g] and self.refs[g][self.cached[g][node]] == 1
        )

    def cache_only_slots(self) -> tuple[int, ...]:
        """Slots per group held by the prefix cache alone (evictable)."""
        return tuple(
            sum(1 for b in self.cached[g].values() if self.refs[g][b] == 1)
            for g in range(len(self.free))
        )


@functools.lru_cache(maxsize=4096)
def _prefill_peak(layout: KVLayout, mode: str, length: int, chunk: int) -> tuple[int, ...]:
    steps = [chunk] * (length // chunk) + ([length % chunk] if length % chunk else [])
    return row_peak_slots(layout, steps, mode)[1]


def row_peak_slots(
    layout: KVLayout, steps: Sequence[int], mode: str | None = None
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(steady, peak) slots per group of one row growing by steps[i] tokens at step i.

    steady: held after the last step's advance; peak: the most held at any step (after a
    reserve, scratch included). Row 0 of a fresh ledger, so the pool is never the limit.
    """
    # one row (a ledger of max_batch rows would advance every empty row at every step)
    ledger = SlotLedger(dataclasses.replace(layout, max_batch=1), mode)
    ledger.free = [10**12] * len(ledger.free)  # unbounded: this measures one row alone
    peak = [0] * len(ledger.free)
    for n in steps:
        if not ledger.reserve({0: n}):
            raise ValueError(
                f"a row cannot grow by {n} tokens from {ledger.history[0]} "
                f"(max_context={layout.max_context})"
            )
        peak = [max(p, s) for p, s in zip(peak, ledger.row_slots(0), strict=True)]
        ledger.advance()
    return ledger.row_slots(0), tuple(peak)
