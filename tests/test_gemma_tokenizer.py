"""`gemma.load_tokenizer` against transformers' AutoTokenizer (ids, decoded text, chat
templates; oracle in tests/fixtures/tokenizers/oracle.json), streaming decode, and the
errors of missing or malformed tokenizer files."""

import json
import shutil
from pathlib import Path

import chex
import jax.numpy as jnp
import pytest

import gemma

FIXTURES = Path(__file__).parent / "fixtures" / "tokenizers"
ORACLE = json.loads((FIXTURES / "oracle.json").read_text(encoding="utf-8"))
CASES = sorted(ORACLE)
STREAM_TEXTS = [
    "Crème brûlée, café, œuf",
    "日本語のテキスト and emoji 🙂👍🏽 🇫🇷",
    "e\u0301 ∑∫ ‽ mixed with <end_of_turn> turns",
]


@pytest.fixture(scope="module", params=CASES)
def case(request):
    return request.param, gemma.load_tokenizer(FIXTURES / request.param), ORACLE[request.param]


def test_cases_present():
    assert set(CASES) == {"gemma3", "gemma4", "sentencepiece"}


def test_vocabulary_and_special_ids_match_hf(case):
    _, tok, ref = case
    assert tok.vocab_size == ref["vocab_size"]
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (
        ref["bos_token_id"],
        ref["eos_token_id"],
        ref["pad_token_id"],
    )
    assert sorted(tok.special_token_ids) == ref["all_special_ids"]


def test_encode_matches_hf(case):
    _, tok, ref = case
    for text, ids, plain in zip(ref["texts"], ref["encode"], ref["encode_no_special"], strict=True):
        assert tok.encode(text) == ids, text
        assert tok.encode(text, add_special_tokens=False) == plain, text


def test_decode_matches_hf(case):
    _, tok, ref = case
    for ids, text, skipped in zip(
        ref["decode_ids"], ref["decode"], ref["decode_skip_special"], strict=True
    ):
        assert tok.decode(ids) == text, ids
        assert tok.decode(ids, skip_special_tokens=True) == skipped, ids


def test_chat_template_matches_hf(case):
    name, tok, ref = case
    assert len(ref["chats"]) == 4, name
    for chat in ref["chats"]:
        kw = dict(add_generation_prompt=chat["add_generation_prompt"], **chat["kwargs"])
        assert tok.apply_chat_template(chat["messages"], **kw) == chat["text"]
        assert tok.apply_chat_template(chat["messages"], tokenize=True, **kw) == chat["ids"]


def test_bos_rule_and_stop_ids():
    g3, g4, sp = (gemma.load_tokenizer(FIXTURES / c) for c in ("gemma3", "gemma4", "sentencepiece"))
    for tok in (g3, g4, sp):
        assert tok.add_bos_token
        assert tok.encode("hi")[0] == tok.bos_token_id
        # The template writes <bos>; the rendered chat is not given a second one.
        ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True)
        assert ids.count(tok.bos_token_id) == 1 and ids[0] == tok.bos_token_id
    assert g3.id_to_token(g3.end_of_turn_id) == "<end_of_turn>"
    assert g3.id_to_token(g3.start_of_turn_id) == "<start_of_turn>"
    assert g4.id_to_token(g4.end_of_turn_id) == "<turn|>"
    assert g4.id_to_token(g4.start_of_turn_id) == "<|turn>"
    for tok in (g3, g4, sp):
        assert tok.eos_token_ids == (tok.eos_token_id, tok.end_of_turn_id)
    prompt = g4.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert prompt == "<bos><|turn>user\nhi<turn|>\n<|turn>model\n"


def test_generation_config_eos_joins_stop_ids(tmp_path):
    d = tmp_path / "tok"
    shutil.copytree(FIXTURES / "gemma4", d)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [6, 1, 0]}))
    assert gemma.load_tokenizer(d).eos_token_ids == (1, 6, 0)


@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_incremental_decode_equals_one_shot(case, text):
    _, tok, _ = case
    ids = tok.encode(text)
    assert any(tok.id_to_token(i).startswith("<0x") for i in ids)  # byte-fallback pieces
    for skip in (False, True):
        decoder = tok.incremental_decoder(skip_special_tokens=skip)
        pieces = [decoder.feed(i) for i in ids]
        pieces.append(decoder.flush())
        assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip)
        assert not any("\ufffd" in p for p in pieces)
        assert decoder.ids == tuple(ids)
    # Ids fed in uneven chunks give the same text.
    decoder = tok.incremental_decoder()
    chunks = [ids[i : i + 3] for i in range(0, len(ids), 3)]
    assert "".join(decoder.feed(c) for c in chunks) + decoder.flush() == tok.decode(ids)


def test_incremental_decode_holds_a_split_character():
    tok = gemma.load_tokenizer(FIXTURES / "gemma3")
    smile = [tok.token_to_id(f"<0x{b:02X}>") for b in "🙂".encode()]
    decoder = tok.incremental_decoder()
    assert decoder.feed(tok.encode("a", add_special_tokens=False)) == "a"
    assert [decoder.feed(i) for i in smile] == ["", "", "", "🙂"]
    assert decoder.feed(smile[:2]) == ""
    assert decoder.flush() == "\ufffd\ufffd"  # the stream ended inside a character


