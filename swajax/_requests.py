"""The engine's front: who receives each request's outputs, and messages from other threads.

Threading model (`docs/design.md`, "Requests and threads"):
- One thread at a time runs a step (the engine's step lock, held only inside a step: planning,
  dispatch, reading the previous step, routing its outputs). No lock is held while user code
  runs: not across a stream's `yield`, not while a callback runs.
- Every request has at most one consumer. A stream (`Engine.stream_requests`, `stream`, `run`)
  binds its requests; their outputs go to the stream's queue, whichever thread ran the step.
  The outputs of unbound requests (`add_request` with no stream) go to the next `step()`
  caller. Nothing is dropped: an output waits in its queue until its consumer takes it.
- A stream with nothing queued drives the engine itself: it runs the next step if no other
  thread is running one, else waits for that step's outputs. A suspended stream holds nothing
  but its queue; other callers go on.
- Adding and aborting are messages (`inbox`) applied in order at the start of the next step,
  or at once when no step is running. An abort ends the request with a final output
  (finished, finish_reason "abort", the tokens so far), which wakes its stream.

This module holds the shared state and its condition variable; the engine drives it.
"""

from __future__ import annotations

import collections
import dataclasses
import threading

from swajax._scheduler import Request


@dataclasses.dataclass(frozen=True)
class RequestOutput:
    """What a step produced for one request.

    new_token_ids: tokens since the request's previous output; token_ids: every generated
    token so far (a stop token included); finished: whether this is its last output;
    finish_reason: "stop" (a stop token), "length" (max_new_tokens), "abort" (`Engine.abort`,
    or its stream closed) or "error" (`error` says why: e.g. non-finite logits), None while it
    runs; cached_tokens: prompt tokens served from the prefix cache (not prefilled) at its
    latest admission.
    """

    request_id: int
    new_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    finished: bool
    finish_reason: str | None
    error: str | None = None
    cached_tokens: int = 0


@dataclasses.dataclass(eq=False)
class Stream:
    """One consumer's requests: those not yet finished, and their outputs not yet taken."""

    pending: set[int]
    queue: collections.deque = dataclasses.field(default_factory=collections.deque)


@dataclasses.dataclass(eq=False)
class Tracked:
    """A request from its arrival until its final output is routed."""

    request: Request
    arrival: float
    index: int  # its prompt index in a `run` (for recorded logits), else its id
    last: float | None = None  # when its previous token came
    stream: Stream | None = None


class Front:
    """The requests in the engine and the routing of their outputs (see the module text).
    Every method is called with `cond` held."""

    def __init__(self):
        self.cond = threading.Condition()
        self.tracked: dict[int, Tracked] = {}
        self.unclaimed: list[RequestOutput] = []  # for the next `step()` caller
        self.inbox: list[tuple[str, object]] = []  # ("add", Request) / ("abort", id)
        self.next_id = 0
        self.stepping = False  # a thread is running a step

    def issue_id(self) -> int:
        rid, self.next_id = self.next_id, self.next_id + 1
        return rid

    def bind(self, ids: list[int]) -> Stream:
        """A stream for these requests; ValueError for an id not in the engine (never issued,
        or finished and delivered) or one that already has a consumer. Outputs of these
        requests not yet taken by a `step()` caller move to the stream, so a request that
        finished (or was aborted) before its consumer came still reaches it."""
        undelivered = {o.request_id for o in self.unclaimed if o.finished}
        unknown = [i for i in ids if i not in self.tracked and i not in undelivered]
        if unknown:
            raise ValueError(f"request ids {unknown[:5]} are not queued or running")
        bound = [i for i in ids if i in self.tracked and self.tracked[i].stream is not None]
        if bound:
            raise ValueError(
                f"request ids {bound[:5]} already have a consumer (a stream): every request's "
                "outputs go to one consumer"
            )
        if len(set(ids)) != len(ids):
            raise ValueError(f"request ids {ids} repeat an id")
        stream = Stream(set(ids))
        for i in ids:
            if i in self.tracked:
                self.tracked[i].stream = stream
        keep = []
        for out in self.unclaimed:
            (stream.queue.append if out.request_id in stream.pending else keep.append)(out)
        self.unclaimed = keep
        for out in stream.queue:
            if out.finished:
                stream.pending.discard(out.request_id)
        return stream

    def unbind(self, stream: Stream) -> list[int]:
        """Detaches a stream that its consumer left; returns its unfinished request ids (to
        abort: nobody would read them)."""
        left = sorted(stream.pending)
        for i in left:
            t = self.tracked.get(i)
            if t is not None and t.stream is stream:
                t.stream = None
        stream.pending.clear()
        stream.queue.clear()
        return left

    def route(self, outputs: list[RequestOutput]) -> None:
        """Hands each output to its request's consumer; a finished request leaves the front."""
        for out in outputs:
            t = self.tracked.get(out.request_id)
            stream = None if t is None else t.stream
            if stream is None:
                self.unclaimed.append(out)
            else:
                stream.queue.append(out)
                if out.finished:
                    stream.pending.discard(out.request_id)
            if out.finished:
                self.tracked.pop(out.request_id, None)
        if outputs:
            self.cond.notify_all()

    def take_unclaimed(self) -> list[RequestOutput]:
        out, self.unclaimed = self.unclaimed, []
        return out


class Consumer:
    """The iterator `stream_requests` returns: the stream's generator, which also releases
    the stream (aborting its requests) when closed or dropped before its first `next`."""

    def __init__(self, engine, stream):
        self._engine, self._stream = engine, stream
        self._gen, self._started = engine._consume(stream), False

    def __iter__(self):
        return self

    def __next__(self) -> RequestOutput:
        self._started = True
        return next(self._gen)

    def close(self) -> None:
        if self._started:
            self._gen.close()
        elif self._stream is not None:
            self._engine._release(self._stream)
        self._stream = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
