"""`python -m swajax` refuses bad arguments and files before it loads a model, and the JSONL
runner (`swajax.jsonl`) and memory plan (`swajax.plan`) check what they are given.

Oracles: the exit status and `error:` line of `cli.main`, a `load_model` / `model_config`
replaced by one that fails the test (so a refusal provably comes first), the input file's bytes
(never overwritten), and the committed tiny model's tokenizer and config. No engine runs.
"""

import json
import os
import pathlib
import re

import pytest

import gemma
import swajax
from swajax import cli, jsonl, plan

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = ROOT / "experiments" / "tiny_model"
LINES = [{"id": "a", "prompt": "Humpty Dumpty"}, {"id": "b", "prompt": "Mary had"}]


def _write_lines(path, lines):
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


@pytest.fixture
def no_model(monkeypatch):
    """A `cli` that fails the test if it reads a model config or loads a model."""

    def fail(*args, **kwargs):
        raise AssertionError("a model config was read or a model loaded")

    monkeypatch.setattr(cli, "load_model", fail)
    monkeypatch.setattr(cli, "model_config", fail)


def _generate_argv(input_path, output_path, *extra):
    return [
        "generate",
        "--model",
        str(TINY),
        "--input",
        str(input_path),
        "--output",
        str(output_path),
        "--no-progress",
        *extra,
    ]


# ----------------------------------------------------------------------------- files


@pytest.mark.parametrize("resume", [False, True], ids=["new", "resume"])
@pytest.mark.parametrize("spelling", ["same", "dot-slash", "symlink", "hardlink"])
def test_generate_refuses_the_input_as_output(
    tmp_path, monkeypatch, capsys, no_model, spelling, resume
):
    monkeypatch.chdir(tmp_path)
    prompts = _write_lines(tmp_path / "p.jsonl", LINES)
    before = prompts.read_bytes()
    output = {
        "same": "p.jsonl",
        "dot-slash": "./p.jsonl",
        "symlink": tmp_path / "link.jsonl",
        "hardlink": tmp_path / "hard.jsonl",
    }[spelling]
    if spelling == "symlink":
        os.symlink(prompts, output)
    if spelling == "hardlink":
        os.link(prompts, output)
    argv = _generate_argv("p.jsonl", output, *(["--resume"] if resume else []))
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "is the input file 'p.jsonl'" in err
    assert prompts.read_bytes() == before
    # the library function refuses it too, before it looks at the model or tokenizer
    with pytest.raises(ValueError, match="is the input file"):
        jsonl.generate_jsonl(None, None, "p.jsonl", output, resume=resume, progress=False)
    assert prompts.read_bytes() == before


@pytest.mark.parametrize(
    "input_name, output_name, match",
    [
        (
            "p.jsonl",
            "no/such/dir/out.jsonl",
            r"out.jsonl': directory '.*no/such/dir' does not exist",
        ),
        ("p.jsonl", "dir", "output '.*dir' is a directory"),
        ("missing.jsonl", "out.jsonl", "input file '.*missing.jsonl' does not exist"),
        ("dir", "out.jsonl", "input '.*dir' is not a file"),
    ],
    ids=["output-dir-missing", "output-is-dir", "input-missing", "input-is-dir"],
)
def test_generate_checks_files_before_loading_a_model(
    tmp_path, capsys, no_model, input_name, output_name, match
):
    _write_lines(tmp_path / "p.jsonl", LINES)
    (tmp_path / "dir").mkdir()
    assert cli.main(_generate_argv(tmp_path / input_name, tmp_path / output_name)) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ")
    assert re.search(match, err), err
    assert not (tmp_path / "out.jsonl").exists()


# ----------------------------------------------------------------------------- --resume


def _requests():
    return [
        jsonl.LineRequest(k, line["id"], (2, 3), 4, swajax.SamplingParams())
        for k, line in enumerate(LINES, start=1)
    ]


def test_done_lines_accepts_only_result_lines(tmp_path):
    requests = _requests()
    out = tmp_path / "out.jsonl"
    # a copy of the input: its ids match, but its lines are requests, not results
    _write_lines(out, LINES)
    with pytest.raises(ValueError, match=f"{out} line 1: not a result line of this command"):
        jsonl.done_lines(out, requests)
    result = {"id": "a", "text": "x", "token_ids": [5, 1], "finish_reason": "stop"}
    for broken in (
        {k: v for k, v in result.items() if k != "token_ids"},
        {**result, "text": None},
        {**result, "token_ids": "5 1"},
        ["a", "x"],
    ):
        _write_lines(out, [result, broken])
        with pytest.raises(ValueError, match=f"{out} line 2: not a result line"):
            jsonl.done_lines(out, requests)
    _write_lines(out, [result, {**result, "id": "b"}])
    assert jsonl.done_lines(out, requests) == (2, out.stat().st_size)
    # a last line cut short is not done
    size = out.stat().st_size
    with out.open("ab") as f:
        f.write(b'{"id": "c", "te')
    assert jsonl.done_lines(out, requests) == (2, size)


