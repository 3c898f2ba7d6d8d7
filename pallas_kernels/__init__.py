"""Pallas (Mosaic GPU) kernels for paged attention, each beside its pure-jnp reference."""

from pallas_kernels.kv_write import kv_write, kv_write_reference
from pallas_kernels.paged_attention import (
    paged_decode_attention,
    paged_decode_attention_reference,
    ragged_paged_attention,
    ragged_paged_attention_reference,
)

__all__ = [
    "kv_write",
    "kv_write_reference",
    "paged_decode_attention",
    "paged_decode_attention_reference",
    "ragged_paged_attention",
    "ragged_paged_attention_reference",
]
