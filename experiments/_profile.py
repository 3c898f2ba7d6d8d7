"""Device-side kernel times from a JAX profiler trace (no TensorBoard needed).

`device_kernel_times(call, iters)` runs `call()` `iters` times under `jax.profiler.trace`,
reads the trace back with `jax.profiler.ProfileData` and sums the GPU kernels by name. Wall
clock timing of a Python loop measures dispatch when the device work is shorter than the
launch (a few tens of microseconds); these times are the kernels' own.

Returns dict(kernels={name: dict(total_us, count)}, busy_us, span_us, iters, lines): the
per-kernel totals cover all `iters` calls; `busy_us` is the time per call during which some
kernel ran (the union of their intervals, so overlapping kernels count once) and `span_us` the
first-start to last-end time per call (kernel gaps included). Empty `kernels` on a machine
without a GPU plane (CPU).
"""

from __future__ import annotations

import glob
import os
import tempfile

import jax


def _gpu_kernel_lines(plane):
    """The stream lines of a GPU plane (kernels and memcpys), not the XLA op summaries."""
    lines = [ln for ln in plane.lines if ln.name.startswith("Stream")]
    return lines or [ln for ln in plane.lines if "XLA" not in ln.name]


def _union_ns(starts, ends) -> float:
    """Length of the union of the intervals [start, end): overlapping kernels count once."""
    total, reach = 0.0, None
    for s, e in sorted(zip(starts, ends, strict=True)):
        if reach is None or s >= reach:
            total += e - s
            reach = e
        elif e > reach:
            total += e - reach
            reach = e
    return total


def device_kernel_times(call, iters: int = 10) -> dict:
    jax.block_until_ready(call())  # compile and warm up outside the trace
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp):
            out = None
            for _ in range(iters):
                out = call()
            jax.block_until_ready(out)
        paths = glob.glob(os.path.join(tmp, "**", "*.xplane.pb"), recursive=True)
        if not paths:
            return dict(kernels={}, busy_us=0.0, span_us=0.0, iters=iters, lines=[])
        from jax.profiler import ProfileData

        data = ProfileData.from_file(paths[0])
        kernels: dict[str, dict] = {}
        starts, ends, names = [], [], []
        for plane in data.planes:
            if not plane.name.startswith("/device:GPU"):
                continue
            for line in _gpu_kernel_lines(plane):
                names.append(f"{plane.name}/{line.name}")
                for ev in line.events:
                    k = kernels.setdefault(ev.name, dict(total_us=0.0, count=0))
                    k["total_us"] += ev.duration_ns / 1e3
                    k["count"] += 1
                    starts.append(ev.start_ns)
                    ends.append(ev.end_ns)
    busy = _union_ns(starts, ends) / 1e3 / iters
    span = (max(ends) - min(starts)) / 1e3 / iters if starts else 0.0
    return dict(kernels=kernels, busy_us=busy, span_us=span, iters=iters, lines=names)


def top_kernels(times: dict, n: int = 12) -> list[dict]:
    """The n kernels with the most time, per call: name, us, count, share of busy time."""
    iters = max(times["iters"], 1)
    busy = max(times["busy_us"], 1e-9)
    rows = sorted(times["kernels"].items(), key=lambda kv: -kv[1]["total_us"])[:n]
    return [
        dict(
            name=name[:160],
            us=k["total_us"] / iters,
            count=k["count"] / iters,
            share=k["total_us"] / iters / busy,
        )
        for name, k in rows
    ]
