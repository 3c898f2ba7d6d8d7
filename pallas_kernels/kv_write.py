"""Writing the step's new K/V tokens into their pages of a pool root, in place.

Owns `kv_write` (validated public function), `kv_write_reference` (a pure-jnp scatter) and
`token_slots`, the packed-token -> (page, row) map both use. The Mosaic GPU kernel is in
`_kv_write_kernel.py`.

Axis names: T packed new tokens, B sequences, NB blocks per page table row, P pages of the pool
root, S page_size, Hkv KV heads, D head_dim.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels import _checks
from pallas_kernels._tokens import token_slots

FP8_MAX = 448.0  # largest finite float8_e4m3fn


def quantise(x, scale, dtype):
    """Stored value = round(x / scale) in the pool's dtype (fp8 saturates at +-448)."""
    y = x.astype(jnp.float32) / scale
    if _checks.is_fp8(dtype):
        y = jnp.clip(y, -FP8_MAX, FP8_MAX)
    return y.astype(dtype)


def kv_write_reference(pool, page_table, k, v, q_starts, kv_lens, *, k_scale=None, v_scale=None):
    """Pure-jnp scatter of k, v [T, Hkv, D] into the pool root [P, S, Hkv, D]; returns the pool."""
    ks, vs = _checks.kv_scales(pool, k_scale, v_scale)
    num_pages, page_size = pool.shape[:2]
    k_page, v_page, row, valid = token_slots(page_table, q_starts, kv_lens, k.shape[0], page_size)
    drop = jnp.int32(num_pages)  # out of bounds: dropped by the scatter
    pages = jnp.concatenate([jnp.where(valid, k_page, drop), jnp.where(valid, v_page, drop)])
    rows = jnp.concatenate([row, row])
    vals = jnp.concatenate([quantise(k, ks, pool.dtype), quantise(v, vs, pool.dtype)])
    return pool.at[pages, rows].set(vals, mode="drop")


def _check(pool, page_table, k, v, q_starts, kv_lens, k_scale, v_scale, implementation):
    _checks.check_implementation(implementation)
    _, _, num_kv_heads, head_dim, batch, _ = _checks.check_pool(pool, page_table, kv_lens)
    _checks.check_q_starts(q_starts, batch)
    for name, x in (("k", k), ("v", v)):
        if getattr(x, "ndim", None) != 3 or tuple(x.shape[1:]) != (num_kv_heads, head_dim):
            raise ValueError(
                f"{name} must have shape [T, {num_kv_heads}, {head_dim}], got "
                f"{getattr(x, 'shape', None)}"
            )
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"{name} must be a float array, got {x.dtype}")
    if k.shape[0] != v.shape[0]:
        raise ValueError(f"k and v must have the same token count, got {k.shape[0]}, {v.shape[0]}")
    _checks.kv_scales(pool, k_scale, v_scale)


def kv_write(
    pool, page_table, k, v, q_starts, kv_lens, *, k_scale=None, v_scale=None, implementation="auto"
):
    """Writes the step's new tokens k, v [T, Hkv, D] into their pages; returns the updated pool.

    Token r of sequence b goes to row p % S of pages page_table[b, 0|1, p // S] with
    p = kv_lens[b] - q_len_b + r; padding rows and BAD pages are dropped. Quantises to fp8
    with the scales when the pool is fp8. Jit with the pool donated to update it in place
    (the Pallas version aliases the pool input to its output).
    """
    _check(pool, page_table, k, v, q_starts, kv_lens, k_scale, v_scale, implementation)
    from pallas_kernels import _kv_write_kernel

    use = implementation == "pallas" or (
        implementation == "auto" and _checks.on_hopper() and _kv_write_kernel.supports(pool)
    )
    if use:
        return _kv_write_kernel.kv_write_pallas(
            pool, page_table, k, v, q_starts, kv_lens, k_scale=k_scale, v_scale=v_scale
        )
    return kv_write_reference(
        pool, page_table, k, v, q_starts, kv_lens, k_scale=k_scale, v_scale=v_scale
    )