def test_bad_ids_and_messages():
    tok = gemma.load_tokenizer(FIXTURES / "gemma3")
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 601\)"):
        tok.decode([1, 601])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.incremental_decoder().feed(-1)
    with pytest.raises(TypeError, match="must be a str"):
        tok.encode(b"bytes")
    with pytest.raises(ValueError, match="messages is empty"):
        tok.apply_chat_template([])
    with pytest.raises(ValueError, match="roles must alternate"):
        tok.apply_chat_template([{"role": "user", "content": "a"}] * 2)
    with pytest.raises(ValueError, match="must be a dict with a 'role'"):
        tok.apply_chat_template(["hello"])


def _copy(tmp_path, case="gemma3") -> Path:
    d = tmp_path / case
    shutil.copytree(FIXTURES / case, d)
    return d


def _write(path: Path, content) -> None:
    path.write_bytes(content if isinstance(content, bytes) else content.encode())


@pytest.mark.parametrize(
    "case, file, content, match",
    [
        ("gemma3", "tokenizer.json", "", r"tokenizer\.json.*not valid JSON"),
        ("gemma3", "tokenizer.json", "[1, 2]", r"tokenizer\.json.*JSON object, got list"),
        ("gemma3", "tokenizer.json", '{"model": 3}', r"tokenizer\.json.*malformed"),
        ("gemma3", "tokenizer.json", b"\xff\xfe\x00", r"tokenizer\.json.*not UTF-8"),
        ("gemma3", "tokenizer_config.json", "{", r"tokenizer_config\.json.*not valid JSON"),
        ("gemma3", "tokenizer_config.json", '"x"', r"tokenizer_config\.json.*JSON object"),
        (
            "gemma3",
            "tokenizer_config.json",
            '{"chat_template": 5}',
            r"tokenizer_config\.json.*chat_template must be",
        ),
        (
            "gemma3",
            "tokenizer_config.json",
            '{"bos_token": 7}',
            r"tokenizer_config\.json.*bos_token must be a string",
        ),
        (
            "gemma3",
            "tokenizer_config.json",
            '{"added_tokens_decoder": {"9": {"content": "<bos>"}}}',
            r"tokenizer_config\.json.*'<bos>' has id 2 in the vocabulary, not 9",
        ),
        (
            "gemma3",
            "tokenizer_config.json",
            '{"chat_template": "{% if %}"}',
            r"chat template 'default' in .*tokenizer_config\.json.*not valid jinja",
        ),
        ("gemma4", "chat_template.jinja", "{{ unclosed", r"chat_template\.jinja.*not valid jinja"),
        ("gemma3", "generation_config.json", "[]", r"generation_config\.json.*JSON object"),
        (
            "gemma3",
            "generation_config.json",
            '{"eos_token_id": "1"}',
            r"generation_config\.json.*eos_token_id must be",
        ),
        (
            "gemma3",
            "generation_config.json",
            '{"eos_token_id": 5000}',
            r"generation_config\.json.*\[5000\] outside the vocabulary",
        ),
        ("sentencepiece", "tokenizer.model", b"not a model", r"tokenizer\.model.*malformed"),
        ("sentencepiece", "tokenizer.model", b"", r"tokenizer\.model"),
    ],
)
def test_malformed_files_name_the_file(tmp_path, case, file, content, match):
    d = _copy(tmp_path, case)
    _write(d / file, content)
    with pytest.raises(ValueError, match=match):
        gemma.load_tokenizer(d)


def test_missing_files(tmp_path):
    with pytest.raises(ValueError, match="no checkpoint directory"):
        gemma.load_tokenizer(tmp_path / "nothing")
    with pytest.raises(ValueError, match="no tokenizer.json or tokenizer.model"):
        gemma.load_tokenizer(tmp_path)
    d = _copy(tmp_path)
    (d / "tokenizer_config.json").unlink()
    tok = gemma.load_tokenizer(d)  # the config is optional; Gemma's defaults apply
    assert tok.bos_token_id == 2 and tok.chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_template_files_take_priority(tmp_path):
    d = _copy(tmp_path)
    (d / "chat_templates").mkdir()
    (d / "chat_templates" / "plain.jinja").write_text("{{ messages[0]['content'] }}")
    tok = gemma.load_tokenizer(d)
    assert set(tok.chat_templates) == {"plain"}
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match=r"several chat templates and no default.*\['plain'\]"):
        tok.apply_chat_template(msgs)
    assert tok.apply_chat_template(msgs, chat_template="plain") == "hi"
    assert tok.apply_chat_template(msgs, chat_template="<{{ bos_token }}>") == "<<bos>>"


def test_checkpoint_beside_the_tokenizer_loads():
    model = gemma.from_pretrained(FIXTURES / "gemma3")
    tok = gemma.load_tokenizer(FIXTURES / "gemma3")
    assert model.config.vocab_size == tok.vocab_size
    ids = tok.encode("Hello world")
    chex.assert_shape(model(jnp.asarray([ids])), (1, len(ids), tok.vocab_size))
