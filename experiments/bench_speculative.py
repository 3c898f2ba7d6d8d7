"""Speculative decoding: decode tokens/s with and without drafts, and where the mechanism tops out.

    PYTHONPATH=. python experiments/bench_speculative.py --target gemma3_27b \
        --drafters none,ngram,model:gemma3_1b,oracle:1.0,oracle:0.5 --batches 1,8,32 \
        --out experiments/results/speculative_h200.json            # GPU
    PYTHONPATH=. .venv/bin/python experiments/bench_speculative.py --quick --out /tmp/s.json

For each (drafter, batch, prompt kind) one engine of the target (random weights, bf16, scratch
reuse and prefix caching on, the default decode path) runs `batch` requests of `--input-len`
prompt tokens and `--output-len` new tokens, greedy, twice: the first run compiles, the second
is timed. Prompt kinds: "repetitive" (a random 32-token snippet repeated with one token changed
per copy, as code and extraction outputs repeat their context) and "random".

Drafters: "none" (no speculation: the baseline, the same engine with num_draft_tokens=0),
"ngram" (prompt lookup), "model:<preset>" (an engine of a smaller preset of the same vocabulary
drafting greedily in its own pool; random weights, so it rarely agrees with the target), and
"assistant:<layers>" (a random Gemma 4 multi-token-prediction assistant of that many layers,
`gemma.assistant_config_for`, drafting inside each step; Gemma 4 targets), and
"oracle:<rate>" (the target's own greedy continuation, read from the baseline run, with tokens
replaced so that about `rate` of the drafts are kept): with random weights no real drafter
agrees with the target, so the oracle shows the mechanism's ceiling (rate 1.0) and its cost at
a given acceptance. Each record: output tokens/s of the timed run, decode steps, tokens per
decode step, the acceptance rate, and the speed against "none" of the same batch and prompts.
"""

from __future__ import annotations

import argparse
import json
import time
import traceback

import numpy as np

from experiments._meta import run_metadata


