"""`EngineConfig`: every setting of an engine, validated once (frozen, hashable).

`Engine`, `generate`, `generate_text`, the JSONL runner, the CLI and the experiments all take or
build one, so they cannot drift apart. Fields left None take their defaults when an engine
resolves the config against its model (`EngineConfig.resolved`): max_context the model's,
max_batch `kv_cache.max_batch` or 16, max_num_tokens `kv_cache.max_num_tokens` or 8192,
prefill_chunk_size `kv_cache.chunk_size` or max_num_tokens, min_prefill_bucket max_num_tokens.
"""

from __future__ import annotations

import dataclasses

from swajax import _validate
from swajax._config import KVCacheConfig
from swajax._drafter import is_in_step

DEFAULT_MAX_BATCH = 16
DEFAULT_MAX_NUM_TOKENS = 8192
IMPLEMENTATIONS = ("auto", "reference", "pallas")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """The settings of an `Engine`.

    Attributes:
      kv_cache: the KV cache (page size, byte quota, pool ratio, scratch policy, dtype).
      max_context: longest sequence served (prompt + new tokens); None: the model's.
      max_batch: rows served at once per replica.
      max_num_tokens: token budget of one step: decode rows take one token each, prefill
        chunks fill the rest.
      prefill_chunk_size: most prompt tokens of one row in one step; it also bounds a row's
        scratch range.
      implementation: attention kernels, "auto" (Pallas on a Hopper GPU), "reference" or
        "pallas".
      min_prefill_bucket: smallest token axis of a step with prefill rows; such steps are padded
        to powers of two from here up to max_num_tokens (the default compiles one variant).
      enable_prefix_caching: automatic prefix caching (`swajax._prefix_cache`): a request
        starts from the longest whole-block prefix it shares with cached blocks (earlier
        prompts, finished requests' histories, prefixes queued requests share), and skips
        prefilling it. Cached blocks no row reads are bounded only by free KV memory: they are
        evicted least recently used when admission needs their slots. On by default; greedy
        tokens are those of an uncached engine. With it on, sliding layers keep two pages past
        their window (`KVCacheConfig.max_rewind` >= 2 * page_size) so that a conversation's
        next turn, whose re-encoded history may part from the cached one in its last tokens,
        still shares every block before them.
      admission_headroom: fraction of each group's slots an admission leaves free for the
        running rows to grow.
      batch_invariant: a step holds decode rows only or prefill rows only, and prefill steps
        always have max_num_tokens tokens, so that a row's numbers (and greedy tokens) do not
        depend on what else runs (see `swajax._scheduler`).
      mesh: a `jax.sharding.Mesh` with an axis "model" (tensor parallelism) and optionally
        "data" (replicas, each with its own pool); None: one device.
      precompile: compile the greedy steps at construction (in threads).
      num_draft_tokens: speculative decoding (`swajax._drafter`): a request in decode feeds up
        to this many drafted tokens after its last token in one step, the model scores them
        all, and the request keeps those the target agrees with (greedy: the same tokens as
        without; sampling: the same distribution). 0: off. Per request:
        `SamplingParams.num_draft_tokens`. Needs mixed steps (not batch_invariant); sliding
        layers keep at least this many tokens past their window (`max_rewind`).
      drafter: what proposes the drafts: "ngram" (prompt lookup, `NgramDrafter`), an `Engine`
        of a smaller model of the same tokenizer (its greedy continuation, in its own KV pool:
        `Engine.propose_batch`), any object with `propose(tokens, k) -> list[int]`
        (`swajax._drafter.Drafter`), or a Gemma 4 assistant (`gemma.Gemma4Assistant`,
        `gemma.load_assistant`): a multi-token-prediction drafter that runs inside each step
        on the target's hidden state and KV pages (`swajax._drafter.is_in_step`; one device
        or data-parallel replicas; SWA scratch reuse then defaults to off, as the design's
        policy has it for external shared-KV drafters).
    """

    kv_cache: KVCacheConfig = dataclasses.field(default_factory=KVCacheConfig)
    max_context: int | None = None
    max_batch: int | None = None
    max_num_tokens: int | None = None
    prefill_chunk_size: int | None = None
    implementation: str = "auto"
    min_prefill_bucket: int | None = None
    enable_prefix_caching: bool = True
    admission_headroom: float = 0.01
    batch_invariant: bool = False
    mesh: object = None
    precompile: bool = False
    num_draft_tokens: int = 0
    drafter: object = "ngram"

    def __post_init__(self):
        if not isinstance(self.kv_cache, KVCacheConfig):
            raise ValueError(
                f"kv_cache must be a KVCacheConfig, got {type(self.kv_cache).__name__}"
            )
        for name in ("max_context", "max_batch", "max_num_tokens", "prefill_chunk_size"):
            if getattr(self, name) is not None:
                _validate.positive_int(name, getattr(self, name))
        if self.min_prefill_bucket is not None:
            _validate.positive_int("min_prefill_bucket", self.min_prefill_bucket)
        if self.implementation not in IMPLEMENTATIONS:
            raise ValueError(
                f"implementation must be one of {IMPLEMENTATIONS}, got {self.implementation!r}"
            )
        h = self.admission_headroom
        if isinstance(h, bool) or not isinstance(h, float | int) or not 0 <= h < 1:
            raise ValueError(f"admission_headroom must be in [0, 1), got {h!r}")
        _validate.positive_int("num_draft_tokens", self.num_draft_tokens, minimum=0)
        if not (
            (isinstance(self.drafter, str) and self.drafter == "ngram")
            or callable(getattr(self.drafter, "propose", None))
            or is_in_step(self.drafter)
        ):
            raise ValueError(
                "drafter must be 'ngram', an object with propose(tokens, k) or a "
                f"gemma.Gemma4Assistant, got {self.drafter!r}"
            )
        if self.num_draft_tokens and self.batch_invariant:
            raise ValueError(
                f"num_draft_tokens={self.num_draft_tokens} needs mixed steps: a step with drafts "
                "holds decode rows of several lengths, which batch_invariant=True does not run"
            )
        for name in ("batch_invariant", "precompile", "enable_prefix_caching"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")

    @classmethod
    def of(cls, config=None, **fields) -> EngineConfig:
        """An EngineConfig from `config` (an EngineConfig, a KVCacheConfig for `kv_cache`, or
        None) with `fields` replaced; ValueError for a field it does not have."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(fields) - names)
        if unknown:
            raise ValueError(f"unknown engine settings {unknown}; the settings are {sorted(names)}")
        if config is None:
            return cls(**fields)
        if isinstance(config, KVCacheConfig):
            return cls(kv_cache=config, **fields)
        if isinstance(config, EngineConfig):
            return dataclasses.replace(config, **fields) if fields else config
        raise ValueError(
            f"config must be an EngineConfig or a KVCacheConfig, got {type(config).__name__}"
        )

    def resolved(self, model_max_context: int) -> EngineConfig:
        """Every None filled in for a model of `model_max_context` tokens; ValueError for a
        max_context beyond it."""
        cfg = self.kv_cache
        max_context = self.max_context or model_max_context
        if max_context > model_max_context:
            raise ValueError(
                f"max_context={max_context} exceeds the model's context of {model_max_context}"
            )
        tokens = self.max_num_tokens or cfg.max_num_tokens or DEFAULT_MAX_NUM_TOKENS
        chunk = min(self.prefill_chunk_size or cfg.chunk_size or tokens, max_context)
        if self.batch_invariant and self.min_prefill_bucket not in (None, tokens):
            raise ValueError(
                f"batch_invariant=True runs every prefill step at max_num_tokens={tokens} "
                "tokens, so min_prefill_bucket must equal it (or be left unset), got "
                f"min_prefill_bucket={self.min_prefill_bucket}"
            )
        bucket = min(self.min_prefill_bucket or tokens, tokens)
        rows = self.max_batch or cfg.max_batch or DEFAULT_MAX_BATCH
        if self.enable_prefix_caching:
            cfg = dataclasses.replace(cfg, max_rewind=max(cfg.max_rewind, 2 * cfg.page_size))
        if self.num_draft_tokens:  # the drafts a verification rejects are taken back
            cfg = dataclasses.replace(cfg, max_rewind=max(cfg.max_rewind, self.num_draft_tokens))
        return dataclasses.replace(
            self,
            kv_cache=cfg,
            max_context=max_context,
            max_batch=rows,
            max_num_tokens=tokens,
            prefill_chunk_size=chunk,
            min_prefill_bucket=bucket,
        )
