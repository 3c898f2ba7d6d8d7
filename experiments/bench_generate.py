"""End-to-end batch generation on the H200: swajax's engine, Hugging Face's continuous
batching, and each workload's floor.

    SWAJAX_GIT_COMMIT=... PYTHONPATH=. python3 experiments/bench_generate.py --out $OUT/g.json
    PYTHONPATH=. .venv/bin/python experiments/bench_generate.py --quick --out /tmp/g.json  # CPU

Workloads (random bf16 weights, random prompt tokens, greedy, every request generates exactly
`output` tokens, Pallas kernels, page 32, bf16 KV, the scheduler's default budget of 8192
tokens per step):
  - gemma3_1b_2k: Gemma 3 1B, 64 x (2048 + 128), prefill chunk 2048, KV from free memory;
  - gemma4_e2b_2k: the same on Gemma 4 E2B;
  - gemma3_1b_8k_cap: Gemma 3 1B, 32 x (8192 + 64), chunk 8192, KV capped at 1 GiB with the
    pool ratio derived for an expected input length of 8K, scratch reuse ON and OFF.
Each swajax record: `cold_s` (engine construction to the end of the first run, compiles
included; `cold_first_token_s` to its first token), then the same prompts again on the same
engine, warm: `seconds`, tokens/s, steps, TTFT and inter-token latency, slots, concurrency,
preemptions, and whether the warm tokens equal the cold ones.

Peer (`--only hf`, run in its own process before JAX takes the GPU): Hugging Face transformers
`generate_batch` (continuous batching, paged attention) on gemma3_1b_2k, configured as its
documentation describes (bf16, `attn_implementation` "paged|sdpa", its defaults, then the
8192-token batch budget swajax's steps use; a warm-up batch first; `HF_CONFIGS`); every
configuration tried is recorded, with the first failing request's error.
    PYTHONPATH=. python experiments/bench_generate.py --only hf --quick --out /tmp/hf.json  # CPU

Floor: prefill FLOPs (matmuls + causal/windowed attention) at the bf16 matmul rate plus, per
decode step, the weights and the KV read at the copy bandwidth, both measured in the run
(torch). A swajax record's `x_floor` is its warm time over that floor.
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

import numpy as np

WORKLOADS = {
    "gemma3_1b_2k": dict(preset="gemma3_1b", prompts=64, input=2048, output=128, chunk=2048),
    "gemma4_e2b_2k": dict(preset="gemma4_e2b", prompts=64, input=2048, output=128, chunk=2048),
    "gemma3_1b_8k_cap": dict(
        preset="gemma3_1b",
        prompts=32,
        input=8192,
        output=64,
        chunk=8192,
        kv_cap=1 << 30,
        expected_input_length=8192,
        scratch=(True, False),
    ),
}
QUICK = {
    "tiny_gemma3": dict(preset="gemma3_1b", prompts=6, input=40, output=6, chunk=32, small=True),
    "tiny_gemma4_cap": dict(
        preset="gemma4_e2b",
        prompts=6,
        input=48,
        output=4,
        chunk=48,
        small=True,
        kv_cap=3 << 20,
        expected_input_length=48,
        scratch=(True, False),
    ),
}


def torch_ceilings():
    """(bf16 matmul TFLOP/s, copy TB/s) from torch on random data, or (None, None)."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None, None
        a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        x = torch.empty(2**31, dtype=torch.uint8, device="cuda")
        y = torch.empty_like(x)

        def timed(fn, reps=10):
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            times = []
            for _ in range(reps):
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) * 1e-3)
            return float(np.median(times))

        mm = 2 * 8192**3 / timed(lambda: a @ b) / 1e12
        copy = 2 * 2**31 / timed(lambda: y.copy_(x)) / 1e12
        # Every tensor goes before the cache is emptied: torch's allocator keeps what it still
        # holds reserved, and 4.3 GiB held here left JAX short on an 80 GB card.
        a = b = x = y = None
        torch.cuda.empty_cache()
        return mm, copy
    except Exception:  # noqa: BLE001
        return None, None


# %% floor
def matmul_flops_per_token(config) -> int:
    """Matmul FLOPs of one token: 2 x the parameters it multiplies (no embedding lookup, no
    LM head; MoE layers count their active experts)."""
    specs = config.layer_specs
    d, layers = config.hidden_size, config.num_layers
    per_token = 0
    for i, s in enumerate(specs):
        q = config.num_heads * s.head_dim
        kv = 2 * s.num_kv_heads * s.head_dim if s.kv_source == i else 0
        mlp = 3 * config.mlp_width(i)
        if config.num_experts:
            mlp += 3 * config.num_experts_per_token * config.moe_intermediate_size
        per_token += 2 * d * (2 * q + kv + mlp)
    if config.per_layer_input_dim:
        per_token += 2 * d * layers * config.per_layer_input_dim * 2
    return per_token


