"""The engine: continuous batching of requests on one paged KV pool.

A request's path: `Engine.add_request` (validated, queued) -> `Scheduler.schedule` (pure
Python: admission, token budget, preemption, prefix parking; `swajax._scheduler`) ->
`ModelRunner.run` (one compiled step, state donated; `swajax._model_runner`) -> pool transforms
(`swajax._transforms`) -> the model's attention hook (`swajax._paged`) -> kernels
(`pallas_kernels`). The step's tokens come back through `Scheduler.update_from_output` and are
routed to the request's consumer (`swajax._requests`).

`Engine.step()` is schedule -> run -> postprocess: it plans and dispatches the next step, then
reads the step before it (the device always has the next step queued while the host reads
results and plans). The request side (`add_request`, `abort`, `run`, `stream`,
`stream_requests`, `recording`) is the `RequestAPI` mixin of `swajax._request_api`; streams
drive the steps; `swajax.generate` is `run` on a kept engine. Several threads may share an
engine: see `swajax._requests` for who may call what.

Several devices (`EngineConfig.mesh`, see `swajax._sharding`): the parameters are split over
the mesh's "model" axis, the pool roots over KV heads; with a "data" axis each replica has its
own pool, ledger and scheduler (`swajax._replicas`), and one compiled step runs every replica.

Adaptive pool split (`KVCacheConfig(pool_ratio="adaptive")`, `swajax._budget.adaptive_split`):
the split of the byte quota across pool groups follows the requests queued. A split's slot
counts are static shapes of the compiled step, so a new split is a new layout (compiled once,
then shared); the pool is split anew only while no request runs (cached blocks are dropped
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

import dataclasses
import threading
import time
from collections.abc import Sequence

import jax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from swajax import _sharding, _validate
from swajax._budget import (
    PoolSplit,
    plan_num_slots,
    prefix_cache_nodes,
)
from swajax._compilation_cache import enable_default_cache
from swajax._config import resolve_scratch_policy
from swajax._drafter import NgramDrafter, is_in_step
from swajax._engine_config import EngineConfig
from swajax._layout import build_layout, with_num_slots
from swajax._model_runner import ModelRunner
from swajax._replicas import Replicas, make_scheduler
from swajax._request_api import RequestAPI
from swajax._requests import Front, RequestOutput
from swajax._scheduler import FINISHED, Request, default_headroom
from swajax._stats import Recording, RunStats

__all__ = ["Engine", "RequestOutput", "RunStats", "make_scheduler"]


class Engine(RequestAPI):
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
        in_step = cfg.num_draft_tokens > 0 and is_in_step(cfg.drafter)
        scratch = resolve_scratch_policy(
            kv,
            is_multimodal=getattr(model_config, "is_multimodal", False),
            has_external_kv_draft=getattr(model_config, "has_external_kv_draft", False) or in_step,
        )
        mesh = None if cfg.mesh is None else _sharding.serving_mesh(cfg.mesh)
        dp, tp = (1, 1) if mesh is None else _sharding.mesh_sizes(mesh)
        assistant = None
        if in_step:
            sources = cfg.drafter.config.sources(model_config)  # ValueError if it does not fit
            if tp > 1:
                raise ValueError(
                    f"a Gemma 4 assistant drafter runs on one device or data-parallel replicas, "
                    f"not under tensor parallelism (the mesh's model axis is {tp})"
                )
            a_graphdef, a_params = nnx.split(cfg.drafter)
            if mesh is not None:
                a_params = jax.device_put(a_params, NamedSharding(mesh, PartitionSpec()))
            assistant = (a_graphdef, a_params, sources)
        if cfg.batch_invariant and dp > 1:
            raise ValueError(
                f"batch_invariant=True needs one data-parallel replica, got {dp}: one step runs "
                "every replica's plan, and each replica's scheduler picks its own step kind"
            )
        model, param_shardings = _sharding.model_on_mesh(model, mesh)
        self.config = cfg
        self.vocab_size = model_config.vocab_size
        layout = build_layout(
            model_config.layer_specs,
            kv,
            max_context=cfg.max_context,
            max_batch=cfg.max_batch,
            max_chunk=cfg.prefill_chunk_size,
            num_slots=1,
            scratch=scratch,
            tp=tp,
        )
        if cfg.enable_prefix_caching:
            layout = dataclasses.replace(layout, cache_nodes=prefix_cache_nodes(layout))
        self.pool = PoolSplit.of(kv, cfg.admission_headroom)
        layout = with_num_slots(layout, plan_num_slots(layout, kv, self.pool.quota))
        graphdef, params = nnx.split(model)
        if param_shardings is not None:
            params = jax.device_put(params, param_shardings)
        self.runner = ModelRunner(
            graphdef,
            params,
            layout,
            max_num_tokens=cfg.max_num_tokens,
            min_prefill_bucket=cfg.min_prefill_bucket,
            max_cache_ops=min(16, cfg.max_batch) if cfg.enable_prefix_caching else 0,
            draft_tokens=cfg.num_draft_tokens,
            assistant=assistant,
            implementation=cfg.implementation,
            mesh=mesh,
            num_replicas=dp,
        )
        self._drafter = None
        if cfg.num_draft_tokens:
            ngram = isinstance(cfg.drafter, str) and cfg.drafter == "ngram"
            self._drafter = NgramDrafter() if ngram else cfg.drafter
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
                max_num_tokens=self.config.max_num_tokens,
                chunk=self.config.prefill_chunk_size,
                headroom=self.pool.headroom,
                max_cache_ops=self.runner.max_cache_ops,
                batch_invariant=self.config.batch_invariant,
                drafter=self._drafter,
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
        """Drops every cached block, returning its slot (blocks rows read stay with them)."""
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
            if self.replicas.awaits_tokens and self.runner.in_flight is not None:
                # a speculating request's drafts follow its last token: read it first
                outputs += self._postprocess(self.runner.collect())
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
            tokens = {row: res.tokens(row) for row in samples}
            finite = {row: bool(res.finite[row]) for row in samples}
            proposals = None
            if res.proposals is not None:
                proposals = {row: [int(t) for t in res.proposals[row]] for row in samples}
            scheduler = schedulers[i % len(schedulers)]
            changed = set(scheduler.update_from_output(res.plan, tokens, finite, proposals))
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
        while (plans := self.replicas.bookkeeping()) is not None:
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


def _final(r: Request) -> RequestOutput:
    """The last output of a finished request (no new tokens)."""
    return RequestOutput(
        r.id, (), tuple(r.output), True, r.finish_reason, r.error, r.prefix_hit_tokens
    )
