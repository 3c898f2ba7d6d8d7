"""Benchmark of the paged attention kernels on the H200 (decode, prefill, kv_write) and peers.

    PYTHONPATH=. python3 experiments/bench_kernels.py --out $OUT/kernels_h200.json
    PYTHONPATH=. .venv/bin/python experiments/bench_kernels.py --quick   # CPU smoke, reference

Prints a short table and writes JSON: device, jax_version, copy_tbs (device-to-device copy,
bytes read + written, best of jnp / cupy / torch), records [{kernel, shape, time_ms, tbs or
tflops, ...}]. Each case is caught on its own: a failure becomes a record with `error`.

Timing: warm-up, then the median over `reps` of the mean time of `iters` back-to-back calls of
a jitted function, blocked at the end. Decode pools exceed the 60 MB L2 by far; smaller inputs
are rotated among several copies so each call reads cold data.

Decode cases: page 32, bf16, B in {32, 128} x context in {4K, 32K} x head_dim {128: 8 KV heads
x group 4, 256: 4 KV heads x group 2, 512: 2 KV heads x group 4}; sliding window 1024 at 32K vs
full attention at 1K; fp8; JAX's built-in Triton paged attention (best of a small sweep).

`--presets` measures the geometries of `gemma.configs.attention_geometries()` instead (every
record carries `preset`, the presets that use the geometry, and `geometry`, its id):

    PYTHONPATH=. python3 experiments/bench_kernels.py --presets --out $OUT/kernels_presets.json

decode (bf16, page 32, B=128, 32K context) at each Gemma 4 full-layer geometry and the 31B
sliding geometry without its window, under both decode schedules; every Gemma 4 sliding
geometry with its window; fp8 next to bf16 at head_dim 128 (Gemma 3 27B, `ratio_to_bf16`) and
at head_dim 512 (Gemma 4 E4B); prefill (8K tokens causal) at each Gemma 4 full-layer geometry,
default and `split_scores` (one record each), with `ratio_to_d256` against the head_dim-256
rate of the same run; kv_write at decode size
(128 sequences x 1 token) and at 8K tokens for every distinct (KV heads, head_dim), the Pallas
kernel against XLA's scatter. The kernels of a section are compiled in a thread pool first
(`--compile-threads`). `--quick --presets` runs every section on CPU at tiny sizes with the
reference implementation (one geometry each).
"""

# %%
from __future__ import annotations

import argparse
import concurrent.futures
import functools
import glob
import hashlib
import itertools
import json
import os
import re
import time
import traceback
import warnings

import numpy as np

L2_BYTES = 60 * 2**20


def torch_copy_tbs():
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        x = torch.empty(2**31, dtype=torch.uint8, device="cuda")
        y = torch.empty_like(x)
        for _ in range(3):
            y.copy_(x)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(10):
            start.record()
            y.copy_(x)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        del x, y
        torch.cuda.empty_cache()
        return 2 * 2**31 / (np.median(times) * 1e-3) / 1e12
    except Exception:  # noqa: BLE001
        return None


def cupy_copy_tbs():
    try:
        import cupy as cp

        x = cp.empty(2**31, dtype=cp.uint8)
        y = cp.empty_like(x)
        for _ in range(3):
            cp.copyto(y, x)
        cp.cuda.Device().synchronize()
        start, end = cp.cuda.Event(), cp.cuda.Event()
        times = []
        for _ in range(10):
            start.record()
            cp.copyto(y, x)
            end.record()
            end.synchronize()
            times.append(cp.cuda.get_elapsed_time(start, end))
        del x, y
        cp.get_default_memory_pool().free_all_blocks()
        return 2 * 2**31 / (np.median(times) * 1e-3) / 1e12
    except Exception:  # noqa: BLE001
        return None


# Peers measured before JAX takes most of the GPU memory.
_PEER_COPY = {}
if __name__ == "__main__" and "--quick" not in os.sys.argv:
    _PEER_COPY = {"torch": torch_copy_tbs(), "cupy": cupy_copy_tbs()}

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from experiments._profile import device_kernel_times, top_kernels  # noqa: E402
from pallas_kernels import (  # noqa: E402
    _checks,
    _decode_kernel,
    _paged_common,
    kv_write,
    kv_write_reference,
    paged_decode_attention,
    ragged_paged_attention,
)


def time_calls(call, *, iters=10, reps=5, warmup=2):
    """Median over reps of the mean per-call time (ms) of `call()` (returns arrays to block on)."""
    out = None
    for _ in range(warmup):
        out = call()
    jax.block_until_ready(out)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(iters):
            out = call()
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / iters * 1e3)
    return float(np.median(times))


def bench(fn, arg_sets, *, iters=10, reps=5, warmup=2):
    """`time_calls` of fn, the calls cycling through arg_sets."""
    count = itertools.count()
    return time_calls(
        lambda: fn(*arg_sets[next(count) % len(arg_sets)]), iters=iters, reps=reps, warmup=warmup
    )


