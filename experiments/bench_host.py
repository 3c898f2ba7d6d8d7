"""Host time per decode step: what the engine's Python does around each device step.

    PYTHONPATH=. .venv/bin/python experiments/bench_host.py            # CPU, no model
    PYTHONPATH=. .venv/bin/python experiments/bench_host.py --rows 1,8,24 --presets gemma4_e2b

A decode step is host-bound when this time exceeds the device's (a small model's decode step
takes well under a millisecond on an H200), and scratch ON only pays where its extra rows do
not cost more host time than they save. This measures the host's share without a model: the
engine's `Scheduler` and `SlotLedger` at a preset's full-size layout (the reproduction's
pinned_8k split, `experiments/swa_scratch_throughput.py`, with room for every row), `rows`
requests of `--input` prompt tokens prefilled, then `--steps` decode steps, each timed through
the three host stages of `Engine.step`: `schedule` (plan and ledger), `step_inputs` (the
step's NumPy inputs) and `update_from_output` (the tokens read back). The jit dispatch and
the device are not included.

Writes experiments/results/host_step_cpu.json (device, versions, git commit, parameters;
`records`: preset, scratch, rows, median / p90 microseconds per decode step per stage, of the
fastest of `--repeats` runs).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
STAGES = ("schedule", "step_inputs", "update_from_output")


def layout_for(preset: str, scratch: bool, rows: int, input_len: int, steps: int):
    """The pinned_8k cell layout of the reproduction, with every group large enough for
    `rows` rows of input_len + steps tokens (the host's cost, not the pool, is measured)."""
    import swajax
    from experiments import swa_scratch_throughput as swa
    from swajax._layout import with_num_slots

    # 32 serving rows, as the reproduction serves; the context of one input_len + steps + 1
    # request, the layout the reproduction's `cell_layout` builds for it
    params = dataclasses.replace(swa.Params(), output_len=steps + 1)
    if not 1 <= rows <= params.rows:
        raise ValueError(f"rows must be in [1, {params.rows}], got {rows}")
    config = swa.model_config(preset, params)
    cap = swa.kv_cap_bytes(config, swa.Params())  # the reproduction's cap
    lay = swa.cell_layout(config, params, "pinned_8k", scratch, cap, [(1,) * input_len])
    need = swajax.pool.request_slots(lay, input_len, max_new_tokens=steps)
    room = [max(g.num_slots, rows * k + 64) for g, k in zip(lay.groups, need, strict=True)]
    return with_num_slots(lay, room), params


def measure(preset: str, scratch: bool, rows: int, input_len: int, steps: int) -> dict:
    from swajax._ledger import SlotLedger
    from swajax._runner import step_inputs
    from swajax._sampling import SamplingParams, request_key_data
    from swajax._scheduler import Request, Scheduler, default_headroom

    lay, params = layout_for(preset, scratch, rows, input_len, steps)
    sched = Scheduler(
        SlotLedger(lay),
        max_num_tokens=params.max_num_tokens,
        chunk=lay.max_chunk,
        headroom=default_headroom([g.num_slots for g in lay.groups], params.admission_headroom),
        mixed_steps=False,
    )
    for i in range(rows):
        sched.add(
            Request(
                id=i,
                prompt=(1,) * input_len,
                max_new_tokens=steps + 1,
                sampling=SamplingParams(),
                key_data=request_key_data(0, i),
            )
        )
    times = {s: [] for s in STAGES}
    tokens = np.ones(params.rows, np.int32)
    decode = []  # (rows, seconds per stage) of every decode step
    while sched.has_work:
        t0 = time.perf_counter()
        plan = sched.schedule()
        t1 = time.perf_counter()
        if plan is None:
            continue
        step_inputs(
            plan,
            num_tokens=-(-params.rows // 8) * 8 if plan.decode_only else params.max_num_tokens,
            layout=lay,
            max_cache_ops=4,
            sampling=lambda r: r.sampling.row_values(),
        )
        t2 = time.perf_counter()
        sched.update_from_output(plan, tokens)
        t3 = time.perf_counter()
        if plan.decode_only:
            decode.append((len(plan.new_tokens), (t1 - t0, t2 - t1, t3 - t2)))
    # the steps at the most decode rows at once (rows, or one fewer: the last admission's
    # prefill step can come after the first row's last decode step)
    most = max(n for n, _ in decode)
    for n, dts in decode:
        if n == most:
            for s, dt in zip(STAGES, dts, strict=True):
                times[s].append(dt * 1e6)
    total = np.sum([times[s] for s in STAGES], axis=0)
    return dict(
        preset=preset,
        scratch=scratch,
        rows=most,
        decode_steps=len(total),
        groups=[g.window for g in lay.groups],
        us_median={s: float(np.median(times[s])) for s in STAGES}
        | {"total": float(np.median(total))},
        us_p90={s: float(np.percentile(times[s], 90)) for s in STAGES}
        | {"total": float(np.percentile(total, 90))},
    )


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--presets", default="gemma4_e2b,gemma3_270m")
    p.add_argument("--rows", default="1,8,24")
    p.add_argument("--input", type=int, default=8192, help="prompt tokens per request")
    p.add_argument("--steps", type=int, default=256, help="decode steps per request")
    p.add_argument("--repeats", type=int, default=3, help="runs per cell; the fastest is kept")
    p.add_argument("--out", type=pathlib.Path, default=RESULTS / "host_step_cpu.json")
    args = p.parse_args(argv)
    from experiments._meta import run_metadata

    presets = args.presets.split(",")
    rows = [int(r) for r in args.rows.split(",")]
    meta = run_metadata(
        presets=presets, rows=rows, input=args.input, steps=args.steps, repeats=args.repeats
    )
    records = []
    print(
        f"{'preset':<14} {'scratch':<7} {'rows':>4}  "
        + "  ".join(f"{s:>11}" for s in STAGES)
        + "  total (median us per decode step)"
    )
    for preset in presets:
        for scratch in (False, True):
            for r in rows:
                # the quietest of the repeats (shared machines add noise, never remove it)
                runs = [
                    measure(preset, scratch, r, args.input, args.steps) for _ in range(args.repeats)
                ]
                rec = min(runs, key=lambda x: x["us_median"]["total"])
                rec["repeats"] = args.repeats
                records.append(rec)
                m = rec["us_median"]
                print(
                    f"{preset:<14} {scratch!s:<7} {rec['rows']:>4}  "
                    + "  ".join(f"{m[s]:>11.1f}" for s in STAGES)
                    + f"  {m['total']:>8.1f}",
                    flush=True,
                )
    res = dict(
        description="Host time per decode step of the engine's scheduler, ledger and step "
        "inputs at full-size preset layouts, no model (experiments/bench_host.py).",
        **meta,
        records=records,
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {args.out}")
    return res


if __name__ == "__main__":
    main()
