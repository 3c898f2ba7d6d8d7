"""Cold start and the decode step as `Engine.run` drives it, on the H200.

    SWAJAX_GIT_COMMIT=... PYTHONPATH=. python3 experiments/bench_cold_start.py --out $OUT/c.json
    # and the decode step of each preset of DECODE_CASES (or --decode-presets)
    SWAJAX_GIT_COMMIT=... PYTHONPATH=. python3 experiments/bench_cold_start.py --decode \
        --out $OUT/c.json
    PYTHONPATH=. .venv/bin/python experiments/bench_cold_start.py --quick --out /tmp/c.json
    # CPU, the presets' depth at small widths (reference attention): the caches' effect
    PYTHONPATH=. .venv/bin/python experiments/bench_cold_start.py --quick --full-depth \
        --out experiments/results/cold_start_cpu_full_depth.json
    # CPU: lowering for CUDA (Pallas kernels) with and without the step cache
    SWAJAX_COMPILATION_CACHE=0 PYTHONPATH=. .venv/bin/python experiments/bench_cold_start.py \
        --lowering --out experiments/results/step_cache_lowering_cpu.json

Cold start (per preset, full size, random bf16 weights, Pallas kernels): a fresh process with
an empty persistent compilation cache times `swajax.Engine(...)` construction to the first
generated token of one 512-token prompt (`cold_s`; model initialisation is `init_s`, not
counted), then a second fresh process with the caches the first one filled (`warm_cache_s`:
JAX's compilation cache and swajax's step cache, whose steps are neither traced nor lowered);
the same pair with the step cache off (`cold_no_step_cache_s`,
`warm_compilation_cache_only_s`: steps traced and lowered again before the cache lookup).
`precompile` records the same with `Engine(precompile=True)` (every step shape compiled at
construction, in threads) where asked.

Decode (`--decode`): per preset of DECODE_CASES (rows, prompt tokens), that many prompts,
96 new tokens each, greedy, through the default engine (`Engine.run`; the layers under
`lax.scan`, every matrix read in its stack); the gaps between each request's last tokens (every
row decoding: one decode step as the host loop drives it, p50) against the step's bytes floor:
the weights a decode step reads (the MoE: the routed experts of its rows, at most all) and the
KV, at the copy bandwidth measured in the run. For Gemma 3 4B also the model built unrolled
(`scan_layers=False`, one Block per layer, the same weights): what XLA does with per-layer
arrays.
"""

# %%
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback

PRESETS = ("gemma3_4b", "gemma4_e2b")
# (preset, rows, prompt tokens) of the decode records
# (preset, rows, prompt tokens, token budget per step). The 31B's 57 GiB of weights leave an
# 80 GB card room for its rows' KV and a 1024-token prefill chunk, not an 8K one; the budget
# changes the prefill steps only, not the decode step measured.
DECODE_CASES = (
    ("gemma3_4b", 64, 8192, 8192),
    ("gemma4_12b", 8, 8192, 8192),
    ("gemma4_26b_a4b", 16, 8192, 8192),
    ("gemma4_31b", 8, 8192, 1024),
)


