"""Mosaic GPU KV write: the step's new K/V rows into their pool pages, in place.

The (page, row) of each packed token comes from `kv_write.token_slots` (a few [T] jnp ops).
One CUDA block per `block_tokens` tokens: TMA loads the tokens' K and V rows [n, Hkv, D] into
SMEM, converts them to the pool dtype when needed (x / scale, fp8 saturating), and TMA-stores
each valid token's [Hkv, D] row into pool[page, row]. The pool enters the kernel as a mutable
Ref (an input/output alias), so jit with the pool donated updates it in place; untouched rows
keep their bytes.

Axis names: T packed tokens, Hkv KV heads, D head_dim, P pages, S page_size.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import _checks

BLOCK_TOKENS = 8


def supports(pool) -> bool:
    _, _, num_kv_heads, head_dim = pool.shape
    row_bytes = num_kv_heads * head_dim * jnp.dtype(pool.dtype).itemsize
    return row_bytes % 128 == 0


@functools.partial(jax.jit, static_argnames=("convert", "interpret"), donate_argnums=0)
def _kv_write_jit(pool, slots, k, v, scales, *, convert, interpret):
    num_tokens, num_kv_heads, head_dim = k.shape
    bt = BLOCK_TOKENS
    grid = -(-num_tokens // bt)
    pool_dtype = pool.dtype

    def body(slots_ref, k_ref, v_ref, scales_ref, pool_ref, k_in, v_in, k_st, v_st, bar):
        t0 = jax.lax.axis_index("t") * bt
        n = min(bt, num_tokens)
        rows = pl.ds(jnp.minimum(t0, num_tokens - n), n)
        # The last block's box may overlap the previous block (no partial TMA boxes); each
        # token is stored by the block that owns it.
        start = jnp.minimum(t0, num_tokens - n)
        plgpu.copy_gmem_to_smem(k_ref.at[rows], k_in, bar.at[0])
        plgpu.copy_gmem_to_smem(v_ref.at[rows], v_in, bar.at[1])
        plgpu.barrier_wait(bar.at[0])
        plgpu.barrier_wait(bar.at[1])
        if convert:
            for src, dst, role in ((k_in, k_st, 0), (v_in, v_st, 1)):
                x = src[...].astype(jnp.float32) / scales_ref[role]
                if _checks.is_fp8(pool_dtype):
                    x = jnp.minimum(jnp.maximum(x, -448.0), 448.0)
                dst[...] = x.astype(pool_dtype)
            plgpu.commit_smem()
            k_src, v_src = k_st, v_st
        else:
            k_src, v_src = k_in, v_in
        for i in range(n):
            t = start + i

            @pl.when((slots_ref[3, t] != 0) & (t >= t0))
            def _(i=i, t=t):
                row = slots_ref[2, t]
                plgpu.copy_smem_to_gmem(k_src.at[i], pool_ref.at[slots_ref[0, t], row])
                plgpu.copy_smem_to_gmem(v_src.at[i], pool_ref.at[slots_ref[1, t], row])

        plgpu.wait_smem_to_gmem(0)

    n = min(bt, num_tokens)
    st_dtype = pool_dtype if convert else k.dtype
    kernel = plgpu.kernel(
        body,
        out_type=(),
        grid=(grid,),
        grid_names=("t",),
        scratch_types=[
            plgpu.SMEM((n, num_kv_heads, head_dim), k.dtype),
            plgpu.SMEM((n, num_kv_heads, head_dim), v.dtype),
            plgpu.SMEM((n, num_kv_heads, head_dim), st_dtype),
            plgpu.SMEM((n, num_kv_heads, head_dim), st_dtype),
            plgpu.Barrier(num_barriers=2),
        ],
        compiler_params=plgpu.CompilerParams(),
        interpret=interpret,
    )
    # The pool enters as a mutable Ref: the kernel's writes become an input/output alias.
    pool_ref = jax.new_ref(pool)
    kernel(slots, k, v, scales, pool_ref)
    return jax.freeze(pool_ref)


def kv_write_pallas(pool, page_table, k, v, q_starts, kv_lens, *, k_scale=None, v_scale=None):
    """Mosaic GPU kv_write (validated inputs; see `kv_write.py`). Returns the updated pool."""
    from pallas_kernels.kv_write import token_slots

    if not supports(pool):
        raise ValueError(
            f"kv_write kernel needs Hkv * D * itemsize to be a multiple of 128 bytes, got pool "
            f"shape {pool.shape} {pool.dtype}"
        )
    if k.shape[0] == 0:
        return pool
    page_size = pool.shape[1]
    k_page, v_page, row, valid = token_slots(page_table, q_starts, kv_lens, k.shape[0], page_size)
    slots = jnp.stack([k_page, v_page, row, valid.astype(jnp.int32)])  # i32[4, T]
    ks, vs = _checks.kv_scales(pool, k_scale, v_scale)
    convert = (
        k_scale is not None
        or v_scale is not None
        or jnp.dtype(k.dtype) != jnp.dtype(pool.dtype)
        or jnp.dtype(v.dtype) != jnp.dtype(pool.dtype)
    )
    return _kv_write_jit(
        pool,
        slots,
        k,
        v,
        jnp.stack([ks, vs]),
        convert=convert,
        interpret=_checks.interpret_params(),
    )
