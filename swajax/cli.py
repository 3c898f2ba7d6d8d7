"""`python -m swajax`: batch text generation over JSONL files, and a model's KV memory plan.

    python -m swajax generate --model DIR_OR_PRESET --input prompts.jsonl --output out.jsonl \\
        [--max-new-tokens N] [--temperature T] [--top-p P] [--top-k K] [--seed S] [--chat] \\
        [--kv-cap BYTES] [--scratch on|off|auto] [--page-size N] [--max-batch N] \\
        [--dtype auto|bfloat16|float32] [--resume] [--tokenizer DIR] [--small] \\
        [--max-num-tokens N] [--prefill-chunk N] [--implementation auto|reference|pallas]
    python -m swajax info --model DIR_OR_PRESET [--kv-cap BYTES] [--max-context N] ...

Input: one JSON object per line, `{"prompt": "..."}` or `{"messages": [{"role": ...,
"content": ...}, ...]}`, with optional `"id"` (default: the line number), `"max_new_tokens"`,
`"temperature"`, `"top_p"`, `"top_k"` and `"seed"` (the flags give the defaults); blank lines
are skipped. Every line is read, checked and tokenized before anything is generated; a bad
line is a `ValueError` naming the file and the line.

Output: one line per request, in input order, written as soon as it and every request before
it have finished: `{"id": ..., "text": ..., "token_ids": [...], "finish_reason": "stop" |
"length"}`. `--resume` keeps the lines already in the output (checking their ids against the
input), drops a partly written last line, and generates the rest, appending. A request's
sampling key comes from its own seed (the line's `"seed"`, else one derived from `--seed` and
its line number), so a resumed run writes what an uninterrupted one would.

`DIR_OR_PRESET`: a Hugging Face checkpoint directory (its tokenizer too, unless `--tokenizer`
names another), or `preset:NAME` (a `gemma.configs` preset with random weights and the
vocabulary of the `--tokenizer` directory; `--small` shrinks it with
`gemma.configs.small_preset`). `info` reads only the config: full-size presets are sized with
`jax.eval_shape`, nothing is allocated.

This module is an application entry point: it imports gemma (the `swajax` package does not).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from swajax import _validate
from swajax._budget import kv_bytes_per_sequence, kv_quota_bytes, request_slots
from swajax._config import KVCacheConfig, resolve_scratch_policy
from swajax._engine import RunStats
from swajax._generate import cached_engine
from swajax._layout import KVLayout, make_layout
from swajax._sampling import SamplingParams, check_seed
from swajax._text import TextOutput, encode_prompt, stream_requests_text

PRESET_PREFIX = "preset:"
LINE_FIELDS = (
    "id",
    "prompt",
    "messages",
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
)
DEFAULT_MAX_NEW_TOKENS = 256
DEFAULT_CHUNK = 8192  # the engine's default step budget (and so its prefill chunk)
DEFAULT_INFO_LENGTH = 8192
_UNIT_POWER = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}


# ----------------------------------------------------------------------------- arguments


def parse_bytes(text: str) -> int:
    """'1073741824', '512MiB', '512M', '2GB', '1.5GiB' -> bytes: KiB..TiB and K..T are powers of
    1024, KB..TB powers of 1000. ValueError for anything else."""
    m = re.fullmatch(r"([0-9]+(?:\.[0-9]*)?)\s*(?:([kmgt])(i?)(b?))?", str(text).strip(), re.I)
    if m is None:
        raise ValueError(f"a byte count must look like 1073741824, 512MiB or 2GB, got {text!r}")
    number, unit, binary, b = m.groups()
    base = 1000 if unit and b and not binary else 1024
    value = int(float(number) * base ** _UNIT_POWER[(unit or "").lower()])
    if value < 1:
        raise ValueError(f"a byte count must be >= 1, got {text!r}")
    return value


def _bytes_argument(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _dtype_name(dtype: str) -> str:
    if dtype != "auto":
        return dtype
    import jax

    return "bfloat16" if jax.default_backend() == "gpu" else "float32"


def model_config(spec: str, *, small: bool = False, vocab_size: int | None = None):
    """The `gemma.TransformerConfig` of `DIR_OR_PRESET` (only config.json of a directory)."""
    import gemma

    if spec.startswith(PRESET_PREFIX):
        name = spec[len(PRESET_PREFIX) :]
        overrides = {} if vocab_size is None else {"vocab_size": vocab_size}
        if small:
            return gemma.configs.small_preset(name, **overrides)
        return gemma.configs.preset(name, **overrides)
    if small:
        raise ValueError("--small applies to preset:NAME models only")
    directory = Path(spec)
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise ValueError(
            f"--model {spec!r} is neither preset:NAME nor a checkpoint directory with a "
            f"config.json; presets: {', '.join(gemma.configs.PRESET_NAMES)}"
        )
    try:
        hf = json.loads(config_file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{str(config_file)!r} is not valid JSON: {e}") from e
    try:
        return gemma.config_from_hf(hf)
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise ValueError(f"{str(config_file)!r}: {e}") from e


def load_model(
    spec: str,
    *,
    tokenizer_dir: str | None = None,
    dtype: str = "auto",
    small: bool = False,
    seed: int = 0,
):
    """(model, tokenizer) of `DIR_OR_PRESET` (module docstring); dtype of the parameters."""
    import jax.numpy as jnp
    from flax import nnx

    import gemma

    dtype = jnp.dtype(_dtype_name(dtype))
    if spec.startswith(PRESET_PREFIX):
        if tokenizer_dir is None:
            raise ValueError(
                f"--model {spec!r} has random weights and no tokenizer: give a tokenizer "
                "directory with --tokenizer DIR"
            )
        tokenizer = gemma.load_tokenizer(tokenizer_dir)
        config = model_config(spec, small=small, vocab_size=tokenizer.vocab_size)
        model = gemma.Transformer(config, rngs=nnx.Rngs(seed), dtype=dtype, param_dtype=dtype)
        return model, tokenizer
    model_config(spec, small=small)  # names a bad directory before loading anything
    tokenizer = gemma.load_tokenizer(tokenizer_dir or spec)
    return gemma.from_pretrained(spec, dtype=dtype), tokenizer


# ----------------------------------------------------------------------------- input lines


@dataclasses.dataclass(frozen=True)
class LineRequest:
    """One input line: its number (1-based), id, prompt ids, max_new_tokens and sampling."""

    line: int
    id: str | int
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    sampling: SamplingParams


def line_seed(seed: int, line: int) -> int:
    """The sampling seed of input line `line` under `--seed seed` (a line without "seed")."""
    state = np.random.SeedSequence([check_seed(seed), line]).generate_state(2, np.uint32)
    return (int(state[0]) << 31) ^ int(state[1])


def _line_error(path, line: int, message: str) -> ValueError:
    return ValueError(f"{path} line {line}: {message}")


def _parse_line(path, number: int, raw: bytes) -> dict | None:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _line_error(path, number, f"not UTF-8 text ({e})") from None
    if not text.strip():
        return None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise _line_error(path, number, f"not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise _line_error(
            path, number, f'expected a JSON object such as {{"prompt": "..."}}, got {text.strip()}'
        )
    return obj


def read_requests(
    path,
    tokenizer,
    *,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    sampling: SamplingParams | None = None,
    seed: int = 0,
    chat: bool = False,
) -> list[LineRequest]:
    """Every request of a JSONL file (module docstring), checked and tokenized.

    max_new_tokens, sampling (temperature, top_k, top_p) and seed are the defaults of lines
    that do not set them; chat=True renders `"prompt"` lines as one user message. ValueError
    naming the file and line for the first bad line, or for a file without requests.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"input file {str(path)!r} does not exist")
    defaults = sampling or SamplingParams()
    seed = check_seed(seed)
    requests: list[LineRequest] = []
    seen: dict = {}
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            obj = _parse_line(path, number, raw)
            if obj is None:
                continue
            unknown = sorted(set(obj) - set(LINE_FIELDS))
            if unknown:
                raise _line_error(
                    path, number, f"unknown field(s) {unknown}; allowed: {list(LINE_FIELDS)}"
                )
            if ("prompt" in obj) == ("messages" in obj):
                raise _line_error(path, number, 'give exactly one of "prompt" and "messages"')
            if "prompt" in obj and not isinstance(obj["prompt"], str):
                raise _line_error(
                    path, number, f'"prompt" must be a string, got {type(obj["prompt"]).__name__}'
                )
            if "messages" in obj and not (
                isinstance(obj["messages"], list)
                and obj["messages"]
                and all(isinstance(m, dict) for m in obj["messages"])
            ):
                raise _line_error(
                    path,
                    number,
                    '"messages" must be a non-empty list of {"role": ..., "content": ...} '
                    f"objects, got {json.dumps(obj['messages'])[:80]}",
                )
            rid = obj.get("id", number)
            if isinstance(rid, bool) or not isinstance(rid, (str, int)):
                raise _line_error(path, number, f'"id" must be a string or an integer, got {rid!r}')
            if rid in seen:
                raise _line_error(path, number, f"id {rid!r} is also the id of line {seen[rid]}")
            seen[rid] = number
            n = obj.get("max_new_tokens", max_new_tokens)
            if not _validate.is_int(n) or n < 1:
                raise _line_error(path, number, f'"max_new_tokens" must be an int >= 1, got {n!r}')
            try:
                sampling_line = SamplingParams(
                    temperature=obj.get("temperature", defaults.temperature),
                    top_k=obj.get("top_k", defaults.top_k),
                    top_p=obj.get("top_p", defaults.top_p),
                    seed=obj.get("seed", line_seed(seed, number)),
                )
            except ValueError as e:
                raise _line_error(path, number, str(e)) from None
            prompt = obj["prompt"] if "prompt" in obj else obj["messages"]
            try:
                ids = encode_prompt(tokenizer, prompt, chat=chat or None, name="the prompt")
            except (ValueError, TypeError) as e:
                raise _line_error(path, number, str(e)) from None
            requests.append(LineRequest(number, rid, tuple(ids), int(n), sampling_line))
    if not requests:
        raise ValueError(f"input file {str(path)!r} has no requests (every line is blank)")
    return requests


