"""Does a `lax.scan` over stacked layer weights copy each layer's weights before its GEMMs?

A decode step of a large model reads every weight once; at 1-8 rows its time is the weights'
bytes over the HBM bandwidth. Under a scan, each layer's matrices are dynamic slices of the
stacked parameters. If XLA materialises those slices (a device-to-device copy per matrix per
layer) the step moves 3x the weight bytes: read + write the copy, then the GEMM's read.

This probe times a synthetic decode MLP stack at Gemma 4 12B's sizes (48 layers, d_model
3840, four matrices a layer) in several forms and counts the copies in a profiler trace:

- `scan`: `lax.scan` over the stacked weights (the model's form), default compiler options;
- `scan_dsf`: the same with `xla_gpu_enable_dynamic_slice_fusion` (GEMMs read the slice in
  place where XLA supports it);
- `scan_dsf_cublas`: plus `xla_gpu_enable_triton_gemm=false` (cuBLAS GEMMs, which the dynamic
  slice fusion handles);
- `scan_gemm_v2`: XLA's second GEMM fusion (`xla_gpu_experimental_gemm_fusion_v2`), which
  fuses any operand Triton can tile, a major-dimension dynamic slice included
  (`scan_gemm_v2_tiling`: with its tiling propagation);
- `scan_xla_full_unroll`: XLA unrolls the while loop itself (static slices);
- `scan_unroll_full`: `lax.scan(..., unroll=True)` over the stacked weights (static slices);
- `unrolled_stacked`: a Python loop over static slices `w[i]` of the stacked weights;
- `unrolled`: a Python loop over per-layer arrays (no slices at all): the floor;
- `scan_grouped`: the scan over layer indices, each product `x @ W[i]` as the grouped matmul
  (`pallas_kernels.grouped_matmul`, Mosaic GPU on Hopper) of the whole stack with every row in
  group i: the kernel reads group i's weights where they lie.

    PYTHONPATH=. python3 experiments/probe_layer_scan.py --out /tmp/out/probe_layer_scan.json
    PYTHONPATH=. python3 experiments/probe_layer_scan.py --quick   # CPU, tiny sizes

Writes per variant and row count: the largest difference from the unrolled loop's output
(absolute, and relative to its largest entry), the wall time per step, the device busy time,
the memcpy count and time per step, and the weight bytes over the step time (TB/s). Each
layer normalises its inputs (RMS), so 48 layers of random weights stay finite in bf16.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import jax
import jax.numpy as jnp

VARIANTS = {
    "scan": {},
    "scan_dsf": {"xla_gpu_enable_dynamic_slice_fusion": True},
    "scan_dsf_cublas": {
        "xla_gpu_enable_dynamic_slice_fusion": True,
        "xla_gpu_enable_triton_gemm": False,
    },
    "scan_gemm_v2": {"xla_gpu_experimental_gemm_fusion_v2": True},
    "scan_gemm_v2_tiling": {
        "xla_gpu_experimental_gemm_fusion_v2": True,
        "xla_gpu_experimental_enable_tiling_propagation": True,
    },
    "scan_xla_full_unroll": {
        "xla_gpu_enable_while_loop_unrolling": "WHILE_LOOP_UNROLLING_FULL_UNROLL"
    },
    "scan_unroll_full": {},
    "unrolled_stacked": {},
    "unrolled": {},
    "scan_grouped": {},
}


def _norm(x):
    """RMS normalisation in float32 (keeps the residual stream finite over 48 layers)."""
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)).astype(x.dtype)


def layer(x, w):
    q, gate, up, down = w
    h = x + (_norm(x) @ q)[:, : x.shape[1]]
    n = _norm(h)
    a = jax.nn.gelu(n @ gate) * (n @ up)
    return h + a @ down


def scanned(x, stacked):
    def body(h, w):
        return layer(h, w).astype(h.dtype), None

    return jax.lax.scan(body, x, stacked)[0]


def scanned_grouped(x, stacked):
    from pallas_kernels.grouped_matmul import grouped_matmul

    layers = stacked[0].shape[0]

    def mm(h, w, i):
        sizes = jnp.where(jnp.arange(layers) == i, h.shape[0], 0).astype(jnp.int32)
        return grouped_matmul(h, w, sizes)

    def body(h, i):
        q, gate, up, down = stacked
        h2 = h + mm(_norm(h), q, i)[:, : h.shape[1]]
        n = _norm(h2)
        a = jax.nn.gelu(mm(n, gate, i)) * mm(n, up, i)
        return (h2 + mm(a.astype(h.dtype), down, i)).astype(h.dtype), None

    return jax.lax.scan(body, x, jnp.arange(layers))[0]


def scanned_unrolled(x, stacked):
    def body(h, w):
        return layer(h, w).astype(h.dtype), None

    return jax.lax.scan(body, x, stacked, unroll=True)[0]


def unrolled_stacked(x, stacked):
    for i in range(stacked[0].shape[0]):
        x = layer(x, tuple(w[i] for w in stacked)).astype(x.dtype)
    return x


def unrolled(x, per_layer):
    for w in per_layer:
        x = layer(x, w).astype(x.dtype)
    return x


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--d-model", type=int, default=3840)
    p.add_argument("--d-ff", type=int, default=15360)
    p.add_argument("--d-q", type=int, default=4096)
    p.add_argument("--rows", default="1,8")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", type=pathlib.Path, default=None)
    args = p.parse_args(argv)
    if args.quick:
        args.layers, args.d_model, args.d_ff, args.d_q, args.iters = 3, 64, 128, 64, 2
    from experiments._meta import run_metadata
    from experiments._profile import device_kernel_times

    L, D, F, Q = args.layers, args.d_model, args.d_ff, args.d_q
    keys = jax.random.split(jax.random.key(0), 4)
    shapes = [(L, D, Q), (L, D, F), (L, D, F), (L, F, D)]
    stacked = tuple(
        (jax.random.normal(k, s, jnp.float32) * s[1] ** -0.5).astype(jnp.bfloat16)
        for k, s in zip(keys, shapes, strict=True)
    )
    weight_bytes = sum(w.size * w.dtype.itemsize for w in stacked)
    per_layer = [tuple(w[i] for w in stacked) for i in range(L)]
    jax.block_until_ready(per_layer)
    res = run_metadata(**vars(args) | {"out": str(args.out)}, weight_bytes=weight_bytes)
    res["records"] = []
    for rows in [int(r) for r in args.rows.split(",")]:
        x = jax.random.normal(jax.random.key(rows), (rows, D), jnp.bfloat16)
        expected = jax.jit(unrolled)(x, per_layer).astype(jnp.float32)
        for name in args.variants.split(","):
            options = VARIANTS[name]
            rec = dict(variant=name, rows=rows, compiler_options=options)
            try:
                fn, w = {
                    "unrolled": (unrolled, per_layer),
                    "unrolled_stacked": (unrolled_stacked, stacked),
                    "scan_unroll_full": (scanned_unrolled, stacked),
                    "scan_grouped": (scanned_grouped, stacked),
                }.get(name, (scanned, stacked))
                t0 = time.perf_counter()
                compiled = jax.jit(fn).lower(x, w).compile(compiler_options=options or None)
                rec["compile_s"] = time.perf_counter() - t0
                got = compiled(x, w).astype(jnp.float32)
                rec["max_abs_diff_vs_unrolled"] = float(jnp.max(jnp.abs(got - expected)))
                rec["max_rel_diff_vs_unrolled"] = rec["max_abs_diff_vs_unrolled"] / float(
                    jnp.max(jnp.abs(expected))
                )
                t0 = time.perf_counter()
                for _ in range(args.iters):
                    out = compiled(x, w)
                jax.block_until_ready(out)
                rec["step_ms"] = (time.perf_counter() - t0) / args.iters * 1e3
                times = device_kernel_times(lambda c=compiled, x=x, w=w: c(x, w), iters=3)
                copies = {k: v for k, v in times["kernels"].items() if "memcpy" in k.lower()}
                rec["device_busy_ms"] = times["busy_us"] / 1e3
                rec["memcpy_per_step"] = sum(v["count"] for v in copies.values()) / 3
                rec["memcpy_ms_per_step"] = sum(v["total_us"] for v in copies.values()) / 3e3
                rec["weight_tb_s"] = weight_bytes / (rec["step_ms"] / 1e3) / 1e12
            except Exception as e:  # an option this XLA does not know: record and go on
                rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            res["records"].append(rec)
            print(json.dumps(rec), flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
