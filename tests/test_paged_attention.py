"""Paged attention (reference and Mosaic GPU kernels) against a dense float64 numpy oracle.

Every pool row no query may see is NaN (see `pallas_kernels._testing.make_case`), so a read of
a BAD, unwritten or out-of-window page poisons the output and fails the comparison.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import _checks, _testing
from pallas_kernels.paged_attention import (
    PREFILL_QUERY_TILE,
    paged_decode_attention,
    paged_decode_attention_reference,
    ragged_paged_attention,
    ragged_paged_attention_reference,
)

HAS_GPU = any(d.platform == "gpu" for d in jax.devices())


def dense_oracle(case: _testing.PagedCase, *, scale, window=None, softcap=None, decode=False):
    """Contiguous K/V per sequence, explicit causal + window mask, float64 softmax."""
    pool = case.pool.astype(np.float64)
    batch = len(case.kv_lens)
    page_size = pool.shape[1]
    num_q_heads = case.q.shape[1]
    num_kv_heads = pool.shape[2]
    group = num_q_heads // num_kv_heads
    out = np.zeros(case.q.shape, np.float64)
    for b in range(batch):
        kv_len = int(case.kv_lens[b])
        q_len = int(case.q_starts[b + 1] - case.q_starts[b])
        lo = int(case.visible_lo[b])
        if q_len == 0 or kv_len == 0:
            continue
        k = np.zeros((kv_len,) + pool.shape[2:])
        v = np.zeros_like(k)
        for j in range(lo, kv_len):  # tokens below `lo` are never visible (and poisoned)
            k[j] = pool[case.page_table[b, 0, j // page_size], j % page_size] * case.k_scale
            v[j] = pool[case.page_table[b, 1, j // page_size], j % page_size] * case.v_scale
        rows = [b] if decode else range(case.q_starts[b], case.q_starts[b + 1])
        for r, t in enumerate(rows):
            i = kv_len - q_len + r
            keys = np.arange(kv_len)
            ok = keys <= i
            if window is not None:
                ok &= i - keys < window
            for h in range(num_q_heads):
                kh = h // group
                s = scale * (k[ok, kh] @ case.q[t, h].astype(np.float64))
                if softcap is not None:
                    s = softcap * np.tanh(s / softcap)
                p = np.exp(s - s.max())
                out[t, h] = (p / p.sum()) @ v[ok, kh]
    return out


def _tol(dtype):
    return {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}[dtype]


def _check(got, want, q_dtype, case=None):
    got = np.asarray(jnp.asarray(got, jnp.float32))
    assert np.all(np.isfinite(got)), "non-finite output: a poisoned page was read"
    np.testing.assert_allclose(got, want, atol=_tol(q_dtype), rtol=_tol(q_dtype))


# fp8 (e4m3) vs bf16 pool: max abs output difference in units of v_scale. e4m3 rounds a
# unit-normal value in [2, 4) by up to 0.125; a row that sees one token passes it through.
FP8_ATOL = 0.2

# (q_lens, kv_lens): chunks attending history, pure decode rows, an empty sequence, a full
# first chunk, an inactive row.
RAGGED_BATCH = ([3, 1, 0, 7, 5], [19, 40, 9, 7, 21])


# --------------------------------------------------------------------------- reference


@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("page_size", [16, 32, 64])
def test_ragged_reference_gqa_pages(group, page_size):
    num_kv_heads = 2 if group < 8 else 1
    case = _testing.make_case(
        group * 100 + page_size,
        q_lens=RAGGED_BATCH[0],
        kv_lens=RAGGED_BATCH[1],
        num_q_heads=num_kv_heads * group,
        num_kv_heads=num_kv_heads,
        head_dim=128,
        page_size=page_size,
        pool_dtype=jnp.float32,
        q_dtype=jnp.float32,
        num_tokens=20,
    )
    got = ragged_paged_attention_reference(**case.jax_args(), scale=0.1)
    _check(got, dense_oracle(case, scale=0.1), jnp.float32)
    assert np.all(np.asarray(got)[16:] == 0)  # padding rows


@pytest.mark.parametrize("head_dim", [128, 256, 512])
@pytest.mark.parametrize("window,softcap", [(None, None), (8, None), (5, 20.0), (None, 2.0)])
def test_ragged_reference_window_softcap(head_dim, window, softcap):
    case = _testing.make_case(
        head_dim + (window or 0),
        q_lens=[4, 1, 6, 0],
        kv_lens=[37, 50, 6, 3],
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=head_dim,
        page_size=16,
        window=window,
        pool_dtype=jnp.bfloat16,
        q_dtype=jnp.float32,
        num_tokens=13,
    )
    scale = head_dim**-0.5
    got = ragged_paged_attention_reference(
        **case.jax_args(), scale=scale, window=window, softcap=softcap
    )
    _check(got, dense_oracle(case, scale=scale, window=window, softcap=softcap), jnp.float32)


def test_ragged_reference_bf16_q_output_dtype():
    case = _testing.make_case(
        7,
        q_lens=[2, 3],
        kv_lens=[33, 3],
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=128,
        page_size=32,
        num_tokens=8,
    )
    got = ragged_paged_attention(**case.jax_args(), scale=0.08, implementation="reference")
    assert got.dtype == jnp.bfloat16
    _check(got, dense_oracle(case, scale=0.08), jnp.bfloat16)


@pytest.mark.parametrize("window", [None, 16])
def test_fp8_reference_close_to_bf16(window):
    """fp8 pool with scales: tight against the oracle on the stored values, and within
    FP8_ATOL * v_scale (max abs; unit-normal stored data) of the same pool kept in bf16."""
    kw = dict(
        q_lens=[1, 4, 2],
        kv_lens=[70, 45, 2],
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=128,
        page_size=16,
        window=window,
        q_dtype=jnp.float32,
        num_tokens=8,
        k_scale=0.5,
        v_scale=0.02,
    )
    outs = {}
    for dtype in (jnp.float8_e4m3fn, jnp.bfloat16):
        case = _testing.make_case(3, pool_dtype=dtype, **kw)
        got = ragged_paged_attention_reference(
            **case.jax_args(),
            scale=0.1,
            window=window,
            k_scale=jnp.float32(case.k_scale),
            v_scale=jnp.float32(case.v_scale),
        )
        _check(got, dense_oracle(case, scale=0.1, window=window), jnp.float32)
        outs[dtype] = np.asarray(got)
    err = np.abs(outs[jnp.float8_e4m3fn] - outs[jnp.bfloat16]).max() / kw["v_scale"]
    assert err < FP8_ATOL, err


@pytest.mark.parametrize("window,softcap", [(None, None), (24, 30.0)])
def test_decode_reference(window, softcap):
    kv_lens = [1, 0, 33, 64, 100]
    case = _testing.make_case(
        11,
        q_lens=[1 if n else 0 for n in kv_lens],
        kv_lens=kv_lens,
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=256,
        page_size=32,
        window=window,
        pool_dtype=jnp.bfloat16,
        q_dtype=jnp.float32,
        decode=True,
    )
    args = case.jax_args()
    got = paged_decode_attention_reference(
        args["q"],
        args["pool"],
        args["page_table"],
        args["kv_lens"],
        scale=0.0625,
        window=window,
        softcap=softcap,
    )
    want = dense_oracle(case, scale=0.0625, window=window, softcap=softcap, decode=True)
    _check(got, want, jnp.float32)
    assert np.all(np.asarray(got)[1] == 0)


# --------------------------------------------------------------------------- validation


def _small():
    case = _testing.make_case(
        0,
        q_lens=[1, 1],
        kv_lens=[5, 9],
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=128,
        page_size=16,
        decode=True,
    )
    return case.jax_args()


def test_validation_errors():
    a = _small()
    q, pool, pt, kv = a["q"], a["pool"], a["page_table"], a["kv_lens"]
    with pytest.raises(ValueError, match="multiple"):
        paged_decode_attention(q[:, :3], pool, pt, kv, scale=1.0)
    with pytest.raises(ValueError, match="head_dim"):
        paged_decode_attention(q[..., :64], pool, pt, kv, scale=1.0)
    with pytest.raises(TypeError, match="int32"):
        paged_decode_attention(q, pool, pt.astype(jnp.float32), kv, scale=1.0)
    with pytest.raises(ValueError, match="page_table"):
        paged_decode_attention(q, pool, pt[:, :1], kv, scale=1.0)
    with pytest.raises(ValueError, match="window"):
        paged_decode_attention(q, pool, pt, kv, scale=1.0, window=0)
    with pytest.raises(ValueError, match="implementation"):
        paged_decode_attention(q, pool, pt, kv, scale=1.0, implementation="triton")
    with pytest.raises(TypeError, match="pool dtype"):
        paged_decode_attention(q, pool.astype(jnp.int8), pt, kv, scale=1.0)
    with pytest.raises(ValueError, match="q_starts"):
        ragged_paged_attention(q, pool, pt, jnp.zeros(2, jnp.int32), kv, scale=1.0)
    with pytest.raises(ValueError, match="tuning"):
        paged_decode_attention(
            q, pool, pt, kv, scale=1.0, implementation="reference", pages_per_step=2
        )
    # 32 or a multiple of 64 (96 would reach WGMMA with K = 96 at a 128-byte swizzle).
    pallas = dict(scale=1.0, implementation="pallas")
    with pytest.raises(ValueError, match="32 or a multiple of 64, got 96"):
        paged_decode_attention(q, pool, pt, kv, **pallas, schedule="lockstep", block_kv=96)
    fp8_pool = pool.astype(jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match="a multiple of 64, got 32"):
        paged_decode_attention(q, fp8_pool, pt, kv, **pallas, schedule="lockstep", block_kv=32)
    # The producer schedule's S^T has block_kv rows: WGMMA M, a multiple of 64.
    with pytest.raises(ValueError, match="a multiple of 64, got 32"):
        paged_decode_attention(q, pool, pt, kv, **pallas, schedule="producer", block_kv=32)
    with pytest.raises(ValueError, match="split_scores needs head_dim 512"):
        ragged_paged_attention(
            q, pool, pt, jnp.array([0, 1, 2], jnp.int32), kv, **pallas, split_scores=True
        )
    with pytest.raises(ValueError, match="schedule must be one of"):
        paged_decode_attention(q, pool, pt, kv, **pallas, schedule="warp")
    with pytest.raises(ValueError, match="num_stages must be >= 2 for the producer"):
        paged_decode_attention(q, pool, pt, kv, **pallas, schedule="producer", num_stages=1)
    with pytest.raises(ValueError, match="fp8_scores applies to fp8 pools only"):
        paged_decode_attention(q, pool, pt, kv, **pallas, fp8_scores="split_q")
    with pytest.raises(ValueError, match="fp8_scores must be one of"):
        paged_decode_attention(q, fp8_pool, pt, kv, **pallas, fp8_scores="e5m2")
    with pytest.raises(ValueError, match="fp8_scores applies to the producer schedule only"):
        paged_decode_attention(
            q, fp8_pool, pt, kv, **pallas, schedule="lockstep", fp8_scores="dequant"
        )
    # O^T [head_dim, N] in registers: N * head_dim <= 16384 (a group of 64 at head_dim 512
    # takes the lockstep schedule by default).
    sds = jax.ShapeDtypeStruct
    big = (sds((2, 64, 512), jnp.bfloat16), sds((8, 16, 1, 512), jnp.bfloat16))
    with pytest.raises(ValueError, match="N=64 .group 64. x head_dim 512"):
        jax.eval_shape(
            lambda q, p: paged_decode_attention(q, p, pt, kv, **pallas, schedule="producer"),
            *big,
        )
    with _checks.force_compiled():
        jax.eval_shape(lambda q, p: paged_decode_attention(q, p, pt, kv, **pallas), *big)


# --------------------------------------------------------------------------- Pallas kernels
# Interpret mode (CPU, race detection on) at small shapes; compiled on an H200 (`gpu` marker).
# Read pages hold finite garbage in the rows no query sees (the kernel contract); pages that
# must never be read are NaN.

MODES = ["interpret", pytest.param("compiled", marks=pytest.mark.gpu)]


def _mode_ctx(mode):
    return _checks.force_interpret() if mode == "interpret" else _checks.force_compiled()


def _pallas(case, *, decode, **kw):
    """The Pallas kernel on `case` with its scales; kw: scale, window, softcap, tuning."""
    a = case.jax_args()
    scales = dict(k_scale=jnp.float32(case.k_scale), v_scale=jnp.float32(case.v_scale))
    if decode:
        args = (a["q"], a["pool"], a["page_table"], a["kv_lens"])
        return paged_decode_attention(*args, **scales, implementation="pallas", **kw)
    return ragged_paged_attention(**a, **scales, implementation="pallas", **kw)


DECODE_CASES = {
    # name: (kv_lens, Hq, Hkv, D, page_size, pool dtype, window, softcap, tuning)
    # Cases without a `schedule` run with both schedules (`test_decode_kernel`).
    "d128_g4": ([37, 0, 70, 16], 8, 2, 128, 16, jnp.bfloat16, None, None, {}),
    "d256_g2_window_softcap_split": (
        [90, 1, 64],
        4,
        2,
        256,
        32,
        jnp.bfloat16,
        40,
        30.0,
        {"num_splits": 2},
    ),
    "d512_g8_page64": ([70, 129], 8, 1, 512, 64, jnp.bfloat16, None, None, {}),
    "d512_g4_window": (
        [300, 129, 0],
        8,
        2,
        512,
        32,
        jnp.bfloat16,
        200,
        None,
        {},
    ),
    "d512_g4_softcap_split": (
        [300, 129, 0],
        8,
        2,
        512,
        32,
        jnp.bfloat16,
        None,
        20.0,
        {"num_splits": 2},
    ),
    "d128_g8_split_2stages": (
        [260, 3, 190],
        8,
        1,
        128,
        16,
        jnp.bfloat16,
        None,
        None,
        {"num_splits": 2, "num_stages": 2},
    ),
    "d128_g2_block32_page64": (
        [150, 31, 64],
        4,
        2,
        128,
        64,
        jnp.bfloat16,
        None,
        None,
        {"block_kv": 32, "num_stages": 3, "schedule": "lockstep"},
    ),
    "d256_g4_block32_page16_split": (
        [97, 200],
        4,
        1,
        256,
        16,
        jnp.bfloat16,
        90,
        None,
        {"block_kv": 32, "num_splits": 2, "schedule": "lockstep"},
    ),
    "fp8_d128_g1_window": (
        [100, 33],
        2,
        2,
        128,
        32,
        jnp.float8_e4m3fn,
        24,
        None,
        {"num_splits": 3},
    ),
    # Producer schedule (`DecodeTuning.schedule`): the Gemma 4 12B full-layer group of 16
    # (N = 16) at head_dim 512 with 4 pages per step; odd and even ring slot counts (K and V
    # of a step in any pair of slots); a context shorter than the ring (the prologue fills
    # part of it); 128-token steps over 8 pages; fp8 with split queries and with K
    # dequantised; a float32 q (O^T stored as [D, N], transposed by the wrapper).
    "p_d512_g16_page16_split": (
        [200, 65, 1],
        16,
        1,
        512,
        16,
        jnp.bfloat16,
        None,
        None,
        {"schedule": "producer", "num_splits": 2},
    ),
    "p_d256_g2_5slots_window": (
        [400, 7, 129],
        4,
        2,
        256,
        32,
        jnp.bfloat16,
        150,
        None,
        {"schedule": "producer", "num_stages": 5},
    ),
    "p_d128_g4_block128_page16_2slots": (
        [300, 128, 129],
        8,
        2,
        128,
        16,
        jnp.bfloat16,
        None,
        15.0,
        {"schedule": "producer", "block_kv": 128, "num_stages": 2},
    ),
    "p_fp8_d512_g8_split_q": (
        [150, 64, 0],
        8,
        1,
        512,
        32,
        jnp.float8_e4m3fn,
        None,
        None,
        {"schedule": "producer", "fp8_scores": "split_q", "num_splits": 2},
    ),
    "p_fp8_d256_g4_dequant_window": (
        [200, 30],
        8,
        2,
        256,
        64,
        jnp.float8_e4m3fn,
        100,
        None,
        {"schedule": "producer", "fp8_scores": "dequant"},
    ),
    "p_fp8_d128_g2_page16_f32q": (
        [180, 1, 77],
        4,
        2,
        128,
        16,
        jnp.float8_e4m3fn,
        None,
        None,
        {"schedule": "producer", "q_dtype": jnp.float32},
    ),
}


def _decode_params():
    """(name, schedule) pairs: pinned cases once, the others under both schedules."""
    out = []
    for name in sorted(DECODE_CASES):
        pinned = DECODE_CASES[name][-1].get("schedule")
        out += [(name, s) for s in (pinned,) if pinned] or [
            (name, s) for s in ("producer", "lockstep")
        ]
    return out


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name,schedule", _decode_params())
def test_decode_kernel(name, schedule, mode):
    kv_lens, hq, hkv, d, ps, dtype, window, softcap, tuning = DECODE_CASES[name]
    tuning = dict(tuning, schedule=schedule)
    q_dtype = tuning.pop("q_dtype", jnp.bfloat16)
    fp8 = dtype == jnp.float8_e4m3fn
    case = _testing.make_case(
        sorted(DECODE_CASES).index(name) + (100 if schedule == "producer" else 0),
        q_lens=[min(n, 1) for n in kv_lens],
        kv_lens=kv_lens,
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=d,
        page_size=ps,
        pool_dtype=dtype,
        q_dtype=q_dtype,
        window=window,
        decode=True,
        k_scale=0.3 if fp8 else 1.0,
        v_scale=0.5 if fp8 else 1.0,
        row_fill=200.0,
    )
    with _mode_ctx(mode):
        got = _pallas(case, decode=True, scale=d**-0.5, window=window, softcap=softcap, **tuning)
    assert got.dtype == q_dtype
    want = dense_oracle(case, scale=d**-0.5, window=window, softcap=softcap, decode=True)
    _check(got, want, jnp.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", ["producer", "lockstep"])
@pytest.mark.parametrize(
    "d,hq,hkv,ps,dtype,window,splits",
    [
        (128, 32, 8, 32, jnp.bfloat16, None, None),
        (128, 16, 8, 16, jnp.bfloat16, 1024, 4),
        (256, 8, 4, 32, jnp.bfloat16, None, None),
        (256, 16, 2, 64, jnp.float8_e4m3fn, 512, None),
        (512, 4, 2, 32, jnp.bfloat16, None, 2),
        (512, 8, 1, 32, jnp.float8_e4m3fn, None, None),
        (512, 8, 2, 32, jnp.bfloat16, 1000, None),
        (256, 8, 4, 16, jnp.bfloat16, None, 3),
        (512, 16, 1, 16, jnp.bfloat16, None, None),
        (512, 32, 4, 32, jnp.float8_e4m3fn, None, 2),
        (128, 32, 8, 32, jnp.float8_e4m3fn, None, None),
    ],
)
def test_decode_kernel_gpu_long(d, hq, hkv, ps, dtype, window, splits, schedule):
    kv_lens = [1, 3000, 517, 2048, 0, 4097]
    case = _testing.make_case(
        d + ps,
        q_lens=[min(n, 1) for n in kv_lens],
        kv_lens=kv_lens,
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=d,
        page_size=ps,
        pool_dtype=dtype,
        window=window,
        decode=True,
        row_fill=200.0,
        k_scale=0.5,
        v_scale=0.25,
    )
    want = dense_oracle(case, scale=d**-0.5, window=window, decode=True)
    variants = [{}]
    if schedule == "producer" and dtype == jnp.float8_e4m3fn:
        variants = [dict(fp8_scores="split_q"), dict(fp8_scores="dequant")]
    for extra in variants:
        got = _pallas(
            case,
            decode=True,
            scale=d**-0.5,
            window=window,
            num_splits=splits,
            schedule=schedule,
            **extra,
        )
        _check(got, want, jnp.bfloat16)
        # With k_scale 0.5 the long rows' softmaxes are near uniform and their outputs about
        # 0.005 (against the 2e-2 tolerance above): each output row against its own size too.
        # fp8 scores (q rounded to e4m3) err by a few % of a row.
        _check_rows(got, want, rel=0.1 if extra else 2e-2)


def _check_rows(got, want, rel):
    """Per (token, head) output row: ||got - want|| <= rel * ||want|| (rows of any size)."""
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    want = np.asarray(want, np.float64)
    err = np.linalg.norm(got - want, axis=-1)
    size = np.linalg.norm(want, axis=-1)
    bad = err > rel * size + 1e-6
    assert not bad.any(), (np.argwhere(bad)[:5], err[bad][:5], size[bad][:5])


PREFILL_CASES = {
    # name: (q_lens, kv_lens, T, Hq, Hkv, D, page_size, pool dtype, window, softcap)
    "d128_g2_ragged": (
        [70, 0, 5, 1, 130],
        [100, 9, 5, 40, 200],
        220,
        4,
        2,
        128,
        16,
        jnp.bfloat16,
        None,
        None,
    ),
    "d256_g4_window_softcap": ([40, 66], [90, 66], 110, 8, 2, 256, 64, jnp.bfloat16, 40, 20.0),
    "d512_g1": ([33, 64], [60, 64], 100, 2, 2, 512, 32, jnp.bfloat16, None, None),
    "fp8_d128_g8_window": ([20, 50], [120, 50], 72, 8, 1, 128, 32, jnp.float8_e4m3fn, 24, None),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(PREFILL_CASES))
def test_prefill_kernel(name, mode):
    _check_prefill(10 + sorted(PREFILL_CASES).index(name), *PREFILL_CASES[name], mode)


def _check_prefill(
    seed, q_lens, kv_lens, t, hq, hkv, d, ps, dtype, window, softcap, mode, **tuning
):
    """The Pallas prefill kernel on a fresh random case vs the dense oracle; padding rows 0."""
    fp8 = dtype == jnp.float8_e4m3fn
    case = _testing.make_case(
        seed,
        q_lens=q_lens,
        kv_lens=kv_lens,
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=d,
        page_size=ps,
        pool_dtype=dtype,
        window=window,
        num_tokens=t,
        k_scale=0.3 if fp8 else 1.0,
        v_scale=0.5 if fp8 else 1.0,
        row_fill=100.0,
    )
    with _mode_ctx(mode):
        got = _pallas(case, decode=False, scale=d**-0.5, window=window, softcap=softcap, **tuning)
    want = dense_oracle(case, scale=d**-0.5, window=window, softcap=softcap)
    _check(got, want, jnp.bfloat16)
    assert np.all(np.asarray(got, np.float32)[int(case.q_starts[-1]) :] == 0)


# Prefill schedule knobs (`PrefillTuning`): tiles whose warpgroups see mask-free steps
# (history longer than the tile), window edges, steps no row of a warpgroup sees (diagonal
# half of a 128-row tile at block_kv 64, window start, a warpgroup without valid rows) and
# the pipelined loop (next S issued before the softmax) with 1 to 3 ring stages.
PREFILL_KNOB_CASES = {
    # name: (q_lens, kv_lens, T, Hq, Hkv, D, page_size, pool dtype, window, softcap, tuning)
    "d128_ps16_pipe2": (
        [150, 0, 1, 3],
        [300, 5, 70, 3],
        160,
        2,
        1,
        128,
        16,
        jnp.bfloat16,
        None,
        None,
        dict(block_kv=64, num_stages=2, pipeline=True),
    ),
    "d128_ps32_window_softcap_pipe3": (
        [100, 40],
        [400, 40],
        150,
        2,
        1,
        128,
        32,
        jnp.bfloat16,
        300,
        20.0,
        dict(block_kv=64, num_stages=3),
    ),
    "d128_ps64_window_nosplit_pipe": (
        [100, 40],
        [400, 40],
        150,
        2,
        2,
        128,
        64,
        jnp.bfloat16,
        300,
        None,
        dict(block_kv=128, num_stages=2, mask_split=False, pv_in_place=False),
    ),
    "d128_ps64_small_window_split": (
        [130, 9],
        [130, 200],
        140,
        2,
        1,
        128,
        64,
        jnp.bfloat16,
        40,
        None,
        dict(block_kv=64, pipeline=False, p_smem=False),
    ),
    "d256_ps64_window_softcap_pipe2": (
        [90, 2],
        [260, 2],
        100,
        2,
        1,
        256,
        64,
        jnp.bfloat16,
        200,
        30.0,
        dict(block_kv=64, num_stages=2),
    ),
    "d512_ps32_pipe1": (
        [70, 1],
        [200, 33],
        72,
        2,
        1,
        512,
        32,
        jnp.bfloat16,
        None,
        None,
        dict(pipeline=True),
    ),
    "d512_ps64_block32_window_pipe2": (
        [70, 1],
        [200, 33],
        72,
        2,
        1,
        512,
        64,
        jnp.bfloat16,
        90,
        None,
        dict(block_kv=32, num_stages=2),
    ),
    # split_scores: each warpgroup contracts S over its half of head_dim (partials summed
    # through SMEM), pipelined (the default two 32-key stages) and unpipelined; ragged rows,
    # a window and a soft-cap.
    "d512_ps32_split_scores_window_softcap": (
        [70, 1, 0, 40],
        [200, 33, 5, 40],
        120,
        2,
        1,
        512,
        32,
        jnp.bfloat16,
        90,
        25.0,
        dict(split_scores=True),
    ),
    "d512_ps64_split_scores_nopipe": (
        [66, 3],
        [130, 70],
        72,
        2,
        2,
        512,
        64,
        jnp.bfloat16,
        None,
        None,
        dict(split_scores=True, block_kv=32, num_stages=2, pipeline=False),
    ),
    "d128_ps16_block32_nosplit": (
        [50, 20],
        [120, 20],
        72,
        2,
        2,
        128,
        16,
        jnp.bfloat16,
        None,
        10.0,
        dict(block_kv=32, num_stages=3, mask_split=False),
    ),
    "fp8_d128_ps16_window_pipe2": (
        [80, 1],
        [300, 100],
        90,
        2,
        1,
        128,
        16,
        jnp.float8_e4m3fn,
        250,
        None,
        dict(block_kv=128, num_stages=2),
    ),
    "fp8_d256_ps32_nopipe": (
        [70],
        [200],
        70,
        2,
        2,
        256,
        32,
        jnp.float8_e4m3fn,
        None,
        None,
        dict(block_kv=64, mask_split=True, pipeline=False, num_stages=2),
    ),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(PREFILL_KNOB_CASES))
def test_prefill_kernel_knobs(name, mode):
    *spec, tuning = PREFILL_KNOB_CASES[name]
    _check_prefill(30 + sorted(PREFILL_KNOB_CASES).index(name), *spec, mode, **tuning)


def test_prefill_knobs_lower_for_gpu():
    """Every schedule knob lowers to a Mosaic GPU module for the compiled target (no GPU
    needed), including the in-place P V accumulation that interpret mode cannot run."""

    def lower(d, dtype, **tuning):
        sds = jax.ShapeDtypeStruct
        args = (
            sds((256, 4, d), jnp.bfloat16),
            sds((40, 32, 2, d), dtype),
            sds((2, 2, 16), jnp.int32),
            sds((3,), jnp.int32),
            sds((2,), jnp.int32),
        )

        def f(*a):
            return ragged_paged_attention(
                *a, scale=0.1, window=100, softcap=20.0, implementation="pallas", **tuning
            )

        with _checks.force_compiled():
            return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()

    for d, dtype, tuning in [
        (128, jnp.bfloat16, dict(num_stages=2, p_smem=False)),
        (128, jnp.bfloat16, dict(mask_split=False, pipeline=False, pv_in_place=False)),
        (256, jnp.bfloat16, dict(block_kv=64, num_stages=2, p_smem=True)),
        (512, jnp.bfloat16, dict(pipeline=True)),
        (512, jnp.bfloat16, dict(block_kv=32, num_stages=2)),
        (512, jnp.bfloat16, dict(split_scores=True)),
        (512, jnp.bfloat16, dict(split_scores=True, pipeline=False, pv_in_place=False)),
        (128, jnp.bfloat16, dict(block_kv=32, num_stages=3, p_smem=False)),
        (128, jnp.float8_e4m3fn, dict(num_stages=2)),
    ]:
        assert "mosaic_gpu" in lower(d, dtype, **tuning), (d, dtype, tuning)


def test_decode_split_count_counts_waves():
    """Split-K by waves: 64 (sequence, head) pairs on 132 slots take 6 splits (the fewest of
    least time, three waves of 1/6 of a pair = 1/2, that launch 264 blocks; 5 would take
    three waves of 1/5), 512 pairs none (four waves either way), 256 pairs two (264 blocks),
    and few steps cap the count."""
    from pallas_kernels._decode_kernel import pick_splits

    assert pick_splits(64, 132, 256, 264) == 6
    assert pick_splits(512, 132, 128, 264) == 1
    assert pick_splits(256, 132, 128, 264) == 2
    assert pick_splits(256, 264, 128, 264) == 2  # two blocks per SM: 264 slots
    assert pick_splits(2, 132, 1, 264) == 1
    assert pick_splits(2, 264, 3, 264) == 3


def _lower_decode(hq, hkv, d, dtype, ps, *, window=None, q_dtype=jnp.bfloat16, **tuning):
    """The decode call lowered for CUDA on CPU (the whole Mosaic GPU lowering: TMA boxes,
    shared-memory limit; not ptxas)."""
    sds = jax.ShapeDtypeStruct
    args = (
        sds((4, hq, d), q_dtype),
        sds((64, ps, hkv, d), dtype),
        sds((4, 2, 32), jnp.int32),
        sds((4,), jnp.int32),
    )
    scales = {}
    if dtype == jnp.float8_e4m3fn:
        scales = dict(k_scale=jnp.float32(0.5), v_scale=jnp.float32(0.25))

    def f(*a):
        return paged_decode_attention(
            *a, scale=0.1, window=window, implementation="pallas", **scales, **tuning
        )

    with _checks.force_compiled():
        return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_decode_lowers_for_gpu():
    """The lockstep schedule's compiled form (P in registers below head_dim 256, 32-token
    steps with a 64-byte-swizzled P tile at head_dim 512) and the producer schedule's
    variants the interpreter cannot run (O^T accumulated in place) lower on CPU."""
    for d, dtype, ps, tuning in [
        (512, jnp.bfloat16, 32, dict(schedule="lockstep")),
        (512, jnp.bfloat16, 64, dict(schedule="lockstep", block_kv=64, num_splits=2)),
        (512, jnp.float8_e4m3fn, 32, dict(schedule="lockstep")),
        (128, jnp.bfloat16, 64, dict(schedule="lockstep", block_kv=32, num_stages=4)),
        (256, jnp.bfloat16, 16, dict(schedule="lockstep", block_kv=32, num_splits=2)),
        (256, jnp.bfloat16, 16, dict(schedule="producer", block_kv=128, num_stages=2)),
        (256, jnp.float8_e4m3fn, 64, dict(schedule="producer", fp8_scores="dequant")),
        (512, jnp.bfloat16, 16, dict(schedule="producer", q_dtype=jnp.float32)),  # O^T out
        (128, jnp.bfloat16, 32, dict(schedule="producer", block_kv=64, num_stages=8, num_splits=3)),
    ]:
        assert "mosaic_gpu" in _lower_decode(8, 2, d, dtype, ps, **tuning), (d, dtype, tuning)


def _distinct_kernel_geometries():
    """One preset geometry per (head_dim, group, window or not): what the decode kernel's code
    and the prefill kernel's query tiles and key loop depend on
    (`gemma.configs.attention_geometries`)."""
    from gemma import configs

    seen = {}
    for g in configs.attention_geometries():
        seen.setdefault((g.head_dim, g.group, g.window is None), g)
    return list(seen.values())


DECODE_GEOMETRIES = _distinct_kernel_geometries()


@pytest.mark.parametrize(
    "geometry", DECODE_GEOMETRIES, ids=[f"{g.id}-{'+'.join(g.presets)}" for g in DECODE_GEOMETRIES]
)
def test_decode_schedules_lower_at_preset_geometries(geometry):
    """Both schedules with bf16 and fp8 pools, the producer schedule split and unsplit, at
    every preset attention geometry, lower for CUDA with their other knobs at the defaults
    (`tests/test_preset_lowering.py` lowers the default schedule at pages of 16, 32, 64)."""
    g = geometry
    variants = [
        (dtype, 32, schedule, splits)
        for dtype in (jnp.bfloat16, jnp.float8_e4m3fn)
        for schedule, splits in (("producer", 1), ("producer", 3), ("lockstep", None))
    ]
    for dtype, ps, schedule, splits in variants:
        text = _lower_decode(
            g.num_q_heads,
            g.num_kv_heads,
            g.head_dim,
            dtype,
            ps,
            window=g.window,
            schedule=schedule,
            num_splits=splits,
        )
        assert "mosaic_gpu" in text, (g, dtype, ps, schedule, splits)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "d,hq,hkv,ps,dtype,window",
    [
        (128, 16, 8, 32, jnp.bfloat16, None),
        (256, 8, 4, 64, jnp.bfloat16, 512),
        (512, 8, 2, 32, jnp.bfloat16, None),
        (128, 8, 2, 16, jnp.float8_e4m3fn, 300),
    ],
)
def test_prefill_kernel_gpu_long(d, hq, hkv, ps, dtype, window):
    q_lens = [1000, 1, 0, 777, 64]
    kv_lens = [1000, 1500, 20, 2000, 64]
    case = _testing.make_case(
        d + ps,
        q_lens=q_lens,
        kv_lens=kv_lens,
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=d,
        page_size=ps,
        pool_dtype=dtype,
        window=window,
        num_tokens=1900,
        row_fill=100.0,
        k_scale=0.5,
        v_scale=0.25,
    )
    got = _pallas(case, decode=False, scale=d**-0.5, window=window)
    want = dense_oracle(case, scale=d**-0.5, window=window)
    _check(got, want, jnp.bfloat16)


PREFILL_TILINGS = _distinct_kernel_geometries()


@pytest.mark.parametrize(
    "geometry", PREFILL_TILINGS, ids=[f"{g.id}-{'+'.join(g.presets)}" for g in PREFILL_TILINGS]
)
def test_prefill_output_does_not_depend_on_a_tile_aligned_chunk_start(geometry):
    """`Engine(batch_invariant=True)` relies on this: a query's output is bitwise the same
    whether its sequence's new tokens start at position 0 or at a later multiple of
    `PREFILL_QUERY_TILE` (the earlier ones then read from the pool), where its scheduler cuts
    chunks. Every preset's head_dim and group (head_dim 512 has 64-row query tiles), one KV
    head; interpret mode, one sequence of 256 tokens, the last 128 queries computed both ways;
    a sliding geometry's window shortened to 80 so that it cuts through the tiles. (A start
    inside a tile may regroup a query's keys into other steps: at start 100 one row differs
    with head_dim 128.)"""
    g = geometry
    d, window = g.head_dim, None if g.window is None else 80
    length, tile = 256, PREFILL_QUERY_TILE
    assert tile == 128
    case = _testing.make_case(
        3,
        q_lens=[length],
        kv_lens=[length],
        num_q_heads=g.group,
        num_kv_heads=1,
        head_dim=d,
        page_size=32,
        window=window,
        row_fill=100.0,
    )
    a = case.jax_args()

    def run(start):
        q_starts = jnp.array([0, length - start], jnp.int32)
        with _checks.force_interpret():
            out = ragged_paged_attention(
                a["q"][start:],
                a["pool"],
                a["page_table"],
                q_starts,
                a["kv_lens"],
                scale=d**-0.5,
                window=window,
                implementation="pallas",
            )
        return np.asarray(out, np.float32)

    whole, last = run(0), run(tile)
    np.testing.assert_array_equal(last, whole[tile:])


@pytest.mark.parametrize("window", [None, 40])
def test_decode_row_output_does_not_depend_on_the_other_rows(window):
    """`Engine(batch_invariant=True)` relies on this too: with the step's shape fixed, a decode
    row's output is bitwise the same whatever the other rows of the batch hold (their queries
    and lengths). Interpret mode; split-K on, so a row's partials and their combine are its
    own."""
    d = 128
    case = _testing.make_case(
        5,
        q_lens=[1, 1, 1, 1],
        kv_lens=[37, 90, 64, 16],
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=d,
        page_size=16,
        window=window,
        decode=True,
        row_fill=100.0,
    )
    a = case.jax_args()

    def run(q, kv_lens):
        with _checks.force_interpret():
            out = paged_decode_attention(
                q,
                a["pool"],
                a["page_table"],
                kv_lens,
                scale=d**-0.5,
                window=window,
                implementation="pallas",
                num_splits=3,
            )
        return np.asarray(out, np.float32)

    first = run(a["q"], a["kv_lens"])
    others = jnp.array([0, 2, 3])
    q = a["q"].at[others].set(-2 * a["q"][others])
    second = run(q, jnp.array([5, 90, 20, 9], jnp.int32))  # the others shorter, row 1 as is
    np.testing.assert_array_equal(second[1], first[1])
    assert np.abs(second[others] - first[others]).max() > 0  # the other rows did change
