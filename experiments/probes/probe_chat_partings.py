"""Do cached and uncached engines give the same greedy tokens on a multi-session chat?

    PYTHONPATH=. .venv/bin/python experiments/probes/probe_chat_partings.py \
        --out experiments/results/chat_partings_cpu.json

The chat of the prefix-caching issue: `--sessions` conversations x `--turns` turns, each turn
every session's request submitted together (round robin), the checkpoint's chat template, the
answer decoded to text and carried into the next turn as an assistant message (so the next
prompt re-encodes it, as a chat client does). Two engines serve the same prompts turn by turn:
prefix caching on (the default) and off. Both follow the uncached engine's answers, so every
turn compares the two on identical prompts. Where a request's cached tokens part from the
uncached ones, both runs' logits at the parting position are recorded with the gap between the
two tokens relative to the top logit: below `NEAR_TIE` (2e-2, the GPU tests' tolerance between
two correct implementations) either token is a correct greedy choice (a near tie decided by
the rounding of a different prefill split); above it the parting is a fault.

Writes the JSON (run metadata, per turn: prompt tokens, tokens from the cache, partings with
their gaps) and prints one line per turn.
"""

# %%
from __future__ import annotations

import argparse
import json
import pathlib
import sys

import numpy as np

HERE = pathlib.Path(__file__).resolve().parents[1]
NEAR_TIE = 0.02
OPENERS = (
    "Tell me about the sea.",
    "What is a paged KV cache?",
    "Write a short poem about rain.",
    "How do trains work?",
    "Name three colours.",
    "What should I cook tonight?",
    "Explain sliding window attention.",
    "Why is the sky blue?",
)
FOLLOW_UPS = ("Go on.", "Say more about that.", "Why?", "Give an example.", "Summarise.")


def gap(logits, a: int, b: int) -> float:
    logits = np.asarray(logits, np.float64)
    top = float(logits.max())
    return (top - min(logits[a], logits[b])) / max(1.0, abs(top))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=str(HERE / "tiny_model"))
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--new", type=int, default=48)
    p.add_argument("--max-context", type=int, default=None, help="default: the model's")
    p.add_argument("--out", type=pathlib.Path, default=HERE / "results" / "chat_partings_cpu.json")
    args = p.parse_args(argv)
    sys.path.insert(0, str(HERE.parent))
    import gemma
    import swajax
    from experiments._meta import run_metadata
    from swajax._text import encode_prompt

    model = gemma.from_pretrained(args.model)
    tokenizer = gemma.load_tokenizer(args.model)
    stop = tokenizer.eos_token_ids
    engines = {
        cached: swajax.Engine(
            model,
            max_context=args.max_context,
            max_batch=args.sessions,
            enable_prefix_caching=cached,
            implementation="reference",
        )
        for cached in (True, False)
    }
    res = run_metadata(**vars(args) | {"out": str(args.out)}, near_tie=NEAR_TIE)
    res["engine"] = {
        str(cached): dict(
            cache_nodes=e.layout.cache_nodes,
            page_size=e.layout.page_size,
            scratch=e.layout.scratch,
            num_slots=list(e.num_slots),
        )
        for cached, e in engines.items()
    }
    conversations = [
        [{"role": "user", "content": OPENERS[s % len(OPENERS)]}] for s in range(args.sessions)
    ]
    turns = []
    for turn in range(args.turns):
        prompts = [encode_prompt(tokenizer, c, chat=True) for c in conversations]
        runs = {}
        for cached, engine in engines.items():
            outs, stats = engine.run(prompts, args.new, stop_token_ids=stop, collect_logits=True)
            logits = {(i, k): lg for i, k, lg in stats.step_logits}
            runs[cached] = outs, logits, stats
        (c_out, c_logits, c_stats), (u_out, u_logits, _) = runs[True], runs[False]
        partings = []
        for i, (a, b) in enumerate(zip(u_out, c_out, strict=True)):
            if a == b:
                continue
            k = next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
            if k is None:  # one stopped earlier: not a parting of tokens
                partings.append(dict(session=i, position=min(len(a), len(b)), lengths_differ=True))
                continue
            partings.append(
                dict(
                    session=i,
                    position=k,
                    uncached_token=int(a[k]),
                    cached_token=int(b[k]),
                    rel_gap_uncached=gap(u_logits[i, k], a[k], b[k]),
                    rel_gap_cached=gap(c_logits[i, k], a[k], b[k]),
                )
            )
        turns.append(
            dict(
                turn=turn,
                prompt_tokens=sum(map(len, prompts)),
                cached_tokens=c_stats.prefix_tokens,
                prefix_hits=c_stats.prefix_hits,
                identical=c_out == u_out,
                partings=partings,
            )
        )
        gaps = [x["rel_gap_uncached"] for x in partings if "rel_gap_uncached" in x]
        print(
            f"turn {turn}: {turns[-1]['prompt_tokens']} prompt tokens, "
            f"{c_stats.prefix_tokens} from the cache; "
            + ("identical" if not partings else f"{len(partings)} partings, gaps {gaps}"),
            flush=True,
        )
        for s, (conv, answer) in enumerate(zip(conversations, u_out, strict=True)):
            text = tokenizer.decode(answer, skip_special_tokens=True)
            conv += [
                {"role": "assistant", "content": text},
                {"role": "user", "content": FOLLOW_UPS[(turn + s) % len(FOLLOW_UPS)]},
            ]
    partings = [x for t in turns for x in t["partings"]]
    faults = [x for x in partings if x.get("rel_gap_uncached", 1.0) >= NEAR_TIE]
    res.update(
        turns=turns,
        requests=args.sessions * args.turns,
        partings=len(partings),
        near_ties=len(partings) - len(faults),
        beyond_near_tie=len(faults),
        reuse=sum(t["cached_tokens"] for t in turns)
        / max(sum(t["prompt_tokens"] for t in turns), 1),
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1, default=str) + "\n")
    print(
        f"{res['requests']} requests: {len(partings)} partings ({len(faults)} beyond a near tie); "
        f"{100 * res['reuse']:.1f} % of prompt tokens from the cache; wrote {args.out}"
    )
    return res


if __name__ == "__main__":
    main()
