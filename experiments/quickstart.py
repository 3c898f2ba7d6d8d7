"""Quickstart: the first ten minutes with swajax, on the tiny trained model of
experiments/tiny_model/ (4 layers, 0.84 M parameters, trained on nursery rhymes).

1. load a Hugging Face checkpoint directory and its tokenizer;
2. batch-generate from a JSONL file with the function behind `python -m swajax generate`;
3. chat, streaming the answer as it is generated;
4. the same batch with SWA scratch reuse off: KV slot occupancy per step, ON vs OFF;
5. the KV memory plan of a full-size preset (`python -m swajax info`), without weights.

    .venv/bin/python experiments/quickstart.py [--quick] [--out DIR]

Writes the JSONL files and quickstart_occupancy.png to --out (default: experiments/results for
the figure, a temporary directory for the JSONL files). --quick: fewer, shorter requests (CI).
Opened as a notebook (`# %%` cells: VS Code, jupytext), the figure is shown inline.
"""

# %%
from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import tempfile

import gemma
import swajax
import swajax.jsonl
import swajax.plan

INTERACTIVE = "ipykernel" in sys.modules or hasattr(sys, "ps1")
if not INTERACTIVE:
    import matplotlib

    matplotlib.use("Agg")  # a script or a test: files only, no window

import matplotlib.pyplot as plt  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
TINY = HERE / "tiny_model"
CORPUS = HERE / "data" / "nursery_rhymes.txt"

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--quick", action="store_true", help="fewer, shorter requests (CI)")
parser.add_argument("--out", type=pathlib.Path, default=None, help="where the files go")
# parse_known_args: a notebook kernel passes arguments of its own
ARGS = parser.parse_known_args()[0]
OUT = ARGS.out or pathlib.Path(tempfile.mkdtemp(prefix="swajax_quickstart_"))
OUT.mkdir(parents=True, exist_ok=True)
FIGURE = (ARGS.out or HERE / "results") / "quickstart_occupancy.png"

# %% [markdown]
# ## 1. A checkpoint directory
#
# `gemma.from_pretrained` reads `config.json` and the safetensors of a Hugging Face Gemma 3 /
# Gemma 4 directory; `gemma.load_tokenizer` its `tokenizer.json`, chat template and stop ids.

# %%
model = gemma.from_pretrained(TINY)
tokenizer = gemma.load_tokenizer(TINY)
print(model.config.family, f"{model.num_params:,} parameters;", tokenizer)

# %% [markdown]
# ## 2. Batch generation from a JSONL file
#
# One request per line, `{"prompt": ...}` or `{"messages": [...]}`, with an optional `"id"`,
# `"max_new_tokens"` and sampling fields. `swajax.jsonl.generate_jsonl` is the function behind
#
#     python -m swajax generate --model experiments/tiny_model --input prompts.jsonl \
#         --output out.jsonl --chat --max-new-tokens 32 --kv-cap 573440 --page-size 16
#
# It checks every line before anything runs, writes the results in input order as they
# finish, and (`resume=True`, `--resume`) continues an interrupted run. Here each request
# quotes a part of the nursery-rhyme corpus (a few hundred tokens: long prefills) before asking
# for a rhyme (`chat=True`: a "prompt" is a user message of a chat).

# %%
TITLES = ["Jack and Jill", "Humpty Dumpty", "Little Bo Peep", "Hey Diddle Diddle"]
TITLES += ["Baa, Baa, Black Sheep", "Three Blind Mice", "Old King Cole", "Simple Simon"]
NUM_REQUESTS, NEW_TOKENS = (6, 8) if ARGS.quick else (16, 32)
corpus = [line for line in CORPUS.read_text().splitlines() if line and line[0] != "#"]
requests = []
for i in range(NUM_REQUESTS):
    quote = "\n".join(corpus[7 * i : 7 * i + 16 + 4 * (i % 4)])  # about 200 to 380 tokens
    ask = f"Say the rhyme {TITLES[i % len(TITLES)]}."
    requests.append({"id": f"r{i}", "prompt": f"{quote}\n\n{ask}"})
prompts_file = OUT / "prompts.jsonl"
prompts_file.write_text("".join(json.dumps(r) + "\n" for r in requests))

# A tight KV quota: 40 slots of the sliding-window pool group (16 tokens of the 3 sliding
# layers, bf16: 6144 bytes each) and 160 of the full-attention group (2048 bytes), the pool
# ratio pinned so that the scratch-off run of section 4 gets the same slots. Scratch reuse is
# on by default for Gemma text models.
KV = swajax.KVCacheConfig(
    page_size=16, max_gpu_total_bytes=40 * 6144 + 160 * 2048, pool_ratio=(40 * 6144, 160 * 2048)
)
# at most 8 rows, steps of at most 512 tokens, prefill chunks of 256
ENGINE = dict(kv_cache=KV, max_batch=8, max_num_tokens=512, prefill_chunk_size=256)


