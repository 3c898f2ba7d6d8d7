"""Checkpoints: Hugging Face safetensors directories and Orbax checkpoints, in and out.

`from_pretrained` reads config.json and `model.safetensors` (or the shards of
`model.safetensors.index.json`) of `Gemma3ForCausalLM`, `Gemma4ForCausalLM`
and the text part of the conditional-generation (multimodal) checkpoints,
whose text weights sit under `model.language_model.` (vision / audio tensors
are ignored). Torch Linear weights are [out, in]; they are transposed and
split into the einsum layouts of `gemma._layers`. Tensors of the text model that the config
does not use are an error unless `strict=False`. `save_pretrained` writes the same layout
back (config.json + model.safetensors). Orbax checkpoints (`save_params` / `restore_params`)
hold the nnx state and the config it belongs to.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from gemma._config import TransformerConfig
from gemma._hf_config import config_from_hf
from gemma._mesh import MODEL, serving_mesh
from gemma._sharding import for_mesh, param_shardings, variable_specs
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


def _architecture(hf_config: dict, config_file: Path) -> str:
    architectures = hf_config.get("architectures")
    if architectures is not None and not (
        isinstance(architectures, list) and all(isinstance(a, str) for a in architectures)
    ):
        raise ValueError(
            f"{str(config_file)!r}: architectures must be a list of strings, got {architectures!r}"
        )
    if architectures:
        name = architectures[0]
    else:
        name = _ARCHITECTURE_OF_MODEL_TYPE.get(hf_config.get("model_type"))
        if name is None:
            raise ValueError(
                f"{str(config_file)!r} names no architecture and model_type "
                f"{hf_config.get('model_type')!r} is not supported; supported architectures: "
                f"{list(SUPPORTED_ARCHITECTURES)}"
            )
    if name not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {name!r} in {str(config_file)!r}; supported: "
            f"{list(SUPPORTED_ARCHITECTURES)}"
        )
    return name


def _read_json_object(path: Path, what: str) -> dict:
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{what} {str(path)!r} is not valid JSON: {e}") from e
    if not isinstance(obj, dict):
        raise ValueError(f"{what} {str(path)!r} must hold a JSON object, got {type(obj).__name__}")
    return obj


def read_hf_config(directory) -> tuple[dict, TransformerConfig]:
    """(config.json as a dict, its TransformerConfig); ValueError naming the file if malformed."""
    config_file = Path(directory) / "config.json"
    if not config_file.is_file():
        raise ValueError(f"no config.json in {str(directory)!r}")
    hf_config = _read_json_object(config_file, "model config")
    _architecture(hf_config, config_file)
    try:
        return hf_config, config_from_hf(hf_config)
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise ValueError(f"{str(config_file)!r}: {e}") from e


class _SafetensorsIndex:
    """Name -> file of a single-file or sharded safetensors checkpoint; lazy tensor access."""

    def __init__(self, directory: Path):
        from safetensors import SafetensorError, safe_open

        index_file = directory / "model.safetensors.index.json"
        single_file = directory / "model.safetensors"
        if index_file.exists():
            index = _read_json_object(index_file, "safetensors index")
            weight_map = index.get("weight_map")
            if not isinstance(weight_map, dict) or not all(
                isinstance(k, str) and isinstance(v, str) and v and Path(v).name == v
                for k, v in weight_map.items()
            ):
                raise ValueError(
                    f"safetensors index {str(index_file)!r} needs a 'weight_map' object of "
                    f"tensor name -> shard file name, got {str(weight_map)[:200]}"
                )
            files = sorted(set(weight_map.values()))
        elif single_file.exists():
            files = ["model.safetensors"]
            weight_map = None
        else:
            raise ValueError(
                f"no model.safetensors or model.safetensors.index.json in {str(directory)!r}"
            )
        self._handles = {}
        self._directory = directory
        for name in files:
            if not (directory / name).is_file():
                raise ValueError(
                    f"safetensors shard {name!r} listed in {str(index_file)!r} is missing"
                )
            try:
                self._handles[name] = safe_open(str(directory / name), framework="numpy")
            except (SafetensorError, OSError) as e:
                raise ValueError(
                    f"safetensors file {str(directory / name)!r} is unreadable (truncated or "
                    f"not safetensors?): {e}"
                ) from e
        self._file_of = {}
        for name, handle in self._handles.items():
            for key in handle.keys():
                self._file_of[key] = name
        if weight_map is not None:
            absent = sorted(k for k, f in weight_map.items() if self._file_of.get(k) != f)
            if absent:
                raise ValueError(
                    f"tensors listed in {str(index_file)!r} but not in their shard: {absent}"
                )

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def keys(self):
        return self._file_of.keys()

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handles[self._file_of[name]].get_slice(name).get_shape())

    def get(self, name: str) -> np.ndarray:
        from safetensors import SafetensorError

        try:
            return self._handles[self._file_of[name]].get_tensor(name)
        except (SafetensorError, OSError, TypeError, ValueError) as e:
            path = self._directory / self._file_of[name]
            raise ValueError(f"cannot read tensor {name!r} of {str(path)!r}: {e}") from e


class _Entry(NamedTuple):
    """One HF tensor (or, for experts.gate_up_proj, one half of it) and its model Variable."""

    name: str  # relative to the text prefix; "/name" is absolute (lm_head)
    shape: tuple[int, ...]  # HF shape
    var: nnx.Variable
    to_model: Callable  # HF array -> the Variable's layout
    to_hf: Callable  # the Variable's layout -> HF array (its half for gate_up_proj)
    index: int | None = None  # the layer's index along a stacked Variable's leading axis

    @property
    def var_shape(self) -> tuple[int, ...]:
        """The shape of this entry's part of the Variable (one layer of a stacked Variable)."""
        shape = tuple(self.var.shape)
        return shape if self.index is None else shape[1:]

    def value(self) -> np.ndarray:
        """The entry's part of the Variable, on the host."""
        value = self.var[...]
        return np.asarray(value if self.index is None else value[self.index])