def check_requests(path, requests: Sequence[LineRequest], config, engine=None) -> None:
    """ValueError naming the line of the first request the model (or `engine`) cannot serve."""
    for r in requests:
        try:
            _validate.prompt(
                "the prompt",
                r.prompt_ids,
                config.vocab_size,
                config.max_context,
                r.max_new_tokens,
                "the model's context",
            )
            if engine is not None:
                engine.check_fits(len(r.prompt_ids), r.max_new_tokens)
        except ValueError as e:
            raise _line_error(path, r.line, str(e)) from None


def done_lines(path, requests: Sequence[LineRequest]) -> tuple[int, int]:
    """(complete lines, their bytes) of an earlier run's output `path`, checked against the
    requests in order (ValueError on a line that is not one of their results); 0 without a file.
    A last line without its newline is not complete (the run was stopped while writing it)."""
    path = Path(path)
    if not path.exists():
        return 0, 0
    if not path.is_file():
        raise ValueError(f"output {str(path)!r} is not a file")
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    lines = data[:end].splitlines()
    if len(lines) > len(requests):
        raise ValueError(
            f"output {str(path)!r} has {len(lines)} lines but the input only {len(requests)} "
            "requests: it belongs to another input (remove it, or run without --resume)"
        )
    for k, (raw, r) in enumerate(zip(lines, requests, strict=False), start=1):
        try:
            got = json.loads(raw)["id"]
        except (json.JSONDecodeError, UnicodeDecodeError, TypeError, KeyError):
            raise ValueError(
                f"{path} line {k}: not a result line of this command (remove the file, or run "
                "without --resume)"
            ) from None
        if got != r.id:
            raise ValueError(
                f"{path} line {k}: id {got!r}, but input line {r.line} has id {r.id!r}: the "
                "output belongs to another input (remove it, or run without --resume)"
            )
    return len(lines), end


