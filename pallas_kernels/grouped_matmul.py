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

Tiles: 64 x 64 (K) x 128 (N, 64 when N is not a multiple of 128), 128 rows once M reaches 4096
(prefill), four stages of copies in flight: at most (128*64 + 64*128) * 2 B * 4 + 128*128*2 B
= 160 KiB of shared memory, inside the 227 KiB of an H100/H200 block.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import _checks

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


def grouped_matmul(lhs, rhs, group_sizes, *, implementation: str = "auto"):
    """lhs [M, K] (rows sorted by group) x rhs [G, K, N] per group -> [M, N] in lhs.dtype.

    Args:
      group_sizes: i32[G] rows of each group, summing to M (the caller's invariant: rows past
        the sum are not written by the kernel).
      implementation: "auto", "reference" or "pallas" (see the module text).
    """
    _check(lhs, rhs, group_sizes, implementation)
    use = implementation == "pallas" or (
        implementation == "auto" and _checks.on_hopper() and _kernel_takes(lhs, rhs)
    )
    if not use:
        return grouped_matmul_reference(lhs, rhs, group_sizes)
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    m, n = lhs.shape[0], rhs.shape[2]
    return ragged_dot_mgpu.ragged_dot(
        lhs, rhs, group_sizes=group_sizes.astype(jnp.int32), **tiles(m, n)
    )
