"""Gemma 4's multi-token-prediction assistant (`gemma.Gemma4Assistant`) against Hugging Face's
`Gemma4AssistantForCausalLM` (tests/fixtures/hf/gemma4_assistant*, random weights): the
drafts, logits and projected states of three greedy drafts at four context lengths, on the
K/V and final hidden state of the `gemma4_ple_shared` target; and the errors of a config or
checkpoint that does not fit."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file
from test_generate import make_model

import gemma
from gemma import configs
from pallas_kernels import _checks

FIXTURES = Path(__file__).parent / "fixtures" / "hf"


@pytest.fixture(scope="module")
def target():
    return gemma.from_pretrained(FIXTURES / "gemma4_ple_shared")


@pytest.mark.parametrize("case", ["gemma4_assistant", "gemma4_assistant_ordered"])
def test_drafts_logits_and_states_match_hugging_face(target, case):
    assistant = gemma.load_assistant(FIXTURES / case)
    assert assistant.config.sources(target.config) == (4, 4, 3)  # last sliding / full writers
    assert (assistant.centroids is not None) == case.endswith("ordered")
    oracle = np.load(FIXTURES / case / "oracle.npz")
    ids = oracle["input_ids"]
    num_drafts = oracle["tokens"].shape[1]
    for c, h in enumerate(oracle["contexts"]):
        for b in range(ids.shape[0]):
            drafts, logits, projected = gemma.draft_reference(
                target, assistant, ids[b, : h + 1], num_drafts, return_outputs=True
            )
            assert drafts == oracle["tokens"][c, :, b].tolist(), (case, h, b)
            want = oracle["logits"][c, :, b]  # [drafts, V]
            if case.endswith("ordered"):  # unchosen tokens: the call's smallest logit less one
                chosen = want > want.min(axis=-1, keepdims=True)  # (HF's call had two rows)
                assert (chosen.sum(-1) == 2 * 16).all()  # top-2 of 8 clusters of 16 tokens
                logits = np.asarray(logits)
                assert (logits[~chosen].reshape(num_drafts, -1).max(-1) < want.max(-1)).all()
                logits, want = logits[chosen], want[chosen]
            np.testing.assert_allclose(logits, want, atol=2e-4, rtol=1e-4)
            np.testing.assert_allclose(
                projected, oracle["projected"][c, :, b], atol=2e-4, rtol=1e-4
            )


def test_a_target_that_does_not_fit_and_a_bad_checkpoint_are_named(target, tmp_path):
    assistant = gemma.load_assistant(FIXTURES / "gemma4_assistant")
    with pytest.raises(
        ValueError,
        match=r"the target is gemma3, not gemma4; full layers' \(KV heads, head_dim\) are "
        r"\(1, 32\)",
    ):
        assistant.config.sources(make_model("gemma3").config)
    narrow = target.config.replace(sliding_window=16)
    with pytest.raises(ValueError, match=r"sliding windows differ \(8 vs 16\)"):
        assistant.config.sources(narrow)
    with pytest.raises(ValueError, match="model_type must be 'gemma4_assistant'"):
        gemma.assistant_config_from_hf({"model_type": "gemma4_text"})
    hf = json.loads((FIXTURES / "gemma4_assistant" / "config.json").read_text())
    hf["text_config"]["num_kv_shared_layers"] = 1
    with pytest.raises(ValueError, match="num_kv_shared_layers must equal num_hidden_layers"):
        gemma.assistant_config_from_hf(hf)
    broken = tmp_path / "broken"
    shutil.copytree(FIXTURES / "gemma4_assistant", broken)
    tensors = load_file(broken / "model.safetensors")
    del tensors["pre_projection.weight"]
    tensors["model.layers.0.self_attn.k_proj.weight"] = np.zeros((16, 32), np.float32)
    save_file(tensors, broken / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing tensors .*\['pre_projection.weight'\]"):
        gemma.load_assistant(broken)


def test_a_random_assistant_builds_from_its_config(target):
    config = gemma.load_assistant(FIXTURES / "gemma4_assistant_ordered").config
    model = gemma.Gemma4Assistant(config, rngs=nnx.Rngs(0))
    drafts = gemma.draft_reference(target, model, [5, 9, 17, 3], 2)
    assert len(drafts) == 2 and all(0 <= t < config.body.vocab_size for t in drafts)
    assert model.token_ordering[...].dtype == jnp.int32


def test_the_cli_loads_an_assistant_drafter_and_names_a_wrong_one(target, tmp_path, capsys):
    from swajax import cli

    args = cli._parser().parse_args(
        ["generate", "--model", "gemma3_1b", "--input", "x", "--output", "y"]
        + ["--num-draft-tokens", "3", "--drafter", str(FIXTURES / "gemma4_assistant")]
    )
    args.kv_dtype = cli._dtype_name(args.dtype)
    config = cli._with_drafter(args, cli._engine_config(args, cli._kv_cache_config(args)), target)
    assert isinstance(config.drafter, gemma.Gemma4Assistant) and config.num_draft_tokens == 3
    for bad, why in [
        (FIXTURES / "gemma4_ple_shared", "has model_type 'gemma4_text'"),
        (tmp_path, "neither 'ngram' nor a checkpoint directory"),
    ]:
        with pytest.raises(SystemExit) as e:
            cli._parser().parse_args(["generate", "--model", "m", "--drafter", str(bad)])
        assert e.value.code == 2
        assert why in capsys.readouterr().err


def _assistant_geometry(name):
    """What the assistant's lowering depends on: per layer type read, the decode kernel's
    (head_dim, GQA group, window) (`assistant_config_for` keeps the target's heads)."""
    c = configs.small_preset(name)
    return tuple(
        (t, c.type_head_dim(t), c.num_heads // c.type_num_kv_heads(t), t == "sliding")
        for t in ("sliding", "full")
    )


GEMMA4 = [n for n in configs.PRESET_NAMES if configs.preset(n).family == "gemma4"]
DISTINCT = list({_assistant_geometry(n): n for n in GEMMA4}.values())


@pytest.mark.parametrize("name", DISTINCT)
def test_in_step_drafting_lowers_for_cuda_at_the_preset_geometries(name):
    """The assistant's drafting round of the step (`swajax._runner._assistant_drafts`: its
    layers' queries through the Pallas decode kernel on the target's pool roots and page tables)
    lowers for CUDA at each distinct Gemma 4 preset geometry (small_preset: attention geometry
    kept)."""
    import swajax
    from swajax._paged import make_attention_fn
    from swajax._runner import _assistant_drafts
    from swajax._transforms import StepMetadata

    config = configs.small_preset(name)
    bf16 = dict(dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    model = gemma.Transformer(config, rngs=nnx.Rngs(0), moe_implementation="pallas", **bf16)
    assistant = gemma.Gemma4Assistant(
        gemma.assistant_config_for(config, num_layers=2), rngs=nnx.Rngs(1), **bf16
    )
    kv = swajax.KVCacheConfig(page_size=32, max_gpu_total_bytes=32 << 20)
    engine = swajax.Engine(
        model, kv, max_context=256, max_batch=4, implementation="pallas",
        num_draft_tokens=3, drafter=assistant,
    )  # fmt: skip
    runner, layout = engine.runner, engine.layout
    a_graphdef, a_sources = runner.assistant
    t_graphdef, (t_params, a_params) = runner.graphdef, runner._step_params
    rows = layout.max_batch

    def draft(t_params, a_params, state, tables, hidden, picked, last, kv_lens):
        meta = StepMetadata(jnp.ones(rows, jnp.int32), jnp.arange(rows + 1), kv_lens)
        return _assistant_drafts(
            (a_graphdef, a_sources),
            a_params,
            nnx.merge(t_graphdef, t_params),
            hidden,
            picked,
            last,
            meta,
            make_assistant_hook=lambda m: make_attention_fn(
                layout, tables, m, state.k_scales, state.v_scales, decode=True,
                implementation="pallas",
            ),
            pools=state.pools,
            num_drafts=3,
        )  # fmt: skip

    sds = jax.ShapeDtypeStruct
    args = (
        t_params,
        a_params,
        runner.state,
        runner.tables,
        sds((rows, 4, config.hidden_size), jnp.bfloat16),
        sds((rows,), jnp.int32),
        sds((rows,), jnp.int32),
        sds((rows,), jnp.int32),
    )
    with _checks.force_compiled():
        text = jax.jit(draft).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "pallas_kernels/_decode_kernel.py" in text, name
