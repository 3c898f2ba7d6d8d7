"""The request side of `Engine`: requests in (`add_request`, `abort`), outputs out (`step`'s,
streams, `run`, `stream`, `recording`).

`Engine` (`swajax._engine`) owns the pool, the step lock and the step (`_advance`: schedule ->
run -> postprocess); this mixin is what callers use on top of it. Requests are validated here
and queued in the front's inbox (`swajax._requests.Front`), which the step applies; a stream
drives the steps itself when no other thread does and holds no lock between its outputs. See
`swajax._requests` for who may call what.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence

import jax

from swajax import _validate
from swajax._budget import request_slots
from swajax._requests import Consumer, RequestOutput, Tracked
from swajax._sampling import SamplingParams, check_seed, request_key_data
from swajax._scheduler import Request
from swajax._stats import Recording, RunStats


class RequestAPI:
    """`Engine`'s request methods (a mixin over the engine's `_front`, `_step_lock`,
    `_advance`, `_apply_inbox`, `replicas`, `runner`, `pool`, `layout`, `config`)."""

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
        most = self.config.num_draft_tokens
        drafts = most if sampling.num_draft_tokens is None else sampling.num_draft_tokens
        if drafts > most:
            raise ValueError(
                f"num_draft_tokens={drafts} exceeds the engine's num_draft_tokens={most} "
                "(EngineConfig.num_draft_tokens bounds the drafted tokens of a step)"
            )
        return Request(
            id=-1,
            prompt=tuple(prompt),
            max_new_tokens=max_new_tokens,
            stop_token_ids=stop,
            sampling=sampling,
            key_data=key_data,
            num_draft_tokens=drafts,
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
        key = request_key_data(seed, None) if seed is not None else key_of_id
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

    def propose(self, tokens, k: int) -> list[int]:
        """The drafter protocol (`swajax._drafter.Drafter`): this engine's greedy continuation
        of `tokens`, k tokens (fewer where it stops or its context ends), so that an engine of
        a smaller model of the same tokenizer drafts for a larger one
        (`EngineConfig(drafter=draft_engine)`), in its own KV pool."""
        return self.propose_batch([(tokens, k)])[0]

    def propose_batch(self, requests) -> list[list[int]]:
        """`propose` for several (tokens, k) at once, in one run of this engine. Its prefix
        cache keeps each sequence between calls, so a call prefills only the tokens added
        since the last one (those past its last whole block)."""
        out: list[list[int]] = [[] for _ in requests]
        room = self.layout.max_context
        by_k: dict[int, list[tuple[int, list[int]]]] = {}
        for i, (tokens, k) in enumerate(requests):
            k = min(k, room - len(tokens))  # (what its context has room for)
            if k > 0:
                by_k.setdefault(k, []).append((i, list(tokens)))
        for k, asks in by_k.items():  # usually one run: every row asks for the same k
            outputs, _ = self.run([t for _, t in asks], k)
            for (i, _), o in zip(asks, outputs, strict=True):
                out[i] = list(o)
        return out

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
                for name in (
                    "preemptions",
                    "evictions",
                    "prefix_hits",
                    "prefix_tokens",
                    "draft_tokens",
                    "accepted_tokens",
                ):
                    setattr(stats, name, getattr(c, name) - getattr(rec.counters, name))
                self._recordings.remove(rec)
                self.runner.collect_logits = any(
                    r.stats.step_logits is not None for r in self._recordings
                )


def key_of_id(request_id: int):
    """A request's PRNG key data from its id (requests without a seed)."""
    return request_key_data(0, request_id)
