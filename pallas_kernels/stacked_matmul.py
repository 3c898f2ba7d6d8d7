"""Stacked matmul: a skinny product with one layer's matrix read where it lies in a stack.

`stacked_matmul(x [M, K], stack [L, K, N], index) -> [M, N]` is `x @ stack[index]` for a
traced `index`, the product a layer-scanned model makes at every weight matrix of a decode
step. Slicing `stack[index]` under `lax.scan` makes XLA copy the matrix before the GEMM reads
it (a device-to-device copy per matrix per layer per step); this kernel reads the layer's
matrix in the stack instead, so a decode step moves each weight once.

Implementations:
- "reference": `jnp.dot` of x with the dynamically indexed matrix, float32 accumulation
  (XLA copies the slice first; on CPU it is the same numbers the model's einsum gives).
- "pallas": the Mosaic GPU kernel (Hopper, WGMMA; interpret mode off a GPU). Each program is
  one (row tile, column block, K split): `_wgmma_stream.stream_tile` streams its share of
  layer `index`'s [K, block_n] columns through shared memory, 64 or 128 rows of x at a time
  (rows past M read as zero and are never stored). With one K split the tile is stored in x's
  dtype; with several, each split stores float32 partial sums [splits, M, N] and XLA adds
  them. Needs bf16/f16 operands of one dtype, K a multiple of 64 and N a multiple of 64.
- "auto": "pallas" on a Hopper GPU (or under `_checks.force_compiled` / `force_interpret`)
  where the kernel takes the operands and M is at most `MAX_ROWS`; else "reference". Above
  MAX_ROWS (prefill steps) the product is compute-bound: the copy of the matrix is a few % of
  its GEMM, which XLA's own GEMMs run at the matmul rate.

Tiling (`tiling(m, k, n)`): the memory-bound product wants every SM streaming weights. Column
blocks of 128 (64 where N is not a multiple of 128) give N / block_n programs; K is split
until there are about two programs per SM (`TARGET_PROGRAMS`), each split keeping at least
`MIN_SPLIT_STEPS` K blocks so that its copies pipeline, and no further once the float32
partials would add more than `MAX_PARTIAL_SHARE` of the weights' bytes (they grow with M).

Axes: M rows (tokens), K contracted width, N output width, L stacked layers.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels import _checks
from pallas_kernels._wgmma_stream import DELAY_RELEASE, stream_tile

IMPLEMENTATIONS = ("auto", "reference", "pallas")
BLOCK_K = 64
MAX_ROWS = 256  # decode steps' rows; "auto" leaves larger products to XLA
NUM_SMS = 132  # H100 / H200 SXM
TARGET_PROGRAMS = 2 * NUM_SMS
MIN_SPLIT_STEPS = 4
MAX_PARTIAL_SHARE = 0.125
_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@dataclasses.dataclass(frozen=True)
class Tiling:
    """One product's tiles: rows and columns of an output tile, K block, K splits (each a
    contiguous run of K blocks) and K blocks of copies in flight."""

    block_m: int = 64
    block_n: int = 128
    block_k: int = BLOCK_K
    splits: int = 1
    stages: int = 4

    def check(self, m: int, k: int, n: int) -> None:
        if self.block_m not in (64, 128):
            raise ValueError(f"block_m must be 64 or 128, got {self.block_m}")
        if self.block_n % 64 or not 64 <= self.block_n <= 256 or n % self.block_n:
            raise ValueError(f"block_n={self.block_n} must be 64..256 in 64s and divide N={n}")
        if self.block_k % 64 or k % self.block_k:
            raise ValueError(f"block_k={self.block_k} must be a multiple of 64 dividing K={k}")
        steps = k // self.block_k
        if self.splits < 1 or steps % self.splits:
            raise ValueError(f"splits={self.splits} must divide the {steps} K blocks")
        if self.stages <= DELAY_RELEASE:
            raise ValueError(f"stages must be more than {DELAY_RELEASE}, got {self.stages}")


def tiling(m: int, k: int, n: int) -> Tiling:
    """The default tiles of an [m, k] x [k, n] product (see the module text)."""
    block_m = 64 if m <= 64 else 128
    block_n = 128 if n % 128 == 0 else 64
    steps = k // BLOCK_K
    programs = -(-m // block_m) * (n // block_n)
    splits = 1
    for s in range(2, steps // MIN_SPLIT_STEPS + 1):
        if programs * splits >= TARGET_PROGRAMS:
            break
        if steps % s:
            continue
        # float32 partials written and read again, against the weights' k * n * 2 bytes
        if 2 * s * m * n * 4 > MAX_PARTIAL_SHARE * k * n * 2:
            break
        splits = s
    return Tiling(block_m=block_m, block_n=block_n, splits=splits)


def supports(dtype, k: int, n: int) -> bool:
    """Whether the kernel takes [M, k] x [L, k, n] operands of `dtype`."""
    return jnp.dtype(dtype) in _DTYPES and k % BLOCK_K == 0 and n % 64 == 0


def stacked_matmul_reference(x, stack, index):
    """x [M, K] @ stack[index] -> [M, N] in x.dtype, float32 accumulation."""
    w = jax.lax.dynamic_index_in_dim(stack, jnp.asarray(index, jnp.int32), 0, keepdims=False)
    return jnp.dot(x, w.astype(x.dtype), preferred_element_type=jnp.float32).astype(x.dtype)


def _check(x, stack, index, implementation):
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    if getattr(x, "ndim", None) != 2 or getattr(stack, "ndim", None) != 3:
        raise ValueError(
            f"x must be [M, K] and stack [L, K, N], got shapes {getattr(x, 'shape', None)} and "
            f"{getattr(stack, 'shape', None)}"
        )
    if x.shape[1] != stack.shape[1]:
        raise ValueError(f"x K={x.shape[1]} must equal stack K={stack.shape[1]}")
    if jnp.ndim(index) != 0 or not jnp.issubdtype(jnp.result_type(index), jnp.integer):
        raise ValueError(f"index must be an integer scalar, got {index!r}")
    if isinstance(index, int) and not 0 <= index < stack.shape[0]:
        raise ValueError(f"index must be in [0, {stack.shape[0]}), got {index}")
    if implementation == "pallas" and not _kernel_takes(x, stack):
        raise ValueError(
            "the Pallas stacked matmul needs bf16 or f16 operands of one dtype, K a multiple of "
            f"{BLOCK_K} and N a multiple of 64; got x {x.dtype} {x.shape}, stack {stack.dtype} "
            f"{stack.shape}"
        )


def _kernel_takes(x, stack) -> bool:
    return jnp.dtype(x.dtype) == jnp.dtype(stack.dtype) and supports(x.dtype, *stack.shape[1:])


def uses_kernel(x, stack, implementation: str = "auto") -> bool:
    """Whether `stacked_matmul` runs the Pallas kernel for these operands."""
    return implementation == "pallas" or (
        implementation == "auto"
        and x.shape[0] <= MAX_ROWS
        and (_checks.on_hopper() or _checks.kernels_forced())
        and _kernel_takes(x, stack)
    )


def stacked_matmul(x, stack, index, *, implementation: str = "auto", tiles: Tiling | None = None):
    """x [M, K] @ stack[index] ([L, K, N] stack, index an i32 scalar, traced or not) -> [M, N]
    in x.dtype, reading only layer `index` of the stack (see the module text).

    Args:
      implementation: "auto", "reference" or "pallas".
      tiles: the kernel's `Tiling` (default `tiling(M, K, N)`); for benchmarks.
    """
    _check(x, stack, index, implementation)
    if not uses_kernel(x, stack, implementation):
        return stacked_matmul_reference(x, stack, index)
    m, k = x.shape
    tiles = tiling(m, k, stack.shape[2]) if tiles is None else tiles
    tiles.check(m, k, stack.shape[2])
    return _stacked_matmul_kernel(x, stack, jnp.asarray(index, jnp.int32).reshape(1), tiles)


def _stacked_matmul_kernel(x, stack, index, tiles: Tiling):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    m, k = x.shape
    n = stack.shape[2]
    bm, bn = tiles.block_m, tiles.block_n
    row_tiles = -(-m // bm)
    rows = m if m <= 8 else -(-m // 8) * 8  # TMA takes rows in 8s (or fewer than 8)
    if rows != m:
        x = jnp.pad(x, ((0, rows - m), (0, 0)))
    steps = k // tiles.block_k // tiles.splits
    out_dtype = x.dtype if tiles.splits == 1 else jnp.float32

    def body(index_ref, x_ref, stack_ref, out_ref, o_smem):
        row = jax.lax.axis_index("m")
        col = jax.lax.axis_index("n")
        split = jax.lax.axis_index("k")

        def tile(acc_ref):
            stream_tile(
                acc_ref,
                x_ref,
                stack_ref.at[index_ref[0]],
                row_block=row,
                col_block=col,
                k_first=split * steps,
                k_steps=steps,
                block_k=tiles.block_k,
                stages=tiles.stages,
            )
            return acc_ref[...]  # waits for the last WGMMA

        acc = pl.run_scoped(tile, plgpu.ACC((bm, bn)))
        o_smem[...] = acc.astype(out_dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, out_ref.at[split, pl.ds(row * bm, bm), pl.ds(col * bn, bn)])
        plgpu.wait_smem_to_gmem(0)

    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((tiles.splits, rows, n), out_dtype),
        grid=(row_tiles, n // bn, tiles.splits),
        grid_names=("m", "n", "k"),
        scratch_types=[plgpu.SMEM((bm, bn), out_dtype)],
        interpret=_checks.interpret_params(),
    )
    out = kernel(index, x, stack)
    if tiles.splits > 1:
        out = jnp.sum(out, axis=0)
    return out.reshape(rows, n)[:m].astype(x.dtype)
