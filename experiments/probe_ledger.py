"""Host ledger vs device pool, step by step, for a full-size preset on the GPU.

    PYTHONPATH=. python3 experiments/probe_ledger.py --preset gemma4_31b \
        --variants pallas,ref-kv_write,ref-gather,ref-attention,reference --out $OUT/l.json

Runs `bench_presets`' workload (random bf16 weights, 16 x (2048 + 8), page 32, default quota)
one engine step at a time. Before each step the pool's control arrays (free stacks and counts,
refcounts, tables, history/cap, scratch ranges) are copied; after it, the slots the device
holds are compared with the ledger's. At the first disagreement the copied arrays go through
the pool transforms alone (free -> shares -> reserve, jitted on the same device) to tell a
fault of the transforms from a fault elsewhere in the step (a kernel writing out of bounds
into the control arrays), and the control arrays are checked for consistency (each free stack
holds distinct in-range slots; refcounts match the tables). Variants, each in its own process:
"pallas", "reference", and "ref-<kernel>" (the Pallas path with one kernel, kv_write, gather
or attention, replaced by its reference) to find the step's faulty part; a suffix ":N" cuts
the preset to its first N layers (full width), a suffix "@G" caps the KV quota at G GiB
(`max_gpu_total_bytes`; e.g. "pallas@20", "pallas:24@20"), a suffix "+remat" compiles the
steps with XLA's rematerialization pass (`swajax._runner.STEP_COMPILER_OPTIONS` turns it off)
and `--slop P` sets XLA's memory-limit slop factor (P % of its limit; 0 makes every program
exceed it, so rematerialization runs at any size). One record each.
"""

# %%
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import subprocess
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np


def control(state):
    """The pool state without its pool roots (small arrays), copied off the donated buffers."""
    return jax.tree.map(lambda x: np.asarray(x).copy(), dataclasses.replace(state, pools=()))


def consistency(layout, c) -> dict:
    """Checks of one control snapshot: free stacks, counts and refcounts."""
    out = {}
    for g, group in enumerate(layout.groups):
        n = int(c.free_count[g])
        free = np.asarray(c.free_stack[g])[:n]
        held = np.concatenate(
            [np.asarray(c.base_tables[g]).ravel(), np.asarray(c.scratch_slots[g]).ravel()]
        )
        held = held[held >= 0]
        ref = np.bincount(held, minlength=group.num_slots)[: group.num_slots]
        out[f"group{g}"] = dict(
            num_slots=group.num_slots,
            free_count=n,
            free_distinct=len(set(free.tolist())) == n,
            free_in_range=bool(np.all((free >= 0) & (free < group.num_slots))),
            held_slots=int(np.count_nonzero(ref)),
            refcount_matches_tables=bool(np.array_equal(ref, np.asarray(c.refcount[g]))),
            free_and_held_disjoint=not bool(np.any(ref[free[(free >= 0) & (free < len(ref))]])),
        )
    return out


def memory() -> dict:
    """The device allocator's limit, bytes in use and peak (GiB), where it reports them."""
    stats = jax.devices()[0].memory_stats() or {}
    keys = ("bytes_limit", "bytes_in_use", "peak_bytes_in_use", "largest_free_block_bytes")
    return {k: round(stats[k] / 2**30, 3) for k in keys if k in stats}


VARIANTS = ("pallas", "ref-kv_write", "ref-gather", "ref-attention", "reference")


