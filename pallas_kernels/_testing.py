"""Random paged-attention inputs for tests and benchmarks: a pool root poisoned with NaN.

`make_case` scatters each sequence's tokens over randomly chosen pages; every pool row that no
query may see (unused pages, rows past kv_lens, blocks wholly outside the window) holds NaN,
so any read of them shows up in the result. Host-side numpy only.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from pallas_kernels._contract import BAD


@dataclasses.dataclass
class PagedCase:
    q: np.ndarray  # [T, Hq, D] (ragged) or [B, Hq, D] (decode)
    pool: np.ndarray  # [P, S, Hkv, D]
    page_table: np.ndarray  # i32[B, 2, NB]
    q_starts: np.ndarray  # i32[B + 1]
    kv_lens: np.ndarray  # i32[B]
    k_scale: float
    v_scale: float
    visible_lo: np.ndarray  # i32[B]: first position any query of the sequence may see

    def jax_args(self):
        return dict(
            q=jnp.asarray(self.q),
            pool=jnp.asarray(self.pool),
            page_table=jnp.asarray(self.page_table),
            q_starts=jnp.asarray(self.q_starts),
            kv_lens=jnp.asarray(self.kv_lens),
        )


def make_case(
    seed,
    *,
    q_lens,
    kv_lens,
    num_q_heads,
    num_kv_heads,
    head_dim,
    page_size,
    pool_dtype=jnp.bfloat16,
    q_dtype=jnp.bfloat16,
    window=None,
    num_tokens=None,
    max_blocks=None,
    k_scale=1.0,
    v_scale=1.0,
    spare_pages=3,
    poison=True,
    decode=False,
    row_fill=np.nan,
) -> PagedCase:
    """Builds a ragged batch; `decode=True` gives q [B, Hq, D] (q_lens must all be 1 or 0).

    Stored pool values are standard normal for every dtype; the logical K/V values are
    stored * k_scale (resp. v_scale), as for a pool written by `kv_write` with those scales.
    row_fill: value of the rows of a read page that no query may see (rows past kv_lens,
    rows before the window); pages never read are always NaN.
    """
    rng = np.random.default_rng(seed)
    q_lens = np.asarray(q_lens, np.int32)
    kv_lens = np.asarray(kv_lens, np.int32)
    batch = len(kv_lens)
    assert len(q_lens) == batch and np.all(q_lens <= kv_lens)
    need_blocks = -(-kv_lens // page_size)  # [B]
    if max_blocks is None:
        max_blocks = max(1, int(need_blocks.max(initial=0)) + 1)
    assert max_blocks >= need_blocks.max(initial=0)
    q_pos0 = kv_lens - q_lens
    if window is None:
        visible_lo = np.zeros(batch, np.int32)
    else:
        visible_lo = np.maximum(q_pos0 - window + 1, 0).astype(np.int32)
    visible_lo = np.where(q_lens > 0, visible_lo, kv_lens)  # no query: nothing is visible

    num_pages = 2 * int(need_blocks.sum()) + spare_pages
    np_dtype = np.dtype(jnp.dtype(pool_dtype))
    pool = np.full((num_pages, page_size, num_kv_heads, head_dim), np.nan, np.float32)
    order = rng.permutation(num_pages)
    page_table = np.full((batch, 2, max_blocks), BAD, np.int32)
    nxt = 0
    for b in range(batch):
        for blk in range(need_blocks[b]):
            lo_pos, hi_pos = blk * page_size, (blk + 1) * page_size
            wholly_out = hi_pos <= visible_lo[b]
            for role in (0, 1):
                page = int(order[nxt])
                nxt += 1
                if wholly_out and rng.random() < 0.5:
                    continue  # freed window page: BAD entry (else a stale poisoned page)
                page_table[b, role, blk] = page
                if wholly_out:
                    continue
                rows = np.arange(lo_pos, hi_pos)
                ok = (rows >= visible_lo[b]) & (rows < kv_lens[b])
                vals = rng.standard_normal((page_size, num_kv_heads, head_dim))
                pool[page] = np.where(ok[:, None, None] | (not poison), vals, row_fill)
        # Blocks past the needed ones point at poisoned spare pages now and then.
        for blk in range(need_blocks[b], max_blocks):
            if rng.random() < 0.3:
                page_table[b, :, blk] = (
                    order[rng.integers(nxt, num_pages)] if nxt < num_pages else BAD
                )
    if not poison:
        pool = np.nan_to_num(pool)
    if np_dtype == np.dtype(ml_dtypes.float8_e4m3fn):
        pool = np.clip(pool, -448, 448)  # NaN stays NaN
    pool = pool.astype(np_dtype)

    q_starts = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    total = int(q_starts[-1])
    if decode:
        assert np.all(q_lens <= 1)
        q = rng.standard_normal((batch, num_q_heads, head_dim))
    else:
        num_tokens = total if num_tokens is None else num_tokens
        assert num_tokens >= total
        q = rng.standard_normal((num_tokens, num_q_heads, head_dim))
        q[total:] = np.nan  # padding rows: must not leak anywhere
    q = q.astype(np.dtype(jnp.dtype(q_dtype)))
    return PagedCase(
        q, pool, page_table, q_starts, kv_lens, float(k_scale), float(v_scale), visible_lo
    )
