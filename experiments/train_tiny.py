# %% [markdown]
# # A tiny trained Gemma 3-style model, for examples
#
# Trains, on the CPU in a few minutes, a 4-layer Gemma 3-style model (3 sliding layers with a
# 64-token window, 1 full layer) on `experiments/data/nursery_rhymes.txt` (traditional
# nursery rhymes, public domain), with a byte-fallback BPE tokenizer trained on the same text
# with Hugging Face `tokenizers`: Gemma's special tokens (`<pad>` 0, `<eos>` 1, `<bos>` 2,
# `<unk>` 3, `<mask>` 4, `<start_of_turn>` 5, `<end_of_turn>` 6), Gemma's normalizer and
# decoder, `<bos>` put first, and a Gemma-style chat template. Each rhyme is seen twice: as
# plain text and as a chat in which the user asks for it by its title.
#
# Writes
# - `experiments/tiny_model/`: a Hugging Face checkpoint directory (config.json,
#   model.safetensors, tokenizer.json, tokenizer_config.json with the chat template,
#   generation_config.json) that `gemma.from_pretrained` and `gemma.load_tokenizer` load;
#   committed, so demos need no training (`make tiny-model` rebuilds it);
# - `experiments/tiny_model_orbax/`: the same model as an Orbax checkpoint (not committed);
# - `experiments/results/train_tiny.json`: parameters, versions, loss curve and greedy samples
#   generated with `swajax.generate`.
#
# Run: `python experiments/train_tiny.py [--steps N] [--out DIR]`.

# %%
from __future__ import annotations

import argparse
import json
import platform
import re
import shutil
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import gemma
import swajax

HERE = Path(__file__).resolve().parent
CORPUS = HERE / "data" / "nursery_rhymes.txt"
SPECIAL_TOKENS = [
    "<pad>",
    "<eos>",
    "<bos>",
    "<unk>",
    "<mask>",
    "<start_of_turn>",
    "<end_of_turn>",
]
BYTE_TOKENS = [f"<0x{b:02X}>" for b in range(256)]
# Gemma 3's chat format; system text joins the first user turn.
CHAT_TEMPLATE = """\
{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = '' -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif -%}
    {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}
    {{- message['content'] | trim }}
    {{- '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<start_of_turn>model\\n' }}
{%- endif -%}
"""


def read_rhymes(path: Path = CORPUS) -> list[tuple[str, str]]:
    """(title, text) of every rhyme: blocks separated by blank lines, title first."""
    lines = [line for line in path.read_text().splitlines() if not line.startswith("#")]
    blocks = [b.strip() for b in re.split(r"\n\s*\n", "\n".join(lines)) if b.strip()]
    return [(b.split("\n", 1)[0], b.split("\n", 1)[1]) for b in blocks]


def chat_request(title: str) -> str:
    return f"Say the rhyme {title}."


# %% [markdown]
# ## Tokenizer

# %%


def train_tokenizer(texts: list[str], vocab_size: int):
    """A Gemma-shaped byte-fallback BPE `tokenizers.Tokenizer` trained on `texts`."""
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers, processors
    from tokenizers.models import BPE
    from tokenizers.trainers import BpeTrainer

    learner = Tokenizer(BPE(unk_token="<unk>"))
    learner.normalizer = normalizers.Replace(" ", "▁")
    trained_size = vocab_size - len(SPECIAL_TOKENS) - len(BYTE_TOKENS)
    learner.train_from_iterator(
        texts, trainer=BpeTrainer(vocab_size=trained_size, show_progress=False)
    )
    trained = json.loads(learner.to_str())["model"]
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS + BYTE_TOKENS)}
    for token, _ in sorted(trained["vocab"].items(), key=lambda kv: kv[1]):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in trained["merges"]]
    tok = Tokenizer(
        BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True)
    )
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", vocab["<bos>"])]
    )
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tok


