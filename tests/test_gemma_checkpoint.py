"""Checkpoint errors (missing / mis-shaped tensors, unknown architectures), Orbax round trip,
random init, and token-id validation at the API boundary."""

import json
import shutil
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

import gemma

CASE = Path(__file__).parent / "fixtures" / "hf" / "gemma3_linear"
SHARDED = Path(__file__).parent / "fixtures" / "hf" / "gemma3_sharded"


def tiny_gemma4(**overrides):
    kw = dict(
        num_layers=6,
        hidden_size=32,
        intermediate_size=48,
        num_heads=2,
        num_kv_heads=1,
        head_dim=8,
        global_head_dim=16,
        vocab_size=64,
        per_layer_input_dim=4,
        num_experts=4,
        num_experts_per_token=2,
        moe_intermediate_size=8,
    )
    return gemma.configs.gemma4_e2b(**{**kw, **overrides})


@pytest.fixture
def case_copy(tmp_path):
    target = tmp_path / "ckpt"
    shutil.copytree(CASE, target)
    return target


def _rewrite_tensors(directory: Path, edit) -> None:
    tensors = load_file(directory / "model.safetensors")
    edit(tensors)
    save_file(tensors, directory / "model.safetensors")


def test_missing_tensor_is_named(case_copy):
    _rewrite_tensors(case_copy, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(
        ValueError, match=r"missing tensors.*model\.layers\.1\.mlp\.up_proj\.weight"
    ):
        gemma.from_pretrained(case_copy)


def test_misshaped_tensor_is_named(case_copy):
    def edit(t):
        t["model.layers.0.self_attn.q_norm.weight"] = np.zeros((17,), np.float32)

    _rewrite_tensors(case_copy, edit)
    with pytest.raises(
        ValueError,
        match=r"model\.layers\.0\.self_attn\.q_norm\.weight: expected \(16,\), got \(17,\)",
    ):
        gemma.from_pretrained(case_copy)


def test_unknown_architecture_is_named(case_copy):
    config = json.loads((case_copy / "config.json").read_text())
    config["architectures"] = ["LlamaForCausalLM"]
    (case_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported architecture 'LlamaForCausalLM'"):
        gemma.from_pretrained(case_copy)


def test_missing_files(tmp_path, case_copy):
    with pytest.raises(ValueError, match="no config.json"):
        gemma.from_pretrained(tmp_path)
    (case_copy / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no model.safetensors"):
        gemma.from_pretrained(case_copy)
    sharded = tmp_path / "sharded"
    shutil.copytree(SHARDED, sharded)
    (sharded / "model-00003-of-00006.safetensors").unlink()
    with pytest.raises(ValueError, match="model-00003-of-00006.safetensors"):
        gemma.from_pretrained(sharded)


def test_unused_layer_tensors_are_named(case_copy):
    """An 8-layer checkpoint whose config says 7 layers does not load silently."""
    config = json.loads((case_copy / "config.json").read_text())
    config["num_hidden_layers"] = 7
    config["layer_types"] = config["layer_types"][:7]
    (case_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ValueError,
        match=r"13 tensors .* not used by its config \(config.json has 7 layers; the checkpoint "
        r"has tensors of layers up to 7\): model\.layers\.7\.input_layernorm\.weight, ",
    ):
        gemma.from_pretrained(case_copy)
    model = gemma.from_pretrained(case_copy, strict=False)
    assert model.config.num_layers == 7


def test_unknown_tensor_and_untied_head_are_named(case_copy):
    raw = load_file(case_copy / "model.safetensors")
    _rewrite_tensors(case_copy, lambda t: t.update({"model.extra.bias": np.zeros(3, np.float32)}))
    with pytest.raises(ValueError, match=r"1 tensors .* not used .*: model\.extra\.bias;"):
        gemma.from_pretrained(case_copy)
    # A stored copy of the tied embedding is accepted, a different lm_head is not.
    embed = raw["model.embed_tokens.weight"]

    def head(w):
        def edit(t):
            t.pop("model.extra.bias", None)
            t["lm_head.weight"] = w

        return edit

    _rewrite_tensors(case_copy, head(embed.copy()))
    gemma.from_pretrained(case_copy)
    _rewrite_tensors(case_copy, head(embed + 1))
    with pytest.raises(ValueError, match="lm_head.weight differs from the embedding"):
        gemma.from_pretrained(case_copy)


@pytest.mark.parametrize(
    "content, match",
    [
        ("", r"config\.json.*not valid JSON"),
        ("[1, 2]", r"config\.json.*must hold a JSON object, got list"),
        ('{"architectures": "Gemma3ForCausalLM"}', r"config\.json.*architectures must be a list"),
        ('{"architectures": ["Gemma3ForCausalLM"]}', r"config\.json.*model_type None"),
        (
            '{"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", '
            '"num_hidden_layers": "8"}',
            r"config\.json.*cannot be interpreted as an integer",
        ),
        (
            '{"model_type": "gemma3", "text_config": [1]}',
            r"config\.json",
        ),
    ],
)
def test_malformed_config_json_is_named(case_copy, content, match):
    (case_copy / "config.json").write_text(content)
    with pytest.raises(ValueError, match=match):
        gemma.from_pretrained(case_copy)


@pytest.mark.parametrize("how", ["truncate", "zero"])
def test_damaged_safetensors_is_named(case_copy, how):
    _corrupt(case_copy / "model.safetensors", how)
    with pytest.raises(ValueError, match=r"safetensors file .*model\.safetensors.* unreadable"):
        gemma.from_pretrained(case_copy)


@pytest.mark.parametrize(
    "index, match",
    [
        ("{", r"model\.safetensors\.index\.json.*not valid JSON"),
        ('{"metadata": {}}', r"model\.safetensors\.index\.json.*needs a 'weight_map'"),
        ('{"weight_map": {"a": 3}}', r"needs a 'weight_map'"),
        ('{"weight_map": {"a": "../model.safetensors"}}', r"needs a 'weight_map'"),
    ],
)
def test_malformed_index_is_named(tmp_path, index, match):
    sharded = tmp_path / "sharded"
    shutil.copytree(SHARDED, sharded)
    (sharded / "model.safetensors.index.json").write_text(index)
    with pytest.raises(ValueError, match=match):
        gemma.from_pretrained(sharded)


@pytest.mark.parametrize(
    "case", ["gemma3_linear", "gemma4_ple_shared", "gemma4_moe", "gemma4_keqv"]
)
def test_save_pretrained_writes_hf_tensors(tmp_path, case):
    """Loading an HF checkpoint and saving it gives back HF's tensors, names and config."""
    source = CASE.parent / case
    model = gemma.from_pretrained(source)
    gemma.save_pretrained(model, tmp_path / "out")
    original, saved = (
        load_file(source / "model.safetensors"),
        load_file(tmp_path / "out" / "model.safetensors"),
    )
    assert sorted(saved) == sorted(original)
    chex.assert_trees_all_equal(saved, original)
    hf = json.loads((tmp_path / "out" / "config.json").read_text())
    assert gemma.config_from_hf(hf) == model.config


@pytest.mark.parametrize("param_dtype", [jnp.float32, jnp.bfloat16])
def test_save_pretrained_round_trip_is_bit_exact(tmp_path, param_dtype):
    config = tiny_gemma4(
        attention_k_eq_v=True, num_global_kv_heads=1, num_kv_heads=2, tie_word_embeddings=False
    )
    model = gemma.Transformer(config, rngs=nnx.Rngs(5), param_dtype=param_dtype)
    model.set_layer_param(2, "layer_scalar", jnp.array([0.5], param_dtype))
    gemma.save_pretrained(model, tmp_path / "out")
    loaded = gemma.from_pretrained(tmp_path / "out", dtype=param_dtype)
    assert loaded.config == model.config
    chex.assert_trees_all_equal(nnx.state(loaded), nnx.state(model))
    with pytest.raises(ValueError, match="already exist"):
        gemma.save_pretrained(model, tmp_path / "out")
    gemma.save_pretrained(model, tmp_path / "out", overwrite=True)


def test_config_to_hf_round_trips_presets():
    for name in gemma.configs.PRESET_NAMES:
        config = gemma.configs.preset(name)
        assert gemma.config_from_hf(gemma.config_to_hf(config)) == config, name


def test_loaded_values_and_layouts(case_copy):
    """Spot-check the [out, in] -> einsum layout conversion against the raw tensors."""
    raw = load_file(case_copy / "model.safetensors")
    model = gemma.from_pretrained(case_copy)
    q = raw["model.layers.2.self_attn.q_proj.weight"]  # [N*H, D]
    chex.assert_trees_all_equal(
        model.layer_param(2, "attn.q_proj"), q.reshape(4, 16, 64).transpose(2, 0, 1)
    )
    o = raw["model.layers.2.self_attn.o_proj.weight"]  # [D, N*H]
    chex.assert_trees_all_equal(model.layer_param(2, "attn.o_proj"), o.T.reshape(4, 16, 64))
    chex.assert_trees_all_equal(
        model.layer_param(7, "mlp.down_proj"), raw["model.layers.7.mlp.down_proj.weight"].T
    )


def _leaves(model):
    return jax.tree_util.tree_leaves_with_path(nnx.state(model))


def test_orbax_round_trip(tmp_path):
    model = gemma.Transformer(tiny_gemma4(), rngs=nnx.Rngs(3))
    # Non-default buffers and norms, so a restore that re-initialises would be caught.
    model.set_layer_param(2, "layer_scalar", jnp.array([0.5]))
    model.final_norm.scale[...] = jnp.linspace(0.5, 1.5, 32)
    gemma.save_params(model, tmp_path / "params")
    from_config = gemma.restore_params(model.config, tmp_path / "params")
    from_model = gemma.restore_params(
        gemma.Transformer(model.config, rngs=nnx.Rngs(9)), tmp_path / "params"
    )
    assert any("layer_scalar" in jax.tree_util.keystr(p) for p, _ in _leaves(model))
    for restored in (from_config, from_model):
        # Same tree paths, shapes and dtypes, equal values.
        chex.assert_trees_all_equal(nnx.state(restored), nnx.state(model), strict=True)
    with pytest.raises(ValueError, match="already exists|exists"):
        gemma.save_params(model, tmp_path / "params")
    gemma.save_params(model, tmp_path / "params", overwrite=True)


def test_orbax_restore_into_other_config_raises(tmp_path):
    model = gemma.Transformer(tiny_gemma4(), rngs=nnx.Rngs(0))
    gemma.save_params(model, tmp_path / "params")
    assert gemma.saved_config(tmp_path / "params") == model.config
    with pytest.raises(
        ValueError, match="saved with another config: hidden_size: saved 32, given 16"
    ):
        gemma.restore_params(tiny_gemma4(hidden_size=16), tmp_path / "params")
    with pytest.raises(ValueError, match="num_layers: saved 6, given 7"):
        gemma.restore_params(tiny_gemma4(num_layers=7), tmp_path / "params")
    other = gemma.Transformer(tiny_gemma4(vocab_size=80), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="vocab_size: saved 64, given 80"):
        gemma.restore_params(other, tmp_path / "params")
    with pytest.raises(ValueError, match="no Orbax checkpoint"):
        gemma.restore_params(model, tmp_path / "nothing")
    with pytest.raises(TypeError, match="config_or_model must be None"):
        gemma.restore_params("config", tmp_path / "params")
    # The stored config alone rebuilds the model.
    restored = gemma.restore_params(None, tmp_path / "params")
    chex.assert_trees_all_equal(nnx.state(restored), nnx.state(model))


def _corrupt(path: Path, how: str) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if how == "truncate" else bytes(len(data)))


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # Orbax's reads
@pytest.mark.parametrize("how", ["truncate", "zero"])
def test_orbax_damaged_data_raises(tmp_path, how):
    model = gemma.Transformer(tiny_gemma4(), rngs=nnx.Rngs(0))
    gemma.save_params(model, tmp_path / "params")
    files = sorted(
        (p for p in (tmp_path / "params" / "params").rglob("*") if p.is_file()),
        key=lambda p: p.stat().st_size,
    )
    _corrupt(files[-1], how)  # the largest data file
    with pytest.raises(ValueError, match=r"Orbax checkpoint data in .*params"):
        gemma.restore_params(None, tmp_path / "params")


def test_orbax_damaged_config_raises(tmp_path):
    model = gemma.Transformer(tiny_gemma4(), rngs=nnx.Rngs(0))
    gemma.save_params(model, tmp_path / "params")
    config_file = tmp_path / "params" / "config" / "metadata"
    config_file.write_text("{")
    with pytest.raises(ValueError, match=r"config/metadata.*not valid JSON"):
        gemma.restore_params(None, tmp_path / "params")
    config_file.write_text(json.dumps({"num_layers": 6, "colour": "red"}))
    with pytest.raises(ValueError, match=r"config/metadata.*unknown TransformerConfig fields"):
        gemma.restore_params(None, tmp_path / "params")
    config_file.unlink()
    with pytest.raises(ValueError, match="has no model config"):
        gemma.restore_params(model, tmp_path / "params")


def test_random_init_is_seeded():
    config = tiny_gemma4()
    a = gemma.Transformer(config, rngs=nnx.Rngs(0))
    b = gemma.Transformer(config, rngs=nnx.Rngs(0))
    c = gemma.Transformer(config, rngs=nnx.Rngs(1))
    chex.assert_trees_all_equal(
        a.layer_param(1, "moe.gate_proj"), b.layer_param(1, "moe.gate_proj")
    )
    assert not np.array_equal(a.embedding[...], c.embedding[...])
    assert a.layer_param(5, "attn.k_proj") is None  # KV-shared layer
    assert float(jnp.std(a.embedding[...])) == pytest.approx(0.02, rel=0.2)


@pytest.mark.parametrize(
    "tokens, error, match",
    [
        ([[1, -1]], ValueError, r"token id -1 is outside the vocabulary \[0, 64\)"),
        ([[1, 64]], ValueError, r"token id 64 is outside the vocabulary \[0, 64\)"),
        ([3, 70], ValueError, "token id 70"),
        ([[0.5, 1.0]], TypeError, "integer"),
        ([[[1]]], ValueError, r"i32\[B, T\]"),
        (np.array([[1, 2**40]], np.int64), ValueError, f"token id {2**40} "),
    ],
)
def test_bad_tokens_raise(tokens, error, match):
    model = gemma.Transformer(
        tiny_gemma4(num_experts=0, num_experts_per_token=0, moe_intermediate_size=0),
        rngs=nnx.Rngs(0),
    )
    with pytest.raises(error, match=match):
        model(tokens if isinstance(tokens, np.ndarray) else jnp.asarray(tokens))


def test_token_range_includes_per_layer_vocab_and_positions_shape():
    config = tiny_gemma4(per_layer_input_vocab_size=32)
    model = gemma.Transformer(config, rngs=nnx.Rngs(0))
    chex.assert_shape(model(jnp.array([[0, 31]])), (1, 2, 64))
    with pytest.raises(ValueError, match=r"token id 40 is outside the vocabulary \[0, 32\)"):
        model(jnp.array([[0, 40]]))
    with pytest.raises(ValueError, match=r"positions shape \(1, 3\) must equal tokens shape"):
        model(jnp.array([[0, 1]]), jnp.array([[0, 1, 2]]))
