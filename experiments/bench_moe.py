"""The MoE layer's decode products on the GPU: reading one layer's experts in place in the stack
(the tile kernel, `grouped_matmul(..., group_offset=)`) against copying them out first.

    PYTHONPATH=. python3 experiments/bench_moe.py --out $OUT/moe_decode_h200.json
    PYTHONPATH=. .venv/bin/python experiments/bench_moe.py --quick   # CPU smoke, interpret mode

Per MoE preset geometry (`gemma.configs.moe_geometries`) and tokens per step (decode batches,
a 2048-token step, at the bound up to which the layer scan reads experts in place,
`gemma._layers.EXPERTS_IN_PLACE_MAX_ROWS`, and one 8192-token prefill step): the three
products of the last layer of the preset's largest scanned run (gate, up: [copies, hidden] x
[hidden, moe_ff];
down: [copies, moe_ff] x [moe_ff, hidden]; copies = rows x experts per token, each token routed
to distinct uniformly drawn experts), in three forms:
  - `tile_in_place`: the tile kernel on the run's whole stack [layers * E, K, N] with the
    layer's group offset (what in-place decode runs);
  - `slice_then_ragged_dot`: the layer's experts sliced out of the stack (XLA copies them, a
    custom call cannot take a fused slice), then JAX's `ragged_dot_mgpu` (what the scan runs);
  - `ragged_dot_own_array`: `ragged_dot_mgpu` on the layer's experts as their own array (no copy;
    the other kernel's own time).
Bytes: the routed experts' weights, once (`active_bytes`), plus for the sliced form the copy
of every expert of the layer (read and written; `moved_bytes`); the prediction is the bytes
moved at the copy ceiling (`--tbs`), or the FLOPs at the bf16 peak (`--tflops`) where
that is longer (the 8192-token prefill step). Timing: `bench_kernels.time_calls` (warm-up, median
over reps of back-to-back calls). The stacks exceed the L2 many times over.

Writes JSON (device, versions, commit, parameters; `records`: one per geometry x batch x form,
with `time_ms`, `active_bytes`, `predicted_ms`, `tbs`, or `error`) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from experiments._meta import run_metadata  # noqa: E402
from gemma.configs import MoEGeometry, moe_geometries  # noqa: E402
from pallas_kernels import _checks  # noqa: E402
from pallas_kernels.grouped_matmul import grouped_matmul  # noqa: E402

FORMS = ("tile_in_place", "slice_then_ragged_dot", "ragged_dot_own_array")
COPY_TBS = 4.18  # device-to-device copy ceiling of the H200 (NOTES: kernels_h200_v8_presets)
PEAK_TFLOPS = 989.0  # the H200's dense bf16 peak


def routed_sizes(rng, rows: int, experts: int, per_token: int) -> np.ndarray:
    """Group sizes of `rows` tokens each routed to `per_token` distinct uniform experts."""
    picks = np.stack([rng.choice(experts, per_token, replace=False) for _ in range(rows)])
    return np.bincount(picks.ravel(), minlength=experts).astype(np.int32)


def layer_products(geom, rows, rng, dtype):
    """Inputs of the three products of the last layer of the stack, and their active bytes."""
    d, f, e, k = geom.hidden, geom.moe_ff, geom.experts, geom.per_token
    sizes = routed_sizes(rng, rows, e, k)
    copies = rows * k
    active = int(np.count_nonzero(sizes))
    products = []
    for kk, n in ((d, f), (d, f), (f, d)):
        key = jax.random.key(rng.integers(2**31))
        stack = jax.random.normal(key, (geom.stack_layers * e, kk, n), dtype) * 0.02
        lhs = jax.random.normal(jax.random.fold_in(key, 1), (copies, kk), dtype)
        products.append((lhs, stack))
    active_bytes = active * (2 * d * f + f * d) * jnp.dtype(dtype).itemsize
    return jnp.asarray(sizes), products, active_bytes, active


def sampled_error(out, lhs, w, sizes, samples: int = 64) -> float:
    """Max |out - lhs @ w[group]| over up to `samples` evenly spaced rows, in float32 (a dense
    oracle of every row would hold [G, M, N] floats at a prefill step)."""
    m = lhs.shape[0]
    rows = np.unique(np.linspace(0, m - 1, min(samples, m)).astype(np.int64))
    group = np.searchsorted(np.cumsum(np.asarray(sizes)), rows, side="right")
    want = jnp.einsum("nk,nkf->nf", lhs[rows].astype(jnp.float32), w[group].astype(jnp.float32))
    return float(jnp.max(jnp.abs(out[rows].astype(jnp.float32) - want)))


def form_fn(form: str, e: int, offset: int):
    """The jitted layer (three products) of one form."""
    impl = "pallas"

    def tile(sizes, products):
        return [
            grouped_matmul(lhs, stack, sizes, group_offset=offset, implementation=impl)
            for lhs, stack in products
        ]

    def sliced(sizes, products):
        return [
            grouped_matmul(
                lhs, jax.lax.dynamic_slice_in_dim(stack, offset, e), sizes, implementation=impl
            )
            for lhs, stack in products
        ]

    def own(sizes, products):  # products hold the layer's experts as their own arrays
        return [grouped_matmul(lhs, w, sizes, implementation=impl) for lhs, w in products]

    forms = {"tile_in_place": tile, "slice_then_ragged_dot": sliced, "ragged_dot_own_array": own}
    return jax.jit(forms[form])


def main(argv=None) -> dict:
    from experiments.bench_kernels import time_calls

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("experiments/results/moe_decode_h200.json"))
    p.add_argument(
        "--rows",
        default="8,32,2048,8192",
        help="tokens per step (decode batches; 2048: the in-place bound; 8192: a prefill step)",
    )
    p.add_argument("--forms", default=",".join(FORMS))
    p.add_argument("--tbs", type=float, default=COPY_TBS, help="bytes/s ceiling, 1e12")
    p.add_argument("--tflops", type=float, default=PEAK_TFLOPS, help="bf16 FLOP/s ceiling, 1e12")
    p.add_argument("--quick", action="store_true", help="tiny geometry, interpret mode, CPU")
    args = p.parse_args(argv)
    rows_list = [int(r) for r in args.rows.split(",") if r]
    forms = [f for f in args.forms.split(",") if f]
    for f in forms:
        if f not in FORMS:
            p.error(f"--forms: {f!r} is not one of {FORMS}")
    if args.quick:  # the tile kernel in interpret mode; JAX's kernel is compiled-only
        geoms = [MoEGeometry(128, 64, 8, 2, stack_layers=3, presets=("tiny",))]
        rows_list, forms = [2], ["tile_in_place"]
    else:
        geoms = moe_geometries()
    meta = run_metadata(
        rows=rows_list, forms=forms, tbs=args.tbs, tflops=args.tflops, quick=args.quick
    )
    records = []
    rng = np.random.default_rng(0)
    for geom in geoms:
        d, f, e, k, layers = (
            geom.hidden,
            geom.moe_ff,
            geom.experts,
            geom.per_token,
            geom.stack_layers,
        )
        presets = list(geom.presets)
        offset = (layers - 1) * e
        layer_bytes = e * 3 * d * f * jnp.dtype(jnp.bfloat16).itemsize
        for rows in rows_list:
            sizes, products, active_bytes, active = layer_products(geom, rows, rng, jnp.bfloat16)
            own = [(lhs, stack[offset : offset + e]) for lhs, stack in products]
            for form in forms:
                # bytes moved: the routed experts read once, plus (sliced) every expert of the
                # layer read and written by the copy
                moved = active_bytes + (2 * layer_bytes if form == "slice_then_ragged_dot" else 0)
                flops = 2 * rows * k * 3 * d * f
                rec = dict(
                    presets=presets,
                    geometry=dict(hidden=d, moe_ff=f, experts=e, per_token=k, layers=layers),
                    rows=rows,
                    copies=rows * k,
                    active_experts=active,
                    active_bytes=active_bytes,
                    moved_bytes=moved,
                    flops=flops,
                    predicted_ms=max(moved / args.tbs, flops / args.tflops) / 1e9,
                    form=form,
                )
                try:
                    fn = form_fn(form, e, offset)
                    inputs = own if form == "ragged_dot_own_array" else products
                    if args.quick:
                        with _checks.force_interpret():
                            out = fn(sizes, inputs)
                        ms = None  # interpret mode: no timing
                    else:
                        out = fn(sizes, inputs)
                        ms = time_calls(lambda fn=fn, s=sizes, x=inputs: fn(s, x))
                    err = max(
                        sampled_error(o, lhs, w, sizes)
                        for o, (lhs, w) in zip(out, own, strict=True)
                    )
                    rec.update(max_abs_err=err, time_ms=ms)
                    if ms is not None:
                        rec["tbs"] = moved / ms / 1e9  # bytes moved per second, 1e12
                except Exception:  # noqa: BLE001 - one failed form must not lose the others
                    rec["error"] = traceback.format_exc()[-1500:]
                records.append(rec)
                print(
                    f"{'+'.join(presets):<16} rows {rows:>4} {form:<22} "
                    + (
                        "ERROR " + rec["error"].strip().splitlines()[-1][:160]
                        if "error" in rec
                        else f"{rec['time_ms'] or float('nan'):8.3f} ms  "
                        f"{rec.get('tbs', float('nan')):5.2f} TB/s  predicted "
                        f"{rec['predicted_ms']:.3f} ms  err {rec['max_abs_err']:.2e}"
                    ),
                    flush=True,
                )
            del products, own
    res = dict(
        description=(
            "MoE decode products of one layer: the tile kernel reading the layer's experts in "
            "the stack vs slicing them out (a copy) for ragged_dot_mgpu (experiments/bench_moe.py)"
        ),
        **meta,
        records=records,
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))
    print(f"wrote {args.out}")
    return res


if __name__ == "__main__":
    main()