def copies_for(nbytes):
    """How many input copies make one pass over them exceed the L2 four times."""
    return int(min(8, max(1, -(-4 * L2_BYTES // max(nbytes, 1)))))


# %% decode inputs
def decode_inputs(key, batch, context, num_kv_heads, group, head_dim, page_size, dtype):
    """Pool root with K/V pages scattered at random, full contexts."""
    blocks = -(-context // page_size)
    num_pages = 2 * batch * blocks
    k1, k2, k3 = jax.random.split(key, 3)
    if jnp.dtype(dtype) == jnp.dtype(jnp.float8_e4m3fn):
        pool = jax.random.normal(k1, (num_pages, page_size, num_kv_heads, head_dim), jnp.bfloat16)
        pool = pool.astype(dtype)
    else:
        pool = jax.random.normal(k1, (num_pages, page_size, num_kv_heads, head_dim), dtype)
    perm = jax.random.permutation(k2, num_pages).astype(jnp.int32)
    page_table = perm.reshape(batch, 2, blocks)
    q = jax.random.normal(k3, (batch, num_kv_heads * group, head_dim), jnp.bfloat16)
    kv_lens = jnp.full((batch,), context, jnp.int32)
    return q, pool, page_table, kv_lens


def decode_bytes(batch, context, num_kv_heads, head_dim, page_size, itemsize, window=None):
    seen = context if window is None else min(context, window)
    # Whole pages are read: the first in-window page may be partial.
    pages = -(-seen // page_size) + (0 if window is None or seen == context else 1)
    return 2 * batch * pages * page_size * num_kv_heads * head_dim * itemsize


DECODE_SHAPES = [
    # (batch, context, head_dim, num_kv_heads, group)
    (b, c, d, hkv, g)
    for b in (32, 128)
    for c in (4096, 32768)
    for d, hkv, g in ((128, 8, 4), (256, 4, 2), (512, 2, 4))
]


def run_decode(records, args, quick):
    ps = 32
    impl = "reference" if quick else "pallas"
    shapes = [(2, 256, 128, 2, 2)] if quick else DECODE_SHAPES
    extra = []
    if not quick:
        # Sliding window W=1024 at 32K against full attention at 1K; fp8.
        extra = [
            (128, 32768, 256, 4, 2, 1024, jnp.bfloat16),
            (128, 1024, 256, 4, 2, None, jnp.bfloat16),
            (128, 32768, 128, 8, 4, None, jnp.float8_e4m3fn),
            (32, 4096, 128, 8, 4, None, jnp.float8_e4m3fn),
        ]
    cases = [(b, c, d, h, g, None, jnp.bfloat16) for b, c, d, h, g in shapes] + extra
    for batch, context, d, hkv, g, window, dtype in cases:
        if not _selected(args, batch=batch, context=context, head_dim=d):
            continue
        shape = dict(
            batch=batch,
            context=context,
            head_dim=d,
            page_size=ps,
            kv_heads=hkv,
            q_heads=hkv * g,
            window=window,
            dtype=jnp.dtype(dtype).name,
        )
        name = "decode" if window is None else "decode_window"
        try:
            q, pool, pt, lens = decode_inputs(
                jax.random.key(batch + context + d), batch, context, hkv, g, d, ps, dtype
            )
            nbytes = decode_bytes(batch, context, hkv, d, ps, jnp.dtype(dtype).itemsize, window)
            sets = [(q, pool, pt, lens)]
            if not quick and pool.nbytes < 4 * L2_BYTES:
                sets += [(q, pool + 0, pt, lens) for _ in range(copies_for(pool.nbytes) - 1)]
            tunings = [{}]
            sweep = args.sweep and not quick and context == 32768 and window is None
            if sweep:
                # Split-K x ring shapes, both decode schedules (v8). Lockstep rings at 128
                # were swept in v3 (notes/kernels.md); 32-token steps (v6) fit two stages
                # beside the 64 KB Q tile at head_dim 512, and two 2-stage blocks per SM at 256.
                # (An L2 prefetch knob swept in v5 was slower everywhere and was removed.)
                splits = (None, 1, 2, 4) if batch == 128 else (None, 2, 4, 8)
                lock = dict(schedule="lockstep")
                rings = {
                    256: [
                        dict(lock, block_kv=32, num_stages=2),
                        dict(lock, block_kv=32, num_stages=4),
                    ],
                    512: [dict(lock, block_kv=64), dict(lock, block_kv=32)],
                }.get(d, [])
                rings = [{}, lock] + rings
                tunings = [dict(r, num_splits=s) for r in rings for s in splits]
            best = None
            for tuning in tunings:
                try:
                    fn = jax.jit(
                        functools.partial(
                            paged_decode_attention,
                            scale=d**-0.5,
                            window=window,
                            implementation=impl,
                            **tuning,
                        )
                    )
                    t = bench(fn, sets, iters=3 if quick else 10)
                except Exception as e:  # noqa: BLE001
                    records.append(
                        dict(kernel=f"{name}_try", shape=shape, tuning=tuning, error=repr(e)[:400])
                    )
                    continue
                if args.sweep and not quick:
                    records.append(
                        dict(
                            kernel=f"{name}_try",
                            shape=shape,
                            tuning=tuning,
                            time_ms=t,
                            tbs=nbytes / (t * 1e-3) / 1e12,
                        )
                    )
                if best is None or t < best[0]:
                    best = (t, tuning)
            if best is not None:
                records.append(
                    dict(
                        kernel=name,
                        shape=shape,
                        implementation=impl,
                        tuning=best[1],
                        time_ms=best[0],
                        bytes=nbytes,
                        tbs=nbytes / (best[0] * 1e-3) / 1e12,
                    )
                )
            builtin = not quick and not args.no_builtin and window is None
            if builtin and jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16):
                run_builtin(records, q, pool, pt, lens, shape, nbytes)
            del q, pool, pt, lens, sets
        except Exception:  # noqa: BLE001
            records.append(dict(kernel=name, shape=shape, error=traceback.format_exc()[-600:]))


def run_builtin(records, q, pool, pt, lens, shape, nbytes):
    """JAX's built-in paged attention (Triton lowering): best of a small block sweep."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from jax.experimental.pallas.ops.gpu import paged_attention as jpa
        # Its layout: k_pages, v_pages [Hkv, P, S, D] and one block table for both.
        half = pool.shape[0] // 2
        k_pages = jnp.moveaxis(pool[:half], 2, 0)
        v_pages = jnp.moveaxis(pool[half:], 2, 0)
        perm = jax.random.permutation(jax.random.key(7), half).astype(jnp.int32)
        table = perm.reshape(pt.shape[0], -1)
    except Exception:  # noqa: BLE001
        records.append(
            dict(kernel="builtin_paged_decode", shape=shape, error=traceback.format_exc()[-400:])
        )
        return
    best, errors = None, []
    for ppcb in (4, 8, 16):
        for ks in (1, 4, 8):
            try:
                fn = jax.jit(
                    functools.partial(
                        jpa.paged_attention, pages_per_compute_block=ppcb, k_splits=ks
                    )
                )
                t = bench(fn, [(q, k_pages, v_pages, table, lens)], iters=5, reps=3)
                if best is None or t < best[0]:
                    best = (t, ppcb, ks)
            except Exception as e:  # noqa: BLE001
                errors.append(f"ppcb={ppcb} k_splits={ks}: {repr(e)[:150]}")
    if best is None:
        records.append(dict(kernel="builtin_paged_decode", shape=shape, error=errors[:3]))
    else:
        records.append(
            dict(
                kernel="builtin_paged_decode",
                shape=shape,
                time_ms=best[0],
                tbs=nbytes / (best[0] * 1e-3) / 1e12,
                params=dict(pages_per_compute_block=best[1], k_splits=best[2]),
            )
        )
    del k_pages, v_pages, table


# %% prefill
# The kernel before the mask split / in-place P V (v4 in notes/kernels.md), then the knobs of
# `_prefill_kernel.PrefillTuning` that fit in SMEM at each head_dim.
_V4 = dict(mask_split=False, pv_in_place=False, pipeline=False)  # + P via SMEM at D >= 256
PREFILL_SWEEP = {
    128: [
        dict(block_kv=128, num_stages=1, **_V4),
        *[
            dict(block_kv=bk, num_stages=st, pipeline=pp)
            for bk, st in ((128, 1), (128, 2), (64, 2), (64, 3))
            for pp in ((False, True) if st > 1 else (False,))
        ],
        dict(block_kv=128, num_stages=2, pipeline=True, p_smem=True),
    ],
    256: [
        dict(block_kv=64, num_stages=1, p_smem=True, **_V4),
        *[
            dict(block_kv=64, num_stages=st, pipeline=pp, p_smem=sm)
            for st in (1, 2)
            for pp in ((False, True) if st > 1 else (False,))
            for sm in (False, True)
        ],
        dict(block_kv=128, num_stages=1, p_smem=False),
        dict(block_kv=32, num_stages=4, pipeline=True),  # v6
    ],
    512: [
        dict(p_smem=True, **_V4),
        dict(p_smem=False),
        dict(pipeline=True),
        dict(pipeline=True, p_smem=False),
        # v6: 32-key steps, two stages fit.
        dict(block_kv=32, num_stages=2, pipeline=False),
        dict(block_kv=32, num_stages=2, pipeline=True),
        dict(block_kv=32, num_stages=2, pipeline=True, p_smem=True),
        dict(block_kv=32, num_stages=2, pipeline=True, pv_in_place=False),
        dict(block_kv=32, num_stages=2, pipeline=True, mask_split=False),
        dict(block_kv=32, num_stages=1),
        # v8: S contracted over half of head_dim per warpgroup, partials summed through SMEM.
        dict(split_scores=True),
        dict(split_scores=True, pipeline=False),
    ],
}
# --presets: head_dim-512 prefill variants measured in every run (the default first).
PRESET_PREFILL_512 = [{}, dict(split_scores=True)]


def run_prefill(records, args, quick):
    """One 8K-token causal chunk (empty history) through the paged kernel vs dense cuDNN."""
    ps = 64
    tokens = 256 if quick else 8192
    heads = 4 if quick else 16
    impl = "reference" if quick else "pallas"
    for d, hkv in ((128, 8), (256, 8), (512, 4)):
        if not _selected(args, head_dim=d):
            continue
        if quick:
            if d != 128:
                continue
            hkv = 2
        shape = dict(
            batch=1,
            tokens=tokens,
            context=tokens,
            head_dim=d,
            page_size=ps,
            kv_heads=hkv,
            q_heads=heads,
        )
        flops = 4 * tokens * tokens * d * heads / 2
        cudnn_t = None
        key = jax.random.key(d)
        kq, kk, kv = jax.random.split(key, 3)
        q4 = jax.random.normal(kq, (1, tokens, heads, d), jnp.bfloat16)
        k4 = jax.random.normal(kk, (1, tokens, hkv, d), jnp.bfloat16)
        v4 = jax.random.normal(kv, (1, tokens, hkv, d), jnp.bfloat16)
        if not quick:
            try:
                f = jax.jit(
                    functools.partial(
                        jax.nn.dot_product_attention, is_causal=True, implementation="cudnn"
                    )
                )
                cudnn_t = bench(f, [(q4, k4, v4)])
                records.append(
                    dict(
                        kernel="prefill_dense_cudnn",
                        shape=shape,
                        time_ms=cudnn_t,
                        tflops=flops / (cudnn_t * 1e-3) / 1e12,
                    )
                )
            except Exception as e:  # noqa: BLE001
                records.append(dict(kernel="prefill_dense_cudnn", shape=shape, error=repr(e)[:300]))
        try:
            blocks = tokens // ps
            # Pages of one sequence, K/V adjacent as in the pool (V page = K page + 1).
            pool = jnp.stack(
                [k4[0].reshape(blocks, ps, hkv, d), v4[0].reshape(blocks, ps, hkv, d)], axis=1
            )
            pool = pool.reshape(2 * blocks, ps, hkv, d)
            perm = jnp.arange(blocks, dtype=jnp.int32) * 2
            pt = jnp.stack([perm, perm + 1])[None]  # [1, 2, NB]
            q_starts = jnp.array([0, tokens], jnp.int32)
            lens = jnp.array([tokens], jnp.int32)
            tunings = [{}]
            if args.sweep and not quick:
                tunings += PREFILL_SWEEP[d]
            best = None
            for tuning in tunings:
                try:
                    fn = jax.jit(
                        functools.partial(
                            ragged_paged_attention, scale=d**-0.5, implementation=impl, **tuning
                        )
                    )
                    t = bench(fn, [(q4[0], pool, pt, q_starts, lens)], iters=2 if quick else 10)
                except Exception as e:  # noqa: BLE001
                    records.append(
                        dict(kernel="prefill_try", shape=shape, tuning=tuning, error=repr(e)[:300])
                    )
                    continue
                records.append(
                    dict(
                        kernel="prefill_try",
                        shape=shape,
                        tuning=tuning,
                        time_ms=t,
                        tflops=flops / (t * 1e-3) / 1e12,
                    )
                )
                if best is None or t < best[0]:
                    best = (t, tuning)
            if best is None:
                raise RuntimeError("no prefill configuration ran")
            t = best[0]
            rec = dict(
                kernel="prefill",
                shape=shape,
                implementation=impl,
                tuning=best[1],
                time_ms=t,
                tflops=flops / (t * 1e-3) / 1e12,
            )
            if cudnn_t is not None:
                rec["ratio_to_cudnn"] = cudnn_t / t
            records.append(rec)
        except Exception as e:  # noqa: BLE001
            records.append(dict(kernel="prefill", shape=shape, error=repr(e)[:400]))
    add_ratio_to_d256(records)


def add_ratio_to_d256(records):
    """The head_dim-512 prefill target is relative to our own head_dim-256 rate (cuDNN has no
    512): `ratio_to_d256` = its TFLOP/s over the head_dim-256 record's of the same run."""
    rate = {
        r["shape"]["head_dim"]: r["tflops"]
        for r in records
        if r.get("kernel") == "prefill" and "tflops" in r
    }
    for r in records:
        if r.get("kernel") == "prefill" and "tflops" in r and r["shape"]["head_dim"] == 512:
            if 256 in rate:
                r["ratio_to_d256"] = r["tflops"] / rate[256]


# %% kv_write
def run_kv_write(records, args, quick):
    impl = "reference" if quick else "pallas"
    ps = 32
    for batch, new, context, d, hkv in ((128, 1, 4096, 256, 4), (1, 8192, 8192, 256, 4)):
        if quick:
            batch, new, context, d, hkv = min(batch, 2), min(new, 16), 64, 128, 2
        shape = dict(
            batch=batch, new_tokens=new, context=context, head_dim=d, kv_heads=hkv, page_size=ps
        )
        try:
            blocks = -(-context // ps)
            pool = jnp.zeros((2 * batch * blocks, ps, hkv, d), jnp.bfloat16)
            perm = jax.random.permutation(jax.random.key(0), 2 * batch * blocks)
            pt = perm.astype(jnp.int32).reshape(batch, 2, blocks)
            kk = jax.random.normal(jax.random.key(1), (batch * new, hkv, d), jnp.bfloat16)
            q_starts = jnp.arange(batch + 1, dtype=jnp.int32) * new
            lens = jnp.full((batch,), context, jnp.int32)
            nbytes = 2 * 2 * kk.nbytes  # read new K/V, write them into pages
            for im in [impl] if quick else [impl, "reference"]:
                fn = jax.jit(functools.partial(kv_write, implementation=im), donate_argnums=0)
                state = [pool]

                def step(k, v, q_starts, lens, fn=fn, state=state, pt=pt):
                    state[0] = fn(state[0], pt, k, v, q_starts, lens)
                    return state[0]

                wall = bench(step, [(kk, kk, q_starts, lens)], iters=3 if quick else 20)
                # Kernel time from a profiler trace: a decode-sized write is shorter than the
                # Python dispatch of its jitted call, which the wall clock would measure.
                prof = device_kernel_times(functools.partial(step, kk, kk, q_starts, lens), 10)
                device = prof["busy_us"] / 1e3 if prof["kernels"] else None
                t = device or wall
                pool = state[0]
                records.append(
                    dict(
                        kernel="kv_write" if im == impl else "kv_write_xla_scatter",
                        shape=shape,
                        implementation=im,
                        time_ms=t,
                        wall_ms=wall,
                        device_ms=device,
                        device_kernels=top_kernels(prof, 4) if prof["kernels"] else [],
                        bytes=nbytes,
                        tbs=nbytes / (t * 1e-3) / 1e12,
                    )
                )
        except Exception as e:  # noqa: BLE001
            records.append(dict(kernel="kv_write", shape=shape, error=repr(e)[:400]))


# %% preset geometries (--presets)
GEMMA4 = ("gemma4_e2b", "gemma4_e4b", "gemma4_12b", "gemma4_26b_a4b", "gemma4_31b")
PRESET_DECODE = dict(batch=128, context=32768, page_size=32)
PRESET_PREFILL = dict(tokens=8192, page_size=64)
# kv_write: (sequences, new tokens per sequence, context after the write)
PRESET_KV_WRITE = ((128, 1, 1024), (1, 8192, 8192))
SCHEDULES = ("producer", "lockstep")


def preset_geometries():
    from gemma import configs

    return configs.attention_geometries()


def _is_gemma4(g) -> bool:
    return any(p in GEMMA4 for p in g.presets)


def geometry_tags(g) -> dict:
    return dict(preset=list(g.presets), geometry=g.id)


def pattern_pool(shape, dtype, seed):
    """A pool root filled by one fused elementwise kernel (a hash of the indices mapped to
    [-2, 2)): random-looking values without the RNG's intermediates, which for the 69 GB pool
    of the Gemma 4 31B sliding geometry at 32K would not fit."""

    @functools.partial(jax.jit, static_argnums=(0, 1))
    def make(shape, dtype, seed):
        h = jnp.uint32(seed) * jnp.uint32(0x9E3779B9)
        for d in range(len(shape)):
            i = jax.lax.broadcasted_iota(jnp.uint32, shape, d)
            h = (h ^ i) * jnp.uint32(0x85EBCA6B) + jnp.uint32(0xC2B2AE35 + d)
            h = h ^ (h >> 13)
        x = (h >> 16).astype(jnp.float32) * (4.0 / 65536.0) - 2.0
        return x.astype(dtype)

    return make(tuple(shape), jnp.dtype(dtype), int(seed))


def _decode_layout(batch, context, page_size, window):
    """(blocks per row, first block with pages, pages per row): with a window only the blocks
    a query can see get pages (the rest are BAD), so the pool holds the windows."""
    blocks = -(-context // page_size)
    first = 0 if window is None else max(0, (context - window) // page_size - 1)
    return blocks, first, blocks - first


def preset_decode_shapes(g, batch, context, page_size, dtype, window):
    sds = jax.ShapeDtypeStruct
    blocks, _, used = _decode_layout(batch, context, page_size, window)
    return (
        sds((batch, g.num_q_heads, g.head_dim), jnp.bfloat16),
        sds((2 * batch * used, page_size, g.num_kv_heads, g.head_dim), jnp.dtype(dtype)),
        sds((batch, 2, blocks), jnp.int32),
        sds((batch,), jnp.int32),
    )


def preset_decode_inputs(g, batch, context, page_size, dtype, window, seed):
    """q, pool, page table and lengths for `batch` sequences of `context` tokens at g."""
    blocks, first, used = _decode_layout(batch, context, page_size, window)
    num_pages = 2 * batch * used
    pool = pattern_pool((num_pages, page_size, g.num_kv_heads, g.head_dim), dtype, seed)
    perm = jax.random.permutation(jax.random.key(seed), num_pages).astype(jnp.int32)
    table = jnp.full((batch, 2, blocks), _checks.BAD, jnp.int32)
    table = table.at[:, :, first:].set(perm.reshape(batch, 2, used))
    q = jax.random.normal(
        jax.random.key(seed + 1), (batch, g.num_q_heads, g.head_dim), jnp.bfloat16
    )
    lens = jnp.full((batch,), context, jnp.int32)
    return q, pool, table, lens


def resolved_decode_tuning(g, batch, max_blocks, page_size, dtype, window, tuning):
    """The knobs the decode kernel resolves for this call (schedule, ring, splits), or the
    error it raises."""
    try:
        _, t = _decode_kernel._pick(
            g.head_dim,
            page_size,
            dtype,
            batch,
            g.num_kv_heads,
            max_blocks,
            _decode_kernel.DecodeTuning(**tuning),
            _paged_common.p_in_smem(None, g.head_dim),
            window,
            g.group,
        )
        return {k: v for k, v in vars(t).items() if v is not None}
    except Exception as e:  # noqa: BLE001
        return dict(error=repr(e)[:200])


def compile_all(jobs, threads):
    """jobs: {key: (jitted fn, argument ShapeDtypeStructs)}. Compiles them `threads` at a
    time (XLA and ptxas release the GIL). Returns {key: (executable or the exception,
    seconds)}."""

    def one(item):
        key, (fn, sds) = item
        t0 = time.time()
        try:
            return key, fn.lower(*sds).compile(), time.time() - t0
        except Exception as e:  # noqa: BLE001
            return key, e, time.time() - t0

    items = list(jobs.items())
    if threads > 1 and len(items) > 1:
        with concurrent.futures.ThreadPoolExecutor(threads) as ex:
            results = list(ex.map(one, items))
    else:
        results = [one(item) for item in items]
    return {key: (exe, secs) for key, exe, secs in results}


def _executable(compiled, fn):
    """The precompiled executable, or the jitted fn when precompiling failed (a call then
    compiles it again here and raises the real error, with its traceback)."""
    exe, _ = compiled
    return fn if isinstance(exe, Exception) else exe


def preset_decode_cases(args, quick):
    """[(group label, geometry, pool dtype, window, [tuning, ...])] of `--presets` decode."""
    geoms = preset_geometries()
    full4 = [g for g in geoms if _is_gemma4(g) and g.window is None]
    slide4 = [g for g in geoms if _is_gemma4(g) and g.window is not None]
    slide31 = [g for g in slide4 if "gemma4_31b" in g.presets]
    d128 = [g for g in geoms if g.head_dim == 128 and g.window is None][:1]  # Gemma 3 27B
    e4b = [g for g in full4 if "gemma4_e4b" in g.presets]
    sched = [dict(schedule=x) for x in args.schedules]
    bf16, fp8 = jnp.bfloat16, jnp.float8_e4m3fn
    fp8_tunings = [dict(schedule="producer", fp8_scores=x) for x in ("split_q", "dequant")]
    fp8_tunings += [dict(schedule="lockstep")] if "lockstep" in args.schedules else []
    sweep = []
    if args.sweep:
        sweep = [
            dict(schedule="producer", num_splits=x, num_stages=st)
            for x in (1, 2, 4)
            for st in (2, 3)
        ]
    cases = [("full", g, bf16, None, sched + sweep) for g in full4]
    cases += [("sliding_at_full_context", g, bf16, None, sched) for g in slide31]
    cases += [("sliding_window", g, bf16, g.window, sched) for g in slide4]
    cases += [("fp8_vs_bf16", g, bf16, None, sched) for g in d128]
    cases += [("fp8_vs_bf16", g, fp8, None, fp8_tunings) for g in d128]
    cases += [("fp8_vs_bf16", g, fp8, None, fp8_tunings[:1]) for g in e4b]
    if quick:  # the first case of each (group, dtype), through the reference
        seen = set()
        cases = [c for c in cases if not ((c[0], c[2]) in seen or seen.add((c[0], c[2])))]
        cases = [(label, g, dt, w, [{}]) for label, g, dt, w, _ in cases]
    return cases


def run_presets_decode(records, args, quick, flush):
    ps = PRESET_DECODE["page_size"]
    batch, context = (2, 256) if quick else (PRESET_DECODE["batch"], PRESET_DECODE["context"])
    impl = "reference" if quick else "pallas"
    cases = preset_decode_cases(args, quick)
    fns, jobs = {}, {}
    for c, (_, g, dtype, window, tunings) in enumerate(cases):
        window = window if window is None or not quick else min(window, context // 2)
        scales = {}
        if dtype == jnp.float8_e4m3fn:
            scales = dict(k_scale=jnp.float32(0.5), v_scale=jnp.float32(0.5))
        sds = preset_decode_shapes(g, batch, context, ps, dtype, window)
        for i, tuning in enumerate(tunings):
            fns[c, i] = jax.jit(
                functools.partial(
                    paged_decode_attention,
                    scale=g.scale,
                    window=window,
                    softcap=g.softcap,
                    implementation=impl,
                    **scales,
                    **tuning,
                )
            )
            jobs[c, i] = (fns[c, i], sds)
    t0 = time.time()
    compiled = compile_all(jobs, 1 if quick else args.compile_threads)
    print(f"  decode: {len(jobs)} kernels compiled in {time.time() - t0:.0f} s", flush=True)
    for c, (label, g, dtype, window, tunings) in enumerate(cases):
        window = window if window is None or not quick else min(window, context // 2)
        shape = dict(
            batch=batch,
            context=context,
            head_dim=g.head_dim,
            page_size=ps,
            kv_heads=g.num_kv_heads,
            q_heads=g.num_q_heads,
            window=window,
            dtype=jnp.dtype(dtype).name,
        )
        base = dict(kernel="decode", case=label, shape=shape, **geometry_tags(g))
        t0 = time.time()
        try:
            call = preset_decode_inputs(g, batch, context, ps, dtype, window, seed=c)
        except Exception:  # noqa: BLE001
            records.append(dict(base, error=traceback.format_exc()[-600:]))
            flush()
            continue
        item = jnp.dtype(dtype).itemsize
        nbytes = decode_bytes(batch, context, g.num_kv_heads, g.head_dim, ps, item, window)
        sets = [call]  # pools of a few L2 sizes (the windowed ones): rotate copies, cold reads
        if not quick and call[1].nbytes < 4 * L2_BYTES:
            copies = copies_for(call[1].nbytes) - 1
            sets += [(call[0], jnp.copy(call[1]), *call[2:]) for _ in range(copies)]
        for i, tuning in enumerate(tunings):
            rec = dict(base, implementation=impl, tuning=tuning, compile_s=compiled[c, i][1])
            if not quick:
                rec["resolved"] = resolved_decode_tuning(
                    g, batch, call[2].shape[2], ps, dtype, window, tuning
                )
            try:
                t = bench(_executable(compiled[c, i], fns[c, i]), sets, iters=2 if quick else 10)
                rec.update(time_ms=t, bytes=nbytes, tbs=nbytes / (t * 1e-3) / 1e12)
            except Exception:  # noqa: BLE001
                rec["error"] = traceback.format_exc()[-600:]
            records.append(rec)
            flush()
        del call, sets
        print(f"  decode {label} {g.id} {shape['dtype']}: {time.time() - t0:.0f} s", flush=True)
    add_fp8_ratio(records)


def add_fp8_ratio(records):
    """fp8 decode records get `ratio_to_bf16`: their time over the fastest bf16 record of the
    same geometry and shape in this run (the target is <= 0.6)."""

    def key(r):
        return r.get("geometry"), json.dumps(dict(r["shape"], dtype=None), sort_keys=True)

    best = {}
    for r in records:
        if r.get("kernel") == "decode" and "time_ms" in r and r["shape"]["dtype"] == "bfloat16":
            best[key(r)] = min(best.get(key(r), float("inf")), r["time_ms"])
    for r in records:
        if r.get("kernel") == "decode" and "time_ms" in r and r["shape"]["dtype"] != "bfloat16":
            if key(r) in best:
                r["ratio_to_bf16"] = r["time_ms"] / best[key(r)]


def run_presets_prefill(records, args, quick, flush):
    """8K tokens causal (one sequence, no history) at each Gemma 4 full-layer geometry and at
    the head_dim-256 reference geometry (Gemma 4 12B / 26B sliding, without its window: the
    shape of the v5-v6 head_dim-256 figures)."""
    ps = PRESET_PREFILL["page_size"]
    tokens = 128 if quick else PRESET_PREFILL["tokens"]
    geoms = preset_geometries()
    full4 = [g for g in geoms if _is_gemma4(g) and g.window is None]
    ref = [g for g in geoms if g.head_dim == 256 and g.window is not None and _is_gemma4(g)]
    ref = [g for g in ref if g.num_q_heads == 16] or ref
    cases = [(ref[0], "d256_reference")] + [(g, "full") for g in full4]
    if quick:
        cases = cases[:2]
    impl = "reference" if quick else "pallas"
    sweep = [{}] if quick else list(PRESET_PREFILL_512)
    if args.sweep and not quick:
        sweep += [t for t in PREFILL_SWEEP[512] if t not in sweep]
    sds = jax.ShapeDtypeStruct
    fns, jobs = {}, {}
    for c, (g, _) in enumerate(cases):
        d, hkv, hq = g.head_dim, g.num_kv_heads, g.num_q_heads
        blocks = tokens // ps
        shapes = (
            sds((tokens, hq, d), jnp.bfloat16),
            sds((2 * blocks, ps, hkv, d), jnp.bfloat16),
            sds((1, 2, blocks), jnp.int32),
            sds((2,), jnp.int32),
            sds((1,), jnp.int32),
        )
        for i, tuning in enumerate(sweep if d == 512 else [{}]):
            fns[c, i] = jax.jit(
                functools.partial(
                    ragged_paged_attention, scale=g.scale, implementation=impl, **tuning
                )
            )
            jobs[c, i] = (fns[c, i], shapes)
    t0 = time.time()
    compiled = compile_all(jobs, 1 if quick else args.compile_threads)
    print(f"  prefill: {len(jobs)} kernels compiled in {time.time() - t0:.0f} s", flush=True)
    rate_256 = None
    for c, (g, label) in enumerate(cases):
        d, hkv, hq = g.head_dim, g.num_kv_heads, g.num_q_heads
        shape = dict(
            batch=1,
            tokens=tokens,
            context=tokens,
            head_dim=d,
            page_size=ps,
            kv_heads=hkv,
            q_heads=hq,
        )
        base = dict(kernel="prefill", case=label, shape=shape, **geometry_tags(g))
        flops = 4 * tokens * tokens * d * hq / 2
        try:
            blocks = tokens // ps
            kq, kk, kv = jax.random.split(jax.random.key(d + hq), 3)
            q = jax.random.normal(kq, (tokens, hq, d), jnp.bfloat16)
            k = jax.random.normal(kk, (blocks, ps, hkv, d), jnp.bfloat16)
            v = jax.random.normal(kv, (blocks, ps, hkv, d), jnp.bfloat16)
            pool = jnp.stack([k, v], axis=1).reshape(2 * blocks, ps, hkv, d)  # V page = K + 1
            perm = jnp.arange(blocks, dtype=jnp.int32) * 2
            pt = jnp.stack([perm, perm + 1])[None]  # [1, 2, NB]
            call = (q, pool, pt, jnp.array([0, tokens], jnp.int32), jnp.array([tokens], jnp.int32))
        except Exception:  # noqa: BLE001
            records.append(dict(base, error=traceback.format_exc()[-600:]))
            flush()
            continue
        best = None
        for i, tuning in enumerate(sweep if d == 512 else [{}]):
            rec = dict(base, implementation=impl, tuning=tuning, compile_s=compiled[c, i][1])
            if i >= len(PRESET_PREFILL_512):  # --sweep extras
                rec["kernel"] = "prefill_try"
            try:
                t = bench(_executable(compiled[c, i], fns[c, i]), [call], iters=2 if quick else 10)
                rec.update(time_ms=t, tflops=flops / (t * 1e-3) / 1e12)
                best = t if best is None else min(best, t)
            except Exception:  # noqa: BLE001
                rec["error"] = traceback.format_exc()[-600:]
            records.append(rec)
            flush()
        if best is not None and label == "d256_reference":
            rate_256 = flops / (best * 1e-3) / 1e12
        del q, k, v, pool, call
    for r in records:
        is_prefill = r.get("kernel") in ("prefill", "prefill_try") and "case" in r
        if is_prefill and "tflops" in r and r["shape"]["head_dim"] == 512:
            if rate_256 is not None:
                r["ratio_to_d256"] = r["tflops"] / rate_256
                r["d256_reference"] = cases[0][0].id


def run_presets_kv_write(records, args, quick, flush):
    """kv_write of 128 x 1 token (decode) and 8K tokens at every distinct (KV heads,
    head_dim) of the presets: the Pallas kernel against XLA's scatter (`kv_write_reference`),
    kernel times from a profiler trace (a decode-size write is shorter than the dispatch)."""
    ps = 32
    rows = {}
    for g in preset_geometries():
        rows.setdefault((g.num_kv_heads, g.head_dim), []).append(g)
    items = sorted(rows.items())[:1] if quick else sorted(rows.items())
    impls = ["reference"] if quick else ["pallas", "reference"]
    sizes = (
        [(min(b, 2), min(n, 16), 64) for b, n, _ in PRESET_KV_WRITE] if quick else PRESET_KV_WRITE
    )
    writers = {
        "pallas": functools.partial(kv_write, implementation="pallas"),
        "reference": kv_write_reference,
    }
    sds = jax.ShapeDtypeStruct
    fns, jobs = {}, {}
    for (hkv, d), _ in items:
        for batch, new, context in sizes:
            blocks = -(-context // ps)
            shapes = (
                sds((2 * batch * blocks, ps, hkv, d), jnp.bfloat16),
                sds((batch, 2, blocks), jnp.int32),
                sds((batch * new, hkv, d), jnp.bfloat16),
                sds((batch * new, hkv, d), jnp.bfloat16),
                sds((batch + 1,), jnp.int32),
                sds((batch,), jnp.int32),
            )
            for im in impls:
                key = (hkv, d, batch, new, im)
                fns[key] = jax.jit(writers[im], donate_argnums=0)
                jobs[key] = (fns[key], shapes)
    t0 = time.time()
    compiled = compile_all(jobs, 1 if quick else args.compile_threads)
    print(f"  kv_write: {len(jobs)} kernels compiled in {time.time() - t0:.0f} s", flush=True)
    for (hkv, d), gs in items:
        presets = sorted({p for g in gs for p in g.presets})
        tags = dict(preset=presets, geometry=f"kv{hkv}d{d}", geometries=[g.id for g in gs])
        for batch, new, context in sizes:
            shape = dict(
                batch=batch,
                new_tokens=new,
                context=context,
                head_dim=d,
                kv_heads=hkv,
                page_size=ps,
            )
            blocks = -(-context // ps)
            pool = jnp.zeros((2 * batch * blocks, ps, hkv, d), jnp.bfloat16)
            perm = jax.random.permutation(jax.random.key(0), 2 * batch * blocks)
            pt = perm.astype(jnp.int32).reshape(batch, 2, blocks)
            kk = jax.random.normal(jax.random.key(1), (batch * new, hkv, d), jnp.bfloat16)
            q_starts = jnp.arange(batch + 1, dtype=jnp.int32) * new
            lens = jnp.full((batch,), context, jnp.int32)
            nbytes = 2 * 2 * kk.nbytes  # read the new K/V, write them into pages
            for im in impls:
                key = (hkv, d, batch, new, im)
                name = "kv_write_xla_scatter" if im == "reference" and not quick else "kv_write"
                rec = dict(kernel=name, shape=shape, implementation=im, bytes=nbytes, **tags)
                rec["compile_s"] = compiled[key][1]
                fn = _executable(compiled[key], fns[key])
                state = [pool]

                def step(k, v, q_starts, lens, fn=fn, state=state, pt=pt):
                    state[0] = fn(state[0], pt, k, v, q_starts, lens)
                    return state[0]

                call = (kk, kk, q_starts, lens)
                try:
                    wall = bench(step, [call], iters=3 if quick else 20)
                    device = None
                    if not quick:
                        prof = device_kernel_times(functools.partial(step, *call), 10)
                        if prof["kernels"]:
                            device = prof["busy_us"] / 1e3
                            rec["device_kernels"] = top_kernels(prof, 4)
                    t = device or wall
                    rec.update(
                        time_ms=t, wall_ms=wall, device_ms=device, tbs=nbytes / (t * 1e-3) / 1e12
                    )
                except Exception:  # noqa: BLE001
                    rec["error"] = traceback.format_exc()[-600:]
                pool = state[0]  # donated: the next implementation writes into this one
                records.append(rec)
                flush()
            del pool


def sources_sha256() -> str:
    """A hash of the kernel sources and this script: names the code of a run even where the
    machine's copy of the tree has no .git and $SWAJAX_GIT_COMMIT was not set."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    digest = hashlib.sha256()
    for path in sorted(glob.glob(os.path.join(root, "pallas_kernels", "*.py"))) + [__file__]:
        with open(path, "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()[:16]


# %% main
def jnp_copy_tbs(quick):
    """Device copy bandwidth, TB/s of bytes read + written (x + 1 over 2 GiB of uint32)."""
    n = 2**18 if quick else 2**29
    x = jnp.ones((n,), jnp.uint32)
    t = bench(jax.jit(lambda a: a + jnp.uint32(1)), [(x,)], iters=3 if quick else 10)
    return 2 * 4 * n / (t * 1e-3) / 1e12


def _selected(args, **dims) -> bool:
    """Whether a case passes the --batch / --context / --head-dim filters."""
    return all(getattr(args, k, None) in (None, v) for k, v in dims.items())


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="experiments/results/kernels_h200.json")
    p.add_argument("--quick", action="store_true", help="tiny sizes, reference implementation")
    p.add_argument("--only", default="", help="regex over the section names")
    p.add_argument("--sweep", action="store_true", help="sweep prefill and 32K decode knobs")
    p.add_argument("--no-builtin", action="store_true", help="skip the Triton peer")
    p.add_argument("--batch", type=int, default=None, help="only decode cases of this batch")
    p.add_argument("--context", type=int, default=None, help="only decode cases of this context")
    p.add_argument("--head-dim", type=int, default=None, help="only cases of this head_dim")
    p.add_argument(
        "--presets", action="store_true", help="the preset geometries (module docstring)"
    )
    p.add_argument(
        "--schedules",
        default=",".join(SCHEDULES),
        help="--presets: decode schedules to compare (comma separated)",
    )
    p.add_argument(
        "--compile-threads", type=int, default=8, help="--presets: kernels compiled at once"
    )
    args = p.parse_args()
    args.schedules = [x for x in args.schedules.split(",") if x]
    from experiments._meta import run_metadata

    params = {k: v for k, v in vars(args).items() if k != "out"}
    if args.presets:
        params.update(decode=PRESET_DECODE, prefill=PRESET_PREFILL, kv_write=PRESET_KV_WRITE)
    res = dict(
        run_metadata(**params),
        jax_version=jax.__version__,
        sources_sha256=sources_sha256(),
        records=[],
    )
    copies = dict(jnp=jnp_copy_tbs(args.quick), **_PEER_COPY)
    res["copy_tbs_by_library"] = copies
    res["copy_tbs"] = max(v for v in copies.values() if v is not None)

    def flush():  # partial results survive a later crash or a time limit
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1, default=str)

    if args.presets:
        sections = (
            ("presets_decode", functools.partial(run_presets_decode, flush=flush)),
            ("presets_prefill", functools.partial(run_presets_prefill, flush=flush)),
            ("presets_kv_write", functools.partial(run_presets_kv_write, flush=flush)),
        )
    else:
        sections = (("decode", run_decode), ("prefill", run_prefill), ("kv_write", run_kv_write))
    t_start = time.time()
    for name, fn in sections:
        if args.only and not re.search(args.only, name):
            continue
        t0 = time.time()
        try:
            fn(res["records"], args, args.quick)
        except Exception:  # noqa: BLE001
            res["records"].append(dict(kernel=name, error=traceback.format_exc()[-600:]))
        print(f"[{name}: {time.time() - t0:.0f} s]", flush=True)
        res["elapsed_s"] = time.time() - t_start
        flush()
    for r in res["records"]:
        if "tbs" in r:
            r["frac_of_copy"] = r["tbs"] / res["copy_tbs"]
    flush()
    print_table(res)


def print_table(res):
    print(f"device {res['device']} jax {res['jax_version']} copy {res['copy_tbs']:.2f} TB/s")
    for r in res["records"]:
        if r["kernel"].endswith("_try"):
            continue
        sh = r.get("shape", {})
        desc = " ".join(f"{k}={v}" for k, v in sh.items() if v is not None)
        if "geometry" in r:
            desc = f"{r['geometry']} {','.join(r.get('preset', []))[:28]} " + desc
        tun = r.get("tuning")
        if tun:
            desc += " " + ",".join(f"{k}={v}" for k, v in tun.items())
        val = r.get("tbs", r.get("tflops", float("nan")))
        unit = "TB/s" if "tbs" in r else "TFLOP/s"
        extra = f" x{r['ratio_to_cudnn']:.2f} cudnn" if "ratio_to_cudnn" in r else ""
        extra += f" x{r['ratio_to_d256']:.3f} of d256" if "ratio_to_d256" in r else ""
        extra += f" x{r['ratio_to_bf16']:.3f} of bf16" if "ratio_to_bf16" in r else ""
        err = str(r.get("error", "")).strip().splitlines()[-1:] if "error" in r else ""
        print(
            f"{r['kernel']:<22} {desc:<110} {r.get('time_ms', float('nan')):9.3f} ms "
            f"{val:7.2f} {unit}{extra} {err[0][:90] if err else ''}"
        )


if __name__ == "__main__":
    main()
