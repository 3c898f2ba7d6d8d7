"""SWA scratch reuse under KV-memory pressure: generation throughput with scratch reuse ON vs OFF
for every Gemma 3 / Gemma 4 preset and three ways to split the KV quota across pool groups,
beside the published result (TensorRT-LLM, KV cache manager V2, B200).

    # H200, one model per invocation; records merge into the JSON by (preset, setup, scratch):
    SWAJAX_GIT_COMMIT=<sha> PYTHONPATH=. python3 experiments/swa_scratch_throughput.py \\
        --presets gemma4_e2b --out $OUT/swa_scratch_h200.json \\
        --merge experiments/results/swa_scratch_h200.json
    # predictions and time estimates only (scheduler + slot ledger on the host, no model):
    PYTHONPATH=. .venv/bin/python experiments/swa_scratch_throughput.py --simulate
    # the same script at tiny sizes on CPU (tests/test_experiments.py runs it):
    PYTHONPATH=. .venv/bin/python experiments/swa_scratch_throughput.py --quick --out /tmp/s.json

Workload per preset (`--requests`, `--input-mean`, `--output-len`, `--seed`): random bf16
weights (no download) with unit-size attention logits (`gemma.set_unit_size_attention_logits`:
raw random Gemma 4 weights give near one-hot softmaxes, under which ON and OFF, batching rows
differently, part after a few tokens); `requests` random prompts with lengths uniform in
[3/4, 5/4] x input_mean (6K-10K at the default 8K), each generating exactly `output_len` tokens
greedily (no stop tokens); bf16 KV, page 32, the engine's default token budget of 8192 tokens
per step (TensorRT-LLM's default max_num_tokens; prefill chunk = budget), Pallas kernels,
`--rows` serving rows (enough that the KV pool, not the rows, bounds concurrency), batch-invariant
steps (`Engine(batch_invariant=True)`: a step holds decode rows only or prefill rows only, at
one shape each, a prompt's chunks cut only at multiples of the prefill kernel's 128-row query
tile, so a request's greedy tokens do not depend on which other rows ON and OFF admit beside
it; `--mixed-steps` serves as the default engine does, decode rows riding in prefill steps).

KV cap, the same for every cell of a preset: `--cap-seqs` (8) x the steady-state KV bytes of one
sequence of input_mean + output_len tokens (after its prefill and decode: every token in full
layers, the window in sliding layers; the same with scratch ON and OFF).

Setups, each with scratch ON and OFF, the split derived in the cell's own scratch mode:
  cap_only   pool_ratio unset: the library's default split from the hints
             expected_input_length = `--default-isl` (2048: TensorRT-LLM's initial split assumes
             an average ISL of 2K) and expected_batch_size = the batch of such sequences the cap
             holds (`swajax.pool.fitted_batch`), each group raised to what the longest request needs
             alone (`swajax.pool.plan_num_slots`);
  pinned_8k  pool_ratio pinned to `swajax.pool.fitted_pool_ratio` for an expected ISL of input_mean
             (8K): the split at which a pool full of 8K sequences runs out of every group at once;
  adaptive   pool_ratio="adaptive": the engine splits the quota for the requests queued, no
             hints (`Engine.adapt_pool` before the precompile, so that the timed run compiles
             nothing);
  online     pool_ratio="online": the split follows the observed slot demand between steps
             (moving average, threshold, cooldown; the library's defaults, recorded in
             `split_from`), running requests kept: the rebalancing policy of TensorRT-LLM's KV
             manager V2 and SGLang's flexible pool, as their users run it. Each split it visits
             is a new layout, so the cell runs the workload once untimed on an engine of its
             own (compiling every layout the run visits; the policy is deterministic for a
             workload) and is timed on a second, fresh engine (`warmup_s`).
Each cell: an engine, every step shape compiled up front (`precompile`; layouts of equal slots
share their compiled steps, and the persistent compilation cache serves later invocations), then
one timed `Engine.run`. Recorded per cell: output and total tokens/s, steps, peak and mean slots
per group, max concurrent rows, preemptions, TTFT / inter-token latency, a digest of every
request's tokens (`same_tokens_as_off`: ON equals every OFF cell of the preset;
`first_token_agreement` and `mean_common_prefix` over each request's first 16 tokens),
the split and the ledger simulation's prediction (`predicted`), the re-splits in the run
(`resplits`), the host-observed time of prefill and decode steps (`prefill_s`, `decode_s`,
`prefill_share`) and the mean rows of a decode step (`mean_decode_rows`), whether the steps
came through the step cache (`step_cache`; `SWAJAX_STEP_CACHE=0` turns it off) and, with
`--profile N`, N of the cell's requests run once more under the profiler (`profile`: the
device's busy time against the wall time, the top kernels). An error in one cell is recorded
in it and the next cell runs. Where ON and OFF tokens differ, `divergences` (per OFF
setup compared): the first `--verify` differing requests recomputed alone at the position where
they part (prompt + common prefix, one engine of batch 1), with the two runs' tokens' logit gap
relative to the top logit; below `NEAR_TIE` the divergence is a near tie decided by the
rounding of differently batched steps.

Prediction (`--simulate`, and `predicted` in every record): the engine's own scheduler and
`SlotLedger` plan the whole workload on the host (no pipelining); each planned step costs
max(bytes / copy rate, FLOPs / matmul rate, the host's launch time per layer) at H200 rates and
efficiencies measured in earlier runs (`H200`), bytes and FLOPs from `bench_generate`
(weights, KV read per decode row, matmul FLOPs of the padded token bucket, attention FLOPs).

Writes the JSON (device, versions, git commit, every invocation's metadata, caps, the prompts'
seed, `records`, `comparison`) and a PNG beside it (per model: the ON vs OFF change per setup,
ours beside the published percentages), and prints both tables side by side.
"""

# %%
from __future__ import annotations

import argparse
import dataclasses
import gc
import hashlib
import json
import os
import pathlib
import sys
import time
import traceback

import numpy as np

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
PRESETS = (
    "gemma4_e2b",
    "gemma4_e4b",
    "gemma4_12b",
    "gemma4_26b_a4b",
    "gemma4_31b",
    "gemma3_270m",
    "gemma3_1b",
    "gemma3_4b",
    "gemma3_12b",
    "gemma3_27b",
)
SETUPS = ("cap_only", "pinned_8k", "adaptive", "online")
ENGINE_SPLITS = ("adaptive", "online")  # the engine sizes the split (no hints)
CONTROL = "control"  # a record of pinned_8k ON run again after the preset's other cells
SCRATCH = {s: (False, True) for s in SETUPS}
# Published ON vs OFF throughput change, % (TensorRT-LLM, KV cache manager V2, B200).
PUBLISHED = {
    "gemma4_e2b": {"cap_only": -0.1, "pinned_8k": 59.6},
    "gemma4_e4b": {"cap_only": -1.2, "pinned_8k": 37.9},
    "gemma4_12b": {"cap_only": 0.8, "pinned_8k": 8.6},
    "gemma4_26b_a4b": {"cap_only": -1.1, "pinned_8k": 11.3},
    "gemma4_31b": {"cap_only": -0.1, "pinned_8k": 6.9},
}
# H200 rates for the estimates: copy 4.05-4.24 TB/s and bf16 matmul 694 TFLOP/s measured
# (notes/kernels.md, results/archive/h200_baselines.json); one Gemma 3 4B decode step ran at
# 0.58 of its bytes floor (model_h200_v3.json); the prefill share and the compile time per step
# variant are assumptions.
# A step never takes less than the host needs to launch it: ~0.21 ms per layer, the
# least-squares slope through the inter-token latency p50 of the OFF cells of Gemma 3 270M /
# 1B and Gemma 4 E2B / E4B (4.1-9.6 ms at 18-42 layers; results/swa_scratch_h200.json, 876f573).
# With the weights read in place (unrolled then), a least-squares fit of the five Gemma 4 31B
# cells' times to their predicted decode and prefill seconds (22f1cca, NOTES v17) gives decode
# steps at 0.65 of the bytes floor and prefill steps at 0.92 of the matmul rate (then within
# 0.4 % of every cell); the layer scan's decode steps read every matrix in its stack since.
H200 = dict(
    copy_tbs=4.1,
    matmul_tflops=694.0,
    decode_efficiency=0.65,
    prefill_efficiency=0.92,
    host_ms_per_layer=0.21,
)
DEVICE_CALL_S = 600


