"""The engine: continuous batching of requests on one paged KV pool.

A request's path: `Engine.add_request` (validated, queued) -> `Scheduler.schedule` (pure
Python: admission, token budget, preemption, prefix parking; `swajax._scheduler`) ->
`ModelRunner.run` (one compiled step, state donated; `swajax._model_runner`) -> pool transforms
(`swajax._transforms`) -> the model's attention hook (`swajax._paged`) -> kernels
(`pallas_kernels`). The step's tokens come back through `Scheduler.update_from_output` and are
routed to the request's consumer (`swajax._requests`).

`Engine.step()` is schedule -> run -> postprocess: it plans and dispatches the next step, then
reads the step before it (the device always has the next step queued while the host reads
results and plans). `Engine.run`, `stream` and `stream_requests` consume streams that drive
the steps; `swajax.generate` is `run` on a kept engine. Several threads may share an engine:
see `swajax._requests` for who may call what.

Several devices (`EngineConfig.mesh`, see `swajax._sharding`): the parameters are split over
the mesh's "model" axis, the pool roots over KV heads; with a "data" axis each replica has its
own pool, ledger and scheduler (`swajax._replicas`), and one compiled step runs every replica.

Adaptive pool split (`KVCacheConfig(pool_ratio="adaptive")`, `swajax._budget.adaptive_split`):
the split of the byte quota across pool groups follows the requests queued. A split's slot
counts are static shapes of the compiled step, so a new split is a new layout (compiled once,
then shared); the pool is split anew only while no request runs (parked prefixes are dropped
with the old split), to the split that fits the most requests of the queue's mean length,
snapped to a coarse grid; every queued request fits the new split alone; the quota never
changes. `pool_ratio="online"` (`swajax._budget.OnlineRebalance`) re-splits between steps
instead, from the slot demand observed per group, with the running requests' pages moved into
the new split (`swajax._transforms.resize`).

Robustness: the donating step call defers SIGINT until the new state is held; an exception or
KeyboardInterrupt inside a stream aborts that stream's requests and frees their rows, so the
engine stays usable and leaks no slot (if the donated state itself was lost, the pool is
rebuilt and every request in the engine ends with an error output).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Sequence

import jax
from flax import nnx
from jax.sharding import NamedSharding

from swajax import _sharding, _validate
from swajax._budget import (
    OnlineRebalance,
    PoolSplit,
    kv_quota_bytes,
    plan_num_slots,
    request_slots,
)
from swajax._compilation_cache import enable_default_cache
from swajax._config import resolve_scratch_policy
from swajax._engine_config import EngineConfig
from swajax._layout import build_layout, with_num_slots
from swajax._model_runner import ModelRunner
from swajax._replicas import Replicas, make_scheduler
from swajax._requests import Consumer, Front, RequestOutput, Tracked
from swajax._sampling import SamplingParams, check_seed, request_key_data
from swajax._scheduler import FINISHED, Request, default_headroom
from swajax._stats import Recording, RunStats

__all__ = ["Engine", "RequestOutput", "RunStats", "make_scheduler"]


class Engine:
    """Serves requests on a paged KV pool.

    Args:
      model: a model with `config.layer_specs`, `config.vocab_size`, `config.max_context`
        and `forward(tokens, positions, *, attention_fn, attention_state, logits_indices)`
        (e.g. `gemma.Transformer`).
      config: an `EngineConfig`, or a `KVCacheConfig` (the EngineConfig's kv_cache), or None.
      **settings: fields of `EngineConfig` (max_context, max_batch, ...) replacing config's.

    A mesh needs a model with `partition_specs(tp)` (as `gemma.Transformer` has); its
    parameters are moved to their shardings, and with tp > 1 the model's
    `for_tensor_parallel(tp)` is what runs. The byte quota is then per device.

    Compiled steps are shared by every engine of the same model structure and layout, and
    JAX's persistent compilation cache is on by default (`swajax._compilation_cache`).
    """

    def __init__(self, model, config: EngineConfig | None = None, **settings):
        enable_default_cache()
        model_config = model.config
        cfg = EngineConfig.of(config, **settings).resolved(model_config.max_context)
        kv = cfg.kv_cache
        scratch = resolve_scratch_policy(
            kv,
            is_multimodal=getattr(model_config, "is_multimodal", False),
            has_external_kv_draft=getattr(model_config, "has_external_kv_draft", False),
        )
        mesh = None if cfg.mesh is None else _sharding.serving_mesh(cfg.mesh)
        dp, tp = (1, 1) if mesh is None else _sharding.mesh_sizes(mesh)
        if cfg.batch_invariant and dp > 1:
            raise ValueError(
                f"batch_invariant=True needs one data-parallel replica, got {dp}: one step runs "
                "every replica's plan, and each replica's scheduler picks its own step kind"
            )
        param_specs = None
        if mesh is not None:
            if not callable(getattr(model, "partition_specs", None)):
                raise TypeError(
                    f"a mesh needs a model with partition_specs(tp), got {type(model).__name__}"
                )
            param_specs = model.partition_specs(tp)  # ValueError for tp vs query heads
            if tp > 1 and callable(getattr(model, "for_tensor_parallel", None)):
                model = model.for_tensor_parallel(tp)  # how the model runs sharded
        self.config = cfg
        self.vocab_size = model_config.vocab_size
        rows = cfg.max_batch + cfg.prefix_cache_rows
        layout = build_layout(
            model_config.layer_specs,
            kv,
            max_context=cfg.max_context,
            max_batch=rows,
            max_chunk=cfg.prefill_chunk_size,
            num_slots=1,
            scratch=scratch,
            tp=tp,
            cache_rows=cfg.prefix_cache_rows,
        )
        # The quota is read once: a re-split pool must not see the old pool as used memory.
        quota = kv_quota_bytes(kv)
        online = None
        if kv.online_pool_ratio:
            online = OnlineRebalance(
                quota,
                ema=kv.rebalance_ema,
                threshold=kv.rebalance_threshold,
                cooldown=kv.rebalance_cooldown,
            )
        self.pool = PoolSplit(quota, kv.adaptive_pool_ratio, cfg.admission_headroom, online)
        layout = with_num_slots(layout, plan_num_slots(layout, kv, self.pool.quota))
        graphdef, params = nnx.split(model)
        if param_specs is not None:
            params = jax.device_put(
                params, jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs)
            )
        self.runner = ModelRunner(
            graphdef,
            params,
            layout,
            serving_rows=cfg.max_batch,
            max_num_tokens=cfg.max_num_tokens,
            min_prefill_bucket=cfg.min_prefill_bucket,
            max_shares=min(16, rows) if cfg.prefix_cache_rows else 0,
            implementation=cfg.implementation,
            mesh=mesh,
            num_replicas=dp,
        )
        self._front = Front()
        self._step_lock = threading.Lock()
        self._recordings: list[Recording] = []  # open `recording` blocks
        self._new_replicas()
        if cfg.precompile:
            self.runner.precompile()

    def _new_replicas(self) -> None:
        self.pool.headroom = default_headroom(self.num_slots, self.pool.fraction)
        self.replicas = Replicas(
            lambda: make_scheduler(
                self.layout,
                serving_rows=self.config.max_batch,
                max_num_tokens=self.config.max_num_tokens,
                chunk=self.config.prefill_chunk_size,
                headroom=self.pool.headroom,
                max_shares=self.runner.max_shares,
                batch_invariant=self.config.batch_invariant,
            ),
            self.runner.num_replicas,
        )

    # ------------------------------------------------------------------ properties

    layout = property(lambda self: self.runner.layout, doc="The pool layout (one replica's).")
    trace_count = property(lambda self: self.runner.trace_count)
    scheduler = property(lambda self: self.replicas.schedulers[0], doc="Replica 0's scheduler.")
    ledger = property(lambda self: self.scheduler.ledger, doc="Replica 0's slot ledger.")

    @property
    def state(self):
        """The pool state (device arrays, donated to every step)."""
        return self.runner.state

    @state.setter
    def state(self, value):
        self.runner.state = value

    @property
    def params(self):
        return self.runner.params

    @params.setter
    def params(self, value):
        self.runner.params = value

    @property
    def num_slots(self) -> tuple[int, ...]:
        """Slots per pool group of one replica's pool."""
        return tuple(g.num_slots for g in self.layout.groups)

    @property
    def has_unfinished_requests(self) -> bool:
        """Whether a request is unfinished or an output awaits a `step()` caller (outputs in a
        stream's queue belong to that stream)."""
        with self._front.cond:
            pending = bool(self._front.tracked or self._front.unclaimed or self._front.inbox)
        return pending or self.replicas.has_work

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
            self.layout,
            prompt_len,
            chunk=self.config.prefill_chunk_size,
            max_new_tokens=max_new_tokens - 1,
        )
        self.pool.check(self.layout, need, self.num_slots, prompt_len, max_new_tokens)

    def _make_request(self, prompt, max_new_tokens, sampling, stop_token_ids, key_data):
        max_new_tokens = _validate.positive_int("max_new_tokens", max_new_tokens)
        prompt = _validate.prompt(
            "prompt", prompt, self.vocab_size, self.layout.max_context, max_new_tokens
        )
        sampling = SamplingParams() if sampling is None else sampling
        if not isinstance(sampling, SamplingParams):
            raise ValueError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        stop = frozenset(_validate.token_ids("stop_token_ids", stop_token_ids, self.vocab_size))
        self.check_fits(len(prompt), max_new_tokens)
        return Request(
            id=-1,
            prompt=tuple(prompt),
            max_new_tokens=max_new_tokens,
            stop_token_ids=stop,
            sampling=sampling,
            key_data=key_data,
        )

    def _queue(self, requests: Sequence[Request], run_index: bool = False, into=None) -> list[int]:
        """Gives the requests ids and keys and posts them to the scheduler (their ids also
        added to the set `into`, under the same lock)."""
        now = time.perf_counter()
        with self._front.cond:
            for i, r in enumerate(requests):
                r.id = self._front.issue_id()
                if callable(r.key_data):  # a key from the request's own id
                    r.key_data = r.key_data(r.id)
                self._front.tracked[r.id] = Tracked(r, now, i if run_index else r.id)
                if into is not None:
                    into.add(r.id)
                self._front.inbox.append(("add", r))
        self._apply_inbox_if_idle()
        return [r.id for r in requests]

    def add_request(
        self,
        prompt,
        max_new_tokens: int,
        sampling: SamplingParams | None = None,
        stop_token_ids=(),
    ) -> int:
        """Queues one request; returns its id. Its outputs come from `step()`, or from
        `stream_requests([id])`. The request's PRNG key comes from `sampling.seed`, else from
        its id. ValueError (nothing queued) for a bad prompt or parameters, or a request that
        can never fit the pool."""
        seed = sampling.seed if isinstance(sampling, SamplingParams) else None
        key = request_key_data(seed, None) if seed is not None else _key_of_id
        r = self._make_request(prompt, max_new_tokens, sampling, stop_token_ids, key)
        return self._queue([r])[0]

    def abort(self, request_ids) -> None:
        """Ends these requests (one id or a sequence) at the next step, or now if no step is
        running: each gets a final output (finish_reason "abort", its tokens so far) and its
        rows are freed. Never waits for a step. ValueError for an id this engine never
        issued; a request that already finished is left alone."""
        ids = [request_ids] if _validate.is_int(request_ids) else request_ids
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence | set | frozenset):
            raise ValueError(f"request_ids must be an id or a sequence of ids, got {request_ids!r}")
        with self._front.cond:
            bad = [i for i in ids if not _validate.is_int(i) or not 0 <= i < self._front.next_id]
            if bad:
                raise ValueError(f"unknown request ids {list(bad)[:5]}")
            self._front.inbox += [("abort", int(i)) for i in ids if i in self._front.tracked]
        self._apply_inbox_if_idle()

    def _apply_inbox_if_idle(self) -> None:
        if self._step_lock.acquire(blocking=False):
            try:
                self._route(self._apply_inbox())
                self._flush_bookkeeping()
            finally:
                self._step_lock.release()

    def _apply_inbox(self) -> list[RequestOutput]:
        """Applies the queued adds and aborts in order (step lock held); returns the aborted
        requests' final outputs."""
        with self._front.cond:
            inbox, self._front.inbox = self._front.inbox, []
        outputs = []
        for kind, item in inbox:
            if kind == "add":
                self.replicas.add(item)
            else:
                outputs += [_final(r) for r in self.replicas.finish([item], "abort")]
        return outputs

    def adapt_pool(self, prompt_lengths: Sequence[int] | None = None, max_new_tokens: int = 1):
        """Applies the adaptive split policy now (for the queued requests, or for requests of
        `prompt_lengths` generating max_new_tokens each, e.g. before `precompile`); returns
        whether the pool was split anew (never while it is not idle). ValueError without
        pool_ratio="adaptive"."""
        if not self.pool.adaptive:
            raise ValueError(
                "adapt_pool needs KVCacheConfig(pool_ratio='adaptive' or 'online'), got pool_ratio="
                f"{self.config.kv_cache.pool_ratio!r}"
            )
        requests = None
        if prompt_lengths is not None:
            max_new_tokens = _validate.positive_int("max_new_tokens", max_new_tokens)
            requests = [
                (_validate.positive_int("prompt_lengths[i]", n), max_new_tokens)
                for n in prompt_lengths
            ]
            for n, k in requests:
                self.check_fits(n, k)
        with self._step_lock:
            self._route(self._apply_inbox())
            return self._adapt(requests)

    def _adapt(self, requests=None) -> bool:
        """Splits the idle pool anew for (prompt, max_new_tokens) pairs (default the queue)
        if the policy asks (step lock held)."""
        requests = self.replicas.waiting() if requests is None else requests
        if not requests or self.runner.in_flight is not None or not self.replicas.pool_idle:
            return False
        num_slots = self.pool.split(self.layout, requests, self.config)
        if num_slots is None or num_slots == self.num_slots:
            return False
        self.runner.set_layout(with_num_slots(self.layout, num_slots))
        self.pool.headroom = default_headroom(self.num_slots, self.pool.fraction)
        self.replicas.rebind(self.layout, self.pool.headroom)
        self._count_resplit()
        return True

    def _rebalance(self) -> list[RequestOutput]:
        """pool_ratio="online": the split the policy proposes from this step's slot demand,
        applied between steps with the running requests kept (the step in flight is read
        first; its outputs are returned). Skipped while the device lacks the room for both
        pools."""
        layout = self.pool.rebalanced(self.layout, *self.replicas.slot_demand())
        if layout is None or not self.runner.can_resize(layout):
            return []
        outputs = self._postprocess(self.runner.collect())
        self.runner.resize(layout)
        self.pool.headroom = default_headroom(self.num_slots, self.pool.fraction)
        self.replicas.resize(layout, self.pool.headroom)
        self.pool.online.resplit()
        self._count_resplit()
        return outputs

    def _count_resplit(self) -> None:
        for rec in self._recordings:
            rec.stats.num_slots = tuple(n * self.runner.num_replicas for n in self.num_slots)
            rec.stats.resplits += 1

    def clear_prefix_cache(self) -> None:
        """Drops every parked prefix, returning its slots (shared blocks stay with other rows)."""
        with self._step_lock:
            self.replicas.clear_cache()
            self._flush_bookkeeping()

    # ------------------------------------------------------------------ steps

    def step(self) -> list[RequestOutput]:
        """Runs one step (waiting for another thread's step to end first); returns the outputs
        of requests without a stream, those of this step and any left by streams' steps."""
        with self._step_lock:
            self._advance()
        with self._front.cond:
            return self._front.take_unclaimed()

    def _advance(self) -> None:
        """schedule -> run -> postprocess, the outputs routed (step lock held). On a failure
        the engine is left consistent (`_recover`) and the error raised."""
        with self._front.cond:
            self._front.stepping = True
        outputs = []
        try:
            outputs += self._apply_inbox()
            if self.pool.online is not None:
                if self.replicas.has_work:
                    outputs += self._rebalance()
            elif self.pool.adaptive and self.runner.in_flight is None:
                self._adapt()
            plans = self.replicas.schedule()
            if plans is None:
                if self.replicas.has_work and self.runner.in_flight is None:
                    raise RuntimeError(
                        "internal error: requests are queued but the scheduler planned no step"
                    )
                results = self.runner.collect()
            else:
                if any(p.new_tokens for p in plans):
                    for rec in self._recordings:
                        rec.stats.on_step(plans)
                results = self.runner.run(plans)
            outputs += self._postprocess(results)
        except BaseException:
            outputs += self._recover()
            raise
        finally:
            self._route(outputs)

    def _postprocess(self, results) -> list[RequestOutput]:
        """The tokens read back, recorded by each replica's scheduler, as outputs."""
        outputs, now = [], time.perf_counter()
        schedulers = self.replicas.schedulers
        for i, res in enumerate(results):  # one per replica, in order
            samples = res.plan.samples
            before = {row: len(r.output) for row, (r, _) in samples.items()}
            tokens = {row: int(res.next_tokens[row]) for row in samples}
            finite = {row: bool(res.finite[row]) for row in samples}
            scheduler = schedulers[i % len(schedulers)]
            changed = set(scheduler.update_from_output(res.plan, tokens, finite))
            for row, (r, _) in samples.items():
                if r not in changed:
                    continue
                with self._front.cond:
                    t = self._front.tracked.get(r.id)
                for rec in self._recordings:
                    if t is not None and (rec.ids is None or r.id in rec.ids):
                        rec.on_output(r, t, now, res.logits, row, before[row])
                if t is not None:
                    t.last = now
                finished = r.status == FINISHED
                new = tuple(r.output[before[row] :])
                outputs.append(
                    RequestOutput(
                        r.id,
                        new,
                        tuple(r.output),
                        finished,
                        r.finish_reason,
                        r.error,
                        r.prefix_hit_tokens,
                    )
                )
                if finished:
                    self.replicas.forget(r.id)
        return outputs

    def _route(self, outputs: list[RequestOutput]) -> None:
        with self._front.cond:
            self._front.stepping = False
            self._front.route(outputs)
            self._front.cond.notify_all()

    def _flush_bookkeeping(self) -> None:
        """Frees on the device now the rows the schedulers released outside a step."""
        plans = self.replicas.bookkeeping()
        if plans is not None:
            self.runner.bookkeeping(plans)

    def _recover(self) -> list[RequestOutput]:
        """After a failed step: if the donated state is gone, a fresh pool and every request
        ended with an error; else the step in flight read (or dropped). Returns the outputs."""
        if self.runner.state_lost:
            self.runner.set_layout(self.layout)
            with self._front.cond:
                lost = [t.request for t in self._front.tracked.values()]
                self._front.inbox = []
            self._new_replicas()
            for r in lost:
                r.status, r.finish_reason = FINISHED, "error"
                r.error = "the step failed and its pool state was lost; the pool was rebuilt"
            return [_final(r) for r in lost]
        try:
            return self._postprocess(self.runner.collect())
        except Exception:  # noqa: BLE001 - the step itself failed; its state is still held
            self.runner.in_flight = None
            return []

    # ------------------------------------------------------------------ streams

    def stream_requests(self, request_ids) -> Iterator[RequestOutput]:
        """Yields the outputs of these requests (from `add_request`) as they come, until all
        have finished, driving the steps when no other thread does. Holds no lock between
        outputs. Closing the iterator (or dropping it), or an exception in it, aborts its
        unfinished requests. ValueError (at this call, nothing run) for an id not in the
        engine or one that already has a consumer."""
        ids = [request_ids] if _validate.is_int(request_ids) else list(request_ids)
        with self._front.cond:
            stream = self._front.bind(ids)
        return Consumer(self, stream)

    def _consume(self, stream) -> Iterator[RequestOutput]:
        front = self._front
        try:
            while True:
                with front.cond:
                    if stream.queue:
                        out = stream.queue.popleft()
                    elif not stream.pending:
                        settle = not front.tracked and not front.inbox
                        break
                    elif front.stepping:  # another thread's step will route to us
                        front.cond.wait_for(lambda: stream.queue or not front.stepping, 0.5)
                        continue
                    else:
                        out = None
                if out is not None:
                    yield out
                elif self._step_lock.acquire(blocking=False):
                    try:
                        self._advance()
                    finally:
                        self._step_lock.release()
                else:  # the lock is held outside a step (an abort, a recording): brief
                    with front.cond:
                        front.cond.wait(0.005)
            # The last request of the engine is done: one more step returns the rows it
            # finished in (their release is planned with the next step), leaving it idle.
            if settle and self.replicas.has_work and self._step_lock.acquire(blocking=False):
                try:
                    self._advance()
                finally:
                    self._step_lock.release()
        finally:
            self._release(stream)

    def _release(self, stream) -> None:
        """A stream's consumer left: its unfinished requests are aborted."""
        with self._front.cond:
            left = self._front.unbind(stream)
            self._front.inbox += [("abort", i) for i in left if i in self._front.tracked]
        if left:
            self._apply_inbox_if_idle()

    def _new_requests(self, prompts, max_new_tokens, sampling, seed, stop_token_ids):
        max_new_tokens = _validate.positive_int("max_new_tokens", max_new_tokens)
        prompts = _validate.prompts(
            prompts, self.vocab_size, self.layout.max_context, max_new_tokens
        )
        seed = check_seed(seed)
        sampling = sampling or SamplingParams()
        seed = sampling.seed if sampling.seed is not None else seed
        return [
            self._make_request(
                p, max_new_tokens, sampling, stop_token_ids, request_key_data(seed, i)
            )
            for i, p in enumerate(prompts)
        ]

    def stream(
        self,
        prompts,
        max_new_tokens: int,
        *,
        sampling: SamplingParams | None = None,
        seed: int = 0,
        stop_token_ids=(),
    ) -> Iterator[tuple[int, RequestOutput]]:
        """Yields (prompt index, output) as tokens come, until every prompt has finished;
        prompt i's PRNG key comes from (sampling.seed or seed, i). The prompts are checked
        and queued at the first `next`."""
        requests = self._new_requests(prompts, max_new_tokens, sampling, seed, stop_token_ids)
        ids = self._queue(requests, run_index=True)
        index = {rid: i for i, rid in enumerate(ids)}
        with contextlib.closing(self.stream_requests(ids)) as outputs:
            for out in outputs:
                yield index[out.request_id], out

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
        callback(prompt index, RequestOutput), if given, sees every output as it comes (no lock
        is held: it may call `abort`).
        """
        requests = self._new_requests(prompts, max_new_tokens, sampling, seed, stop_token_ids)
        outputs: list[list[int]] = [[] for _ in requests]
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(requests) * max_new_tokens, unit="tok", desc="generate")
        try:
            own: set[int] = set()
            with self._record(collect_logits, own) as stats:
                ids = self._queue(requests, run_index=True, into=own)
                index = {rid: i for i, rid in enumerate(ids)}
                with contextlib.closing(self.stream_requests(ids)) as request_outputs:
                    for out in request_outputs:
                        i = index[out.request_id]
                        outputs[i] = list(out.token_ids)
                        if bar is not None:
                            bar.update(len(out.new_token_ids))
                        if callback is not None:
                            callback(i, out)
                with self._step_lock:  # no other thread's step donates the state meanwhile
                    jax.block_until_ready(self.runner.state)
        finally:
            if bar is not None:
                bar.close()
        return outputs, stats

    @contextlib.contextmanager
    def recording(self, *, collect_logits: bool = False) -> Iterator[RunStats]:
        """Records the steps run inside the block (by any thread) into the `RunStats` it
        yields (seconds: the block's wall time); blocks may overlap (each `run` records its
        own requests' tokens, every open block the steps)."""
        with self._record(collect_logits, None) as stats:
            yield stats

    @contextlib.contextmanager
    def _record(self, collect_logits: bool, ids: set | None):
        stats = RunStats(num_slots=tuple(n * self.runner.num_replicas for n in self.num_slots))
        stats.peak_slots = stats.slot_steps = (0,) * len(self.num_slots)
        stats.step_logits = [] if collect_logits else None
        with self._step_lock:
            rec = Recording(stats, ids, self.replicas.counters())
            self._recordings.append(rec)
            self.runner.collect_logits = any(
                r.stats.step_logits is not None for r in self._recordings
            )
        t0 = time.perf_counter()
        try:
            yield stats
        finally:
            with self._step_lock:
                stats.seconds = time.perf_counter() - t0
                c = self.replicas.counters()
                for name in ("preemptions", "evictions", "prefix_hits", "prefix_tokens"):
                    setattr(stats, name, getattr(c, name) - getattr(rec.counters, name))
                self._recordings.remove(rec)
                self.runner.collect_logits = any(
                    r.stats.step_logits is not None for r in self._recordings
                )

    # ------------------------------------------------------------------ compilation

    def step_buckets(self) -> list[tuple[int, bool]]:
        """Every (token bucket, decode) step shape this engine can run."""
        return self.runner.step_shapes()

    def precompile(self, modes=("greedy",)) -> None:
        """Compiles every step shape of `step_buckets` for the sampling modes, in threads."""
        self.runner.precompile(modes)

    def lower_step(self, num_tokens: int, *, decode: bool, lowering_platforms=None):
        """The `jax.stages.Lowered` greedy step for a token bucket, for HLO and memory
        inspection. lowering_platforms: e.g. ("cuda",) to lower for a GPU on a machine without
        one (with `pallas_kernels._checks.force_compiled()` for the Mosaic GPU kernels)."""
        return self.runner.lower(num_tokens, decode, lowering_platforms=lowering_platforms)


def _key_of_id(request_id: int):
    """A request's PRNG key data from its id (requests without a seed)."""
    return request_key_data(0, request_id)


def _final(r: Request) -> RequestOutput:
    """The last output of a finished request (no new tokens)."""
    return RequestOutput(
        r.id, (), tuple(r.output), True, r.finish_reason, r.error, r.prefix_hit_tokens
    )
