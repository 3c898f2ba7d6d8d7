"""Page-table gather: base tables + scratch descriptors + converters -> per-layer page tables.

Owns the argument layout of the gather (below), the scratch rotation formula (`rotate`), the
pure-jnp reference `page_table_gather_reference`, the Mosaic GPU kernel and the validated public
`page_table_gather`.

Axis names: B sequences (batch rows), NB blocks per table row, S scratch slots per row,
L layers of the pool, R = 2 roles (0 = K, 1 = V), C table blocks per CUDA block (`tile_blocks`).

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

Column property: every column [:, b, :, o] of a gathered table is fixed by its layer-0 K entry
p0 = [0, b, 0, o]: BAD everywhere when p0 is BAD, else, with phase = p0 mod scale (0 for a
converter page), page(j, r) = p0 - phase + (phase + 2 * j + r) mod scale. The kernel computes
p0 per block and expands it; the incremental mode (`out=`) relies on it.

Kernel (Mosaic GPU, sm90): one warpgroup per (row b, tile of C table blocks). It loads the
tile's base-table entries, computes p0 (the rotation, with a per-slot select loop, only when the
tile meets the row's scratch range: a per-tile scalar check is the fast path) and stores the
L * 2 rows of C entries straight from registers. With `out=` (a previous table of the same pool,
donated and aliased to the result) it first reads the tile's layer-0 K entries of `out` and
skips the whole tile when they equal p0: by the column property the other L * 2 - 1 rows are
then already right. A serving loop that passes the previous step's tables writes only the tiles
that changed (a block appended or released, a scratch range): the step costs the reads of the
base table and of one [B, NB] slice of the previous table instead of L * B * 2 * NB * 4 bytes
of writes. NB is padded to a multiple of 128 inside the kernel (in place only when NB already is).

Cost, Gemma 3 27B (52 sliding + 10 full layers), batch 256, 128K context, page 32 (NB = 4096):
a fresh table is 436 MB (sliding pool) + 84 MB (full pool) of writes whatever the row lengths
(the BAD tail is written too): 130 us for the kernel (4.0 TB/s) and 176 us for the reference
on the H200, so a fresh table cannot meet a 50 us step budget. In place, a decode step
reads 2 * 4 MB per pool (base table, layer-0 K slice of `out`) and writes the few tiles whose
rows gained or released a block (a 512-block tile of the sliding pool is 213 KB): 8.9 us for
rows of 8K-32K in decode, 13.9 us with 32 rows prefilling with scratch, 30.9 us with every row
at 128K (H200, `experiments/NOTES.md`). A compact
sliding table (a ring of ceil(W / tpb) + chunk blocks per row instead of NB, 32x smaller here)
would make even fresh tables cheap, but the attention and KV-write kernels would have to index
it modulo the ring: a change of the kernel-facing API, not made.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import _checks
from pallas_kernels._contract import BAD, rotate

# "auto" takes the kernel on a Hopper GPU: its compiled tests pass on the H200 and it beats
# the reference (fresh 520 MB table: 130 vs 176 us of kernel time; in place 9-31 us).
AUTO_USES_KERNEL = True
LANES = 128  # threads of the one warpgroup of a CUDA block; NB is padded to a multiple
TILE_BLOCKS = (512, 256, 128)  # default tile: the largest that divides the padded NB
MAX_UNROLL = 16  # scratch slots selected per tile by unrolled code; a loop beyond

__all__ = [
    "BAD",
    "page_table_gather",
    "page_table_gather_pallas",
    "page_table_gather_reference",
    "rotate",
]


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


def _round_up(a: int, b: int) -> int:
    return -(-a // b) * b


def _pick_tile(padded_blocks: int, tile_blocks: int | None) -> tuple[int, int]:
    """(C, vec): table blocks per CUDA block and int32 elements per thread and store."""
    if tile_blocks is None:
        tile_blocks = next(c for c in TILE_BLOCKS if padded_blocks % c == 0)
    if (
        not isinstance(tile_blocks, int)
        or isinstance(tile_blocks, bool)
        or tile_blocks <= 0
        or tile_blocks % LANES
        or padded_blocks % tile_blocks
    ):
        raise ValueError(
            f"tile_blocks must be a multiple of {LANES} dividing the padded max_blocks "
            f"({padded_blocks}), got {tile_blocks!r}"
        )
    vec = next(v for v in (4, 2, 1) if tile_blocks % (LANES * v) == 0)
    return tile_blocks, vec


def _gather_call(
    base_table,
    kv_lens,
    scratch_range,
    scratch_slots,
    out,
    *,
    num_layers: int,
    page_size: int,
    max_blocks: int,
    tile_blocks: int,
    vec: int,
    interpret,
):
    """Runs the kernel on NB-padded inputs; returns i32[L, B, 2, NB_pad] (`out` updated if given).

    base_table i32[B, NB_pad] (BAD past max_blocks), scratch_slots i32[B, S] with S >= 1.
    """
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    batch, padded_blocks = base_table.shape
    num_scratch = scratch_slots.shape[1]
    scale = 2 * num_layers
    C = tile_blocks
    incremental = out is not None
    layout = plgpu.Layout.WG_STRIDED((C,), vec_size=vec)
    # Distinct scratch slot indices (p // L) among the C consecutive blocks of a tile.
    num_select = min(num_scratch, -(-(C - 1) // num_layers) + 1)

    def body(kv_lens_ref, range_ref, slots_ref, base_ref, out_ref):
        b = lax.axis_index("b")
        o0 = pl.multiple_of(lax.axis_index("c") * C, C)
        cols = pl.ds(o0, C)
        extent = jnp.minimum(
            (jnp.maximum(kv_lens_ref[b], 0) + page_size - 1) // page_size, max_blocks
        )
        begin = range_ref[b, 0]
        end = range_ref[b, 1]
        blk = o0 + plgpu.broadcasted_iota(jnp.int32, (C,), 0, layout=layout)  # [C]
        valid = blk < extent
        base = base_ref[b, cols]  # [C]
        p0 = jnp.where(valid & (base != BAD), base * scale, BAD)  # [C] layer-0 K page

        def store(p0, phase):
            def layer(j, carry):
                for role in range(2):
                    off = 2 * j + role
                    if phase is None:
                        page = p0 + off
                    else:
                        x = phase + off  # < 2 * scale: one conditional subtract is the mod
                        page = p0 - phase + jnp.where(x >= scale, x - scale, x)
                    out_ref[j, b, role, cols] = jnp.where(p0 == BAD, BAD, page)
                return carry

            lax.fori_loop(0, num_layers, layer, jnp.int32(0))

        def emit(p0, phase):
            if not incremental:
                store(p0, phase)
                return
            # By the column property, equal layer-0 K entries mean an equal tile.
            prev = out_ref[0, b, 0, cols]  # [C]
            changed = jnp.max(jnp.where(p0 != prev, 1, 0)) > 0
            pl.when(changed)(lambda: store(p0, phase))

        has_scratch = (begin < end) & (begin < jnp.minimum(o0 + C, extent)) & (end > o0)

        @pl.when(jnp.logical_not(has_scratch))
        def _fast_path():
            emit(p0, None)

        @pl.when(has_scratch)
        def _rotation():
            in_scratch = valid & (blk >= begin) & (blk < end)  # [C]
            p = jnp.where(in_scratch, blk - begin, 0)
            index, within = rotate(p, scale, 0)  # [C] slot index, page within the slot
            first, _ = rotate(jnp.maximum(o0 - begin, 0), scale, 0)

            def select(i, slot):
                k = first + i
                s_k = slots_ref[b, jnp.minimum(k, num_scratch - 1)]
                s_k = jnp.where(k < num_scratch, s_k, BAD)
                return jnp.where(index == k, s_k, slot)

            slot = jnp.full((C,), BAD, jnp.int32)
            if num_select <= MAX_UNROLL:
                for i in range(num_select):
                    slot = select(i, slot)
            else:
                slot = lax.fori_loop(0, num_select, select, slot)
            rotated = jnp.where(slot != BAD, slot * scale + within, BAD)
            emit(jnp.where(in_scratch, rotated, p0), jnp.where(in_scratch, within, 0))

    table_type = jax.ShapeDtypeStruct((num_layers, batch, 2, padded_blocks), jnp.int32)
    kernel = plgpu.kernel(
        body,
        out_type=() if incremental else table_type,
        grid=(padded_blocks // C, batch),
        grid_names=("c", "b"),
        # Every thread reads and writes only its own elements (one strided layout for the
        # loads of `out` and the stores), so no barrier is needed around the stores.
        compiler_params=plgpu.CompilerParams(unsafe_no_auto_barriers=True),
        interpret=interpret,
    )
    if not incremental:
        return kernel(kv_lens, scratch_range, scratch_slots, base_table)
    # `out` enters as a mutable Ref: the kernel's writes become an input/output alias.
    out_ref = jax.new_ref(out)
    kernel(kv_lens, scratch_range, scratch_slots, base_table, out_ref)
    return jax.freeze(out_ref)


@functools.partial(
    jax.jit,
    static_argnames=("num_layers", "page_size", "tile_blocks", "interpret"),
    donate_argnames=("out",),
)
def _gather_pallas_jit(
    base_table,
    kv_lens,
    scratch_range,
    scratch_slots,
    out,
    *,
    num_layers,
    page_size,
    tile_blocks,
    interpret,
):
    batch, max_blocks = base_table.shape
    padded_blocks = _round_up(max_blocks, LANES)
    tile_blocks, vec = _pick_tile(padded_blocks, tile_blocks)
    if scratch_slots.shape[1] == 0:  # no slots: a non-empty scratch range reads BAD
        scratch_slots = jnp.full((batch, 1), BAD, jnp.int32)
    pad = padded_blocks - max_blocks
    if pad:  # a copy in and out; production tables (NB a multiple of 128) stay in place
        base_table = jnp.pad(base_table, ((0, 0), (0, pad)), constant_values=BAD)
        if out is not None:
            out = jnp.pad(out, ((0, 0), (0, 0), (0, 0), (0, pad)), constant_values=BAD)
    table = _gather_call(
        base_table,
        kv_lens,
        scratch_range,
        scratch_slots,
        out,
        num_layers=num_layers,
        page_size=page_size,
        max_blocks=max_blocks,
        tile_blocks=tile_blocks,
        vec=vec,
        interpret=interpret,
    )
    return table[..., :max_blocks] if pad else table


def page_table_gather_pallas(
    base_table,
    kv_lens,
    scratch_range,
    scratch_slots,
    *,
    num_layers: int,
    page_size: int,
    out=None,
    tile_blocks: int | None = None,
):
    """Mosaic GPU page-table gather (validated, non-empty inputs; see `page_table_gather`)."""
    _pick_tile(_round_up(base_table.shape[1], LANES), tile_blocks)  # ValueError before tracing
    return _gather_pallas_jit(
        base_table,
        kv_lens,
        scratch_range,
        scratch_slots,
        out,
        num_layers=num_layers,
        page_size=page_size,
        tile_blocks=tile_blocks,
        interpret=_checks.interpret_params(),
    )


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
    out=None,
    tile_blocks: int | None = None,
):
    """Per-layer page tables i32[num_layers, B, 2, NB] of one pool for one step.

    Validated entry point of the gather described in the module docstring.

    Args:
      base_table, kv_lens, scratch_range, scratch_slots, num_layers, page_size: see the module
        docstring.
      implementation: "reference" (pure jnp), "pallas" (Mosaic GPU kernel; GPU interpret mode
        off a Hopper GPU) or "auto" (the kernel on a Hopper GPU when NB is a multiple of 128,
        else the reference).
      out: optional i32[num_layers, B, 2, NB], the table this call updates: a table returned
        by an earlier `page_table_gather` of the same pool (any inputs), or all BAD. It is
        DONATED (do not use it afterwards; jit with it donated to update it in place): the
        kernel rewrites only the tiles whose entries change. The result equals the reference
        of this call's inputs on every element whatever those earlier inputs were; an `out`
        of another origin gives unspecified entries. The reference ignores it.
      tile_blocks: kernel tuning, table blocks per CUDA block (a multiple of 128 dividing NB
        rounded up to 128); default the largest of 512, 256, 128 that fits.
    """
    _checks.check_implementation(implementation)
    for name, v in (("num_layers", num_layers), ("page_size", page_size)):
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"{name} must be a positive static int, got {v!r}")
    if getattr(base_table, "ndim", None) != 2:
        raise ValueError(
            "base_table must have shape [batch, max_blocks], got "
            f"{getattr(base_table, 'shape', None)}"
        )
    batch, max_blocks = base_table.shape
    _check_int32(base_table, "base_table", tuple(base_table.shape), "[batch, max_blocks]")
    _check_int32(kv_lens, "kv_lens", (batch,), "[batch]")
    _check_int32(scratch_range, "scratch_range", (batch, 2), "[batch, 2]")
    if getattr(scratch_slots, "ndim", None) != 2 or scratch_slots.shape[0] != batch:
        raise ValueError(
            f"scratch_slots must have shape [batch={batch}, num_scratch], "
            f"got {getattr(scratch_slots, 'shape', None)}"
        )
    _check_int32(scratch_slots, "scratch_slots", tuple(scratch_slots.shape), "[batch, num_scratch]")
    if out is not None:
        _check_int32(out, "out", (num_layers, batch, 2, max_blocks), "[num_layers, batch, 2, NB]")
    # "auto": NB-padded tables (a copy in and out of the kernel) stay on the reference.
    use_pallas = implementation == "pallas" or (
        AUTO_USES_KERNEL
        and implementation == "auto"
        and _checks.on_hopper()
        and max_blocks % LANES == 0
    )
    if use_pallas and batch and max_blocks:
        return page_table_gather_pallas(
            base_table,
            kv_lens,
            scratch_range,
            scratch_slots,
            num_layers=num_layers,
            page_size=page_size,
            out=out,
            tile_blocks=tile_blocks,
        )
    if tile_blocks is not None:
        _pick_tile(_round_up(max(max_blocks, 1), LANES), tile_blocks)
    return page_table_gather_reference(
        base_table,
        kv_lens,
        scratch_range,
        scratch_slots,
        num_layers=num_layers,
        page_size=page_size,
    )
