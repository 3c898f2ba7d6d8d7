"""Staleness and SWA scratch reuse: the stale range, the scratch range and the rotation.

These formulas (docs/design.md, "The KV memory model") are the single definition used by the
transforms (jnp, per batch row), the budget simulation (Python ints) and the tests. Every
function takes an `xp` module (`numpy` or `jax.numpy`) so the same code serves both.

Blocks are half-open ranges `[begin, end)` of block indices; `tpb` is the page size.
"""

from __future__ import annotations

import types

import numpy as np

from pallas_kernels._contract import BAD, rotate

__all__ = [
    "BAD",
    "INTS",
    "ceil_div",
    "rotation_pages",
    "scratch_range",
    "scratch_slot_count",
    "stale_range",
]


# The `xp` of Python ints (the host's `SlotLedger`): the same formulas on plain ints, without
# the NumPy scalar round trips that would dominate the host's per-step planning.
INTS = types.SimpleNamespace(maximum=max, minimum=min)


def ceil_div(a, b):
    """ceil(a / b) for non-negative a and positive b (ints, NumPy or jnp arrays)."""
    return -(-a // b)


def stale_range(h, window: int | None, sink_blocks: int, page_size: int, xp=np):
    """Stale blocks [start, end) of a sequence with history h for one life cycle.

    start = min(ceil(h/tpb), sink_blocks), end = max(start, floor((h + 1 - W)/tpb)); empty
    (end = start) for full layers (window None). A block is stale iff no query at a position
    >= h can see any of its tokens: its last token (o+1)*tpb - 1 <= h - W.
    """
    h = xp.maximum(h, 0)
    start = xp.minimum(ceil_div(h, page_size), sink_blocks)
    if window is None:
        return start, start
    end = xp.maximum(start, (h + 1 - window) // page_size)
    return start, end


def scratch_range(
    h, cap, window: int | None, sink_blocks: int, page_size: int, max_rewind: int, xp=np
):
    """Scratch range [begin, end) of a row growing from history h to cap this step.

    R = stale(cap - max_rewind) ∩ [ceil(h/tpb), ceil(cap/tpb)); empty (begin == end) for full
    layers and whenever nothing of the chunk is stale by the end of the step (decode).
    """
    lo = ceil_div(xp.maximum(h, 0), page_size)
    if window is None:
        return lo, lo
    start, end = stale_range(cap - max_rewind, window, sink_blocks, page_size, xp)
    begin = xp.maximum(start, lo)
    end = xp.maximum(begin, xp.minimum(end, ceil_div(cap, page_size)))
    return begin, end


def scratch_slot_count(num_blocks, scale: int):
    """n = ceil(|R| * roles / scale) scratch slots for |R| = num_blocks scratch blocks."""
    return ceil_div(num_blocks * 2, scale)


def rotation_pages(begin: int, end: int, scratch_slots, *, scale: int, layer_offset: int):
    """Pages (NumPy int array [end - begin]) of blocks begin..end-1 of one (layer, role).

    Concrete-value helper (tests, docs, the worked example). Raises ValueError when the scratch
    slots are too few for the range (n = ceil(|R| * 2 / scale) non-BAD slots needed) or when
    scale / layer_offset are inconsistent.
    """
    if scale <= 0 or scale % 2:
        raise ValueError(f"scale must be a positive even int (2 * layers), got {scale}")
    if not 0 <= layer_offset < scale:
        raise ValueError(f"layer_offset must be in [0, {scale}), got {layer_offset}")
    if end < begin or begin < 0:
        raise ValueError(f"scratch range must satisfy 0 <= begin <= end, got [{begin}, {end})")
    slots = np.asarray(scratch_slots, dtype=np.int64).reshape(-1)
    needed = scratch_slot_count(end - begin, scale)
    usable = int(np.sum(slots[:needed] != BAD)) if needed <= slots.size else -1
    if needed > slots.size or usable < needed:
        raise ValueError(
            f"scratch range [{begin}, {end}) with scale {scale} needs {needed} scratch slots, "
            f"got {slots.tolist()}"
        )
    p = np.arange(end - begin, dtype=np.int64)
    index, within = rotate(p, scale, layer_offset)
    return slots[index] * scale + within
