"""Benchmark of the page-table gather (Gemma 3 27B layout) and of one paged decode step of
Gemma 3 4B, on the H200.

    PYTHONPATH=. python3 experiments/bench_model.py --out $OUT/model_h200.json
    PYTHONPATH=. .venv/bin/python experiments/bench_model.py --quick --out /tmp/x.json  # CPU smoke

Prints a short table and writes JSON: device, platform, jax_version, argv, copy_tbs (device copy,
bytes read + written per second), records [{kernel, shape, time_ms, tbs, ...}]. Every case is
caught on its own: a failure becomes a record with `error`.

Gather (`gather_records`): the whole step's tables (both pools of the layout: 52 sliding layers,
10 full; page 32; batch 256; max context 128K, NB = 4096), timed as one jitted function of the
two `page_table_gather` calls. Cases: every row at 128K (the worst case), rows of 8K-32K tokens
in decode, and the same with 32 rows prefilling a 2048-token chunk (scratch rotation on the
sliding pool). Variants: the jnp reference, the kernel writing a fresh table, and the kernel
updating the previous step's table in place (`out=`, donated; calls alternate between the
previous and the current step's inputs, so each call rewrites exactly the tiles a real step
changes). tbs = bytes written / time; `bytes_table` is the full materialisation
L * B * 2 * NB * 4 per pool, `bytes_written` what the variant writes (in place: the changed
tiles), `bytes_read` the base tables (+ the layer-0 K slice of `out` in place).

Decode (`model_decode_records`): the engine's jitted step (`swajax._runner.step_function`,
decode, state and tables donated) on Gemma 3 4B with random bf16 weights, batch 64, every row
at 8K context, bf16 KV, page 32. The state is built directly (reserve + advance to 8191 tokens
of history, pools filled with random values; no prefill). floor_ms = (weight bytes + KV bytes
read) / copy bandwidth. Also per step: `device_busy_ms` / `device_span_ms` (profiler: union of
kernel intervals / first start to last end), `device_ops` (kernels and copies in the trace) and
`dispatch_ms` (host time per step when issuing several back to back: an upper bound on the
host's cost).

Timing: warm-up, then the median over `reps` of the mean time of `iters` back-to-back calls,
blocked at the end.
"""

# %%
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import time
import traceback

import numpy as np

from experiments.bench_kernels import cupy_copy_tbs, torch_copy_tbs

# Peers measured before JAX takes most of the GPU memory (as in bench_kernels).
_PEER_COPY = {}
if __name__ == "__main__" and "--quick" not in sys.argv and "--copy-tbs" not in sys.argv:
    _PEER_COPY = {"torch": torch_copy_tbs(), "cupy": cupy_copy_tbs()}

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import gemma  # noqa: E402
import swajax  # noqa: E402
from experiments._profile import device_kernel_times, top_kernels  # noqa: E402
from experiments.bench_kernels import jnp_copy_tbs, time_calls  # noqa: E402
from pallas_kernels.page_table_gather import LANES, _pick_tile, page_table_gather  # noqa: E402

GATHER_TARGET_US = 50.0


def _error(kernel, shape, **extra):
    return dict(kernel=kernel, shape=shape, error=traceback.format_exc()[-800:], **extra)


# %% page-table gather
def gather_layout(quick: bool):
    """(layout, batch): Gemma 3 27B (52 sliding + 10 full layers), page 32, 128K, batch 256."""
    if quick:
        config = gemma.configs.gemma3_27b(num_layers=12, sliding_window=256)
        batch, max_context = 4, 4096
    else:
        config = gemma.configs.gemma3_27b()
        batch, max_context = 256, 131_072
    layout = swajax.pool.make_layout(
        config.layer_specs,
        swajax.KVCacheConfig(page_size=32, chunk_size=2048),
        max_context=max_context,
        max_batch=batch,
        num_slots=1,  # the gather never touches pool roots; none is allocated here
        scratch=True,
    )
    return layout, batch


