"""KV bytes per sequence of every Gemma 3 / Gemma 4 text preset, with and without SWA scratch reuse.

For each preset and input length (2K, 8K, 32K, 128K tokens, prefilled in chunks of 8K, bf16 KV,
page size 32) it computes, from the layer specs alone (no weights), the KV bytes one sequence
holds in three modes:

  full     every layer keeps every block (no out-of-window release);
  release  sliding layers release blocks that fell out of their window after each step;
  scratch  release + SWA scratch reuse: the stale part of a prefill chunk lives in a few
           scratch slots shared by all sliding layers of a pool, one layer after the other.

"steady" is what the sequence holds after its prefill, "peak" the most it holds during it
(after a step's reserve). The numbers come from `swajax.pool.kv_bytes_per_sequence`, a step-by-step
simulation of the pool's bookkeeping; they are cross-checked against the slots a real
`swajax.Engine` run holds (tiny random Gemma 4 E2B- and Gemma 3-shaped models on CPU).

Writes experiments/results/kv_memory.json (versions, every parameter, the table, the
cross-check) and kv_memory.png, and prints a short table.

    .venv/bin/python experiments/kv_memory.py [--no-engine] [--out experiments/results]
"""

# %%
from __future__ import annotations

import argparse
import importlib.metadata
import json
import pathlib
import platform
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

import gemma
import swajax
from swajax.main import tiny_e2b  # the `make run` model: Gemma 4 E2B's structure made tiny

PRESETS = (
    "gemma3_270m",
    "gemma3_1b",
    "gemma3_4b",
    "gemma3_12b",
    "gemma3_27b",
    "gemma4_e2b",
    "gemma4_e4b",
    "gemma4_12b",
    "gemma4_26b_a4b",
    "gemma4_31b",
)
INPUT_LENGTHS = (2048, 8192, 32768, 131072)
CHUNK = 8192
PAGE_SIZE = 32
KV_DTYPE = "bfloat16"
MODES = ("full", "release", "scratch")
HEADLINE = ("gemma4_e2b", 8192)
MiB = 2**20
RESULTS = pathlib.Path(__file__).resolve().parent / "results"


# %% [markdown]
# ## The table, from layer specs alone
#
# `config.layer_specs` of a full-size preset is cheap (no parameters are built), and the
# per-sequence byte counts depend only on the specs, the page size, the KV dtype and the chunk.


# %%
def preset_facts(config: gemma.TransformerConfig, dtype: str = KV_DTYPE) -> dict:
    """The facts of a preset that decide its KV bytes."""
    return {
        "family": config.family,
        "num_layers": config.num_layers,
        "kv_writer_layers": config.kv_layer_counts,
        "num_kv_shared_layers": config.num_kv_shared_layers,
        "sliding_window": config.sliding_window,
        "kv_bytes_per_token_per_layer": config.kv_bytes_per_token(dtype),
        "max_context": config.max_context,
    }


def memory_rows(
    presets=PRESETS,
    input_lengths=INPUT_LENGTHS,
    *,
    chunk: int = CHUNK,
    page_size: int = PAGE_SIZE,
    dtype: str = KV_DTYPE,
) -> list[dict]:
    """One row per (preset, input length): steady and peak KV bytes of one sequence per mode."""
    kv_cache_config = swajax.KVCacheConfig(page_size=page_size, dtype=dtype)
    rows = []
    for name in presets:
        config = gemma.configs.preset(name)
        specs = config.layer_specs
        for input_len in input_lengths:
            row = {"preset": name, "family": config.family, "input_len": input_len}
            for mode in MODES:
                kv = swajax.pool.kv_bytes_per_sequence(
                    specs, input_len, chunk, mode, kv_cache_config=kv_cache_config
                )
                row[mode] = {"steady": kv.steady, "peak": kv.peak}
            # the saving of scratch reuse over plain out-of-window release, at the peak
            row["scratch_saving_pct"] = 100.0 * (
                1 - row["scratch"]["peak"] / row["release"]["peak"]
            )
            # the presets' released context limit; longer rows are what the layout would need
            row["beyond_max_context"] = input_len > config.max_context
            rows.append(row)
    return rows


