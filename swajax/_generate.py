"""`swajax.generate`: the public entry point of batch generation on the KV pool."""

from __future__ import annotations

import dataclasses
import threading
import weakref

import jax
from flax import nnx

from swajax import _validate
from swajax._engine import Engine
from swajax._engine_config import EngineConfig
from swajax._sampling import SamplingParams


def validate_prompts(prompts, vocab_size: int, max_context: int, max_new_tokens: int):
    """Checks the request and returns the prompts as lists of ints; ValueError on bad input."""
    return _validate.prompts(
        prompts, vocab_size, max_context, max_new_tokens, "the model's context"
    )


def _round_context(n: int, page_size: int) -> int:
    """Engine context for n tokens: a power-of-two number of blocks (few distinct layouts)."""
    blocks = -(-n // page_size)
    return (1 << max(blocks - 1, 0).bit_length()) * page_size


class _EngineCache:
    """The engine of the last `generate` call, reused while the model and settings allow.

    One engine is kept (its KV pool holds most of the device's free memory): a call with other
    settings, a longer context or more rows than it has builds a new one, after dropping the
    old, as does a change of the model's structure (its GraphDef: e.g.
    `gemma.set_experts_in_place_max_rows`). Changed parameters (the model was trained or edited
    since) are taken up again, on the engine's shardings.
    """

    def __init__(self):
        self.lock = threading.Lock()
        self.model = None  # weakref
        self.key = None
        self.engine = None
        self.leaves = ()
        self.graphdef = None

    def get(self, model, key, max_context, rows, build):
        with self.lock:
            graphdef, state = nnx.split(model)
            fresh = self.model is not None and self.model() is model and self.key == key
            fresh = fresh and graphdef == self.graphdef
            e = self.engine
            if fresh and e.layout.max_context >= max_context and e.config.max_batch >= rows:
                leaves = jax.tree.leaves(state)
                if any(a is not b for a, b in zip(leaves, self.leaves, strict=True)):
                    if e.config.mesh is not None:  # the engine's shardings, as at its construction
                        state = jax.device_put(state, jax.tree.map(lambda a: a.sharding, e.params))
                    e.params = state
                    self.leaves = leaves
                return e
            self.engine = None  # free the old pool before the new one is made
            self.engine = build()
            self.model, self.key, self.graphdef = weakref.ref(model), key, graphdef
            self.leaves = jax.tree.leaves(state)
            return self.engine

    def clear(self):
        with self.lock:
            self.model = self.key = self.engine = self.graphdef = None
            self.leaves = ()


ENGINE_CACHE = _EngineCache()


def generate(
    model,
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    config: EngineConfig | None = None,
    sampling: SamplingParams | None = None,
    seed: int = 0,
    stop_token_ids=(),
    **settings,
) -> list[list[int]]:
    """Generates up to `max_new_tokens` token ids for each prompt on a paged KV cache.

    Args:
      model: e.g. a `gemma.Transformer`.
      prompts: a list of token-id lists (ragged lengths).
      max_new_tokens: tokens generated per prompt (fewer if a stop token comes first).
      config: the engine's `EngineConfig` (default `EngineConfig()`); `settings` are fields of
        it that replace config's (e.g. `kv_cache=KVCacheConfig(page_size=16)`, `max_batch=8`).
        max_context, if unset, is the longest request rounded up; max_batch, if unset,
        `kv_cache.max_batch` or 16, never more than a replica's share of the prompts.
      sampling: `SamplingParams` (default greedy).
      seed: PRNG seed of sampling (request i draws from a key of (seed, i)).
      stop_token_ids: tokens that end a sequence (returned as its last token).

    Returns:
      The generated token ids of each prompt, in order.

    The engine is kept for the next call with the same model and settings
    (`swajax._generate.ENGINE_CACHE`; `.clear()` frees it), so repeated calls compile nothing.
    """
    max_new_tokens = _validate.positive_int("max_new_tokens", max_new_tokens)
    prompts = validate_prompts(
        prompts, model.config.vocab_size, model.config.max_context, max_new_tokens
    )
    engine = cached_engine(
        model, [len(p) + max_new_tokens for p in prompts], EngineConfig.of(config, **settings)
    )
    outputs, _ = engine.run(
        prompts, max_new_tokens, sampling=sampling, seed=seed, stop_token_ids=stop_token_ids
    )
    return outputs


def cached_engine(model, request_lengths: list[int], config: EngineConfig | None = None) -> Engine:
    """The engine that serves requests of `request_lengths` tokens (prompt + new tokens) with
    `config`: the kept engine (`ENGINE_CACHE`) when its config matches and its context and rows
    suffice, else a new one, which is then kept. Unset in config: max_batch (per replica)
    `kv_cache.max_batch` or 16, never more than a replica's share of the requests; max_context
    the longest request rounded up to a power-of-two number of blocks, at most the model's."""
    config = EngineConfig() if config is None else config
    cfg = config.kv_cache
    replicas = 1 if config.mesh is None else dict(config.mesh.shape).get("data", 1)
    rows = min(config.max_batch or cfg.max_batch or 16, -(-len(request_lengths) // replicas))
    max_context = config.max_context or min(
        _round_context(max(request_lengths), cfg.page_size), model.config.max_context
    )
    key = dataclasses.replace(config, max_batch=None, max_context=None)
    return ENGINE_CACHE.get(
        model,
        key,
        max_context,
        rows,
        lambda: Engine(model, config, max_context=max_context, max_batch=rows),
    )
