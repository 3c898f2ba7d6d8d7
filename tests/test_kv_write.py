"""kv_write (reference and Mosaic GPU kernel): exact page contents against a numpy loop.

The pool starts all-NaN; after the write, exactly the expected rows hold the (quantised) new
tokens and every other row is still NaN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from gemma import configs
from pallas_kernels import _checks
from pallas_kernels.kv_write import kv_write, kv_write_reference

BAD = -1


def make_write_case(
    seed,
    q_lens,
    kv_lens,
    *,
    num_kv_heads=2,
    head_dim=128,
    page_size=16,
    num_tokens=None,
    bad_block=None,
):
    rng = np.random.default_rng(seed)
    q_lens, kv_lens = np.asarray(q_lens, np.int32), np.asarray(kv_lens, np.int32)
    batch = len(q_lens)
    max_blocks = int(-(-kv_lens.max() // page_size)) + 1
    num_pages = 2 * batch * max_blocks + 2
    perm = rng.permutation(num_pages)
    page_table = perm[: 2 * batch * max_blocks].reshape(batch, 2, max_blocks).astype(np.int32)
    if bad_block is not None:
        page_table[bad_block[0], :, bad_block[1]] = BAD
    q_starts = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    num_tokens = int(q_starts[-1]) if num_tokens is None else num_tokens
    k = rng.standard_normal((num_tokens, num_kv_heads, head_dim)).astype(np.float32)
    v = rng.standard_normal((num_tokens, num_kv_heads, head_dim)).astype(np.float32)
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    return page_table, q_starts, kv_lens, k, v, shape


def expected_pool(pool, page_table, q_starts, kv_lens, k, v, k_scale, v_scale):
    """Hand loop: token r of sequence b -> row p % S of page page_table[b, role, p // S]."""
    out = np.array(pool)
    page_size = pool.shape[1]
    for b in range(len(kv_lens)):
        q_len = q_starts[b + 1] - q_starts[b]
        for r in range(q_len):
            p = kv_lens[b] - q_len + r
            t = q_starts[b] + r
            for role, x, sc in ((0, k, k_scale), (1, v, v_scale)):
                page = page_table[b, role, p // page_size]
                if page == BAD:
                    continue
                y = x[t] / sc
                if pool.dtype == ml_dtypes.float8_e4m3fn:
                    y = np.clip(y, -448, 448)
                out[page, p % page_size] = y.astype(pool.dtype)
    return out


def _same(got, want):
    got = np.asarray(got).astype(np.float32)
    want = want.astype(np.float32)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(np.nan_to_num(got), np.nan_to_num(want))


CASES = {
    # name: (q_lens, kv_lens, num_tokens, bad_block)
    "ragged": ([3, 0, 1, 17], [20, 5, 1, 40], 24, None),
    "decode": ([1, 1, 1, 0], [16, 17, 64, 3], 4, None),
    "bad_page": ([5, 2], [18, 9], 8, (0, 1)),
}


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32, jnp.float8_e4m3fn])
@pytest.mark.parametrize("name", sorted(CASES))
def test_kv_write_reference_exact(name, dtype):
    q_lens, kv_lens, num_tokens, bad = CASES[name]
    page_table, q_starts, kv_lens, k, v, shape = make_write_case(
        sorted(CASES).index(name), q_lens, kv_lens, num_tokens=num_tokens, bad_block=bad
    )
    pool = np.full(shape, np.nan, np.float32).astype(jnp.dtype(dtype))
    fp8 = dtype == jnp.float8_e4m3fn
    ks, vs = (0.25, 0.5) if fp8 else (1.0, 1.0)
    k[0, 0, 0] = 1e4  # saturates in fp8
    write = jax.jit(kv_write_reference, donate_argnums=0)
    got = write(
        jnp.asarray(pool),
        jnp.asarray(page_table),
        jnp.asarray(k),
        jnp.asarray(v),
        jnp.asarray(q_starts),
        jnp.asarray(kv_lens),
        k_scale=jnp.float32(ks),
        v_scale=jnp.float32(vs),
    )
    want = expected_pool(pool, page_table, q_starts, kv_lens, k, v, ks, vs)
    _same(got, want)
    assert np.isnan(want).any() and not np.isnan(want).all()


def test_kv_write_validation():
    page_table, q_starts, kv_lens, k, v, shape = make_write_case(0, [1], [3])
    pool = jnp.zeros(shape, jnp.bfloat16)
    args = (
        jnp.asarray(page_table),
        jnp.asarray(k),
        jnp.asarray(v),
        jnp.asarray(q_starts),
        jnp.asarray(kv_lens),
    )
    with pytest.raises(ValueError, match="k must have shape"):
        kv_write(pool, args[0], args[1][..., :64], *args[2:])
    with pytest.raises(ValueError, match="q_starts"):
        kv_write(pool, args[0], args[1], args[2], args[3][:1], args[4])
    with pytest.raises(TypeError, match="int32"):
        kv_write(pool, args[0], args[1], args[2], args[3], args[4].astype(jnp.float32))
    with pytest.raises(ValueError, match="implementation"):
        kv_write(pool, *args, implementation="cuda")


