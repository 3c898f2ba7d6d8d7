"""The stacked matmul on the GPU: one layer's matrix read in its stack, at every preset geometry.

    PYTHONPATH=. python3 experiments/bench_stacked.py --out $OUT/stacked_h200.json [--sweep]
    PYTHONPATH=. .venv/bin/python experiments/bench_stacked.py --quick   # CPU smoke (interpret)

Per preset geometry (`gemma.configs.stacked_geometries`, every (K, N) a layer-scanned decode
step multiplies) and decode rows M, three forms of a run of products over a stack of L layers,
each product x [M, K] @ stack[i] [K, N] for i = 0 .. L-1 inside one jitted program:
  - `kernel`: `stacked_matmul` under `lax.scan` with i the scan's counter (what decode runs);
  - `scan_slice`: the same scan with `stacked_matmul_reference`, the dynamic slice that XLA
    copies before its GEMM (what the layer scan ran before the kernel);
  - `unrolled`: a Python loop over static slices, which XLA fuses into its GEMMs (the weights
    read in place at the price of a program per layer; L capped at 48).
L is large enough that the stack exceeds the L2 four times (so every product reads HBM), up to
1024 layers. Time per product = program time / L (`bench_kernels.time_calls`). Bytes = the
weights' K * N * 2 (x and the output are M / N and M / K of that; the kernel's float32 split
partials are added where it splits); the prediction is those bytes at the measured copy
ceiling. `--sweep` also times the kernel at other tilings (block_n, K splits, stages) on a
spread of geometries, to fit `stacked_matmul.tiling`.

Writes JSON (device, versions, commit, parameters, the copy ceiling; `records`: one per
geometry x rows x form, `us`, `tbs`, `bytes`, `tiles`, `predicted_us`) as it goes, and prints
a table.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from experiments._meta import run_metadata  # noqa: E402
from experiments.bench_generate import torch_ceilings  # noqa: E402
from experiments.bench_kernels import L2_BYTES, time_calls  # noqa: E402
from gemma.configs import stacked_geometries  # noqa: E402
from pallas_kernels import _checks  # noqa: E402
from pallas_kernels.stacked_matmul import (  # noqa: E402
    BLOCK_K,
    Tiling,
    stacked_matmul,
    stacked_matmul_reference,
    tiling,
)

FORMS = ("kernel", "scan_slice", "unrolled")
MAX_LAYERS, MAX_UNROLLED = 1024, 48


def layers_for(k: int, n: int, stack_layers: int, quick: bool) -> int:
    if quick:
        return 2
    per_layer = k * n * 2
    return int(min(MAX_LAYERS, max(stack_layers, 2, -(-4 * L2_BYTES // per_layer))))


def program(form: str, layers: int, tiles: Tiling | None = None):
    """The jitted run of `layers` products: x [M, K], stack [L, K, N] -> a checksum [M]."""

    def one(x, stack, i):
        if form == "kernel":
            return stacked_matmul(x, stack, i, implementation="pallas", tiles=tiles)
        return stacked_matmul_reference(x, stack, i)

    if form == "unrolled":

        def run(x, stack):
            total = jnp.zeros((x.shape[0],), jnp.float32)
            for i in range(min(layers, MAX_UNROLLED)):
                total = total + jnp.dot(x, stack[i], preferred_element_type=jnp.float32)[:, 0]
            return total

        return jax.jit(run)

    def run(x, stack):
        def body(total, i):
            return total + one(x, stack, i)[:, 0].astype(jnp.float32), None

        total = jnp.zeros((x.shape[0],), jnp.float32)
        return jax.lax.scan(body, total, jnp.arange(layers, dtype=jnp.int32))[0]

    return jax.jit(run)


def partial_bytes(rows: int, n: int, tiles: Tiling) -> int:
    return 0 if tiles.splits == 1 else 2 * tiles.splits * rows * n * 4


def sweep_tilings(rows: int, k: int, n: int) -> list[Tiling]:
    """Other tilings of one product: block_n 64 / 128, every K split keeping >= 2 K blocks,
    and 3 / 6 stages at the default tiles."""
    default = tiling(rows, k, n)
    steps = k // BLOCK_K
    out = []
    for block_n in (64, 128):
        if n % block_n:
            continue
        for splits in [s for s in range(1, steps // 2 + 1) if steps % s == 0][:8]:
            out.append(dataclasses.replace(default, block_n=block_n, splits=splits))
    out += [dataclasses.replace(default, stages=s) for s in (3, 6)]
    return [t for t in dict.fromkeys(out) if t != default]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="experiments/results/stacked_cpu.json")
    p.add_argument("--rows", default="1,8,32,64")
    p.add_argument("--forms", default=",".join(FORMS))
    p.add_argument("--baseline-rows", default="8", help="rows of the scan_slice / unrolled forms")
    p.add_argument(
        "--profile",
        type=int,
        default=2,
        help="geometries whose kernel form is "
        "profiled (every GPU kernel and copy of its program, by name)",
    )
    p.add_argument("--sweep", action="store_true", help="also time other tilings")
    p.add_argument("--quick", action="store_true", help="CPU smoke: two geometries, interpret")
    p.add_argument("--workers", type=int, default=12, help="threads compiling the programs")
    args = p.parse_args(argv)
    rows_list = [int(r) for r in args.rows.split(",")]
    baseline_rows = {int(r) for r in args.baseline_rows.split(",")}
    forms = args.forms.split(",")
    geoms = stacked_geometries()
    if args.quick:
        geoms, rows_list, forms = geoms[:2], [1], ["kernel", "scan_slice"]
        baseline_rows, args.profile = {1}, 0
    mm, copy = (None, None) if args.quick else torch_ceilings()
    record = run_metadata(
        rows=rows_list,
        forms=forms,
        sweep=args.sweep,
        quick=args.quick,
        max_layers=MAX_LAYERS,
        max_unrolled=MAX_UNROLLED,
        l2_bytes=L2_BYTES,
    )
    record.update(copy_tbs=copy, matmul_tflops=mm, records=[])

    def save():
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)

    jobs = []  # (geometry, rows, form, tiles, layers)
    for g in geoms:
        layers = layers_for(g.k, g.n, g.stack_layers, args.quick)
        for rows in rows_list:
            for form in forms:
                if form != "kernel" and rows not in baseline_rows:
                    continue
                tiles = tiling(rows, g.k, g.n) if form == "kernel" else None
                jobs.append((g, rows, form, tiles, layers))
    if args.sweep:
        spread = geoms[:: max(1, len(geoms) // 12)]
        for g in spread:
            layers = layers_for(g.k, g.n, g.stack_layers, args.quick)
            for rows in (1, 64):
                for t in sweep_tilings(rows, g.k, g.n):
                    jobs.append((g, rows, "sweep", t, layers))

    def build(job):
        g, rows, form, tiles, layers = job
        f = program("kernel" if form == "sweep" else form, layers, tiles)
        sds = jax.ShapeDtypeStruct
        args_ = (sds((rows, g.k), jnp.bfloat16), sds((layers, g.k, g.n), jnp.bfloat16))
        ctx = _checks.force_interpret() if args.quick else _checks.force_compiled()
        with ctx:
            return f.lower(*args_).compile()

    print(f"compiling {len(jobs)} programs (timed as they come)", flush=True)
    pool = concurrent.futures.ThreadPoolExecutor(args.workers)
    compiled = []
    stacks = {}
    for job, exe in zip(jobs, pool.map(lambda j: _try(build, j), jobs), strict=True):
        compiled.append(exe)
        g, rows, form, tiles, layers = job
        rec = dict(
            geometry=g.id,
            k=g.k,
            n=g.n,
            presets=list(g.presets),
            rows=rows,
            form=form,
            layers=layers,
            tiles=None if tiles is None else dataclasses.asdict(tiles),
        )
        key = (g.k, g.n, layers)
        if key not in stacks:
            stacks.clear()  # one stack on the device at a time
            stacks[key] = jax.random.normal(
                jax.random.key(g.k * g.n), (layers, g.k, g.n), jnp.bfloat16
            )
        x = jax.random.normal(jax.random.key(rows), (rows, g.k), jnp.bfloat16)
        weights = g.k * g.n * 2
        moved = weights + (partial_bytes(rows, g.n, tiles) if tiles else 0)
        rec.update(bytes=weights, moved_bytes=moved)
        if copy:
            rec["predicted_us"] = moved / (copy * 1e12) * 1e6
        if isinstance(exe, str):
            rec["error"] = exe
        else:
            try:
                count = min(layers, MAX_UNROLLED) if form == "unrolled" else layers
                stack = stacks[key]
                ms = time_calls(lambda exe=exe, x=x, s=stack: exe(x, s), iters=5, reps=5)
                rec["us"] = ms * 1e3 / count
                rec["tbs"] = weights / (rec["us"] * 1e-6) / 1e12
            except Exception:  # noqa: BLE001
                rec["error"] = traceback.format_exc(limit=3)
        record["records"].append(rec)
        save()
    pool.shutdown()
    _table(record)
    if args.profile:
        from experiments._profile import device_kernel_times, top_kernels

        record["profiles"] = []
        for job, exe in zip(jobs, compiled, strict=True):
            g, rows, form, tiles, layers = job
            if form != "kernel" or rows != rows_list[0] or isinstance(exe, str):
                continue
            if len(record["profiles"]) >= args.profile:
                break
            stack = jax.random.normal(jax.random.key(0), (layers, g.k, g.n), jnp.bfloat16)
            x = jax.random.normal(jax.random.key(1), (rows, g.k), jnp.bfloat16)
            times = device_kernel_times(lambda exe=exe, x=x, stack=stack: exe(x, stack), 3)
            prof = dict(
                geometry=g.id,
                rows=rows,
                layers=layers,
                top=top_kernels(times, 12),
                busy_us=times["busy_us"],
                span_us=times["span_us"],
            )
            record["profiles"].append(prof)
            print(f"profile {g.id} rows {rows}, {layers} products per call:")
            for t in prof["top"]:
                print("   ", t)
            del stack
    save()
    return 0


def _try(fn, job):
    try:
        return fn(job)
    except Exception:  # noqa: BLE001
        return traceback.format_exc(limit=4)


def _table(record) -> None:
    rows = sorted({r["rows"] for r in record["records"]})
    by = {}
    for r in record["records"]:
        if r["form"] != "sweep":
            by.setdefault(r["geometry"], {})[(r["form"], r["rows"])] = r
    print(f"copy ceiling {record['copy_tbs']} TB/s; TB/s of the weights' bytes per form")
    head = " ".join(f"{f[:6]}@{m:<3}" for f in FORMS for m in rows)
    print(f"{'geometry':>14} {'MB':>6} {head}")
    for geom, cells in by.items():
        mb = next(iter(cells.values()))["bytes"] / 1e6
        vals = []
        for f in FORMS:
            for m in rows:
                c = cells.get((f, m))
                vals.append(f"{c['tbs']:10.2f}" if c and "tbs" in c else f"{'-':>10}")
        print(f"{geom:>14} {mb:6.2f} {' '.join(vals)}")


if __name__ == "__main__":
    sys.exit(main())