def test_resume_on_a_copy_of_the_input_is_refused(tmp_path, capsys):
    prompts = _write_lines(tmp_path / "p.jsonl", LINES)
    copy = _write_lines(tmp_path / "copy.jsonl", LINES)
    assert cli.main(_generate_argv(prompts, copy, "--resume")) == 2
    assert f"error: {copy} line 1: not a result line" in capsys.readouterr().err
    assert copy.read_bytes() == prompts.read_bytes()


# ----------------------------------------------------------------------------- input text


@pytest.fixture(scope="module")
def tokenizer():
    return gemma.load_tokenizer(TINY)


@pytest.mark.parametrize(
    "line, name",
    [
        ('{"prompt": "abc\\ud800def"}', '"prompt"'),
        (
            '{"messages": [{"role": "user", "content": "ok \\udfff"}]}',
            r'"messages"\[0\]\["content"\]',
        ),
        ('{"id": "\\ud800", "prompt": "abc"}', '"id"'),
    ],
    ids=["prompt", "messages", "id"],
)
@pytest.mark.parametrize("chat", [False, True], ids=["plain", "chat"])
def test_lone_surrogate_is_a_line_error(tmp_path, tokenizer, line, name, chat):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(LINES[0]) + "\n" + line + "\n")
    code = "U\\+DFFF" if "udfff" in line else "U\\+D800"
    with pytest.raises(ValueError, match=f"{path} line 2: {name} holds {code} at character"):
        jsonl.read_requests(path, tokenizer, chat=chat)


def test_cli_lone_surrogate_exits_2(tmp_path, capsys):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "abc\\ud800def"}\n')
    assert cli.main(_generate_argv(path, tmp_path / "out.jsonl")) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {path} line 1: ") and "U+D800 at character 3" in err
    assert not (tmp_path / "out.jsonl").exists()


# ----------------------------------------------------------------------------- integer options

INFO_BAD = [
    ("--input-len", "0", "must be an int >= 1, got 0"),
    ("--chunk", "0", "must be an int >= 1, got 0"),
    ("--max-context", "-5", "must be an int >= 1, got -5"),
    ("--max-batch", "0", "must be an int >= 1, got 0"),
    ("--page-size", "0", "must be an int >= 1, got 0"),
    ("--input-len", "8k", "must be an int >= 1, got '8k'"),
]
GENERATE_BAD = [
    ("--max-new-tokens", "0", "must be an int >= 1, got 0"),
    ("--max-num-tokens", "0", "must be an int >= 1, got 0"),
    ("--prefill-chunk", "-1", "must be an int >= 1, got -1"),
    ("--max-batch", "0", "must be an int >= 1, got 0"),
    ("--page-size", "0", "must be an int >= 1, got 0"),
    ("--top-k", "-1", "must be an int >= 0, got -1"),
    ("--num-draft-tokens", "-2", "must be an int >= 0, got -2"),
    ("--seed", "-1", r"must be an integer in \[0, 2\*\*63 - 1\], got '-1'"),
    ("--seed", str(2**63), r"must be an integer in \[0, 2\*\*63 - 1\]"),
]


@pytest.mark.parametrize("option, value, match", INFO_BAD, ids=[f"{o}={v}" for o, v, _ in INFO_BAD])
def test_info_rejects_out_of_range_integers(capsys, no_model, option, value, match):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["info", "--model", "preset:gemma4_e2b", option, value])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "error: argument " + option in err
    assert re.search(match, err), err


@pytest.mark.parametrize(
    "option, value, match", GENERATE_BAD, ids=[f"{o}={v}" for o, v, _ in GENERATE_BAD]
)
def test_generate_rejects_out_of_range_integers(tmp_path, capsys, no_model, option, value, match):
    prompts = _write_lines(tmp_path / "p.jsonl", LINES)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(_generate_argv(prompts, tmp_path / "out.jsonl", option, value))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "error: argument " + option in err
    assert re.search(match, err), err


def test_engine_options_reach_the_engine_config():
    args = cli._parser().parse_args(
        ["serve", "--model", "preset:gemma4_e2b", "--num-draft-tokens", "3", "--no-prefix-caching"]
    )
    config = cli._engine_config(args, swajax.KVCacheConfig())
    assert config.num_draft_tokens == 3 and config.drafter == "ngram"
    assert not config.enable_prefix_caching


@pytest.mark.parametrize("name", ["input_len", "chunk", "max_context", "max_batch"])
def test_memory_plan_rejects_zero(name):
    config = cli.model_config(str(TINY))
    with pytest.raises(ValueError, match=f"{name} must be an int >= 1, got 0"):
        plan.memory_plan(config, **{name: 0})
