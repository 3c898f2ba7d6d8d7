"""Validation of what users hand the engine: prompts, token counts, stop ids, batch sizes.

Every check raises `ValueError` naming the value and the allowed range before anything is
queued, so a bad request never reaches a step and never disturbs requests already queued.
Token ids must be integers (Python or NumPy; bools and floats are rejected, never truncated).
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable

import numpy as np


def is_int(x) -> bool:
    """A Python or NumPy integer, not a bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_))


def positive_int(name: str, value, *, minimum: int = 1) -> int:
    if not is_int(value) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def token_ids(name: str, ids, vocab_size: int) -> list[int]:
    """`ids` as a list of Python ints in [0, vocab_size); ValueError otherwise."""
    if not isinstance(ids, (np.ndarray, str, bytes)) and hasattr(ids, "__array__"):
        ids = np.asarray(ids)  # a JAX (or other) array of ids, like a NumPy one
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
        raise ValueError(f"{name} must be a sequence of token ids, got {type(ids).__name__}")
    if isinstance(ids, np.ndarray):
        if ids.ndim != 1 or not (np.issubdtype(ids.dtype, np.integer) or ids.size == 0):
            raise ValueError(f"{name} must be a 1-d integer array, got {ids.dtype}{ids.shape}")
        out = [int(t) for t in ids]
    else:
        out = []
        for t in ids:
            if not is_int(t):
                raise ValueError(
                    f"{name} must hold integer token ids, got {t!r} ({type(t).__name__})"
                )
            out.append(int(t))
    bad = [t for t in out if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(
            f"{name} has token ids {bad[:5]} outside [0, {vocab_size}) (the vocabulary)"
        )
    return out


def prompt(
    name: str,
    ids,
    vocab_size: int,
    max_context: int,
    max_new_tokens: int,
    context: str = "the engine's max_context",
) -> list[int]:
    """A validated prompt: non-empty token ids whose length + max_new_tokens fits the context."""
    out = token_ids(name, ids, vocab_size)
    if not out:
        raise ValueError(f"{name} is empty: every prompt needs at least one token")
    total = len(out) + max_new_tokens
    if total > max_context:
        raise ValueError(
            f"{name}: {len(out)} tokens + max_new_tokens={max_new_tokens} = {total} exceeds "
            f"{context} of {max_context} tokens"
        )
    return out


def prompts(
    prompts,
    vocab_size: int,
    max_context: int,
    max_new_tokens,
    context: str = "the engine's max_context",
) -> list[list[int]]:
    """A validated non-empty list of prompts (see `prompt`)."""
    max_new_tokens = positive_int("max_new_tokens", max_new_tokens)
    if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__len__"):
        raise ValueError(f"prompts must be a list of token-id lists, got {type(prompts).__name__}")
    if len(prompts) == 0:
        raise ValueError("prompts is empty: give at least one prompt (a list of token ids)")
    return [
        prompt(f"prompt {i}", p, vocab_size, max_context, max_new_tokens, context)
        for i, p in enumerate(prompts)
    ]


def unicode_text(name: str, text: str) -> None:
    """ValueError naming `name` and the code point unless `text` can be encoded as UTF-8
    (Python strings, and JSON's \\uXXXX escapes, can hold lone surrogates, U+D800..U+DFFF,
    which are not text)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"{name} holds U+{ord(text[e.start]):04X} at character {e.start}, a lone surrogate: "
            "strings must be Unicode text (code points U+0000..U+D7FF and U+E000..U+10FFFF)"
        ) from None
