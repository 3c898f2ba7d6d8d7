"""The engine: continuous batching of requests on one paged KV pool.

A request's path: `Engine.add_request` (validated, queued) -> `Scheduler.schedule` (pure
Python: admission, token budget, preemption, prefix parking; `swajax._scheduler`) -> the step
runner (one compiled step, state donated; `swajax._runner`) -> pool transforms -> the model's
attention hook (`swajax._paged`) -> kernels (`pallas_kernels`).

`Engine.step()` plans and dispatches the next step, then reads the step before it: the device
always has the next step queued while the host reads results and plans (decode rows take their
input token from the previous step's output on the device). `Engine.run` and `Engine.stream`
are loops over `step`; `swajax.generate` is `run` on a fresh engine.

Several devices (`mesh=`, see `swajax._sharding`): the parameters are split over the mesh's
"model" axis, the pool roots over KV heads; with a "data" axis each replica has its own pool,
slot ledger and scheduler, a request goes to the replica holding the fewest requests, and one
compiled step runs every replica.

Adaptive pool split (`KVCacheConfig(pool_ratio="adaptive")`): the split of the byte quota
across pool groups follows the requests queued, not hints. The split's slot counts are static
shapes of the compiled step, so a new split is a new layout (compiled once, then shared like
any other); the policy (`swajax._budget.adaptive_split`) keeps re-splits rare:
  - only while the pool is idle: no running request and no parked prefix (an engine with a
    prefix cache holding entries keeps its split until `clear_prefix_cache()`); queued
    requests hold no slot, so nothing is lost;
  - the split is the one that fits the most requests of the queue's mean length
    (prompt + max_new_tokens) in the quota, snapped to a grid of 8 points per octave of each
    group's weight, kept while the exact split stays within one grid step of it;
  - every queued request fits the new split alone; the quota never changes.
`Engine.adapt_pool` applies the policy at once (e.g. before `precompile`).

Robustness: the donating step call defers SIGINT until the new state is held; an exception or
KeyboardInterrupt inside `run` / `stream` aborts that call's requests and frees their rows, so
the engine stays usable and leaks no slot (if the state itself was lost, the pool is rebuilt
and every queued request is aborted). One engine serves one thread at a time (a lock).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import signal
import threading
import time
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from pallas_kernels.paged_attention import PREFILL_QUERY_TILE
from swajax import _sharding, _validate
from swajax._budget import (
    AdaptiveSplit,
    adaptive_split,
    kv_quota_bytes,
    plan_num_slots,
    request_slots,
)
from swajax._compilation_cache import enable_default_cache
from swajax._config import KVCacheConfig, resolve_scratch_policy
from swajax._layout import make_layout, with_num_slots
from swajax._ledger import SlotLedger
from swajax._runner import (
    StepInputs,
    bookkeeping_step,
    initial_tables,
    sharded_bookkeeping_step,
    step_function,
    step_inputs,
    trace_count,
)
from swajax._sampling import SamplingParams, request_key_data, step_mode
from swajax._scheduler import (
    FINISHED,
    Request,
    Scheduler,
    SchedulerCounters,
    StepPlan,
    default_headroom,
)
from swajax._state import init_state
from swajax._step_cache import CachedStep, resolve

MIN_BUCKET = 8
DEFAULT_MAX_NUM_TOKENS = 8192


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


@dataclasses.dataclass(frozen=True)
class RequestOutput:
    """What a step produced for one request.

    new_token_ids: tokens since the request's previous output; token_ids: every generated
    token so far (a stop token included); finish_reason: "stop" (a stop token), "length"
    (max_new_tokens) or None while it runs.
    """

    request_id: int
    new_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    finished: bool
    finish_reason: str | None


def _summary(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {"mean": float("nan"), "p50": float("nan"), "p99": float("nan")}
    v = np.asarray(values, np.float64)
    return {
        "mean": float(v.mean()),
        "p50": float(np.percentile(v, 50)),
        "p99": float(np.percentile(v, 99)),
    }


@dataclasses.dataclass
class RunStats:
    """What one `Engine.run` (or a block of `Engine.recording`) did.

    Slots: `peak_slots` / `mean_slots` per pool group (held after each step's reserve),
    `step_slots` the slots held per group after each step's reserve (the occupancy over the
    run), `num_slots` the pool's (with several replicas: summed over their pools). Latency:
    `ttft_s` per request (from its admission to the queue to its first token on the host) and
    `itl_s` (gaps between its tokens), with `ttft` / `itl` summaries (mean, p50, p99).
    """

    steps: int = 0
    prefill_tokens: int = 0  # prompt tokens fed (recomputed ones included)
    decode_tokens: int = 0
    output_tokens: int = 0
    seconds: float = 0.0
    peak_slots: tuple[int, ...] = ()
    slot_steps: tuple[int, ...] = ()  # per group: sum over steps of the slots held in the step
    step_slots: list[tuple[int, ...]] = dataclasses.field(default_factory=list)
    num_slots: tuple[int, ...] = ()
    max_concurrent: int = 0
    preemptions: int = 0
    evictions: int = 0
    prefix_hits: int = 0  # requests that started from a cached prefix
    prefix_tokens: int = 0  # prompt tokens they did not prefill
    ttft_s: list[float] = dataclasses.field(default_factory=list)
    itl_s: list[float] = dataclasses.field(default_factory=list)
    step_logits: list | None = None

    @property
    def tokens_per_second(self) -> float:
        return (self.prefill_tokens + self.decode_tokens) / max(self.seconds, 1e-9)

    @property
    def output_tokens_per_second(self) -> float:
        return self.output_tokens / max(self.seconds, 1e-9)

    @property
    def mean_slots(self) -> tuple[float, ...]:
        return tuple(s / max(self.steps, 1) for s in self.slot_steps)

    @property
    def ttft(self) -> dict[str, float]:
        return _summary(self.ttft_s)

    @property
    def itl(self) -> dict[str, float]:
        return _summary(self.itl_s)


@dataclasses.dataclass
class _Timing:
    added: float
    last: float | None = None


@contextlib.contextmanager
def _sigint_deferred():
    """Holds SIGINT back during the block (main thread only) and raises it afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught = []
    previous = signal.signal(signal.SIGINT, lambda *a: caught.append(a))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        raise KeyboardInterrupt