def attention_flops(config, positions) -> int:
    """Attention FLOPs (QK^T and PV) of tokens at `positions` (causal, windows respected)."""
    total = 0
    for s in config.layer_specs:
        keys = positions + 1 if s.window is None else np.minimum(positions + 1, s.window)
        total += 4 * config.num_heads * s.head_dim * int(np.sum(keys))
    return total


def kv_read_bytes(config, context: int, kv_itemsize: int) -> int:
    """K and V bytes one decode token at position `context` reads: every layer reads its keys
    within its window (a KV-shared layer reads its writer's again)."""
    total = 0
    for s in config.layer_specs:
        keys = context + 1 if s.window is None else min(context + 1, s.window)
        total += 2 * keys * s.num_kv_heads * s.head_dim * kv_itemsize
    return total


def workload_floor(config, w, weight_bytes, kv_itemsize, matmul_tflops, copy_tbs) -> dict:
    """Seconds no implementation beats: prefill FLOPs / matmul rate + decode bytes / copy."""
    n_in, n_out, num = w["input"], w["output"], w["prompts"]
    per_token = matmul_flops_per_token(config)
    lm_head = 2 * config.hidden_size * config.vocab_size
    pos = np.arange(n_in)
    prefill = num * (n_in * per_token + attention_flops(config, pos) + lm_head)
    decode_steps = n_out - 1
    kv_read = sum(kv_read_bytes(config, t, kv_itemsize) for t in range(n_in, n_in + decode_steps))
    kv_read *= num
    batch_steps = decode_steps * -(-num // w.get("batch", num))
    prefill_s = prefill / (matmul_tflops * 1e12)
    decode_s = (batch_steps * weight_bytes + kv_read) / (copy_tbs * 1e12)
    return dict(
        floor_s=prefill_s + decode_s,
        prefill_flops=prefill,
        prefill_floor_s=prefill_s,
        decode_weight_bytes=batch_steps * weight_bytes,
        decode_kv_bytes=kv_read,
        decode_floor_s=decode_s,
        matmul_tflops=matmul_tflops,
        copy_tbs=copy_tbs,
    )


# %% swajax
def make_prompts(vocab, w, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab, size=w["input"]).tolist() for _ in range(w["prompts"])]


def profile_run(engine, prompts, output) -> dict:
    """One more warm run under the profiler: the device's busy time (the union of its kernels'
    intervals) against the run's wall time, and the kernels with the most time. A run whose
    busy time is far below its wall time waits on the host (scheduling, dispatch)."""
    from experiments._profile import device_kernel_times, top_kernels

    holder = {}

    def call():
        holder["t0"] = time.perf_counter()
        out, stats = engine.run(prompts, output)
        holder["wall"], holder["stats"] = time.perf_counter() - holder["t0"], stats
        return out

    times = device_kernel_times(call, iters=1)
    stats = holder["stats"]
    return dict(
        wall_s=holder["wall"],
        steps=stats.steps,
        device_busy_s=times["busy_us"] / 1e6,
        device_span_s=times["span_us"] / 1e6,
        busy_share=times["busy_us"] / 1e6 / holder["wall"],
        itl_s=stats.itl,
        top_kernels=top_kernels(times, 20),
    )


