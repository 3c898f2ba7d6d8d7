"""Walkthrough of the swajax KV pool: life cycles, slots, converters, per-layer page tables and
SWA scratch reuse, step by step on a tiny layout.

It builds a 6-layer layout (5 sliding layers with window 64 sharing one pool, 1 full layer,
page size 16), runs one 400-token prompt through chunked prefill (chunk 128) and a few decode
steps with the pure transforms (`reserve`, `step_page_tables`, `advance`, `free_rows`), and
draws (a) the per-layer K page tables of the prefill steps, with the scratch rotation, and
(b) the slots each pool group holds per step, scratch on vs off; (c) prints the docs/design.md
worked example from `swajax.pool.rotation_pages`; (d) runs the same prompt through `swajax.Engine`
with a tiny random Gemma 3-shaped model of the same life cycles.

    .venv/bin/python experiments/walkthrough.py [--no-engine]

writes experiments/results/walkthrough_page_tables.png and walkthrough_occupancy.png. Opened as
a notebook (`# %%` cells: VS Code, jupytext) the figures are shown inline instead. The cells
that do work are guarded by `if __name__ == "__main__":` (true in a notebook too) so that the
tests can import the functions without running them.
"""

# %% [markdown]
# # The swajax KV pool, step by step
#
# **Life cycles.** A layer's KV goes stale by a rule `(window, sink_blocks)`: a sliding layer's
# block is stale once no later query can see it, a full layer's never. Layers with the same rule
# form a *life cycle*; Gemma 3/4 have two, sliding and full.
#
# **Pools, slots, converters.** The writer layers of one life cycle and one head geometry share a
# *pool root*, one array of pages `[pages, page_size, kv_heads, head_dim]`. The allocation unit is
# a *slot*: one token block for every (layer, role) of the pool, `scale = 2 * layers` consecutive
# pages (role 0 = K, 1 = V). The *converter* of (layer, role) turns a slot into a page:
# `page = slot * scale + layer_offset`, `layer_offset = 2*j + role` for the layer's position j in
# its pool. A sequence has one *base table* of slot ids per life cycle; **BAD = -1** marks "no
# page" and passes through every conversion unchanged.
#
# **Scratch reuse.** In a long prefill chunk, a sliding layer needs the blocks that will be
# stale by the end of the step only during its own attention. Those blocks (the *scratch
# range*) are backed by a few *scratch slots* that all sliding layers of the pool share, one
# layer after the other: the *rotation* gives each layer a different page of the same slots at
# every block, so layer j+1 overwrites what layer j no longer needs. The base table holds BAD
# there; only per-layer page tables can express the rotation.

# %%
from __future__ import annotations

import dataclasses
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

import gemma
import swajax

INTERACTIVE = "ipykernel" in sys.modules or hasattr(sys, "ps1")
if not INTERACTIVE:
    import matplotlib

    matplotlib.use("Agg")  # a script or a test: files only, no window

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.colors import to_rgba  # noqa: E402
from matplotlib.patches import Patch, Rectangle  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
WINDOW = 64
PAGE_SIZE = 16
CHUNK = 128
PROMPT_LEN = 400
DECODE_STEPS = 3


# %% [markdown]
# ## 1. A tiny layout
#
# Six layers: five sliding layers (window 64) and one full layer, each with one KV head of
# width 8. The sliding layers form one pool (`scale = 10` pages per slot), the full layer another
# (`scale = 2`). Each life cycle is a pool group with its own slot allocator. With scratch on, a
# row gets `scratch_slots` slot ids of room for a scratch range of up to `scratch_blocks` blocks.


# %%
def tiny_specs(
    num_sliding: int = 5, window: int = WINDOW, head_dim: int = 8
) -> tuple[gemma.LayerSpec, ...]:
    """`num_sliding` sliding layers then one full layer, all writing their own KV."""
    specs = [
        gemma.LayerSpec(window=window, num_kv_heads=1, head_dim=head_dim, kv_source=i)
        for i in range(num_sliding)
    ]
    specs.append(
        gemma.LayerSpec(window=None, num_kv_heads=1, head_dim=head_dim, kv_source=num_sliding)
    )
    return tuple(specs)