@dataclasses.dataclass(frozen=True)
class Params:
    """Every parameter of a run (recorded in the JSON)."""

    requests: int = 64
    input_mean: int = 8192
    output_len: int = 256
    rows: int = 32
    cap_seqs: float = 8.0
    default_isl: int = 2048
    seed: int = 0
    page_size: int = 32
    max_num_tokens: int = 8192
    kv_dtype: str = "bfloat16"
    weight_dtype: str = "bfloat16"
    implementation: str = "pallas"
    # Admissions leave this share of each group free for the running rows' decode growth
    # (8 rows x 256 tokens = 64 full blocks, ~3 % of the full group at the default cap); the
    # engine's 1 % makes it preempt and recompute 8K prompts, which then dominates the timings.
    admission_headroom: float = 0.04
    compile_s: float = 45.0  # per step variant, for the time estimate
    cell_limit_s: float = 300.0  # a cell's timed run stops here (recorded as an error); 0: none
    verify: int = 16  # per ON/OFF pair, the differing requests whose divergence is checked
    # `Engine(batch_invariant=True)`: decode and prefill rows never share a step and every
    # prefill step has the full budget's shape, so a row's numbers (and greedy tokens) do not
    # depend on how many rows ON and OFF admit; decode rows wait behind prefill steps.
    batch_invariant: bool = True
    # `gemma.set_experts_in_place_max_rows`: up to how many token copies the MoE layers read
    # their experts in the stack (the tile kernel); None: the model's default
    # (`gemma._layers.EXPERTS_IN_PLACE_MAX_ROWS`); 0: every layer's experts copied out first
    # (JAX's `ragged_dot_mgpu` alone, the form before the tile kernel).
    experts_in_place_max_rows: int | None = None
    # After a cell's timed run, this many of its requests run once more under the profiler
    # (`bench_generate.profile_run`: the device's busy time against the wall time, top
    # kernels); 0: none. Not part of the workload.
    profile: int = 0
    # After a preset's cells, its pinned_8k ON cell runs once more (record setup "control"):
    # the same cell first and last, so that the cells' order shows in its time. Not part of
    # the workload.
    control: bool = False
    # With the persistent compilation cache on, every cell's step variants compile up front in
    # this many threads (`precompile_cells`), and each cell then reads them from the cache;
    # 0: each cell compiles its own (two variants at a time). Not part of the workload.
    precompile_workers: int = 8
    quick: bool = False

    @property
    def workload(self) -> dict:
        """What two cells must share to be compared."""
        keys = ("requests", "input_mean", "output_len", "rows", "cap_seqs", "seed", "page_size")
        keys += ("max_num_tokens", "admission_headroom")
        # (recorded only when set, so that records of runs before the option stay comparable)
        keys += ("batch_invariant",) if self.batch_invariant else ()
        keys += ("experts_in_place_max_rows",) if self.experts_in_place_max_rows is not None else ()
        workload = {k: getattr(self, k) for k in keys}
        # decode steps under the layer scan read every matrix in its stack (the stacked matmul;
        # earlier cells: "decode_weights_in_place" True, unrolled, or absent, the scan's copies)
        workload["decode_matrices"] = "in_stack"
        if self.batch_invariant:  # where the engine may cut a prompt's chunk (0: whole chunks)
            from pallas_kernels.paged_attention import PREFILL_QUERY_TILE

            workload["prefill_cut_align"] = PREFILL_QUERY_TILE
        return workload


QUICK = Params(
    requests=8,
    input_mean=192,
    output_len=8,
    rows=8,
    cap_seqs=4.0,
    default_isl=48,
    page_size=16,
    max_num_tokens=128,
    kv_dtype="float32",
    weight_dtype="float32",
    implementation="reference",
    compile_s=3.0,
    cell_limit_s=0.0,
    precompile_workers=2,
    quick=True,
)


# %% model and workload
def model_config(preset: str, params: Params):
    """The full-size preset, or (quick) a seven-layer model of its family: five sliding layers
    sharing one pool (so a chunk far longer than the 16-token window costs them much more
    without scratch), one full layer and, for presets with KV sharing, a shared sliding layer."""
    import gemma

    if not params.quick:
        return gemma.configs.preset(preset)
    tiny = dict(
        hidden_size=32,
        intermediate_size=64,
        vocab_size=128,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        sliding_window=16,
        max_context=512,
    )
    layer_types = ("sliding",) * 5 + ("full",)
    if preset.startswith("gemma4"):
        tiny["global_head_dim"] = 16
        if gemma.configs.preset(preset).num_kv_shared_layers:
            layer_types += ("sliding",)
            tiny["num_kv_shared_layers"] = 1
    return gemma.configs.small_preset(
        preset, num_layers=len(layer_types), layer_types=layer_types, **tiny
    )


def make_prompts(vocab_size: int, params: Params) -> list[list[int]]:
    """`requests` random prompts, lengths uniform in [3/4, 5/4] x input_mean (fixed seed)."""
    rng = np.random.default_rng(params.seed)
    lo, hi = params.input_mean * 3 // 4, params.input_mean * 5 // 4
    lengths = rng.integers(lo, hi + 1, size=params.requests)
    return [rng.integers(1, vocab_size, size=int(n)).tolist() for n in lengths]


def max_context(prompts, params: Params) -> int:
    return max(len(p) for p in prompts) + params.output_len


def base_kv_config(params: Params, scratch: bool, **kw):
    import swajax

    return swajax.KVCacheConfig(
        page_size=params.page_size, dtype=params.kv_dtype, enable_swa_scratch_reuse=scratch, **kw
    )


def kv_cap_bytes(config, params: Params) -> int:
    """`cap_seqs` x the steady-state KV bytes of one input_mean + output_len sequence."""
    import swajax

    steady = swajax.pool.kv_bytes_per_sequence(
        config.layer_specs,
        params.input_mean + params.output_len,
        params.max_num_tokens,
        "release",
        kv_cache_config=base_kv_config(params, False),
    ).steady
    return int(params.cap_seqs * steady)


def slot_free_layout(config, params: Params, scratch: bool, context: int):
    import swajax

    return swajax.pool.make_layout(
        config.layer_specs,
        base_kv_config(params, scratch),
        max_context=context,
        max_batch=params.rows,
        max_chunk=min(params.max_num_tokens, context),
        num_slots=1,
        scratch=scratch,
    )


