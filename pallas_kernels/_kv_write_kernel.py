"""Mosaic GPU KV write kernel (work in progress)."""

from __future__ import annotations


def supports(pool) -> bool:
    return False


def kv_write_pallas(*args, **kwargs):
    raise ValueError("the Pallas KV write kernel is not available yet")