def child(preset: str, quick: bool, precompile: bool, full_depth: bool = False) -> dict:
    """One fresh process: build the model, then time engine construction -> first token."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import gemma
    import swajax

    events: dict[str, float] = {}  # JAX's compile-time events (trace, lower, compile, cache)

    def on_event(event, seconds, **_):
        events[event] = events.get(event, 0.0) + seconds

    jax.monitoring.register_event_duration_secs_listener(on_event)
    config = gemma.configs.preset(preset)
    if quick:  # (full_depth: the preset's layers, small widths: tracing and lowering at scale)
        config = gemma.configs.small_preset(
            preset, num_layers=config.num_layers if full_depth else None
        )
    t0 = time.perf_counter()
    model = gemma.Transformer(
        config, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16
    )
    jax.block_until_ready(nnx.state(model))
    init_s = time.perf_counter() - t0
    prompt = [1 + i % (config.vocab_size - 1) for i in range(512)]
    events.clear()  # (model initialisation compiled its own programs)
    t0 = time.perf_counter()
    engine = swajax.Engine(
        model,
        # (quick: a small pool; on the CPU the default quota is a share of host memory)
        swajax.KVCacheConfig(
            page_size=32, dtype=jnp.bfloat16, max_gpu_total_bytes=(256 << 20) if quick else None
        ),
        max_context=4096,
        max_batch=16,
        max_num_tokens=512 if quick else 8192,
        implementation="reference" if quick else "pallas",
        precompile=precompile,
    )
    built_s = time.perf_counter() - t0
    first = []
    engine.run([prompt], 2, callback=lambda i, o: first.append(time.perf_counter()))
    return dict(
        preset=preset,
        init_s=init_s,
        construct_s=built_s,
        first_token_s=first[0] - t0,
        traces=engine.trace_count,
        # seconds per JAX event between construction and the first token: tracing, lowering
        # to MLIR, XLA compilation or the persistent cache's retrieval; the rest of
        # first_token_s is the engine's own work, loading executables and running the steps
        # (Mosaic GPU kernels are built when their executable first loads)
        events={k.rsplit("/", 1)[-1]: round(v, 3) for k, v in sorted(events.items())},
        cache_dir=jax.config.jax_compilation_cache_dir,
        cache_files=len(os.listdir(jax.config.jax_compilation_cache_dir)),
    )


def cold_start(
    preset: str,
    quick: bool,
    precompile: bool,
    full_depth: bool = False,
    step_cache="both",
) -> dict:
    """Fresh processes, two per cache setting, each pair on an empty cache directory: with the
    step cache (`SWAJAX_STEP_CACHE=1`; `swajax._step_cache`: a warm process neither traces nor
    lowers its steps) `cold_s` then `warm_cache_s`; with it off (`SWAJAX_STEP_CACHE=0`: JAX's
    compilation cache only, steps traced and lowered again) `cold_no_step_cache_s` then
    `warm_compilation_cache_only_s`. The two settings compile different modules (the step cache
    calls an exported step), so each fills its own directory."""
    rec = dict(kind="cold_start", preset=preset, precompile=precompile, full_depth=full_depth)
    cmd = [sys.executable, __file__, "--child", preset]
    cmd += ["--quick"] if quick else []
    cmd += ["--precompile"] if precompile else []
    cmd += ["--full-depth"] if full_depth else []
    settings = (
        ("1", ("cold", "warm_cache")),
        ("0", ("cold_no_step_cache", "warm_compilation_cache_only")),
    )
    for setting, labels in settings:
        if step_cache != "both" and setting != {"on": "1", "off": "0"}[step_cache]:
            continue
        with tempfile.TemporaryDirectory() as cache:
            env = dict(
                os.environ,
                SWAJAX_COMPILATION_CACHE_DIR=cache,
                SWAJAX_COMPILATION_CACHE="1",
                SWAJAX_STEP_CACHE=setting,
            )
            env.pop("JAX_COMPILATION_CACHE_DIR", None)
            env.pop("SWAJAX_STEP_CACHE_DIR", None)
            for label in labels:
                t0 = time.perf_counter()
                out = subprocess.run(cmd, env=env, capture_output=True, text=True)
                wall = time.perf_counter() - t0
                if out.returncode:
                    rec[f"{label}_error"] = out.stderr[-1500:]
                    break
                r = json.loads(out.stdout.strip().splitlines()[-1])
                rec[f"{label}_s"] = r["first_token_s"]
                rec[f"{label}_process_s"] = wall
                rec[f"{label}_detail"] = r
    return rec


def lowering_record(preset: str) -> dict:
    """What the step cache saves a warm process, measured without a GPU: the preset's layers at
    small widths with the Pallas kernels, each step variant (a prefill bucket of 8192 tokens,
    the decode bucket) lowered for CUDA (the whole Mosaic GPU lowering runs on the CPU):
    `plain_s` traces and lowers the jitted step (what a warm process did with the compilation
    cache alone), `export_s` exports and serializes it (a cold process, once), `cached_s`
    deserializes it and lowers the thin jit that calls it (a warm process with the step cache).
    The time to look the executable up in the compilation cache is the same for both."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import gemma
    import swajax
    from pallas_kernels import _checks
    from swajax._model_runner import StepShape

    config = gemma.configs.small_preset(preset, num_layers=gemma.configs.preset(preset).num_layers)
    model = gemma.Transformer(
        config, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16
    )
    engine = swajax.Engine(
        model,
        swajax.KVCacheConfig(page_size=32, dtype=jnp.bfloat16, max_gpu_total_bytes=64 << 20),
        max_context=4096,
        max_batch=16,
        max_num_tokens=8192,
        implementation="pallas",
    )
    jax.jit(lambda x: x + 1).lower(jnp.ones(3))  # jax's own first-use costs, outside the timings
    rec = dict(kind="lowering", preset=preset, num_layers=config.num_layers, variants=[])
    decode_bucket = engine.step_buckets()[0][0]
    for num_tokens, decode in ((8192, False), (decode_bucket, True)):
        step = engine.runner._step_function(StepShape(num_tokens, decode, False, "greedy"))
        args = engine.runner.step_args(num_tokens)
        with _checks.force_compiled():
            t0 = time.perf_counter()
            plain = step.jitted.trace(*args).lower(lowering_platforms=("cuda",))
            plain_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            exported, out_tree = step.export(*args, platforms=("cuda",))
            data = bytes(exported.serialize())
            export_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            loaded = jax.export.deserialize(bytearray(data))
            fn = step.call(loaded, out_tree)
            cached = fn.trace(*args).lower(lowering_platforms=("cuda",))
            cached_s = time.perf_counter() - t0
        rec["variants"].append(
            dict(
                num_tokens=num_tokens,
                decode=decode,
                plain_s=plain_s,
                export_s=export_s,
                cached_s=cached_s,
                serialized_bytes=len(data),
                mosaic_kernels_plain=plain.as_text().count("mosaic_gpu"),
                lowered_chars=len(plain.as_text()),
                while_loops=plain.as_text().count("stablehlo.while"),
                mosaic_kernels_cached=cached.as_text().count("mosaic_gpu"),
            )
        )
    return rec