def use_reference_for(kernel: str) -> None:
    """Routes one Pallas kernel of `implementation="pallas"` to its pure-jnp reference."""
    from pallas_kernels import _kv_write_kernel, page_table_gather, paged_attention
    from pallas_kernels.kv_write import kv_write_reference

    if kernel == "kv_write":

        def write(pool, table, k, v, q_starts, kv_lens, *, k_scale=None, v_scale=None):
            return kv_write_reference(
                pool, table, k, v, q_starts, kv_lens, k_scale=k_scale, v_scale=v_scale
            )

        _kv_write_kernel.kv_write_pallas = write
    elif kernel == "gather":

        def gather(base, kv_lens, srange, sslots, *, num_layers, page_size, out=None, **_):
            return page_table_gather.page_table_gather_reference(
                base, kv_lens, srange, sslots, num_layers=num_layers, page_size=page_size
            )

        page_table_gather.page_table_gather_pallas = gather
    elif kernel == "attention":
        paged_attention._dispatch = lambda impl, kernel, pf, rf, args, att, tuning: rf(*args, **att)
    else:
        raise ValueError(f"unknown kernel {kernel!r}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="gemma4_31b")
    p.add_argument(
        "--variants",
        default="pallas",
        help=f"comma-separated, each in a fresh process: {', '.join(VARIANTS)}",
    )
    p.add_argument("--child", default=None)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--input", type=int, default=2048)
    p.add_argument("--output", type=int, default=8)
    p.add_argument("--small", action="store_true", help="small_preset (a CPU smoke run)")
    p.add_argument("--dump-hlo", action="store_true", help="write the failing step's HLO")
    p.add_argument("--slop", type=int, default=None, help="xla_gpu_memory_limit_slop_factor")
    p.add_argument("--out", default="/tmp/probe_ledger.json")
    args = p.parse_args()
    from flax import nnx

    import gemma
    import swajax
    from experiments._meta import run_metadata
    from swajax._runner import bookkeeping_before
    from swajax._transforms import reserve

    if args.child is None:  # one process per variant (a fault must not leak into the next)
        res = run_metadata(**vars(args))
        res["records"] = []
        for variant in args.variants.split(","):
            if variant.split("+")[0].split("@")[0].split(":")[0] not in VARIANTS:
                raise ValueError(f"unknown variant {variant!r}; variants: {VARIANTS}")
            out = args.out + "." + variant.replace(":", "_").replace("@", "_q").replace("+", "_")
            cmd = [sys.executable, __file__, *sys.argv[1:], "--child", variant, "--out", out]
            # the variants patch kernels at run time: no step cache (its key cannot see that)
            env = dict(os.environ, SWAJAX_STEP_CACHE="0")
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
            try:
                with open(out) as f:
                    rec = json.load(f)
            except (OSError, json.JSONDecodeError):
                rec = dict(ok=False, traceback=proc.stderr[-3000:])
            rec["variant"] = variant
            res["records"].append(rec)
            brief = {k: rec.get(k) for k in ("error", "transforms_alone", "ledger_used")}
            print(f"{variant:<14} ok={rec.get('ok')} {brief}", flush=True)
            with open(args.out, "w") as f:
                json.dump(res, f, indent=1, default=str)
        return
    from swajax import _runner

    variant, _, remat = args.child.partition("+")  # "pallas+remat": XLA's remat pass on
    options = {} if remat == "remat" else dict(_runner.STEP_COMPILER_OPTIONS)
    if args.slop is not None:
        options["xla_gpu_memory_limit_slop_factor"] = args.slop
    _runner.STEP_COMPILER_OPTIONS = options
    variant, _, cap = variant.partition("@")  # "pallas@20": KV quota capped at 20 GiB
    variant, _, layers = variant.partition(":")  # "pallas:12": the preset cut to 12 layers
    implementation = "reference" if variant == "reference" else "pallas"
    if variant.startswith("ref-"):
        use_reference_for(variant[4:])
    rec = dict(ok=False, steps=[], compiler_options=options)
    try:
        configs = gemma.configs
        overrides = dict(num_layers=int(layers)) if layers else {}
        config = (configs.small_preset if args.small else configs.preset)(args.preset, **overrides)
        model = gemma.Transformer(
            config, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16
        )
        engine = swajax.Engine(
            model,
            swajax.KVCacheConfig(
                page_size=32,
                dtype=jnp.bfloat16,
                max_gpu_total_bytes=int(float(cap) * 2**30) if cap else None,
            ),
            max_context=args.input + args.output,
            max_batch=args.prompts,
            implementation=implementation,
        )
        layout = engine.layout
        rec["groups"] = [str(g) for g in layout.groups]
        rec["pool_shapes"] = [list(s.shape(layout.page_size)) for s in layout.pools]
        rec["quota"] = engine.quota
        rec["memory_after_engine"] = memory()
        # The engine reads a step after dispatching the next one: snapshots queue in order.
        snapshots = collections.deque()
        dispatch, collect = engine._dispatch, engine._collect

        def patched_dispatch(plans):
            snapshots.append(control(engine.state))
            return dispatch(plans)

        def patched_collect():
            if engine._in_flight is None:
                return collect()
            plans = engine._in_flight[0]
            before = snapshots.popleft()
            try:
                return collect()
            except RuntimeError as e:
                rec["error"] = str(e)
                rec["memory_at_fault"] = memory()
                rec["before"] = consistency(layout, before)
                rec["after"] = consistency(layout, control(engine.state))
                from swajax._runner import step_inputs

                inputs = step_inputs(
                    plans[0],
                    num_tokens=max(8, sum(plans[0].new_tokens.values())),
                    max_batch=layout.max_batch,
                    max_shares=engine.max_shares,
                    sampling=lambda r: (0.0, 0, 1.0),
                )

                @jax.jit
                def transforms(c):
                    state = dataclasses.replace(c, pools=())
                    ok, state = bookkeeping_before(
                        layout, state, inputs.free_a, inputs.shares_a, inputs.free_b
                    )
                    r, state = reserve(layout, state, inputs.new_tokens)
                    return ok & r, jnp.asarray(
                        [g.num_slots for g in layout.groups], jnp.int32
                    ) - state.free_count

                ok, used = transforms(jax.tree.map(jnp.asarray, before))
                rec["transforms_alone"] = dict(ok=bool(ok), used=[int(x) for x in used])
                rec["ledger_used"] = [int(x) for x in plans[0].used]
                rec["new_tokens"] = {int(k): int(v) for k, v in plans[0].new_tokens.items()}
                if args.dump_hlo:  # the failing step as XLA compiled it (buffer assignment)
                    num_tokens, decode, _, _ = engine._variant(plans)
                    compiled = engine.lower_step(num_tokens, decode=decode).compile()
                    text = compiled.as_text()
                    rec["remat_instructions"] = text.count(".remat")
                    with open(args.out + ".hlo.txt", "w") as f:
                        f.write(text)
                    rec["hlo"] = args.out + ".hlo.txt"
                raise

        engine._dispatch, engine._collect = patched_dispatch, patched_collect
        rng = np.random.default_rng(0)
        batch = [
            rng.integers(1, config.vocab_size, args.input).tolist() for _ in range(args.prompts)
        ]
        t0 = time.perf_counter()
        out, stats = engine.run(batch, args.output)
        rec.update(ok=True, seconds=time.perf_counter() - t0, steps=stats.step_slots)
        if args.dump_hlo:  # did XLA rematerialize anything in the steps that ran?
            rec["remat_instructions"] = {
                str(v[:2]): engine._lower(v[0], v[1], v[3], logits=v[2])
                .compile()
                .as_text()
                .count(".remat")
                for v in engine._ran
            }
    except Exception:  # noqa: BLE001
        rec["traceback"] = traceback.format_exc()[-3000:]
    with open(args.out, "w") as f:
        json.dump(rec, f, indent=1, default=str)


if __name__ == "__main__":
    main()
# %%