def result_line(r: LineRequest, out: TextOutput) -> str:
    record = {
        "id": r.id,
        "text": out.text,
        "token_ids": list(out.token_ids),
        "finish_reason": out.finish_reason,
    }
    return json.dumps(record, ensure_ascii=False) + "\n"


# ----------------------------------------------------------------------------- generate


@dataclasses.dataclass
class GenerateSummary:
    """What `generate_jsonl` did: requests in the input, lines kept from an earlier run
    (`--resume`), results written now, their tokens, and the engine's `RunStats` (None when
    nothing was left to generate)."""

    requests: int
    resumed: int
    written: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    finish_reasons: dict = dataclasses.field(default_factory=dict)
    stats: RunStats | None = None
    groups: tuple[str, ...] = ()

    def line(self) -> str:
        head = f"{self.written} requests"
        if self.resumed:
            head += f" (+{self.resumed} from the earlier run)"
        if self.stats is None:
            return head + "; nothing to generate"
        s = self.stats
        slots = ", ".join(
            f"{name} {peak}/{n}"
            for name, peak, n in zip(self.groups, s.peak_slots, s.num_slots, strict=True)
        )
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(self.finish_reasons.items()))
        return (
            f"{head} ({reasons}): {self.prompt_tokens} prompt + {self.generated_tokens} "
            f"generated tokens in {s.seconds:.1f} s, {s.output_tokens_per_second:.1f} generated "
            f"tokens/s ({s.tokens_per_second:.1f} tokens/s with prefill); peak KV slots {slots}; "
            f"preemptions {s.preemptions}"
        )