def decode_record(
    quick: bool,
    copy_tbs: float | None,
    preset: str = "gemma3_4b",
    batch: int = 64,
    context: int = 8192,
    chunk: int = 8192,
    scan_layers: bool = True,
) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    import gemma
    import swajax

    new = 12 if quick else 96
    if quick:
        batch, context = min(batch, 4), 256
    tail = 8 if quick else 24  # the last tokens of each request come from decode-only steps
    config = gemma.configs.small_preset(preset) if quick else gemma.configs.preset(preset)
    rec = dict(
        kind="decode_step",
        preset=preset,
        batch=batch,
        context=context,
        new=new,
        scan_layers=scan_layers,
        token_budget=chunk,
    )
    try:
        model = gemma.Transformer(
            config,
            rngs=nnx.Rngs(0),
            dtype=jnp.bfloat16,
            param_dtype=jnp.bfloat16,
            scan_layers=scan_layers,
        )
        params = jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param))
        weight_bytes = expert_bytes = 0
        for path, x in params:
            if "moe" in jax.tree_util.keystr(path) and x.ndim >= 3 and "router" not in str(path):
                expert_bytes += x.nbytes
            else:
                weight_bytes += x.nbytes
        if config.num_experts:  # the experts a decode step's rows route to, at most all
            routed = min(1.0, batch * config.num_experts_per_token / config.num_experts)
            weight_bytes += int(expert_bytes * routed)
        rng = np.random.default_rng(0)
        prompts = [rng.integers(1, config.vocab_size, context).tolist() for _ in range(batch)]
        # An explicit quota (the run's KV and its prefill chunk, with room to spare) instead of
        # a fraction of free memory, so every variant plans the same pool.
        quota = (64 << 20) if quick else _decode_quota(config, batch, context + new, chunk)
        engine = swajax.Engine(
            model,
            swajax.KVCacheConfig(
                page_size=32 if not quick else 16,
                dtype=jnp.bfloat16,
                max_gpu_total_bytes=quota,
            ),
            max_context=context + new + 32,
            max_batch=batch,
            max_num_tokens=chunk if not quick else None,
            implementation="reference" if quick else "pallas",
        )
        engine.run(prompts[:1], 2)  # compile outside the run
        times: dict[int, list[float]] = {}
        _, stats = engine.run(
            prompts, new, callback=lambda i, o: times.setdefault(i, []).append(time.perf_counter())
        )
        # Gaps between each request's last `tail` tokens: every row is decoding by then (the
        # prefill of the last prompt ended long before), so a gap is one decode-only step as
        # the engine's host loop drives it.
        gaps = np.concatenate([np.diff(t[-tail:]) for t in times.values()])
        kv = 0
        for i, s in enumerate(config.layer_specs):
            keys = context + new // 2 if s.window is None else min(context, s.window)
            kv += 2 * keys * s.num_kv_heads * s.head_dim * 2 if s.kv_source == i else 0
        floor_ms = (weight_bytes + batch * kv) / (copy_tbs * 1e12) * 1e3 if copy_tbs else None
        rec.update(
            traces=engine.trace_count,
            itl_ms={k: v * 1e3 for k, v in stats.itl.items()},
            decode_step_ms=float(np.median(gaps) * 1e3),
            decode_step_ms_p90=float(np.percentile(gaps, 90) * 1e3),
            ttft_s=stats.ttft,
            steps=stats.steps,
            weight_bytes_read=weight_bytes,
            kv_bytes_per_step=batch * kv,
            floor_ms=floor_ms,
            x_floor=float(np.median(gaps)) * 1e3 / floor_ms if floor_ms else None,
        )
        del engine, model
    except Exception:  # noqa: BLE001
        rec["error"] = traceback.format_exc()[-1500:]
    return rec


