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

Schedule of one warpgroup (all knobs in `PrefillTuning`). Its steps (BK keys each) fall into
segments by what its valid rows see: `skip` (no row sees a key: the step only keeps the ring
going), `masked` (window edge, diagonal, kv_len) and `free` (every row sees every key: no iota,
compare or select per element); with `mask_split` off every step is masked. A step is
  S = Q K^T (WGMMA) -> online softmax in float32 (log2 units) -> P (bf16/f16, registers or
  SMEM) -> O = O * alpha + P V (WGMMA, accumulating into O in place when `pv_in_place`).
With `pipeline` (FA3 intra-warpgroup overlap) step j first issues the WGMMA of S for step j + 1
and runs the softmax of step j while the tensor cores compute it, so the next K must already be
in the ring: it wants num_stages >= 2. Padding rows of a tile (outside the sequence) are not
masked in free steps: their logits are finite or NaN, rows are independent through both
WGMMAs and the softmax, and such rows are never stored.

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
# diff (query position - key column) of a padding row in masked steps: below every key.
_NO_ROW = -(2**30)


@dataclasses.dataclass(frozen=True)
class PrefillTuning:
    """Static knobs (None = chosen from the shapes).

    block_kv: keys per pipeline step: a multiple of 64 (or 32, for 16-bit pools: at head_dim
        512 two ring stages then fit) and a multiple or divisor of page_size.
    num_stages: SMEM ring depth (default 2 at head_dim 256 and 512 for bf16/f16 pools, else
        1).
    mask_split: per-element masks only in the steps that need one; steps no row of the
        warpgroup sees skip the math (default True; False masks every step).
    pipeline: issue the next step's S = Q K^T WGMMA before this step's softmax (default: on
        when num_stages >= 2). fp8 pools dequantise K on the CUDA cores first: no overlap.
    pv_in_place: P V accumulates into O in place (compiled; interpret mode adds a fresh
        accumulator, its WGMMA has no run_state) instead of a fresh accumulator added to
        O * alpha (default True).
    p_smem: P goes to the P V WGMMA through SMEM instead of registers (default False;
        interpret mode always uses SMEM).
    split_scores: head_dim 512, 16-bit pools (both warpgroups take the same 64 rows, each owns
        half of O): each warpgroup computes S over its half of head_dim only and the two
        float32 partials are summed through SMEM (two barriers per step) instead of both
        computing the whole S (default False; 2/3 of the tensor work and ~3/4 of the SMEM
        reads per step, `experiments/NOTES.md` v8).
    The defaults are the fastest of the H200 sweeps in `experiments/NOTES.md` (v5, v6).
    """

    block_kv: int | None = None
    num_stages: int | None = None
    mask_split: bool | None = None
    pipeline: bool | None = None
    pv_in_place: bool | None = None
    p_smem: bool | None = None
    split_scores: bool | None = None


@dataclasses.dataclass(frozen=True)
class _Config:
    cdtype: jnp.dtype
    block_kv: int
    num_stages: int
    mask_split: bool
    pipeline: bool
    pv_in_place: bool
    p_smem: bool
    split_scores: bool


def _layout(head_dim):
    """(row warpgroups, column warpgroups): 2 x 64 rows, or 64 rows x 2 halves of O."""
    return (2, 1) if head_dim <= 256 else (1, 2)


def _smem_bytes(head_dim, block_kv, num_stages, pool_dtype, cdtype, p_in_smem, split=False):
    row_wgs, _ = _layout(head_dim)
    ring = num_stages * 2 * block_kv * head_dim * jnp.dtype(pool_dtype).itemsize
    q = row_wgs * ROWS * (head_dim + 64) * cdtype.itemsize  # WGMMA tile + plain staging
    p = NUM_WGS * ROWS * block_kv * cdtype.itemsize if p_in_smem else 0
    deq = NUM_WGS * 2 * ROWS * 128 * 2 if _checks.is_fp8(pool_dtype) else 0
    exchange = NUM_WGS * ROWS * block_kv * 4 if split else 0  # float32 partial S
    return ring + q + p + deq + exchange + 2048


