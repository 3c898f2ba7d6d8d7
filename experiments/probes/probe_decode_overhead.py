"""Where a small decode step's time goes: inter-token latency of a few rows, the device's busy
time against the run's wall time, and the kernels launched per step, for one engine
configuration. Written against the `Engine(model, kv, ...)` constructor that every commit since
the text API has, so that the same file runs in an older tree (tools/repro_tree.sh) for an A/B:

    python3 experiments/probes/probe_decode_overhead.py --preset gemma3_1b --rows 4 \
        --engine '{"enable_prefix_caching": false}' --out $OUT/decode_overhead.json

The JSON records the git commit of the tree it ran in (SWAJAX_GIT_COMMIT)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.getcwd())


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="gemma3_1b")
    p.add_argument("--rows", default="1,4,16", help="comma-separated batch sizes")
    p.add_argument("--input", type=int, default=256)
    p.add_argument("--output", type=int, default=128)
    p.add_argument("--engine", default="{}", help="more Engine keyword arguments, as JSON")
    p.add_argument("--quick", action="store_true", help="a shrunk preset, reference kernels")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    import gemma
    import swajax
    from experiments._profile import device_kernel_times, top_kernels

    config = (gemma.configs.small_preset if args.quick else gemma.configs.preset)(args.preset)
    model = gemma.Transformer(
        config, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16
    )
    extra = json.loads(args.engine)
    out = dict(
        probe="decode_overhead",
        device=jax.devices()[0].device_kind,
        versions=dict(jax=jax.__version__, python=platform.python_version()),
        git_commit=os.environ.get("SWAJAX_GIT_COMMIT", "unknown"),
        argv=sys.argv[1:],
        preset=args.preset,
        engine_kwargs=extra,
        records=[],
    )
    rng = np.random.default_rng(0)
    for rows in [int(r) for r in args.rows.split(",")]:
        prompts = [rng.integers(1, config.vocab_size, args.input).tolist() for _ in range(rows)]
        kv = swajax.KVCacheConfig(page_size=16 if args.quick else 32, dtype=jnp.bfloat16)
        engine = swajax.Engine(
            model,
            kv,
            max_context=args.input + args.output,
            max_batch=rows,
            implementation="reference" if args.quick else "pallas",
            **extra,
        )
        engine.run(prompts, args.output)  # compile
        engine.run(prompts, args.output)
        _, stats = engine.run(prompts, args.output)
        holder = {}

        def call(engine=engine, prompts=prompts, holder=holder):
            t0 = time.perf_counter()
            res = engine.run(prompts, args.output)
            holder["wall"], holder["steps"] = time.perf_counter() - t0, res[1].steps
            return res[0]

        times = device_kernel_times(call, iters=1)
        launches = sum(k["count"] for k in times["kernels"].values())
        rec = dict(
            rows=rows,
            itl_s=stats.itl,
            ttft_s=stats.ttft,
            seconds=stats.seconds,
            steps=stats.steps,
            profiled_wall_s=holder["wall"],
            device_busy_s=times["busy_us"] / 1e6,
            busy_share=times["busy_us"] / 1e6 / holder["wall"],
            kernel_launches=launches,
            launches_per_step=launches / max(holder["steps"], 1),
            top_kernels=top_kernels(times, 25),
        )
        out["records"].append(rec)
        print(
            f"rows {rows}: ITL p50 {1e3 * stats.itl['p50']:.2f} ms, steps {stats.steps}, "
            f"busy {rec['busy_share']:.0%} of {holder['wall']:.2f} s, "
            f"{rec['launches_per_step']:.0f} launches / step",
            flush=True,
        )
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1, default=str)
        del engine


if __name__ == "__main__":
    main()