def write_tokenizer(tok, directory: Path) -> None:
    """tokenizer.json, tokenizer_config.json (with the chat template), generation_config.json."""
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    vocab = tok.get_vocab()
    added = {
        str(vocab[t]): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    config = {
        "tokenizer_class": "GemmaTokenizer",
        "added_tokens_decoder": added,
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "mask_token": "<mask>",
        "extra_special_tokens": ["<start_of_turn>", "<end_of_turn>"],
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {
        "bos_token_id": vocab["<bos>"],
        "eos_token_id": [vocab["<eos>"], vocab["<end_of_turn>"]],
        "pad_token_id": vocab["<pad>"],
    }
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


# %% [markdown]
# ## Model and data

# %%


def tiny_config(vocab_size: int) -> gemma.TransformerConfig:
    return gemma.configs.gemma3_1b(
        num_layers=4,
        layer_types=("sliding", "sliding", "sliding", "full"),
        hidden_size=128,
        intermediate_size=384,
        num_heads=4,
        num_kv_heads=1,
        head_dim=32,
        query_pre_attn_scalar=32,
        sliding_window=64,
        vocab_size=vocab_size,
        max_context=512,
    )


def examples(tokenizer: gemma.Tokenizer, rhymes) -> list[list[int]]:
    """Token ids of every rhyme as plain text (<bos> text <eos>) and as a chat."""
    out = []
    for title, text in rhymes:
        out.append(tokenizer.encode(f"{title}\n{text}") + [tokenizer.eos_token_id])
        chat = [
            {"role": "user", "content": chat_request(title)},
            {"role": "assistant", "content": text},
        ]
        out.append(tokenizer.apply_chat_template(chat, tokenize=True))
    return out


def batches(rows: list[list[int]], batch_size: int, pad_id: int, seed: int):
    """Endless (tokens i32[B, T], mask f32[B, T-1]) batches; T is the longest row."""
    length = max(len(r) for r in rows)
    table = np.full((len(rows), length), pad_id, np.int32)
    mask = np.zeros((len(rows), length), np.float32)
    for i, r in enumerate(rows):
        table[i, : len(r)] = r
        mask[i, : len(r)] = 1.0
    rng = np.random.default_rng(seed)
    while True:
        pick = rng.choice(len(rows), batch_size, replace=False)
        yield jnp.asarray(table[pick]), jnp.asarray(mask[pick, 1:])


def loss_fn(model, tokens, mask):
    logits = model(tokens[:, :-1])  # [B, T-1, V]
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
    return jnp.sum(losses * mask) / jnp.sum(mask)


@nnx.jit
def train_step(model, optimizer, tokens, mask):
    loss, grads = nnx.value_and_grad(loss_fn)(model, tokens, mask)
    optimizer.update(model, grads)
    return loss


# %% [markdown]
# ## Train, save, generate

# %%


def greedy_samples(model, tokenizer, rhymes, max_new_tokens: int = 64) -> list[dict]:
    """Greedy continuations (swajax.generate on the paged cache) of a plain and a chat prompt."""
    title, text = rhymes[0]
    first_line = text.split("\n", 1)[0]
    plain = tokenizer.encode(f"{title}\n{first_line}\n")
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": chat_request(rhymes[1][0])}],
        add_generation_prompt=True,
        tokenize=True,
    )
    outputs = swajax.generate(
        model,
        [plain, chat],
        max_new_tokens,
        kv_cache=swajax.KVCacheConfig(page_size=16),
        implementation="reference",
    )
    samples = []
    for prompt, out in zip([plain, chat], outputs, strict=True):
        stop = next((k for k, t in enumerate(out) if t in tokenizer.eos_token_ids), len(out))
        samples.append(
            {
                "prompt": tokenizer.decode(prompt),
                "completion": tokenizer.decode(out[:stop]),
                "stopped": stop < len(out),
            }
        )
    return samples


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--vocab-size", type=int, default=640)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--sample-tokens", type=int, default=64, help="greedy tokens per sample (0: no samples)"
    )
    parser.add_argument("--out", type=Path, default=HERE / "tiny_model")
    parser.add_argument("--orbax-out", type=Path, default=HERE / "tiny_model_orbax")
    parser.add_argument("--results", type=Path, default=HERE / "results" / "train_tiny.json")
    args = parser.parse_args(argv)

    rhymes = read_rhymes()
    corpus_lines = [line for title, text in rhymes for line in [title, *text.split("\n")]]
    corpus_lines += [chat_request(title) for title, _ in rhymes]
    hf_tok = train_tokenizer(corpus_lines, args.vocab_size)
    if args.out.exists():
        shutil.rmtree(args.out)
    write_tokenizer(hf_tok, args.out)
    tokenizer = gemma.load_tokenizer(args.out)
    rows = examples(tokenizer, rhymes)
    config = tiny_config(tokenizer.vocab_size)

    model = gemma.Transformer(config, rngs=nnx.Rngs(args.seed))
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, args.lr, warmup_steps=min(50, args.steps // 10 + 1), decay_steps=args.steps
    )
    optimizer = nnx.Optimizer(model, optax.adamw(schedule, weight_decay=0.01), wrt=nnx.Param)
    data = batches(rows, args.batch_size, tokenizer.pad_token_id, args.seed)
    losses, start = [], time.perf_counter()
    for step in range(args.steps):
        tokens, mask = next(data)
        losses.append(float(train_step(model, optimizer, tokens, mask)))
        if step % 100 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {losses[-1]:.3f}  ({time.perf_counter() - start:.0f} s)")
    train_seconds = time.perf_counter() - start

    gemma.save_pretrained(model, args.out)
    gemma.save_params(model, args.orbax_out.resolve(), overwrite=True)
    samples = (
        greedy_samples(model, tokenizer, rhymes, args.sample_tokens) if args.sample_tokens else []
    )
    for s in samples:
        print(f"--- {s['prompt']!r}\n{s['completion']}")
    result = {
        "machine": platform.platform(),
        "devices": [str(d) for d in jax.devices()],
        "git_commit": _git_commit(),
        "versions": {"jax": jax.__version__, "optax": optax.__version__},
        "parameters": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "config": gemma.config_to_hf(config),
        "num_examples": len(rows),
        "train_seconds": round(train_seconds, 1),
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "loss_every_50": losses[::50],
        "samples": samples,
    }
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(result, indent=2) + "\n")
    return result


def _git_commit() -> str | None:
    """The full commit of the checkout (experiments._meta's rule)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from experiments._meta import git_commit

    return git_commit()


if __name__ == "__main__":
    main()
