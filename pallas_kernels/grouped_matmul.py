"""Grouped matmul, the mixture-of-experts product: rows sorted by group, one matrix per group.

`grouped_matmul(lhs [M, K], rhs [G, K, N], group_sizes i32[G]) -> [M, N]`: rows
[sum(group_sizes[:g]), sum(group_sizes[:g + 1])) of `lhs` are multiplied by `rhs[g]`
(`sum(group_sizes) == M`).

Implementations:
- "reference": `jax.lax.ragged_dot`. On CPU XLA runs it group by group; on the GPU XLA rewrites
  it into a dense dot over every group, G times the FLOPs and an [G, M, N]-sized temporary
  (Gemma 4 26B-A4B, 128 experts: 48 GiB for one prefill chunk), so it cannot serve MoE models
  there.
- "pallas": the Mosaic GPU (Hopper, wgmma) grouped matmul that JAX ships as
  `jax.experimental.pallas.ops.gpu.ragged_dot_mgpu`: persistent CTAs walk (row tile, column
  tile) pairs where a row tile that straddles a group boundary is computed once per group and
  stored with masked TMA copies. Each group's weights are read once per row tile it owns, so an
  MoE step reads about the chosen experts' weights plus the token copies. Compiled only (it has
  no interpret mode); needs bf16/f16 operands of one dtype, K a multiple of 64 and N a multiple
  of 64.
- "auto": "pallas" on a Hopper GPU where `supports` holds, else "reference".

With `group_offset`, `group_sizes` (E entries) describes groups [offset, offset + E) of a larger
stack `rhs` [G, K, N], e.g. one layer's experts in a stack of every layer's: the products read
those groups where they lie, without copying them out of the stack. There "pallas" is this
module's tile kernel (`tile_grouped_matmul`): the JAX side lists a tile per (non-empty group,
64-row block it has rows in), and the kernel runs those tiles only, each through the K loop
of its group's matrix, into a tile-padded output that a gather puts back in row order. The
whole stack is never walked (the kernel above walks M / 64 + G - 1 row tiles and unrolls its
group search over G, so a stack of several layers' experts would multiply its work and its
code by the layers). It has an interpret mode (`_checks.interpret_params`).

Tiles: 64 x 64 (K) x 128 (N, 64 when N is not a multiple of 128), 128 rows once M reaches 4096
(prefill), four stages of copies in flight: at most (128*64 + 64*128) * 2 B * 4 + 128*128*2 B
= 160 KiB of shared memory, inside the 227 KiB of an H100/H200 block.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import _checks
from pallas_kernels._wgmma_stream import stream_tile

IMPLEMENTATIONS = ("auto", "reference", "pallas")
BLOCK_K = 64
_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def tiles(m: int, n: int) -> dict:
    """The kernel's tile sizes for an [m, K] x [K, n] group product (see the module text)."""
    return dict(
        block_m=128 if m >= 4096 else 64,
        block_n=128 if n % 128 == 0 else 64,
        block_k=BLOCK_K,
        max_concurrent_steps=4,
        grid_block_n=1,
    )


def supports(dtype, k: int, n: int) -> bool:
    """Whether the Pallas kernel takes [M, k] x [G, k, n] operands of `dtype`."""
    return jnp.dtype(dtype) in _DTYPES and k % BLOCK_K == 0 and n % 64 == 0


def _kernel_takes(lhs, rhs) -> bool:
    return jnp.dtype(lhs.dtype) == jnp.dtype(rhs.dtype) and supports(lhs.dtype, *rhs.shape[1:])


def grouped_matmul_reference(lhs, rhs, group_sizes):
    """`jax.lax.ragged_dot` (see the module text for its cost on the GPU)."""
    return jax.lax.ragged_dot(lhs, rhs, group_sizes)


def _use_kernel(lhs, rhs, implementation) -> bool:
    """Whether a checked call runs a Pallas kernel: asked for, or 'auto' on Hopper."""
    return implementation == "pallas" or (
        implementation == "auto" and _checks.on_hopper() and _kernel_takes(lhs, rhs)
    )