def generate_file(name, **settings):
    summary = swajax.jsonl.generate_jsonl(
        model,
        tokenizer,
        prompts_file,
        OUT / name,
        max_new_tokens=NEW_TOKENS,
        chat=True,
        progress=INTERACTIVE,
        **{**ENGINE, **settings},
    )
    print(summary.line())
    return summary


runs = {True: generate_file("out_scratch_on.jsonl")}
for line in (OUT / "out_scratch_on.jsonl").read_text().splitlines()[:3]:
    result = json.loads(line)  # {"id", "text", "token_ids", "finish_reason"}
    print(f"{result['id']} [{result['finish_reason']}]: {result['text']!r}")

# %% [markdown]
# ## 3. Chat, streamed
#
# `swajax.generate_text` takes strings or conversations (lists of `{"role", "content"}`
# messages, rendered by the checkpoint's chat template) and stops at the tokenizer's stop ids
# (`<eos>`, `<end_of_turn>`). With `stream=True` it yields `TextChunk`s as tokens come, each
# request decoded incrementally (a piece never ends inside a multi-byte character).
#
# The engine of the batch above is kept for the next call with the same settings (and a
# context and batch that fit it), so this call compiles nothing.

# %%
conversation = [{"role": "user", "content": "Say the rhyme Jack and Jill."}]
for chunk in swajax.generate_text(model, tokenizer, [conversation], 64, stream=True, **ENGINE):
    print(chunk.text, end="", flush=True)
print(f"\n[{chunk.finish_reason}]")

# %% [markdown]
# ## 4. KV slot occupancy, scratch ON vs OFF
#
# The same batch with scratch reuse off (`--scratch off`), the same quota and pool ratio.
# `RunStats.step_slots`: the slots each pool group holds after every step's reserve. The
# sliding-window group (window 64) is where scratch reuse acts: a 256-token prefill chunk needs
# its stale part only during each sliding layer's own attention, so with scratch on it lives in
# a few scratch slots shared by the three sliding layers instead of in every layer's pages.
# With the same quota, more requests prefill at once and the batch needs fewer steps; the
# results are the same.

# %%
off = dataclasses.replace(KV, enable_swa_scratch_reuse=False)
runs[False] = generate_file("out_scratch_off.jsonl", kv_cache=off)
same = (OUT / "out_scratch_on.jsonl").read_text() == (OUT / "out_scratch_off.jsonl").read_text()
print("scratch ON and OFF wrote the same results:", same)


# %%
def plot_occupancy(runs):
    on, off = runs[True].stats, runs[False].stats
    groups = runs[True].groups
    fig, axes = plt.subplots(1, len(groups), figsize=(6 * len(groups), 3.8))
    for g, (ax, name) in enumerate(zip(axes, groups, strict=True)):
        for stats, label, color in ((on, "scratch ON", "tab:orange"), (off, "OFF", "tab:blue")):
            held = [s[g] for s in stats.step_slots]
            ax.step(range(1, len(held) + 1), held, where="mid", color=color, label=label)
        ax.axhline(on.num_slots[g], color="k", lw=0.8, ls="--", label="slots in the pool")
        ax.set_title(
            f"{name}: peak {on.peak_slots[g]} ON / {off.peak_slots[g]} OFF; "
            f"{on.steps} / {off.steps} steps",
            fontsize=9,
        )
        ax.set_ylim(0, on.num_slots[g] * 1.1)
        ax.set_xlabel("step")
        ax.set_ylabel("slots held after reserve")
        ax.legend(fontsize=8)
    fig.suptitle(f"{len(requests)} requests, KV quota {KV.max_gpu_total_bytes:,} bytes")
    fig.tight_layout()
    return fig


fig = plot_occupancy(runs)
if INTERACTIVE:
    plt.show()
else:
    FIGURE.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(FIGURE, dpi=120)
    print(f"wrote {FIGURE}")

# %% [markdown]
# ## 5. The memory plan of a full-size model
#
# `python -m swajax info --model preset:gemma4_e2b --kv-cap 8GiB` sizes the model with
# `jax.eval_shape` and the KV pool from the layout alone: nothing is allocated.

# %%
plan = swajax.plan.memory_plan(
    gemma.configs.gemma4_e2b(), swajax.KVCacheConfig(max_gpu_total_bytes=8 << 30)
)
print(swajax.plan.format_plan(plan, "preset:gemma4_e2b"))
