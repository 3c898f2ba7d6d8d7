"""Does the bookkeeping step update the pool roots in place on the device?

    SWAJAX_GIT_COMMIT=... PYTHONPATH=. python3 experiments/probes/probe_donation.py \
        --out $OUT/donation.json

Per preset (the decode cases of `bench_cold_start.py`: full-size layouts, the same KV quota,
no model weights): the pool state of the layout, then `swajax._runner.bookkeeping_step` with
empty frees; recorded are the compiled step's memory analysis (argument, output, alias and
temp bytes), whether the input pool roots were donated (deleted after the call) and the
device's peak bytes in use before and after. A copy of a pool root shows as temp or output
bytes beyond the aliased ones and as a higher peak.
"""

# %%
from __future__ import annotations

import argparse
import json
import traceback


def record(preset: str, rows: int, context: int, chunk: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import gemma
    import swajax
    from experiments.bench_cold_start import _decode_quota
    from swajax import _budget, _runner
    from swajax._scheduler import StepPlan
    from swajax._state import init_state

    rec = dict(preset=preset, rows=rows, context=context, chunk=chunk)
    try:
        cfg = gemma.configs.preset(preset)
        quota = _decode_quota(cfg, rows, context + 96, chunk)
        kv = swajax.KVCacheConfig(page_size=32, dtype=jnp.bfloat16, max_gpu_total_bytes=quota)
        layout = _budget.make_layout(
            cfg.layer_specs, kv, max_context=context + 128, max_batch=rows, max_chunk=chunk
        )
        state = init_state(layout)
        inputs = _runner.step_inputs(
            StepPlan(0, {}, {}, {}),
            num_tokens=0,
            layout=layout,
            max_cache_ops=0,
            sampling=lambda r: (0.0, 0, 1.0),
        )
        args = (inputs.free_a, inputs.release, inputs.park_a, inputs.adopt, inputs.free_b)
        compiled = _runner.bookkeeping_step.lower(layout, state, *args).compile()
        m = compiled.memory_analysis()
        dev = jax.devices()[0]
        jax.block_until_ready(state)
        before = dev.memory_stats() or {}
        pools = list(state.pools)
        ok, state = _runner.bookkeeping_step(layout, state, *args)
        jax.block_until_ready(state)
        after = dev.memory_stats() or {}
        rec.update(
            pool_root_bytes=[int(p.nbytes) for p in pools],
            argument_bytes=m.argument_size_in_bytes,
            output_bytes=m.output_size_in_bytes,
            alias_bytes=m.alias_size_in_bytes,
            temp_bytes=m.temp_size_in_bytes,
            donated=[p.is_deleted() for p in pools],
            ok=bool(np.asarray(ok)),
            peak_before=before.get("peak_bytes_in_use"),
            peak_after=after.get("peak_bytes_in_use"),
            in_use_after=after.get("bytes_in_use"),
        )
        del state, pools
    except Exception:  # noqa: BLE001
        rec["error"] = traceback.format_exc()[-1500:]
    return rec


def main():
    from experiments.bench_cold_start import DECODE_CASES

    p = argparse.ArgumentParser()
    p.add_argument("--out", default="/tmp/probe_donation.json")
    args = p.parse_args()
    from experiments._meta import run_metadata

    res = run_metadata()
    res["records"] = []
    for preset, rows, context, chunk in DECODE_CASES:
        rec = record(preset, rows, context, chunk)
        res["records"].append(rec)
        print(json.dumps(rec))
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1, default=str)


if __name__ == "__main__":
    main()
