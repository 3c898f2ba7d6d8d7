"""Per-device memory of Gemma 4 31B and Gemma 3 27B under tensor parallelism (tp = 1, 2, 4, 8).

Computed, not measured: the parameters from the abstract model (`jax.eval_shape`, no weights)
and the split of `gemma._sharding` (`device_bytes`), the KV pool from the layout
(`swajax.pool.make_layout(..., tp=)`, per-device bytes of a slot). For each tp it gives

  params      parameter bytes on one device (bf16);
  kv/token    KV bytes one token costs one device in all full layers and in all sliding layers
              (bf16 KV; sliding layers hold only their window, so this is what a token costs
              while it is in the window);
  pool        what is left of an 80 GB H100 and a 141 GB H200 for the KV pool after the
              parameters, at the default fraction 0.9 of free memory (activations and XLA
              workspace not counted), and the tokens of history the full layers can hold in it,
              summed over sequences (the default pool ratio for a typical batch of 32
              sequences of 32K tokens, chunk 8K, splits the pool between full and sliding
              layers).

The KV heads of a pool root are split over tp where tp divides them, else each device holds
one whole KV head (`gemma._mesh.stored_kv_heads`): Gemma 4 31B's full layers have 4 KV heads,
so at tp = 8 their per-device bytes stop halving.

Writes experiments/results/tp_memory.json (versions, every parameter, the rows) and prints a
table.

    .venv/bin/python experiments/tp_memory.py [--out experiments/results]
"""

# %%
from __future__ import annotations

import argparse
import json
import pathlib
import sys

import jax.numpy as jnp

import gemma
import swajax
from gemma._checkpoint import abstract_model
from gemma._sharding import device_bytes

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from _meta import run_metadata  # noqa: E402

PRESETS = ("gemma4_31b", "gemma3_27b")
TPS = (1, 2, 4, 8)
DEVICES = {"H100-80GB": 80 * 10**9, "H200-141GB": 141 * 10**9}
FREE_FRACTION = 0.9  # swajax._budget.DEFAULT_FREE_MEMORY_FRACTION
PAGE_SIZE = 32
MAX_CONTEXT = 32768
BATCH = 32
LAYOUT_ROWS = 4096  # rows of the layout: high, so no group is capped at what its rows can hold
CHUNK = 8192
GiB = 2**30


def kv_layout(config, tp: int, quota: int):
    cfg = swajax.KVCacheConfig(
        page_size=PAGE_SIZE,
        max_gpu_total_bytes=quota,
        dtype=jnp.bfloat16,
        expected_batch_size=BATCH,
        expected_input_length=MAX_CONTEXT,
        chunk_size=CHUNK,
    )
    return swajax.pool.make_layout(
        config.layer_specs,
        cfg,
        max_context=MAX_CONTEXT,
        max_batch=LAYOUT_ROWS,
        max_chunk=CHUNK,
        tp=tp,
    )


def memory_rows(presets=PRESETS, tps=TPS) -> list[dict]:
    rows = []
    for name in presets:
        config = gemma.configs.preset(name)
        model = abstract_model(config, jnp.bfloat16)
        for tp in tps:
            params = device_bytes(model, tp)
            probe = kv_layout(config, tp, 1 << 40)
            per_token = {
                ("full" if g.window is None else "sliding"): probe.slot_bytes(i) // PAGE_SIZE
                for i, g in enumerate(probe.groups)
            }
            row = dict(
                preset=name,
                tp=tp,
                param_bytes=params,
                kv_bytes_per_token=per_token,
                kv_heads=[
                    dict(
                        window=probe.groups[p.group].window,
                        num_kv_heads=p.num_kv_heads,
                        stored_kv_heads=p.stored_kv_heads,
                        device_kv_heads=p.device_kv_heads,
                    )
                    for p in probe.pools
                ],
                devices={},
            )
            for device, hbm in DEVICES.items():
                quota = int(FREE_FRACTION * (hbm - params))
                entry = dict(pool_bytes=max(quota, 0))
                if quota > 0:
                    layout = kv_layout(config, tp, quota)
                    full = [i for i, g in enumerate(layout.groups) if g.window is None]
                    entry.update(
                        num_slots=[g.num_slots for g in layout.groups],
                        full_history_tokens=sum(layout.groups[i].num_slots for i in full)
                        * PAGE_SIZE,
                    )
                row["devices"][device] = entry
            rows.append(row)
    return rows


def table(rows) -> str:
    head = (
        f"{'preset':<12} {'tp':>2} {'params GiB':>10} {'full B/tok':>10} {'slid B/tok':>10}"
        + "".join(f" {d + ' pool GiB':>18} {'tokens':>9}" for d in DEVICES)
    )
    lines = [head]
    for r in rows:
        line = (
            f"{r['preset']:<12} {r['tp']:>2} {r['param_bytes'] / GiB:>10.2f} "
            f"{r['kv_bytes_per_token']['full']:>10} {r['kv_bytes_per_token']['sliding']:>10}"
        )
        for d in DEVICES:
            e = r["devices"][d]
            line += f" {e['pool_bytes'] / GiB:>18.2f} {e.get('full_history_tokens', 0):>9}"
        lines.append(line)
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results"))
    args = parser.parse_args(argv)
    rows = memory_rows()
    print(table(rows))
    record = run_metadata(
        presets=PRESETS,
        tps=TPS,
        devices=DEVICES,
        free_fraction=FREE_FRACTION,
        page_size=PAGE_SIZE,
        max_context=MAX_CONTEXT,
        batch=BATCH,
        layout_rows=LAYOUT_ROWS,
        chunk=CHUNK,
        param_dtype="bfloat16",
        kv_dtype="bfloat16",
    )
    record["note"] = (
        "computed from jax.eval_shape and the layout, not measured; pool = 0.9 * (HBM - "
        "params per device), activations and workspace not counted; full_history_tokens: "
        "tokens of history the full-attention layers hold with the default pool ratio"
    )
    record["rows"] = rows
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tp_memory.json").write_text(json.dumps(record, indent=1) + "\n")
    return rows


if __name__ == "__main__":
    main()
