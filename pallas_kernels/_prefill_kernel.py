"""Mosaic GPU (sm90) ragged paged attention: chunked prefill (and decode rows) over the pool.

The packed new tokens of every sequence are cut into query tiles; one CUDA block handles one
tile of one query head with two warpgroups. For head_dim <= 256 each warpgroup owns 64 query
rows (128 per block) and both share the K/V pages; for head_dim 512 both take the same 64 rows
and each owns half of O (both compute S). Causal masking is by absolute position: row r of a
sequence with q_len new tokens sits at kv_len - q_len + r and sees keys at positions <= its
own (and, with a window, > its own - window), cached pages and the chunk's own alike, so the
chunk's K/V must already be in the pool (`kv_write` first).

The key range of a block is [lo, hi): hi = one past the last row's position, lo = the first
row's window start. K/V pages stream through a TMA ring exactly as in the decode kernel
(`_paged_common.issue_pages`): blocks outside [lo // S, cdiv(hi, S)) are never read. Rows of a
read page outside [lo, kv_len) must hold finite values (they are masked from the logits).
The work list (sequence, tile) is built with a few jnp ops; longest tiles run first. Output
rows are stored with a ladder of power-of-two TMA boxes, so a tile never writes rows of another
sequence; padding rows stay zero.

Axis names: T packed tokens, B sequences, Hq query heads, Hkv KV heads, G = Hq // Hkv, D
head_dim, S page_size, BK block_kv.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import _checks
from pallas_kernels import _paged_common as pc

ROWS = pc.ROWS
HEAD_DIMS = pc.HEAD_DIMS
PAGE_SIZES = pc.PAGE_SIZES
NUM_WGS = 2


@dataclasses.dataclass(frozen=True)
class PrefillTuning:
    """Static knobs (None = chosen from the shapes).

    block_kv: keys per pipeline step (a multiple of 64 and a multiple or divisor of page_size).
    num_stages: SMEM ring depth.
    """

    block_kv: int | None = None
    num_stages: int | None = None


def _layout(head_dim):
    """(row warpgroups, column warpgroups): 2 x 64 rows, or 64 rows x 2 halves of O."""
    return (2, 1) if head_dim <= 256 else (1, 2)


def _smem_bytes(head_dim, block_kv, num_stages, pool_dtype, cdtype, p_in_smem):
    row_wgs, _ = _layout(head_dim)
    ring = num_stages * 2 * block_kv * head_dim * jnp.dtype(pool_dtype).itemsize
    q = row_wgs * ROWS * (head_dim + 64) * cdtype.itemsize  # WGMMA tile + plain staging
    p = NUM_WGS * ROWS * block_kv * cdtype.itemsize if p_in_smem else 0
    deq = NUM_WGS * 2 * ROWS * 128 * 2 if _checks.is_fp8(pool_dtype) else 0
    return ring + q + p + deq + 2048


def _pick(head_dim, page_size, pool_dtype, tuning, p_in_smem=False):
    cdtype = pc.compute_dtype(pool_dtype)
    if cdtype is None:
        raise ValueError(
            f"the Pallas prefill kernel needs a bf16, f16 or fp8 pool, got {pool_dtype}"
        )
    block_kv = tuning.block_kv or {64: 128, 128: 128, 256: 64, 512: 64}[head_dim]
    pc.check_block_kv(block_kv, page_size)
    # One stage (K of the next step loads during P V, V during the next Q K) measured best:
    # 0.83 vs 0.88 ms at head_dim 128 and 1.76 vs 2.61 ms at 256 (8K tokens, H200).
    num_stages = tuning.num_stages or 1
    need = _smem_bytes(head_dim, block_kv, num_stages, pool_dtype, cdtype, p_in_smem)
    if num_stages < 1 or need > pc.SMEM_LIMIT:
        raise ValueError(
            f"prefill kernel needs {need} bytes of shared memory (head_dim={head_dim}, "
            f"block_kv={block_kv}, num_stages={num_stages}), more than {pc.SMEM_LIMIT}"
        )
    return cdtype, block_kv, num_stages


def supports(q, pool, **tuning) -> bool:
    _, page_size, _, head_dim = pool.shape
    if head_dim not in HEAD_DIMS or page_size not in PAGE_SIZES:
        return False
    try:
        _pick(head_dim, page_size, pool.dtype, PrefillTuning(**tuning))
    except (ValueError, TypeError):
        return False
    return True


def work_list(q_starts, rows_per_block, num_work):
    """i32[3, W]: (sequence, tile within it, active) per block, longest tiles first."""
    q_lens = q_starts[1:] - q_starts[:-1]  # [B]
    tiles = (q_lens + rows_per_block - 1) // rows_per_block
    cum = jnp.cumsum(tiles)
    total = cum[-1]
    w = jnp.arange(num_work, dtype=jnp.int32)
    w = jnp.where(w < total, total - 1 - w, w)  # reverse: the last (longest) tiles first
    b = jnp.minimum(jnp.searchsorted(cum, w, side="right"), q_lens.shape[0] - 1)
    tile = w - (cum[b] - tiles[b])
    return jnp.stack([b.astype(jnp.int32), tile.astype(jnp.int32), (w < total).astype(jnp.int32)])


@functools.partial(
    jax.jit,
    static_argnames=("scale", "window", "softcap", "block_kv", "num_stages", "interpret"),
)
def _prefill_jit(
    q,
    pool,
    page_table,
    q_starts,
    kv_lens,
    k_scale,
    v_scale,
    *,
    scale,
    window,
    softcap,
    block_kv,
    num_stages,
    interpret,
):
    num_tokens, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = pool.shape
    batch, _, max_blocks = page_table.shape
    group = num_q_heads // num_kv_heads
    fp8 = _checks.is_fp8(pool.dtype)
    p_in_smem = pc.p_in_smem(interpret, head_dim)
    cdtype, BK, num_stages = _pick(
        head_dim, page_size, pool.dtype, PrefillTuning(block_kv, num_stages), p_in_smem
    )
    row_wgs, col_wgs = _layout(head_dim)
    rows_per_block = ROWS * row_wgs
    dv = head_dim // col_wgs
    num_work = -(-num_tokens // rows_per_block) + batch
    work = work_list(q_starts, rows_per_block, num_work)
    # Tiles are 64-row TMA boxes inside [0, T): pad tiny batches to 64 rows.
    qc = q.astype(cdtype)
    if num_tokens < ROWS:
        qc = jnp.pad(qc, ((0, ROWS - num_tokens), (0, 0), (0, 0)))
    t_rows = qc.shape[0]

    def body(work_ref, qs_ref, kv_lens_ref, pt_ref, q_ref, pool_ref, scales_ref, out_ref):
        hq = lax.axis_index("h")
        w = lax.axis_index("w")
        wg = lax.axis_index("wg")
        kvh = hq // group
        b = work_ref[0, w]
        q_start = qs_ref[b]
        q_len = qs_ref[b + 1] - q_start
        kv_len = kv_lens_ref[b]
        cta_row = work_ref[1, w] * rows_per_block
        n_cta = jnp.where(work_ref[2, w] != 0, jnp.clip(q_len - cta_row, 0, rows_per_block), 0)
        pos_first = kv_len - q_len + cta_row
        hi = pos_first + n_cta
        lo = jnp.int32(0) if window is None else jnp.maximum(pos_first - window + 1, 0)
        lo_blk = lo // page_size
        hi_blk = jnp.maximum((hi + page_size - 1) // page_size, lo_blk + 1)
        first = lo // BK
        n = jnp.where(n_cta > 0, (hi + BK - 1) // BK - first, 0)
        r_wg = wg if row_wgs > 1 else 0
        col0 = wg * dv if col_wgs > 1 else 0
        wg_row = r_wg * ROWS
        nv = jnp.clip(n_cta - wg_row, 0, ROWS)  # valid rows of this warpgroup
        packed0 = q_start + cta_row + wg_row
        tile0 = jnp.minimum(packed0, t_rows - ROWS)  # keep the box inside [0, T)
        shift = packed0 - tile0
        pos0 = pos_first + wg_row
        qk_scale = scale * pc.LOG2E * scales_ref[0]

        def leader(fn):
            pl.when(wg == 0)(fn)

        def main(
            q_raw, q_smem, k_ring, v_ring, p_smem, deq, q_bar, q_ready, k_bar, v_bar, k_done, v_done
        ):
            q_tile = q_smem.at[r_wg]
            p_tile = p_smem.at[wg] if p_in_smem else None
            k_deq, v_deq = (deq.at[wg, 0], deq.at[wg, 1]) if fp8 else (None, None)

            issue = pc.page_issuer(
                pool_ref,
                pt_ref,
                k_ring,
                k_bar,
                v_ring,
                v_bar,
                b=b,
                kv_head=kvh,
                block_kv=BK,
                page_size=page_size,
                lo_blk=lo_blk,
                hi_blk=hi_blk,
                max_blocks=max_blocks,
            )

            def load_q():
                # The tile starts at any row: TMA into plain SMEM (tiled SMEM would need an
                # 8-row aligned offset), then re-lay it out for WGMMA through registers, in
                # 64-column chunks to keep the plain buffer small.
                raw = q_raw.at[r_wg]
                for c in range(head_dim // 64):
                    cols = pl.ds(c * 64, 64)
                    plgpu.copy_gmem_to_smem(
                        q_ref.at[pl.ds(tile0, ROWS), hq, cols], raw, q_bar.at[r_wg]
                    )
                    plgpu.barrier_wait(q_bar.at[r_wg])
                    q_tile.at[:, cols][...] = plgpu.load(
                        raw, layout=plgpu.Layout.WGMMA, optimized=False
                    )
                plgpu.commit_smem()

            # Pages start streaming before Q is re-laid out.
            leader(lambda: pc.ring_prologue(issue, first, n, num_stages))
            if row_wgs > 1:
                load_q()
            else:
                leader(load_q)

            if row_wgs == 1:
                plgpu.barrier_arrive(q_ready)
                plgpu.barrier_wait(q_ready)  # the leader's re-laid-out Q is visible to both
            rr = plgpu.broadcasted_iota(jnp.int32, (ROWS, BK), 0, layout=plgpu.Layout.WGMMA)
            kk = plgpu.broadcasted_iota(jnp.int32, (ROWS, BK), 1, layout=plgpu.Layout.WGMMA)
            qpos = pos0 - shift + rr
            row_ok = (rr >= shift) & (rr < shift + nv)

            refill = functools.partial(
                pc.ring_refill,
                issue,
                n=n,
                num_stages=num_stages,
                leader=leader,
                multi_wg=True,
            )

            def step(j, carry):
                acc, m_i, l_i = carry
                slot = lax.rem(j, num_stages)
                j_abs = first + j
                plgpu.barrier_wait(k_bar.at[slot])
                s = pc.qk_block(
                    q_tile,
                    k_ring.at[slot],
                    k_deq,
                    fp8=fp8,
                    cdtype=cdtype,
                    head_dim=head_dim,
                    block_kv=BK,
                )
                refill(k_done, 0, j=j, step=j_abs, slot=slot)
                s = pc.softcap_logits(s * qk_scale, softcap)
                kpos = j_abs * BK + kk
                valid = row_ok & (kpos <= qpos)
                if window is not None:
                    valid &= qpos - kpos < window
                p, alpha, m_i, l_i = pc.softmax_step(s, valid, m_i, l_i)
                p_op = pc.stage_p(p, p_tile, cdtype)
                plgpu.barrier_wait(v_bar.at[slot])
                pv = pc.pv_block(
                    p_op,
                    v_ring.at[slot],
                    v_deq,
                    fp8=fp8,
                    cdtype=cdtype,
                    col0=col0,
                    cols=dv,
                    block_kv=BK,
                    p_in_smem=p_in_smem,
                )
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + pv
                refill(v_done, 1, j=j, step=j_abs, slot=slot)
                return acc, m_i, l_i

            return lax.fori_loop(0, n, step, pc.init_stats(dv))

        item = jnp.dtype(pool.dtype)
        pages = pc.pages_per_step(BK, page_size)
        done = plgpu.Barrier(num_arrivals=NUM_WGS, num_barriers=num_stages)
        acc, m_i, l_i = pl.run_scoped(
            main,
            plgpu.SMEM((row_wgs, ROWS, 64), cdtype),
            plgpu.SMEM((row_wgs, ROWS, head_dim), cdtype, transforms=pc.transforms(cdtype)),
            plgpu.SMEM((num_stages, BK, head_dim), item, transforms=pc.transforms(item)),
            plgpu.SMEM((num_stages, BK, head_dim), item, transforms=pc.transforms(item)),
            plgpu.SMEM((NUM_WGS, ROWS, BK), cdtype, transforms=pc.transforms(cdtype))
            if p_in_smem
            else None,
            plgpu.SMEM((NUM_WGS, 2, ROWS, 128), cdtype, transforms=pc.transforms(cdtype))
            if fp8
            else None,
            plgpu.Barrier(num_barriers=row_wgs),
            plgpu.Barrier(num_arrivals=NUM_WGS),
            plgpu.Barrier(num_arrivals=pages, num_barriers=num_stages),
            plgpu.Barrier(num_arrivals=pages, num_barriers=num_stages),
            done,
            done,
            collective_axes="wg",
        )
        v_mult = scales_ref[1]

        def epilogue(o_smem):
            o_smem = o_smem.at[wg]
            inv = jnp.where(l_i > 0, v_mult / jnp.where(l_i > 0, l_i, 1.0), 0.0)
            o_smem[...] = (acc * lax.broadcast_in_dim(inv, acc.shape, [0])).astype(o_smem.dtype)
            plgpu.commit_smem()
            # Rows [shift, shift + nv) -> packed rows [packed0, packed0 + nv), in boxes of
            # 64, 32, ..., 1 rows so no row outside the sequence is written.
            done_rows = jnp.int32(0)
            c = ROWS
            while c >= 1:

                @pl.when((nv & c) != 0)
                def _(c=c, done_rows=done_rows):
                    plgpu.copy_smem_to_gmem(
                        o_smem.at[pl.ds(shift + done_rows, c)],
                        out_ref.at[pl.ds(packed0 + done_rows, c), hq, pl.ds(col0, dv)],
                    )

                done_rows = done_rows + (nv & c)
                c //= 2
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(epilogue, plgpu.SMEM((NUM_WGS, ROWS, dv), q.dtype), collective_axes="wg")

    kernel = plgpu.kernel(
        body,
        out_type=(),
        grid=(num_q_heads, num_work),
        grid_names=("h", "w"),
        num_threads=NUM_WGS,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret,
    )
    # Output as a zero-initialised Ref: padding rows are never written and stay 0.
    out = jax.new_ref(jnp.zeros((t_rows, num_q_heads, head_dim), q.dtype))
    scales = jnp.stack([k_scale, v_scale]).astype(jnp.float32)
    kernel(work, q_starts, kv_lens, page_table, qc, pool, scales, out)
    return jax.freeze(out)[:num_tokens]


def ragged_paged_attention_pallas(
    q,
    pool,
    page_table,
    q_starts,
    kv_lens,
    *,
    scale,
    window=None,
    softcap=None,
    k_scale=None,
    v_scale=None,
    block_kv=None,
    num_stages=None,
):
    """Mosaic GPU ragged paged attention (validated inputs; see `paged_attention.py`)."""
    _, page_size, _, head_dim = pool.shape
    pc.check_shape("prefill", head_dim, page_size)
    ks, vs = _checks.kv_scales(pool, k_scale, v_scale)
    return _prefill_jit(
        q,
        pool,
        page_table,
        q_starts,
        kv_lens,
        ks,
        vs,
        scale=float(scale),
        window=window,
        softcap=None if softcap is None else float(softcap),
        block_kv=block_kv,
        num_stages=num_stages,
        interpret=_checks.interpret_params(),
    )
