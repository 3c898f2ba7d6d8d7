"""Presets of every Gemma 3 / Gemma 4 text variant: `gemma.configs.gemma3_1b(num_layers=2)`."""

from gemma._config import RopeConfig, TransformerConfig
from gemma._presets import (
    PRESET_NAMES,
    AttentionGeometry,
    MoEGeometry,
    attention_geometries,
    gemma3_1b,
    gemma3_4b,
    gemma3_12b,
    gemma3_27b,
    gemma3_270m,
    gemma4_12b,
    gemma4_26b_a4b,
    gemma4_31b,
    gemma4_e2b,
    gemma4_e4b,
    moe_geometries,
    preset,
    small_preset,
)

__all__ = [
    "PRESET_NAMES",
    "AttentionGeometry",
    "MoEGeometry",
    "attention_geometries",
    "moe_geometries",
    "RopeConfig",
    "TransformerConfig",
    "gemma3_1b",
    "gemma3_4b",
    "gemma3_12b",
    "gemma3_27b",
    "gemma3_270m",
    "gemma4_12b",
    "gemma4_26b_a4b",
    "gemma4_31b",
    "gemma4_e2b",
    "gemma4_e4b",
    "preset",
    "small_preset",
]
