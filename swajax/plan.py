"""The KV memory plan of a model config: what `python -m swajax info` prints.

This module owns `memory_plan` (the KV layout, pool groups, slot sizes and per-sequence KV
bytes with SWA scratch reuse off and on, computed from a config alone: parameters are sized
with `jax.eval_shape`, nothing is allocated) and `format_plan`, its text form. `memory_plan`
imports gemma when called (the `swajax` package itself does not).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Mapping

from swajax import _validate
from swajax._budget import kv_bytes_per_sequence, kv_quota_bytes, make_layout, request_slots
from swajax._config import KVCacheConfig, resolve_scratch_policy
from swajax.jsonl import group_names

DEFAULT_CHUNK = 8192  # the engine's default step budget (and so its prefill chunk)
DEFAULT_INFO_LENGTH = 8192


def memory_plan(
    config,
    kv_cache_config: KVCacheConfig | None = None,
    *,
    max_context: int | None = None,
    max_batch: int = 16,
    chunk: int | None = None,
    input_len: int | None = None,
    param_dtype: str = "bfloat16",
) -> dict:
    """The KV layout and memory plan of a model config, without allocating anything.

    Parameters are counted on `jax.eval_shape`'s abstract model. For scratch reuse off
    ("release": out-of-window release only) and on ("scratch"): the pool groups and pools of
    the layout for `max_context` / `max_batch` / `chunk`, slots per group from the KV quota
    (`kv_cache_config`; default: the device's free memory), KV bytes of one `input_len`-token
    sequence prefilled in chunks (steady and peak, `swajax.pool.kv_bytes_per_sequence`; also "full",
    nothing released), its peak slots, and how many such sequences the pool holds at once.
    `used` names the mode the config's scratch policy picks. max_context (default: the
    model's), max_batch, chunk (default 8192) and input_len (default 8192) must be ints >= 1
    (ValueError otherwise); chunk and input_len are capped at max_context.
    """
    cfg = kv_cache_config or KVCacheConfig()
    if max_context is None:
        max_context = config.max_context
    max_context = _validate.positive_int("max_context", max_context)
    max_batch = _validate.positive_int("max_batch", max_batch)
    chunk = _validate.positive_int("chunk", DEFAULT_CHUNK if chunk is None else chunk)
    chunk = min(chunk, max_context)
    input_len = DEFAULT_INFO_LENGTH if input_len is None else input_len
    input_len = _validate.positive_int("input_len", input_len)
    input_len = min(input_len, max_context)
    # The default pool ratio for this workload: max_batch sequences of input_len tokens.
    cfg = dataclasses.replace(
        cfg,
        expected_input_length=cfg.expected_input_length or input_len,
        expected_batch_size=cfg.expected_batch_size or max_batch,
        chunk_size=cfg.chunk_size or chunk,
    )
    used = resolve_scratch_policy(
        cfg,
        is_multimodal=getattr(config, "is_multimodal", False),
        has_external_kv_draft=getattr(config, "has_external_kv_draft", False),
    )
    plan = {
        "model": _model_summary(config, param_dtype),
        "kv_cache": {
            "page_size": cfg.page_size,
            "dtype": cfg.dtype.name,
            "max_context": max_context,
            "max_batch": max_batch,
            "chunk": chunk,
            "quota_bytes": kv_quota_bytes(cfg),
            "quota_from": "max_gpu_total_bytes"
            if cfg.max_gpu_total_bytes is not None and cfg.free_gpu_memory_fraction is None
            else "free device memory",
        },
        "input_len": input_len,
        "used": "scratch" if used else "release",
        "full": kv_bytes_per_sequence(
            config.layer_specs, input_len, chunk, "full", kv_cache_config=cfg
        )._asdict(),
    }
    for mode in ("release", "scratch"):
        if mode == "scratch" and cfg.page_table_mode != "per_layer":
            continue
        plan[mode] = _mode_plan(config, cfg, mode, max_context, max_batch, chunk, input_len)
    return plan


def _model_summary(config, param_dtype: str) -> dict:
    """The model's shape and parameter bytes, from `jax.eval_shape`'s abstract model."""
    import jax
    from flax import nnx

    import gemma

    abstract = nnx.eval_shape(
        lambda: gemma.Transformer(config, rngs=nnx.Rngs(0), param_dtype=param_dtype)
    )
    params = jax.tree.leaves(nnx.state(abstract, nnx.Param))
    return {
        "family": config.family,
        "num_layers": config.num_layers,
        "layers": dict(collections.Counter(config.layer_types)),
        "sliding_window": config.sliding_window,
        "num_kv_shared_layers": config.num_kv_shared_layers,
        "max_context": config.max_context,
        "num_params": int(abstract.num_params),
        "param_bytes": int(sum(x.size * x.dtype.itemsize for x in params)),
        "param_dtype": param_dtype,
    }


def _mode_plan(config, cfg, mode, max_context, max_batch, chunk, input_len) -> dict:
    """The layout of one mode ("release" or "scratch"), a sequence's bytes and slots in it,
    and how many such sequences its pool holds at once."""
    scratch = mode == "scratch"
    layout = make_layout(
        config.layer_specs,
        dataclasses.replace(cfg, enable_swa_scratch_reuse=scratch),
        max_context=max_context,
        max_batch=max_batch,
        max_chunk=chunk,
        scratch=scratch,
    )
    need = request_slots(layout, input_len, chunk=chunk)
    fit = min(g.num_slots // max(n, 1) for g, n in zip(layout.groups, need, strict=True))
    groups = []
    for k, (g, name) in enumerate(zip(layout.groups, group_names(layout), strict=True)):
        pools = [layout.pools[p] for p in g.pools]
        groups.append(
            {
                "name": name,
                "life_cycle": list(g.life_cycle),
                "pools": [
                    {
                        "layers": list(p.layers),
                        "num_kv_heads": p.num_kv_heads,
                        "head_dim": p.head_dim,
                        "scale": p.scale,
                    }
                    for p in pools
                ],
                "slot_bytes": layout.slot_bytes(k),
                "num_slots": g.num_slots,
                "scratch_slots_per_row": g.scratch_slots,
                "sequence_peak_slots": need[k],
            }
        )
    return {
        "groups": groups,
        "pool_bytes": layout.pool_bytes(),
        "sequence": kv_bytes_per_sequence(layout, input_len, chunk, mode)._asdict(),
        "sequences_at_once": min(fit, max_batch),
    }


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def format_plan(plan: Mapping, name: str = "") -> str:
    """`memory_plan` as the text `python -m swajax info` prints."""
    m, kv = plan["model"], plan["kv_cache"]
    layers = " + ".join(f"{n} {t}" for t, n in m["layers"].items())
    lines = [
        f"model {name}: {m['family']}, {m['num_layers']} layers ({layers}, sliding window "
        f"{m['sliding_window']}, {m['num_kv_shared_layers']} KV-shared), context "
        f"{m['max_context']}; {m['num_params']:,} parameters = {_size(m['param_bytes'])} in "
        f"{m['param_dtype']} (sized with jax.eval_shape, nothing allocated)",
        f"KV cache: page size {kv['page_size']}, {kv['dtype']}, max_context {kv['max_context']}, "
        f"max_batch {kv['max_batch']}, prefill chunk {kv['chunk']}; quota "
        f"{_size(kv['quota_bytes'])} ({kv['quota_from']}), pool ratio for {kv['max_batch']} "
        f"sequences of {plan['input_len']} tokens; scratch reuse "
        f"{'ON' if plan['used'] == 'scratch' else 'OFF'} under this config",
    ]
    full = plan["full"]
    lines.append(
        f"one {plan['input_len']}-token sequence holding every block (no release): "
        f"{_size(full['peak'])}"
    )
    for mode, title in (("release", "scratch OFF"), ("scratch", "scratch ON")):
        if mode not in plan:
            continue
        p = plan[mode]
        lines.append(f"{title} (pool roots {_size(p['pool_bytes'])}):")
        for k, g in enumerate(p["groups"]):
            pools = "; ".join(
                f"{_count(len(q['layers']), 'layer')} x {_count(q['num_kv_heads'], 'KV head')} x "
                f"{q['head_dim']}, "
                f"scale {q['scale']}"
                for q in g["pools"]
            )
            extra = (
                f", {g['scratch_slots_per_row']} scratch slots per row"
                if g["scratch_slots_per_row"]
                else ""
            )
            lines.append(
                f"  pool group {k} {g['name']}: {pools}; slot {_size(g['slot_bytes'])}, "
                f"{g['num_slots']} slots{extra}; one sequence peaks at "
                f"{g['sequence_peak_slots']} slots"
            )
        s = p["sequence"]
        lines.append(
            f"  KV of one {plan['input_len']}-token sequence: peak {_size(s['peak'])}, after "
            f"prefill {_size(s['steady'])}; {p['sequences_at_once']} such sequences fit at their "
            "peak at once"
        )
    if "release" in plan and "scratch" in plan:
        off, on = plan["release"]["sequence"]["peak"], plan["scratch"]["sequence"]["peak"]
        lines.append(f"scratch reuse saves {100 * (1 - on / off):.1f} % of a sequence's peak KV")
    return "\n".join(lines)
