"""Text in, text out with the committed tiny trained model: `swajax.generate_text` (plain and
chat prompts, streaming) and `python -m swajax` (`generate` over JSONL files with `--resume`,
`info` on full-size presets).

Oracles: the token path (`swajax.generate` on ids made by the tokenizer directly, decoded by
the tokenizer), the nursery-rhyme corpus the model memorised, hand-computed KV bytes (the
docs/design.md E2B numbers of tests/test_experiments.py) and Hugging Face parameter counts
(tests/fixtures/param_counts.json). Every test uses one engine setting (page 16, four rows,
64-token steps, reference kernels), so the steps compile once for the module.
"""

import json
import pathlib
import runpy
import sys

import jax
import pytest

import gemma
import swajax
import swajax._generate
import swajax._text
from swajax import cli, jsonl

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = ROOT / "experiments" / "tiny_model"
PARAM_COUNTS = json.loads((ROOT / "tests" / "fixtures" / "param_counts.json").read_text())
NEW = 64  # with the prompts below, every request fits a 128-token context (one layout)
SETTINGS = dict(
    kv_cache=swajax.KVCacheConfig(page_size=16),
    implementation="reference",
    max_num_tokens=64,
    max_batch=4,
)
JACK = "Jack and Jill went up the hill\nTo fetch a pail of water."


@pytest.fixture(scope="module")
def tiny():
    return gemma.from_pretrained(TINY), gemma.load_tokenizer(TINY)


def chat(text):
    return [{"role": "user", "content": text}]


PROMPTS = [
    chat("Say the rhyme Jack and Jill."),
    "Humpty Dumpty\n",
    "Mary had",
    chat("Say the rhyme Little Bo Peep."),
]


def _oracle_ids(tok, prompt):
    if isinstance(prompt, str):
        return tok.encode(prompt)
    return tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)


def _oracle_text(tok, tokens):
    if tokens and tokens[-1] in tok.eos_token_ids:
        tokens = tokens[:-1]
    return tok.decode(tokens, skip_special_tokens=True)


# ----------------------------------------------------------------------------- generate_text


# top_k: the "filter" sampling mode, as the CLI's sampled lines (one more compiled step)
@pytest.mark.parametrize("sampling", [None, swajax.SamplingParams(temperature=0.9, top_k=40)])
def test_generate_text_equals_the_decoded_token_path(tiny, sampling):
    model, tok = tiny
    out = swajax.generate_text(model, tok, PROMPTS, NEW, sampling=sampling, seed=5, **SETTINGS)
    ids = [_oracle_ids(tok, p) for p in PROMPTS]
    tokens = swajax.generate(
        model, ids, NEW, sampling=sampling, seed=5, stop_token_ids=tok.eos_token_ids, **SETTINGS
    )
    assert [o.prompt_token_ids for o in out] == [tuple(p) for p in ids]
    assert [list(o.token_ids) for o in out] == tokens
    assert [o.text for o in out] == [_oracle_text(tok, t) for t in tokens]
    for o, t in zip(out, tokens, strict=True):
        assert o.finish_reason == ("stop" if t[-1] in tok.eos_token_ids else "length")
        assert o.finish_reason == "stop" or len(t) == NEW
    if sampling is None:
        assert {o.finish_reason for o in out} == {"stop", "length"}
        assert out[0].text.startswith(JACK)  # the corpus: the model memorised its rhymes


def test_chat_template_path(tiny):
    model, tok = tiny
    request = "Say the rhyme Jack and Jill."
    as_chat, as_string = swajax.generate_text(
        model, tok, [chat(request), request, "x", "y"], NEW, **SETTINGS
    )[:2]
    plain = swajax.generate_text(model, tok, [request, "x", "y", "z"], NEW, chat=True, **SETTINGS)
    # the template renders <bos><start_of_turn>user\n...<end_of_turn>\n<start_of_turn>model\n
    rendered = tok.apply_chat_template(chat(request), add_generation_prompt=True)
    assert rendered.endswith("<start_of_turn>model\n")
    assert plain[0].prompt_token_ids == tuple(tok.encode(rendered, add_special_tokens=False))
    assert plain[0] == as_chat
    assert as_string.prompt_token_ids == tuple(tok.encode(request))  # chat=None: plain text
    assert as_chat.text.startswith(JACK) and as_chat.finish_reason == "stop"
    assert as_chat.token_ids[-1] == tok.end_of_turn_id


