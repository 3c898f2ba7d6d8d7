"""Gemma 3 and Gemma 4 text models in Flax NNX: configs and presets, the model with its
attention hook, Hugging Face safetensors loading and Orbax parameter checkpoints, and the
checkpoint's tokenizer and chat template (`load_tokenizer`)."""

from gemma import configs
from gemma._checkpoint import (
    SUPPORTED_ARCHITECTURES,
    config_to_hf,
    from_pretrained,
    restore_params,
    save_params,
    save_pretrained,
    saved_config,
)
from gemma._config import RopeConfig, TransformerConfig
from gemma._dense_attention import DenseAttentionState, dense_attention, dense_attention_fn
from gemma._hf_config import config_from_hf
from gemma._sharding import init_sharded, param_shardings, partition_specs, shard_model
from gemma._tokenizer import IncrementalDecoder, Tokenizer, load_tokenizer
from gemma._transformer import (
    Transformer,
    set_experts_in_place_max_rows,
    set_unit_size_attention_logits,
)

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "DenseAttentionState",
    "IncrementalDecoder",
    "RopeConfig",
    "Tokenizer",
    "Transformer",
    "TransformerConfig",
    "config_from_hf",
    "config_to_hf",
    "configs",
    "dense_attention",
    "dense_attention_fn",
    "from_pretrained",
    "init_sharded",
    "load_tokenizer",
    "param_shardings",
    "partition_specs",
    "restore_params",
    "save_params",
    "save_pretrained",
    "saved_config",
    "set_experts_in_place_max_rows",
    "set_unit_size_attention_logits",
    "shard_model",
]