def cell_kv_config(config, params: Params, setup: str, scratch: bool, cap: int, context: int):
    """(KVCacheConfig, what the split was derived from) of one cell."""
    import swajax

    lay = slot_free_layout(config, params, scratch, context)
    budget = params.max_num_tokens
    if setup == "cap_only":
        b = swajax.pool.fitted_batch(
            lay, params.default_isl, cap, chunk=budget, max_batch=params.rows
        )
        hints = dict(expected_input_length=params.default_isl, expected_batch_size=max(1, round(b)))
        return base_kv_config(params, scratch, max_gpu_total_bytes=cap, **hints), hints
    if setup == "pinned_8k":
        ratio = swajax.pool.fitted_pool_ratio(
            lay, params.input_mean, cap, chunk=budget, max_batch=params.rows
        )
        return base_kv_config(params, scratch, max_gpu_total_bytes=cap, pool_ratio=ratio), {
            "expected_input_length": params.input_mean,
            "pool_ratio": ratio,
        }
    if setup in ENGINE_SPLITS:
        kv = base_kv_config(params, scratch, max_gpu_total_bytes=cap, pool_ratio=setup)
        policy = {
            k: getattr(kv, k)
            for k in ("rebalance_ema", "rebalance_threshold", "rebalance_cooldown")
        }
        return kv, (policy if setup == "online" else {})
    raise ValueError(f"setup must be one of {SETUPS}, got {setup!r}")


def cell_online(params: Params, setup: str, cap: int):
    """The cell's `OnlineRebalance` policy (pool_ratio="online"), for the host simulation;
    None for the other setups."""
    from swajax._budget import OnlineRebalance

    if setup != "online":
        return None
    kv = base_kv_config(params, False, max_gpu_total_bytes=cap, pool_ratio="online")
    return OnlineRebalance(
        cap, ema=kv.rebalance_ema, threshold=kv.rebalance_threshold, cooldown=kv.rebalance_cooldown
    )


def cell_layout(config, params: Params, setup: str, scratch: bool, cap: int, prompts):
    """The layout a cell's engine starts the workload on (adaptive: the adaptive split applied;
    online: the default split, which the policy re-splits from its first step on, as the
    host simulation does)."""
    import swajax
    import swajax._layout

    context = max_context(prompts, params)
    kv, _ = cell_kv_config(config, params, setup, scratch, cap, context)
    lay = swajax.pool.make_layout(
        config.layer_specs,
        kv,
        max_context=context,
        max_batch=params.rows,
        max_chunk=min(params.max_num_tokens, context),
        scratch=scratch,
    )
    if setup == "adaptive":
        split = swajax.pool.adaptive_split(
            lay,
            [(len(p), params.output_len) for p in prompts],
            cap,
            chunk=params.max_num_tokens,
            max_batch=params.rows,
            headroom=params.admission_headroom,
        )
        lay = swajax._layout.with_num_slots(lay, split.num_slots)
    return lay


def _simulated_rebalance(online, sched, params: Params) -> int:
    """One step's `Engine._rebalance` on the host: the policy observes the scheduler's demand
    and a proposed split is applied to the scheduler (1), or not (0)."""
    from swajax._layout import with_num_slots
    from swajax._scheduler import default_headroom

    demand, minimum, force = sched.slot_demand()
    layout = sched.ledger.layout
    online.observe(layout, demand)
    slots = online.propose(layout, minimum, force=force)
    if slots is None:
        return 0
    sched.resize(with_num_slots(layout, slots), default_headroom(slots, params.admission_headroom))
    online.resplit()
    return 1


# %% prediction: the engine's scheduler on the host, steps costed at H200 rates
def weight_bytes(config, params: Params) -> int:
    """Parameter bytes read per step (the per-layer embedding table is looked up, not read)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import gemma

    dtype = jnp.dtype(params.weight_dtype)
    abstract = nnx.eval_shape(
        lambda: gemma.Transformer(config, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=dtype)
    )
    return sum(
        int(np.prod(x.shape)) * x.dtype.itemsize
        for path, x in jax.tree_util.tree_leaves_with_path(nnx.state(abstract, nnx.Param))
        if "per_layer_embedding" not in jax.tree_util.keystr(path)
    )


def simulate(config, layout, params: Params, prompts, weights: int, online=None) -> dict:
    """Plans the workload with the engine's `Scheduler` and `SlotLedger` (no device) and costs
    every step; returns steps, concurrency, preemptions, slots and the estimated seconds.

    `online`: a `swajax._budget.OnlineRebalance` (the cell's pool_ratio="online" policy),
    applied between steps as `Engine._rebalance` applies it; the re-splits and the distinct
    layouts they visit (each compiles its steps on first use) are counted."""
    import jax.numpy as jnp

    from experiments.bench_generate import attention_flops, kv_read_bytes, matmul_flops_per_token
    from swajax._replicas import make_scheduler
    from swajax._scheduler import Request, default_headroom
    from swajax.pool import request_slots

    num_slots = tuple(g.num_slots for g in layout.groups)
    sched = make_scheduler(
        layout,
        max_num_tokens=params.max_num_tokens,
        chunk=layout.max_chunk,
        headroom=default_headroom(num_slots, params.admission_headroom),
        batch_invariant=params.batch_invariant,
    )
    for i, p in enumerate(prompts):
        # what `Engine.check_fits` refuses (the scheduler would preempt it forever)
        need = request_slots(layout, len(p), max_new_tokens=params.output_len - 1)
        if any(n > have for n, have in zip(need, num_slots, strict=True)):
            raise ValueError(
                f"a request of {len(p)} prompt tokens + {params.output_len} new tokens needs "
                f"{list(need)} slots per pool group but the pool has {list(num_slots)}"
            )
        sched.add(Request(id=i, prompt=(0,) * len(p), max_new_tokens=params.output_len))
    per_token = matmul_flops_per_token(config)
    itemsize = jnp.dtype(params.kv_dtype).itemsize
    copy = H200["copy_tbs"] * 1e12 * H200["decode_efficiency"]
    matmul = H200["matmul_tflops"] * 1e12 * H200["prefill_efficiency"]
    decode_bucket = -(-params.rows // 8) * 8
    host_floor = H200["host_ms_per_layer"] * 1e-3 * len(config.layer_specs)
    steps = prefill_steps = resplits = 0
    seconds = prefill_seconds = 0.0
    concurrent, used = [], []
    splits = {num_slots}
    while sched.has_work:
        if online is not None:
            resplits += _simulated_rebalance(online, sched, params)
            splits.add(tuple(g.num_slots for g in sched.ledger.layout.groups))
        plan = sched.schedule()
        if plan is None:
            raise RuntimeError("the scheduler planned nothing with requests queued")
        if not plan.new_tokens:
            continue
        steps += 1
        nbytes, flops = weights, 0
        for row, n in plan.new_tokens.items():
            start = sched.rows[row].fed - n
            if n == 1:
                nbytes += kv_read_bytes(config, start, itemsize)
            else:
                flops += attention_flops(config, np.arange(start, start + n))
        if plan.decode_only:
            flops += decode_bucket * per_token
        else:
            prefill_steps += 1
            flops += params.max_num_tokens * per_token  # the step is padded to the budget
        t = max(nbytes / copy, flops / matmul, host_floor)
        seconds += t
        prefill_seconds += 0.0 if plan.decode_only else t
        concurrent.append(len(plan.new_tokens))
        used.append(plan.used)
        sched.update_from_output(plan, dict.fromkeys(plan.samples, 0))
    total = sum(len(p) for p in prompts) + params.requests * params.output_len
    return dict(
        steps=steps,
        prefill_steps=prefill_steps,
        max_concurrent=max(concurrent),
        mean_concurrent=float(np.mean(concurrent)),
        preemptions=sched.counters.preemptions,
        num_slots=list(num_slots),
        peak_slots=[int(x) for x in np.max(used, axis=0)],
        mean_slots=[float(x) for x in np.mean(used, axis=0)],
        resplits=resplits,
        layouts=len(splits),
        est_seconds=seconds,
        est_prefill_share=prefill_seconds / seconds,
        est_output_tokens_per_s=params.requests * params.output_len / seconds,
        est_total_tokens_per_s=total / seconds,
    )


def estimate(predicted: dict[tuple, dict], params: Params, weights: int, scale=1.0) -> dict:
    """Seconds of one preset's invocation: init + compiles (two step variants per distinct
    layout, compiled in threads: `precompile_cells`) + the predicted runs (each at most
    cell_limit_s), the runs scaled by `scale` (requests / simulated requests: steps grow with
    the requests)."""
    layouts = {(s, tuple(p["num_slots"])) for (_, s), p in predicted.items()}
    init = 5.0 + weights / 4e9
    variants = 2 * len(layouts)
    if params.precompile_workers > 0:  # all at once, then every cell's lowering, cache read
        # and warm-up (5 s). Measured on the H200 (NOTES v17, Gemma 4 31B): 6 variants in 62 s
        # and 4 in 33 s with 8 threads, 2 s per cell.
        compile_s = 1.2 * params.compile_s * -(-variants // params.precompile_workers)
        compile_s += 5.0 * len(predicted)
    else:  # each cell its own two variants, in two threads
        compile_s = 1.2 * params.compile_s * len(layouts)
    limit = params.cell_limit_s or float("inf")
    runs = sum(min(scale * p["est_seconds"], limit) for p in predicted.values())
    return dict(init_s=init, compile_s=compile_s, run_s=runs, total_s=init + compile_s + runs)


REQUEST_STEPS = (128, 96, 64, 48, 32, 24, 16)


def plan_calls(preset: str, predicted: dict, params: Params, weights: int, budget: float):
    """Device calls of at most `budget` seconds each for this preset: the most requests (of
    REQUEST_STEPS up to twice the simulated count; the same in every call, so that the cells
    compare) at which every setup fits one call, or cap_only one call and the others a second.
    Returns [(setups, requests, estimated seconds)]."""
    ok = {k: v for k, v in predicted.items() if "error" not in v}
    splits = [tuple(SETUPS)], [("cap_only", "pinned_8k"), ENGINE_SPLITS]
    for n in (n for n in REQUEST_STEPS if n <= 2 * params.requests):
        for split in splits:
            calls = []
            for setups in split:
                cells = {k: v for k, v in ok.items() if k[0] in setups}
                calls.append((setups, n, estimate(cells, params, weights, n / params.requests)))
            if all(est["total_s"] <= budget for _, _, est in calls):
                return [(setups, n, est["total_s"]) for setups, n, est in calls]
    return [(tuple(SETUPS), REQUEST_STEPS[-1], float("nan"))]


# %% one cell on the device
class CellLimit(RuntimeError):
    """A cell's run passed `cell_limit_s` (e.g. a preemption storm); carries its progress."""

    def __init__(self, limit: float, seconds: float, tokens: int):
        super().__init__(
            f"stopped at the cell limit of {limit:g} s: {tokens} output tokens in {seconds:.1f} s"
        )
        self.seconds, self.tokens = seconds, tokens


