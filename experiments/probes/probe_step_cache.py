"""The step cache on the GPU: three fresh processes on one cache directory.

    SWAJAX_GIT_COMMIT=... PYTHONPATH=. python3 experiments/probes/probe_step_cache.py \
        --out $OUT/s.json

A small preset (`gemma.configs.small_preset`, the real attention geometry) through
`Engine(implementation="pallas")`, 4 prompts of 300 tokens, 8 new tokens, greedy: (1) the
step cache off (`SWAJAX_STEP_CACHE=0`, the plain jit path), (2) on with empty caches (exports
and stores the steps), (3) on again (loads them). Recorded per process: the tokens, the step
traces, engine construction to first token, whether the pool roots kept their buffers (updated
in place), whether `flatbuffers` (needed by `jax.export` serialization) is importable, and the
files in the step cache. The tokens of (2) and (3) must equal (1)'s; (3) must trace nothing.
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


def child(preset: str, implementation: str) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    import gemma
    import swajax
    from swajax import _step_cache

    try:
        import flatbuffers  # noqa: F401

        has_flatbuffers = True
    except ImportError:
        has_flatbuffers = False
    config = gemma.configs.small_preset(preset)
    model = gemma.Transformer(
        config, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16
    )
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, config.vocab_size, 300).tolist() for _ in range(4)]
    t0 = time.perf_counter()
    engine = swajax.Engine(
        model,
        swajax.KVCacheConfig(page_size=32, dtype=jnp.bfloat16, max_gpu_total_bytes=256 << 20),
        max_context=1024,
        max_batch=4,
        max_num_tokens=1024,
        implementation=implementation,
    )
    pools = [p.unsafe_buffer_pointer() for p in engine.state.pools]
    first = []
    out, _ = engine.run(prompts, 8, callback=lambda i, o: first.append(time.perf_counter()))
    directory = _step_cache.cache_dir()
    return dict(
        tokens=out,
        traces=engine.trace_count,
        first_token_s=first[0] - t0,
        pools_in_place=[p.unsafe_buffer_pointer() for p in engine.state.pools] == pools,
        flatbuffers=has_flatbuffers,
        step_cache_dir=str(directory),
        step_cache_files=sorted(os.listdir(directory)) if directory and directory.exists() else [],
        jax_cache=jax.config.jax_compilation_cache_dir,
    )


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="gemma4_e2b")
    p.add_argument("--child", action="store_true")
    p.add_argument("--implementation", default="pallas", help="reference: a CPU smoke run")
    p.add_argument("--out", default="/tmp/probe_step_cache.json")
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.preset, args.implementation)))
        return
    from experiments._meta import run_metadata

    res = run_metadata(preset=args.preset, implementation=args.implementation)
    res["records"] = []
    with tempfile.TemporaryDirectory() as cache:
        for label, step_cache in (("plain", "0"), ("cold", "1"), ("warm", "1")):
            env = dict(
                os.environ,
                SWAJAX_COMPILATION_CACHE="1",
                SWAJAX_COMPILATION_CACHE_DIR=cache,
                SWAJAX_STEP_CACHE=step_cache,
            )
            env.pop("JAX_COMPILATION_CACHE_DIR", None)
            env.pop("SWAJAX_STEP_CACHE_DIR", None)
            cmd = [sys.executable, __file__, "--child", "--preset", args.preset]
            cmd += ["--implementation", args.implementation]
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            rec = dict(label=label, step_cache=step_cache == "1")
            try:
                rec.update(json.loads(proc.stdout.strip().splitlines()[-1]))
            except (IndexError, json.JSONDecodeError):
                rec["error"] = proc.stderr[-2000:]
            rec["process_s"] = time.perf_counter() - t0
            rec["warnings"] = [ln for ln in proc.stderr.splitlines() if "step cache" in ln][:5]
            res["records"].append(rec)
            with open(args.out, "w") as f:
                json.dump(res, f, indent=1, default=str)
            print(
                label,
                {
                    k: rec.get(k)
                    for k in ("traces", "first_token_s", "pools_in_place", "flatbuffers")
                },
                len(rec.get("step_cache_files", [])),
                rec.get("warnings"),
                rec.get("error", "")[-300:],
                flush=True,
            )
    recs = {r["label"]: r for r in res["records"]}
    if all("tokens" in r for r in recs.values()):
        res["same_tokens"] = (
            recs["plain"]["tokens"] == recs["cold"]["tokens"] == recs["warm"]["tokens"]
        )
        print("same tokens:", res["same_tokens"])
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1, default=str)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
