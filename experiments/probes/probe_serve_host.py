"""The host's Python per step in a serving-shaped run: requests arriving one by one as others
finish (the server's steady state), prefix caching on or off, the pool filling with cached
blocks. cProfile of `Engine.step` calls with the tiny model on the CPU: the device's share
(XLA calls) is left out by name, so what remains is the scheduler, the ledger, the prefix
cache, the step inputs and the outputs, per step and as the cache grows.

    PYTHONPATH=. .venv/bin/python experiments/probes/probe_serve_host.py \
        --out experiments/results/serve_host_cpu.json
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import sys
import time

sys.path.insert(0, os.getcwd())

# Host-only Python of a step (no device call inside): planning, the step's NumPy inputs,
# the outputs, and the prefix cache's eviction order.
HOST = {
    ("_replicas.py", "schedule"): "schedule",
    ("_runner.py", "step_inputs"): "step_inputs",
    ("_engine.py", "_postprocess"): "postprocess",
    ("_prefix_cache.py", "victim"): "victim (in schedule)",
}


def run(prefix: bool, args, eviction: str = "heap") -> dict:
    import jax.numpy as jnp
    import numpy as np

    import gemma
    import swajax

    model = gemma.from_pretrained(os.path.join(os.path.dirname(__file__), "..", "tiny_model"))
    engine = swajax.Engine(
        model,
        swajax.KVCacheConfig(
            page_size=16, dtype=jnp.float32, max_gpu_total_bytes=args.kv_mib << 20
        ),
        max_context=args.input + args.output,
        max_batch=args.rows,
        implementation="reference",
        enable_prefix_caching=prefix,
    )
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size

    def prompt():
        return rng.integers(1, vocab, args.input).tolist()

    # warm: every step shape compiled
    engine.run([prompt() for _ in range(args.rows)], args.output)
    for _ in range(args.rows):
        engine.add_request(prompt(), args.output)
    steps, added, wall = 0, 0, []
    prof = cProfile.Profile()
    while added < args.requests:
        t0 = time.perf_counter()
        prof.enable()
        outs = engine.step()
        prof.disable()
        wall.append(time.perf_counter() - t0)
        steps += 1
        for o in outs:
            if o.finished:
                engine.add_request(prompt(), args.output)
                added += 1
    while engine.has_unfinished_requests:
        engine.step()
    stats = pstats.Stats(prof)
    host = dict.fromkeys(HOST.values(), 0.0)
    for k, v in stats.stats.items():
        name = HOST.get((os.path.basename(k[0]), k[2]))
        if name is not None:
            host[name] += v[3]
    total = sum(wall)
    top = sorted(
        ((v[3], f"{os.path.basename(k[0])}:{k[1]}:{k[2]}") for k, v in stats.stats.items()),
        reverse=True,
    )[:25]
    ledger = engine.ledger
    return dict(
        prefix_caching=prefix,
        eviction=eviction if prefix else None,
        steps=steps,
        wall_s=total,
        us_per_step=1e6 * total / steps,
        host_us_per_step={k: 1e6 * v / steps for k, v in host.items()},
        host_python_us_per_step=1e6 * sum(v for k, v in host.items() if "victim" not in k) / steps,
        slots_held_after=list(ledger.used()),
        num_slots=list(ledger.num_slots),
        cached_nodes=len(engine.replicas.schedulers[0].cache or ()),
        top_cumulative=[dict(seconds=t, function=f) for t, f in top],
    )


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--input", type=int, default=96)
    p.add_argument("--output", type=int, default=32)
    p.add_argument("--requests", type=int, default=64, help="arrivals after the warm batch")
    p.add_argument(
        "--kv-mib",
        type=int,
        default=64,
        help="KV quota (the pool is also bounded by what --rows rows can hold)",
    )
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    import jax

    from experiments._meta import run_metadata

    res = run_metadata(**vars(args))
    res["records"] = []
    from swajax._prefix_cache import PrefixCache

    heap = PrefixCache.victim
    for prefix, eviction in ((False, "heap"), (True, "heap"), (True, "scan")):
        # "scan": the eviction order of a29fe47..d9155ab, every node scanned per victim
        PrefixCache.victim = PrefixCache.victim_by_scan if eviction == "scan" else heap
        rec = run(prefix, args, eviction)
        res["records"].append(rec)
        print(
            f"prefix caching {prefix!s:5} ({eviction}): {rec['us_per_step']:.0f} us / step, "
            f"host Python {rec['host_python_us_per_step']:.0f} us "
            f"({', '.join(f'{k} {v:.0f}' for k, v in rec['host_us_per_step'].items())}), "
            f"{rec['cached_nodes']} cached nodes",
            flush=True,
        )
    PrefixCache.victim = heap
    res["device"] = jax.devices()[0].device_kind
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