def build_layout(
    specs=None,
    *,
    scratch: bool = True,
    page_size: int = PAGE_SIZE,
    chunk: int = CHUNK,
    max_context: int = 512,
    num_slots: tuple[int, ...] = (24, 40),
) -> swajax.pool.KVLayout:
    """One batch row, a fixed number of slots per group (no byte budget: small readable ids)."""
    return swajax.pool.make_layout(
        tiny_specs() if specs is None else specs,
        swajax.KVCacheConfig(page_size=page_size, dtype=jnp.float32),
        max_context=max_context,
        max_batch=1,
        max_chunk=chunk,
        num_slots=num_slots,
        scratch=scratch,
    )


def describe_layout(layout: swajax.pool.KVLayout) -> str:
    lines = [f"page size {layout.page_size}, scratch {'on' if layout.scratch else 'off'}"]
    for g, group in enumerate(layout.groups):
        lines.append(
            f"pool group {g}: life cycle (window, sink_blocks) = {group.life_cycle}, "
            f"{group.num_slots} slots of {layout.slot_bytes(g)} B, pools {group.pools}, "
            f"scratch_slots {group.scratch_slots}, scratch_blocks {group.scratch_blocks}"
        )
    for p, pool in enumerate(layout.pools):
        lines.append(
            f"pool {p}: layers {pool.layers}, scale {pool.scale}, "
            f"pool root {pool.shape(layout.page_size)} {pool.dtype}"
        )
    for layer in range(layout.num_layers):
        k, v = layout.converter(layer, 0), layout.converter(layer, 1)
        lines.append(
            f"layer {layer}: K converter (pool {k.pool}, scale {k.scale}, layer_offset "
            f"{k.layer_offset}), V layer_offset {v.layer_offset}"
        )
    return "\n".join(lines)


# %%
if __name__ == "__main__":
    layout = build_layout()
    print(describe_layout(layout))


# %% [markdown]
# ## 2. Chunked prefill and decode with the pure transforms
#
# Each step: `reserve` grows the row from history `h` to `cap = h + n` (normal slots for blocks
# outside the scratch range, scratch slots for the range); `step_page_tables` builds the
# per-layer page tables the attention reads (here the forward itself is left out: the tables
# and slots are the point); `advance` sets `history := cap`, releases the blocks that fell out
# of the window (out-of-window release: they become BAD) and the scratch slots. `free_rows` ends
# the sequence. The scratch range of a step is `stale(cap) ∩ [ceil(h/tpb), ceil(cap/tpb))`
# (`max_rewind = 0`: no speculative decoding here).


# %%
@dataclasses.dataclass
class Step:
    """What one step of one row looks like, after its reserve (the step in flight)."""

    label: str
    history: int
    cap: int
    scratch_range: list[tuple[int, int]]  # per group [begin, end), (BAD, BAD) when none
    scratch_slots: list[list[int]]  # per group, this step's scratch slot ids (no BAD padding)
    tables: np.ndarray  # i32[num_layers, 2, NB]: page of (layer, role, block) for this row
    normal_slots: list[int]  # per group, slots held by base-table entries (after reserve)
    scratch_slot_count: list[int]  # per group, scratch slots held (after reserve)
    held_after: list[int]  # per group, slots held after advance / free_rows


def step_sizes(prompt_len: int, chunk: int, decode_steps: int) -> list[int]:
    """New tokens per step: the prompt in chunks, then one token per decode step."""
    chunks = [min(chunk, prompt_len - s) for s in range(0, prompt_len, chunk)]
    return chunks + [1] * decode_steps


_reserve = jax.jit(swajax.pool.reserve, static_argnums=0)
_tables = jax.jit(swajax.pool.step_page_tables, static_argnums=0)
_advance = jax.jit(swajax.pool.advance, static_argnums=0)
_free_rows = jax.jit(swajax.pool.free_rows, static_argnums=0)