def test_streaming_text_equals_the_non_streamed_text(tiny):
    model, tok = tiny
    whole = swajax.generate_text(model, tok, PROMPTS, NEW, **SETTINGS)
    chunks = list(swajax.generate_text(model, tok, PROMPTS, NEW, stream=True, **SETTINGS))
    for i, o in enumerate(whole):
        mine = [c for c in chunks if c.index == i]
        assert "".join(c.text for c in mine) == o.text
        assert tuple(t for c in mine for t in c.token_ids) == o.token_ids
        assert [c.finished for c in mine] == [False] * (len(mine) - 1) + [True]
        assert mine[-1].finish_reason == o.finish_reason
        assert len(mine) > 5  # pieces as they come, not one block at the end
    # requests interleave: the chunks are not grouped by request
    assert [c.index for c in chunks] != sorted(c.index for c in chunks)


def test_streamed_pieces_never_split_a_character(tiny):
    """The streaming path on hand-made engine outputs: one token per step, byte-fallback
    pieces of multi-byte characters held back until complete."""
    _, tok = tiny
    text = "Crème brûlée, 日本語 🙂 done"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > len(text) // 2  # byte pieces: more ids than a plain word split
    # an id past the tokenizer's vocabulary (a padded model vocabulary) has no text
    ids = [*ids[:3], tok.vocab_size + 5, *ids[3:]]
    outputs, sofar = [], ()
    for k, t in enumerate([*ids, tok.end_of_turn_id]):
        sofar += (t,)
        last = k == len(ids)
        outputs.append((0, swajax.RequestOutput(0, (t,), sofar, last, "stop" if last else None)))
    pieces = [c.text for c in swajax._text.text_chunks(tok, outputs)]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert "" in pieces  # some ids completed no character on their own


def test_generate_text_rejects_bad_prompts_before_running(tiny):
    model, tok = tiny
    with pytest.raises(ValueError, match="prompts is empty"):
        swajax.generate_text(model, tok, [], 4, **SETTINGS)
    with pytest.raises(ValueError, match="prompt 1 must be a string or a non-empty list"):
        swajax.generate_text(model, tok, ["a", 3], 4, **SETTINGS)
    with pytest.raises(ValueError, match="prompt 0: message 0 needs a string 'role'"):
        swajax.generate_text(model, tok, [[{"content": "hi"}]], 4, **SETTINGS)
    with pytest.raises(ValueError, match="prompt 0 is a conversation but chat=False"):
        swajax.generate_text(model, tok, [chat("hi")], 4, chat=False, **SETTINGS)
    with pytest.raises(ValueError, match="prompt 1: .* exceeds the model's context of 512"):
        swajax.generate_text(model, tok, ["a", "b " * 1000], 4, stream=True, **SETTINGS)
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 1"):
        swajax.generate_text(model, tok, ["a"], 0, stream=True, **SETTINGS)


# ----------------------------------------------------------------------------- engine hooks


