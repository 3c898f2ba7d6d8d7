"""Checkpoints: Hugging Face safetensors directories in, Orbax parameter checkpoints in and out.

`from_pretrained` reads config.json and `model.safetensors` (or the shards of
`model.safetensors.index.json`) of `Gemma3ForCausalLM`, `Gemma4ForCausalLM`
and the text part of the conditional-generation (multimodal) checkpoints,
whose text weights sit under `model.language_model.` (vision / audio tensors
are ignored). Torch Linear weights are [out, in]; they are transposed and
split into the einsum layouts of `gemma._layers`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gemma._config import TransformerConfig
from gemma._hf_config import config_from_hf
from gemma._transformer import Transformer

SUPPORTED_ARCHITECTURES = (
    "Gemma3ForCausalLM",
    "Gemma3ForConditionalGeneration",
    "Gemma4ForCausalLM",
    "Gemma4ForConditionalGeneration",
    "Gemma4UnifiedForCausalLM",
    "Gemma4UnifiedForConditionalGeneration",
)
_ARCHITECTURE_OF_MODEL_TYPE = {
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma3": "Gemma3ForConditionalGeneration",
    "gemma4_text": "Gemma4ForCausalLM",
    "gemma4": "Gemma4ForConditionalGeneration",
    "gemma4_unified_text": "Gemma4UnifiedForCausalLM",
    "gemma4_unified": "Gemma4UnifiedForConditionalGeneration",
}
# Where the text model's weights live, by checkpoint layout (transformers 5 first).
_TEXT_PREFIXES = ("model.", "model.language_model.", "language_model.model.", "")
_LM_HEAD_NAMES = ("lm_head.weight", "language_model.lm_head.weight")


def _architecture(hf_config: dict) -> str:
    architectures = hf_config.get("architectures") or []
    if architectures:
        name = architectures[0]
    else:
        name = _ARCHITECTURE_OF_MODEL_TYPE.get(hf_config.get("model_type"))
        if name is None:
            raise ValueError(
                f"config.json names no architecture and model_type "
                f"{hf_config.get('model_type')!r} is not supported; supported architectures: "
                f"{list(SUPPORTED_ARCHITECTURES)}"
            )
    if name not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {name!r}; supported: {list(SUPPORTED_ARCHITECTURES)}"
        )
    return name


class _SafetensorsIndex:
    """Name -> file of a single-file or sharded safetensors checkpoint; lazy tensor access."""

    def __init__(self, directory: Path):
        from safetensors import safe_open

        index_file = directory / "model.safetensors.index.json"
        single_file = directory / "model.safetensors"
        if index_file.exists():
            weight_map = json.loads(index_file.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        elif single_file.exists():
            files = ["model.safetensors"]
            weight_map = None
        else:
            raise ValueError(
                f"no model.safetensors or model.safetensors.index.json in {str(directory)!r}"
            )
        self._handles = {}
        for name in files:
            if not (directory / name).exists():
                raise ValueError(f"safetensors shard {name!r} listed in the index is missing")
            self._handles[name] = safe_open(str(directory / name), framework="numpy")
        self._file_of = {}
        for name, handle in self._handles.items():
            for key in handle.keys():
                self._file_of[key] = name
        if weight_map is not None:
            absent = sorted(k for k, f in weight_map.items() if self._file_of.get(k) != f)
            if absent:
                raise ValueError(f"tensors listed in the index but not in their shard: {absent}")

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def keys(self):
        return self._file_of.keys()

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handles[self._file_of[name]].get_slice(name).get_shape())

    def get(self, name: str) -> np.ndarray:
        return self._handles[self._file_of[name]].get_tensor(name)


def _hf_layout(config: TransformerConfig, model: Transformer):
    """(hf name, hf shape, our Variable, convert) of every tensor; names relative to the prefix."""
    c = config
    d = c.hidden_size
    entries: list[tuple[str, tuple[int, ...], nnx.Variable, Callable]] = []

    def linear_t(w):  # [out, in] -> [in, out]
        return w.T

    def same(w):
        return w

    def add(name, shape, var, convert=same):
        entries.append((name, tuple(shape), var, convert))

    add("embed_tokens.weight", (c.vocab_size, d), model.embedding)
    add("norm.weight", (d,), model.final_norm.scale)
    if c.has_per_layer_inputs:
        width = c.num_layers * c.per_layer_input_dim
        vocab = c.per_layer_input_vocab_size or c.vocab_size
        add("embed_tokens_per_layer.weight", (vocab, width), model.per_layer_embedding)
        add(
            "per_layer_model_projection.weight",
            (width, d),
            model.per_layer_model_projection,
            linear_t,
        )
        add(
            "per_layer_projection_norm.weight",
            (c.per_layer_input_dim,),
            model.per_layer_projection_norm.scale,
        )
    for i, layer in enumerate(model.layers):
        p = f"layers.{i}."
        t = c.layer_types[i]
        n, h, kv = c.num_heads, c.type_head_dim(t), c.type_num_kv_heads(t)
        attn = layer.attn
        add(p + "input_layernorm.weight", (d,), layer.pre_attention_norm.scale)
        add(p + "post_attention_layernorm.weight", (d,), layer.post_attention_norm.scale)
        add(p + "pre_feedforward_layernorm.weight", (d,), layer.pre_ffw_norm.scale)
        add(p + "post_feedforward_layernorm.weight", (d,), layer.post_ffw_norm.scale)
        # [N*H, D] -> [D, N, H]
        add(
            p + "self_attn.q_proj.weight",
            (n * h, d),
            attn.q_proj,
            lambda w, n=n, h=h: w.reshape(n, h, -1).transpose(2, 0, 1),
        )
        # [D, N*H] -> [N, H, D]
        add(
            p + "self_attn.o_proj.weight",
            (d, n * h),
            attn.o_proj,
            lambda w, n=n, h=h: w.T.reshape(n, h, -1),
        )
        add(p + "self_attn.q_norm.weight", (h,), attn.q_norm.scale)
        if attn.writes_kv:
            to_dkh = lambda w, kv=kv, h=h: w.reshape(kv, h, -1).transpose(2, 0, 1)  # noqa: E731
            add(p + "self_attn.k_proj.weight", (kv * h, d), attn.k_proj, to_dkh)
            if attn.v_proj is not None:
                add(p + "self_attn.v_proj.weight", (kv * h, d), attn.v_proj, to_dkh)
            add(p + "self_attn.k_norm.weight", (h,), attn.k_norm.scale)
        f = c.mlp_width(i)
        add(p + "mlp.gate_proj.weight", (f, d), layer.mlp.gate_proj, linear_t)
        add(p + "mlp.up_proj.weight", (f, d), layer.mlp.up_proj, linear_t)
        add(p + "mlp.down_proj.weight", (d, f), layer.mlp.down_proj, linear_t)
        if layer.moe is not None:
            e, fm = c.num_experts, c.moe_intermediate_size
            moe = layer.moe
            add(p + "router.proj.weight", (e, d), moe.router_proj, linear_t)
            add(p + "router.scale", (d,), moe.router_scale)
            add(p + "router.per_expert_scale", (e,), moe.per_expert_scale)
            # gate_up_proj [E, 2F, D]: rows [0, F) gate, [F, 2F) up -> [E, D, F] each.
            add(
                p + "experts.gate_up_proj",
                (e, 2 * fm, d),
                moe.gate_proj,
                lambda w, fm=fm: w[:, :fm, :].transpose(0, 2, 1),
            )
            add(
                p + "experts.gate_up_proj",
                (e, 2 * fm, d),
                moe.up_proj,
                lambda w, fm=fm: w[:, fm:, :].transpose(0, 2, 1),
            )
            add(p + "experts.down_proj", (e, d, fm), moe.down_proj, lambda w: w.transpose(0, 2, 1))
            add(p + "post_feedforward_layernorm_1.weight", (d,), layer.post_ffw_norm_1.scale)
            add(p + "pre_feedforward_layernorm_2.weight", (d,), layer.pre_ffw_norm_2.scale)
            add(p + "post_feedforward_layernorm_2.weight", (d,), layer.post_ffw_norm_2.scale)
        if layer.per_layer_input_gate is not None:
            pd = c.per_layer_input_dim
            add(p + "per_layer_input_gate.weight", (pd, d), layer.per_layer_input_gate, linear_t)
            add(p + "per_layer_projection.weight", (d, pd), layer.per_layer_projection, linear_t)
            add(p + "post_per_layer_input_norm.weight", (d,), layer.post_per_layer_input_norm.scale)
        if layer.layer_scalar is not None:
            add(p + "layer_scalar", (1,), layer.layer_scalar)
    return entries


def _text_prefix(tensors: _SafetensorsIndex) -> str:
    for prefix in _TEXT_PREFIXES:
        if prefix + "embed_tokens.weight" in tensors:
            return prefix
    raise ValueError(
        "missing tensor embed_tokens.weight: none of "
        f"{[p + 'embed_tokens.weight' for p in _TEXT_PREFIXES]} is in the checkpoint"
    )


def abstract_model(config, dtype, param_dtype=None, moe_implementation="ragged") -> Transformer:
    """The model with jax.ShapeDtypeStruct leaves (nothing allocated); param_dtype: dtype."""
    param_dtype = jnp.dtype(dtype if param_dtype is None else param_dtype)
    return nnx.eval_shape(
        lambda: Transformer(
            config,
            rngs=nnx.Rngs(0),
            dtype=dtype,
            param_dtype=param_dtype,
            moe_implementation=moe_implementation,
        )
    )


def from_pretrained(
    path, dtype=jnp.float32, *, param_dtype=None, moe_implementation="ragged"
) -> Transformer:
    """A `Transformer` loaded from a Hugging Face checkpoint directory.

    Args:
      path: directory with config.json and model.safetensors (or
        model.safetensors.index.json and its shards).
      dtype: compute dtype; also the parameter dtype unless `param_dtype` is given.
      moe_implementation: see `Transformer`.

    Raises:
      ValueError: unsupported architecture or config, missing or mis-shaped tensors
        (all of them named).
    """
    directory = Path(path)
    config_file = directory / "config.json"
    if not config_file.exists():
        raise ValueError(f"no config.json in {str(directory)!r}")
    hf_config = json.loads(config_file.read_text())
    _architecture(hf_config)
    config = config_from_hf(hf_config)
    tensors = _SafetensorsIndex(directory)
    prefix = _text_prefix(tensors)
    model = abstract_model(config, dtype, param_dtype, moe_implementation)
    param_dtype = model.param_dtype
    entries = _hf_layout(config, model)
    if not config.tie_word_embeddings:
        lm_head = next((n for n in _LM_HEAD_NAMES if n in tensors), _LM_HEAD_NAMES[0])
        entries.append(
            ("/" + lm_head, (config.vocab_size, config.hidden_size), model.lm_head, None)
        )

    def full_name(name):
        return name[1:] if name.startswith("/") else prefix + name

    missing = sorted({full_name(n) for n, *_ in entries if full_name(n) not in tensors})
    if missing:
        raise ValueError(f"missing tensors in {str(directory)!r}: {missing}")
    misshaped = [
        f"{full_name(n)}: expected {shape}, got {tensors.shape(full_name(n))}"
        for n, shape, *_ in entries
        if tensors.shape(full_name(n)) != shape
    ]
    if misshaped:
        raise ValueError(f"mis-shaped tensors in {str(directory)!r}: " + "; ".join(misshaped))
    for name, _, var, convert in entries:
        array = tensors.get(full_name(name))
        array = array.T if convert is None else convert(array)
        assert array.shape == var.shape, (name, array.shape, var.shape)
        var.set_value(jnp.asarray(array, dtype=param_dtype))
    leftover = [
        jax.tree_util.keystr(k)
        for k, v in jax.tree_util.tree_leaves_with_path(nnx.state(model))
        if isinstance(v, jax.ShapeDtypeStruct)
    ]
    assert not leftover, f"parameters not loaded: {leftover}"
    return model


# --------------------------------------------------------------------- Orbax


def save_params(model: Transformer, path, *, overwrite: bool = False) -> None:
    """Save the model's parameters and buffers (its nnx state) as an Orbax checkpoint at `path`."""
    import orbax.checkpoint as ocp

    _, state = nnx.split(model)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(os.path.abspath(path), state, force=overwrite)
        checkpointer.wait_until_finished()