def trace_steps(layout: swajax.pool.KVLayout, steps: list[int]) -> list[Step]:
    """Runs row 0 of `layout` through `steps` (new tokens per step), then frees it.

    Returns one `Step` per step plus a final "free" entry. Raises RuntimeError if a reserve
    fails (too few slots for the layout's num_slots).
    """
    state = swajax.pool.init_state(layout)
    num_slots = np.array([g.num_slots for g in layout.groups])
    num_prefill = sum(1 for n in steps if n > 1)
    out = []
    for i, n in enumerate(steps):
        ok, state = _reserve(layout, state, jnp.array([n], jnp.int32))
        if not bool(ok):
            raise RuntimeError(f"reserve of {n} tokens failed at step {i}: too few slots")
        tables = _tables(layout, state)  # per pool i32[L_p, B, 2, NB]
        per_layer = np.stack(
            [
                np.asarray(swajax.pool.layer_page_table(layout, tables, layer))[0]
                for layer in range(layout.num_layers)
            ]
        )  # [num_layers, 2, NB]
        label = f"prefill {i + 1}" if i < num_prefill else f"decode {i - num_prefill + 1}"
        h, cap = int(state.history[0]), int(state.cap[0])
        normal = [int(np.sum(np.asarray(t[0]) != swajax.pool.BAD)) for t in state.base_tables]
        scratch = [np.asarray(s[0]) for s in state.scratch_slots]
        step = Step(
            label=label,
            history=h,
            cap=cap,
            scratch_range=[tuple(int(x) for x in r[0]) for r in state.scratch_range],
            scratch_slots=[s[s != swajax.pool.BAD].tolist() for s in scratch],
            tables=per_layer,
            normal_slots=normal,
            scratch_slot_count=[int(np.sum(s != swajax.pool.BAD)) for s in scratch],
            held_after=[],
        )
        state = _advance(layout, state)
        step.held_after = (num_slots - np.asarray(state.free_count)).tolist()
        out.append(step)
    state = _free_rows(layout, state, jnp.array([True]))
    held = (num_slots - np.asarray(state.free_count)).tolist()
    out.append(Step("free", 0, 0, [], [], np.zeros((0,)), [0] * len(held), [0] * len(held), held))
    return out


def describe_steps(layout: swajax.pool.KVLayout, trace: list[Step]) -> str:
    """One line per step: h -> cap, scratch range and slots, slots held per group."""
    lines = []
    for s in trace:
        if s.label == "free":
            lines.append(f"{'free_rows':<10} slots held after: {s.held_after}")
            continue
        parts = []
        for g, group in enumerate(layout.groups):
            name = f"w{group.window}" if group.is_sliding else "full"
            begin, end = s.scratch_range[g]
            rng = f" scratch [{begin},{end}) in {s.scratch_slots[g]}" if end > begin else ""
            parts.append(
                f"{name}: {s.normal_slots[g]} normal + {s.scratch_slot_count[g]} scratch{rng}"
            )
        lines.append(
            f"{s.label:<10} {s.history:>3} -> {s.cap:<3} | "
            + " | ".join(parts)
            + f" | held after advance {s.held_after}"
        )
    return "\n".join(lines)


# %%
if __name__ == "__main__":
    steps = step_sizes(PROMPT_LEN, CHUNK, DECODE_STEPS)
    trace = trace_steps(layout, steps)
    print("scratch on (slots held right after each reserve):")
    print(describe_steps(layout, trace))


# %% [markdown]
# ## 3. (a) Per-layer page tables of the prefill steps
#
# Rows are model layers, columns blocks of `page_size` tokens; each cell is the K page of that
# (layer, block) in its pool root (the V page is always K + 1). Grey cells are **BAD**: not yet
# reserved, or released once out of the window. In the outlined scratch range the sliding layers
# rotate through one scratch slot: at every block each layer gets a different page (the colour
# is the page's index within the slot), and the pattern shifts by one page pair per layer.


