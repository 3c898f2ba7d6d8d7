"""Mosaic GPU (sm90) paged decode attention: one new token per sequence over its pages.

One CUDA block per (KV head, context split, sequence). The G = Hq // Hkv query heads of the KV
head are the first G rows of a 64-row WGMMA tile (the rest are zero), so every K/V page of the
head is read once for the whole group. K/V pages stream through a ring of `num_stages` SMEM
slots by TMA; the source page of each copy comes from the page table (scalar loads from GMEM).
A step covers `block_kv` tokens: several whole pages (block_kv >= page_size) or a slice of one
(block_kv < page_size). S = Q K^T and O += P V run on WGMMA with float32 accumulation and an
online (exp2) softmax in float32; P enters the second WGMMA from registers (head_dim < 256,
compiled) or through SMEM (`_paged_common.p_in_smem`).

Only blocks [lo // S, cdiv(kv_len, S)) are read, lo = max(0, kv_len - window): a step whose
aligned range reaches outside it re-reads an in-range page instead (its logits are masked), so
BAD or out-of-window pages are never touched. Rows of a read page outside [lo, kv_len) are
masked out of the logits; they must hold finite values (as any page written by `kv_write` or
zero-initialised does), since a masked row still enters P V with weight 0.

With `num_splits > 1` each block handles a contiguous share of the steps and writes
unnormalised float32 partials (o, m, l); a small jnp combine merges them. head_dim 512 uses two
compute warpgroups, each owning half of O (both compute S; splitting its contraction between
them, the halves summed through SMEM, measured slower: `experiments/NOTES.md`, v7). fp8 (e4m3)
pools are dequantised in SMEM to float16 per 64x128 chunk; the scales are folded into the logit
scale and the output.

Axis names: B sequences, Hkv KV heads, G query heads per KV head, D head_dim, S page_size,
T block_kv (tokens per step), NS num_splits.
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


@dataclasses.dataclass(frozen=True)
class DecodeTuning:
    """Static knobs of the decode kernel (None = chosen from the shapes).

    block_kv: tokens per pipeline step: a multiple of 64 (or 32, for 16-bit pools) and a
        multiple or divisor of page_size.
    num_stages: SMEM ring depth (TMA steps in flight).
    num_splits: context splits per (sequence, KV head) (split-K), combined in float32.
    """

    block_kv: int | None = None
    num_stages: int | None = None
    num_splits: int | None = None


def _smem_bytes(head_dim, block_kv, num_stages, pool_dtype, cdtype, p_in_smem):
    item = jnp.dtype(pool_dtype).itemsize
    ring = num_stages * 2 * block_kv * head_dim * item
    q = ROWS * head_dim * cdtype.itemsize
    num_wgs = 2 if head_dim > 256 else 1
    p = num_wgs * ROWS * block_kv * 2 if p_in_smem else 0
    dequant = num_wgs * 2 * ROWS * 128 * 2 if _checks.is_fp8(pool_dtype) else 0
    return ring + q + p + dequant + 2048  # barriers, reduction scratch


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
):
    """Resolves the tuning knobs; raises ValueError for an unsupported configuration."""
    cdtype = pc.compute_dtype(pool_dtype)
    if cdtype is None:
        raise ValueError("the Pallas decode kernel needs a bf16, f16 or fp8 pool, got float32")
    if _checks.is_fp8(pool_dtype) and head_dim < 128:  # dequantised in 64 x 128 chunks
        raise ValueError(f"fp8 pools need head_dim >= 128 in the Pallas kernels, got {head_dim}")
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
    return cdtype, DecodeTuning(block_kv, num_stages, num_splits)


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
        lo = jnp.int32(0) if window is None else jnp.maximum(kv_len - window, 0)
        lo_blk = lo // page_size
        hi_blk = jnp.maximum((kv_len + page_size - 1) // page_size, lo_blk + 1)  # exclusive
        first_step = lo // T
        n_total = jnp.where(kv_len > 0, (kv_len + T - 1) // T - first_step, 0)
        per_split = (n_total + num_splits - 1) // num_splits
        st = first_step + jnp.minimum(sp * per_split, n_total)
        n = jnp.clip(n_total - sp * per_split, 0, per_split)
        qk_scale = scale * pc.LOG2E * scales_ref[0]

        def leader(fn):
            if num_wgs == 1:
                fn()
            else:
                pl.when(wg == 0)(fn)

        def main(q_smem, k_ring, v_ring, p_smem, deq, q_bar, k_bar, v_bar, k_done, v_done):
            p_smem = p_smem.at[wg] if p_in_smem else None
            k_deq, v_deq = (deq.at[wg, 0], deq.at[wg, 1]) if fp8 else (None, None)

            issue = pc.page_issuer(
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
    )
    q_tiles = q.reshape(batch, num_kv_heads, group, head_dim).astype(cdtype)
    q_tiles = jnp.pad(q_tiles, ((0, 0), (0, 0), (0, ROWS - group), (0, 0)))  # [B, Hkv, 64, D]
    res = _decode_call(
        kv_lens,
        page_table,
        q_tiles,
        pool,
        scale=scale,
        window=window,
        softcap=softcap,
        k_scale=k_scale,
        v_scale=v_scale,
        group=group,
        tuning=tuning,
        cdtype=cdtype,
        q_dtype=q.dtype,
        interpret=interpret,
    )
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

    tuning: the `DecodeTuning` knobs (block_kv, num_stages, num_splits).
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