def _transpose(w):  # [out, in] <-> [in, out]
    return w.T


def _same(w):
    return w


def _block_entries(c: TransformerConfig, i: int, layer, p: str, add) -> None:
    """The HF tensors of one decoder layer (`layer`, with config c's layer i geometry) under
    prefix p, each passed to add(name, shape, var, to_model, to_hf)."""
    transpose = _transpose
    d = c.hidden_size
    t = c.layer_types[i]
    n, h, kv = c.num_heads, c.type_head_dim(t), c.type_num_kv_heads(t)
    attn = layer.attn
    add(p + "input_layernorm.weight", (d,), layer.pre_attention_norm.scale)
    add(p + "post_attention_layernorm.weight", (d,), layer.post_attention_norm.scale)
    add(p + "pre_feedforward_layernorm.weight", (d,), layer.pre_ffw_norm.scale)
    add(p + "post_feedforward_layernorm.weight", (d,), layer.post_ffw_norm.scale)
    # [N*H, D] <-> [D, N, H]
    add(
        p + "self_attn.q_proj.weight",
        (n * h, d),
        attn.q_proj,
        lambda w, n=n, h=h: w.reshape(n, h, -1).transpose(2, 0, 1),
        lambda w, n=n, h=h: w.transpose(1, 2, 0).reshape(n * h, -1),
    )
    # [D, N*H] <-> [N, H, D]
    add(
        p + "self_attn.o_proj.weight",
        (d, n * h),
        attn.o_proj,
        lambda w, n=n, h=h: w.T.reshape(n, h, -1),
        lambda w, n=n, h=h: w.reshape(n * h, -1).T,
    )
    add(p + "self_attn.q_norm.weight", (h,), attn.q_norm.scale)
    if attn.writes_kv:
        # [K*H, D] <-> [D, K, H]
        to_dkh = lambda w, kv=kv, h=h: w.reshape(kv, h, -1).transpose(2, 0, 1)  # noqa: E731
        from_dkh = lambda w, kv=kv, h=h: w.transpose(1, 2, 0).reshape(kv * h, -1)  # noqa: E731
        add(p + "self_attn.k_proj.weight", (kv * h, d), attn.k_proj, to_dkh, from_dkh)
        if attn.v_proj is not None:
            add(p + "self_attn.v_proj.weight", (kv * h, d), attn.v_proj, to_dkh, from_dkh)
        add(p + "self_attn.k_norm.weight", (h,), attn.k_norm.scale)
    f = c.mlp_width(i)
    add(p + "mlp.gate_proj.weight", (f, d), layer.mlp.gate_proj, transpose, transpose)
    add(p + "mlp.up_proj.weight", (f, d), layer.mlp.up_proj, transpose, transpose)
    add(p + "mlp.down_proj.weight", (d, f), layer.mlp.down_proj, transpose, transpose)
    if layer.moe is not None:
        e, fm = c.num_experts, c.moe_intermediate_size
        moe = layer.moe
        add(p + "router.proj.weight", (e, d), moe.router_proj, transpose, transpose)
        add(p + "router.scale", (d,), moe.router_scale)
        add(p + "router.per_expert_scale", (e,), moe.per_expert_scale)

        def experts_t(w):  # [E, F, D] <-> [E, D, F]
            return w.transpose(0, 2, 1)

        add(
            p + "experts.gate_up_proj",
            (e, 2 * fm, d),
            moe.gate_proj,
            lambda w, fm=fm: experts_t(w[:, :fm, :]),
            experts_t,
        )
        add(
            p + "experts.gate_up_proj",
            (e, 2 * fm, d),
            moe.up_proj,
            lambda w, fm=fm: experts_t(w[:, fm:, :]),
            experts_t,
        )
        add(p + "experts.down_proj", (e, d, fm), moe.down_proj, experts_t, experts_t)
        add(p + "post_feedforward_layernorm_1.weight", (d,), layer.post_ffw_norm_1.scale)
        add(p + "pre_feedforward_layernorm_2.weight", (d,), layer.pre_ffw_norm_2.scale)
        add(p + "post_feedforward_layernorm_2.weight", (d,), layer.post_ffw_norm_2.scale)
    if layer.per_layer_input_gate is not None:
        pd = c.per_layer_input_dim
        add(
            p + "per_layer_input_gate.weight",
            (pd, d),
            layer.per_layer_input_gate,
            transpose,
            transpose,
        )
        add(
            p + "per_layer_projection.weight",
            (d, pd),
            layer.per_layer_projection,
            transpose,
            transpose,
        )
        add(p + "post_per_layer_input_norm.weight", (d,), layer.post_per_layer_input_norm.scale)
    if layer.layer_scalar is not None:
        add(p + "layer_scalar", (1,), layer.layer_scalar)