def _decode_quota(config, batch: int, tokens: int, chunk: int = 8192) -> int:
    """KV bytes for `batch` sequences of `tokens` (every KV layer's keys and values in bf16,
    sliding layers their window) plus one `chunk`-token prefill in the sliding layers, with a
    quarter to spare (sized to fit beside the weights on an 80 GB card)."""
    per_seq = prefill = 0
    for i, s in enumerate(config.layer_specs):
        if s.kv_source == i:
            token_bytes = 2 * s.num_kv_heads * s.head_dim * 2
            per_seq += token_bytes * (tokens if s.window is None else min(tokens, s.window))
            prefill += token_bytes * chunk if s.window is not None else 0
    return int((batch * per_seq + prefill) * 1.1) + (512 << 20)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="experiments/results/cold_start_h200.json")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--child", default=None)
    p.add_argument("--precompile", action="store_true")
    p.add_argument("--full-depth", action="store_true", help="--quick with the presets' depth")
    p.add_argument("--presets", default=",".join(PRESETS))
    p.add_argument(
        "--step-cache", default="both", choices=("both", "on", "off"), help="which process pairs"
    )
    p.add_argument("--decode", action="store_true", help="also the decode steps (DECODE_CASES)")
    p.add_argument(
        "--decode-presets", default=None, help="the presets of DECODE_CASES to run (default all)"
    )
    p.add_argument("--no-cold", action="store_true", help="skip the cold starts")
    p.add_argument("--both", action="store_true", help="cold start with and without precompile")
    p.add_argument(
        "--lowering", action="store_true", help="only the lowering with and without the step cache"
    )
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.quick, args.precompile, args.full_depth)))
        return
    if args.lowering:  # CPU: no device needed
        from experiments._meta import run_metadata

        res = run_metadata(presets=args.presets, lowering=True)
        res["records"] = [lowering_record(p) for p in filter(None, args.presets.split(","))]
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1, default=str)
        for r in res["records"]:
            for v in r["variants"]:
                print(
                    f"{r['preset']:<12} {'decode' if v['decode'] else 'prefill'} "
                    f"{v['num_tokens']:>5} tokens: trace+lower {v['plain_s']:5.2f} s, with the "
                    f"step cache {v['cached_s']:5.2f} s (export once {v['export_s']:5.2f} s, "
                    f"{v['serialized_bytes'] / 2**20:.1f} MiB, Mosaic kernels "
                    f"{v['mosaic_kernels_plain']} / {v['mosaic_kernels_cached']})"
                )
        return
    copy = None
    if not args.quick:
        from experiments.bench_generate import torch_ceilings

        _, copy = torch_ceilings()
    from experiments._meta import run_metadata

    res = run_metadata(
        quick=args.quick, full_depth=args.full_depth, presets=args.presets, copy_tbs=copy
    )
    res["records"] = []
    presets = [] if args.no_cold else list(filter(None, args.presets.split(",")))
    for preset in presets:
        for pre in (False, True) if args.both else (args.precompile,):
            res["records"].append(
                cold_start(preset, args.quick, pre, args.full_depth, args.step_cache)
            )
            with open(args.out, "w") as f:
                json.dump(res, f, indent=1, default=str)
    if args.decode:
        wanted = args.decode_presets.split(",") if args.decode_presets else None
        cases = [c for c in DECODE_CASES if wanted is None or c[0] in wanted]
        # the default engine's decode steps; for Gemma 3 4B also the model built unrolled
        # (one Block per layer, no stacks)
        runs = [(*c, True) for c in cases]
        runs += [(*c, False) for c in cases if c[0] == "gemma3_4b"]
        for preset, batch, context, chunk, scan_layers in runs:
            rec = decode_record(args.quick, copy, preset, batch, context, chunk, scan_layers)
            res["records"].append(rec)
            with open(args.out, "w") as f:
                json.dump(res, f, indent=1, default=str)
        steps = {
            r["scan_layers"]: r.get("decode_step_ms")
            for r in res["records"]
            if r["kind"] == "decode_step" and r["preset"] == "gemma3_4b"
        }
        if steps.get(True) and steps.get(False):
            res["decode_scan_over_unrolled"] = steps[True] / steps[False]
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1, default=str)
    for r in res["records"]:
        if r["kind"] == "cold_start":
            print(
                f"{r['preset']:<12} precompile={r['precompile']!s:<5} cold "
                f"{r.get('cold_s', float('nan')):6.1f} s  warm cache "
                f"{r.get('warm_cache_s', float('nan')):6.1f} s  (step cache off: cold "
                f"{r.get('cold_no_step_cache_s', float('nan')):6.1f} s, warm "
                f"{r.get('warm_compilation_cache_only_s', float('nan')):6.1f} s) "
                + " ".join(v[-200:] for k, v in r.items() if k.endswith("_error"))
            )
        else:
            print(
                f"decode {r['preset']:<15} {r['batch']:>3} rows "
                f"scan_layers={r['scan_layers']!s:<5} "
                f"step {r.get('decode_step_ms')} ms, floor {r.get('floor_ms')} ms, x floor "
                f"{r.get('x_floor')} {r.get('error', '')[-300:]}"
            )
    if "decode_scan_over_unrolled" in res:
        print(f"decode step, scan / unrolled: {res['decode_scan_over_unrolled']:.3f}")


if __name__ == "__main__":
    main()