def restore_params(
    config_or_model: TransformerConfig | Transformer,
    path,
    *,
    dtype=jnp.float32,
    param_dtype=None,
    moe_implementation="ragged",
) -> Transformer:
    """A `Transformer` with the parameters saved by `save_params` at `path`.

    Args:
      config_or_model: the config to build the model from (with `dtype` /
        `param_dtype` / `moe_implementation`), or a model whose structure,
        dtypes and shardings the restored one takes (the given model is not modified).

    Raises:
      ValueError: the checkpoint does not match the model's structure or shapes.
    """
    import orbax.checkpoint as ocp

    if isinstance(config_or_model, Transformer):
        graphdef, state = nnx.split(config_or_model)
        abstract_state = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
        )
    elif isinstance(config_or_model, TransformerConfig):
        abstract = abstract_model(config_or_model, dtype, param_dtype, moe_implementation)
        graphdef, abstract_state = nnx.split(abstract)
    else:
        raise TypeError(
            "config_or_model must be a TransformerConfig or a Transformer, got "
            f"{type(config_or_model).__name__}"
        )
    path = os.path.abspath(path)
    if not os.path.isdir(path):
        raise ValueError(f"no Orbax checkpoint at {path!r}")
    with ocp.StandardCheckpointer() as checkpointer:
        item_metadata = checkpointer.metadata(path).item_metadata
        if item_metadata is None:
            raise ValueError(f"no Orbax checkpoint metadata at {path!r}")
        saved = _flat_shapes(item_metadata)
        wanted = _flat_shapes(abstract_state)
        problems = [f"{k}: missing in the checkpoint" for k in sorted(wanted.keys() - saved.keys())]
        problems += [f"{k}: not in the model" for k in sorted(saved.keys() - wanted.keys())]
        problems += [
            f"{k}: checkpoint shape {saved[k]}, model shape {wanted[k]}"
            for k in sorted(wanted.keys() & saved.keys())
            if saved[k] != wanted[k]
        ]
        if problems:
            raise ValueError(
                f"the checkpoint at {path!r} does not match the model: " + "; ".join(problems)
            )
        state = checkpointer.restore(path, abstract_state)
    return nnx.merge(graphdef, state)


def _flat_shapes(tree) -> dict[str, tuple[int, ...]]:
    """'layers/0/attn/q_proj' -> shape, for a saved metadata tree or an (abstract) nnx state."""

    def name(key):
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                return str(getattr(key, attr))
        return str(key)

    flat = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        names = [name(k) for k in path]
        if names and names[-1] == "value":
            names = names[:-1]
        flat["/".join(names)] = tuple(leaf.shape)
    return flat