def run_swajax(name, w, quick, records, profile=False):
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import gemma
    import swajax

    preset = w["preset"]
    config = gemma.configs.small_preset(preset) if w.get("small") else gemma.configs.preset(preset)
    t0 = time.perf_counter()
    model = gemma.Transformer(
        config, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16
    )
    jax.block_until_ready(nnx.state(model))
    init_s = time.perf_counter() - t0
    weight_bytes = sum(
        x.nbytes
        for path, x in jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param))
        if "per_layer_embedding" not in jax.tree_util.keystr(path)
    )
    prompts = make_prompts(config.vocab_size, w)
    impl = "reference" if quick else "pallas"
    for scratch in w.get("scratch", (None,)):
        rec = dict(
            system="swajax",
            workload=name,
            scratch=scratch,
            implementation=impl,
            **{k: v for k, v in w.items() if k not in ("scratch", "small")},
            init_s=init_s,
        )
        try:
            kv = swajax.KVCacheConfig(
                page_size=16 if quick else 32,
                dtype=jnp.bfloat16,
                enable_swa_scratch_reuse=scratch,
                max_gpu_total_bytes=w.get("kv_cap"),
                expected_input_length=w.get("expected_input_length"),
                chunk_size=w["chunk"],
            )
            t0 = time.perf_counter()
            engine = swajax.Engine(
                model,
                kv,
                max_context=w["input"] + w["output"],
                max_batch=w["prompts"],
                prefill_chunk_size=w["chunk"],
                max_num_tokens=256 if quick else None,
                implementation=impl,
            )
            first = []

            def on_output(i, out, first=first):
                if not first:
                    first.append(time.perf_counter())

            cold, _ = engine.run(prompts, w["output"], callback=on_output)
            rec["cold_s"] = time.perf_counter() - t0
            rec["cold_first_token_s"] = first[0] - t0
            rec["traces"] = engine.trace_count
            warm, stats = engine.run(prompts, w["output"])
            total = w["prompts"] * (w["input"] + w["output"])
            rec.update(
                seconds=stats.seconds,
                output_tokens_per_s=w["prompts"] * w["output"] / stats.seconds,
                total_tokens_per_s=total / stats.seconds,
                steps=stats.steps,
                ttft_s=stats.ttft,
                itl_s=stats.itl,
                num_slots=stats.num_slots,
                peak_slots=stats.peak_slots,
                mean_slots=stats.mean_slots,
                max_concurrent=stats.max_concurrent,
                preemptions=stats.preemptions,
                same_tokens_as_cold=warm == cold,
                layout_groups=[str(g.life_cycle) for g in engine.layout.groups],
                kv_pool_bytes=engine.layout.pool_bytes(),
                outputs_digest=hash(tuple(map(tuple, warm))) & 0xFFFFFFFF,
            )
            rec["_tokens"] = warm
            if profile:
                rec["profile"] = profile_run(engine, prompts, w["output"])
            del engine
        except Exception:  # noqa: BLE001
            rec["error"] = traceback.format_exc()[-1500:]
        records.append(rec)
        print(
            f"{name} scratch={scratch}: {rec.get('seconds', float('nan')):.2f} s warm, "
            f"cold {rec.get('cold_s', float('nan')):.1f} s, steps {rec.get('steps')}, "
            f"concurrent {rec.get('max_concurrent')}, preemptions {rec.get('preemptions')} "
            f"{rec.get('error', '')[-300:]}",
            flush=True,
        )
    return config, weight_bytes


# %% Hugging Face peer
# Configurations tried in order until one generates every token. transformers 5.17 runs
# `generate_batch` through the paged variant of the model's attention ("paged|sdpa"; flash
# attention needs its own package). First its defaults (KV blocks and the batch's token
# budget inferred from free GPU memory, CUDA graphs decided by the library), then the budget
# of swajax's step (8192 tokens) with the blocks the workload needs: the settings a user tuning
# throughput would reach for.
HF_CONFIGS = (
    dict(attn="paged|sdpa", cb={}),
    dict(attn="paged|sdpa", cb=dict(max_batch_tokens=8192, num_blocks="workload")),
    dict(attn="paged|flash_attention_2", cb={}),
)


def hf_generate(model, batch, gen, cb_config):
    """`generate_batch`, raising the first failed request's error."""
    # No torch.inference_mode() around generate_batch: its generation loop runs in a thread
    # of its own, which cannot update tensors made in inference mode.
    out = model.generate_batch(
        batch, generation_config=gen, continuous_batching_config=cb_config, progress_bar=False
    )
    errors = [o.error for o in out.values() if o.error]
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, first: {errors[0]}")
    return out


