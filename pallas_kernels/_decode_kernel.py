"""Mosaic GPU (sm90) paged decode attention: one new token per sequence over its pages.

One CUDA block per (KV head, context split, sequence) reads every K/V page of its KV head once
for the G = Hq // Hkv query heads of the group. The source page of each TMA copy comes from
the page table (scalar loads from GMEM). A step covers `block_kv` tokens: several whole pages
(block_kv >= page_size) or a slice of one (block_kv < page_size). Softmax statistics are
float32 in log2 units (exp2), accumulation float32. Two schedules (`DecodeTuning.schedule`):

producer (default where O^T fits in registers): warpgroup 1 only issues TMA copies; K and V
of each step stream through one ring of `num_stages` slots (step j's K is half-step 2j, its V
2j + 1, in slot half-step % num_stages), each slot with a "full" barrier (TMA bytes) and an
"empty" barrier (the consumer's release); the producer reads the next page ids before it
waits for a slot, so their GMEM latency overlaps the wait. Warpgroup 0 computes with the
tokens as WGMMA rows: S^T = K Q^T (M = block_kv, N = G padded to a multiple of 8, K from the
ring as the A operand), the online softmax over the rows, P^T to SMEM, O^T += V^T P^T
(M = head_dim, A = V^T from the ring, transposed). No Q tile is padded to 64 rows, so a step
reads K and V from SMEM once plus a small Q^T, and the SMEM left over holds a deep ring: at
head_dim 512 three 64 KB slots (128 KB in flight while one is consumed). fp8 pools: S^T on the
fp8 tensor cores from the ring's K and the queries split into hi + lo fp8 parts
(`split_queries`: one WGMMA with N = 2 x the padded group, the two column halves summed; or K
dequantised to f16 first, `fp8_scores="dequant"`), V dequantised to an f16 tile on the CUDA
cores while the S^T WGMMA runs; each step's fp8 bytes cross HBM once.

lockstep (the v6 kernel): the query heads are the first G rows of a 64-row WGMMA tile (the
rest zero); K/V stream through separate rings of `num_stages` steps, refilled by the compute
warpgroup(s) themselves; S = Q K^T and O += P V, P from registers (head_dim < 256, compiled)
or through SMEM (`_paged_common.p_in_smem`). head_dim 512 uses two compute warpgroups, each
owning half of O (both compute S; splitting its contraction between them, the halves summed
through SMEM, measured slower: `experiments/NOTES.md`, v7); both wait for each other before
every refill of a ring slot. fp8 pools are dequantised in SMEM to float16 per 64x128 chunk;
the scales are folded into the logit scale and the output.

Only blocks [lo // S, cdiv(kv_len, S)) are read, lo = max(0, kv_len - window): a step whose
aligned range reaches outside it re-reads an in-range page instead (its logits are masked), so
BAD or out-of-window pages are never touched. Rows of a read page outside [lo, kv_len) are
masked out of the logits; they must hold finite values (as any page written by `kv_write` or
zero-initialised does), since a masked row still enters P V with weight 0.

With `num_splits > 1` each block handles a contiguous share of the steps and writes
unnormalised float32 partials (o, m, l); a small jnp combine merges them.

Axis names: B sequences, Hkv KV heads, G query heads per KV head, N = G padded (producer),
D head_dim, S page_size, T block_kv (tokens per step), NS num_splits.
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

ROWS = pc.ROWS  # query rows of one tile (G of them are real)
SMEM_LIMIT = pc.SMEM_LIMIT
SMEM_PER_SM = 228 * 1024
HEAD_DIMS = pc.HEAD_DIMS
PAGE_SIZES = pc.PAGE_SIZES
MAX_GROUP = ROWS
NUM_SMS = 132


SCHEDULES = ("lockstep", "producer")
FP8_SCORES = ("split_q", "dequant")
FP8_MAX = 448.0  # largest finite float8_e4m3fn
MAX_ACC_ELEMS = 128 * 128  # producer schedule: O^T [D, N] float32 <= 128 registers per thread


@dataclasses.dataclass(frozen=True)
class DecodeTuning:
    """Static knobs of the decode kernel (None = chosen from the shapes).

    schedule: "producer" (default where it fits: N * head_dim <= 16384 for the padded group N)
        or "lockstep" (the v6 kernel). See the module docstring.
    block_kv: tokens per pipeline step. lockstep: a multiple of 64 (or 32, for 16-bit pools);
        producer: a multiple of 64 (the WGMMA M of S^T). Both: a multiple or divisor of
        page_size.
    num_stages: SMEM ring depth. lockstep: steps of K + V in flight; producer: slots of the
        shared ring, each holding one step's K or V (>= 2; an odd count lets K and V of a step
        and the next step's K sit in three slots).
    num_splits: context splits per (sequence, KV head) (split-K), combined in float32.
    fp8_scores: producer schedule, fp8 pools: "split_q" (default) computes S^T on the fp8
        tensor cores from the ring's K and the queries split into two fp8 parts (hi + lo,
        ~8 significant bits, like bf16); "dequant" converts K to float16 first.
    """

    block_kv: int | None = None
    num_stages: int | None = None
    num_splits: int | None = None
    schedule: str | None = None
    fp8_scores: str | None = None


def producer_rows(group: int) -> int:
    """WGMMA N of the producer schedule's S^T tile: the group padded to a multiple of 8."""
    return max(8, -(-group // 8) * 8)


def _smem_bytes(head_dim, block_kv, num_stages, pool_dtype, cdtype, p_in_smem):
    item = jnp.dtype(pool_dtype).itemsize
    ring = num_stages * 2 * block_kv * head_dim * item
    q = ROWS * head_dim * cdtype.itemsize
    num_wgs = 2 if head_dim > 256 else 1
    p = num_wgs * ROWS * block_kv * 2 if p_in_smem else 0
    dequant = num_wgs * 2 * ROWS * 128 * 2 if _checks.is_fp8(pool_dtype) else 0
    return ring + q + p + dequant + 2048  # barriers, reduction scratch


def _smem_bytes_producer(head_dim, block_kv, num_stages, pool_dtype, cdtype, n_pad, split_q):
    """Shared memory of the producer schedule's main scope (the epilogue reuses it)."""
    item = jnp.dtype(pool_dtype).itemsize
    fp8 = _checks.is_fp8(pool_dtype)
    ring = num_stages * block_kv * head_dim * item
    q = (2 * n_pad * head_dim) if split_q else n_pad * head_dim * cdtype.itemsize
    p = n_pad * block_kv * 2
    deq = (1 if split_q else 2) * block_kv * head_dim * 2 if fp8 else 0
    # 1 KB alignment of each buffer, the 2 KB cross-warp reduction scratch, barriers.
    return ring + q + p + deq + 4 * 1024 + 2048 + 1024


def _pick(
    head_dim,
    page_size,
    pool_dtype,
    batch,
    num_kv_heads,
    max_blocks,
    tuning,
    p_in_smem=False,
    window=None,
    group=1,
):
    """Resolves the tuning knobs; raises ValueError for an unsupported configuration."""
    cdtype = pc.compute_dtype(pool_dtype)
    if cdtype is None:
        raise ValueError("the Pallas decode kernel needs a bf16, f16 or fp8 pool, got float32")
    if _checks.is_fp8(pool_dtype) and head_dim < 128:  # dequantised in 64 x 128 chunks
        raise ValueError(f"fp8 pools need head_dim >= 128 in the Pallas kernels, got {head_dim}")
    schedule = tuning.schedule
    fits_producer = producer_rows(group) * head_dim <= MAX_ACC_ELEMS
    if schedule is None:
        schedule = "producer" if fits_producer else "lockstep"
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if schedule == "producer":
        if not fits_producer:
            raise ValueError(
                f"the producer schedule holds O^T [head_dim, N] in registers: N * head_dim must "
                f"be <= {MAX_ACC_ELEMS}, got N={producer_rows(group)} (group {group}) x "
                f"head_dim {head_dim}; use schedule='lockstep'"
            )
        return cdtype, _pick_producer(
            head_dim,
            page_size,
            pool_dtype,
            cdtype,
            batch,
            num_kv_heads,
            max_blocks,
            tuning,
            window,
            group,
        )
    if tuning.fp8_scores is not None:
        raise ValueError(f"fp8_scores applies to the producer schedule only, got {tuning}")
    fp8 = _checks.is_fp8(pool_dtype)
    block_kv = tuning.block_kv
    if block_kv is None:
        # head_dim 512, 16-bit: steps of 32 tokens (64 KB of K+V) so that two ring stages fit
        # beside the 64 KB Q tile; steps of 64 fit one stage only.
        block_kv = {64: 128, 128: 64, 256: 64, 512: 64 if fp8 else 32}[head_dim]
    # fp8 dequantises 64-row chunks; a [64, 32] 16-bit P tile takes a 64-byte swizzle.
    pc.check_block_kv(block_kv, page_size, allow_32=not fp8)
    num_stages = tuning.num_stages
    if num_stages is None:
        # Two blocks per SM (measured: 4.2 vs 3.1 TB/s at head_dim 128) with >= 2 stages if
        # they fit in half the SMEM, else as many stages as one block per SM holds.
        def fits(stages, limit):
            need = _smem_bytes(head_dim, block_kv, stages, pool_dtype, cdtype, p_in_smem)
            return need <= limit

        half = SMEM_PER_SM // 2 - 1024
        num_stages = next((st for st in (4, 3, 2) if fits(st, half)), None)
        if num_stages is None:
            num_stages = next((st for st in (4, 3, 2, 1) if fits(st, SMEM_LIMIT)), 1)
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    need = _smem_bytes(head_dim, block_kv, num_stages, pool_dtype, cdtype, p_in_smem)
    if need > SMEM_LIMIT:
        raise ValueError(
            f"decode kernel needs {need} bytes of shared memory (head_dim={head_dim}, "
            f"block_kv={block_kv}, num_stages={num_stages}, pool {jnp.dtype(pool_dtype)}), "
            f"more than the {SMEM_LIMIT} available; lower block_kv or num_stages"
        )
    num_splits = _splits(tuning, need, batch, num_kv_heads, max_blocks, page_size, block_kv, window)
    return cdtype, DecodeTuning(block_kv, num_stages, num_splits, "lockstep", None)


def _splits(tuning, need, batch, num_kv_heads, max_blocks, page_size, block_kv, window):
    num_splits = tuning.num_splits
    if num_splits is None:
        context = max_blocks * page_size  # the longest a row can be; a window reads less
        if window is not None:
            context = min(context, window + 2 * max(block_kv, page_size))
        steps = max(1, -(-context // block_kv))
        per_sm = 2 if need <= SMEM_PER_SM // 2 - 1024 else 1
        num_splits = pick_splits(
            batch * num_kv_heads, NUM_SMS * per_sm, max(1, steps // 4), 2 * NUM_SMS
        )
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    return num_splits


def _pick_producer(
    head_dim,
    page_size,
    pool_dtype,
    cdtype,
    batch,
    num_kv_heads,
    max_blocks,
    tuning,
    window,
    group,
):
    fp8 = _checks.is_fp8(pool_dtype)
    fp8_scores = tuning.fp8_scores
    if fp8_scores is None:
        fp8_scores = "split_q" if fp8 else None
    elif not fp8:
        raise ValueError(f"fp8_scores applies to fp8 pools only, got {fp8_scores!r}")
    elif fp8_scores not in FP8_SCORES:
        raise ValueError(f"fp8_scores must be one of {FP8_SCORES}, got {fp8_scores!r}")
    split_q = fp8_scores == "split_q"
    n_pad = producer_rows(group)
    block_kv = tuning.block_kv
    if block_kv is None:
        # One ring slot (a step's K or V) of 32 KB (bf16 at D=128 and 256) or 64 KB (D=512);
        # fp8: 16-32 KB.
        block_kv = 128 if head_dim <= 128 else 64
    pc.check_block_kv(block_kv, page_size)  # S^T = K Q^T: M = block_kv, a multiple of 64

    def need(stages):
        return _smem_bytes_producer(head_dim, block_kv, stages, pool_dtype, cdtype, n_pad, split_q)

    num_stages = tuning.num_stages
    if num_stages is None:
        # Two blocks per SM when at least three slots fit in half the SMEM (two of them in
        # flight per block while the consumer holds the third), else one block with as many
        # slots as fit (at head_dim 512: three slots of 64 KB, 128 KB in flight).
        half = SMEM_PER_SM // 2 - 1024
        num_stages = next((st for st in (6, 5, 4, 3) if need(st) <= half), None)
        if num_stages is None:
            num_stages = next((st for st in range(8, 1, -1) if need(st) <= SMEM_LIMIT), 2)
    if num_stages < 2:
        raise ValueError(f"num_stages must be >= 2 for the producer schedule, got {num_stages}")
    if need(num_stages) > SMEM_LIMIT:
        raise ValueError(
            f"decode kernel needs {need(num_stages)} bytes of shared memory (head_dim="
            f"{head_dim}, block_kv={block_kv}, num_stages={num_stages}, pool "
            f"{jnp.dtype(pool_dtype)}), more than the {SMEM_LIMIT} available; lower block_kv "
            f"or num_stages"
        )
    num_splits = _splits(
        tuning, need(num_stages), batch, num_kv_heads, max_blocks, page_size, block_kv, window
    )
    return DecodeTuning(block_kv, num_stages, num_splits, "producer", fp8_scores)


def pick_splits(blocks, slots, max_splits, min_blocks):
    """Split-K count for `blocks` (sequence, KV head) pairs on `slots` resident CUDA blocks.

    With s splits a block's work is 1/s and the launch takes ceil(blocks * s / slots) waves,
    so time goes as waves / s. Splits cost a combine and their partials (B=128, head_dim 256:
    4.49 ms unsplit, 4.76-4.97 with 2-4 splits), so among the counts within 10 % of the least
    time: the fewest that launch at least `min_blocks` blocks (the kernel passes two per SM),
    else the most. At B=32, head_dim 512 (64 pairs, 132 slots) five splits take three waves of
    1/5 of a pair's work (3/5 in all) and measured 2.31 ms; four take two waves of 1/4 (1/2 in
    all), 1.99 ms.
    """
    cands = range(1, min(max_splits, 16) + 1)
    cost = {s: -(-blocks * s // slots) / s for s in cands}
    best = min(cost.values())
    near = [s for s in cands if cost[s] <= best * 1.1]
    return next((s for s in near if blocks * s >= min_blocks), near[-1])


def supports(q, pool, **tuning) -> bool:
    """Whether the kernel handles this configuration (else "auto" uses the reference)."""
    _, page_size, num_kv_heads, head_dim = pool.shape
    group = q.shape[1] // num_kv_heads
    if head_dim not in HEAD_DIMS or page_size not in PAGE_SIZES or group > MAX_GROUP:
        return False
    p_smem = pc.p_in_smem(_checks.interpret_params(), head_dim)  # as the call will decide
    try:
        _pick(
            head_dim,
            page_size,
            pool.dtype,
            q.shape[0],
            num_kv_heads,
            1,
            DecodeTuning(**tuning),
            p_smem,
            group=group,
        )
    except (ValueError, TypeError):
        return False
    return True


def _check_supported(q, pool):
    _, page_size, num_kv_heads, head_dim = pool.shape
    group = q.shape[1] // num_kv_heads
    pc.check_shape("decode", head_dim, page_size)
    if group > MAX_GROUP:
        raise ValueError(f"decode kernel GQA group must be <= {MAX_GROUP}, got {group}")


def _step_range(kv_len, split, window, page_size, block_kv, num_splits):
    """(lo, lo_blk, hi_blk, first step, step count) of one CUDA block: the keys [lo, kv_len)
    it may see, the blocks [lo_blk, hi_blk) it may read and its share of the steps."""
    lo = jnp.int32(0) if window is None else jnp.maximum(kv_len - window, 0)
    lo_blk = lo // page_size
    hi_blk = jnp.maximum((kv_len + page_size - 1) // page_size, lo_blk + 1)  # exclusive
    first_step = lo // block_kv
    n_total = jnp.where(kv_len > 0, (kv_len + block_kv - 1) // block_kv - first_step, 0)
    per_split = (n_total + num_splits - 1) // num_splits
    st = first_step + jnp.minimum(split * per_split, n_total)
    n = jnp.clip(n_total - split * per_split, 0, per_split)
    return lo, lo_blk, hi_blk, st, n


def _decode_call(
    kv_lens,
    page_table,
    q_tiles,
    pool,
    *,
    scale,
    window,
    softcap,
    k_scale,
    v_scale,
    group,
    tuning,
    cdtype,
    q_dtype,
    interpret,
):
    """Runs the kernel. q_tiles: [B, Hkv, 64, D] (compute dtype, rows >= G zero); tuning: the
    resolved knobs (none None).

    Returns o [B, Hkv, G, D] (normalised, q dtype) when num_splits == 1, else float32 partials
    o [B, Hkv, NS, G, D], m and l [B, Hkv, NS, 64] (m in log2 units).
    """
    batch, num_kv_heads, _, head_dim = q_tiles.shape
    _, page_size, _, _ = pool.shape
    max_blocks = page_table.shape[2]
    fp8 = _checks.is_fp8(pool.dtype)
    num_wgs = 2 if head_dim > 256 else 1
    dv = head_dim // num_wgs
    T, num_stages, num_splits = tuning.block_kv, tuning.num_stages, tuning.num_splits
    split = num_splits > 1
    p_in_smem = pc.p_in_smem(interpret, head_dim)

    def body(kv_lens_ref, pt_ref, q_ref, pool_ref, scales_ref, *refs):
        if split:
            o_ref, m_ref, l_ref = refs
        else:
            (o_ref,) = refs
        h = lax.axis_index("h")
        sp = lax.axis_index("s")
        b = lax.axis_index("b")
        wg = lax.axis_index("wg") if num_wgs > 1 else 0
        kv_len = kv_lens_ref[b]
        lo, lo_blk, hi_blk, st, n = _step_range(kv_len, sp, window, page_size, T, num_splits)
        qk_scale = scale * pc.LOG2E * scales_ref[0]

        def leader(fn):
            if num_wgs == 1:
                fn()
            else:
                pl.when(wg == 0)(fn)

        def main(q_smem, k_ring, v_ring, p_smem, deq, q_bar, k_bar, v_bar, k_done, v_done):
            p_smem = p_smem.at[wg] if p_in_smem else None
            k_deq, v_deq = (deq.at[wg, 0], deq.at[wg, 1]) if fp8 else (None, None)

            issue = pc.PageIssuer(
                pool_ref,
                pt_ref,
                k_ring,
                k_bar,
                v_ring,
                v_bar,
                b=b,
                kv_head=h,
                block_kv=T,
                page_size=page_size,
                lo_blk=lo_blk,
                hi_blk=hi_blk,
                max_blocks=max_blocks,
            )

            @functools.partial(leader)
            def _prologue():
                plgpu.copy_gmem_to_smem(q_ref.at[b, h], q_smem, q_bar)
                pc.ring_prologue(issue, st, n, num_stages)

            plgpu.barrier_wait(q_bar)

            refill = functools.partial(
                pc.ring_refill,
                issue,
                n=n,
                num_stages=num_stages,
                leader=leader,
                multi_wg=num_wgs > 1,
            )

            def step(j, carry):
                acc, m_i, l_i = carry
                slot = lax.rem(j, num_stages)
                j_abs = st + j
                plgpu.barrier_wait(k_bar.at[slot])
                s = pc.qk_block(
                    q_smem,
                    k_ring.at[slot],
                    k_deq,
                    fp8=fp8,
                    cdtype=cdtype,
                    head_dim=head_dim,
                    block_kv=T,
                )
                refill(
                    k_done, 0, j=j, step=j_abs, slot=slot
                )  # K of a later step streams in during P V
                s = pc.softcap_logits(s * qk_scale, softcap)  # [64, T], log2 units
                pos = j_abs * T + plgpu.broadcasted_iota(
                    jnp.int32, (ROWS, T), 1, layout=plgpu.Layout.WGMMA
                )
                p, alpha, m_i, l_i = pc.softmax_step(s, (pos >= lo) & (pos < kv_len), m_i, l_i)
                p_op = pc.stage_p(p, p_smem, cdtype)
                plgpu.barrier_wait(v_bar.at[slot])
                pv = pc.pv_block(
                    p_op,
                    v_ring.at[slot],
                    v_deq,
                    fp8=fp8,
                    cdtype=cdtype,
                    col0=wg * dv,
                    cols=dv,
                    block_kv=T,
                    p_in_smem=p_in_smem,
                )
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + pv
                refill(v_done, 1, j=j, step=j_abs, slot=slot)
                return acc, m_i, l_i

            return lax.fori_loop(0, n, step, pc.init_stats(dv))

        item = jnp.dtype(pool.dtype)
        p_swizzle = pc.row_swizzle(T, cdtype)
        v_swizzle = pc.SWIZZLE if fp8 else p_swizzle  # fp8 V is dequantised, never an operand
        done = plgpu.Barrier(num_arrivals=num_wgs, num_barriers=num_stages)
        pages = pc.pages_per_step(T, page_size)
        scratch = [
            plgpu.SMEM((ROWS, head_dim), cdtype, transforms=pc.transforms(cdtype)),
            plgpu.SMEM((num_stages, T, head_dim), item, transforms=pc.transforms(item)),
            # P V takes A and B with one swizzle: V gets P's (64 bytes when T is 32).
            plgpu.SMEM((num_stages, T, head_dim), item, transforms=pc.transforms(item, v_swizzle)),
            plgpu.SMEM((num_wgs, ROWS, T), cdtype, transforms=pc.transforms(cdtype, p_swizzle))
            if p_in_smem
            else None,
            plgpu.SMEM((num_wgs, 2, ROWS, 128), cdtype, transforms=pc.transforms(cdtype))
            if fp8
            else None,
            plgpu.Barrier(num_barriers=()),
            plgpu.Barrier(num_arrivals=pages, num_barriers=num_stages),
            plgpu.Barrier(num_arrivals=pages, num_barriers=num_stages),
            done if num_wgs > 1 else None,
            done if num_wgs > 1 else None,
        ]
        kw = dict(collective_axes="wg") if num_wgs > 1 else {}
        acc, m_i, l_i = pl.run_scoped(main, *scratch, **kw)

        v_mult = scales_ref[1]
        cols = pl.ds(wg * dv, dv) if num_wgs > 1 else slice(None)

        def epilogue(o_smem, stat_smem):
            o_smem = o_smem.at[wg]
            if split:
                o_smem[...] = acc * v_mult
            else:
                inv = jnp.where(l_i > 0, v_mult / jnp.where(l_i > 0, l_i, 1.0), 0.0)
                o_smem[...] = (acc * lax.broadcast_in_dim(inv, acc.shape, [0])).astype(o_smem.dtype)

            @functools.partial(leader)
            def _():
                if split:
                    stat_smem.at[0][...] = m_i
                    stat_smem.at[1][...] = l_i

            plgpu.commit_smem()
            if split:
                plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, group)], o_ref.at[b, h, sp, :, cols])

                @functools.partial(leader)
                def _():
                    plgpu.copy_smem_to_gmem(stat_smem.at[0], m_ref.at[b, h, sp])
                    plgpu.copy_smem_to_gmem(stat_smem.at[1], l_ref.at[b, h, sp])
            else:
                plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, group)], o_ref.at[b, h, :, cols])
            plgpu.wait_smem_to_gmem(0)

        o_dtype = jnp.float32 if split else q_dtype
        pl.run_scoped(
            epilogue,
            plgpu.SMEM((num_wgs, ROWS, dv), o_dtype),
            plgpu.SMEM((2, ROWS), jnp.float32),
            **kw,
        )

    if split:
        out_type = (
            jax.ShapeDtypeStruct((batch, num_kv_heads, num_splits, group, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((batch, num_kv_heads, num_splits, ROWS), jnp.float32),
            jax.ShapeDtypeStruct((batch, num_kv_heads, num_splits, ROWS), jnp.float32),
        )
    else:
        out_type = jax.ShapeDtypeStruct((batch, num_kv_heads, group, head_dim), q_dtype)
    kernel = plgpu.kernel(
        body,
        out_type=out_type,
        grid=(num_kv_heads, num_splits, batch),
        grid_names=("h", "s", "b"),
        num_threads=num_wgs if num_wgs > 1 else None,
        thread_name="wg" if num_wgs > 1 else None,
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret,
    )
    scales = jnp.stack([k_scale, v_scale]).astype(jnp.float32)
    return kernel(kv_lens, page_table, q_tiles, pool, scales)


def _dequant_tile(src, dst):
    """fp8 [T, D] SMEM tile -> dst (float16, WGMMA-tiled) in [64, 128] chunks, one fence."""
    rows, cols = src.shape
    for r in range(0, rows, ROWS):
        for c in range(0, cols, 128):
            chunk = (pl.ds(r, ROWS), pl.ds(c, 128))
            dst.at[chunk][...] = src.at[chunk][...].astype(dst.dtype)
    plgpu.commit_smem()


def _producer_call(
    kv_lens,
    page_table,
    q_tiles,
    q_inv,
    pool,
    *,
    scale,
    window,
    softcap,
    k_scale,
    v_scale,
    tuning,
    cdtype,
    q_dtype,
    interpret,
):
    """The producer schedule. q_tiles: [B, Hkv, R, D]: the group's queries zero-padded to
    R = N rows in the compute dtype, or for split-q fp8 the hi (rows [0, N)) and lo (rows
    [N, 2N)) fp8 parts of the queries scaled by a power of two (R = 2N); q_inv f32[B, Hkv]:
    the logit factor undoing that scaling (1 otherwise).

    Returns, unsplit with a 16-bit q: o [B, Hkv, N, D] (normalised, q dtype); unsplit with a
    float32 q: o [B, Hkv, D, N] float32 (normalised); split: float32 partials o [B, Hkv, NS,
    D, N], m and l [B, Hkv, NS, N] (m in log2 units).
    """
    batch, num_kv_heads, q_rows, head_dim = q_tiles.shape
    split_q = _checks.is_fp8(q_tiles.dtype)
    n_pad = q_rows // 2 if split_q else q_rows
    _, page_size, _, _ = pool.shape
    max_blocks = page_table.shape[2]
    fp8 = _checks.is_fp8(pool.dtype)
    dequant_k = fp8 and tuning.fp8_scores == "dequant"
    T, num_slots, num_splits = tuning.block_kv, tuning.num_stages, tuning.num_splits
    split = num_splits > 1
    o_rows = not split and jnp.dtype(q_dtype).itemsize == 2
    item = jnp.dtype(pool.dtype)
    q_item = q_tiles.dtype
    pages = pc.pages_per_step(T, page_size)
    f32 = jnp.float32
    # P V accumulates into O^T in place when compiled (the interpreter's WGMMA adds into a
    # fresh accumulator: no run_state), which keeps one [D, N] float32 tile out of registers.
    in_place = interpret is None

    def body(kv_lens_ref, pt_ref, q_ref, q_inv_ref, pool_ref, scales_ref, *refs):
        h = lax.axis_index("h")
        sp = lax.axis_index("s")
        b = lax.axis_index("b")
        wg = lax.axis_index("wg")
        kv_len = kv_lens_ref[b]
        lo, lo_blk, hi_blk, st, n = _step_range(kv_len, sp, window, page_size, T, num_splits)
        where = dict(
            b=b,
            block_kv=T,
            page_size=page_size,
            lo_blk=lo_blk,
            hi_blk=hi_blk,
            max_blocks=max_blocks,
        )

        def main(q_smem, ring, p_smem, deq, q_bar, full, empty):
            # Half-step i of the block: K (even i) or V (odd i) of local step i // 2, in ring
            # slot i % num_slots; full[slot] counts its TMA bytes, empty[slot] the consumer's
            # release.
            def reads(i):
                return pc.step_pages(pt_ref, role=lax.rem(i, 2), step=st + i // 2, **where)

            def producer():
                """Warpgroup 1: only issues TMA copies, as far ahead as the ring allows."""
                plgpu.copy_gmem_to_smem(q_ref.at[b, h], q_smem, q_bar)
                for i in range(num_slots):

                    @pl.when(i < 2 * n)
                    def _(i=i):
                        pc.copy_pages(pool_ref, reads(i), ring.at[i], full.at[i], kv_head=h)

                def refill(i, carry):
                    slot = lax.rem(i, num_slots)
                    r = reads(i)  # page ids first: their GMEM loads overlap the wait
                    plgpu.barrier_wait(empty.at[slot])
                    pc.copy_pages(pool_ref, r, ring.at[slot], full.at[slot], kv_head=h)
                    return carry

                lax.fori_loop(num_slots, 2 * n, refill, ())
                return pc.init_stats(n_pad, head_dim, axis=0)

            def consumer():
                """Warpgroup 0: S^T = K Q^T, softmax over the tokens (rows), O^T += V^T P^T."""
                plgpu.barrier_wait(q_bar)
                qk_scale = scale * pc.LOG2E * scales_ref[0] * q_inv_ref[b, h]
                k_deq = deq.at[1] if dequant_k else None
                v_deq = deq.at[0] if fp8 else None

                def release(i, slot):
                    """Frees half-step i's slot for the producer (only if it refills it, so
                    every completed phase of `empty` has a waiter)."""
                    plgpu.barrier_arrive(empty.at[slot], predicate=i + num_slots < 2 * n)

                def step(j, carry):
                    acc, m_i, l_i = carry
                    k_slot = lax.rem(2 * j, num_slots)
                    v_slot = lax.rem(2 * j + 1, num_slots)
                    plgpu.barrier_wait(full.at[k_slot])
                    k_op = ring.at[k_slot]
                    if dequant_k:
                        _dequant_tile(k_op, k_deq)
                        release(2 * j, k_slot)
                        k_op = k_deq

                    def scores(s_ref):
                        plgpu.wgmma(s_ref, k_op, q_smem.transpose((1, 0)))  # B: Q^T [D, R]
                        if fp8:  # V's dequant on the CUDA cores overlaps the WGMMA
                            plgpu.barrier_wait(full.at[v_slot])
                            _dequant_tile(ring.at[v_slot], v_deq)
                            release(2 * j + 1, v_slot)
                        return s_ref[...]

                    s = pl.run_scoped(scores, plgpu.ACC((T, q_rows), f32))  # [T, R]
                    if split_q:  # S^T = K hi^T + K lo^T
                        s = s[:, :n_pad] + s[:, n_pad:]
                    if not dequant_k:
                        release(2 * j, k_slot)
                    s = pc.softcap_logits(s * qk_scale, softcap)  # log2 units
                    pos = (st + j) * T + plgpu.broadcasted_iota(
                        jnp.int32, (T, n_pad), 0, layout=plgpu.Layout.WGMMA
                    )
                    valid = (pos >= lo) & (pos < kv_len)
                    p, alpha, m_i, l_i = pc.softmax_step(s, valid, m_i, l_i, axis=0)
                    p_smem.transpose((1, 0))[...] = p.astype(cdtype)  # P^T stored [N, T]
                    plgpu.commit_smem()
                    if not fp8:
                        plgpu.barrier_wait(full.at[v_slot])
                    v_op = v_deq if fp8 else ring.at[v_slot]

                    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [1])

                    def values(o_ref):
                        if in_place:
                            o_ref[...] = acc  # O^T * alpha becomes the WGMMA accumulator
                        plgpu.wgmma(o_ref, v_op.transpose((1, 0)), p_smem.transpose((1, 0)))
                        return o_ref[...]

                    pv = pl.run_scoped(values, plgpu.ACC((head_dim, n_pad), f32))  # [D, N]
                    if not fp8:
                        release(2 * j + 1, v_slot)
                    acc = pv if in_place else acc + pv
                    return acc, m_i, l_i

                return lax.fori_loop(0, n, step, pc.init_stats(n_pad, head_dim, axis=0))

            return lax.cond(wg == 0, consumer, producer)

        ring_tf = pc.transforms(item)
        deq_bufs = 2 if dequant_k else 1
        acc, m_i, l_i = pl.run_scoped(
            main,
            plgpu.SMEM((q_rows, head_dim), q_item, transforms=pc.transforms(q_item)),
            plgpu.SMEM((num_slots, T, head_dim), item, transforms=ring_tf),
            plgpu.SMEM((n_pad, T), cdtype, transforms=pc.transforms(cdtype)),
            plgpu.SMEM((deq_bufs, T, head_dim), cdtype, transforms=pc.transforms(cdtype))
            if fp8
            else None,
            plgpu.Barrier(num_barriers=()),
            plgpu.Barrier(num_arrivals=pages, num_barriers=num_slots),
            plgpu.Barrier(num_arrivals=1, num_barriers=num_slots),
            collective_axes="wg",
        )

        def epilogue(o_smem, stat_smem):
            @pl.when(wg == 0)
            def _():
                v_mult = scales_ref[1]
                if split:
                    o = acc * v_mult
                else:
                    inv = jnp.where(l_i > 0, v_mult / jnp.where(l_i > 0, l_i, 1.0), 0.0)
                    o = acc * lax.broadcast_in_dim(inv, acc.shape, [1])
                if o_rows:
                    o_smem.transpose((1, 0))[...] = o.astype(o_smem.dtype)  # O [N, D]
                else:
                    o_smem[...] = o  # O^T [D, N] float32
                if split:
                    stat_smem.at[0][...] = m_i
                    stat_smem.at[1][...] = l_i
                plgpu.commit_smem()
                if o_rows:
                    plgpu.copy_smem_to_gmem(o_smem, refs[0].at[b, h])
                else:
                    dst = refs[0].at[b, h, sp] if split else refs[0].at[b, h]
                    for r in range(0, head_dim, 256):  # TMA boxes of <= 256 rows
                        rows = pl.ds(r, min(256, head_dim - r))
                        plgpu.copy_smem_to_gmem(o_smem.at[rows], dst.at[rows])
                if split:
                    plgpu.copy_smem_to_gmem(stat_smem.at[0], refs[1].at[b, h, sp])
                    plgpu.copy_smem_to_gmem(stat_smem.at[1], refs[2].at[b, h, sp])
                plgpu.wait_smem_to_gmem(0)

        if o_rows:
            o_stage = plgpu.SMEM((n_pad, head_dim), q_dtype, transforms=pc.transforms(q_dtype))
        else:
            o_stage = plgpu.SMEM((head_dim, n_pad), f32)
        pl.run_scoped(epilogue, o_stage, plgpu.SMEM((2, n_pad), f32), collective_axes="wg")

    if split:
        out_type = (
            jax.ShapeDtypeStruct((batch, num_kv_heads, num_splits, head_dim, n_pad), f32),
            jax.ShapeDtypeStruct((batch, num_kv_heads, num_splits, n_pad), f32),
            jax.ShapeDtypeStruct((batch, num_kv_heads, num_splits, n_pad), f32),
        )
    elif o_rows:
        out_type = jax.ShapeDtypeStruct((batch, num_kv_heads, n_pad, head_dim), q_dtype)
    else:
        out_type = jax.ShapeDtypeStruct((batch, num_kv_heads, head_dim, n_pad), f32)
    kernel = plgpu.kernel(
        body,
        out_type=out_type,
        grid=(num_kv_heads, num_splits, batch),
        grid_names=("h", "s", "b"),
        num_threads=2,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret,
    )
    scales = jnp.stack([k_scale, v_scale]).astype(f32)
    return kernel(kv_lens, page_table, q_tiles, q_inv, pool, scales)


def split_queries(q_groups):
    """Split-q fp8 queries: q [B, Hkv, G, D] -> (hi, lo) float8_e4m3fn [B, Hkv, 2, G, D] and
    the factor f32[B, Hkv] that undoes their scaling.

    Each (sequence, KV head) tile is scaled by the power of two c that brings its largest
    |q| to at most 448; hi = e4m3(q c), lo = e4m3(q c - hi), so hi + lo keeps about 8
    significant bits (bf16 keeps 8) of every entry within 2^11 of the tile's largest.
    """
    qf = q_groups.astype(jnp.float32)
    amax = jnp.max(jnp.abs(qf), axis=(2, 3))  # [B, Hkv]
    c = jnp.where(
        amax > 0, jnp.exp2(jnp.floor(jnp.log2(FP8_MAX / jnp.where(amax > 0, amax, 1.0)))), 1.0
    )
    qs = qf * c[:, :, None, None]
    hi = qs.astype(jnp.float8_e4m3fn)
    lo = (qs - hi.astype(jnp.float32)).astype(jnp.float8_e4m3fn)
    return jnp.stack([hi, lo], axis=2), 1.0 / c


def combine_splits(o, m, l, group):
    """Merges float32 split partials o [B, Hkv, NS, G, D], m, l [B, Hkv, NS, 64].

    Returns [B, Hkv, G, D]; m is in log2 units, a split that saw no key has l == 0.
    """
    m = m[..., :group]  # [B, Hkv, NS, G]
    l = l[..., :group]
    m_max = jnp.max(m, axis=2, keepdims=True)
    w = jnp.where(l > 0, jnp.exp2(m - m_max), 0.0)  # [B, Hkv, NS, G]
    denom = jnp.sum(w * l, axis=2)  # [B, Hkv, G]
    num = jnp.sum(w[..., None] * o, axis=2)  # [B, Hkv, G, D]
    return jnp.where(denom[..., None] > 0, num / jnp.where(denom > 0, denom, 1.0)[..., None], 0.0)


@functools.partial(
    jax.jit,
    static_argnames=(
        "scale",
        "window",
        "softcap",
        "tuning",
        "interpret",
    ),
)
def _decode_jit(
    q,
    pool,
    page_table,
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
    batch, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = pool.shape
    group = num_q_heads // num_kv_heads
    cdtype, tuning = _pick(
        head_dim,
        page_size,
        pool.dtype,
        batch,
        num_kv_heads,
        page_table.shape[2],
        tuning,
        pc.p_in_smem(interpret, head_dim),
        window,
        group,
    )
    q_groups = q.reshape(batch, num_kv_heads, group, head_dim)  # [B, Hkv, G, D]
    attention = dict(
        scale=scale,
        window=window,
        softcap=softcap,
        k_scale=k_scale,
        v_scale=v_scale,
        tuning=tuning,
        cdtype=cdtype,
        q_dtype=q.dtype,
        interpret=interpret,
    )
    if tuning.schedule == "producer":
        n_pad = producer_rows(group)
        pad = ((0, 0), (0, 0), (0, 0), (0, n_pad - group), (0, 0))
        if tuning.fp8_scores == "split_q":
            parts, q_inv = split_queries(q_groups)  # [B, Hkv, 2, G, D], [B, Hkv]
            q_tiles = jnp.pad(parts, pad).reshape(batch, num_kv_heads, 2 * n_pad, head_dim)
        else:
            q_tiles = jnp.pad(q_groups.astype(cdtype)[:, :, None], pad)[:, :, 0]  # [B,Hkv,N,D]
            q_inv = jnp.ones((batch, num_kv_heads), jnp.float32)
        res = _producer_call(kv_lens, page_table, q_tiles, q_inv, pool, **attention)
        if tuning.num_splits > 1:
            o, m, l = res
            out = combine_splits(jnp.swapaxes(o, -1, -2)[..., :group, :], m, l, group)
        elif jnp.dtype(q.dtype).itemsize == 2:  # o [B, Hkv, N, D] (`_producer_call`)
            out = res[:, :, :group]
        else:  # float32 o^T [B, Hkv, D, N]
            out = jnp.swapaxes(res, -1, -2)[:, :, :group]
        return out.astype(q.dtype).reshape(batch, num_q_heads, head_dim)
    q_tiles = q_groups.astype(cdtype)
    q_tiles = jnp.pad(q_tiles, ((0, 0), (0, 0), (0, ROWS - group), (0, 0)))  # [B, Hkv, 64, D]
    res = _decode_call(kv_lens, page_table, q_tiles, pool, group=group, **attention)
    if tuning.num_splits > 1:
        out = combine_splits(*res, group).astype(q.dtype)
    else:
        out = res
    return out.reshape(batch, num_q_heads, head_dim)


def paged_decode_attention_pallas(
    q,
    pool,
    page_table,
    kv_lens,
    *,
    scale,
    window=None,
    softcap=None,
    k_scale=None,
    v_scale=None,
    **tuning,
):
    """Mosaic GPU paged decode attention (validated inputs; see `paged_attention.py`).

    tuning: the `DecodeTuning` knobs (schedule, block_kv, num_stages, num_splits, fp8_scores).
    """
    _check_supported(q, pool)
    ks, vs = _checks.kv_scales(pool, k_scale, v_scale)
    return _decode_jit(
        q,
        pool,
        page_table,
        kv_lens,
        ks,
        vs,
        scale=float(scale),
        window=window,
        softcap=None if softcap is None else float(softcap),
        tuning=DecodeTuning(**tuning),
        interpret=_checks.interpret_params(),
    )