HEAD_TOKENS = 16  # first tokens of each request kept in the record (ON vs OFF agreement)


def digests(outputs) -> list[str]:
    return [hashlib.sha256(np.asarray(o, np.int64).tobytes()).hexdigest()[:12] for o in outputs]


def cell_engine(model, config, params: Params, setup: str, scratch: bool, cap: int, prompts):
    """The engine of one cell (the adaptive split applied), and the split's hints."""
    import swajax

    context = max_context(prompts, params)
    kv, derived = cell_kv_config(config, params, setup, scratch, cap, context)
    engine = swajax.Engine(
        model,
        kv,
        max_context=context,
        max_batch=params.rows,
        max_num_tokens=params.max_num_tokens,
        implementation=params.implementation,
        admission_headroom=params.admission_headroom,
        batch_invariant=params.batch_invariant,
        # the published experiment: distinct prompts, no prefix cache (parked histories would
        # hold slots that the cells' occupancy figures count)
        enable_prefix_caching=False,
    )
    if setup == "adaptive":
        engine.adapt_pool([len(p) for p in prompts], params.output_len)
    return engine, derived


def precompile_cells(model, config, params: Params, cells, cap: int, prompts, workers=None):
    """Compiles the greedy step variants of every cell's engine at once, in `workers` threads,
    before any cell runs (with the persistent compilation cache on, each cell's own compile
    then reads them back). Cells of one layout share their steps and are lowered once; each
    engine is dropped, pool included, once its steps are lowered, so one pool is live at a
    time. Returns what was compiled and the wall time."""
    import concurrent.futures

    t0 = time.perf_counter()
    workers = workers or min(8, os.cpu_count() or 1)
    layouts, futures = set(), []
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        for setup, scratch in cells:
            if setup == "online":  # its layouts come from the run: its warm-up pass compiles
                continue
            engine, _ = cell_engine(model, config, params, setup, scratch, cap, prompts)
            if engine.layout not in layouts:
                layouts.add(engine.layout)
                for tokens, decode in engine.step_buckets():
                    lowered = engine.lower_step(tokens, decode=decode)
                    futures.append(pool.submit(lowered.compile))
            del engine
            gc.collect()
        lowered_s = time.perf_counter() - t0
        for f in futures:
            f.result()
    return dict(
        layouts=len(layouts),
        variants=len(futures),
        workers=workers,
        lowered_s=lowered_s,
        seconds=time.perf_counter() - t0,
    )


def run_cell(model, config, params: Params, setup: str, scratch: bool, cap: int, prompts):
    import jax

    from swajax import _step_cache

    t0 = time.perf_counter()
    warmup_s = None
    if setup == "online":  # every layout the run visits, compiled by an untimed run
        engine, _ = cell_engine(model, config, params, setup, scratch, cap, prompts)
        engine.run(prompts, params.output_len)
        del engine
        gc.collect()
        warmup_s = time.perf_counter() - t0
    engine, derived = cell_engine(model, config, params, setup, scratch, cap, prompts)
    if jax.config.jax_compilation_cache_dir:  # else the warm-up would compile them again
        engine.precompile()  # both step shapes at once, in threads
    # A warm-up request through the jit path (its executables then come from the cache or
    # are compiled here); as long as the workload's mean request, so that the adaptive policy
    # keeps its split.
    # (online: not so: a request would move its policy off the warm-up run's course)
    mean = round(np.mean([len(p) for p in prompts])) + params.output_len - 2
    if setup != "online":
        engine.run([prompts[0][:1] * mean], 2)
    compile_s = time.perf_counter() - t0
    traces = engine.trace_count
    progress = {"tokens": 0}
    start = time.perf_counter()

    def guard(i, out):
        progress["tokens"] += len(out.new_token_ids)
        elapsed = time.perf_counter() - start
        if params.cell_limit_s and elapsed > params.cell_limit_s:
            raise CellLimit(params.cell_limit_s, elapsed, progress["tokens"])

    outputs, stats = engine.run(prompts, params.output_len, callback=guard)
    layout = engine.layout
    slot_bytes = [layout.slot_bytes(g) for g in range(len(layout.groups))]
    pool = [n * b for n, b in zip(engine.num_slots, slot_bytes, strict=True)]
    rec = dict(
        seconds=stats.seconds,
        output_tokens_per_s=stats.output_tokens / stats.seconds,
        total_tokens_per_s=(sum(map(len, prompts)) + stats.output_tokens) / stats.seconds,
        processed_tokens_per_s=stats.tokens_per_second,  # recomputed prompt tokens included
        steps=stats.steps,
        prefill_tokens=stats.prefill_tokens,
        decode_tokens=stats.decode_tokens,
        output_tokens=stats.output_tokens,
        groups=[g.window for g in layout.groups],  # None: full attention
        slot_bytes=slot_bytes,
        num_slots=list(engine.num_slots),
        pool_bytes=sum(pool),
        pool_ratio=[b / sum(pool) for b in pool],
        split_from=derived,
        peak_slots=list(stats.peak_slots),
        mean_slots=list(stats.mean_slots),
        max_concurrent=stats.max_concurrent,
        preemptions=stats.preemptions,
        resplits=stats.resplits,
        prefill_s=stats.prefill_s,
        decode_s=stats.decode_s,
        prefill_share=stats.prefill_s / max(stats.prefill_s + stats.decode_s, 1e-9),
        decode_steps=stats.decode_steps,
        mean_decode_rows=stats.mean_decode_rows,
        ttft_s=stats.ttft,
        itl_s=stats.itl,
        compile_s=compile_s,
        warmup_s=warmup_s,
        traces_before_run=traces,
        traces_in_run=engine.trace_count - traces,
        request_digests=digests(outputs),
        request_heads=[list(map(int, o[:HEAD_TOKENS])) for o in outputs],
        step_cache=_step_cache.cache_dir() is not None,
    )
    if params.profile:
        from experiments.bench_generate import profile_run

        rec["profile"] = dict(
            requests=params.profile,
            **profile_run(engine, prompts[: params.profile], params.output_len),
        )
    del engine
    gc.collect()
    return rec, outputs


