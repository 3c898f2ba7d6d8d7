"""Gemma 3 and Gemma 4 text models in Flax NNX: configs and presets, the model with its
attention hook (the contract: `LayerSpec`, `LayerRef`), Hugging Face safetensors loading and
Orbax parameter checkpoints, and the checkpoint's tokenizer and chat template
(`load_tokenizer`).

Names are imported on first use, so that importing one module (e.g. `gemma._hook`, which the
KV pool reads) does not import the model, JAX or the kernels.
"""

import importlib

# Public names and the module each lives in.
_EXPORTS = {
    "AssistantConfig": "gemma._assistant",
    "Gemma4Assistant": "gemma._assistant",
    "assistant_config_for": "gemma._assistant",
    "assistant_config_from_hf": "gemma._assistant",
    "draft_reference": "gemma._assistant",
    "load_assistant": "gemma._assistant",
    "LayerRef": "gemma._hook",
    "LayerSpec": "gemma._hook",
    "SUPPORTED_ARCHITECTURES": "gemma._checkpoint",
    "config_to_hf": "gemma._checkpoint",
    "from_pretrained": "gemma._checkpoint",
    "init_sharded": "gemma._checkpoint",
    "restore_params": "gemma._checkpoint",
    "save_params": "gemma._checkpoint",
    "save_pretrained": "gemma._checkpoint",
    "saved_config": "gemma._checkpoint",
    "RopeConfig": "gemma._config",
    "TransformerConfig": "gemma._config",
    "DenseAttentionState": "gemma._dense_attention",
    "dense_attention": "gemma._dense_attention",
    "dense_attention_fn": "gemma._dense_attention",
    "config_from_hf": "gemma._hf_config",
    "param_shardings": "gemma._sharding",
    "partition_specs": "gemma._sharding",
    "shard_model": "gemma._sharding",
    "IncrementalDecoder": "gemma._tokenizer",
    "Tokenizer": "gemma._tokenizer",
    "load_tokenizer": "gemma._tokenizer",
    "Transformer": "gemma._transformer",
    "set_experts_in_place_max_rows": "gemma._transformer",
    "set_unit_size_attention_logits": "gemma._transformer",
}
_SUBMODULES = ("configs",)
__all__ = sorted([*_EXPORTS, *_SUBMODULES])


def __getattr__(name):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"gemma.{name}")
    else:
        raise AttributeError(f"module 'gemma' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
