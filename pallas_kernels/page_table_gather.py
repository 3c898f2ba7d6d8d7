"""Page-table gather: base tables + scratch descriptors + converters -> per-layer page tables.

Owns the argument layout of the gather (below), the scratch rotation formula (`rotate`), the
pure-jnp reference `page_table_gather_reference` and the validated public `page_table_gather`.
A Mosaic GPU kernel may be added beside the reference; it must consume exactly this layout.

Axis names: B sequences (batch rows), NB blocks per table row, S scratch slots per row,
L layers of the pool, R = 2 roles (0 = K, 1 = V).

Argument layout (all int32, static shapes, row-major, no padding semantics beyond BAD = -1):

  base_table     i32[B, NB]  slot id of block o of row b in this pool's group, BAD = -1 when the
                             block has no normal slot (unallocated, released or scratch-backed).
  kv_lens        i32[B]      context length of row b after this step (the capacity `cap`); only
                             blocks o < ceil(kv_lens[b] / page_size) are written, BAD elsewhere.
  scratch_range  i32[B, 2]   [begin, end) blocks of row b backed by scratch this step; empty
                             (begin >= end, e.g. BAD, BAD) when the row has no scratch.
  scratch_slots  i32[B, S]   the row's scratch slot ids in rotation order, BAD-padded.
  num_layers     static int  L, layers of the pool; scale = 2 * L pages per slot.
  page_size      static int  tokens per block (tpb).

Output: i32[L, B, 2, NB]; entry [j, b, r, o] is the page of block o of row b for layer j, role r:

  o >= ceil(kv_lens[b] / page_size)          -> BAD
  scratch_range[b, 0] <= o < scratch_range[b, 1] (rotation):
      p = o - begin, t = 2 * p, slot = scratch_slots[b, t // scale],
      page = slot * scale + ((t mod scale) + 2 * j + r) mod scale      (BAD if slot is BAD)
  otherwise (converter): base_table[b, o] * scale + 2 * j + r, BAD passed through unchanged.

So V = K + 1 everywhere. When no row of the batch has scratch, a fast path skips the rotation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels._checks import BAD

IMPLEMENTATIONS = ("auto", "reference")

__all__ = ["BAD", "page_table_gather", "page_table_gather_reference", "rotate"]


def rotate(p, scale: int, layer_offset):
    """Scratch rotation of relative block p: (index into the scratch slots, page within slot).

    Works on Python ints, NumPy and jnp arrays. `scale` is even and `layer_offset` = 2*j + role,
    so the page within the slot keeps the role's parity: V = K + 1.
    """
    t = p * 2
    return t // scale, (t % scale + layer_offset) % scale


def _ceil_div(a, b):
    return -(-a // b)


def page_table_gather_reference(
    base_table, kv_lens, scratch_range, scratch_slots, *, num_layers: int, page_size: int
):
    """Pure-jnp page-table gather; see the module docstring. Returns i32[L, B, 2, NB]."""
    batch, max_blocks = base_table.shape
    if scratch_slots.shape[1] == 0:  # no slots: a non-empty scratch range reads BAD
        scratch_slots = jnp.full((batch, 1), BAD, jnp.int32)
    num_scratch = scratch_slots.shape[1]
    scale = 2 * num_layers
    blk = jnp.arange(max_blocks, dtype=jnp.int32)[None, :]  # [1, NB]
    valid = blk < _ceil_div(kv_lens, page_size)[:, None]  # [B, NB]
    base = jnp.where(valid, base_table, BAD)  # [B, NB]
    layer_offset = (
        2 * jnp.arange(num_layers, dtype=jnp.int32)[:, None] + jnp.arange(2, dtype=jnp.int32)
    )[:, None, :, None]  # [L, 1, 2, 1]

    def converted():
        b = base[None, :, None, :]  # [1, B, 1, NB]
        return jnp.where(b == BAD, BAD, b * scale + layer_offset)  # [L, B, 2, NB]

    def rotated():
        begin = scratch_range[:, 0:1]  # [B, 1]
        end = scratch_range[:, 1:2]  # [B, 1]
        in_scratch = valid & (blk >= begin) & (blk < end)  # [B, NB]
        p = jnp.where(in_scratch, blk - begin, 0)  # [B, NB]
        index, _ = rotate(p, scale, 0)
        slot = jnp.take_along_axis(scratch_slots, jnp.minimum(index, num_scratch - 1), axis=1)
        slot_ok = in_scratch & (index < num_scratch) & (slot != BAD)  # [B, NB]
        _, within = rotate(p[None, :, None, :], scale, layer_offset)  # [L, B, 2, NB]
        page = slot[None, :, None, :] * scale + within
        page = jnp.where(slot_ok[None, :, None, :], page, BAD)
        return jnp.where(in_scratch[None, :, None, :], page, converted())

    any_scratch = jnp.any(scratch_range[:, 0] < scratch_range[:, 1])
    return jax.lax.cond(any_scratch, rotated, converted)


def _check_int32(x, name: str, shape: tuple[int, ...], what: str):
    if not hasattr(x, "shape") or tuple(x.shape) != shape:
        raise ValueError(f"{name} must have shape {what} = {shape}, got {getattr(x, 'shape', x)}")
    if jnp.dtype(x.dtype) != jnp.dtype(jnp.int32):
        raise TypeError(f"{name} must be int32, got {x.dtype}")


def page_table_gather(
    base_table,
    kv_lens,
    scratch_range,
    scratch_slots,
    *,
    num_layers: int,
    page_size: int,
    implementation: str = "auto",
):
    """Per-layer page tables i32[num_layers, B, 2, NB] of one pool for one step.

    Validated entry point of the gather described in the module docstring. `implementation`:
    "reference" (pure jnp) or "auto" (the best available; the reference until a kernel lands).
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    for name, v in (("num_layers", num_layers), ("page_size", page_size)):
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"{name} must be a positive static int, got {v!r}")
    if getattr(base_table, "ndim", None) != 2:
        raise ValueError(
            "base_table must have shape [batch, max_blocks], got "
            f"{getattr(base_table, 'shape', None)}"
        )
    batch, _ = base_table.shape
    _check_int32(base_table, "base_table", tuple(base_table.shape), "[batch, max_blocks]")
    _check_int32(kv_lens, "kv_lens", (batch,), "[batch]")
    _check_int32(scratch_range, "scratch_range", (batch, 2), "[batch, 2]")
    if getattr(scratch_slots, "ndim", None) != 2 or scratch_slots.shape[0] != batch:
        raise ValueError(
            f"scratch_slots must have shape [batch={batch}, num_scratch], "
            f"got {getattr(scratch_slots, 'shape', None)}"
        )
    _check_int32(scratch_slots, "scratch_slots", tuple(scratch_slots.shape), "[batch, num_scratch]")
    return page_table_gather_reference(
        base_table,
        kv_lens,
        scratch_range,
        scratch_slots,
        num_layers=num_layers,
        page_size=page_size,
    )