def _check(lhs, rhs, group_sizes, implementation):
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    if getattr(lhs, "ndim", None) != 2 or getattr(rhs, "ndim", None) != 3:
        raise ValueError(
            f"lhs must be [M, K] and rhs [G, K, N], got shapes {getattr(lhs, 'shape', None)} "
            f"and {getattr(rhs, 'shape', None)}"
        )
    if lhs.shape[1] != rhs.shape[1]:
        raise ValueError(f"lhs K={lhs.shape[1]} must equal rhs K={rhs.shape[1]}")
    if getattr(group_sizes, "shape", None) != (rhs.shape[0],):
        raise ValueError(
            f"group_sizes must be i32[{rhs.shape[0]}] (one per group of rhs), got shape "
            f"{getattr(group_sizes, 'shape', None)}"
        )
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"group_sizes must be integer, got {group_sizes.dtype}")
    if implementation == "pallas" and not _kernel_takes(lhs, rhs):
        raise ValueError(
            "the Pallas grouped matmul needs bf16 or f16 operands of one dtype, K a multiple of "
            f"{BLOCK_K} and N a multiple of 64; got lhs {lhs.dtype} {lhs.shape}, rhs {rhs.dtype} "
            f"{rhs.shape}"
        )


def grouped_matmul(lhs, rhs, group_sizes, *, group_offset=None, implementation: str = "auto"):
    """lhs [M, K] (rows sorted by group) x rhs [G, K, N] per group -> [M, N] in lhs.dtype.

    Args:
      group_sizes: i32[G] rows of each group, summing to M (the caller's invariant: rows past
        the sum are not written by the kernel); with `group_offset`, i32[E] for groups
        [group_offset, group_offset + E) of rhs.
      group_offset: None, or the first group of rhs that `group_sizes` describes (int or i32
        scalar; the caller keeps it in [0, G - E]).
      implementation: "auto", "reference" or "pallas" (see the module text).
    """
    if group_offset is not None:
        return _offset_grouped_matmul(lhs, rhs, group_sizes, group_offset, implementation)
    _check(lhs, rhs, group_sizes, implementation)
    if not _use_kernel(lhs, rhs, implementation):
        return grouped_matmul_reference(lhs, rhs, group_sizes)
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    m, n = lhs.shape[0], rhs.shape[2]
    return ragged_dot_mgpu.ragged_dot(
        lhs, rhs, group_sizes=group_sizes.astype(jnp.int32), **tiles(m, n)
    )


# ------------------------------------------------------------------ groups within a larger stack
TILE_ROWS = 64  # rows of one tile: one warpgroup's WGMMA
TILE_STEPS = 4  # K blocks of copies in flight (see `_wgmma_stream`)


def _offset_grouped_matmul(lhs, rhs, group_sizes, group_offset, implementation):
    sizes_shape = getattr(group_sizes, "shape", None)
    if getattr(rhs, "ndim", None) != 3 or sizes_shape is None or len(sizes_shape) != 1:
        raise ValueError(
            f"with group_offset, rhs must be [G, K, N] and group_sizes i32[E], got shapes "
            f"{getattr(rhs, 'shape', None)} and {sizes_shape}"
        )
    e, g = sizes_shape[0], rhs.shape[0]
    if e > g:
        raise ValueError(f"group_sizes describes {e} groups but rhs has only {g}")
    if isinstance(group_offset, int) and not 0 <= group_offset <= g - e:
        raise ValueError(
            f"group_offset must be in [0, {g - e}] for {e} of {g} groups, got {group_offset}"
        )
    # the contract on the E groups' slice (shapes only: the slice is never materialised here)
    _check(lhs, jax.ShapeDtypeStruct((e, *rhs.shape[1:]), rhs.dtype), group_sizes, implementation)
    offset = jnp.asarray(group_offset, jnp.int32)
    if not _use_kernel(lhs, rhs, implementation):
        part = jax.lax.dynamic_slice_in_dim(rhs, offset, e, axis=0)
        return grouped_matmul_reference(lhs, part, group_sizes)
    return tile_grouped_matmul(lhs, rhs, group_sizes.astype(jnp.int32), offset)