def _hf_layout(config: TransformerConfig, model: Transformer) -> list[_Entry]:
    """Every tensor of the HF checkpoint of `config`, in HF's order, with both conversions.

    Torch Linear weights are [out, in]; the model keeps [in, out] and splits head axes.
    Two entries share experts.gate_up_proj [E, 2F, D]: rows [0, F) are the gate, [F, 2F) up.
    """
    c = config
    d = c.hidden_size
    entries: list[_Entry] = []

    index = None  # the current layer's index in its stacked Variables

    def add(name, shape, var, to_model=_same, to_hf=_same):
        entries.append(_Entry(name, tuple(shape), var, to_model, to_hf, index))

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
            _transpose,
            _transpose,
        )
        add(
            "per_layer_projection_norm.weight",
            (c.per_layer_input_dim,),
            model.per_layer_projection_norm.scale,
        )
    for i in range(c.num_layers):
        layer, index = model.layer_block(i)
        _block_entries(c, i, layer, f"layers.{i}.", add)
    index = None
    if not c.tie_word_embeddings:
        add("/lm_head.weight", (c.vocab_size, d), model.lm_head, _transpose, _transpose)
    return entries


def _text_prefix(tensors: _SafetensorsIndex) -> str:
    for prefix in _TEXT_PREFIXES:
        if prefix + "embed_tokens.weight" in tensors:
            return prefix
    raise ValueError(
        "missing tensor embed_tokens.weight: none of "
        f"{[p + 'embed_tokens.weight' for p in _TEXT_PREFIXES]} is in the checkpoint"
    )