class Engine:
    """Serves requests on a paged KV pool sized from a `KVCacheConfig`.

    Args:
      model: a model with `config.layer_specs`, `config.vocab_size`, `config.max_context`
        and `forward(tokens, positions, *, attention_fn, attention_state, logits_indices)`
        (e.g. `gemma.Transformer`).
      kv_cache_config: the KV cache settings (page size, byte quota, scratch policy, dtype...).
      max_context: longest sequence this engine serves (prompt + new tokens).
      max_batch: rows served at once (default kv_cache_config.max_batch, else 16).
      max_num_tokens: token budget of one step (default kv_cache_config.max_num_tokens, else
        8192): decode rows take one token each, prefill chunks fill the rest.
      prefill_chunk_size: most prompt tokens of one row in one step (default
        kv_cache_config.chunk_size, else max_num_tokens); it also bounds a row's scratch range.
      implementation: kernels: "reference", "pallas" or "auto".
      min_prefill_bucket: smallest token axis of a step with prefill rows. Such steps are
        padded to powers of two from here up to max_num_tokens; the default (max_num_tokens)
        compiles one prefill variant.
      prefix_cache_rows: extra batch rows that park prefixes for reuse (0: no prefix cache;
        see `swajax._prefix_cache`): prefixes that queued prompts share, and finished
        requests' histories (a conversation's next turn starts from its last one).
      admission_headroom: fraction of each group's slots an admission leaves free for the
        running rows to grow (at least one slot; none when nothing else runs).
      precompile: compile the greedy prefill and decode steps now (in parallel threads)
        instead of at their first use.
      mesh: a `jax.sharding.Mesh` with an axis "model" (tensor parallelism over tp devices)
        and optionally "data" (dp replicas, each serving max_batch rows from its own pool);
        None: one device. The model must provide `partition_specs(tp)` (as
        `gemma.Transformer` does); its parameters are moved to their shardings, and with
        tp > 1 the model's `for_tensor_parallel(tp)`, where it has one, is what runs. The byte
        quota of `kv_cache_config` is then per device, and each replica's pool is sized from
        the per-device bytes of a slot (`KVLayout.tp`). ValueError for a mesh without "model"
        or a tp that cannot split the query or KV heads evenly.
      batch_invariant: keep a row's computation apart from what else runs in its step, so
        that greedy tokens do not depend on the schedule (e.g. on how many rows the pool
        admits, as with scratch reuse on or off). A step then holds decode rows only or
        prefill rows only (the two kinds alternate while both wait, see `swajax._scheduler`);
        every step with prefill rows has the token axis max_num_tokens (min_prefill_bucket
        must be left unset or equal it: ValueError otherwise); a prompt's chunks start at
        multiples of the prefill kernel's query tile (`PREFILL_QUERY_TILE`, 128) whatever
        else runs: a chunk is cut to the budget left only there, and only when the chunk is a
        multiple of it (else chunks are whole); never to the free slots; a prefix-cache hit
        moves them. Cost: decode rows wait while a prefill step runs, and a prefill step is
        padded to max_num_tokens. Preemption breaks it: a
        preempted request is recomputed from prompt + generated tokens in prefill steps
        (`RunStats.preemptions` counts them). ValueError with a mesh of several "data"
        replicas (one step runs every replica's plan, and each replica's scheduler picks its
        own step kind).

    With `kv_cache_config.pool_ratio="adaptive"` the pool is split anew for the queued requests
    whenever the engine is idle and the policy says so (see the module docstring); until the
    first request it is split by the hints.

    Compiled steps are shared by every engine of the same model structure and layout (the
    layout is deterministic: see `swajax._budget.round_quota`), and JAX's persistent
    compilation cache is on by default (`swajax._compilation_cache`), so a new engine or a new
    process compiles little or nothing.
    """

    def __init__(
        self,
        model,
        kv_cache_config: KVCacheConfig,
        *,
        max_context: int,
        max_batch: int | None = None,
        max_num_tokens: int | None = None,
        prefill_chunk_size: int | None = None,
        implementation: str = "auto",
        min_prefill_bucket: int | None = None,
        prefix_cache_rows: int = 0,
        admission_headroom: float = 0.01,
        precompile: bool = False,
        mesh=None,
        batch_invariant: bool = False,
    ):
        enable_default_cache()
        config = model.config
        cfg = kv_cache_config
        max_context = _validate.positive_int("max_context", max_context)
        if max_context > config.max_context:
            raise ValueError(
                f"max_context={max_context} exceeds the model's context of {config.max_context}"
            )
        prefix_cache_rows = _validate.positive_int(
            "prefix_cache_rows", prefix_cache_rows, minimum=0
        )
        if max_batch is None:
            max_batch = cfg.max_batch or 16
        max_batch = _validate.positive_int("max_batch", max_batch)
        if max_num_tokens is None:
            max_num_tokens = getattr(cfg, "max_num_tokens", None) or DEFAULT_MAX_NUM_TOKENS
        max_num_tokens = _validate.positive_int("max_num_tokens", max_num_tokens)
        if prefill_chunk_size is None:
            prefill_chunk_size = cfg.chunk_size or max_num_tokens
        chunk = min(_validate.positive_int("prefill_chunk_size", prefill_chunk_size), max_context)
        min_bucket = max_num_tokens if min_prefill_bucket is None else min_prefill_bucket
        min_bucket = _validate.positive_int("min_prefill_bucket", min_bucket)
        if not isinstance(admission_headroom, float | int) or not 0 <= admission_headroom < 1:
            raise ValueError(f"admission_headroom must be in [0, 1), got {admission_headroom!r}")
        if not isinstance(batch_invariant, bool):
            raise ValueError(f"batch_invariant must be True or False, got {batch_invariant!r}")
        if batch_invariant and min_bucket != max_num_tokens:
            raise ValueError(
                f"batch_invariant=True runs every prefill step at max_num_tokens={max_num_tokens} "
                f"tokens, so min_prefill_bucket must equal it (or be left unset), got "
                f"min_prefill_bucket={min_bucket}"
            )
        scratch = resolve_scratch_policy(
            cfg,
            is_multimodal=getattr(config, "is_multimodal", False),
            has_external_kv_draft=getattr(config, "has_external_kv_draft", False),
        )
        self.mesh = None if mesh is None else _sharding.serving_mesh(mesh)
        self.num_replicas, tp = (1, 1) if mesh is None else _sharding.mesh_sizes(self.mesh)
        if batch_invariant and self.num_replicas > 1:
            raise ValueError(
                f"batch_invariant=True needs one data-parallel replica, got {self.num_replicas}: "
                "one step runs every replica's plan, and the replicas' schedulers pick their "
                "step kinds (decode or prefill) independently"
            )
        param_specs = None
        if self.mesh is not None:
            if not callable(getattr(model, "partition_specs", None)):
                raise TypeError(
                    f"a mesh needs a model with partition_specs(tp), got {type(model).__name__}"
                )
            param_specs = model.partition_specs(tp)  # ValueError for tp vs query heads
            view = getattr(model, "for_tensor_parallel", None)
            if tp > 1 and callable(view):  # how the model runs sharded (the same arrays)
                model = view(tp)
        # The quota is read once: a re-split pool must not see the old pool as used memory.
        self.quota = kv_quota_bytes(cfg)
        layout = make_layout(
            config.layer_specs,
            cfg,
            max_context=max_context,
            max_batch=max_batch + prefix_cache_rows,
            max_chunk=chunk,
            num_slots=1,
            scratch=scratch,
            tp=tp,
        )
        self.layout = with_num_slots(layout, plan_num_slots(layout, cfg, self.quota))
        self.kv_cache_config = cfg
        self.adaptive = cfg.adaptive_pool_ratio
        self._split: AdaptiveSplit | None = None  # the adaptive split in effect
        self._headroom_fraction = admission_headroom
        self.serving_rows = max_batch
        self.max_num_tokens = max_num_tokens
        self.chunk = chunk
        self.min_prefill_bucket = min(min_bucket, max_num_tokens)
        self.batch_invariant = batch_invariant
        self.vocab_size = config.vocab_size
        self.implementation = implementation
        self.max_shares = min(16, max_batch + prefix_cache_rows) if prefix_cache_rows else 0
        self.headroom = default_headroom(self.num_slots, admission_headroom)
        self.graphdef, self.params = nnx.split(model)
        if param_specs is not None:
            shardings = jax.tree.map(lambda s: NamedSharding(self.mesh, s), param_specs)
            self.params = jax.device_put(self.params, shardings)
        self._steps: dict = {}  # (decode, logits, mode) -> step function
        self._resolved: dict = {}  # (tokens, decode, logits, mode) -> its callable
        self._ran: set = set()  # step variants (`_variant`) this engine has dispatched
        self._lock = threading.RLock()
        self._ids = itertools.count()
        self._traces_at_start = {self.layout: trace_count(self.layout)}
        self._reset_pool()
        if precompile:
            self.precompile()

    def _reset_pool(self) -> None:
        """A fresh pool, ledger and scheduler per replica (every queued request is dropped)."""
        self._init_pool()
        self.schedulers = [
            make_scheduler(
                self.layout,
                serving_rows=self.serving_rows,
                max_num_tokens=self.max_num_tokens,
                chunk=self.chunk,
                headroom=self.headroom,
                max_shares=self.max_shares,
                batch_invariant=self.batch_invariant,
            )
            for _ in range(self.num_replicas)
        ]
        self._replica_of: dict[int, int] = {}  # request id -> replica
        self._in_flight = None
        self._timing: dict[int, _Timing] = {}
        self._unclaimed: list[RequestOutput] = []
        self._stats: RunStats | None = None
        self._logit_rows: dict[int, int] | None = None

    def _init_pool(self) -> None:
        """Empty pool roots, page tables and previous tokens for `self.layout` (every replica's)."""
        if self.mesh is None:
            state = init_state(self.layout)
            # The previous step's page tables, updated in place by the gather (per_layer mode).
            tables = initial_tables(self.layout)
            prev_tokens = jnp.zeros((self.layout.max_batch,), jnp.int32)
            # Committed to their device (no copy), as every step's outputs are: a first step
            # with uncommitted inputs would be a second compile of the same step.
            device = next(iter(jax.tree.leaves(state)[0].devices()))
            self.state, self.tables, self._prev_tokens = jax.device_put(
                (state, tables, prev_tokens), device
            )
        else:  # every replica's, concatenated along the first axis
            self.state = _sharding.init_state_sharded(self.layout, self.mesh)
            self.tables = _sharding.initial_tables_sharded(self.layout, self.mesh)
            self._prev_tokens = jax.device_put(
                np.zeros((self.num_replicas * self.layout.max_batch,), np.int32),
                _sharding.replica_sharding(self.mesh),
            )

    # ------------------------------------------------------------------ properties

    @property
    def trace_count(self) -> int:
        """Traces of the step for this engine's layouts since the engine was made."""
        return sum(trace_count(lay) - n for lay, n in self._traces_at_start.items())

    @property
    def num_slots(self) -> tuple[int, ...]:
        """Slots per pool group of one replica's pool."""
        return tuple(g.num_slots for g in self.layout.groups)

    @property
    def scheduler(self) -> Scheduler:
        """The scheduler (of replica 0 with a "data" axis: see `schedulers`)."""
        return self.schedulers[0]

    @property
    def ledger(self) -> SlotLedger:
        """The slot ledger (of replica 0 with a "data" axis)."""
        return self.schedulers[0].ledger

    @property
    def has_unfinished_requests(self) -> bool:
        return any(s.has_work for s in self.schedulers) or self._in_flight is not None

    # ------------------------------------------------------------------ requests

    def check_fits(self, prompt_len: int, max_new_tokens: int) -> None:
        """ValueError if one request alone can never fit the pool or the context."""
        total = prompt_len + max_new_tokens
        if total > self.layout.max_context:
            raise ValueError(
                f"prompt of {prompt_len} tokens + max_new_tokens={max_new_tokens} = {total} "
                f"exceeds the engine's max_context={self.layout.max_context}"
            )
        # The last prefill step draws the first new token: max_new_tokens - 1 decode steps.
        need = request_slots(
            self.layout, prompt_len, chunk=self.chunk, max_new_tokens=max_new_tokens - 1
        )
        if self.adaptive:  # the next split gives it what it needs if the quota holds that
            nbytes = sum(n * self.layout.slot_bytes(g) for g, n in enumerate(need))
            if nbytes > self.quota:
                raise ValueError(
                    f"a request of {prompt_len} prompt tokens + {max_new_tokens} new tokens needs "
                    f"{nbytes} bytes of KV ({list(need)} slots per pool group) but the quota is "
                    f"{self.quota} bytes; raise max_gpu_total_bytes / free_gpu_memory_fraction "
                    "or shorten the request"
                )
            return
        for g, (n, have) in enumerate(zip(need, self.num_slots, strict=True)):
            if n > have:
                raise ValueError(
                    f"a request of {prompt_len} prompt tokens + {max_new_tokens} new tokens needs "
                    f"{n} slots of pool group {g} (life cycle {self.layout.groups[g].life_cycle}) "
                    f"but the pool has {have}; raise max_gpu_total_bytes / "
                    "free_gpu_memory_fraction or shorten the request"
                )

    def _make_request(self, prompt, max_new_tokens, sampling, stop_token_ids, key_data):
        max_new_tokens = _validate.positive_int("max_new_tokens", max_new_tokens)
        prompt = _validate.prompt(
            "prompt", prompt, self.vocab_size, self.layout.max_context, max_new_tokens
        )
        if sampling is None:
            sampling = SamplingParams()
        if not isinstance(sampling, SamplingParams):
            raise ValueError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        stop = frozenset(_validate.token_ids("stop_token_ids", stop_token_ids, self.vocab_size))
        self.check_fits(len(prompt), max_new_tokens)
        rid = next(self._ids)
        if key_data is None:
            seed = sampling.seed if sampling.seed is not None else 0
            key_data = request_key_data(seed, None if sampling.seed is not None else rid)
        return Request(
            id=rid,
            prompt=tuple(prompt),
            max_new_tokens=max_new_tokens,
            stop_token_ids=stop,
            sampling=sampling,
            key_data=key_data,
        )

    def _queue(self, requests: Sequence[Request]) -> list[int]:
        now = time.perf_counter()
        for r in requests:
            replica = min(range(self.num_replicas), key=lambda i: len(self.schedulers[i].requests))
            self.schedulers[replica].add(r)
            self._replica_of[r.id] = replica
            self._timing[r.id] = _Timing(now)
        return [r.id for r in requests]

    def add_request(
        self,
        prompt,
        max_new_tokens: int,
        sampling: SamplingParams | None = None,
        stop_token_ids=(),
    ) -> int:
        """Queues one request; returns its id. Its tokens come back from `step()`.

        The request's PRNG key comes from `sampling.seed`, else from the engine's request id.
        ValueError (nothing queued) for a bad prompt or parameters, or a request that can
        never fit the pool.
        """
        with self._lock:
            r = self._make_request(prompt, max_new_tokens, sampling, stop_token_ids, None)
            return self._queue([r])[0]

    def abort(self, request_ids) -> None:
        """Drops these requests (unknown ids raise ValueError); their rows are freed."""
        with self._lock:
            ids = list(request_ids)
            unknown = [i for i in ids if i not in self._scheduler_of(i).requests]
            if unknown:
                raise ValueError(f"unknown request ids {unknown[:5]}")
            self._abort(ids)
            self._flush_bookkeeping()

    def _scheduler_of(self, request_id: int) -> Scheduler:
        return self.schedulers[self._replica_of.get(request_id, 0)]

    def _abort(self, ids) -> None:
        for i in ids:
            self._scheduler_of(i).abort([i])
            self._replica_of.pop(i, None)

    def adapt_pool(
        self, prompt_lengths: Sequence[int] | None = None, max_new_tokens: int = 1
    ) -> bool:
        """Applies the adaptive split policy now; returns whether the pool was split anew.

        For the queued requests, or (given `prompt_lengths`) for requests of those prompt
        lengths generating `max_new_tokens` each, e.g. before `precompile` so that a run's
        first step finds its layout compiled. Only with pool_ratio="adaptive" (ValueError
        otherwise); returns False while the pool is not idle (see the module docstring).
        """
        if not self.adaptive:
            raise ValueError(
                "adapt_pool needs KVCacheConfig(pool_ratio='adaptive'), got pool_ratio="
                f"{self.kv_cache_config.pool_ratio!r}"
            )
        with self._lock:
            if prompt_lengths is None:
                requests = self._waiting_requests()
            else:
                max_new_tokens = _validate.positive_int("max_new_tokens", max_new_tokens)
                requests = [
                    (_validate.positive_int("prompt_lengths[i]", n), max_new_tokens)
                    for n in prompt_lengths
                ]
                for n, k in requests:
                    self.check_fits(n, k)
            if self._in_flight is not None or not requests:
                return False
            return self._adapt(requests)

    def _waiting_requests(self) -> list[tuple[int, int]]:
        """(prompt tokens, max_new_tokens) of every queued request, over the replicas."""
        return [(len(r.prompt), r.max_new_tokens) for s in self.schedulers for r in s.waiting]

    def _adapt(self, requests: Sequence[tuple[int, int]]) -> bool:
        """Re-splits the idle pool for (prompt tokens, max_new_tokens) pairs if the policy asks.

        With replicas, one split serves all of them (one compiled step runs every replica)."""
        if not all(s.pool_idle for s in self.schedulers):
            return False
        split = adaptive_split(
            self.layout,
            requests,
            self.quota,
            chunk=self.max_num_tokens,
            max_batch=self.serving_rows,
            current=self._split,
            headroom=self._headroom_fraction,
        )
        if split is None:
            return False
        self._split = split
        if split.num_slots == self.num_slots:
            return False
        self._resplit(split.num_slots)
        return True

    def _resplit(self, num_slots: Sequence[int]) -> None:
        """A new, empty pool with `num_slots` per group; the queue (and its timing) is kept."""
        layout = with_num_slots(self.layout, num_slots)
        self.state = self.tables = None  # the old pool roots go before the new ones come
        self.layout = layout
        self._traces_at_start.setdefault(layout, trace_count(layout))
        self._steps = {}  # compiled steps are per layout (and shared across engines)
        self._resolved = {}
        self._ran = set()
        self._init_pool()
        self.headroom = default_headroom(self.num_slots, self._headroom_fraction)
        for s in self.schedulers:
            s.rebind(SlotLedger(layout), self.headroom)
        if self._stats is not None:
            self._stats.num_slots = tuple(n * self.num_replicas for n in self.num_slots)

    def clear_prefix_cache(self) -> None:
        """Drops every parked prefix, returning its slots (shared blocks stay with other rows)."""
        with self._lock:
            for s in self.schedulers:
                s.clear_cache()
            self._flush_bookkeeping()

    # ------------------------------------------------------------------ steps

    def _bucket(self, plans) -> tuple[int, bool]:
        if all(p.decode_only for p in plans):
            return _round_up(max(self.serving_rows, 1), MIN_BUCKET), True
        n = max(max(p.num_tokens for p in plans), self.min_prefill_bucket, MIN_BUCKET)
        return min(1 << (n - 1).bit_length(), self.max_num_tokens), False

    def _step_function(self, decode: bool, logits: bool, mode: str):
        key = (decode, logits, mode)
        if key not in self._steps:
            self._steps[key] = step_function(
                self.graphdef,
                self.layout,
                decode=decode,
                implementation=self.implementation,
                sampling_mode=mode,
                logits=logits,
                mesh=self.mesh,
            )
        return self._steps[key]

    def _full_plans(self, plans) -> list[StepPlan]:
        """Every replica's plan, an idle one (no tokens, no bookkeeping) where it has none."""
        return [
            StepPlan(s._steps, {}, {}, {}, used=s.ledger.used()) if p is None else p
            for s, p in zip(self.schedulers, plans, strict=True)
        ]

    def _device_inputs(self, inputs: list):
        """One replica's inputs as they are; with a mesh, every replica's concatenated."""
        if self.mesh is None:
            return inputs[0]
        joined = jax.tree.map(lambda *x: np.concatenate(x), *inputs)
        return jax.device_put(joined, _sharding.replica_sharding(self.mesh))

    def _variant(self, plans) -> tuple:
        """(token bucket, decode, logits, sampling mode): which compiled step runs `plans`."""
        plans = [p for p in plans if p is not None and p.new_tokens]
        num_tokens, decode = self._bucket(plans)
        mode = step_mode([r.sampling for p in plans for r, _ in p.samples.values()])
        logits = self._stats is not None and self._stats.step_logits is not None
        return max([num_tokens] + [p.num_tokens for p in plans]), decode, logits, mode

    def _dispatch(self, plans) -> None:
        num_tokens, decode, logits, mode = variant = self._variant(plans)
        self._ran.add(variant)
        plans = self._full_plans(plans)
        inputs = [
            step_inputs(
                plan,
                num_tokens=num_tokens,
                max_batch=self.layout.max_batch,
                max_shares=self.max_shares,
                sampling=lambda r: r.sampling.row_values(),
            )
            for plan in plans
        ]
        inputs = self._device_inputs(inputs)
        args = (self.params, self.state, self.tables, self._prev_tokens, inputs)
        step = self._resolved.get(variant)  # the callable of this exact shape, once resolved
        if step is None:
            step = resolve(self._step_function(decode, logits, mode), args)
            self._resolved[variant] = step
        with _sigint_deferred():
            out = step(*args)
            self.state, self.tables, self._prev_tokens = out.state, out.tables, out.next_tokens
        self._in_flight = (plans, out)
        stats = self._stats
        if stats is not None:
            stats.steps += 1
            for plan in plans:
                for row, n in plan.new_tokens.items():
                    if n > 1 or row not in plan.samples or plan.samples[row][1] == 0:
                        stats.prefill_tokens += n
                    else:
                        stats.decode_tokens += n
            used = np.sum([p.used for p in plans], axis=0)  # over the replicas
            stats.max_concurrent = max(stats.max_concurrent, sum(len(p.new_tokens) for p in plans))
            stats.peak_slots = tuple(int(x) for x in np.maximum(stats.peak_slots, used))
            stats.slot_steps = tuple(int(x) for x in np.add(stats.slot_steps, used))
            stats.step_slots.append(tuple(int(x) for x in used))

    def _collect(self) -> list[RequestOutput]:
        """Reads the step in flight and records its tokens; returns the outputs."""
        if self._in_flight is None:
            return []
        plans, out = self._in_flight
        self._in_flight = None
        # Per replica (one without a mesh; with one, the replicas' outputs are concatenated).
        dp = self.num_replicas
        next_tokens = np.asarray(out.next_tokens).reshape(dp, -1)
        ok, used = np.asarray(out.ok).reshape(dp), np.asarray(out.used).reshape(dp, -1)
        logits = None if out.logits is None else out.logits.reshape(dp, -1, out.logits.shape[-1])
        for plan, ok_r, used_r in zip(plans, ok, used, strict=True):
            if not bool(ok_r):
                raise RuntimeError(
                    "internal error: a step's slot reservation or prefix share failed on the "
                    "device although the host ledger planned it "
                    f"(new_tokens={plan.new_tokens})"
                )
            if tuple(int(x) for x in used_r) != tuple(plan.used):
                raise RuntimeError(
                    f"internal error: the device holds {tuple(used_r)} slots per group, the "
                    f"ledger {plan.used}"
                )
        outputs = []
        for i, plan in enumerate(plans):
            outputs += self._collect_replica(
                i, plan, next_tokens[i], None if logits is None else logits[i]
            )
        return outputs

    def _collect_replica(self, replica: int, plan, next_tokens, logits) -> list[RequestOutput]:
        scheduler = self.schedulers[replica]
        tokens = {row: int(next_tokens[row]) for row in plan.samples}
        before = {row: len(r.output) for row, (r, _) in plan.samples.items()}
        changed = scheduler.on_sampled(plan, tokens)
        now = time.perf_counter()
        stats = self._stats
        outputs = []
        for row, (r, _) in plan.samples.items():
            if r not in changed:
                continue
            timing = self._timing[r.id]
            if stats is not None:
                stats.output_tokens += 1
                if timing.last is None:
                    stats.ttft_s.append(now - timing.added)
                else:
                    stats.itl_s.append(now - timing.last)
                if stats.step_logits is not None and logits is not None:
                    stats.step_logits.append(
                        (self._logit_rows.get(r.id, r.id), before[row], np.asarray(logits[row]))
                    )
            timing.last = now
            new = tuple(r.output[before[row] :])
            finished = r.status == FINISHED
            outputs.append(RequestOutput(r.id, new, tuple(r.output), finished, r.finish_reason))
            if finished:
                scheduler.requests.pop(r.id, None)
                self._replica_of.pop(r.id, None)
                self._timing.pop(r.id, None)
        return outputs

    def _apply_bookkeeping(self, plans) -> None:
        """Runs plans without tokens (frees and shares only) on the device."""
        inputs = [
            step_inputs(
                plan,
                num_tokens=0,
                max_batch=self.layout.max_batch,
                max_shares=self.max_shares,
                sampling=lambda r: (0.0, 0, 1.0),
            )
            for plan in self._full_plans(plans)
        ]
        inputs = self._device_inputs(inputs)
        args = (inputs.free_a, inputs.shares_a, inputs.free_b)
        with _sigint_deferred():
            if self.mesh is None:
                ok, self.state = bookkeeping_step(self.layout, self.state, *args)
            else:
                step = sharded_bookkeeping_step(self.layout, self.mesh)
                ok, self.state = step(self.state, *args)
        if not bool(np.all(np.asarray(ok))):
            raise RuntimeError("internal error: a bookkeeping share failed on the device")

    def _flush_bookkeeping(self) -> None:
        """Frees on the device now the rows the schedulers released outside a step."""
        plans = [s.bookkeeping_plan() for s in self.schedulers]
        if any(p is not None for p in plans):
            self._apply_bookkeeping(plans)

    def _drain(self) -> None:
        """Reads the step in flight; its outputs come with the next `step()`."""
        if self._in_flight is not None:
            self._unclaimed += self._collect()

    def step(self) -> list[RequestOutput]:
        """Plans and dispatches the next step, then reads the one before it.

        Returns the outputs of the requests that got tokens in the step read (empty after the
        first call of a run: that step's tokens come with the next call).
        """
        with self._lock:
            if self.adaptive and self._in_flight is None:
                waiting = self._waiting_requests()
                if waiting:
                    self._adapt(waiting)
            outputs, self._unclaimed = self._unclaimed, []
            previous, self._in_flight = self._in_flight, None
            plans = [s.schedule() if s.has_work else None for s in self.schedulers]
            if any(p is not None and p.new_tokens for p in plans):
                if self._variant(plans) not in self._ran:
                    # This step's shape has not run on this engine, so dispatching it may
                    # compile for seconds: read the step in flight first, so that its tokens
                    # (often a request's first) do not wait for the compile.
                    self._in_flight, previous = previous, None
                    outputs += self._collect()
                self._dispatch(plans)
            elif any(p is not None for p in plans):
                self._apply_bookkeeping(plans)
            current, self._in_flight = self._in_flight, previous
            outputs += self._collect()
            self._in_flight = current
            if (
                all(p is None for p in plans)
                and previous is None
                and any(s.has_work for s in self.schedulers)
            ):
                raise RuntimeError(
                    "internal error: requests are queued but the scheduler planned no step"
                )
            return outputs

    # ------------------------------------------------------------------ loops

    def _guarded(self, ids: list[int]):
        """Context: on any exception, abort `ids` and leave the engine consistent."""
        engine = self

        class _Guard:
            def __enter__(self):
                return self

            def __exit__(self, exc_type, exc, tb):
                if exc_type is None:
                    return False
                engine._recover(ids)
                return False

        return _Guard()

    def _recover(self, ids: list[int]) -> None:
        leaves = jax.tree.leaves((self.state, self.tables, self._prev_tokens))
        if any(x.is_deleted() for x in leaves):
            self._reset_pool()  # the donated state is gone: start from an empty pool
            return
        try:
            self._drain()
        except Exception:  # noqa: BLE001 - the step itself failed; its state is still held
            self._in_flight = None
        self._abort([i for i in ids if i in self._scheduler_of(i).requests])
        self._flush_bookkeeping()
        self._unclaimed = [o for o in self._unclaimed if o.request_id not in set(ids)]

    def _new_requests(self, prompts, max_new_tokens, sampling, seed, stop_token_ids):
        max_new_tokens = _validate.positive_int("max_new_tokens", max_new_tokens)
        prompts = _validate.prompts(
            prompts, self.vocab_size, self.layout.max_context, max_new_tokens
        )
        seed = _check_seed(seed)
        sampling = sampling or SamplingParams()
        requests = []
        for i, p in enumerate(prompts):
            key = request_key_data(sampling.seed if sampling.seed is not None else seed, i)
            requests.append(self._make_request(p, max_new_tokens, sampling, stop_token_ids, key))
        return requests

    def stream(
        self,
        prompts,
        max_new_tokens: int,
        *,
        sampling: SamplingParams | None = None,
        seed: int = 0,
        stop_token_ids=(),
    ) -> Iterator[tuple[int, RequestOutput]]:
        """Yields (prompt index, output) as tokens come, until every prompt has finished."""
        with self._lock:
            requests = self._new_requests(prompts, max_new_tokens, sampling, seed, stop_token_ids)
            ids = self._queue(requests)
            index = {rid: i for i, rid in enumerate(ids)}
            with contextlib.closing(self.stream_requests(ids)) as outputs:
                for out in outputs:
                    yield index[out.request_id], out

    def stream_requests(self, request_ids) -> Iterator[RequestOutput]:
        """Steps until the queued requests `request_ids` (from `add_request`) have finished,
        yielding their outputs as they come; other requests' outputs come from later `step()`
        calls. An exception, a KeyboardInterrupt or closing the generator aborts these requests
        (their rows are freed). ValueError (nothing run) for an id that is not queued.
        """
        with self._lock:
            ids = list(request_ids)
            unknown = [i for i in ids if not any(i in s.requests for s in self.schedulers)]
            if unknown:
                raise ValueError(f"request ids {unknown[:5]} are not queued or running")
            remaining = set(ids)
            with self._guarded(ids):
                while remaining:
                    for out in self.step():
                        if out.request_id in remaining:
                            if out.finished:
                                remaining.discard(out.request_id)
                            yield out
                        else:
                            self._unclaimed.append(out)

    def run(
        self,
        prompts,
        max_new_tokens: int,
        *,
        sampling: SamplingParams | None = None,
        seed: int = 0,
        stop_token_ids=(),
        collect_logits: bool = False,
        progress: bool = False,
        callback=None,
    ) -> tuple[list[list[int]], RunStats]:
        """Generates up to max_new_tokens tokens for every prompt; returns (outputs, stats).

        stop_token_ids end a request early (the stop token is its last output token).
        callback(prompt index, RequestOutput), if given, sees every output as it comes.
        """
        with self._lock:
            requests = self._new_requests(prompts, max_new_tokens, sampling, seed, stop_token_ids)
            bar = None
            if progress:
                from tqdm.auto import tqdm

                bar = tqdm(total=len(requests) * max_new_tokens, unit="tok", desc="generate")
            outputs: list[list[int]] = [[] for _ in requests]
            try:
                with self.recording(collect_logits=collect_logits) as stats:
                    ids = self._queue(requests)
                    index = {rid: i for i, rid in enumerate(ids)}
                    self._logit_rows = dict(index)
                    with contextlib.closing(self.stream_requests(ids)) as request_outputs:
                        for out in request_outputs:
                            i = index[out.request_id]
                            outputs[i] = list(out.token_ids)
                            if bar is not None:
                                bar.update(len(out.new_token_ids))
                            if callback is not None:
                                callback(i, out)
                    jax.block_until_ready(self.state)
            finally:
                if bar is not None:
                    bar.close()
            return outputs, stats

    @contextlib.contextmanager
    def recording(self, *, collect_logits: bool = False) -> Iterator[RunStats]:
        """Records the steps run inside the block into the `RunStats` it yields.

        `run` records this way; around `stream`, `stream_requests` or a loop over `step` the
        same statistics come out (seconds: the block's wall time). One recording at a time.
        """
        with self._lock:
            if self._stats is not None:
                raise RuntimeError("this engine is already recording a RunStats")
            stats = RunStats(num_slots=tuple(n * self.num_replicas for n in self.num_slots))
            zeros = (0,) * len(self.num_slots)
            stats.peak_slots, stats.slot_steps = zeros, zeros
            stats.step_logits = [] if collect_logits else None
            counters = self._counters()
            self._stats = stats
            self._logit_rows = {}
            t0 = time.perf_counter()
            try:
                yield stats
            finally:
                stats.seconds = time.perf_counter() - t0
                c = self._counters()
                stats.preemptions = c.preemptions - counters.preemptions
                stats.evictions = c.evictions - counters.evictions
                stats.prefix_hits = c.prefix_hits - counters.prefix_hits
                stats.prefix_tokens = c.prefix_tokens - counters.prefix_tokens
                self._stats, self._logit_rows = None, None

    def _counters(self) -> SchedulerCounters:
        """The schedulers' counters, summed over the replicas."""
        return SchedulerCounters(
            **{
                f.name: sum(getattr(s.counters, f.name) for s in self.schedulers)
                for f in dataclasses.fields(SchedulerCounters)
            }
        )

    # ------------------------------------------------------------------ compilation

    def step_buckets(self) -> list[tuple[int, bool]]:
        """Every (token bucket, decode) step shape this engine can run."""
        buckets, n = [], max(self.min_prefill_bucket, MIN_BUCKET)
        while True:
            t = min(1 << (n - 1).bit_length(), self.max_num_tokens)
            buckets.append((t, False))
            if t >= self.max_num_tokens:
                break
            n = t + 1
        return [(_round_up(self.serving_rows, MIN_BUCKET), True), *buckets]

    def precompile(self, modes=("greedy",)) -> None:
        """Compiles every step shape of `step_buckets` for the sampling modes, in threads."""
        import concurrent.futures

        jobs = [(t, d, m) for t, d in self.step_buckets() for m in modes]
        with concurrent.futures.ThreadPoolExecutor(max_workers=min(4, len(jobs))) as pool:
            list(pool.map(lambda job: self._lower(*job).compile(), jobs))

    def _lower(
        self, num_tokens: int, decode: bool, mode: str, lowering_platforms=None, logits=False
    ):
        step = self._step_function(decode, logits, mode)
        if lowering_platforms is not None and isinstance(step, CachedStep):
            step = step.jitted  # the step cache stores this backend's lowering only
        args = self._step_args(num_tokens)
        return step.trace(*args).lower(lowering_platforms=lowering_platforms)

    def _step_args(self, num_tokens: int) -> tuple:
        """The step's arguments for a token bucket, its inputs as shapes (for lowering)."""
        b, s = self.layout.max_batch, self.max_shares
        if self.mesh is None:
            sds = jax.ShapeDtypeStruct
        else:  # every replica's inputs, stacked

            def sds(shape, dtype):
                shape = (self.num_replicas * shape[0], *shape[1:])
                sharding = _sharding.replica_sharding(self.mesh)
                return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

        inputs = StepInputs(
            sds((num_tokens,), jnp.int32),
            sds((num_tokens,), jnp.int32),
            sds((b,), jnp.int32),
            sds((b,), jnp.bool_),
            sds((s, 3), jnp.int32),
            sds((b,), jnp.bool_),
            sds((s, 3), jnp.int32),
            sds((b, 2), jnp.uint32),
            sds((b,), jnp.int32),
            sds((b,), jnp.float32),
            sds((b,), jnp.int32),
            sds((b,), jnp.float32),
        )
        return (self.params, self.state, self.tables, self._prev_tokens, inputs)

    # ------------------------------------------------------------------ inspection

    def lower_step(self, num_tokens: int, *, decode: bool, lowering_platforms=None):
        """The `jax.stages.Lowered` greedy step for a token bucket, for HLO and memory
        inspection. lowering_platforms: e.g. ("cuda",) to lower for a GPU on a machine without
        one (with `pallas_kernels._checks.force_compiled()` for the Mosaic GPU kernels).
        """
        return self._lower(num_tokens, decode, "greedy", lowering_platforms)


def make_scheduler(
    layout,
    *,
    serving_rows: int,
    max_num_tokens: int,
    chunk: int,
    headroom,
    max_shares: int = 0,
    batch_invariant: bool = False,
) -> Scheduler:
    """The engine's scheduler over a fresh `SlotLedger` of `layout` (also what a host-only
    simulation of the engine plans with): mixed steps, or with `batch_invariant` one kind of
    rows per step and chunks cut only at multiples of `PREFILL_QUERY_TILE`."""
    return Scheduler(
        SlotLedger(layout),
        serving_rows=serving_rows,
        max_num_tokens=max_num_tokens,
        chunk=chunk,
        headroom=headroom,
        max_shares=max_shares,
        mixed_steps=not batch_invariant,
        cut_align=PREFILL_QUERY_TILE if batch_invariant else 0,
    )


def _check_seed(seed) -> int:
    from swajax._sampling import check_seed

    return check_seed(seed)