# --------------------------------------------------------------------------- Pallas kernel
MODES = ["interpret", pytest.param("compiled", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "name,dtype,scaled",
    [
        ("ragged", jnp.bfloat16, False),
        ("bad_page", jnp.float8_e4m3fn, True),
        ("decode", jnp.bfloat16, True),
    ],
)
def test_kv_write_kernel_exact(name, dtype, scaled, mode):
    q_lens, kv_lens, num_tokens, bad = CASES[name]
    page_table, q_starts, kv_lens, k, v, shape = make_write_case(
        7 + sorted(CASES).index(name), q_lens, kv_lens, num_tokens=num_tokens, bad_block=bad
    )
    pool = np.full(shape, np.nan, np.float32).astype(jnp.dtype(dtype))
    ks, vs = (0.25, 0.5) if scaled else (None, None)
    k16, v16 = jnp.asarray(k, jnp.bfloat16), jnp.asarray(v, jnp.bfloat16)
    ctx = _checks.force_interpret() if mode == "interpret" else _checks.force_compiled()
    with ctx:
        write = jax.jit(
            lambda *a: kv_write(*a, k_scale=ks, v_scale=vs, implementation="pallas"),
            donate_argnums=0,
        )
        got = write(
            jnp.asarray(pool),
            jnp.asarray(page_table),
            k16,
            v16,
            jnp.asarray(q_starts),
            jnp.asarray(kv_lens),
        )
    want = expected_pool(
        pool,
        page_table,
        q_starts,
        kv_lens,
        np.asarray(k16, np.float32),
        np.asarray(v16, np.float32),
        ks or 1.0,
        vs or 1.0,
    )
    _same(got, want)


@pytest.mark.gpu
def test_kv_write_kernel_gpu_large():
    q_lens = [1] * 100 + [900, 0, 37]
    kv_lens = [1 + 13 * i for i in range(100)] + [2000, 50, 37]
    page_table, q_starts, kv_lens, k, v, shape = make_write_case(
        5, q_lens, kv_lens, num_kv_heads=4, head_dim=256, page_size=32, num_tokens=1100
    )
    pool = np.full(shape, np.nan, np.float32).astype(jnp.bfloat16)
    k16, v16 = jnp.asarray(k, jnp.bfloat16), jnp.asarray(v, jnp.bfloat16)
    got = kv_write(
        jnp.asarray(pool),
        jnp.asarray(page_table),
        k16,
        v16,
        jnp.asarray(q_starts),
        jnp.asarray(kv_lens),
        implementation="pallas",
    )
    want = expected_pool(
        pool,
        page_table,
        q_starts,
        kv_lens,
        np.asarray(k16, np.float32),
        np.asarray(v16, np.float32),
        1.0,
        1.0,
    )
    _same(got, want)


# Every (KV heads, head_dim) of the presets, from gemma.configs (never a hand-written list).
PRESET_KV_GEOMETRIES = sorted(
    {(g.num_kv_heads, g.head_dim) for g in configs.attention_geometries()}
)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e4m3fn])
@pytest.mark.parametrize("num_kv_heads,head_dim", PRESET_KV_GEOMETRIES)
def test_kv_write_kernel_preset_geometries(num_kv_heads, head_dim, dtype, mode):
    """Ragged chunk, decode rows and a BAD page at every preset's KV geometry: exact pages."""
    page_size = {128: 16, 256: 32, 512: 64}[head_dim]
    seed = 31 * num_kv_heads + head_dim
    page_table, q_starts, kv_lens, k, v, shape = make_write_case(
        seed,
        [11, 1, 0, 1],
        [page_size + 9, 2 * page_size, 4, 1],
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        num_tokens=16,
        bad_block=(1, 1),
    )
    pool = np.full(shape, np.nan, np.float32).astype(jnp.dtype(dtype))
    ks, vs = (0.25, 0.5) if dtype == jnp.float8_e4m3fn else (None, None)
    k16, v16 = jnp.asarray(k, jnp.bfloat16), jnp.asarray(v, jnp.bfloat16)
    ctx = _checks.force_interpret() if mode == "interpret" else _checks.force_compiled()
    with ctx:
        write = jax.jit(
            lambda *a: kv_write(*a, k_scale=ks, v_scale=vs, implementation="pallas"),
            donate_argnums=0,
        )
        got = write(
            jnp.asarray(pool),
            jnp.asarray(page_table),
            k16,
            v16,
            jnp.asarray(q_starts),
            jnp.asarray(kv_lens),
        )
    want = expected_pool(
        pool,
        page_table,
        q_starts,
        kv_lens,
        np.asarray(k16, np.float32),
        np.asarray(v16, np.float32),
        ks or 1.0,
        vs or 1.0,
    )
    _same(got, want)


def test_kv_write_kernel_block_tokens_from_smem_budget():
    from pallas_kernels import _kv_write_kernel as kw

    # Gemma 4 31B sliding: 16 KV heads x 256 (8 KB a row in bf16): 4 tokens in 96 KB.
    assert kw.block_tokens(16, 256, jnp.bfloat16, jnp.bfloat16, False) == 4
    assert kw.block_tokens(16, 256, jnp.bfloat16, jnp.float8_e4m3fn, True) == 4
    assert kw.block_tokens(1, 512, jnp.bfloat16, jnp.bfloat16, False) == 8
    with pytest.raises(ValueError, match="shared memory"):
        kw.block_tokens(64, 512, jnp.float32, jnp.float32, True)
    assert not kw.supports(jnp.zeros((1, 16, 64, 512), jnp.float32))