def abstract_model(
    config, dtype, param_dtype=None, moe_implementation="auto", scan_layers=True
) -> Transformer:
    """The model with jax.ShapeDtypeStruct leaves (nothing allocated); param_dtype: dtype."""
    param_dtype = jnp.dtype(dtype if param_dtype is None else param_dtype)
    return nnx.eval_shape(
        lambda: Transformer(
            config,
            rngs=nnx.Rngs(0),
            dtype=dtype,
            param_dtype=param_dtype,
            moe_implementation=moe_implementation,
            scan_layers=scan_layers,
        )
    )


def _summarise(names: list[str], limit: int = 20) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


def _unused_tensors(tensors, used: set[str], prefix: str, architecture: str) -> list[str]:
    """Tensors of the text model (under the text prefix, or lm_head) the config does not use.

    The other modalities of a conditional-generation checkpoint (vision / audio towers,
    projectors) lie outside the text prefix and are not the text model's.
    """
    multimodal = architecture.endswith("ForConditionalGeneration")
    unused = []
    for name in tensors.keys():
        if name in used:
            continue
        if name.startswith(prefix) or name in _LM_HEAD_NAMES or not multimodal:
            unused.append(name)
    return sorted(unused)


def from_pretrained(
    path,
    dtype=jnp.float32,
    *,
    param_dtype=None,
    moe_implementation="auto",
    strict=True,
    scan_layers=True,
    mesh=None,
) -> Transformer:
    """A `Transformer` loaded from a Hugging Face checkpoint directory.

    Args:
      path: directory with config.json and model.safetensors (or
        model.safetensors.index.json and its shards).
      dtype: compute dtype; also the parameter dtype unless `param_dtype` is given.
      moe_implementation: see `Transformer`.
      strict: tensors of the text model that the config does not use (e.g. layers beyond
        num_hidden_layers) are an error; False loads what the config uses and ignores them.
        The vision / audio tensors of multimodal checkpoints are never an error.
      scan_layers: see `Transformer`; the layers of each repeating run are stacked while
        loading (one host-to-device copy per stacked array).
      mesh: a `jax.sharding.Mesh` with a "model" axis: every tensor goes from the host straight
        to its shards (`gemma._sharding`), so no device holds more than its part; None: the
        default device.

    Raises:
      ValueError: a missing or malformed config.json, index or safetensors file (named),
        an unsupported architecture or config, missing, mis-shaped or (strict) unused
        tensors (all of them named), a mesh whose "model" axis cannot split the heads.
    """
    directory = Path(path)
    hf_config, config = read_hf_config(directory)
    architecture = _architecture(hf_config, directory / "config.json")
    tensors = _SafetensorsIndex(directory)
    prefix = _text_prefix(tensors)
    model = abstract_model(config, dtype, param_dtype, moe_implementation, scan_layers)
    param_dtype = model.param_dtype
    place = _placement(model, mesh)
    entries = _hf_layout(config, model)
    lm_head = next((n for n in _LM_HEAD_NAMES if n in tensors), _LM_HEAD_NAMES[0])

    def full_name(name):
        if name == "/lm_head.weight":
            return lm_head
        return name[1:] if name.startswith("/") else prefix + name

    missing = sorted({full_name(e.name) for e in entries if full_name(e.name) not in tensors})
    if missing:
        raise ValueError(f"missing tensors in {str(directory)!r}: {missing}")
    misshaped = [
        f"{full_name(e.name)}: expected {e.shape}, got {tensors.shape(full_name(e.name))}"
        for e in entries
        if tensors.shape(full_name(e.name)) != e.shape
    ]
    if misshaped:
        raise ValueError(f"mis-shaped tensors in {str(directory)!r}: " + "; ".join(misshaped))
    used = {full_name(e.name) for e in entries}
    if config.tie_word_embeddings and lm_head in tensors:
        # A stored copy of the tied embedding is harmless; a different matrix is not.
        if tensors.shape(lm_head) == (config.vocab_size, config.hidden_size) and np.array_equal(
            tensors.get(lm_head), tensors.get(prefix + "embed_tokens.weight")
        ):
            used.add(lm_head)
    unused = _unused_tensors(tensors, used, prefix, architecture)
    if unused and strict:
        layers = sorted(
            {
                int(m.group(1))
                for n in unused
                if (m := re.match(re.escape(prefix) + r"layers\.(\d+)\.", n))
            }
        )
        hint = ""
        if layers and layers[-1] >= config.num_layers:
            hint = (
                f" (config.json has {config.num_layers} layers; the checkpoint has tensors of "
                f"layers up to {layers[-1]})"
            )
        elif lm_head in unused and config.tie_word_embeddings:
            hint = f" ({lm_head} differs from the embedding but tie_word_embeddings is true)"
        raise ValueError(
            f"{len(unused)} tensors in {str(directory)!r} are not used by its config{hint}: "
            f"{_summarise(unused)}; pass strict=False to load anyway"
        )
    stacked: dict[int, list] = {}  # id(var) -> [var, {index: array}] of stacked Variables
    for e in entries:
        array = e.to_model(tensors.get(full_name(e.name)))
        assert array.shape == e.var_shape, (e.name, array.shape, e.var_shape)
        if e.index is None:
            e.var.set_value(place(e.var, np.asarray(array, dtype=param_dtype)))
            continue
        rows = stacked.setdefault(id(e.var), [e.var, {}])[1]
        rows[e.index] = np.asarray(array, dtype=param_dtype)
        if len(rows) == e.var.shape[0]:  # the run's last layer: one host -> device copy
            e.var.set_value(place(e.var, np.stack([rows.pop(k) for k in sorted(rows)])))
    leftover = [
        jax.tree_util.keystr(k)
        for k, v in jax.tree_util.tree_leaves_with_path(nnx.state(model))
        if isinstance(v, jax.ShapeDtypeStruct)
    ]
    assert not leftover, f"parameters not loaded: {leftover}"
    warn_non_finite(model, str(directory))
    return _for_mesh(model, mesh)