def test_recording_a_request_loop_and_step_slots(tiny):
    model, tok = tiny
    engine = swajax._generate.cached_engine(model, [100] * 4, swajax.EngineConfig(**SETTINGS))
    ids = [engine.add_request(_oracle_ids(tok, p), 8) for p in PROMPTS]
    with engine.recording() as stats:
        with engine.recording() as inner:  # recordings may overlap: each sees every step
            outs = [o for o in engine.stream_requests(ids) if o.finished]
    assert sorted(o.request_id for o in outs) == ids
    assert stats.output_tokens == inner.output_tokens == 4 * 8 and stats.seconds > 0
    assert inner.steps == stats.steps and inner.step_slots == stats.step_slots
    assert len(stats.step_slots) == stats.steps
    assert tuple(max(s[g] for s in stats.step_slots) for g in range(2)) == stats.peak_slots
    with pytest.raises(ValueError, match="not queued or running"):
        next(engine.stream_requests(ids[:1]))


# ----------------------------------------------------------------------------- CLI generate

LINES = [
    {"id": "jack", "messages": chat("Say the rhyme Jack and Jill.")},
    {"prompt": "Humpty Dumpty\n", "max_new_tokens": 12},
    None,  # a blank line: skipped
    {"id": 7, "prompt": "Mary had", "temperature": 0.8, "top_k": 40, "seed": 3},
    {"id": "bo", "prompt": "Say the rhyme Little Bo Peep."},
    {"id": "hey", "prompt": "Hey diddle", "temperature": 0.7, "top_p": 0.9},
    {"id": "x", "prompt": "Baa, baa", "max_new_tokens": 3},
]


def _write_lines(path, lines):
    path.write_text("".join(("" if x is None else json.dumps(x)) + "\n" for x in lines))
    return path


def _generate(tiny, tmp_path, output="out.jsonl", **kw):
    model, tok = tiny
    return jsonl.generate_jsonl(
        model,
        tok,
        tmp_path / "in.jsonl",
        tmp_path / output,
        max_new_tokens=NEW,
        chat=True,
        progress=False,
        **SETTINGS,
        **kw,
    )