def group_names(layout: KVLayout) -> tuple[str, ...]:
    return tuple(f"sliding({g.window})" if g.is_sliding else "full" for g in layout.groups)


def _write(f, data: bytes) -> None:
    f.write(data)
    f.flush()  # a stopped run leaves whole lines (at most a cut last one, dropped on --resume)


def generate_jsonl(
    model,
    tokenizer,
    input_path,
    output_path,
    *,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    sampling: SamplingParams | None = None,
    seed: int = 0,
    chat: bool = False,
    resume: bool = False,
    kv_cache_config: KVCacheConfig | None = None,
    max_batch: int | None = None,
    max_num_tokens: int | None = None,
    prefill_chunk_size: int | None = None,
    implementation: str = "auto",
    progress: bool = True,
) -> GenerateSummary:
    """Generates a result line for every request of a JSONL file (module docstring).

    Every line is checked before anything runs (ValueError naming the file and line), then
    the requests are served together on the kept engine of `swajax.generate` and each result is
    written, in input order, as soon as the requests before it are done. A KeyboardInterrupt
    stops generation with every written line complete; `resume=True` continues from there.
    The sampling flags are `sampling` (temperature, top_k, top_p; its seed is ignored: each
    line's comes from `seed` and its line number unless the line sets one).
    """
    requests = read_requests(
        input_path,
        tokenizer,
        max_new_tokens=max_new_tokens,
        sampling=sampling,
        seed=seed,
        chat=chat,
    )
    check_requests(input_path, requests, model.config)
    output_path = Path(output_path)
    if output_path.is_dir():
        raise ValueError(f"output {str(output_path)!r} is a directory")
    done, keep_bytes = done_lines(output_path, requests) if resume else (0, 0)
    todo = requests[done:]
    summary = GenerateSummary(requests=len(requests), resumed=done)
    if not todo:
        return summary
    engine = cached_engine(
        model,
        [len(r.prompt_ids) + r.max_new_tokens for r in todo],
        kv_cache_config=kv_cache_config,
        prefill_chunk_size=prefill_chunk_size,
        implementation=implementation,
        max_batch=max_batch,
        max_num_tokens=max_num_tokens,
    )
    check_requests(input_path, todo, model.config, engine)
    summary.groups = group_names(engine.layout)
    if resume and output_path.exists():
        with output_path.open("r+b") as f:
            f.truncate(keep_bytes)  # a line cut short by the interruption is written again
    from tqdm.auto import tqdm

    finished: dict[int, TextOutput] = {}
    next_index = 0
    with (
        output_path.open("ab" if resume else "wb") as raw,
        tqdm(total=len(todo), unit="req", desc="generate", disable=not progress) as bar,
        engine.recording() as stats,
    ):
        summary.stats = stats
        results = stream_requests_text(
            engine,
            tokenizer,
            [r.prompt_ids for r in todo],
            [r.max_new_tokens for r in todo],
            [r.sampling for r in todo],
        )
        with contextlib.closing(results):
            for i, out in results:
                finished[i] = out
                summary.generated_tokens += len(out.token_ids)
                bar.update(1)
                bar.set_postfix(tokens=summary.generated_tokens, refresh=False)
                while next_index in finished:
                    out = finished.pop(next_index)
                    r = todo[next_index]
                    _write(raw, result_line(r, out).encode("utf-8"))
                    summary.written += 1
                    summary.prompt_tokens += len(r.prompt_ids)
                    reason = out.finish_reason
                    summary.finish_reasons[reason] = summary.finish_reasons.get(reason, 0) + 1
                    next_index += 1
    return summary