def non_finite_parameters(model: Transformer) -> list[str]:
    """The paths of the model's arrays that hold a NaN or an Inf (checked on their devices)."""
    leaves = jax.tree_util.tree_leaves_with_path(nnx.state(model))
    finite = jax.device_get(
        [jnp.all(jnp.isfinite(v)) for _, v in leaves if jnp.issubdtype(v.dtype, jnp.floating)]
    )
    paths = [jax.tree_util.keystr(k) for k, v in leaves if jnp.issubdtype(v.dtype, jnp.floating)]
    return [p for p, ok in zip(paths, finite, strict=True) if not ok]


def warn_non_finite(model: Transformer, source: str) -> None:
    """A warning naming the arrays loaded from `source` that hold NaN or Inf: the engine would
    then end the requests they touch with finish_reason "error"."""
    bad = non_finite_parameters(model)
    if bad:
        warnings.warn(
            f"{len(bad)} parameter arrays loaded from {source!r} hold NaN or Inf: "
            f"{bad[:8]}{' ...' if len(bad) > 8 else ''}",
            RuntimeWarning,
            stacklevel=3,
        )


def _for_mesh(model: Transformer, mesh) -> Transformer:
    """The loaded model as it runs on `mesh` (`gemma._sharding.for_mesh`)."""
    return for_mesh(model, mesh)


def _placement(model: Transformer, mesh):
    """place(var, host array) -> the device array of Variable `var` (its shards with a mesh)."""
    if mesh is None:
        return lambda var, array: jnp.asarray(array)
    mesh = serving_mesh(mesh)
    specs = variable_specs(model, mesh.shape[MODEL])
    return lambda var, array: jax.device_put(array, NamedSharding(mesh, specs[id(var)]))