def make_prompts(kind: str, vocab: int, batch: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    if kind == "random":
        return [rng.integers(1, vocab, length).tolist() for _ in range(batch)]
    out = []
    for _ in range(batch):
        snippet = rng.integers(1, vocab, 32).tolist()
        seq = []
        while len(seq) < length:
            copy = list(snippet)
            copy[int(rng.integers(len(copy)))] = int(rng.integers(1, vocab))
            seq += copy
        out.append(seq[:length])
    return out


class OracleDrafter:
    """The target's known greedy continuation, each drafted token replaced with probability
    1 - rate (a fixed seed): drafts kept at about `rate`, whatever the weights."""

    def __init__(self, prompts, outputs, rate: float, vocab: int, seed: int = 0):
        self.full = {tuple(p): list(p) + list(o) for p, o in zip(prompts, outputs, strict=True)}
        self.lengths = sorted({len(p) for p in prompts})
        self.rate, self.vocab = rate, vocab
        self.rng = np.random.default_rng(seed)

    def propose(self, tokens, k):
        tokens = list(tokens)
        for n in self.lengths:
            full = self.full.get(tuple(tokens[:n]))
            if full is not None and full[: len(tokens)] == tokens:
                drafts = full[len(tokens) : len(tokens) + k]
                wrong = self.rng.random(len(drafts)) >= self.rate
                return [
                    (t + 1) % self.vocab if w else t for t, w in zip(drafts, wrong, strict=True)
                ]
        return []


def model_of(preset: str, quick: bool, seed: int = 0):
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import gemma

    config = gemma.configs.small_preset(preset) if quick else gemma.configs.preset(preset)
    dtype = jnp.float32 if quick else jnp.bfloat16
    model = gemma.Transformer(config, rngs=nnx.Rngs(seed), dtype=dtype, param_dtype=dtype)
    jax.block_until_ready(nnx.state(model))
    return model


def assistant_of(target, num_layers: int, seed: int = 2):
    from flax import nnx

    import gemma

    config = gemma.assistant_config_for(target.config, num_layers=num_layers)
    return gemma.Gemma4Assistant(
        config, rngs=nnx.Rngs(seed), dtype=target.dtype, param_dtype=target.param_dtype
    )


def engine_of(model, args, batch: int, drafts: int, drafter):
    import jax.numpy as jnp

    import swajax

    kv = swajax.KVCacheConfig(
        page_size=16 if args.quick else 32,
        dtype=jnp.float32 if args.quick else jnp.bfloat16,
        max_gpu_total_bytes=args.kv_bytes,
    )
    return swajax.Engine(
        model,
        kv,
        max_context=args.input_len + args.output_len + 64,
        max_batch=batch,
        max_num_tokens=args.max_num_tokens,
        implementation="reference" if args.quick else "auto",
        num_draft_tokens=drafts,
        drafter=drafter if drafts else "ngram",
    )


def timed(engine, prompts, output_len, drafter=None):
    """The second of two runs (the first compiles); prefix caches emptied before each, so
    that the timed run prefills as the first did."""
    caches = [e for e in (engine, drafter) if hasattr(e, "clear_prefix_cache")]
    engine.run(prompts, output_len)
    for e in caches:
        e.clear_prefix_cache()
    t0 = time.perf_counter()
    outputs, stats = engine.run(prompts, output_len)
    seconds = time.perf_counter() - t0
    for e in caches:
        e.clear_prefix_cache()
    return outputs, stats, seconds


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="gemma3_27b")
    p.add_argument("--drafters", default="none,ngram,model:gemma3_1b,oracle:1.0,oracle:0.5")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--prompts", default="repetitive,random")
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--k", type=int, default=4, help="num_draft_tokens")
    p.add_argument("--kv-bytes", type=int, default=8 << 30)
    p.add_argument("--max-num-tokens", type=int, default=2048)
    p.add_argument("--quick", action="store_true", help="small presets on the CPU")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.quick:
        args.input_len, args.output_len = min(args.input_len, 64), min(args.output_len, 12)
        args.kv_bytes, args.max_num_tokens = min(args.kv_bytes, 64 << 20), 128
    res = run_metadata(**vars(args))
    res["records"] = []
    target = model_of(args.target, args.quick)
    vocab = target.config.vocab_size
    drafters = args.drafters.split(",")
    draft_models = {}
    print(
        f"{'drafter':>14} {'batch':>5} {'prompts':>10} {'tok/s':>9} {'vs none':>8} "
        f"{'steps':>6} {'tok/step':>8} {'accept':>7}"
    )
    for batch in (int(b) for b in args.batches.split(",")):
        for kind in args.prompts.split(","):
            prompts = make_prompts(kind, vocab, batch, args.input_len, seed=batch)
            base = None
            for name in ["none", *[d for d in drafters if d != "none"]]:
                rec = dict(drafter=name, batch=batch, prompts=kind, k=args.k, ok=False)
                try:
                    if name == "none":
                        drafter, k = None, 0
                    elif name == "ngram":
                        drafter, k = "ngram", args.k
                    elif name.startswith("model:"):
                        preset = name.split(":", 1)[1]
                        if preset not in draft_models:
                            draft_models[preset] = model_of(preset, args.quick, seed=1)
                        drafter = engine_of(draft_models[preset], args, batch, 0, None)
                        k = args.k
                    elif name.startswith("assistant:"):
                        drafter, k = assistant_of(target, int(name.split(":", 1)[1])), args.k
                    elif name.startswith("oracle:"):
                        if base is None:
                            raise RuntimeError("the oracle needs the baseline's outputs")
                        rate = float(name.split(":", 1)[1])
                        drafter, k = OracleDrafter(prompts, base[0], rate, vocab), args.k
                    else:
                        raise ValueError(f"unknown drafter {name!r}")
                    engine = engine_of(target, args, batch, k, drafter)
                    outputs, stats, seconds = timed(engine, prompts, args.output_len, drafter)
                    if name == "none":
                        base = (outputs, stats.output_tokens / seconds)
                    rec.update(
                        ok=True,
                        seconds=seconds,
                        output_tokens=stats.output_tokens,
                        tokens_per_s=stats.output_tokens / seconds,
                        decode_steps=stats.decode_steps,
                        tokens_per_decode_step=stats.output_tokens / max(stats.decode_steps, 1),
                        draft_tokens=stats.draft_tokens,
                        accepted_tokens=stats.accepted_tokens,
                        acceptance_rate=stats.acceptance_rate if stats.draft_tokens else None,
                        same_tokens_as_none=base is not None and outputs == base[0],
                        speedup=(stats.output_tokens / seconds) / base[1] if base else None,
                    )
                    del engine
                except Exception as e:  # noqa: BLE001 - one failed cell must not lose the rest
                    rec["error"] = f"{type(e).__name__}: {e}"
                    traceback.print_exc()
                res["records"].append(rec)
                if rec["ok"]:
                    acc = rec["acceptance_rate"]
                    print(
                        f"{name:>14} {batch:>5} {kind:>10} {rec['tokens_per_s']:9.1f} "
                        f"{rec['speedup']:8.2f} {rec['decode_steps']:6d} "
                        f"{rec['tokens_per_decode_step']:8.2f} "
                        f"{'-' if acc is None else f'{acc:.2f}':>7}"
                    )
                with open(args.out, "w") as f:  # after every cell: a cut run keeps its cells
                    json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