def tile_plan(group_sizes, num_rows: int, rows: int = TILE_ROWS):
    """The tiles that cover each group's rows, for M = num_rows rows sorted by group: one per
    (group, aligned block of `rows` rows the group has rows in); a block that straddles groups
    is computed once per group, each keeping its own rows. Empty groups get no tile.

    Returns (tile_group i32[T], tile_block i32[T], num_tiles i32[], row_slot i32[M]): tile
    t < num_tiles multiplies rows [tile_block[t] * rows, + rows) by group tile_group[t] (of
    the E groups), and row i's product lands at row row_slot[i] of the tile-padded output.
    T = ceil(M / rows) + min(E, M) bounds the tiles of any sizes summing to M."""
    e = group_sizes.shape[0]
    max_tiles = -(-num_rows // rows) + min(e, num_rows)
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    first = starts // rows
    tiles = jnp.where(sizes > 0, (ends - 1) // rows - first + 1, 0)
    tile_ends = jnp.cumsum(tiles)
    tile_begins = tile_ends - tiles
    t = jnp.arange(max_tiles, dtype=jnp.int32)
    group = jnp.minimum(
        jnp.searchsorted(tile_ends, t, side="right", method="compare_all"), e - 1
    ).astype(jnp.int32)
    block = first[group] + t - tile_begins[group]
    i = jnp.arange(num_rows, dtype=jnp.int32)
    row_group = jnp.minimum(jnp.searchsorted(ends, i, side="right", method="compare_all"), e - 1)
    row_slot = (tile_begins[row_group] + i // rows - first[row_group]) * rows + i % rows
    return group, block.astype(jnp.int32), tile_ends[-1], row_slot.astype(jnp.int32)


def tile_grouped_matmul(lhs, rhs, group_sizes, group_offset):
    """The tile kernel: lhs [M, K] (rows sorted by group) x groups [offset, offset + E) of rhs
    [G, K, N], E = len(group_sizes) -> [M, N]. Each program is one (tile, column block): if
    the tile exists (`tile_plan`), its block of 64 rows times its group's [K, block_n] columns,
    K streamed in 64-deep blocks; the tile-padded output is then gathered back to row order,
    which keeps each row's product by its own group."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    m, k = lhs.shape
    n = rhs.shape[2]
    block_n = 128 if n % 128 == 0 else 64
    group, block, num_tiles, row_slot = tile_plan(group_sizes, m)
    group = group + group_offset
    max_tiles = group.shape[0]
    pad = -m % TILE_ROWS  # whole blocks of rows
    if pad:
        lhs = jnp.concatenate([lhs, jnp.zeros((pad, k), lhs.dtype)])

    def body(group_ref, block_ref, count_ref, lhs_ref, rhs_ref, out_ref):
        t = jax.lax.axis_index("t")
        col = jax.lax.axis_index("n")

        @pl.when(t < count_ref[0])
        def _():
            def tile(acc_ref):
                stream_tile(
                    acc_ref,
                    lhs_ref,
                    rhs_ref.at[group_ref[t]],
                    row_block=block_ref[t],
                    col_block=col,
                    k_first=0,
                    k_steps=k // BLOCK_K,
                    block_k=BLOCK_K,
                    stages=TILE_STEPS,
                )
                return acc_ref[...]  # waits for the last WGMMA

            acc = pl.run_scoped(tile, plgpu.ACC((TILE_ROWS, block_n)))
            out_ref[pl.ds(t * TILE_ROWS, TILE_ROWS), pl.ds(col * block_n, block_n)] = acc.astype(
                out_ref.dtype
            )

    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((max_tiles * TILE_ROWS, n), lhs.dtype),
        grid=(max_tiles, n // block_n),
        grid_names=("t", "n"),
        interpret=_checks.interpret_params(),
    )
    padded = kernel(group, block, num_tiles.reshape(1), lhs, rhs)
    return padded[row_slot]