def save_pretrained(model: Transformer, path, *, overwrite: bool = False) -> None:
    """Save `model` as a Hugging Face checkpoint directory: config.json + model.safetensors.

    Writes Gemma3ForCausalLM / Gemma4ForCausalLM (transformers 5.17 field names) in the
    parameter dtype; `from_pretrained(path, dtype=model.param_dtype)` gives back the same
    config and bit-identical parameters. Other files in the directory (a tokenizer) are kept.

    Raises:
      ValueError: config.json or model.safetensors exists and overwrite is False, or the
        config has fields a HF config cannot express.
    """
    from safetensors.numpy import save_file

    directory = Path(path)
    targets = [directory / "config.json", directory / "model.safetensors"]
    existing = [str(t) for t in targets if t.exists()]
    if existing and not overwrite:
        raise ValueError(f"{existing} already exist; pass overwrite=True to replace them")
    hf_config = config_to_hf(model.config, dtype=model.param_dtype)
    tensors: dict[str, list[np.ndarray]] = {}
    for e in _hf_layout(model.config, model):
        name = e.name[1:] if e.name.startswith("/") else "model." + e.name
        tensors.setdefault(name, []).append(np.asarray(e.to_hf(e.value())))
    arrays = {
        name: np.ascontiguousarray(parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1))
        for name, parts in tensors.items()
    }
    directory.mkdir(parents=True, exist_ok=True)
    save_file(arrays, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")


def config_to_hf(config: TransformerConfig, *, dtype=jnp.float32) -> dict:
    """The config.json of `config` (`config_from_hf` maps it back to an equal config)."""
    c = config
    if c.is_multimodal or c.has_external_kv_draft:
        raise ValueError(
            "is_multimodal / has_external_kv_draft are pool-policy flags a text config.json "
            "cannot hold; save a config with both False"
        )
    hf_layer_type = {"sliding": "sliding_attention", "full": "full_attention"}

    def rope(r):
        out = {"rope_type": r.rope_type, "rope_theta": r.theta}
        if r.rope_type != "default":
            out["factor"] = r.factor
        if r.rope_type == "proportional":
            out["partial_rotary_factor"] = r.partial_rotary_factor
        return out

    hf = {
        "architectures": ["Gemma3ForCausalLM" if c.family == "gemma3" else "Gemma4ForCausalLM"],
        "model_type": "gemma3_text" if c.family == "gemma3" else "gemma4_text",
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "layer_types": [hf_layer_type[t] for t in c.layer_types],
        "sliding_window": c.sliding_window,
        "max_position_embeddings": c.max_context,
        "rms_norm_eps": c.rms_norm_eps,
        "final_logit_softcapping": c.final_logit_softcap,
        "tie_word_embeddings": c.tie_word_embeddings,
        "hidden_activation": "gelu_pytorch_tanh",
        "attention_bias": False,
        "rope_parameters": {
            "sliding_attention": rope(c.rope_sliding),
            "full_attention": rope(c.rope_full),
        },
        "dtype": jnp.dtype(dtype).name,
    }
    if c.family == "gemma3":
        hf["query_pre_attn_scalar"] = c.query_pre_attn_scalar
        hf["attn_logit_softcapping"] = None
        return hf
    hf.update(
        # transformers 5.17's own form of the full-layer geometry.
        per_layer_config={
            f"{i:02d}": {
                "head_dim": c.type_head_dim("full"),
                "num_key_value_heads": c.type_num_kv_heads("full"),
            }
            for i, t in enumerate(c.layer_types)
            if t == "full"
        },
        attention_k_eq_v=c.attention_k_eq_v,
        num_kv_shared_layers=c.num_kv_shared_layers,
        use_double_wide_mlp=c.use_double_wide_mlp,
        hidden_size_per_layer_input=c.per_layer_input_dim,
        vocab_size_per_layer_input=c.per_layer_input_vocab_size or c.vocab_size,
        enable_moe_block=c.has_moe,
        num_experts=c.num_experts or None,
        top_k_experts=c.num_experts_per_token or None,
        moe_intermediate_size=c.moe_intermediate_size or None,
    )
    return hf


# --------------------------------------------------------------------- Orbax


# An Orbax checkpoint is a composite of two items: "params" (the nnx state, Orbax's standard
# pytree format) and "config" (the TransformerConfig as JSON), so that a restore can refuse a
# config other than the saved one.
_PARAMS_ITEM, _CONFIG_ITEM = "params", "config"


def config_to_dict(config: TransformerConfig) -> dict:
    """The config as plain JSON data (`config_from_dict` inverts it)."""
    d = dataclasses.asdict(config)
    d["layer_types"] = list(d["layer_types"])
    return d


def config_from_dict(d: dict, where: str = "config") -> TransformerConfig:
    """The `TransformerConfig` of `config_to_dict` output; ValueError naming `where` if bad."""
    from gemma._config import FIELD_NAMES, RopeConfig

    if not isinstance(d, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(d).__name__}")
    unknown = sorted(set(d) - FIELD_NAMES)
    if unknown:
        raise ValueError(f"{where}: unknown TransformerConfig fields {unknown}")
    try:
        fields = dict(d)
        for key in ("rope_sliding", "rope_full"):
            if key in fields:
                fields[key] = RopeConfig(**fields[key])
        if "layer_types" in fields:
            fields["layer_types"] = tuple(fields["layer_types"])
        return TransformerConfig(**fields)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from e


def save_params(model: Transformer, path, *, overwrite: bool = False) -> None:
    """Save the model's parameters and buffers (its nnx state) and its config as an Orbax
    checkpoint at `path`."""
    import orbax.checkpoint as ocp

    _, state = nnx.split(model)
    args = ocp.args.Composite(
        **{
            _PARAMS_ITEM: ocp.args.StandardSave(state),
            _CONFIG_ITEM: ocp.args.JsonSave(config_to_dict(model.config)),
        }
    )
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
        checkpointer.save(os.path.abspath(path), args, force=overwrite)


def saved_config(path) -> TransformerConfig:
    """The config stored in the Orbax checkpoint at `path` by `save_params`."""
    path = os.path.abspath(path)
    config_file = Path(path) / _CONFIG_ITEM / "metadata"
    if not os.path.isdir(path):
        raise ValueError(f"no Orbax checkpoint at {path!r}")
    if not config_file.is_file():
        raise ValueError(
            f"the Orbax checkpoint at {path!r} has no model config ({str(config_file)!r} is "
            "missing); save_params writes one"
        )
    return config_from_dict(_read_json_object(config_file, "model config"), str(config_file))


def restore_params(
    config_or_model: TransformerConfig | Transformer | None,
    path,
    *,
    dtype=jnp.float32,
    param_dtype=None,
    moe_implementation="auto",
    scan_layers=None,
    mesh=None,
) -> Transformer:
    """A `Transformer` with the parameters saved by `save_params` at `path`.

    Args:
      config_or_model: None (the config stored in the checkpoint), the config to build the
        model from, or a model whose structure, dtypes and shardings the restored one takes
        (the given model is not modified). A config (given or the model's) other than the
        stored one is an error.
      dtype, param_dtype, moe_implementation: of the model built from a config.
      scan_layers: of the model built from a config (see `Transformer`); None: as saved.
      mesh: a `jax.sharding.Mesh` with a "model" axis: Orbax reads every array straight into
        its shards (`gemma._sharding`; a given model's own shardings are then not used).

    Raises:
      ValueError: no checkpoint or no stored config at `path`, a config other than the
        stored one, a checkpoint whose structure or shapes differ from the model's,
        unreadable (truncated) checkpoint data, or a mesh that cannot split the heads.
    """
    import orbax.checkpoint as ocp
    from etils import epath

    path = os.path.abspath(path)
    stored = saved_config(path)
    if config_or_model is None:
        config_or_model = stored
    if isinstance(config_or_model, Transformer):
        given = config_or_model.config
        graphdef, state = nnx.split(config_or_model)
        abstract_state = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
        )
    elif isinstance(config_or_model, TransformerConfig):
        given = config_or_model
        saved_scanned = _saved_scan_layers(path, config_or_model)
        abstract = abstract_model(
            config_or_model,
            dtype,
            param_dtype,
            moe_implementation,
            saved_scanned if scan_layers is None else scan_layers,
        )
        graphdef, abstract_state = nnx.split(abstract)
    else:
        raise TypeError(
            "config_or_model must be None, a TransformerConfig or a Transformer, got "
            f"{type(config_or_model).__name__}"
        )
    if mesh is not None:
        shardings = param_shardings(nnx.merge(graphdef, abstract_state), mesh)
        abstract_state = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
            abstract_state,
            shardings,
        )
    if given != stored:
        differ = [
            f"{f.name}: saved {getattr(stored, f.name)!r}, given {getattr(given, f.name)!r}"
            for f in dataclasses.fields(TransformerConfig)
            if getattr(stored, f.name) != getattr(given, f.name)
        ]
        raise ValueError(
            f"the checkpoint at {path!r} was saved with another config: " + "; ".join(differ)
        )
    params_dir = os.path.join(path, _PARAMS_ITEM)
    try:
        item_metadata = ocp.StandardCheckpointHandler().metadata(epath.Path(params_dir))
    except Exception as e:  # as above; a missing or damaged _METADATA file
        raise ValueError(f"unreadable Orbax metadata in {params_dir!r}: {e}") from e
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
    args = ocp.args.Composite(**{_PARAMS_ITEM: ocp.args.StandardRestore(abstract_state)})
    try:
        with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
            state = checkpointer.restore(path, args)[_PARAMS_ITEM]
    except Exception as e:  # Orbax re-raises tensorstore read errors as a bare Exception
        raise ValueError(f"cannot read the Orbax checkpoint data in {params_dir!r}: {e}") from e
    model = nnx.merge(graphdef, state)
    warn_non_finite(model, path)
    return _for_mesh(model, mesh)


