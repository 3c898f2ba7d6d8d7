"""Pieces shared by the Mosaic GPU paged attention kernels (decode and ragged prefill).

`issue_pages` streams one pipeline step of K or V pages into an SMEM ring slot by TMA, the
page ids read from the page table (`step_pages`, then `copy_pages`; `PageIssuer` binds them to
a CUDA block's K and V rings); `softmax_step` is the float32 online-softmax update in log2
units, over the columns (keys along rows of the query tile) or the rows (the decode kernel's
producer schedule, keys as WGMMA rows); `dequant` turns an fp8 SMEM chunk into float16 for
WGMMA. Also the supported shapes and the trace-time checks of the tuning knobs both kernels
share.

Axis names: S page_size, T tokens per step (block_kv), D head_dim.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import _checks
from pallas_kernels._contract import MASK_VALUE

ROWS = 64  # WGMMA M: rows of one warpgroup's query tile.

LOG2E = math.log2(math.e)
SMEM_LIMIT = 227 * 1024
SWIZZLE = 128
HEAD_DIMS = (64, 128, 256, 512)
PAGE_SIZES = (8, 16, 32, 64, 128, 256)


def compute_dtype(pool_dtype):
    """WGMMA operand dtype of a pool dtype; None for float32 pools (not supported)."""
    if _checks.is_fp8(pool_dtype):
        return jnp.dtype(jnp.float16)  # e4m3 -> f16 is one cvt; e4m3 -> bf16 is not in hardware
    if jnp.dtype(pool_dtype) == jnp.dtype(jnp.float32):
        return None
    return jnp.dtype(pool_dtype)


def check_shape(kernel: str, head_dim: int, page_size: int) -> None:
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"{kernel} kernel head_dim must be one of {HEAD_DIMS}, got {head_dim}")
    if page_size not in PAGE_SIZES:
        raise ValueError(f"{kernel} kernel page_size must be one of {PAGE_SIZES}, got {page_size}")


def check_block_kv(block_kv: int, page_size: int, allow_32: bool = False) -> None:
    """block_kv: a multiple of 64 (or 32 when `allow_32`: 16-bit pools, whose [64, 32] P tile
    and V take a 64-byte swizzle; 96 or 160 would need K % 64 == 0 at the 128-byte swizzle)
    and a multiple or a divisor of page_size."""
    if not (block_kv >= 64 and block_kv % 64 == 0 or allow_32 and block_kv == 32):
        allowed = "32 or a multiple of 64" if allow_32 else "a multiple of 64"
        raise ValueError(f"block_kv must be {allowed}, got {block_kv}")
    if block_kv % page_size and page_size % block_kv:
        raise ValueError(
            f"block_kv ({block_kv}) must be a multiple or a divisor of page_size ({page_size})"
        )


def transforms(dtype, swizzle=SWIZZLE):
    """Tiling + swizzle (bytes) of a WGMMA operand in SMEM."""
    bits = 8 * jnp.dtype(dtype).itemsize
    return (plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle))


def row_swizzle(cols, dtype) -> int:
    """The swizzle of a tile whose rows hold `cols` elements: 128 bytes, or the row's bytes when
    shorter (a [64, 32] bf16 P tile: 64). WGMMA takes A and B with one swizzle."""
    return min(SWIZZLE, cols * jnp.dtype(dtype).itemsize)


def step_pages(pt_ref, *, b, role, step, block_kv, page_size, lo_blk, hi_blk, max_blocks):
    """The page reads of tokens [step * T, (step + 1) * T) of role (0 K, 1 V): a list of
    (page id, rows of the page) in ring-row order.

    Blocks outside [lo_blk, hi_blk) are never read: such a part of a step re-reads an in-range
    page (its logits are masked), so BAD and out-of-window pages stay untouched. The page ids
    are scalar loads from GMEM; a caller that has to wait before it may copy issues them first,
    so their latency overlaps the wait.
    """
    pages_per_step = max(1, block_kv // page_size)
    copy_rows = min(block_kv, page_size)
    tok0 = step * block_kv
    reads = []
    for i in range(pages_per_step):
        if block_kv >= page_size:
            blk = step * pages_per_step + i
            rows = slice(None)
        else:
            blk = tok0 // page_size
            # Tiled SMEM needs tile-aligned GMEM offsets; the offset is a multiple of T.
            rows = pl.ds(pl.multiple_of(tok0 % page_size, block_kv), copy_rows)
        blk = jnp.minimum(jnp.clip(blk, lo_blk, hi_blk - 1), max_blocks - 1)
        reads.append((jnp.maximum(pt_ref[b, role, blk], 0), rows))
    return reads


def copy_pages(pool_ref, reads, dst, bar, *, kv_head):
    """TMA-copies the `step_pages` reads of one KV head into dst [T, D], arriving on bar."""
    copy_rows = dst.shape[0] // len(reads)
    for i, (page, rows) in enumerate(reads):
        plgpu.copy_gmem_to_smem(
            pool_ref.at[page, rows, kv_head, :], dst.at[pl.ds(i * copy_rows, copy_rows)], bar
        )


def issue_pages(
    pool_ref,
    pt_ref,
    ring,
    bar,
    *,
    slot,
    b,
    role,
    kv_head,
    step,
    block_kv,
    page_size,
    lo_blk,
    hi_blk,
    max_blocks,
):
    """TMA-loads tokens [step * T, (step + 1) * T) of role (0 K, 1 V) into ring[slot]
    (`step_pages` then `copy_pages`)."""
    reads = step_pages(
        pt_ref,
        b=b,
        role=role,
        step=step,
        block_kv=block_kv,
        page_size=page_size,
        lo_blk=lo_blk,
        hi_blk=hi_blk,
        max_blocks=max_blocks,
    )
    copy_pages(pool_ref, reads, ring.at[slot], bar.at[slot], kv_head=kv_head)


class PageIssuer:
    """issue(role, step, slot): `issue_pages` into the K (role 0) or V (role 1) ring;
    `reads(role, step)` and `copy(role, reads, slot)` are its two halves.

    where: the keyword arguments of `issue_pages` that stay fixed for a CUDA block (b, kv_head,
    block_kv, page_size, lo_blk, hi_blk, max_blocks).
    """

    def __init__(self, pool_ref, pt_ref, k_ring, k_bar, v_ring, v_bar, **where):
        self.pool_ref, self.pt_ref = pool_ref, pt_ref
        self.rings = ((k_ring, k_bar), (v_ring, v_bar))
        self.kv_head = where.pop("kv_head")
        self.where = where

    def reads(self, role, step):
        return step_pages(self.pt_ref, role=role, step=step, **self.where)

    def copy(self, role, reads, slot):
        ring, bar = self.rings[role]
        copy_pages(self.pool_ref, reads, ring.at[slot], bar.at[slot], kv_head=self.kv_head)

    def __call__(self, role, step, slot):
        self.copy(role, self.reads(role, step), slot)


def ring_prologue(issue, first, n, num_stages):
    """Fills the ring: K and V of steps first .. first + num_stages - 1 (those < n)."""
    for i in range(num_stages):

        @pl.when(i < n)
        def _(i=i):
            issue(0, first + i, i)
            issue(1, first + i, i)


def ring_refill(issue, done, role, *, j, step, slot, n, num_stages, leader, multi_wg):
    """After local step j (absolute `step`) used `slot` for `role`, loads step + num_stages.

    With several warpgroups each arrives on done[slot] and the leader waits for all of them
    before it reuses the slot; one warpgroup's own program order suffices otherwise. The
    leader reads the new page ids from GMEM before that wait, so their latency overlaps it.
    """

    @pl.when(j + num_stages < n)
    def _():
        if multi_wg:
            plgpu.barrier_arrive(done.at[slot])

        def reload():
            reads = issue.reads(role, step + num_stages)
            if multi_wg:
                plgpu.barrier_wait(done.at[slot])
            issue.copy(role, reads, slot)

        leader(reload)


def pages_per_step(block_kv, page_size):
    return max(1, block_kv // page_size)


def softcap_logits(s, softcap):
    """s in log2 units; the soft-cap applies to the natural-log logits."""
    if softcap is None:
        return s
    c = softcap * LOG2E
    return c * jnp.tanh(s / c)


def softmax_step(s, valid, m_i, l_i, axis=1):
    """Online softmax over one block, reducing `axis` (the keys): s, valid [64, T] with
    axis 1, or [T, N] with axis 0 (keys as rows: the decode kernel's producer schedule), in
    log2 units; m_i, l_i: one entry per query.

    Returns (p, alpha, m_new, l_new); masked entries get p = 0 even in fully masked rows.
    """
    keep = [1 - axis]  # the query axis, along which the statistics are broadcast
    s = jnp.where(valid, s, MASK_VALUE)
    m_new = jnp.maximum(m_i, s.max(axis=axis))
    alpha = jnp.exp2(m_i - m_new)
    p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, keep))
    p = jnp.where(valid, p, 0.0)
    l_new = l_i * alpha + p.sum(axis=axis)
    return p, alpha, m_new, l_new


def init_stats(cols, rows=ROWS, axis=1):
    """Zero accumulator [rows, cols] (WGMMA layout) and the softmax statistics m, l: one per
    row (axis 1: the softmax reduces the columns) or per column (axis 0)."""
    acc = plgpu.layout_cast(jnp.zeros((rows, cols), jnp.float32), plgpu.Layout.WGMMA)
    stats = cols if axis == 0 else rows
    layout = plgpu.Layout.WGMMA.reduce(axis)
    m_i = plgpu.layout_cast(jnp.full((stats,), MASK_VALUE, jnp.float32), layout)
    l_i = plgpu.layout_cast(jnp.zeros((stats,), jnp.float32), layout)
    return acc, m_i, l_i


def dequant(src, dst, dtype):
    """fp8 [64, C] SMEM chunk -> `dtype` SMEM chunk, fenced for WGMMA."""
    dst[...] = src[...].astype(dtype)
    plgpu.commit_smem()


def qk_block(q_tile, k_tile, deq, *, fp8, cdtype, head_dim, block_kv):
    """S = Q K^T for one step: q_tile [64, D], k_tile [T, D] (SMEM) -> f32 [64, T]."""

    def run(acc_ref):
        if not fp8:
            plgpu.wgmma(acc_ref, q_tile, k_tile.transpose((1, 0)))
            return acc_ref[...]
        for r in range(block_kv // ROWS):
            for c in range(head_dim // 128):
                cols = pl.ds(c * 128, 128)
                dequant(k_tile.at[pl.ds(r * ROWS, ROWS), cols], deq, cdtype)
                plgpu.wgmma(
                    acc_ref.at[:, pl.ds(r * ROWS, ROWS)], q_tile.at[:, cols], deq.transpose((1, 0))
                )
                plgpu.wgmma_wait(0)
        return acc_ref[...]

    return pl.run_scoped(run, plgpu.ACC((ROWS, block_kv), jnp.float32))


def p_in_smem(interpret, head_dim) -> bool:
    """Whether the decode kernel gives P to WGMMA through SMEM: always in interpret mode (its
    WGMMA reads A from SMEM only) and for head_dim >= 256, where P in registers next to the
    [64, 256] float32 accumulator measured slower (decode 5.8 vs 4.5 ms at B=128, 32K on an
    H200). The prefill kernel chooses with its `p_smem` knob (registers measured faster)."""
    return interpret is not None or head_dim >= 256


def stage_p(p, p_smem, cdtype):
    """P as the WGMMA A operand: in registers when p_smem is None, else stored to the SMEM
    tile p_smem (always so in interpret mode, whose WGMMA reads A from SMEM only)."""
    p = p.astype(cdtype)
    if p_smem is None:
        return p
    p_smem[...] = p
    plgpu.commit_smem()
    return p_smem


def pv_block(p, v_tile, deq, *, fp8, cdtype, col0, cols, block_kv, p_in_smem):
    """P V for one step: p [64, T] (registers or SMEM), v_tile [T, D] (SMEM), O columns
    [col0, col0 + cols)."""

    def p_cols(r):
        if p_in_smem:
            return p.at[:, pl.ds(r * ROWS, ROWS)]
        return p[:, r * ROWS : (r + 1) * ROWS]

    def run(acc_ref):
        if not fp8:
            plgpu.wgmma(acc_ref, p, v_tile.at[:, pl.ds(col0, cols)])
            return acc_ref[...]
        for r in range(block_kv // ROWS):
            for c in range(cols // 128):
                dequant(v_tile.at[pl.ds(r * ROWS, ROWS), pl.ds(col0 + c * 128, 128)], deq, cdtype)
                plgpu.wgmma(acc_ref.at[:, pl.ds(c * 128, 128)], p_cols(r), deq)
                plgpu.wgmma_wait(0)
        return acc_ref[...]

    # A fresh accumulator per step (interpret mode has no run_state), added by the caller.
    return pl.run_scoped(run, plgpu.ACC((ROWS, cols), jnp.float32))