# ----------------------------------------------------------------------------- info


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
    sequence prefilled in chunks (steady and peak, `swajax.kv_bytes_per_sequence`; also "full",
    nothing released), its peak slots, and how many such sequences the pool holds at once.
    `used` names the mode the config's scratch policy picks.
    """
    import jax
    from flax import nnx

    import gemma

    cfg = kv_cache_config or KVCacheConfig()
    max_context = _validate.positive_int("max_context", max_context or config.max_context)
    max_batch = _validate.positive_int("max_batch", max_batch)
    chunk = min(_validate.positive_int("chunk", chunk or DEFAULT_CHUNK), max_context)
    input_len = _validate.positive_int("input_len", input_len or DEFAULT_INFO_LENGTH)
    input_len = min(input_len, max_context)
    abstract = nnx.eval_shape(
        lambda: gemma.Transformer(config, rngs=nnx.Rngs(0), param_dtype=param_dtype)
    )
    params = jax.tree.leaves(nnx.state(abstract, nnx.Param))
    param_bytes = sum(x.size * x.dtype.itemsize for x in params)
    # The default pool ratio for this workload: max_batch sequences of input_len tokens.
    cfg = dataclasses.replace(
        cfg,
        expected_input_length=cfg.expected_input_length or input_len,
        expected_batch_size=cfg.expected_batch_size or max_batch,
        chunk_size=cfg.chunk_size or chunk,
    )
    quota = kv_quota_bytes(cfg)
    used = resolve_scratch_policy(
        cfg,
        is_multimodal=getattr(config, "is_multimodal", False),
        has_external_kv_draft=getattr(config, "has_external_kv_draft", False),
    )
    plan = {
        "model": {
            "family": config.family,
            "num_layers": config.num_layers,
            "layers": dict(collections.Counter(config.layer_types)),
            "sliding_window": config.sliding_window,
            "num_kv_shared_layers": config.num_kv_shared_layers,
            "max_context": config.max_context,
            "num_params": int(abstract.num_params),
            "param_bytes": int(param_bytes),
            "param_dtype": param_dtype,
        },
        "kv_cache": {
            "page_size": cfg.page_size,
            "dtype": cfg.dtype.name,
            "max_context": max_context,
            "max_batch": max_batch,
            "chunk": chunk,
            "quota_bytes": quota,
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
        scratch = mode == "scratch"
        if scratch and cfg.page_table_mode != "per_layer":
            continue
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
        plan[mode] = {
            "groups": [
                {
                    "name": name,
                    "life_cycle": list(g.life_cycle),
                    "pools": [
                        {
                            "layers": list(layout.pools[p].layers),
                            "num_kv_heads": layout.pools[p].num_kv_heads,
                            "head_dim": layout.pools[p].head_dim,
                            "scale": layout.pools[p].scale,
                        }
                        for p in g.pools
                    ],
                    "slot_bytes": layout.slot_bytes(k),
                    "num_slots": g.num_slots,
                    "scratch_slots_per_row": g.scratch_slots,
                    "sequence_peak_slots": need[k],
                }
                for k, (g, name) in enumerate(zip(layout.groups, group_names(layout), strict=True))
            ],
            "pool_bytes": layout.pool_bytes(),
            "sequence": kv_bytes_per_sequence(layout, input_len, chunk, mode)._asdict(),
            "sequences_at_once": min(fit, max_batch),
        }
    return plan


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


# ----------------------------------------------------------------------------- main


def _kv_cache_config(args) -> KVCacheConfig:
    scratch = {"on": True, "off": False, "auto": None}[args.scratch]
    return KVCacheConfig(
        page_size=args.page_size,
        max_gpu_total_bytes=args.kv_cap,
        enable_swa_scratch_reuse=scratch,
        dtype=args.kv_dtype,
    )


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m swajax",
        description="Text generation on swajax's paged KV cache.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True)

    def common(q, dtype_default, max_batch_default):
        q.add_argument(
            "--model",
            required=True,
            metavar="DIR_OR_PRESET",
            help="a Hugging Face checkpoint directory, or preset:NAME (random weights)",
        )
        q.add_argument("--small", action="store_true", help="with preset:NAME: a shrunk preset")
        q.add_argument(
            "--kv-cap",
            type=_bytes_argument,
            default=None,
            metavar="BYTES",
            help="KV cache quota, e.g. 2GiB (default: 90%% of the device's free memory)",
        )
        q.add_argument("--scratch", choices=("on", "off", "auto"), default="auto")
        q.add_argument("--page-size", type=int, default=32)
        q.add_argument("--max-batch", type=int, default=max_batch_default)
        q.add_argument(
            "--dtype",
            choices=("auto", "bfloat16", "float32"),
            default=dtype_default,
            help="parameter and KV dtype (auto: bfloat16 on a GPU, float32 on a CPU)",
        )

    g = sub.add_parser("generate", help="generate a result line for each line of a JSONL file")
    common(g, "auto", None)
    g.add_argument("--input", required=True, help="prompts.jsonl")
    g.add_argument("--output", required=True, help="out.jsonl")
    g.add_argument("--tokenizer", default=None, metavar="DIR")
    g.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--chat", action="store_true", help='"prompt" lines are user messages')
    g.add_argument("--resume", action="store_true", help="keep the results already written")
    g.add_argument("--max-num-tokens", type=int, default=None, help="token budget of a step")
    g.add_argument("--prefill-chunk", type=int, default=None)
    g.add_argument("--implementation", choices=("auto", "reference", "pallas"), default="auto")
    g.add_argument("--no-progress", action="store_true")

    i = sub.add_parser("info", help="the KV layout and memory plan of a model (no weights)")
    common(i, "bfloat16", 16)
    i.add_argument("--max-context", type=int, default=None, help="default: the model's")
    i.add_argument("--chunk", type=int, default=DEFAULT_CHUNK, help="prefill chunk")
    i.add_argument(
        "--input-len", type=int, default=DEFAULT_INFO_LENGTH, help="sequence length of the plan"
    )
    i.add_argument("--json", action="store_true", help="print the plan as JSON")
    return p


def run(argv=None) -> GenerateSummary | dict:
    """`main` without the error handling: ValueError for bad input."""
    args = _parser().parse_args(argv)
    args.kv_dtype = _dtype_name(args.dtype)
    cfg = _kv_cache_config(args)
    if args.command == "info":
        config = model_config(args.model, small=args.small)
        plan = memory_plan(
            config,
            cfg,
            max_context=args.max_context,
            max_batch=args.max_batch,
            chunk=args.chunk,
            input_len=args.input_len,
            param_dtype=args.kv_dtype,
        )
        print(json.dumps(plan, indent=1) if args.json else format_plan(plan, args.model))
        return plan
    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    model, tokenizer = load_model(
        args.model,
        tokenizer_dir=args.tokenizer,
        dtype=args.dtype,
        small=args.small,
        seed=args.seed,
    )
    summary = generate_jsonl(
        model,
        tokenizer,
        args.input,
        args.output,
        max_new_tokens=args.max_new_tokens,
        sampling=sampling,
        seed=args.seed,
        chat=args.chat,
        resume=args.resume,
        kv_cache_config=cfg,
        max_batch=args.max_batch,
        max_num_tokens=args.max_num_tokens,
        prefill_chunk_size=args.prefill_chunk,
        implementation=args.implementation,
        progress=not args.no_progress,
    )
    print(summary.line())
    return summary


def main(argv=None) -> int:
    """The command line; returns the exit status (2: bad input, 130: interrupted)."""
    try:
        run(argv)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(
            "interrupted: every line in the output is complete; run the same command with "
            "--resume to continue",
            file=sys.stderr,
        )
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
