"""Every preset at full size generating through the Pallas kernels, on the H200.

    SWAJAX_GIT_COMMIT=... PYTHONPATH=. python3 experiments/bench_presets.py --out $OUT/p.json
    PYTHONPATH=. .venv/bin/python experiments/bench_presets.py --quick --out /tmp/p.json

Per preset (random bf16 weights, bf16 KV, page 32, scratch reuse by policy, the scheduler's
default budget; one fresh process each, so a failure or an out-of-memory stays with its
preset): 16 prompts x (2048 + 64) tokens, greedy. `cold_start_s`: engine construction to the
end of the first run (compiles included, the persistent cache as the environment sets it);
`tokens_per_s`: total tokens (prompt + generated) per second of a second, warm run of the
same batch; `ok`: both runs finished and gave the same tokens. One record per preset:
`preset`, `ok`, `tokens_per_s`, `cold_start_s`, `error` if any.
"""

# %%
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback


def one(preset: str, quick: bool, prompts: int, input_len: int, output_len: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    import gemma
    import swajax

    rec = dict(preset=preset, ok=False, prompts=prompts, input=input_len, output=output_len)
    try:
        config = gemma.configs.small_preset(preset) if quick else gemma.configs.preset(preset)
        t0 = time.perf_counter()
        model = gemma.Transformer(
            config, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16
        )
        jax.block_until_ready(nnx.state(model))
        rec["init_s"] = time.perf_counter() - t0
        rec["weight_bytes"] = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model)))
        rng = np.random.default_rng(0)
        batch = [rng.integers(1, config.vocab_size, input_len).tolist() for _ in range(prompts)]
        t0 = time.perf_counter()
        engine = swajax.Engine(
            model,
            swajax.KVCacheConfig(page_size=32, dtype=jnp.bfloat16),
            max_context=input_len + output_len,
            max_batch=prompts,
            implementation="reference" if quick else "pallas",
            max_num_tokens=256 if quick else None,
        )
        cold, _ = engine.run(batch, output_len)
        rec["cold_start_s"] = time.perf_counter() - t0
        warm, stats = engine.run(batch, output_len)
        rec.update(
            tokens_per_s=prompts * (input_len + output_len) / stats.seconds,
            output_tokens_per_s=prompts * output_len / stats.seconds,
            seconds=stats.seconds,
            steps=stats.steps,
            traces=engine.trace_count,
            scratch=engine.layout.scratch,
            kv_pool_bytes=engine.layout.pool_bytes(),
            itl_ms_p50=stats.itl["p50"] * 1e3,
            ttft_s_p50=stats.ttft["p50"],
            same_tokens_cold_warm=cold == warm,
            ok=cold == warm and all(len(o) == output_len for o in warm),
        )
    except Exception:  # noqa: BLE001
        rec["error"] = traceback.format_exc()[-2000:]
    return rec


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="experiments/results/presets_h200.json")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--presets", default=None, help="comma-separated (default: all ten)")
    p.add_argument("--child", default=None)
    p.add_argument("--timeout", type=float, default=600)
    args = p.parse_args()
    shape = (2, 40, 4) if args.quick else (16, 2048, 64)
    if args.child:
        print(json.dumps(one(args.child, args.quick, *shape)))
        return
    import gemma
    from experiments._meta import run_metadata

    names = args.presets.split(",") if args.presets else list(gemma.configs.PRESET_NAMES)
    res = run_metadata(prompts=shape[0], input=shape[1], output=shape[2], quick=args.quick)
    res["records"] = []
    for name in names:
        cmd = [sys.executable, __file__, "--child", name] + (["--quick"] if args.quick else [])
        t0 = time.perf_counter()
        try:
            out = subprocess.run(
                cmd, capture_output=True, text=True, timeout=args.timeout, env=dict(os.environ)
            )
            lines = out.stdout.strip().splitlines()
            if out.returncode or not lines:
                rec = dict(preset=name, ok=False, error=out.stderr[-2000:])
            else:
                rec = json.loads(lines[-1])
        except subprocess.TimeoutExpired:
            rec = dict(preset=name, ok=False, error=f"timed out after {args.timeout} s")
        rec["process_s"] = time.perf_counter() - t0
        res["records"].append(rec)
        print(
            f"{name:<16} ok={rec['ok']!s:<5} {rec.get('tokens_per_s', float('nan')):10.0f} tok/s "
            f"cold {rec.get('cold_start_s', float('nan')):6.1f} s "
            f"{str(rec.get('error', ''))[-160:]}",
            flush=True,
        )
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1, default=str)


if __name__ == "__main__":
    main()