def run_hf(name, w, out_path, quick=False):
    """Hugging Face continuous batching on workload w (a separate process; `quick`: a tiny
    model on the CPU, to check the call itself)."""
    import torch
    import transformers
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    import gemma

    config = gemma.configs.preset(w["preset"])
    if quick:
        config = gemma.configs.small_preset(w["preset"])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    hf_config = Gemma3TextConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        sliding_window=config.sliding_window,
        layer_types=[
            "sliding_attention" if t == "sliding" else "full_attention" for t in config.layer_types
        ],
        max_position_embeddings=config.max_context,
        query_pre_attn_scalar=config.query_pre_attn_scalar,
    )
    prompts = make_prompts(config.vocab_size, w)
    expected = w["prompts"] * w["output"]

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    records = []
    for c in HF_CONFIGS:
        cb = dict(c["cb"])
        if cb.get("num_blocks") == "workload":  # every request's blocks at once, plus slack
            block = cb.get("block_size", 256)
            per_request = -(-(w["input"] + w["output"]) // block)
            cb["num_blocks"] = 2 * w["prompts"] * per_request
        if quick and not cb:  # no GPU memory to infer the sizes from
            cb = dict(max_batch_tokens=256, num_blocks=64, block_size=32)
        rec = dict(
            system="hf_transformers",
            workload=name,
            preset=w["preset"],
            attn_implementation=c["attn"],
            continuous_batching_config=cb,
            device=device,
            transformers=transformers.__version__,
            torch=torch.__version__,
        )
        try:
            torch.manual_seed(0)
            model = Gemma3ForCausalLM._from_config(hf_config, attn_implementation=c["attn"])
            model = model.to(device=device, dtype=torch.bfloat16).eval()
            gen = GenerationConfig(
                max_new_tokens=w["output"],
                min_new_tokens=w["output"],
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            cb_config = ContinuousBatchingConfig(**cb)

            hf_generate(model, prompts[:2], gen, cb_config)  # warm-up: CUDA graphs, allocator
            sync()
            t0 = time.perf_counter()
            out = hf_generate(model, prompts, gen, cb_config)
            sync()
            seconds = time.perf_counter() - t0
            lengths = [len(o.generated_tokens) for o in out.values()]
            if sum(lengths) != expected:
                raise RuntimeError(
                    f"generate_batch returned {sum(lengths)} tokens for {len(out)} requests, "
                    f"expected {w['prompts']} x {w['output']}"
                )
            rec.update(
                seconds=seconds,
                output_tokens=sum(lengths),
                output_tokens_per_s=sum(lengths) / seconds,
                total_tokens_per_s=(w["prompts"] * w["input"] + sum(lengths)) / seconds,
            )
            records.append(rec)
            del model
            if device == "cuda":
                torch.cuda.empty_cache()
            break
        except Exception:  # noqa: BLE001
            rec["error"] = traceback.format_exc()[-1500:]
            records.append(rec)
            print(rec["error"], file=sys.stderr)
    with open(out_path, "w") as f:
        json.dump(records, f, indent=1, default=str)
    return records


# %% main
def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="experiments/results/generate_h200.json")
    p.add_argument("--quick", action="store_true", help="tiny models on CPU, reference kernels")
    p.add_argument("--only", default="", help="comma-separated workloads, or 'hf'")
    p.add_argument("--no-hf", action="store_true")
    p.add_argument(
        "--profile",
        default="gemma3_1b_2k",
        help="comma-separated workloads whose warm run is repeated under the profiler",
    )
    args = p.parse_args()
    workloads = QUICK if args.quick else WORKLOADS
    if args.only == "hf":  # (with --quick: a tiny model on the CPU)
        name = "tiny_gemma3" if args.quick else "gemma3_1b_2k"
        run_hf(name, workloads[name], args.out, quick=args.quick)
        return
    matmul, copy = (None, None) if args.quick else torch_ceilings()
    hf = []
    if not args.quick and not args.no_hf:
        hf_path = args.out + ".hf.json"
        cmd = [sys.executable, __file__, "--only", "hf", "--out", hf_path]
        subprocess.run(cmd, check=False, env=dict(os.environ))
        if os.path.exists(hf_path):
            with open(hf_path) as f:
                hf = json.load(f)

    from experiments._meta import run_metadata

    res = run_metadata(workloads=workloads, quick=args.quick)
    res.update(matmul_tflops=matmul, copy_tbs=copy, records=list(hf), floors={})
    names = [n for n in workloads if not args.only or n in args.only.split(",")]
    for name in names:
        w = workloads[name]
        profile = name in args.profile.split(",")
        config, weight_bytes = run_swajax(name, w, args.quick, res["records"], profile)
        if matmul and copy:
            res["floors"][name] = workload_floor(config, w, weight_bytes, 2, matmul, copy)
        ours = [r for r in res["records"] if r.get("workload") == name and r["system"] == "swajax"]
        tokens = [r.pop("_tokens", None) for r in ours]
        if len(ours) == 2 and all(t is not None for t in tokens):
            for r in ours:
                r["same_tokens_on_off"] = tokens[0] == tokens[1]
        for r in ours:
            if name in res["floors"] and "seconds" in r:
                r["floor_s"] = res["floors"][name]["floor_s"]
                r["x_floor"] = r["seconds"] / r["floor_s"]
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1, default=str)
    print(f"device {res['device']}  matmul {matmul} TFLOP/s  copy {copy} TB/s")
    print(
        f"{'workload':<18} {'system':<16} {'scratch':<7} {'s':>8} {'out tok/s':>10} "
        f"{'x floor':>8} {'steps':>6} {'conc':>5} {'preempt':>7}"
    )
    for r in res["records"]:
        print(
            f"{r.get('workload', ''):<18} {r['system']:<16} {str(r.get('scratch', '')):<7} "
            f"{r.get('seconds', float('nan')):8.2f} "
            f"{r.get('output_tokens_per_s', float('nan')):10.0f} "
            f"{r.get('x_floor', float('nan')):8.2f} {str(r.get('steps', '')):>6} "
            f"{str(r.get('max_concurrent', '')):>5} {str(r.get('preemptions', '')):>7} "
            f"{str(r.get('error', ''))[-80:]}"
        )


if __name__ == "__main__":
    main()
