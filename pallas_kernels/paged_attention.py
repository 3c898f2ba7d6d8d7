"""Paged attention over a pool root: the validated public functions and their pure-jnp reference.

Owns `ragged_paged_attention` (a ragged batch of chunks: chunked prefill and decode alike),
`paged_decode_attention` (one new token per sequence) and their references. The Mosaic GPU
kernels live in `_decode_kernel.py` and `_prefill_kernel.py`.

Axis names: T packed new tokens, B sequences, NB blocks per page table row, P pages of the pool
root, S page_size, Hq query heads, Hkv KV heads, G = Hq // Hkv (GQA group), D head_dim,
L = NB * S keys per sequence, Tq query rows per sequence.

The reference never lets a BAD page, a page past kv_lens or a token outside the window of every
query influence the result: pages are gathered with a clamped index and both the logits and the
V values are selected with `jnp.where` (0 * NaN would be NaN).

The Pallas kernels never read a BAD page, a block past kv_lens or a block wholly outside the
window; they read whole pages, so the rows of a read page that no query sees (past kv_lens,
before the window) must hold finite values, as rows written by `kv_write` or a zero-initialised
pool do. "auto" uses the reference where the kernel does not support the configuration
(float32 pools, other head_dims or page sizes). Precision: the kernels round the queries and
the softmax weights P to the KV compute dtype (bf16 or f16; f16 for fp8 pools) for WGMMA and
accumulate in float32, as FlashAttention does; the reference computes in float32 throughout.
With unit-norm q and k at attention scale 1 (Gemma 4) the rounding of q dominates the
difference between the two.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import _checks
from pallas_kernels._contract import MASK_VALUE  # masked logits: a row with no key weighs 0

# A multiple of every query tile of the prefill kernel (128 rows up to head_dim 256, 64 at
# 512). A query's output does not depend on where its sequence's new tokens start, as long as
# they start at a multiple of it (bitwise; tests/test_paged_attention.py), which is what lets a
# batch-invariant schedule cut prompts into chunks there (`swajax._scheduler`).
PREFILL_QUERY_TILE = 128


def _attend_one(
    q, q_pos, q_valid, k_pages, v_pages, kv_len, pool, *, scale, window, softcap, k_scale, v_scale
):
    """Attention of one sequence's query rows over its pages, float32 throughout.

    q: [Tq, Hq, D]; q_pos, q_valid: [Tq] (absolute positions, row validity);
    k_pages, v_pages: i32[NB] page ids (BAD = -1); kv_len: i32[]. Returns f32[Tq, Hq, D].
    """
    num_pages, page_size, num_kv_heads, head_dim = pool.shape
    tq, num_q_heads, _ = q.shape
    group = num_q_heads // num_kv_heads
    max_blocks = k_pages.shape[0]
    length = max_blocks * page_size

    def gather(pages, dequant):
        x = pool[jnp.clip(pages, 0, num_pages - 1)]  # [NB, S, Hkv, D]
        return x.reshape(length, num_kv_heads, head_dim).astype(jnp.float32) * dequant

    k = gather(k_pages, k_scale)  # [L, Hkv, D]
    v = gather(v_pages, v_scale)  # [L, Hkv, D]

    key_pos = jnp.arange(length, dtype=jnp.int32)  # [L]
    block = key_pos // page_size
    key_ok = (key_pos < kv_len) & (k_pages[block] != _checks.BAD)  # [L]
    val_ok = (key_pos < kv_len) & (v_pages[block] != _checks.BAD)  # [L]
    if window is not None:
        # A key is in the window of some query iff it is after the earliest query's window start.
        first_pos = jnp.min(jnp.where(q_valid, q_pos, jnp.iinfo(jnp.int32).max))
        val_ok &= key_pos > first_pos - window
    v = jnp.where(val_ok[:, None, None], v, 0.0)

    qf = q.astype(jnp.float32).reshape(tq, num_kv_heads, group, head_dim)  # [Tq, Hkv, G, D]
    s = jnp.einsum("tkgd,lkd->kgtl", qf, k, precision=jax.lax.Precision.HIGHEST) * scale
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    allowed = key_ok[None, :] & (key_pos[None, :] <= q_pos[:, None]) & q_valid[:, None]  # [Tq, L]
    if window is not None:
        allowed &= q_pos[:, None] - key_pos[None, :] < window
    s = jnp.where(allowed, s, MASK_VALUE)  # [Hkv, G, Tq, L]
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.where(allowed, jnp.exp(s - m), 0.0)
    denom = jnp.sum(p, axis=-1)  # [Hkv, G, Tq]
    o = jnp.einsum("kgtl,lkd->tkgd", p, v, precision=jax.lax.Precision.HIGHEST)
    denom = jnp.moveaxis(denom, -1, 0)[..., None]  # [Tq, Hkv, G, 1]
    o = jnp.where(denom > 0, o / jnp.where(denom > 0, denom, 1.0), 0.0)
    return o.reshape(tq, num_q_heads, head_dim)


def ragged_paged_attention_reference(
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
):
    """Pure-jnp ragged paged attention, float32 accumulation (see the `pallas_kernels` docstring).

    q: [T, Hq, D]; pool: [P, S, Hkv, D]; page_table: i32[B, 2, NB]; q_starts: i32[B + 1];
    kv_lens: i32[B]. Returns [T, Hq, D] in q's dtype, padding rows (>= q_starts[B]) zero.
    Sequences are processed one after another (each with all T rows padded to its own
    [T, Hq, D] query block) so memory stays O(T * L) per sequence.
    """
    ks, vs = _checks.kv_scales(pool, k_scale, v_scale)
    num_tokens = q.shape[0]
    batch = page_table.shape[0]
    rows = jnp.arange(num_tokens, dtype=jnp.int32)  # [T]

    def body(b, out):
        start, end = q_starts[b], q_starts[b + 1]
        q_len = end - start
        r = rows  # row index within the sequence
        q_b = q[jnp.clip(start + r, 0, num_tokens - 1)]  # [T, Hq, D]
        q_valid = r < q_len
        q_pos = kv_lens[b] - q_len + r
        o = _attend_one(
            q_b,
            q_pos,
            q_valid,
            page_table[b, 0],
            page_table[b, 1],
            kv_lens[b],
            pool,
            scale=scale,
            window=window,
            softcap=softcap,
            k_scale=ks,
            v_scale=vs,
        )  # [T, Hq, D], row r = packed token start + r
        aligned = o[jnp.clip(rows - start, 0, num_tokens - 1)]  # row t = packed token t
        owned = (rows >= start) & (rows < end)
        return jnp.where(owned[:, None, None], aligned, out)

    out = jax.lax.fori_loop(0, batch, body, jnp.zeros(q.shape, jnp.float32))
    return out.astype(q.dtype)


def paged_decode_attention_reference(
    q, pool, page_table, kv_lens, *, scale, window=None, softcap=None, k_scale=None, v_scale=None
):
    """Pure-jnp paged decode attention: q [B, Hq, D], one token per sequence at kv_lens - 1.

    Rows with kv_lens == 0 are inactive and return 0. Same core as the ragged reference.
    """
    ks, vs = _checks.kv_scales(pool, k_scale, v_scale)

    def one(args):
        q_b, pages, kv_len = args
        return _attend_one(
            q_b[None],
            (kv_len - 1)[None],
            (kv_len > 0)[None],
            pages[0],
            pages[1],
            kv_len,
            pool,
            scale=scale,
            window=window,
            softcap=softcap,
            k_scale=ks,
            v_scale=vs,
        )[0]

    out = jax.lax.map(one, (q, page_table, kv_lens))
    return out.astype(q.dtype)


# ----------------------------------------------------------------------------- validation


def _check_common(
    q, pool, page_table, kv_lens, scale, window, softcap, k_scale, v_scale, implementation
):
    _checks.check_implementation(implementation)
    _checks.check_attention_params(scale, window, softcap)
    num_pages, page_size, num_kv_heads, head_dim, batch, max_blocks = _checks.check_pool(
        pool, page_table, kv_lens
    )
    if getattr(q, "ndim", None) != 3:
        raise ValueError(f"q must have 3 dimensions, got shape {getattr(q, 'shape', None)}")
    if not jnp.issubdtype(q.dtype, jnp.floating):
        raise TypeError(f"q must be a float array, got {q.dtype}")
    if q.shape[-1] != head_dim:
        raise ValueError(f"q head_dim {q.shape[-1]} != pool head_dim {head_dim}")
    _checks.check_heads(q.shape[1], num_kv_heads)
    _checks.kv_scales(pool, k_scale, v_scale)
    return batch


def _dispatch(implementation, kernel, pallas_fn, reference_fn, args, attention, tuning):
    """Runs `pallas_fn` or `reference_fn` on (*args, **attention).

    "auto" takes the Pallas kernel on a Hopper GPU when `kernel.supports` the configuration;
    tuning goes to the kernel only.
    """
    if implementation == "pallas" or (
        implementation == "auto" and _checks.on_hopper() and kernel.supports(*args[:2], **tuning)
    ):
        return pallas_fn(*args, **attention, **tuning)
    if tuning and implementation == "reference":
        raise ValueError(f"tuning arguments {sorted(tuning)} apply only to the Pallas kernel")
    return reference_fn(*args, **attention)


def ragged_paged_attention(
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
    implementation="auto",
    **tuning,
):
    """Ragged paged attention (chunked prefill + decode); see the `pallas_kernels` docstring.

    q: [T, Hq, D]; pool: [P, S, Hkv, D]; page_table: i32[B, 2, NB]; q_starts: i32[B + 1];
    kv_lens: i32[B]; scale/window/softcap static. Returns [T, Hq, D] in q's dtype.
    implementation: "reference" | "pallas" (Mosaic GPU; interpret mode off-GPU) | "auto".
    tuning: keyword knobs of the Pallas kernel (block_kv, num_stages, mask_split, pipeline,
      pv_in_place, p_smem; see `_prefill_kernel.PrefillTuning`).
    """
    batch = _check_common(
        q, pool, page_table, kv_lens, scale, window, softcap, k_scale, v_scale, implementation
    )
    _checks.check_q_starts(q_starts, batch)
    from pallas_kernels import _prefill_kernel

    return _dispatch(
        implementation,
        _prefill_kernel,
        _prefill_kernel.ragged_paged_attention_pallas,
        ragged_paged_attention_reference,
        (q, pool, page_table, q_starts, kv_lens),
        dict(scale=scale, window=window, softcap=softcap, k_scale=k_scale, v_scale=v_scale),
        tuning,
    )


def paged_decode_attention(
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
    implementation="auto",
    **tuning,
):
    """Paged decode attention: q [B, Hq, D], the token at position kv_lens[b] - 1 of each row.

    kv_lens[b] == 0 marks an inactive row (output 0). Returns [B, Hq, D] in q's dtype.
    tuning: keyword knobs of the Pallas kernel (see `_decode_kernel.DecodeTuning`).
    """
    batch = _check_common(
        q, pool, page_table, kv_lens, scale, window, softcap, k_scale, v_scale, implementation
    )
    if q.shape[0] != batch:
        raise ValueError(f"q batch {q.shape[0]} != page_table batch {batch}")
    from pallas_kernels import _decode_kernel

    return _dispatch(
        implementation,
        _decode_kernel,
        _decode_kernel.paged_decode_attention_pallas,
        paged_decode_attention_reference,
        (q, pool, page_table, kv_lens),
        dict(scale=scale, window=window, softcap=softcap, k_scale=k_scale, v_scale=v_scale),
        tuning,
    )
