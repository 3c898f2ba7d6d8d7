"""Mosaic GPU KV write: the step's new K/V rows into their pool pages, in place.

The (page, row) of each packed token comes from `kv_write.token_slots` (a few [T] jnp ops).
One CUDA block per `block_tokens` tokens: TMA loads the tokens' K and V rows into SMEM,
converts them to the pool dtype when needed (x / scale, fp8 saturating), and TMA-stores each
valid token's row into pool[page, row]. The pool enters the kernel as a mutable Ref (an
input/output alias), so jit with the pool donated updates it in place; untouched rows keep
their bytes.

Every copy is split into boxes of at most `MAX_BOX` elements per dimension (the TMA limit), so
head_dim 512 moves as two 256-column boxes. SMEM holds each box contiguously:
[head chunks, column chunks, tokens, heads per chunk, columns per chunk]. `block_tokens` is the
largest power of two up to `MAX_BLOCK_TOKENS` whose staging buffers fit `SMEM_BUDGET` (so two
blocks share an SM); a geometry whose single token does not fit the SMEM limit raises
ValueError at trace time.

Axis names: T packed tokens, Hkv KV heads, D head_dim, P pages, S page_size.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import _checks
from pallas_kernels._tokens import token_slots

MAX_BOX = 256  # TMA: at most 256 elements along each box dimension
MAX_BLOCK_TOKENS = 8
SMEM_BUDGET = 96 * 1024  # staging per CUDA block: two blocks fit one SM's 228 KB
SMEM_LIMIT = 227 * 1024  # per block (H100 / H200)


def _chunk(n: int) -> int:
    """Box length along a dimension of n elements: n, or the largest divisor <= MAX_BOX."""
    return next(c for c in range(min(n, MAX_BOX), 0, -1) if n % c == 0)


def _staging_bytes_per_token(num_kv_heads, head_dim, in_dtype, pool_dtype, convert) -> int:
    row = num_kv_heads * head_dim
    staged = 2 * row * jnp.dtype(in_dtype).itemsize  # K and V as loaded
    if convert:
        staged += 2 * row * jnp.dtype(pool_dtype).itemsize  # K and V in the pool dtype
    return staged


def block_tokens(num_kv_heads, head_dim, in_dtype, pool_dtype, convert) -> int:
    """Tokens per CUDA block for this geometry; ValueError if one token cannot fit SMEM."""
    per_token = _staging_bytes_per_token(num_kv_heads, head_dim, in_dtype, pool_dtype, convert)
    if per_token + 1024 > SMEM_LIMIT:
        raise ValueError(
            f"kv_write kernel: one token of {num_kv_heads} KV heads x head_dim {head_dim} needs "
            f"{per_token} bytes of shared memory staging, more than the {SMEM_LIMIT} available"
        )
    bt = MAX_BLOCK_TOKENS
    while bt > 1 and bt * per_token > SMEM_BUDGET:
        bt //= 2
    return bt


def supports(pool) -> bool:
    """Whether the kernel handles this pool (else "auto" uses the reference scatter)."""
    _, _, num_kv_heads, head_dim = pool.shape
    item = jnp.dtype(pool.dtype).itemsize
    if (_chunk(head_dim) * item) % 16:  # TMA: a box row is a multiple of 16 bytes
        return False
    try:  # the widest case: bf16/f32 tokens converted into the pool dtype
        block_tokens(num_kv_heads, head_dim, jnp.float32, pool.dtype, True)
    except ValueError:
        return False
    return True


@functools.partial(jax.jit, static_argnames=("convert", "interpret"), donate_argnums=0)
def _kv_write_jit(pool, slots, k, v, scales, *, convert, interpret):
    num_tokens, num_kv_heads, head_dim = k.shape
    pool_dtype = pool.dtype
    bt = block_tokens(num_kv_heads, head_dim, k.dtype, pool_dtype, convert)
    n = min(bt, num_tokens)
    grid = -(-num_tokens // n)
    hc, dc = _chunk(num_kv_heads), _chunk(head_dim)
    boxes = [(h, c) for h in range(num_kv_heads // hc) for c in range(head_dim // dc)]

    def body(slots_ref, k_ref, v_ref, scales_ref, pool_ref, k_in, v_in, k_st, v_st, bar):
        t0 = jax.lax.axis_index("t") * n
        # The last block's box may overlap the previous block (no partial TMA boxes); each
        # token is stored by the block that owns it.
        start = jnp.minimum(t0, num_tokens - n)
        rows = pl.ds(start, n)
        for h, c in boxes:
            heads, cols = pl.ds(h * hc, hc), pl.ds(c * dc, dc)
            plgpu.copy_gmem_to_smem(k_ref.at[rows, heads, cols], k_in.at[h, c], bar.at[0])
            plgpu.copy_gmem_to_smem(v_ref.at[rows, heads, cols], v_in.at[h, c], bar.at[1])
        plgpu.barrier_wait(bar.at[0])  # one arrival per box
        plgpu.barrier_wait(bar.at[1])
        if convert:
            for src, dst, role in ((k_in, k_st, 0), (v_in, v_st, 1)):
                for h, c in boxes:
                    x = src.at[h, c][...].astype(jnp.float32) / scales_ref[role]
                    if _checks.is_fp8(pool_dtype):
                        x = jnp.minimum(jnp.maximum(x, -448.0), 448.0)
                    dst.at[h, c][...] = x.astype(pool_dtype)
            plgpu.commit_smem()
            k_src, v_src = k_st, v_st
        else:
            k_src, v_src = k_in, v_in
        for i in range(n):
            t = start + i

            @pl.when((slots_ref[3, t] != 0) & (t >= t0))
            def _(i=i, t=t):
                row = slots_ref[2, t]
                k_page, v_page = slots_ref[0, t], slots_ref[1, t]
                for h, c in boxes:
                    heads, cols = pl.ds(h * hc, hc), pl.ds(c * dc, dc)
                    plgpu.copy_smem_to_gmem(
                        k_src.at[h, c, i], pool_ref.at[k_page, row, heads, cols]
                    )
                    plgpu.copy_smem_to_gmem(
                        v_src.at[h, c, i], pool_ref.at[v_page, row, heads, cols]
                    )

        plgpu.wait_smem_to_gmem(0)

    staged = (num_kv_heads // hc, head_dim // dc, n, hc, dc)
    converted = [plgpu.SMEM(staged, pool_dtype)] * 2 if convert else [None, None]
    kernel = plgpu.kernel(
        body,
        out_type=(),
        grid=(grid,),
        grid_names=("t",),
        scratch_types=[
            plgpu.SMEM(staged, k.dtype),
            plgpu.SMEM(staged, v.dtype),
            *converted,
            plgpu.Barrier(num_arrivals=len(boxes), num_barriers=2),
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

    if not supports(pool):
        _, _, num_kv_heads, head_dim = pool.shape
        raise ValueError(
            f"kv_write kernel does not support pool shape {pool.shape} {pool.dtype}: a TMA box "
            f"row of {_chunk(head_dim)} columns must be a multiple of 16 bytes and one token of "
            f"{num_kv_heads} x {head_dim} must fit {SMEM_LIMIT} bytes of shared memory"
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