def _pick(head_dim, page_size, pool_dtype, tuning, interpret=None):
    cdtype = pc.compute_dtype(pool_dtype)
    if cdtype is None:
        raise ValueError(
            f"the Pallas prefill kernel needs a bf16, f16 or fp8 pool, got {pool_dtype}"
        )
    if _checks.is_fp8(pool_dtype) and head_dim < 128:  # dequantised in 64 x 128 chunks
        raise ValueError(f"fp8 pools need head_dim >= 128 in the Pallas kernels, got {head_dim}")
    fp8 = _checks.is_fp8(pool_dtype)
    # head_dim 512, 16-bit: 32-key steps, so that two ring stages fit beside the Q tile.
    block_kv = tuning.block_kv or {64: 128, 128: 128, 256: 64, 512: 64 if fp8 else 32}[head_dim]
    # fp8 dequantises 64-row chunks; 16-bit pools may take 32-key steps (64-byte swizzle).
    pc.check_block_kv(block_kv, page_size, allow_32=not fp8)
    # Measured on the H200 (8K tokens causal; in `experiments/results/archive/`:
    # `kernels_h200_v5_prefill_sweep` and `_v6_prefill_sweep_d512*.json`): P in registers
    # at every head_dim (D=256: 475 vs 460 TFLOP/s; D=512: 235 vs 222); one stage at
    # head_dim 128 (436 vs 428 with two, 400 pipelined); two pipelined stages at 256 (506
    # vs 475 with one); at 512 two pipelined stages of 32 keys (302 vs 238 with one stage of
    # 64, the most that fits).
    p_smem = False if tuning.p_smem is None else tuning.p_smem
    p_smem = p_smem or interpret is not None  # the interpreter's WGMMA reads A from SMEM only
    split = bool(tuning.split_scores)
    if split and (_layout(head_dim)[1] != 2 or fp8):
        raise ValueError(
            f"split_scores needs head_dim 512 (two warpgroups on one 64-row tile) and a 16-bit "
            f"pool, got head_dim {head_dim}, pool {jnp.dtype(pool_dtype)}"
        )
    num_stages = tuning.num_stages
    if num_stages is None:
        two_fit = (
            _smem_bytes(head_dim, block_kv, 2, pool_dtype, cdtype, p_smem, split) <= pc.SMEM_LIMIT
        )
        # fp8 dequantises K on the CUDA cores before its WGMMA: nothing to overlap.
        num_stages = 2 if head_dim >= 256 and two_fit and not fp8 else 1
    need = _smem_bytes(head_dim, block_kv, num_stages, pool_dtype, cdtype, p_smem, split)
    if num_stages < 1 or need > pc.SMEM_LIMIT:
        raise ValueError(
            f"prefill kernel needs {need} bytes of shared memory (head_dim={head_dim}, "
            f"block_kv={block_kv}, num_stages={num_stages}), more than {pc.SMEM_LIMIT}"
        )

    def flag(value, default):
        return bool(default if value is None else value)

    return _Config(
        cdtype=cdtype,
        block_kv=block_kv,
        num_stages=num_stages,
        mask_split=flag(tuning.mask_split, True),
        pipeline=flag(tuning.pipeline, num_stages >= 2),
        pv_in_place=flag(tuning.pv_in_place, True),
        p_smem=p_smem,
        split_scores=split,
    )


def supports(q, pool, **tuning) -> bool:
    _, page_size, _, head_dim = pool.shape
    if head_dim not in HEAD_DIMS or page_size not in PAGE_SIZES:
        return False
    try:
        _pick(head_dim, page_size, pool.dtype, PrefillTuning(**tuning), _checks.interpret_params())
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
    b = jnp.searchsorted(cum, w, side="right", method="compare_all")  # no while loop
    b = jnp.minimum(b, q_lens.shape[0] - 1)
    tile = w - (cum[b] - tiles[b])
    return jnp.stack([b.astype(jnp.int32), tile.astype(jnp.int32), (w < total).astype(jnp.int32)])


