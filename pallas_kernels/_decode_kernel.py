"""Mosaic GPU paged decode attention kernel (work in progress)."""

from __future__ import annotations


def supports(q, pool, **tuning) -> bool:
    return False


def paged_decode_attention_pallas(*args, **kwargs):
    raise ValueError("the Pallas paged decode attention kernel is not available yet")
