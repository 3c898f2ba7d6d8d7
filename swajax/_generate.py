"""`swajax.generate`: the public entry point of batch generation on the KV pool."""

from __future__ import annotations

import numbers

from swajax._config import KVCacheConfig
from swajax._engine import Engine
from swajax._sampling import SamplingParams


def validate_prompts(prompts, vocab_size: int, max_context: int, max_new_tokens: int):
    """Checks the request and returns the prompts as lists of ints; ValueError on bad input."""
    if not isinstance(max_new_tokens, numbers.Integral) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__len__"):
        raise ValueError(f"prompts must be a list of token-id lists, got {type(prompts).__name__}")
    if len(prompts) == 0:
        raise ValueError("prompts is empty: give at least one prompt (a list of token ids)")
    out = []
    for i, p in enumerate(prompts):
        p = [int(t) for t in p]
        if not p:
            raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
        bad = [t for t in p if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(
                f"prompt {i} has token ids {bad[:5]} outside [0, {vocab_size}) (the vocabulary)"
            )
        total = len(p) + max_new_tokens
        if total > max_context:
            raise ValueError(
                f"prompt {i}: {len(p)} tokens + max_new_tokens={max_new_tokens} = {total} "
                f"exceeds the model's context of {max_context} tokens"
            )
        out.append(p)
    return out


def _round_context(n: int, page_size: int) -> int:
    """Engine context for n tokens: a power-of-two number of blocks (few distinct layouts)."""
    blocks = -(-n // page_size)
    return (1 << max(blocks - 1, 0).bit_length()) * page_size


def generate(
    model,
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    kv_cache_config: KVCacheConfig | None = None,
    prefill_chunk_size: int | None = None,
    sampling: SamplingParams | None = None,
    seed: int = 0,
    implementation: str = "auto",
    max_batch: int | None = None,
    prefix_cache_rows: int = 0,
) -> list[list[int]]:
    """Generates `max_new_tokens` token ids for each prompt on a paged KV cache.

    Args:
      model: e.g. a `gemma.Transformer`.
      prompts: a list of token-id lists (ragged lengths).
      max_new_tokens: tokens generated per prompt.
      kv_cache_config: page size, byte quota, scratch reuse, KV dtype... (default
        `KVCacheConfig()`).
      prefill_chunk_size: prompt tokens per sequence per step (chunked prefill).
      sampling: `SamplingParams` (default greedy).
      seed: PRNG seed of sampling.
      implementation: attention kernels, "reference", "pallas" or "auto".
      max_batch: sequences served at once (default kv_cache_config.max_batch, else
        min(len(prompts), 16)). More prompts than rows, or than the pool holds, are served in
        waves.
      prefix_cache_rows: rows that park shared prompt prefixes so that prompts sharing a
        block-aligned prefix skip its prefill (see `Engine`); 0 disables the prefix cache.

    Returns:
      The generated token ids of each prompt, in order.
    """
    cfg = kv_cache_config or KVCacheConfig()
    config = model.config
    prompts = validate_prompts(prompts, config.vocab_size, config.max_context, max_new_tokens)
    longest = max(len(p) for p in prompts) + max_new_tokens
    engine = Engine(
        model,
        cfg,
        max_context=min(_round_context(longest, cfg.page_size), config.max_context),
        max_batch=max_batch or cfg.max_batch or min(len(prompts), 16),
        prefill_chunk_size=prefill_chunk_size,
        implementation=implementation,
        prefix_cache_rows=prefix_cache_rows,
    )
    outputs, _ = engine.run(prompts, max_new_tokens, sampling=sampling, seed=seed)
    return outputs