def _issue_qk(s_ref, q_tile, k_tile, deq, *, fp8, cdtype, head_dim, block_kv, cols=None):
    """S = Q K^T into the zeroed accumulator s_ref: q_tile [64, D], k_tile [T, D] (SMEM);
    with `cols` (bf16/f16 only) the contraction over those columns of D only.

    bf16/f16: one WGMMA, left in flight (the caller's read of s_ref waits for it). fp8: each
    64 x 128 chunk of K is dequantised to `deq` on the CUDA cores and waited for.
    """
    if not fp8:
        if cols is not None:
            q_tile, k_tile = q_tile.at[:, cols], k_tile.at[:, cols]
        plgpu.wgmma(s_ref, q_tile, k_tile.transpose((1, 0)))
        return
    for r in range(block_kv // ROWS):
        for c in range(head_dim // 128):
            cols = pl.ds(c * 128, 128)
            pc.dequant(k_tile.at[pl.ds(r * ROWS, ROWS), cols], deq, cdtype)
            plgpu.wgmma(
                s_ref.at[:, pl.ds(r * ROWS, ROWS)], q_tile.at[:, cols], deq.transpose((1, 0))
            )
            plgpu.wgmma_wait(0)


def _issue_pv(o_ref, p, v_tile, deq, *, fp8, cdtype, col0, cols, block_kv, p_in_smem):
    """o_ref += P V: p [64, T] (registers or SMEM), v_tile [T, D] (SMEM), O columns
    [col0, col0 + cols)."""
    if not fp8:
        plgpu.wgmma(o_ref, p, v_tile.at[:, pl.ds(col0, cols)])
        return
    for r in range(block_kv // ROWS):
        p_r = p.at[:, pl.ds(r * ROWS, ROWS)] if p_in_smem else p[:, r * ROWS : (r + 1) * ROWS]
        for c in range(cols // 128):
            dequant_src = v_tile.at[pl.ds(r * ROWS, ROWS), pl.ds(col0 + c * 128, 128)]
            pc.dequant(dequant_src, deq, cdtype)
            plgpu.wgmma(o_ref.at[:, pl.ds(c * 128, 128)], p_r, deq)
            plgpu.wgmma_wait(0)


def _softmax(s, valid, m_i, l_i):
    """Online softmax over one block: s [64, T] (log2 units); valid [64, T] or None (every
    entry visible: no select); m_i, l_i [64]. Returns (p, alpha, m_new, l_new)."""
    if valid is None:
        m_new = jnp.maximum(m_i, s.max(axis=1))
        alpha = jnp.exp2(m_i - m_new)
        p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
        return p, alpha, m_new, l_i * alpha + p.sum(axis=1)
    return pc.softmax_step(s, valid, m_i, l_i)


@functools.partial(
    jax.jit,
    static_argnames=("scale", "window", "softcap", "tuning", "interpret"),
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
    tuning,
    interpret,
):
    num_tokens, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = pool.shape
    batch, _, max_blocks = page_table.shape
    group = num_q_heads // num_kv_heads
    fp8 = _checks.is_fp8(pool.dtype)
    cfg = _pick(head_dim, page_size, pool.dtype, tuning, interpret)
    cdtype, BK, num_stages = cfg.cdtype, cfg.block_kv, cfg.num_stages
    p_in_smem = cfg.p_smem
    split_scores = cfg.split_scores
    pv_in_place = cfg.pv_in_place and interpret is None  # the interpreter has no run_state
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
        pos0 = pos_first + wg_row  # position of this warpgroup's first valid row
        qk_scale = scale * pc.LOG2E * scales_ref[0]

        # Segments of the local steps [0, n) (absolute step = first + local) for this
        # warpgroup's valid rows at positions [pos0, pos0 + nv):
        #   skip [0, e0) | masked [e0, e1) | free [e1, e2) | masked [e2, e3) | skip [e3, n).
        # A step is free when its last key is <= pos0 and (window) its first key is inside
        # the last row's window; skipped when its keys are all before the first row's window
        # or all after the last row.
        def local(abs_step, lower):
            return jnp.clip(abs_step - first, lower, n)

        if cfg.mask_split:
            if window is None:
                vis_lo = free_lo = jnp.int32(0)
            else:
                vis_lo = jnp.maximum(pos0 - window + 1, 0) // BK
                free_lo = (jnp.maximum(pos0 + nv - window, 0) + BK - 1) // BK
            e0 = jnp.where(nv > 0, local(vis_lo, 0), n)  # no valid row: all skipped
            e1 = local(free_lo, e0)
            e2 = local((pos0 + 1) // BK, e1)
            e3 = local((pos0 + nv + BK - 1) // BK, e2)
        else:
            e0 = e1 = e2 = jnp.int32(0)
            e3 = n

        def leader(fn):
            pl.when(wg == 0)(fn)

        def main(
            q_raw,
            q_smem,
            k_ring,
            v_ring,
            p_smem,
            deq,
            exchange,
            q_bar,
            q_ready,
            k_bar,
            v_bar,
            k_done,
            v_done,
            s_full,
            s_free,
        ):
            q_tile = q_smem.at[r_wg]
            p_tile = p_smem.at[wg] if p_in_smem else None
            k_deq, v_deq = (deq.at[wg, 0], deq.at[wg, 1]) if fp8 else (None, None)

            issue = pc.PageIssuer(
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
                    # Every thread has read `raw` (and written its Q chunk) before the next
                    # chunk's TMA overwrites it.
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
            refill = functools.partial(
                pc.ring_refill,
                issue,
                n=n,
                num_stages=num_stages,
                leader=leader,
                multi_wg=True,
            )

            def scores(s_ref, slot):
                _issue_qk(
                    s_ref,
                    q_tile,
                    k_ring.at[slot],
                    k_deq,
                    fp8=fp8,
                    cdtype=cdtype,
                    head_dim=head_dim,
                    block_kv=BK,
                    cols=pl.ds(col0, dv) if split_scores else None,
                )

            def exchange_scores(s_own):
                """split_scores: S = both warpgroups' partials. Each posts its half in SMEM and
                adds the other's; float addition commutes, so both get the same S bit for bit
                (and the same softmax). s_free: the other warpgroup has read my last half."""
                if not split_scores:
                    return s_own
                plgpu.barrier_wait(s_free)
                exchange.at[wg][...] = s_own
                plgpu.barrier_arrive(s_full)
                plgpu.barrier_wait(s_full)
                other = plgpu.load(exchange.at[1 - wg], layout=plgpu.Layout.WGMMA)
                plgpu.barrier_arrive(s_free)
                return s_own + other

            def sync_scores(j):
                """S of local step j, waited for; releases its K slot."""
                slot = lax.rem(j, num_stages)
                plgpu.barrier_wait(k_bar.at[slot])

                def run(s_ref):
                    scores(s_ref, slot)
                    return s_ref[...]

                s = pl.run_scoped(run, plgpu.ACC((ROWS, BK), jnp.float32))
                refill(k_done, 0, j=j, step=first + j, slot=slot)
                return exchange_scores(s)

            def softmax_pv(j, s, acc, m_i, l_i, masked):
                """Softmax of local step j's raw S, then O = O * alpha + P V; releases V."""
                slot = lax.rem(j, num_stages)
                s = pc.softcap_logits(s * qk_scale, softcap)
                valid = None
                if masked:
                    # diff = query position - key position + c (padding rows: below every
                    # key): key c + k is visible to row r iff 0 <= diff - c < window. Built
                    # here, not hoisted, so free steps do not hold it in registers.
                    c = (first + j) * BK
                    shape = (ROWS, BK)
                    rr = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA)
                    kk = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)
                    row_ok = (rr >= shift) & (rr < shift + nv)
                    diff = jnp.where(row_ok, pos0 - shift + rr - kk, _NO_ROW)
                    valid = diff >= c
                    if window is not None:
                        valid &= diff < c + window
                p, alpha, m_i, l_i = _softmax(s, valid, m_i, l_i)
                p_op = pc.stage_p(p, p_tile, cdtype)
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                plgpu.barrier_wait(v_bar.at[slot])
                pv = functools.partial(
                    _issue_pv,
                    p=p_op,
                    v_tile=v_ring.at[slot],
                    deq=v_deq,
                    fp8=fp8,
                    cdtype=cdtype,
                    col0=col0,
                    cols=dv,
                    block_kv=BK,
                    p_in_smem=p_in_smem,
                )

                def accumulate(o_ref):
                    if pv_in_place:
                        o_ref[...] = acc  # O * alpha becomes the WGMMA accumulator
                    pv(o_ref)
                    return o_ref[...]

                pv_out = pl.run_scoped(accumulate, plgpu.ACC((ROWS, dv), jnp.float32))
                acc = pv_out if pv_in_place else acc + pv_out
                refill(v_done, 1, j=j, step=first + j, slot=slot)
                return acc, m_i, l_i

            def skip_step(j, carry):
                """No row sees this step's keys: only wait for and release its ring slot."""
                slot = lax.rem(j, num_stages)
                plgpu.barrier_wait(k_bar.at[slot])
                refill(k_done, 0, j=j, step=first + j, slot=slot)
                plgpu.barrier_wait(v_bar.at[slot])
                refill(v_done, 1, j=j, step=first + j, slot=slot)
                return carry

            def step(j, carry, masked):
                acc, m_i, l_i = carry
                return softmax_pv(j, sync_scores(j), acc, m_i, l_i, masked)

            def piped_step(j, carry, masked):
                """Issues S of step j + 1, then the softmax and P V of step j (S carried)."""
                acc, m_i, l_i, s = carry
                nslot = lax.rem(j + 1, num_stages)
                plgpu.barrier_wait(k_bar.at[nslot])

                def run(s_ref):
                    scores(s_ref, nslot)  # in flight during the softmax below
                    out = softmax_pv(j, s, acc, m_i, l_i, masked)
                    return *out, s_ref[...]

                *stats, s = pl.run_scoped(run, plgpu.ACC((ROWS, BK), jnp.float32))
                refill(k_done, 0, j=j + 1, step=first + j + 1, slot=nslot)
                return *stats, exchange_scores(s)

            def loop(lo_, hi_, fn, carry, **kw):
                return lax.fori_loop(lo_, hi_, functools.partial(fn, **kw), carry)

            if split_scores:
                plgpu.barrier_arrive(s_free)  # both partial-S buffers start free
            stats = pc.init_stats(dv)
            if not cfg.pipeline:
                loop(0, e0, skip_step, ())
                stats = loop(e0, e1, step, stats, masked=True)
                stats = loop(e1, e2, step, stats, masked=False)
                stats = loop(e2, e3, step, stats, masked=True)
                loop(e3, n, skip_step, ())
                if split_scores:
                    plgpu.barrier_wait(s_free)  # the last phase: both halves were read
                return stats

            def piped(stats):
                # Active steps [a0, a3), never empty: S of a0 first, the last step alone.
                a0 = jnp.minimum(e0, n - 1)
                a3 = jnp.maximum(e3, a0 + 1)
                last = a3 - 1
                b1 = jnp.clip(e1, a0, last)
                b2 = jnp.clip(e2, b1, last)
                loop(0, a0, skip_step, ())
                carry = (*stats, sync_scores(a0))
                carry = loop(a0, b1, piped_step, carry, masked=True)
                carry = loop(b1, b2, piped_step, carry, masked=False)
                carry = loop(b2, last, piped_step, carry, masked=True)
                acc, m_i, l_i, s = carry
                stats = softmax_pv(last, s, acc, m_i, l_i, masked=True)
                loop(a3, n, skip_step, ())
                return stats

            stats = lax.cond(n > 0, piped, lambda stats: stats, stats)
            if split_scores:
                plgpu.barrier_wait(s_free)  # the last phase: both halves were read
            return stats

        item = jnp.dtype(pool.dtype)
        p_swizzle = pc.row_swizzle(BK, cdtype)
        v_swizzle = pc.SWIZZLE if fp8 else p_swizzle  # P V takes A and B with one swizzle
        pages = pc.pages_per_step(BK, page_size)
        done = plgpu.Barrier(num_arrivals=NUM_WGS, num_barriers=num_stages)
        acc, m_i, l_i = pl.run_scoped(
            main,
            plgpu.SMEM((row_wgs, ROWS, 64), cdtype),
            plgpu.SMEM((row_wgs, ROWS, head_dim), cdtype, transforms=pc.transforms(cdtype)),
            plgpu.SMEM((num_stages, BK, head_dim), item, transforms=pc.transforms(item)),
            plgpu.SMEM((num_stages, BK, head_dim), item, transforms=pc.transforms(item, v_swizzle)),
            plgpu.SMEM((NUM_WGS, ROWS, BK), cdtype, transforms=pc.transforms(cdtype, p_swizzle))
            if p_in_smem
            else None,
            plgpu.SMEM((NUM_WGS, 2, ROWS, 128), cdtype, transforms=pc.transforms(cdtype))
            if fp8
            else None,
            plgpu.SMEM((NUM_WGS, ROWS, BK), jnp.float32) if split_scores else None,
            plgpu.Barrier(num_barriers=row_wgs),
            plgpu.Barrier(num_arrivals=NUM_WGS),
            plgpu.Barrier(num_arrivals=pages, num_barriers=num_stages),
            plgpu.Barrier(num_arrivals=pages, num_barriers=num_stages),
            done,
            done,
            plgpu.Barrier(num_arrivals=NUM_WGS) if split_scores else None,
            plgpu.Barrier(num_arrivals=NUM_WGS) if split_scores else None,
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
    **tuning,
):
    """Mosaic GPU ragged paged attention (validated inputs; see `paged_attention.py`).

    tuning: the `PrefillTuning` knobs (block_kv, num_stages, mask_split, pipeline,
    pv_in_place, p_smem).
    """
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
        tuning=PrefillTuning(**tuning),
        interpret=_checks.interpret_params(),
    )