def step_inputs(layout, history, new_tokens, slot_ids):
    """Per pool: (base_table, kv_lens, scratch_range, scratch_slots) of one step, NumPy int32.

    Row b grows from history[b] to cap = history + new_tokens. Base tables hold slot_ids[g]
    for allocated blocks, BAD for unallocated ones (>= ceil(cap / tpb)), for blocks released
    out of window (stale(history)) and for the scratch range (a prefill chunk's blocks that are
    stale by the end of the step); scratch slots are random ids past the normal ones.
    """
    tpb, nb = layout.page_size, layout.max_blocks
    cap = (history + new_tokens).astype(np.int32)
    blk = np.arange(nb)[None, :]
    extent = -(-cap[:, None] // tpb)
    per_group = []
    rng = np.random.default_rng(1)
    for g, group in enumerate(layout.groups):
        keep = blk < extent
        batch = len(cap)
        rng_arr = np.full((batch, 2), swajax.pool.BAD, np.int32)
        slots = np.full((batch, max(group.scratch_slots, 0)), swajax.pool.BAD, np.int32)
        if group.is_sliding:
            start, end = swajax.pool.stale_range(history, group.window, group.sink_blocks, tpb)
            keep &= ~((blk >= start[:, None]) & (blk < end[:, None]))
            if layout.scratch:
                begin, end = swajax.pool.scratch_range(
                    history, cap, group.window, group.sink_blocks, tpb, layout.max_rewind
                )
                end = np.minimum(end, begin + group.scratch_blocks)
                has = (begin < end) & (new_tokens > 1)
                rng_arr[has, 0], rng_arr[has, 1] = begin[has], end[has]
                keep &= ~((blk >= rng_arr[:, :1]) & (blk < rng_arr[:, 1:]))
                count = -(-(rng_arr[:, 1] - rng_arr[:, 0]).clip(0) * 2 // layout.min_scale(g))
                for b in np.nonzero(has)[0]:
                    slots[b, : count[b]] = rng.integers(nb * batch, 2 * nb * batch, count[b])
        base = np.where(keep, slot_ids[g], swajax.pool.BAD).astype(np.int32)
        per_group.append((base, cap, rng_arr, slots))
    return [per_group[pool.group] for pool in layout.pools]


def written_bytes(layout, prev_inputs, inputs, tile_blocks=None):
    """Bytes the in-place kernel writes: the tiles whose layer-0 K entries change."""
    from pallas_kernels.page_table_gather import page_table_gather_reference

    total = 0
    for pool, prev, new in zip(layout.pools, prev_inputs, inputs, strict=True):
        kw = dict(num_layers=pool.num_layers, page_size=layout.page_size)
        p_old = np.asarray(page_table_gather_reference(*map(jnp.asarray, prev), **kw)[0, :, 0])
        p_new = np.asarray(page_table_gather_reference(*map(jnp.asarray, new), **kw)[0, :, 0])
        batch, nb = p_new.shape
        padded = -(-nb // LANES) * LANES
        tile, _ = _pick_tile(padded, tile_blocks)
        diff = np.zeros((batch, padded), bool)
        diff[:, :nb] = p_old != p_new
        tiles = diff.reshape(batch, padded // tile, tile).any(-1).sum()
        total += int(tiles) * pool.num_layers * 2 * tile * 4
    return total


def gather_cases(layout, batch, quick):
    """(name, history, new_tokens) of the current step; the previous step is one step earlier."""
    rng = np.random.default_rng(0)
    max_context = layout.max_context
    lo, hi = (512, 2048) if quick else (8192, 32768)
    realistic = rng.integers(lo, hi + 1, batch).astype(np.int32)
    chunk = 256 if quick else 2048
    prefill_rows = rng.choice(batch, max(1, batch // 8), replace=False)
    new_prefill = np.ones(batch, np.int32)
    new_prefill[prefill_rows] = chunk
    return [
        (
            "all_rows_max_context",
            np.full(batch, max_context - 1, np.int32),
            np.ones(batch, np.int32),
        ),
        ("rows_8k_32k_decode", realistic - 1, np.ones(batch, np.int32)),
        ("rows_8k_32k_prefill_scratch", realistic - new_prefill, new_prefill),
    ]


def gather_records(quick: bool = False, impls=("reference", "pallas")) -> list[dict]:
    """The whole step's page tables of the Gemma 3 27B layout (see the module docstring)."""
    records = []
    layout, batch = gather_layout(quick)
    nb, tpb = layout.max_blocks, layout.page_size
    rng = np.random.default_rng(2)
    slot_ids = [
        rng.permutation(batch * nb).astype(np.int32).reshape(batch, nb) for _ in layout.groups
    ]
    layers = [p.num_layers for p in layout.pools]
    table_bytes = sum(4 * 2 * batch * nb * n for n in layers)
    for name, history, new_tokens in gather_cases(layout, batch, quick):
        prev_new = np.where(new_tokens > 1, new_tokens, 1).astype(np.int32)
        shape = dict(
            batch=batch,
            context=layout.max_context,
            page_size=tpb,
            max_blocks=nb,
            layers=layers,
            kv_min=int((history + new_tokens).min()),
            kv_max=int((history + new_tokens).max()),
            prefill_rows=int((new_tokens > 1).sum()),
        )
        try:
            inputs = step_inputs(layout, history, new_tokens, slot_ids)
            prev = step_inputs(layout, history - prev_new, prev_new, slot_ids)
            extent_bytes = sum(
                4 * 2 * p.num_layers * int(np.minimum(-(-inp[1] // tpb), nb).sum())
                for p, inp in zip(layout.pools, inputs, strict=True)
            )
            read_bytes = sum(inp[0].nbytes for inp in inputs)
            in_place_bytes = written_bytes(layout, prev, inputs)
            jin = [tuple(map(jnp.asarray, x)) for x in inputs]
            jprev = [tuple(map(jnp.asarray, x)) for x in prev]
        except Exception:  # noqa: BLE001
            records.append(_error("gather_step", shape, case=name))
            continue
        common = dict(
            case=name,
            bytes_table=table_bytes,
            bytes_extent=extent_bytes,
            target_us=GATHER_TARGET_US,
        )
        variants = [(impl, "fresh") for impl in impls]
        if "pallas" in impls:
            variants.append(("pallas", "in_place"))
        for impl, mode in variants:
            try:
                rec = _time_gather(layout, jin, jprev, impl, mode, quick)
                written = table_bytes if mode == "fresh" else in_place_bytes
                read = read_bytes * (1 if mode == "fresh" else 2)
                # The kernels' own time when a GPU trace has them, else the wall clock.
                t = rec["device_ms"] or rec["wall_ms"]
                records.append(
                    dict(
                        kernel="gather_step",
                        shape=shape,
                        implementation=impl,
                        mode=mode,
                        time_ms=t,
                        time_us=t * 1e3,
                        wall_ms=rec["wall_ms"],
                        device_ms=rec["device_ms"],
                        device_span_ms=rec["device_span_ms"],
                        device_kernels=rec["device_kernels"],
                        bytes_written=written,
                        bytes_read=read,
                        tbs=written / (t * 1e-3) / 1e12,
                        tbs_moved=(written + read) / (t * 1e-3) / 1e12,
                        meets_target=t * 1e3 <= GATHER_TARGET_US,
                        exact=rec["exact"],
                        **common,
                    )
                )
            except Exception:  # noqa: BLE001
                records.append(
                    _error("gather_step", shape, implementation=impl, mode=mode, **common)
                )
    return records


def _time_gather(layout, inputs, prev_inputs, impl, mode, quick):
    kws = [dict(num_layers=p.num_layers, page_size=layout.page_size) for p in layout.pools]
    iters = 2 if quick else 20

    if mode == "fresh":

        @jax.jit
        def tables(inputs):
            return tuple(
                page_table_gather(*x, **kw, implementation=impl)
                for x, kw in zip(inputs, kws, strict=True)
            )

        t = time_calls(lambda: tables(inputs), iters=iters)
        return dict(
            wall_ms=t,
            **_device_time(lambda: tables(inputs), iters),
            exact=_same_as_reference(layout, inputs, tables(inputs)),
        )

    def update(inputs, outs):
        return tuple(
            page_table_gather(*x, **kw, implementation=impl, out=o)
            for x, kw, o in zip(inputs, kws, outs, strict=True)
        )

    step = jax.jit(update, donate_argnums=1)
    from pallas_kernels.page_table_gather import page_table_gather_reference

    state = [
        tuple(page_table_gather_reference(*x, **kw) for x, kw in zip(prev_inputs, kws, strict=True))
    ]
    turn = [0]

    def call():
        # Alternate the current and the previous step: each call changes the same tiles.
        x = inputs if turn[0] % 2 == 0 else prev_inputs
        turn[0] += 1
        state[0] = step(x, state[0])
        return state[0]

    t = time_calls(call, iters=iters)
    device = _device_time(call, 2 * (iters // 2))  # pairs of calls: both inputs equally
    if turn[0] % 2 == 0:  # the last call used the previous step's inputs
        call()
    return dict(wall_ms=t, **device, exact=_same_as_reference(layout, inputs, state[0]))


def _device_time(call, iters):
    """Summed kernel time per call from a profiler trace (None off-GPU or without kernels)."""
    times = device_kernel_times(call, iters)
    if not times["kernels"]:
        return dict(device_ms=None, device_span_ms=None, device_kernels=[])
    return dict(
        device_ms=times["busy_us"] / 1e3,
        device_span_ms=times["span_us"] / 1e3,
        device_kernels=top_kernels(times, 6),
    )


def _same_as_reference(layout, inputs, tables) -> bool:
    from pallas_kernels.page_table_gather import page_table_gather_reference

    ok = True
    for pool, x, table in zip(layout.pools, inputs, tables, strict=True):
        want = page_table_gather_reference(
            *x, num_layers=pool.num_layers, page_size=layout.page_size
        )
        ok &= bool(jnp.array_equal(want, table))
    return ok


# %% decode step of Gemma 3 4B
def decode_config(quick: bool):
    if quick:
        return gemma.configs.gemma3_4b(
            num_layers=6,
            hidden_size=64,
            intermediate_size=128,
            num_heads=2,
            num_kv_heads=1,
            head_dim=128,
            vocab_size=512,
            sliding_window=64,
        )
    return gemma.configs.gemma3_4b()


def kv_read_bytes(layout, kv_lens) -> int:
    """K + V bytes the decode attention reads: whole pages of each row's visible range."""
    tpb = layout.page_size
    total = 0
    for spec in layout.layer_specs:
        item = jnp.dtype(layout.dtype).itemsize
        per_token = 2 * spec.num_kv_heads * spec.head_dim * item
        if spec.window is None:
            pages = -(-kv_lens // tpb)
        else:
            lo = np.maximum(kv_lens - spec.window, 0)
            pages = -(-kv_lens // tpb) - lo // tpb
        total += int(pages.sum()) * tpb * per_token
    return total


def decode_state(layout, history: int, key):
    """Engine state with every row at `history` tokens, pools filled with random values."""
    batch = layout.max_batch
    state = swajax.pool.init_state(layout)
    grow = jax.jit(lambda s, n: swajax.pool.reserve(layout, s, n), donate_argnums=0)
    ok, state = grow(state, jnp.full((batch,), history, jnp.int32))
    if not bool(ok):
        raise RuntimeError(f"reserve of {history} tokens per row failed: too few slots")
    state = jax.jit(lambda s: swajax.pool.advance(layout, s), donate_argnums=0)(state)
    pools = list(state.pools)
    state = dataclasses.replace(state, pools=())
    for i, pool in enumerate(pools):  # one pool at a time: the zero pool is freed as we go
        pools[i] = jax.random.uniform(jax.random.fold_in(key, i), pool.shape, pool.dtype, -1, 1)
    return dataclasses.replace(state, pools=tuple(pools))


def model_decode_records(
    quick: bool = False, impls=("pallas", "reference"), copy_bw_tbs: float | None = None
) -> list[dict]:
    """One decode step of the paged Gemma 3 4B forward (see the module docstring)."""
    from flax import nnx

    from swajax import _step_cache
    from swajax._runner import StepInputs, step_function
    from swajax._state import initial_tables

    records = []
    batch, context, tpb = (2, 256, 16) if quick else (64, 8192, 32)
    steps = 16 if quick else 64  # rows grow by one token per timed, traced or warm-up step
    shape = dict(batch=batch, context=context, page_size=tpb, kv_dtype="bfloat16")
    try:
        config = decode_config(quick)
        shape.update(layers=config.num_layers, model="gemma3_4b" + ("_tiny" if quick else ""))
        model = gemma.Transformer(
            config, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16
        )
        graphdef, params = nnx.split(model)
        del model
        weight_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
        # NB a multiple of 128 (the gather kernel then works in place), room for the timed steps.
        max_context = -(-(context + steps + 64) // (128 * tpb)) * 128 * tpb
        cfg = swajax.KVCacheConfig(page_size=tpb, dtype=jnp.bfloat16, chunk_size=context)
        probe = swajax.pool.make_layout(
            config.layer_specs, cfg, max_context=max_context, max_batch=batch, num_slots=1
        )
        num_slots = []
        for g in probe.groups:
            if g.is_sliding:
                blocks = -(-g.window // tpb) + 2 + g.scratch_slots + -(-steps // tpb) + 1
            else:
                blocks = -(-(context + steps) // tpb) + 1
            num_slots.append(batch * blocks)
        layout = swajax.pool.make_layout(
            config.layer_specs,
            cfg,
            max_context=max_context,
            max_batch=batch,
            num_slots=tuple(num_slots),
        )
        kv_bytes = kv_read_bytes(layout, np.full(batch, context + steps // 2))
        shape.update(max_blocks=layout.max_blocks, num_slots=num_slots)
        bw = copy_bw_tbs if copy_bw_tbs is not None else jnp_copy_tbs(quick)
        floor_ms = (weight_bytes + kv_bytes) / (bw * 1e12) * 1e3
    except Exception:  # noqa: BLE001
        return [_error("model_decode", shape)]

    # The engine's decode inputs: one token per row, each the row's previous sample (read on
    # the device), no frees or shares, greedy.
    num_tokens = -(-batch // 8) * 8
    prev_rows = np.full(num_tokens, -1, np.int32)
    prev_rows[:batch] = np.arange(batch)
    inputs = StepInputs(
        jnp.zeros((num_tokens,), jnp.int32),
        jnp.asarray(prev_rows),
        jnp.ones((batch,), jnp.int32),
        jnp.zeros((batch,), bool),
        jnp.zeros((0, 3), jnp.int32),
        jnp.zeros((batch,), bool),
        jnp.zeros((0, 3), jnp.int32),
        jnp.zeros((batch, 2), jnp.uint32),
        jnp.zeros((batch,), jnp.int32),
        jnp.zeros((batch,), jnp.float32),
        jnp.zeros((batch,), jnp.int32),
        jnp.ones((batch,), jnp.float32),
    )
    first_tokens = jnp.asarray(
        np.random.default_rng(0).integers(0, config.vocab_size, batch), jnp.int32
    )
    box = call = None
    for impl in impls:
        try:
            # The engine's step: statics bound once, state and tables donated; each call
            # updates the previous step's page tables in place (as `Engine.run` does).
            step = step_function(
                graphdef,
                layout,
                decode=True,
                implementation=impl,
                logits=False,
                sampling_mode="greedy",
            )
            tables = initial_tables(layout)
            box = [decode_state(layout, context - 1, jax.random.key(1)), tables, first_tokens]
            count = [0]

            # the callable for these shapes, resolved once as the engine does
            step = _step_cache.resolve(step, (params, box[0], box[1], box[2], inputs))

            def call(step=step, box=box, count=count):
                out = step(params, box[0], box[1], box[2], inputs)
                box[0], box[1], box[2] = out.state, out.tables, out.next_tokens
                count[0] += 1
                return out.next_tokens, out.ok

            iters, reps = (2, 2) if quick else (6, 5)
            t0 = time.perf_counter()
            jax.block_until_ready(call())  # compile
            compile_s = time.perf_counter() - t0
            t = time_calls(call, iters=iters, reps=reps, warmup=1)
            # Host time per step of `iters` steps issued back to back before blocking: an upper
            # bound on the host's cost (a full launch queue also stalls the host), so a value
            # below the device time means the step is device-bound.
            jax.block_until_ready(call())
            t0 = time.perf_counter()
            outs = [call() for _ in range(iters)]
            dispatch_ms = (time.perf_counter() - t0) / iters * 1e3
            jax.block_until_ready(outs)
            outs = None
            prof = device_kernel_times(call, iters)
            device_ops = sum(k["count"] for k in prof["kernels"].values()) / iters
            _, ok = call()
            if not bool(ok):
                raise RuntimeError("a decode step's reserve failed: too few slots")
            records.append(
                dict(
                    kernel="model_decode",
                    shape=shape,
                    implementation=impl,
                    time_ms=t,
                    weight_bytes=weight_bytes,
                    kv_bytes=kv_bytes,
                    copy_tbs=bw,
                    floor_ms=floor_ms,
                    ratio=t / floor_ms,
                    tbs=(weight_bytes + kv_bytes) / (t * 1e-3) / 1e12,
                    tokens_per_s=batch / (t * 1e-3),
                    compile_s=compile_s,
                    dispatch_ms=dispatch_ms,
                    device_ops=device_ops,
                    xla_flags=os.environ.get("XLA_FLAGS", ""),
                    device_busy_ms=prof["busy_us"] / 1e3 if prof["kernels"] else None,
                    device_span_ms=prof["span_us"] / 1e3 if prof["kernels"] else None,
                    top_kernels=top_kernels(prof, 15) if prof["kernels"] else [],
                    steps_run=count[0],
                )
            )
        except Exception:  # noqa: BLE001
            records.append(_error("model_decode", shape, implementation=impl))
        finally:
            box = call = None  # free this variant's state (pools) before the next one
    return records


# %% main
def _print(res):
    print(f"device {res['device']} jax {res['jax_version']} copy {res['copy_tbs']:.2f} TB/s")
    for r in res["records"]:
        sh = r.get("shape", {})
        keys = ("batch", "context", "kv_min", "kv_max", "prefill_rows", "layers")
        desc = " ".join(f"{k}={sh[k]}" for k in keys if k in sh)
        what = " ".join(str(r[k]) for k in ("case", "implementation", "mode") if k in r)
        if "error" in r:
            print(f"{r['kernel']:<13} {what:<48} {desc:<60} ERROR {str(r['error'])[-120:]!r}")
            continue
        extra = ""
        if r["kernel"] == "gather_step":
            extra = f"{r['time_us']:9.1f} us  written {r['bytes_written'] / 1e6:9.3f} MB"
            extra += f"  (wall {r['wall_ms'] * 1e3:.1f} us)"
            extra += "" if r["exact"] else "  NOT EQUAL TO THE REFERENCE"
        else:
            extra = f"floor {r['floor_ms']:.3f} ms  x{r['ratio']:.2f}"
            if r.get("device_busy_ms"):
                extra += f"  kernels {r['device_busy_ms']:.3f} ms"
                ops = r.get("device_ops", r.get("kernel_launches"))  # v3 files: kernel_launches
                extra += f" (span {r['device_span_ms']:.3f}, {ops:.0f} device ops)"
            if "dispatch_ms" in r:
                extra += f"  dispatch {r['dispatch_ms']:.3f} ms"
        print(
            f"{r['kernel']:<13} {what:<48} {desc:<60} {r['time_ms']:9.3f} ms "
            f"{r['tbs']:6.2f} TB/s  {extra}"
        )
        for k in r.get("top_kernels", []):
            print(f"    {k['us']:9.1f} us  x{k['count']:<5.0f} {k['share']:6.1%}  {k['name'][:90]}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="experiments/results/model_h200.json")
    p.add_argument("--quick", action="store_true", help="tiny sizes (CPU smoke), reference")
    p.add_argument("--only", default="", help="regex over gather|decode")
    p.add_argument(
        "--impls", default=None, help="comma list (default pallas,reference; quick: reference)"
    )
    p.add_argument("--copy-tbs", type=float, default=None, help="copy bandwidth, else measured")
    args = p.parse_args(argv)
    impls = (
        tuple(args.impls.split(","))
        if args.impls
        else (("reference",) if args.quick else ("reference", "pallas"))
    )
    dev = jax.devices()[0]
    res = dict(
        device=dev.device_kind,
        platform=dev.platform,
        jax_version=jax.__version__,
        argv=sys.argv[1:] if argv is None else list(argv),
        impls=list(impls),
        records=[],
    )
    try:
        copies = dict(jnp=jnp_copy_tbs(args.quick), **_PEER_COPY)
        res["copy_tbs_by_library"] = copies
        res["copy_tbs"] = args.copy_tbs or max(v for v in copies.values() if v is not None)
    except Exception:  # noqa: BLE001
        res["copy_tbs"] = float("nan")
        res["records"].append(_error("copy", {}))
    cases = (
        ("gather", lambda: gather_records(args.quick, impls)),
        ("decode", lambda: model_decode_records(args.quick, impls, res["copy_tbs"])),
    )
    for name, fn in cases:
        if args.only and not re.search(args.only, name):
            continue
        t0 = time.time()
        try:
            res["records"] += fn()
        except Exception:  # noqa: BLE001
            res["records"].append(_error(name, {}))
        print(f"[{name}: {time.time() - t0:.0f} s]", flush=True)
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:  # partial results survive a later crash
            json.dump(res, f, indent=1, default=str)
    _print(res)
    return res


if __name__ == "__main__":
    main()