# Two correct implementations' logits differ by up to 2e-2 relative (the GPU tests' tolerance),
# so where the top two logits are closer than that, either token is a correct greedy choice.
NEAR_TIE = 0.02


def divergence_engine(model, params: Params, context: int):
    """One engine for the divergence checks of a preset: batch 1, the default (uncapped)
    quota, so every check runs the request alone."""
    import swajax

    return swajax.Engine(
        model,
        base_kv_config(params, True),
        max_context=context,
        max_batch=1,
        max_num_tokens=params.max_num_tokens,
        implementation=params.implementation,
        enable_prefix_caching=False,
    )


def check_divergences(engine, prompts, on_outputs, off_outputs, limit: int) -> dict:
    """Where ON requests part from OFF: the logits at the first differing position, recomputed
    for the request alone (prompt + the common prefix, a third batching), and the gap between
    the two runs' tokens relative to the top logit. ON and OFF batch rows into different steps,
    so their GEMMs round differently; a divergence is explained by that only at a near tie
    (rel_gap < NEAR_TIE). The first `limit` differing requests are checked."""
    differing = [
        (i, _common_prefix(a, b))
        for i, (a, b) in enumerate(zip(on_outputs, off_outputs, strict=True))
        if list(a) != list(b)
    ]
    details = []
    for i, pos in differing[:limit]:
        context = list(prompts[i]) + list(off_outputs[i][:pos])
        _, stats = engine.run([context], 1, collect_logits=True)
        ((_, _, logits),) = stats.step_logits
        logits = np.asarray(logits, np.float64)
        a, b = int(off_outputs[i][pos]), int(on_outputs[i][pos])
        top = float(logits.max())
        rel_gap = (top - min(logits[a], logits[b])) / max(1.0, abs(top))
        details.append(
            dict(
                request=i,
                position=pos,
                off_token=a,
                on_token=b,
                alone_token=int(logits.argmax()),
                off_logit=float(logits[a]),
                on_logit=float(logits[b]),
                top_logit=top,
                rel_gap=float(rel_gap),
            )
        )
    gaps = [d["rel_gap"] for d in details]
    return dict(
        differing=len(differing),
        checked=len(details),
        near_ties=sum(g < NEAR_TIE for g in gaps),
        max_rel_gap=max(gaps, default=None),
        threshold=NEAR_TIE,
        details=details,
    )


def verify_cells(model, params: Params, prompts, outputs_of: dict, records, preset) -> None:
    """`divergences` of every ON cell of `preset` whose tokens differ from an OFF cell's (any
    setup's), keyed by the OFF setup."""
    engine = None
    for r in records:
        if r["preset"] != preset or not r["scratch"] or (r["setup"], True) not in outputs_of:
            continue
        on = outputs_of[r["setup"], True]
        for off_setup in SETUPS:
            off = outputs_of.get((off_setup, False))
            if off is None or [list(o) for o in on] == [list(o) for o in off]:
                continue
            try:
                if engine is None:
                    engine = divergence_engine(model, params, max_context(prompts, params))
                check = check_divergences(engine, prompts, on, off, params.verify)
            except Exception:  # noqa: BLE001 - recorded, the cells' figures stay
                check = {"error": traceback.format_exc()[-1500:]}
            r.setdefault("divergences", {})[off_setup] = check
            print(
                f"  {r['setup']:<10} ON vs {off_setup} OFF: "
                + (
                    f"{check['differing']} requests differ; {check['near_ties']} of "
                    f"{check['checked']} checked part at a near tie (max rel gap "
                    f"{check['max_rel_gap']:.2e}, threshold {NEAR_TIE})"
                    if "error" not in check
                    else "check ERROR " + _last_line(check["error"])
                ),
                flush=True,
            )
    del engine
    gc.collect()


# %% records, comparison, table, plot
def merge(old: list[dict], new: list[dict]) -> list[dict]:
    """Records of `old` not replaced by a record of `new` with the same (preset, setup, scratch),
    then `new`."""
    key = lambda r: (r["preset"], r["setup"], r["scratch"])  # noqa: E731
    replaced = {key(r) for r in new}
    return [r for r in old if key(r) not in replaced] + list(new)


def _cell(records, preset, setup, scratch, workload=None):
    for r in records:
        if (r["preset"], r["setup"], r["scratch"]) == (preset, setup, scratch) and (
            workload is None or r.get("workload") == workload
        ):
            return r
    return None


def _ok(r, key="output_tokens_per_s") -> bool:
    return r is not None and "error" not in r and key in r


def _change(on, off, key="output_tokens_per_s") -> float | None:
    if not (_ok(on, key) and _ok(off, key)):
        return None
    return 100.0 * (on[key] / off[key] - 1.0)


def _predicted_change(on, off) -> float | None:
    if on is None or off is None:
        return None
    return _change(on.get("predicted"), off.get("predicted"), "est_output_tokens_per_s")


def mark_same_tokens(records: list[dict]) -> None:
    """same_tokens_as_off of every ON cell: its tokens (digests) equal those of every OFF cell
    of the preset with the same workload (batch-invariant steps: no split may change them)."""
    for r in records:
        if not r["scratch"] or "request_digests" not in r or r["setup"] not in SETUPS:
            continue
        offs = [_cell(records, r["preset"], s, False, r.get("workload")) for s in SETUPS]
        offs = [o for o in offs if o is not None and "request_digests" in o]
        if not offs:
            r.pop("same_tokens_as_off", None)
            continue
        differ = {
            i
            for o in offs
            for i, (a, b) in enumerate(zip(r["request_digests"], o["request_digests"], strict=True))
            if a != b
        }
        r["same_tokens_as_off"] = not differ
        r["requests_differing_from_off"] = sorted(differ)
        heads = [o["request_heads"] for o in offs if "request_heads" in o]
        if "request_heads" in r and heads:  # where differing requests part from OFF
            prefixes = [
                _common_prefix(a, b)
                for h in heads
                for a, b in zip(r["request_heads"], h, strict=True)
            ]
            r["first_token_agreement"] = float(np.mean([p > 0 for p in prefixes]))
            r["mean_common_prefix"] = float(np.mean(prefixes))  # of the first HEAD_TOKENS