@pytest.fixture(scope="module")
def reference_run(tiny, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cli")
    _write_lines(tmp / "in.jsonl", LINES)
    summary = _generate(tiny, tmp)
    return tmp, (tmp / "out.jsonl").read_bytes(), summary


def test_cli_round_trip(tiny, reference_run):
    model, tok = tiny
    tmp, data, summary = reference_run
    rows = [json.loads(line) for line in data.decode().splitlines()]
    assert [r["id"] for r in rows] == ["jack", 2, 7, "bo", "hey", "x"]  # default id: line number
    assert summary.requests == summary.written == 6 and summary.resumed == 0
    assert summary.generated_tokens == sum(len(r["token_ids"]) for r in rows)
    assert summary.stats.peak_slots and summary.stats.preemptions == 0
    for r in rows:
        assert set(r) == {"id", "text", "token_ids", "finish_reason"}
        assert r["text"] == _oracle_text(tok, r["token_ids"])
        stopped = r["token_ids"][-1] in tok.eos_token_ids
        assert r["finish_reason"] == ("stop" if stopped else "length")
    limits = {"jack": NEW, 2: 12, 7: NEW, "bo": NEW, "hey": NEW, "x": 3}
    for r in rows:
        assert len(r["token_ids"]) <= limits[r["id"]]
    assert rows[1]["finish_reason"] == rows[5]["finish_reason"] == "length"
    # greedy lines equal the token path (--chat: "prompt" lines are user messages)
    greedy = [LINES[i] for i in (0, 1, 4, 6)]
    for line, row in zip(greedy, [rows[i] for i in (0, 1, 3, 5)], strict=True):
        prompt = line.get("messages") or chat(line["prompt"])
        [tokens] = swajax.generate(
            model,
            [_oracle_ids(tok, prompt)],
            line.get("max_new_tokens", NEW),
            stop_token_ids=tok.eos_token_ids,
            **SETTINGS,
        )
        assert row["token_ids"] == tokens
    assert rows[0]["text"].startswith(JACK)
    assert "peak KV slots sliding(64)" in summary.line() and "preemptions 0" in summary.line()


def test_cli_resume_after_an_interrupt_writes_nothing_twice(tiny, reference_run, monkeypatch):
    tmp, expected, _ = reference_run
    _write_lines(tmp / "in.jsonl", LINES)
    written = []
    real_write = jsonl._write

    def write_then_interrupt(f, data):
        if len(written) == 2:
            raise KeyboardInterrupt
        written.append(data)
        real_write(f, data)

    monkeypatch.setattr(jsonl, "_write", write_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        _generate(tiny, tmp, "resumed.jsonl")
    monkeypatch.undo()
    partial = (tmp / "resumed.jsonl").read_bytes()
    assert partial == b"".join(written) == b"".join(expected.splitlines(keepends=True)[:2])
    # a run killed while writing its third line
    with open(tmp / "resumed.jsonl", "ab") as f:
        f.write(expected.splitlines(keepends=True)[2][:10])
    summary = _generate(tiny, tmp, "resumed.jsonl", resume=True)
    assert (summary.resumed, summary.written) == (2, 4)
    assert (tmp / "resumed.jsonl").read_bytes() == expected  # the engine survived the interrupt
    # resuming a finished run generates nothing
    summary = _generate(tiny, tmp, "resumed.jsonl", resume=True)
    assert (summary.resumed, summary.written, summary.stats) == (6, 0, None)
    assert (tmp / "resumed.jsonl").read_bytes() == expected
    # an output of another input is not resumed
    _write_lines(tmp / "in.jsonl", [{"id": "other", "prompt": "x"}, *LINES])
    with pytest.raises(ValueError, match="resumed.jsonl line 1: id 'jack', but input line 1"):
        _generate(tiny, tmp, "resumed.jsonl", resume=True)
    assert (tmp / "resumed.jsonl").read_bytes() == expected


GOOD = {"prompt": "Humpty Dumpty"}
BAD_LINES = [
    ('{"prompt": "a"', "not valid JSON"),
    ('["a"]', "expected a JSON object"),
    ('{"prompt": "a", "max_tokens": 4}', r"unknown field\(s\) \['max_tokens'\]"),
    ('{"prompt": "a", "messages": []}', 'exactly one of "prompt" and "messages"'),
    ('{"id": 3}', 'exactly one of "prompt" and "messages"'),
    ('{"prompt": 3}', '"prompt" must be a string'),
    ('{"messages": []}', '"messages" must be a non-empty list'),
    ('{"messages": "hi"}', '"messages" must be a non-empty list'),
    ('{"messages": [{"role": "user"}]}', "message 0 needs a string 'role' and a string 'content'"),
    ('{"id": true, "prompt": "a"}', '"id" must be a string or an integer'),
    ('{"id": 1, "prompt": "a"}', "id 1 is also the id of line 1"),
    ('{"prompt": "a", "max_new_tokens": 0}', '"max_new_tokens" must be an int >= 1'),
    ('{"prompt": "a", "max_new_tokens": "5"}', '"max_new_tokens" must be an int >= 1'),
    ('{"prompt": "a", "temperature": -1}', "temperature must be a finite number >= 0"),
    ('{"prompt": "a", "top_p": 1.5}', r"top_p must be None or in \(0, 1\]"),
    ('{"prompt": "a", "top_k": -1}', "top_k must be None or an int >= 0"),
    ('{"prompt": "a", "seed": -1}', r"seed must be an integer in \[0, 2\*\*63 - 1\]"),
    ('{"prompt": "a", "max_new_tokens": 600}', "exceeds the model's context of 512"),
]


@pytest.mark.parametrize("line, match", BAD_LINES, ids=[m for _, m in BAD_LINES])
def test_cli_bad_line_names_file_and_line(tiny, tmp_path, line, match):
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps(GOOD) + "\n\n" + line + "\n" + json.dumps(GOOD) + "\n")
    with pytest.raises(ValueError, match=f"{path} line 3: .*{match}"):
        _generate(tiny, tmp_path)
    assert not (tmp_path / "out.jsonl").exists()  # nothing ran, nothing was written


def test_cli_bad_files_and_arguments(tiny, tmp_path, capsys):
    path = tmp_path / "in.jsonl"
    path.write_bytes(json.dumps(GOOD).encode() + b"\n" + b'{"prompt": "\xff"}\n')
    with pytest.raises(ValueError, match=f"{path} line 2: not UTF-8"):
        _generate(tiny, tmp_path)
    path.write_text("\n  \n")
    with pytest.raises(ValueError, match="has no requests"):
        _generate(tiny, tmp_path)
    path.unlink()
    with pytest.raises(ValueError, match="in.jsonl' does not exist"):
        _generate(tiny, tmp_path)
    _write_lines(path, [GOOD])
    (tmp_path / "dir").mkdir()
    with pytest.raises(ValueError, match="is a directory"):
        _generate(tiny, tmp_path, "dir")
    base = ["generate", "--input", str(path), "--output", str(tmp_path / "o.jsonl")]
    assert cli.main([*base, "--model", "preset:gemma3_1b"]) == 2
    assert "give a tokenizer directory with --tokenizer DIR" in capsys.readouterr().err
    assert cli.main([*base, "--model", str(tmp_path)]) == 2
    assert "neither preset:NAME nor a checkpoint directory" in capsys.readouterr().err
    assert cli.main([*base, "--model", "preset:nope", "--tokenizer", str(TINY)]) == 2
    assert "unknown preset 'nope'" in capsys.readouterr().err
    for bad in (["--kv-cap", "lots"], ["--scratch", "maybe"], ["--dtype", "int8"]):
        with pytest.raises(SystemExit):
            cli.main([*base, "--model", str(TINY), *bad])
    assert "a byte count must look like" in capsys.readouterr().err


@pytest.mark.parametrize(
    "text, expected",
    [("4096", 4096), ("512MiB", 512 << 20), ("512M", 512 << 20), ("2GB", 2 * 10**9)],
)
def test_parse_bytes(text, expected):
    assert cli.parse_bytes(text) == expected


# ----------------------------------------------------------------------------- CLI info


def test_info_on_a_full_size_preset_allocates_nothing(capsys, monkeypatch):
    before = sum(a.nbytes for a in jax.live_arrays())
    plan = cli.run(["info", "--model", "preset:gemma4_e2b", "--kv-cap", "8GiB"])
    assert sum(a.nbytes for a in jax.live_arrays()) - before < 1 << 20
    out = capsys.readouterr().out
    assert plan["model"]["num_params"] == PARAM_COUNTS["gemma4_e2b"]["num_params"]
    assert plan["model"]["param_bytes"] == 2 * plan["model"]["num_params"]  # bfloat16
    # docs/design.md's E2B numbers at 8K, chunk 8K, page 32, bf16 (tests/test_experiments.py)
    assert plan["release"]["sequence"]["peak"] == 150_994_944
    assert plan["scratch"]["sequence"]["peak"] == 64_487_424
    assert plan["used"] == "scratch" and plan["kv_cache"]["quota_bytes"] == 8 << 30
    for mode in ("release", "scratch"):
        groups = plan[mode]["groups"]
        assert [g["name"] for g in groups] == ["sliding(512)", "full"]
        assert [g["slot_bytes"] for g in groups] == [12 * 32 * 1024, 3 * 32 * 2048]
        assert plan[mode]["pool_bytes"] <= 8 << 30
    assert plan["scratch"]["groups"][0]["sequence_peak_slots"] == 16 + 20  # window + scratch
    assert "scratch reuse saves 57.3 % of a sequence's peak KV" in out
    assert "4,628,569,344 parameters" in out
    monkeypatch.setattr(sys, "argv", ["swajax", "info", "--model", str(TINY), "--json"])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_module("swajax", run_name="__main__")
    assert exit_info.value.code == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["model"]["num_params"] == 838_016  # README: 0.84 M parameters
