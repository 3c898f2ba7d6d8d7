"""Compiles ahead the pool layouts a reproduction cell with pool_ratio="online" will visit.

An online cell re-splits its pool while it runs; every split is a layout of its own whose
steps compile on first use. In `swa_scratch_throughput.py` the cell's untimed warm-up run
compiles them one after the other, inside the run: on an H100, Gemma 4 E2B's warm-up did not
end within 300 s (notes/reproduction.md v22). This script predicts the layouts with the
engine's own scheduler and policy on the host (the scheduler, the ledger, `OnlineRebalance`,
applied between steps as `Engine._rebalance` applies them) and compiles every one of them in
threads into the persistent compilation cache, where the cell's warm-up run then finds them.
A layout the prediction misses is still compiled by the warm-up run; the timed run is the
same either way.

It runs inside a tree of the reproduction (`tools/repro_tree.sh`), with that tree's modules,
so that what it compiles is that commit's program:

    cd .repro && PYTHONPATH=. python3 ../experiments/repro_online_layouts.py \\
        --presets gemma4_e2b --requests 24 [--out online_layouts.json]

Only the compilation cache changes: no cell is run or timed here.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import copy
import gc
import json
import os
import sys
import time


def predicted_layouts(engine, prompts, max_new_tokens: int) -> list:
    """The layouts a fresh pool_ratio="online" engine visits serving `prompts` (all added
    at once, `max_new_tokens` each, no stop token), its own first: the engine's scheduler
    (made as the engine makes its own) and policy on the host, in the engine's order: each step the
    policy observes the demand and may re-split (the step in flight is read first), then the
    next step is planned, and a step's tokens are read after the next one is dispatched."""
    from swajax._layout import with_num_slots
    from swajax._replicas import make_scheduler
    from swajax._scheduler import Request, default_headroom

    if engine.pool.online is None or len(engine.replicas.schedulers) != 1:
        raise ValueError("predicted_layouts needs an idle one-replica pool_ratio='online' engine")
    cfg = engine.config
    # (the pinned tree's scheduler took the serving rows and a count of prefix shares; the
    # current one a count of prefix-cache ops)
    if hasattr(engine.runner, "max_shares"):
        cache = dict(serving_rows=cfg.max_batch, max_shares=engine.runner.max_shares)
    else:
        cache = dict(max_cache_ops=engine.runner.max_cache_ops)
    sched = make_scheduler(  # as the engine makes its own (`Engine._new_replicas`)
        engine.layout,
        max_num_tokens=cfg.max_num_tokens,
        chunk=cfg.prefill_chunk_size,
        headroom=default_headroom(engine.num_slots, engine.pool.fraction),
        batch_invariant=cfg.batch_invariant,
        **cache,
    )
    policy = copy.deepcopy(engine.pool.online)
    if engine.replicas.has_work or policy.average is not None:
        raise ValueError("predicted_layouts needs an engine that has served nothing yet")
    for i, p in enumerate(prompts):
        sched.add(Request(id=i, prompt=tuple(p), max_new_tokens=max_new_tokens))
    visited, in_flight = [engine.layout], None

    def read(plan):
        sched.update_from_output(plan, dict.fromkeys(plan.samples, 0))

    while sched.has_work or in_flight is not None:
        if sched.has_work:
            demand, minimum, force = sched.slot_demand()
            layout = sched.ledger.layout
            policy.observe(layout, demand)
            slots = policy.propose(layout, minimum, force=force)
            if slots is not None:
                if in_flight is not None:
                    read(in_flight)
                    in_flight = None
                new = with_num_slots(layout, slots)
                sched.resize(new, default_headroom(slots, engine.pool.fraction))
                policy.resplit()
                if new not in visited:
                    visited.append(new)
        plan = sched.schedule()
        if plan is not None and plan.new_tokens:
            previous, in_flight = in_flight, plan
        else:  # bookkeeping only, or nothing: the step in flight is read
            if plan is None and in_flight is None and sched.has_work:
                raise RuntimeError("the scheduler planned nothing with requests queued")
            previous, in_flight = in_flight, None
        if previous is not None:
            read(previous)
    return visited


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--presets", default="gemma4_e2b")
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--out", default=None, help="a JSON of the predicted layouts and the times")
    p.add_argument("--dry-run", action="store_true", help="predict the layouts, compile nothing")
    args = p.parse_args(argv)

    import jax.numpy as jnp
    from flax import nnx

    import gemma
    from experiments import swa_scratch_throughput as sst
    from swajax._compilation_cache import enable_default_cache

    if not args.dry_run and not enable_default_cache():
        sys.exit("the persistent compilation cache is off: nothing to compile ahead into")
    _, params, presets, _ = sst.parse(
        ["--presets", args.presets, "--setups", "online", "--requests", str(args.requests)]
    )
    report = {"commit": os.environ.get("SWAJAX_GIT_COMMIT"), "presets": {}}
    for preset in presets:
        t0 = time.perf_counter()
        config = sst.model_config(preset, params)
        prompts = sst.make_prompts(config.vocab_size, params)
        cap = sst.kv_cap_bytes(config, params)
        dtype = jnp.dtype(params.weight_dtype)
        model = gemma.Transformer(config, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=dtype)
        gemma.set_unit_size_attention_logits(model)  # as the cells' model
        if params.experts_in_place_max_rows is not None:
            gemma.set_experts_in_place_max_rows(model, params.experts_in_place_max_rows)
        cells, futures = [], []
        with concurrent.futures.ThreadPoolExecutor(max_workers=args.workers) as pool:
            for scratch in (False, True):
                engine, _ = sst.cell_engine(model, config, params, "online", scratch, cap, prompts)
                layouts = predicted_layouts(engine, prompts, params.output_len)
                for layout in [] if args.dry_run else layouts:
                    if layout != engine.layout:
                        engine.runner.resize(layout)
                    for tokens, decode in engine.step_buckets():
                        lowered = engine.lower_step(tokens, decode=decode)
                        futures.append(pool.submit(lowered.compile))
                cells.append(
                    dict(scratch=scratch, splits=[[g.num_slots for g in x.groups] for x in layouts])
                )
                print(f"{preset} scratch={scratch}: {len(layouts)} layouts", flush=True)
                del engine
                gc.collect()
            for f in futures:
                f.result()
        seconds = time.perf_counter() - t0
        print(f"{preset}: compiled {len(futures)} step variants in {seconds:.0f} s", flush=True)
        report["presets"][preset] = dict(cells=cells, variants=len(futures), seconds=seconds)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