def headline(rows: list[dict], preset: str = HEADLINE[0], input_len: int = HEADLINE[1]) -> dict:
    """Peak bytes of one `preset` sequence of `input_len` tokens with and without scratch."""
    (row,) = [r for r in rows if r["preset"] == preset and r["input_len"] == input_len]
    return {
        "preset": preset,
        "input_len": input_len,
        "peak_bytes_without_scratch": row["release"]["peak"],
        "peak_bytes_with_scratch": row["scratch"]["peak"],
        "peak_bytes_full": row["full"]["peak"],
        "saving_pct": row["scratch_saving_pct"],
    }


def format_table(rows: list[dict]) -> str:
    """The printed table, MiB per sequence."""
    head = (
        f"{'preset':<15}{'input':>7}{'full':>10}{'release':>10}{'peak':>10}"
        f"{'scratch':>10}{'peak':>10}{'saving':>8}"
    )
    sub = f"{'':<15}{'tokens':>7}{'MiB':>10}{'steady':>10}{'':>10}{'steady':>10}{'':>10}{'%':>8}"
    lines = [head, sub]
    for r in rows:
        mark = "*" if r["beyond_max_context"] else " "
        lines.append(
            f"{r['preset']:<15}{r['input_len'] // 1024:>5}K{mark}"
            f"{r['full']['peak'] / MiB:>10.1f}"
            f"{r['release']['steady'] / MiB:>10.1f}{r['release']['peak'] / MiB:>10.1f}"
            f"{r['scratch']['steady'] / MiB:>10.1f}{r['scratch']['peak'] / MiB:>10.1f}"
            f"{r['scratch_saving_pct']:>7.1f}%"
        )
    lines.append(
        "saving = 1 - scratch peak / release peak.  * beyond the preset's max_context "
        "(the layout's need if it were served)."
    )
    return "\n".join(lines)


# %% [markdown]
# ## Cross-check against a real engine run
#
# The engine records the most slots each pool group held after any step's reserve
# (`RunStats.peak_slots`). With one prompt and `max_new_tokens=1` the engine runs exactly the
# prefill steps (the last prefill step samples the one new token), so
# `sum_g peak_slots[g] * layout.slot_bytes(g)` must equal `kv_bytes_per_sequence(layout, ...)
# .peak`. With more new tokens the engine also runs `max_new_tokens - 1` decode steps; those
# are compared with `request_slots(layout, ..., max_new_tokens=max_new_tokens - 1)`.


# %%
def tiny_gemma3(num_layers: int = 8) -> gemma.TransformerConfig:
    """Gemma 3's structure (5:1 sliding/full, one KV head) made tiny."""
    return gemma.configs.gemma3_1b(
        num_layers=num_layers,
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_heads=2,
        num_kv_heads=1,
        head_dim=32,
        query_pre_attn_scalar=32,
        sliding_window=32,
        max_context=4096,
    )


def micro_e2b() -> gemma.TransformerConfig:
    """Four layers with E2B's features (KV sharing, PLE, 256/512-wide head split made tiny).

    Layer 3 is KV-shared and reads sliding layer 1; smallest model that still exercises a
    shared-KV reader with scratch on (for the smoke test: the compile time is what matters).
    """
    return gemma.configs.gemma4_e2b(
        num_layers=4,
        layer_types=("sliding", "sliding", "full", "sliding"),
        num_kv_shared_layers=1,
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        global_head_dim=32,
        sliding_window=32,
        per_layer_input_dim=4,
        max_context=1024,
    )


