"""Batch generation over JSONL files: the runner behind `python -m swajax generate`.

This module owns the file format and its checks: reading and tokenizing the request lines
(`read_requests`, `check_requests`), the output file (`check_files`, `result_line`, and
`done_lines` for `--resume`), and the run itself (`generate_jsonl`, `GenerateSummary`).

Input: one JSON object per line, `{"prompt": "..."}` or `{"messages": [{"role": ...,
"content": ...}, ...]}`, with optional `"id"` (default: the line number), `"max_new_tokens"`,
`"temperature"`, `"top_p"`, `"top_k"` and `"seed"` (the caller's arguments give the defaults);
blank lines are skipped. Every line is read, checked and tokenized before anything is
generated; a bad line (invalid UTF-8 or JSON, an unknown field, a string that is not Unicode
text such as a lone surrogate, ...) is a `ValueError` naming the file and the line.

Output: one line per request, in input order, written as soon as it and every request before
it have finished: `{"id": ..., "text": ..., "token_ids": [...], "finish_reason": "stop" |
"length"}`. The output is never the input file (under any name). `resume=True` (`--resume`)
keeps the result lines already in the output (checking that they are results and their ids
match the input), drops a partly written last line, and generates the rest, appending. A
request's sampling key comes from its own seed (the line's `"seed"`, else one derived from the
default seed and its line number), so a resumed run writes what an uninterrupted one would.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from swajax import _validate
from swajax._engine import RunStats
from swajax._engine_config import EngineConfig
from swajax._generate import cached_engine
from swajax._layout import KVLayout
from swajax._sampling import SamplingParams, check_seed
from swajax._text import TextOutput, encode_prompt, stream_requests_text

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
RESULT_FIELDS = ("id", "text", "token_ids", "finish_reason")
DEFAULT_MAX_NEW_TOKENS = 256


# ----------------------------------------------------------------------------- files


def check_files(input_path, output_path) -> None:
    """ValueError unless `input_path` is a readable file and `output_path` can be written:
    not a directory, in a directory that exists and is writable, and not the input file under
    any name (another spelling of the path, a symbolic link, a hard link)."""
    input_path, output_path = Path(input_path), Path(output_path)
    if not input_path.exists():
        raise ValueError(f"input file {str(input_path)!r} does not exist")
    if not input_path.is_file():
        raise ValueError(f"input {str(input_path)!r} is not a file")
    if not os.access(input_path, os.R_OK):
        raise ValueError(f"input file {str(input_path)!r} is not readable")
    if output_path.is_dir():
        raise ValueError(f"output {str(output_path)!r} is a directory")
    if output_path.exists():
        if os.path.samefile(input_path, output_path):
            raise ValueError(
                f"output {str(output_path)!r} is the input file {str(input_path)!r}: writing "
                "the results would overwrite the requests; give another output file"
            )
        if not os.access(output_path, os.W_OK):
            raise ValueError(f"output {str(output_path)!r} is not writable")
        return
    # A new file (or a symbolic link to one) is created in the directory of its resolved path.
    directory = Path(os.path.realpath(output_path)).parent
    if not directory.is_dir():
        raise ValueError(
            f"output {str(output_path)!r}: directory {str(directory)!r} does not exist"
        )
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ValueError(
            f"output {str(output_path)!r}: directory {str(directory)!r} is not writable"
        )


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
    """The sampling seed of input line `line` when the line sets no "seed": derived from the
    default seed `seed` (`--seed`) and the line number."""
    state = np.random.SeedSequence([check_seed(seed), line]).generate_state(2, np.uint32)
    return (int(state[0]) << 31) ^ int(state[1])


def _line_error(path, line: int, message: str) -> ValueError:
    return ValueError(f"{path} line {line}: {message}")


def _check_text(path, line: int, name: str, text: str) -> None:
    """ValueError naming the line and the code point unless `text` can be encoded as UTF-8
    (JSON's \\uXXXX escapes can spell lone surrogates, U+D800..U+DFFF, which are not text)."""
    try:
        _validate.unicode_text(name, text)
    except ValueError as e:
        raise _line_error(path, line, str(e)) from None


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
            requests.append(
                _line_request(
                    path, number, obj, tokenizer, max_new_tokens, defaults, seed, chat, seen
                )
            )
    if not requests:
        raise ValueError(f"input file {str(path)!r} has no requests (every line is blank)")
    return requests


def _line_request(
    path, number, obj, tokenizer, max_new_tokens, defaults, seed, chat, seen
) -> LineRequest:
    """One parsed line of `read_requests` checked and tokenized (`seen`: id -> line number,
    updated); ValueError naming the file and line."""
    unknown = sorted(set(obj) - set(LINE_FIELDS))
    if unknown:
        raise _line_error(path, number, f"unknown field(s) {unknown}; allowed: {list(LINE_FIELDS)}")
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
    if "prompt" in obj:
        _check_text(path, number, '"prompt"', obj["prompt"])
    else:
        for k, message in enumerate(obj["messages"]):
            for key in ("role", "content"):
                if isinstance(message.get(key), str):
                    _check_text(path, number, f'"messages"[{k}]["{key}"]', message[key])
    rid = obj.get("id", number)
    if isinstance(rid, bool) or not isinstance(rid, (str, int)):
        raise _line_error(path, number, f'"id" must be a string or an integer, got {rid!r}')
    if isinstance(rid, str):
        _check_text(path, number, '"id"', rid)
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
    return LineRequest(number, rid, tuple(ids), int(n), sampling_line)


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


def _is_result(obj) -> bool:
    """Whether a parsed output line is a `result_line`: an object with a string "text", a
    list "token_ids" and a string "finish_reason" beside its "id"."""
    return (
        isinstance(obj, dict)
        and all(field in obj for field in RESULT_FIELDS)
        and isinstance(obj["text"], str)
        and isinstance(obj["token_ids"], list)
        and isinstance(obj["finish_reason"], str)
    )


def done_lines(path, requests: Sequence[LineRequest]) -> tuple[int, int]:
    """(complete lines, their bytes) of an earlier run's output `path`, checked against the
    requests in order; 0 without a file. ValueError naming the file and line for a line that
    is not a result (`result_line`: "id", "text", "token_ids", "finish_reason") or whose id is
    not that of the request in its place. A last line without its newline is not complete
    (the run was stopped while writing it)."""
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
            obj = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            obj = None
        if not _is_result(obj):
            raise ValueError(
                f"{path} line {k}: not a result line of this command (a JSON object with "
                f"{', '.join(RESULT_FIELDS)}); remove the file, or run without --resume"
            )
        got = obj["id"]
        if got != r.id:
            raise ValueError(
                f"{path} line {k}: id {got!r}, but input line {r.line} has id {r.id!r}: the "
                "output belongs to another input (remove it, or run without --resume)"
            )
    return len(lines), end


def result_line(r: LineRequest, out: TextOutput) -> str:
    """The output line of request `r`: its id, text, token ids and finish reason, newline
    ended."""
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
    """A name per pool group of `layout`: "sliding(WINDOW)" or "full"."""
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
    progress: bool = True,
    config: EngineConfig | None = None,
    **settings,
) -> GenerateSummary:
    """Generates a result line for every request of a JSONL file (module docstring).

    The files are checked first (`check_files`: the output is never the input) and every line
    before anything runs (ValueError naming the file and line), then
    the requests are served together on the kept engine of `swajax.generate` and each result is
    written, in input order, as soon as the requests before it are done. A KeyboardInterrupt
    stops generation with every written line complete; `resume=True` continues from there.
    The sampling flags are `sampling` (temperature, top_k, top_p; its seed is ignored: each
    line's comes from `seed` and its line number unless the line sets one). config,
    **settings: the `EngineConfig`, as `swajax.generate`.
    """
    check_files(input_path, output_path)
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
    done, keep_bytes = done_lines(output_path, requests) if resume else (0, 0)
    todo = requests[done:]
    summary = GenerateSummary(requests=len(requests), resumed=done)
    if not todo:
        return summary
    engine = cached_engine(
        model,
        [len(r.prompt_ids) + r.max_new_tokens for r in todo],
        EngineConfig.of(config, **settings),
    )
    check_requests(input_path, todo, model.config, engine)
    summary.groups = group_names(engine.layout)
    if resume and output_path.exists():
        with output_path.open("r+b") as f:
            f.truncate(keep_bytes)  # a line cut short by the interruption is written again
    from tqdm.auto import tqdm

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
            _write_in_order(raw, todo, results, summary, bar)
    return summary


def _write_in_order(raw, todo, results, summary: GenerateSummary, bar) -> None:
    """Writes each result line of `todo` as soon as every line before it is written."""
    finished: dict[int, TextOutput] = {}
    next_index = 0
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