def _saved_scan_layers(path: str, config: TransformerConfig) -> bool:
    """Whether the checkpoint holds a model with scanned (stacked) layers: its first Block's
    q_proj has a leading stack axis. Unreadable metadata says True (restore reports it)."""
    import orbax.checkpoint as ocp
    from etils import epath

    try:
        meta = ocp.StandardCheckpointHandler().metadata(epath.Path(path) / _PARAMS_ITEM)
    except Exception:  # reported with its file by restore_params
        return True
    shapes = _flat_shapes(meta)
    return shapes.get("blocks/0/0/attn/q_proj", ()) != (
        config.hidden_size,
        config.num_heads,
        config.type_head_dim(config.layer_types[0]),
    )


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


def init_sharded(
    config,
    mesh,
    *,
    seed: int = 0,
    dtype=np.float32,
    param_dtype=None,
    moe_implementation: str = "auto",
    scan_layers: bool = True,
):
    """A random `Transformer` drawn inside one jit whose outputs are the parameters' shards,
    so no device holds more than its shards.

    The values come from `jax.random` under jit (partitionable threefry): the same for every
    mesh, not those of the eager `Transformer(config, rngs=nnx.Rngs(seed))`, which draws
    small arrays on the host.
    """
    param_dtype = dtype if param_dtype is None else param_dtype
    abstract = abstract_model(config, dtype, param_dtype, moe_implementation, scan_layers)
    graphdef, _ = nnx.split(abstract)
    shardings = param_shardings(abstract, mesh)

    @jax.jit(out_shardings=shardings)
    def make():
        model = Transformer(
            config,
            rngs=nnx.Rngs(seed),
            dtype=dtype,
            param_dtype=param_dtype,
            moe_implementation=moe_implementation,
            scan_layers=scan_layers,
        )
        return nnx.split(model)[1]

    return for_mesh(nnx.merge(graphdef, make()), mesh)