def engine_cross_check(
    name: str,
    config: gemma.TransformerConfig,
    *,
    prompt_len: int,
    chunk: int,
    page_size: int,
    max_new_tokens: int = 1,
    dtype: str = KV_DTYPE,
) -> list[dict]:
    """Runs one prompt through `swajax.Engine` with scratch off and on; compares its peak slots.

    Returns one record per scratch setting with the engine's peak slots per pool group, their
    bytes, and what the budget simulation predicts for the same layout and steps.
    """
    from flax import nnx

    model = gemma.Transformer(config, rngs=nnx.Rngs(0), dtype=jnp.float32)
    prompt = np.random.default_rng(0).integers(1, config.vocab_size, size=prompt_len).tolist()
    records, outputs = [], []
    for scratch in (False, True):
        kv_cache_config = swajax.KVCacheConfig(
            page_size=page_size,
            dtype=dtype,
            enable_swa_scratch_reuse=scratch,
            # a quota far above one sequence's need: slots are then capped at what one row can
            # ever hold, and the peak is the sequence's own
            max_gpu_total_bytes=256 * MiB,
        )
        engine = swajax.Engine(
            model,
            kv_cache_config,
            max_context=prompt_len + max_new_tokens,
            max_batch=1,
            prefill_chunk_size=chunk,
            implementation="reference",
            min_prefill_bucket=chunk,  # one compiled prefill variant
            # one sequence's own KV: no rewind pages, no parked prefix
            enable_prefix_caching=False,
        )
        out, stats = engine.run([prompt], max_new_tokens)
        outputs.append(out)
        layout = engine.layout
        mode = "scratch" if scratch else "release"
        slot_bytes = [layout.slot_bytes(g) for g in range(len(layout.groups))]
        engine_bytes = sum(n * b for n, b in zip(stats.peak_slots, slot_bytes, strict=True))
        predicted = swajax.pool.kv_bytes_per_sequence(layout, prompt_len, chunk, mode)
        # the engine runs max_new_tokens - 1 decode steps after the prefill
        predicted_slots = swajax.pool.request_slots(
            layout, prompt_len, chunk=chunk, max_new_tokens=max_new_tokens - 1
        )
        record = {
            "model": name,
            "mode": mode,
            "prompt_len": prompt_len,
            "chunk": chunk,
            "page_size": page_size,
            "kv_dtype": dtype,
            "max_new_tokens": max_new_tokens,
            "engine_steps": stats.steps,
            "groups": [
                "sliding" if g.is_sliding else "full" for g in layout.groups
            ],  # layout group order
            "slot_bytes": slot_bytes,
            "engine_peak_slots": list(stats.peak_slots),
            "predicted_peak_slots": list(predicted_slots),
            "engine_peak_bytes": engine_bytes,
            "kv_bytes_per_sequence": {"steady": predicted.steady, "peak": predicted.peak},
            "slots_agree": list(stats.peak_slots) == list(predicted_slots),
        }
        if max_new_tokens == 1:
            record["bytes_agree"] = engine_bytes == predicted.peak
        records.append(record)
    for r in records:
        r["same_tokens_scratch_on_off"] = outputs[0] == outputs[1]
    return records


def cross_checks(fast: bool = False) -> list[dict]:
    """The cross-checks recorded in the JSON (fast=True: smaller, for the smoke test)."""
    if fast:
        cases = [("micro_e2b", micro_e2b(), dict(prompt_len=160, chunk=64, page_size=16))]
    else:
        cases = [
            ("tiny_e2b", tiny_e2b(), dict(prompt_len=600, chunk=128, page_size=16)),
            ("tiny_gemma3", tiny_gemma3(), dict(prompt_len=600, chunk=128, page_size=16)),
        ]
    records = []
    for name, config, kw in cases:
        records += engine_cross_check(name, config, max_new_tokens=1, **kw)
        if not fast:
            records += engine_cross_check(name, config, max_new_tokens=4, **kw)
    return records


# %% [markdown]
# ## Plot and report


# %%
def plot(rows: list[dict], path: pathlib.Path | None = None):
    """One panel per preset (rows: Gemma 3, Gemma 4): MiB (log) vs input length per mode."""
    import matplotlib.pyplot as plt

    presets = list(dict.fromkeys(r["preset"] for r in rows))
    families = list(dict.fromkeys(r["family"] for r in rows))
    cols = max(sum(1 for p in presets if p.startswith(f)) for f in families)
    fig, axes = plt.subplots(
        len(families), cols, figsize=(3.2 * cols, 3.0 * len(families)), squeeze=False
    )
    styles = [
        ("full", "peak", "full (steady = peak)", dict(color="0.4", ls="-", marker="s")),
        ("release", "peak", "release: peak", dict(color="tab:blue", ls="--", marker="o")),
        ("scratch", "peak", "scratch: peak", dict(color="tab:red", ls="--", marker="^")),
        ("scratch", "steady", "steady (release = scratch)", dict(color="k", ls="-", marker=".")),
    ]
    for ax in axes.flat:
        ax.set_visible(False)
    for fi, family in enumerate(families):
        for ci, preset in enumerate(p for p in presets if p.startswith(family)):
            ax = axes[fi, ci]
            ax.set_visible(True)
            pr = [r for r in rows if r["preset"] == preset]
            x = [r["input_len"] for r in pr]
            for mode, kind, label, style in styles:
                ax.plot(x, [r[mode][kind] / MiB for r in pr], label=label, ms=4, **style)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xticks(x, [f"{n // 1024}K" for n in x])
            ax.set_title(preset, fontsize=10)
            ax.grid(True, which="both", alpha=0.3)
            if ci == 0:
                ax.set_ylabel("KV MiB per sequence")
            if fi == len(families) - 1:
                ax.set_xlabel("input length (tokens)")
    axes[0, 0].legend(fontsize=7, loc="upper left")
    fig.suptitle(
        f"KV bytes per sequence, {KV_DTYPE} KV, page {PAGE_SIZE}, prefill chunk {CHUNK // 1024}K",
        fontsize=11,
    )
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig


def git_commit() -> str | None:
    """The full commit of the checkout (experiments._meta's rule: $SWAJAX_GIT_COMMIT wins)."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    from experiments._meta import git_commit as commit

    return commit()


def versions() -> dict:
    def version(dist):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    try:
        commit = subprocess.run(
            ["git", "describe", "--always", "--dirty"],
            cwd=pathlib.Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = None
    return {
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": version("jaxlib"),
        "flax": version("flax"),
        "numpy": np.__version__,
        "swajax": version("swajax"),
        "swajax_git": commit,
    }


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=pathlib.Path, default=RESULTS)
    p.add_argument("--no-engine", action="store_true", help="skip the engine cross-check")
    args = p.parse_args(argv)

    rows = memory_rows()
    print(format_table(rows))
    h = headline(rows)
    print(
        f"\nheadline: Gemma 4 E2B at {h['input_len'] // 1024}K: peak "
        f"{h['peak_bytes_without_scratch'] / MiB:.1f} MiB without scratch "
        f"({h['peak_bytes_without_scratch']:,} B), {h['peak_bytes_with_scratch'] / MiB:.1f} MiB "
        f"with scratch ({h['peak_bytes_with_scratch']:,} B): {h['saving_pct']:.1f}% less"
    )
    checks = [] if args.no_engine else cross_checks()
    if checks:
        print("\nengine cross-check (peak slots per pool group, engine vs simulation):")
    for c in checks:
        agree = c["slots_agree"] and c.get("bytes_agree", True)
        print(
            f"  {c['model']:<12} {c['mode']:<8} prompt {c['prompt_len']} chunk {c['chunk']} "
            f"new {c['max_new_tokens']}: engine {c['engine_peak_slots']} "
            f"predicted {c['predicted_peak_slots']} groups {c['groups']}; engine "
            f"{c['engine_peak_bytes']:,} B, kv_bytes_per_sequence peak "
            f"{c['kv_bytes_per_sequence']['peak']:,} B -> {'agree' if agree else 'DISAGREE'}"
        )
    result = {
        "description": (
            "KV bytes per sequence of every Gemma 3/4 text preset: every layer keeps everything "
            "(full), out-of-window release (release), release + SWA scratch reuse (scratch); "
            "steady = after the prefill, peak = most during it. From layer specs alone via "
            "swajax.pool.kv_bytes_per_sequence; device independent."
        ),
        "git_commit": git_commit(),
        "versions": versions(),
        "parameters": {
            "presets": list(PRESETS),
            "input_lengths": list(INPUT_LENGTHS),
            "prefill_chunk": CHUNK,
            "page_size": PAGE_SIZE,
            "kv_dtype": KV_DTYPE,
            "max_rewind": 0,
            "batch": 1,
            "modes": list(MODES),
        },
        "presets": {name: preset_facts(gemma.configs.preset(name)) for name in PRESETS},
        "rows": rows,
        "headline": h,
        "cross_check": {
            "method": (
                "swajax.Engine (implementation='reference', CPU), one random prompt, max_batch 1. "
                "max_new_tokens=1: the engine runs only the prefill steps, so sum_g "
                "RunStats.peak_slots[g] * layout.slot_bytes(g) must equal "
                "kv_bytes_per_sequence(layout, prompt_len, chunk, mode).peak. max_new_tokens=k: "
                "the engine also runs k-1 decode steps; peak slots are compared with "
                "request_slots(layout, prompt_len, chunk=chunk, max_new_tokens=k-1)."
            ),
            "records": checks,
        },
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kv_memory.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(rows, args.out / "kv_memory.png")
    print(f"\nwrote {args.out / 'kv_memory.json'} and {args.out / 'kv_memory.png'}")
    if not all(c["slots_agree"] and c.get("bytes_agree", True) for c in checks):
        sys.exit("engine cross-check failed: the engine's peak slots differ from the simulation")
    return result


if __name__ == "__main__":
    import matplotlib

    matplotlib.use("Agg")
    main()