def _common_prefix(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def comparison(records: list[dict]) -> dict:
    """Per preset: ON vs OFF change (%) per setup, ours (measured and predicted) and published;
    for the engine's own splits (adaptive, online) also ON against the untuned OFF (cap_only),
    against the best OFF of any setup and against the best ON of the fixed splits; and
    `best`: the best ON of all setups against the best OFF of all setups (the claim that
    scratch reuse gains counts only against the best baseline, adaptive splits included)."""
    out = {}
    for preset in dict.fromkeys(r["preset"] for r in records):
        row = {}
        wl = None
        for setup in SETUPS:
            on, off = (_cell(records, preset, setup, s) for s in (True, False))
            if on is None and off is None:
                continue
            wl = (on or off).get("workload")
            if off is not None and on is not None and off.get("workload") != on.get("workload"):
                off = None
            row[setup] = dict(
                change_pct=_change(on, off),
                total_change_pct=_change(on, off, "total_tokens_per_s"),
                predicted_change_pct=_predicted_change(on, off),
                published_pct=PUBLISHED.get(preset, {}).get(setup),
            )
        cells = {(s, sc): _cell(records, preset, s, sc, wl) for s in SETUPS for sc in (True, False)}
        offs = [c for (s, sc), c in cells.items() if not sc and _ok(c)]
        best_off = max(offs, key=_tps, default=None)
        fixed_on = [cells[s, True] for s in ("cap_only", "pinned_8k") if _ok(cells[s, True])]
        best_fixed_on = max(fixed_on, key=_tps, default=None)
        for setup in ENGINE_SPLITS:
            if setup not in row:
                continue
            on = cells[setup, True]
            row[setup].update(
                change_vs_cap_only_off_pct=_change(on, cells["cap_only", False]),
                change_vs_best_off_pct=_change(on, best_off),
                best_off=(best_off or {}).get("setup"),
                vs_best_fixed_on_pct=_change(on, best_fixed_on),
            )
        ons = [c for (s, sc), c in cells.items() if sc and _ok(c)]
        best_on = max(ons, key=_tps, default=None)
        if best_on is not None and best_off is not None:
            row["best"] = dict(
                on=best_on["setup"],
                off=best_off["setup"],
                change_pct=_change(best_on, best_off),
            )
        out[preset] = row
    return out


def _tps(r) -> float:
    return r["output_tokens_per_s"]


_EST = "est_output_tokens_per_s"


def _fmt(x, spec="+6.1f") -> str:
    return "-" if x is None else format(x, spec)


def format_table(records: list[dict], comp: dict) -> str:
    """Ours beside the published change, per preset and setup (~: predicted, not measured)."""
    head = (
        f"{'preset':<15}{'setup':<10}{'OFF tok/s':>10}{'ON tok/s':>10}{'ours %':>8}"
        f"{'pred %':>8}{'publ. %':>8}{'vs best':>8}{'conc':>8}{'rows':>11}{'preempt':>9}"
        f"{'prefill':>9}  same tokens"
    )
    lines = [head]
    for preset, row in comp.items():
        for setup in SETUPS:
            if setup not in row:
                continue
            on, off = (_cell(records, preset, setup, sc) for sc in (True, False))
            c = row[setup]
            conc = f"{_show(off, 'max_concurrent')}/{_show(on, 'max_concurrent')}"
            rows = "/".join(
                "-" if _get(r, "mean_decode_rows") is None else f"{r['mean_decode_rows']:.1f}"
                for r in (off, on)
            )
            pre = f"{_show(off, 'preemptions')}/{_show(on, 'preemptions')}"
            share = "/".join(
                "-" if _get(r, "prefill_share") is None else f"{100 * r['prefill_share']:.0f}%"
                for r in (off, on)
            )
            same = {True: "yes", False: "NO", None: "-"}[(on or {}).get("same_tokens_as_off")]
            div = [d for d in (on or {}).get("divergences", {}).values() if "checked" in d]
            if same == "NO" and div:  # near ties among the checked divergences
                same = f"ties {sum(d['near_ties'] for d in div)}/{sum(d['checked'] for d in div)}"
            lines.append(
                f"{preset:<15}{setup:<10}{_fmt(_get(off, 'output_tokens_per_s'), '10.1f'):>10}"
                f"{_fmt(_get(on, 'output_tokens_per_s'), '10.1f'):>10}{_fmt(c['change_pct']):>8}"
                f"{_fmt(c['predicted_change_pct']):>8}{_fmt(c.get('published_pct')):>8}"
                f"{_fmt(c.get('change_vs_best_off_pct')):>8}{conc:>8}{rows:>11}{pre:>9}"
                f"{share:>9}  {same}"
            )
        if "best" in row:
            b = row["best"]
            lines.append(
                f"{preset:<15}best ON ({b['on']}) vs best OFF ({b['off']}): "
                f"{_fmt(b['change_pct'])} %"
            )
    lines.append(
        "ours / pred: output tokens/s ON vs OFF of the same setup, measured / predicted; publ.: "
        "TensorRT-LLM on B200; vs best: the engine's own splits (adaptive, online) ON against "
        "the best OFF cell of any setup; conc / rows / preempt / prefill: max concurrent rows, "
        "mean rows of the decode steps, preemptions and the prefill steps' share of the time, "
        "OFF/ON (~: predicted); same tokens: ON equals every OFF cell, or 'ties k/n': k of n "
        f"checked divergences part at a near tie (top-2 gap < {NEAR_TIE} relative)."
    )
    for r in records:
        if r["setup"] == CONTROL and "error" not in r:
            lines.append(
                f"control {r['preset']} pinned_8k ON run again last: "
                f"{r['output_tokens_per_s']:.1f} out tok/s, {_fmt(r['change_vs_first_run_pct'])} % "
                f"vs its first run, same tokens: {r['same_tokens_as_first_run']}"
            )
    for r in records:
        if "error" in r:
            lines.append(
                f"ERROR {r['preset']} {r['setup']} scratch={r['scratch']}: "
                + _last_line(r["error"])
            )
        elif "error" in r.get("predicted", {}):
            lines.append(
                f"(predicted) ERROR {r['preset']} {r['setup']} scratch={r['scratch']}: "
                + _last_line(r["predicted"]["error"])
            )
    return "\n".join(lines)


def _last_line(error: str, n: int = 160) -> str:
    """The last line of a recorded traceback (the exception), at most n characters."""
    return error.strip().splitlines()[-1][:n]


def _get(r, key):
    if r is None or key not in r:
        return None
    return r[key]


def _show(r, key) -> str:
    """A measured value, else the predicted one marked with ~, else -."""
    if r is None:
        return "-"
    if key in r:
        return str(r[key])
    pred = r.get("predicted", {})
    return f"~{pred[key]}" if key in pred else "-"


def _card(device) -> str:
    """Short card names ("H100", "H100 + H200") from a device description or a list of them."""
    texts = [str(d) for d in device] if isinstance(device, list | tuple) else [str(device or "")]
    cards = [c for c in ("B200", "H200", "H100") if any(c in t for t in texts)]
    return " + ".join(cards) or (texts[0].split()[-1] if texts[0] else "?")


def plot(comp: dict, path: pathlib.Path, device: str | None = None) -> None:
    """One panel per model (in `PRESETS` order): ON vs OFF change per setup, ours (measured,
    labelled with the `device` that ran the cells; predicted as a marker) beside the published
    percentage."""
    import matplotlib.pyplot as plt

    presets = [p for p in PRESETS if p in comp] + [p for p in comp if p not in PRESETS]
    cols = min(5, max(len(presets), 1))
    rows = -(-len(presets) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.4 * cols, 3.2 * rows), squeeze=False)
    for ax in axes.flat:
        ax.set_visible(False)
    x = np.arange(len(SETUPS))
    nan = lambda v: np.nan if v is None else v  # noqa: E731
    for ax, preset in zip(axes.flat, presets, strict=False):
        ax.set_visible(True)
        row = comp[preset]
        ours, pred, publ = [], [], []
        for setup in SETUPS:
            c = row.get(setup, {})
            ours.append(c.get("change_pct"))
            pred.append(c.get("predicted_change_pct"))
            publ.append(c.get("published_pct"))
        bars = ax.bar(
            x - 0.2, [nan(v) for v in ours], 0.4, label=f"ours ({_card(device)})", color="tab:red"
        )
        ax.bar_label(bars, [f"{v:+.0f}" if v is not None else "" for v in ours], fontsize=7)
        pbars = ax.bar(x + 0.2, [nan(v) for v in publ], 0.4, label="published (B200)", color="0.6")
        ax.bar_label(pbars, [f"{v:+.1f}" if v is not None else "" for v in publ], fontsize=7)
        ax.plot(x - 0.2, [nan(v) for v in pred], "k_", ms=14, mew=2, label="ours predicted")
        ax.axhline(0, color="k", lw=0.6)
        values = [v for v in ours + pred + publ if v is not None]
        if values and max(abs(v) for v in values) > 200:  # a preemption storm: keep it readable
            ax.set_yscale("symlog", linthresh=50)
        else:
            ax.margins(y=0.15)
        ax.set_xticks(x, ["cap only", "pinned 8K", "adaptive", "online"], fontsize=8)
        ax.set_title(preset, fontsize=10)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0, 0].set_ylabel("output tokens/s, ON vs OFF (%)")
    axes[0, 0].legend(fontsize=7)
    fig.suptitle(
        "SWA scratch reuse under a KV cap, ON vs OFF of each pool split",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# %% main
def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--presets", default=None, help="comma-separated (default: all ten)")
    p.add_argument("--setups", default=",".join(SETUPS), help="comma-separated subset")
    p.add_argument("--requests", type=int, default=None)
    p.add_argument("--input-mean", type=int, default=None)
    p.add_argument("--output-len", type=int, default=None)
    p.add_argument("--rows", type=int, default=None)
    p.add_argument("--cap-seqs", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--admission-headroom", type=float, default=None)
    p.add_argument("--compile-s", type=float, default=None, help="per step variant (estimate)")
    p.add_argument("--cell-limit-s", type=float, default=None, help="0: no limit")
    p.add_argument(
        "--verify", type=int, default=None, help="divergences checked per ON/OFF pair (0: none)"
    )
    p.add_argument(
        "--out",
        type=pathlib.Path,
        default=None,
        help="default: results/swa_scratch_h200.json (--simulate: swa_scratch_predictions.json)",
    )
    p.add_argument("--merge", type=pathlib.Path, default=None, help="JSON whose records to keep")
    p.add_argument(
        "--combine",
        type=pathlib.Path,
        nargs="+",
        default=None,
        help="run nothing: one table from these per-call JSONs (one commit, one workload)",
    )
    p.add_argument("--png", type=pathlib.Path, default=None, help="default: --out with .png")
    p.add_argument("--quick", action="store_true", help="tiny models on CPU, reference kernels")
    p.add_argument(
        "--mixed-steps",
        dest="batch_invariant",
        action="store_false",
        default=None,
        help="the default engine's steps (decode rows ride in prefill steps) instead of "
        "Engine(batch_invariant=True), whose ON/OFF tokens do not depend on the batching",
    )
    p.add_argument(
        "--experts-in-place-max-rows",
        type=int,
        default=None,
        metavar="N",
        help="MoE layers read their experts in the stack up to N token copies per step "
        "(default: the model's, gemma._layers.EXPERTS_IN_PLACE_MAX_ROWS); 0: copied out first",
    )
    p.add_argument(
        "--profile",
        type=int,
        default=None,
        metavar="N",
        help="after each cell, N of its requests once more under the profiler (0: none)",
    )
    p.add_argument(
        "--control",
        action="store_const",
        const=True,
        default=None,
        help="run each preset's pinned_8k ON cell again after its other cells",
    )
    p.add_argument(
        "--precompile-workers",
        type=int,
        default=None,
        metavar="N",
        help="threads compiling every cell's steps up front (needs the compilation cache; 0: off)",
    )
    p.add_argument("--simulate", action="store_true", help="predictions only, no model")
    p.add_argument(
        "--plan",
        type=float,
        default=None,
        metavar="S",
        help="with --simulate: print the device calls of at most S seconds per preset",
    )
    args = p.parse_args(argv)
    if args.out is None:
        name = "swa_scratch_predictions.json" if args.simulate else "swa_scratch_h200.json"
        args.out = RESULTS / name
    base = QUICK if args.quick else Params()
    over = {
        k: getattr(args, k)
        for k in (
            "requests",
            "input_mean",
            "output_len",
            "rows",
            "cap_seqs",
            "seed",
            "admission_headroom",
            "compile_s",
            "cell_limit_s",
            "verify",
            "batch_invariant",
            "experts_in_place_max_rows",
            "profile",
            "precompile_workers",
            "control",
        )
        if getattr(args, k) is not None
    }
    params = dataclasses.replace(base, **over)
    presets = (
        args.presets.split(",")
        if args.presets
        else (["gemma4_e2b"] if args.quick else list(PRESETS))
    )
    setups = [s for s in args.setups.split(",") if s]
    for s in setups:
        if s not in SETUPS:
            p.error(f"--setups: {s!r} is not one of {SETUPS}")
    for name in presets:
        if name not in PRESETS:
            p.error(f"--presets: {name!r} is not one of {PRESETS}")
    if params.experts_in_place_max_rows is not None and params.experts_in_place_max_rows < 0:
        p.error(f"--experts-in-place-max-rows must be >= 0, got {params.experts_in_place_max_rows}")
    return args, params, presets, setups


def combine(paths, out: pathlib.Path, png: pathlib.Path | None = None) -> dict:
    """One table from the per-preset files of the device calls (`--combine`): their records
    (control records kept), runs and caps, refusing files of different commits or workloads
    (one table, one commit, one workload); the comparison, table and PNG rebuilt."""
    files = [json.loads(pathlib.Path(p).read_text()) for p in paths]
    if not files:
        raise ValueError("--combine needs at least one file")
    records = [r for f in files for r in f["records"]]
    commits = {r.get("git_commit") for r in records}
    workloads = {json.dumps(r.get("workload"), sort_keys=True) for r in records}
    if len(commits) != 1 or len(workloads) != 1:
        raise ValueError(
            f"the cells come from {len(commits)} commits {sorted(map(str, commits))} and "
            f"{len(workloads)} workloads: one table needs one of each"
        )
    keys = [(r["preset"], r["setup"], r["scratch"]) for r in records]
    if len(set(keys)) != len(keys):
        raise ValueError("a cell (preset, setup, scratch) appears in two files")
    res = {k: v for k, v in files[0].items() if k not in ("records", "comparison")}
    res.update(
        git_commit=commits.pop(),
        runs=[run for f in files for run in f.get("runs", [])],
        caps={k: v for f in files for k, v in f.get("caps", {}).items()},
        devices=sorted({f.get("device") for f in files}),
        combined_from=[str(p) for p in paths],
        records=records,
    )
    mark_same_tokens(res["records"])
    res["comparison"] = comparison(res["records"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1, default=str) + "\n")
    print(format_table(res["records"], res["comparison"]))
    png = png or out.with_suffix(".png")
    plot(res["comparison"], png, res["devices"])
    print(f"wrote {out} and {png}")
    return res


def main(argv=None) -> dict:
    args, params, presets, setups = parse(argv)
    if args.combine:
        return combine(args.combine, args.out, args.png)
    import jax.numpy as jnp
    from flax import nnx

    import gemma
    from experiments._meta import run_metadata
    from swajax._compilation_cache import enable_default_cache

    meta = run_metadata(
        **dataclasses.asdict(params), presets=presets, setups=setups, prefix_caching=False
    )
    merge_from = args.merge or (args.out if args.out.exists() else None)
    res = {}
    if merge_from is not None and merge_from.exists():
        res = json.loads(merge_from.read_text())
    records = res.get("records", [])
    res.update(
        description=(
            "SWA scratch reuse ON vs OFF under a KV byte cap: generation throughput per preset "
            "and pool-split setup (cap_only: hint split for ISL 2K; pinned_8k: split pinned for "
            "ISL 8K; adaptive: pool_ratio='adaptive'; online: pool_ratio='online'), beside "
            "TensorRT-LLM's published change "
            "on B200 (experiments/swa_scratch_throughput.py, experiments/notes/reproduction.md)."
        ),
        published=PUBLISHED,
        device=meta["device"],
        platform=meta["platform"],
        versions=meta["versions"],
        git_commit=meta["git_commit"],
        prompts_seed=params.seed,
        runs=res.get("runs", []) + [meta],
        caps=res.get("caps", {}),
    )
    new_records = []

    def save():
        res["records"] = merge(records, new_records)
        mark_same_tokens(res["records"])
        res["comparison"] = comparison(res["records"])
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=1, default=str) + "\n")

    for preset in presets:
        config = model_config(preset, params)
        prompts = make_prompts(config.vocab_size, params)
        cap = kv_cap_bytes(config, params)
        res["caps"][preset] = cap
        weights = weight_bytes(config, params)
        cells = [(s, sc) for s in setups for sc in SCRATCH[s]]
        predicted = {}
        for setup, scratch in cells:
            try:
                lay = cell_layout(config, params, setup, scratch, cap, prompts)
                predicted[setup, scratch] = simulate(
                    config, lay, params, prompts, weights, online=cell_online(params, setup, cap)
                )
            except Exception:  # noqa: BLE001 - reported with the cell
                predicted[setup, scratch] = {"error": traceback.format_exc()[-1500:]}
        ok = {k: v for k, v in predicted.items() if "error" not in v}
        est = estimate(ok, params, weights)
        print(
            f"{preset}: cap {cap / 2**30:.2f} GiB ({params.cap_seqs:g} x steady KV of "
            f"{params.input_mean}+{params.output_len}), weights {weights / 2**30:.1f} GiB, "
            f"{params.requests} requests; estimate {est['total_s']:.0f} s = init "
            f"{est['init_s']:.0f} + compile {est['compile_s']:.0f} + runs {est['run_s']:.0f}",
            flush=True,
        )
        for (setup, scratch), pr in predicted.items():
            print(
                f"  predicted {setup:<10} scratch={scratch!s:<5} "
                + (
                    f"slots {pr['num_slots']} steps {pr['steps']} conc {pr['max_concurrent']} "
                    f"(mean {pr['mean_concurrent']:.1f}) preempt {pr['preemptions']} "
                    + (
                        f"resplits {pr['resplits']} layouts {pr['layouts']} "
                        if pr.get("resplits")
                        else ""
                    )
                    + f"{pr['est_seconds']:.0f} s ({100 * pr['est_prefill_share']:.0f} % in "
                    f"prefill steps) {pr['est_output_tokens_per_s']:.0f} out tok/s"
                    if "error" not in pr
                    else _last_line(pr["error"], 1000)
                ),
                flush=True,
            )
        if args.plan:
            for setups_, n, est_s in plan_calls(preset, predicted, params, weights, args.plan):
                print(
                    f"  plan: --presets {preset} --setups {','.join(setups_)} --requests {n}"
                    f"  # estimate {est_s:.0f} s",
                    flush=True,
                )
        if args.simulate:
            for (setup, scratch), pr in predicted.items():
                new_records.append(
                    dict(
                        preset=preset,
                        setup=setup,
                        scratch=scratch,
                        workload=params.workload,
                        kv_cap_bytes=cap,
                        predicted=pr,
                        estimate=est,
                        git_commit=meta["git_commit"],
                        utc=meta["utc"],
                    )
                )
            save()
            continue
        if est["total_s"] > DEVICE_CALL_S and not params.quick:
            print(
                f"  WARNING: the estimate exceeds one device call ({DEVICE_CALL_S} s): split the "
                "setups over invocations (--setups) or lower --requests / --output-len",
                flush=True,
            )
        t0 = time.perf_counter()
        dtype = jnp.dtype(params.weight_dtype)
        model = gemma.Transformer(config, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=dtype)
        gemma.set_unit_size_attention_logits(model)  # O(1) attention logits, as trained
        if params.experts_in_place_max_rows is not None:
            gemma.set_experts_in_place_max_rows(model, params.experts_in_place_max_rows)
        init_s = time.perf_counter() - t0
        precompiled = None
        if params.precompile_workers > 0 and enable_default_cache():  # as the engine would
            precompiled = precompile_cells(
                model, config, params, cells, cap, prompts, params.precompile_workers
            )
            print(
                f"  precompiled {precompiled['variants']} step variants of "
                f"{precompiled['layouts']} layouts in {precompiled['seconds']:.0f} s "
                f"({precompiled['workers']} threads)",
                flush=True,
            )
        outputs_of = {}  # (setup, scratch) -> every request's tokens
        runs = list(cells)
        if params.control and ("pinned_8k", True) in cells:
            runs.append((CONTROL, True))
        for setup, scratch in runs:
            served = "pinned_8k" if setup == CONTROL else setup  # the control: pinned ON again
            rec = dict(
                preset=preset,
                setup=setup,
                scratch=scratch,
                workload=params.workload,
                kv_cap_bytes=cap,
                implementation=params.implementation,
                init_s=init_s,
                precompiled=precompiled,
                predicted=predicted[served, scratch],
                git_commit=meta["git_commit"],
                utc=meta["utc"],
            )
            try:
                cell, outputs = run_cell(model, config, params, served, scratch, cap, prompts)
                rec.update(cell)
                if setup == CONTROL:
                    first = next(
                        r
                        for r in new_records
                        if (r["preset"], r["setup"], r["scratch"]) == (preset, "pinned_8k", True)
                    )
                    rec.update(
                        control_of="pinned_8k",
                        same_tokens_as_first_run=first.get("request_digests")
                        == rec["request_digests"],
                        change_vs_first_run_pct=_change(rec, first),
                    )
                else:
                    outputs_of[setup, scratch] = outputs
            except CellLimit as e:
                rec.update(error=str(e), partial_seconds=e.seconds, partial_output_tokens=e.tokens)
            except Exception:  # noqa: BLE001 - one failed cell must not lose the others
                rec["error"] = traceback.format_exc()[-2000:]
            new_records.append(rec)
            save()
            print(
                f"  {setup:<10} scratch={scratch!s:<5} "
                + (
                    f"{rec['output_tokens_per_s']:.1f} out tok/s, {rec['seconds']:.1f} s, steps "
                    f"{rec['steps']}, conc {rec['max_concurrent']}, preempt {rec['preemptions']}, "
                    f"slots {rec['num_slots']} peak {rec['peak_slots']}, compile "
                    f"{rec['compile_s']:.0f} s"
                    if "error" not in rec
                    else "ERROR " + _last_line(rec["error"], 200)
                ),
                flush=True,
            )
        if params.verify:
            verify_cells(model, params, prompts, outputs_of, new_records, preset)
            save()
        del model
        gc.collect()
    save()
    table = format_table(res["records"], res["comparison"])
    print(table)
    png = args.png or args.out.with_suffix(".png")
    plot(res["comparison"], png, res.get("device"))
    print(f"wrote {args.out} and {png}")
    return res


if __name__ == "__main__":
    import matplotlib

    matplotlib.use("Agg")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
