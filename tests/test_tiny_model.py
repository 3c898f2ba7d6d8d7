"""The committed tiny trained model (experiments/tiny_model/, built by experiments/train_tiny.py):
it loads with its tokenizer, greedy generation continues a rhyme of its corpus, and tokens and
logits equal what transformers makes of the same directory (tiny_model_oracle.json, built by
make fixtures); and a smoke run of the training script at a few steps."""

import hashlib
import importlib.util
import json
import pathlib
import sys

import jax.numpy as jnp
import numpy as np
import pytest

import gemma
import swajax

EXPERIMENTS = pathlib.Path(__file__).resolve().parents[1] / "experiments"
TINY = EXPERIMENTS / "tiny_model"
HF = json.loads(
    (
        pathlib.Path(__file__).parent / "fixtures" / "tokenizers" / "tiny_model_oracle.json"
    ).read_text()
)


def _load_train_tiny():
    spec = importlib.util.spec_from_file_location(
        "_experiments_train_tiny", EXPERIMENTS / "train_tiny.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


train_tiny = _load_train_tiny()


@pytest.fixture(scope="module")
def tiny():
    return gemma.from_pretrained(TINY), gemma.load_tokenizer(TINY)


def test_tiny_model_files(tiny):
    model, tok = tiny
    sha = hashlib.sha256((TINY / "model.safetensors").read_bytes()).hexdigest()
    assert sha == HF["model_safetensors_sha256"], "retrained: rebuild the oracle (make fixtures)"
    assert model.config == train_tiny.tiny_config(tok.vocab_size)
    assert tok.eos_token_ids == (tok.eos_token_id, tok.end_of_turn_id) == (1, 6)
    size = sum(p.stat().st_size for p in TINY.iterdir())
    assert size < 4_000_000, size  # float32, committed


def test_greedy_generation_continues_a_rhyme(tiny):
    """Oracle: the corpus text that follows the prompt (the model memorised its rhymes)."""
    model, tok = tiny
    rhymes = dict(train_tiny.read_rhymes())
    text = rhymes["Humpty Dumpty"]
    first, rest = text.split("\n", 1)
    plain = tok.encode(f"Humpty Dumpty\n{first}\n")
    chat = tok.apply_chat_template(
        [{"role": "user", "content": train_tiny.chat_request("Jack and Jill")}],
        add_generation_prompt=True,
        tokenize=True,
    )
    out = swajax.generate(
        model,
        [plain, chat],
        24,
        kv_cache=swajax.KVCacheConfig(page_size=16),
        implementation="reference",
    )
    assert tok.decode(out[0]).startswith(rest[:40]), tok.decode(out[0])
    assert tok.decode(out[1]).startswith(rhymes["Jack and Jill"][:40]), tok.decode(out[1])
    # transformers loads the directory save_pretrained wrote and generates the same tokens.
    assert chat == HF["prompt_ids"]
    assert out[1] == HF["greedy_ids"]


def test_logits_match_transformers(tiny):
    model, _ = tiny
    logits = np.asarray(model(jnp.asarray([HF["prompt_ids"]]))[0, -1], np.float64)
    expected = np.asarray(HF["last_logits"])
    rel = np.linalg.norm(logits - expected) / np.linalg.norm(expected)
    assert rel <= 1e-4, rel


def test_results_json_records_the_committed_run(tiny):
    """The JSON's greedy samples are what the committed model generates now (the script's own
    sampling function on its own prompts): the record and the model cannot drift apart."""
    model, tok = tiny
    result = json.loads((EXPERIMENTS / "results" / "train_tiny.json").read_text())
    assert result["loss_last"] < 0.2
    samples = train_tiny.greedy_samples(
        model, tok, train_tiny.read_rhymes(), result["parameters"].get("sample_tokens", 64)
    )
    assert samples == result["samples"]
    assert all(s["completion"] and s["stopped"] for s in samples)


def test_train_script_smoke(tmp_path):
    result = train_tiny.main(
        [
            "--steps",
            "2",
            "--sample-tokens",
            "0",
            "--vocab-size",
            "400",
            "--out",
            str(tmp_path / "hf"),
            "--orbax-out",
            str(tmp_path / "orbax"),
            "--results",
            str(tmp_path / "result.json"),
        ]
    )
    assert result["samples"] == [] and len(result["loss_every_50"]) == 1
    tok = gemma.load_tokenizer(tmp_path / "hf")
    assert tok.vocab_size == 400
    model = gemma.from_pretrained(tmp_path / "hf")
    assert gemma.saved_config(tmp_path / "orbax") == model.config