# %%
NORMAL_COLOR = "#9ecae1"  # normal page of a sliding pool
FULL_COLOR = "#a1d99b"  # page of a full-layer pool
BAD_COLOR = "#e6e6e6"


def plot_page_tables(layout: swajax.pool.KVLayout, trace: list[Step], step_indices=None):
    """Heatmaps (layers x blocks) of the K page tables of the chosen steps (default: prefill)."""
    if step_indices is None:
        step_indices = [i for i, s in enumerate(trace) if s.label.startswith("prefill")]
    blocks = max(-(-trace[i].cap // layout.page_size) for i in step_indices)
    max_scale = max(p.scale for p in layout.pools)
    palette = plt.get_cmap("Oranges")(np.linspace(0.3, 0.9, max_scale // 2))
    fig, axes = plt.subplots(
        len(step_indices),
        1,
        figsize=(max(8.0, 0.42 * blocks + 2), 0.5 * layout.num_layers * len(step_indices) + 1.5),
        squeeze=False,
    )
    for ax, i in zip(axes[:, 0], step_indices, strict=True):
        s = trace[i]
        k_pages = s.tables[:, 0, :blocks]  # [num_layers, blocks]
        rgb = np.zeros((*k_pages.shape, 4))
        for layer in range(layout.num_layers):
            pool, _ = layout.layer_table_index(layer)
            group = layout.groups[layout.pools[pool].group]
            scale = layout.pools[pool].scale
            begin, end = s.scratch_range[layout.pools[pool].group]
            for o in range(blocks):
                page = int(k_pages[layer, o])
                if page == swajax.pool.BAD:
                    color = BAD_COLOR
                elif group.is_sliding and begin <= o < end:
                    color = palette[(page % scale) // 2]
                elif group.is_sliding:
                    color = NORMAL_COLOR
                else:
                    color = FULL_COLOR
                rgb[layer, o] = to_rgba(color)
                if page != swajax.pool.BAD:
                    # white digits on the dark end of the scratch shades
                    dark = np.dot(rgb[layer, o, :3], (0.299, 0.587, 0.114)) < 0.45
                    ax.text(
                        o,
                        layer,
                        str(page),
                        ha="center",
                        va="center",
                        fontsize=7,
                        color="white" if dark else "black",
                    )
        ax.imshow(rgb, aspect="auto", interpolation="nearest")
        for g, group in enumerate(layout.groups):
            begin, end = s.scratch_range[g]
            if group.is_sliding and end > begin:
                rows = [l for l in range(layout.num_layers) if layout.layer_specs[l].is_sliding]
                ax.add_patch(
                    Rectangle(
                        (begin - 0.5, min(rows) - 0.5),
                        end - begin,
                        len(rows),
                        fill=False,
                        lw=2.5,
                        ec="black",
                    )
                )
        ax.set_xticks(range(blocks))
        ax.set_xticks(np.arange(blocks + 1) - 0.5, minor=True)
        ax.set_yticks(np.arange(layout.num_layers + 1) - 0.5, minor=True)
        ax.grid(which="minor", color="white", lw=1)
        ax.tick_params(which="minor", length=0)
        ax.tick_params(axis="x", labelsize=7)
        ax.set_yticks(
            range(layout.num_layers),
            [
                f"L{l} " + ("sliding" if layout.layer_specs[l].is_sliding else "full")
                for l in range(layout.num_layers)
            ],
            fontsize=8,
        )
        rng = [f"[{b},{e})" for (b, e) in s.scratch_range if e > b]
        slots = [x for x in s.scratch_slots if x]
        ax.set_title(
            f"{s.label}: tokens {s.history} -> {s.cap}"
            + (f", scratch range {rng[0]} in scratch slots {slots[0]}" if rng else ""),
            fontsize=9,
            loc="left",
        )
    axes[-1, 0].set_xlabel(f"block ({layout.page_size} tokens)")
    handles = [
        Patch(color=NORMAL_COLOR, label="normal page (sliding pool)"),
        Patch(color=FULL_COLOR, label="page (full pool)"),
        Patch(color=palette[len(palette) // 2], label="scratch page (shade: page within slot)"),
        Patch(color=BAD_COLOR, label="BAD (-1)"),
        Patch(fill=False, ec="black", lw=2.5, label="scratch range"),
    ]
    fig.legend(handles=handles, loc="lower center", ncol=5, fontsize=8, frameon=False)
    fig.suptitle("Per-layer K page tables (number = K page in its pool root; V page = K + 1)")
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    return fig


# %%
if __name__ == "__main__":
    fig_tables = plot_page_tables(layout, trace)


# %% [markdown]
# ## 4. (b) Slots held per pool group, scratch on vs off
#
# Bars: slots the row holds right after each step's `reserve` with scratch on (normal slots
# plus scratch slots). Black markers: the same with scratch off, where every sliding layer keeps
# its whole chunk in normal pages until `advance` releases it. Diamonds: what the row keeps
# after `advance` (the window, once released). The full group is the same in both; the sliding
# group's prefill peak shrinks.


# %%
def plot_occupancy(layout: swajax.pool.KVLayout, trace_on: list[Step], trace_off: list[Step]):
    """Per pool group: normal + scratch slots after each reserve; scratch-off totals as markers."""
    steps_on = [s for s in trace_on if s.label != "free"]
    steps_off = [s for s in trace_off if s.label != "free"]
    x = np.arange(len(steps_on))
    labels = [f"{s.label}\n{s.history}->{s.cap}" for s in steps_on]
    fig, axes = plt.subplots(1, len(layout.groups), figsize=(6 * len(layout.groups), 4.2))
    for g, (ax, group) in enumerate(zip(np.atleast_1d(axes), layout.groups, strict=True)):
        normal = np.array([s.normal_slots[g] for s in steps_on])
        scratch = np.array([s.scratch_slot_count[g] for s in steps_on])
        off = np.array([s.normal_slots[g] + s.scratch_slot_count[g] for s in steps_off])
        after = np.array([s.held_after[g] for s in steps_on])
        ax.bar(x, normal, color=NORMAL_COLOR if group.is_sliding else FULL_COLOR, label="normal")
        if scratch.any():
            ax.bar(x, scratch, bottom=normal, color="tab:orange", label="scratch")
        ax.plot(x, off, "k_", ms=22, mew=2.5, label="scratch off")
        ax.plot(x, after, "D", color="tab:purple", ms=5, label="after advance (scratch on)")
        for xi, total in enumerate(normal + scratch):
            ax.text(xi, total - 0.2, str(total), ha="center", va="top", fontsize=8)
        name = f"sliding (window {group.window})" if group.is_sliding else "full"
        ax.set_title(
            f"pool group {g}: {name}, slot = {layout.slot_bytes(g)} B; peak "
            f"{max(normal + scratch)} on / {max(off)} off",
            fontsize=9,
        )
        ax.set_xticks(x, labels, fontsize=7)
        ax.set_ylabel("slots held after reserve")
        ax.set_ylim(0, max(off.max(), (normal + scratch).max()) * 1.15 + 1)
        # sliding: prefill peaks on the left; full: history grows to the right
        ax.legend(fontsize=8, loc="upper right" if group.is_sliding else "upper left")
    fig.suptitle(f"Slot occupancy of one {trace_on[-2].cap}-token sequence, per step")
    fig.tight_layout()
    return fig


# %%
if __name__ == "__main__":
    layout_off = build_layout(scratch=False)
    trace_off = trace_steps(layout_off, steps)
    print("scratch off:")
    print(describe_steps(layout_off, trace_off))
    fig_occupancy = plot_occupancy(layout, trace, trace_off)


# %% [markdown]
# ## 5. (c) The docs/design.md worked example
#
# A pool of three sliding layers (`scale = 6`), scratch range blocks 4..8 (five blocks, so
# `ceil(5*2/6) = 2` scratch slots, ids 7 and 9). `swajax.pool.rotation_pages` gives the pages of one
# (layer, role); within a column no page repeats, and V = K + 1.


# %%
def worked_example(
    num_layers: int = 3, begin: int = 4, end: int = 9, scratch_slots=(7, 9)
) -> np.ndarray:
    """i32[num_layers, end - begin, 2]: K/V page of each (layer, block) of the scratch range."""
    scale = 2 * num_layers
    return np.stack(
        [
            np.stack(
                [
                    swajax.pool.rotation_pages(
                        begin, end, scratch_slots, scale=scale, layer_offset=2 * j + role
                    )
                    for role in (0, 1)
                ],
                axis=-1,
            )
            for j in range(num_layers)
        ]
    )


def format_worked_example(pages: np.ndarray, begin: int = 4) -> str:
    header = "| layer | " + " | ".join(f"block {begin + o}" for o in range(pages.shape[1])) + " |"
    lines = [header, "|---" * (pages.shape[1] + 1) + "|"]
    for j, row in enumerate(pages):
        lines.append(f"| {j} | " + " | ".join(f"{k}/{v}" for k, v in row) + " |")
    return "\n".join(lines)


# %%
if __name__ == "__main__":
    print(format_worked_example(worked_example()))


# %% [markdown]
# ## 6. (d) End to end: the engine with a tiny random model
#
# A Gemma 3-shaped model with six layers has the same life cycles as the layout above (five
# sliding layers with window 64, then one full layer). `swajax.Engine` runs the same prompt
# with scratch on and off: the greedy tokens agree, and the peak slots per pool group equal
# the peak of the transform trace above (the engine's last prefill step samples the first new
# token, so `max_new_tokens = DECODE_STEPS + 1` runs the same steps).


# %%
def run_engine(prompt_len: int = PROMPT_LEN, decode_steps: int = DECODE_STEPS) -> dict:
    """Greedy generation with a tiny random Gemma 3 model, scratch on and off."""
    from flax import nnx

    config = gemma.configs.gemma3_1b(
        num_layers=6,
        sliding_window=WINDOW,
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        num_kv_heads=1,
        head_dim=8,
        query_pre_attn_scalar=8,
        max_context=1024,
    )
    model = gemma.Transformer(config, rngs=nnx.Rngs(0), dtype=jnp.float32)
    prompt = np.random.default_rng(0).integers(1, config.vocab_size, size=prompt_len).tolist()
    result = {}
    for scratch in (True, False):
        engine = swajax.Engine(
            model,
            swajax.KVCacheConfig(
                page_size=PAGE_SIZE,
                dtype=jnp.float32,
                enable_swa_scratch_reuse=scratch,
                max_gpu_total_bytes=2**24,
            ),
            max_context=prompt_len + decode_steps + 1,
            max_batch=1,
            prefill_chunk_size=CHUNK,
            implementation="reference",
            enable_prefix_caching=False,  # the pages of the sequence alone
            min_prefill_bucket=CHUNK,
        )
        out, stats = engine.run([prompt], decode_steps + 1)
        result[scratch] = (out[0], stats.peak_slots)
    return result


# %%
if __name__ == "__main__" and "--no-engine" not in sys.argv:
    engine_result = run_engine()
    for scratch, (tokens, peak) in engine_result.items():
        trace_peak = [
            max(
                s.normal_slots[g] + s.scratch_slot_count[g]
                for s in (trace if scratch else trace_off)
            )
            for g in range(len(layout.groups))
        ]
        print(
            f"engine scratch {'on ' if scratch else 'off'}: tokens {tokens}, peak slots {peak}, "
            f"transform trace peak {trace_peak}"
        )
    print("same tokens scratch on/off:", engine_result[True][0] == engine_result[False][0])


# %%
if __name__ == "__main__":
    if INTERACTIVE:
        plt.show()
    else:
        RESULTS.mkdir(parents=True, exist_ok=True)
        fig_tables.savefig(RESULTS / "walkthrough_page_tables.png", dpi=130)
        fig_occupancy.savefig(RESULTS / "walkthrough_occupancy.png", dpi=130)
        print(f"wrote {RESULTS / 'walkthrough_page_tables.png'} and walkthrough_occupancy.png")
