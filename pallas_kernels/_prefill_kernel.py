"""Mosaic GPU ragged (chunked prefill) paged attention kernel (work in progress)."""

from __future__ import annotations


def supports(q, pool, **tuning) -> bool:
    return False


def ragged_paged_attention_pallas(*args, **kwargs):
    raise ValueError("the Pallas ragged paged attention kernel is not available yet")
