"""The data-parallel replicas' schedulers, seen as one.

Without a mesh (or with one "data" replica) there is one scheduler. With dp replicas each has
its own pool, slot ledger and scheduler; a request goes to the replica holding the fewest
requests, and one compiled step runs every replica's plan (an idle replica runs an empty one).
Pure Python, like the schedulers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from pallas_kernels.paged_attention import PREFILL_QUERY_TILE
from swajax._ledger import SlotLedger
from swajax._scheduler import Request, Scheduler, SchedulerCounters, StepPlan


class Replicas:
    """`count` schedulers made by `make()` (each over a fresh ledger)."""

    def __init__(self, make: Callable[[], Scheduler], count: int):
        self.schedulers = [make() for _ in range(count)]
        self._replica_of: dict[int, int] = {}  # request id -> replica

    def __len__(self) -> int:
        return len(self.schedulers)

    def add(self, request: Request) -> None:
        i = min(range(len(self.schedulers)), key=lambda i: len(self.schedulers[i].requests))
        self.schedulers[i].add(request)
        self._replica_of[request.id] = i

    def of(self, request_id: int) -> Scheduler:
        return self.schedulers[self._replica_of.get(request_id, 0)]

    def get(self, request_id: int) -> Request | None:
        return self.of(request_id).requests.get(request_id)

    def finish(self, request_ids: Sequence[int], reason: str) -> list[Request]:
        """Finishes these requests where they stand (abort, error); their rows are freed next
        step. Returns the requests (those still known)."""
        done = []
        for i in request_ids:
            r = self.get(i)
            if r is None:
                continue
            self.of(i).abort([i], reason)
            self._replica_of.pop(i, None)
            done.append(r)
        return done

    def forget(self, request_id: int) -> None:
        """Drops a finished request (its outputs have all been produced)."""
        self.of(request_id).requests.pop(request_id, None)
        self._replica_of.pop(request_id, None)

    @property
    def has_work(self) -> bool:
        return any(s.has_work for s in self.schedulers)

    @property
    def awaits_tokens(self) -> bool:
        return any(s.awaits_tokens for s in self.schedulers)

    @property
    def pool_idle(self) -> bool:
        return all(s.pool_idle for s in self.schedulers)

    def waiting(self) -> list[tuple[int, int]]:
        """(prompt tokens, max_new_tokens) of every queued request."""
        return [(len(r.prompt), r.max_new_tokens) for s in self.schedulers for r in s.waiting]

    def counters(self) -> SchedulerCounters:
        """The schedulers' counters, summed."""
        return SchedulerCounters(
            **{
                f.name: sum(getattr(s.counters, f.name) for s in self.schedulers)
                for f in dataclasses.fields(SchedulerCounters)
            }
        )

    def schedule(self) -> list[StepPlan] | None:
        """Every replica's next plan (an idle replica's empty one), or None when no replica has
        anything to run or free."""
        plans = [s.schedule() if s.has_work else None for s in self.schedulers]
        if all(p is None for p in plans):
            return None
        return self._full(plans)

    def bookkeeping(self) -> list[StepPlan] | None:
        """The frees of aborted requests and the releases of cleared cached blocks of every
        replica, or None."""
        plans = [s.bookkeeping_plan() for s in self.schedulers]
        return None if all(p is None for p in plans) else self._full(plans)

    def _full(self, plans) -> list[StepPlan]:
        return [
            StepPlan(s._steps, {}, {}, {}, used=s.ledger.used()) if p is None else p
            for s, p in zip(self.schedulers, plans, strict=True)
        ]

    def rebind(self, layout, headroom) -> None:
        """Every scheduler onto a fresh ledger of `layout` (an idle pool split anew)."""
        for s in self.schedulers:
            s.rebind(SlotLedger(layout), headroom)

    def slot_demand(self) -> tuple[list[int], list[int], bool]:
        """`Scheduler.slot_demand` over the replicas: demand summed, minimum the largest
        (every replica's pool has the one layout), force if any replica's."""
        parts = [s.slot_demand() for s in self.schedulers]
        demand = [sum(d) for d in zip(*(p[0] for p in parts), strict=True)]
        minimum = [max(m) for m in zip(*(p[1] for p in parts), strict=True)]
        return demand, minimum, any(p[2] for p in parts)

    def resize(self, layout, headroom) -> None:
        """Every scheduler onto its pool split anew, requests kept (`Scheduler.resize`)."""
        for s in self.schedulers:
            s.resize(layout, headroom)

    def clear_cache(self) -> None:
        for s in self.schedulers:
            s.clear_cache()


def make_scheduler(
    layout,
    *,
    max_num_tokens: int,
    chunk: int,
    headroom,
    max_cache_ops: int = 0,
    batch_invariant: bool = False,
    drafter=None,
) -> Scheduler:
    """The engine's scheduler over a fresh `SlotLedger` of `layout` (also what a host-only
    simulation of the engine plans with): mixed steps, or with `batch_invariant` one kind of
    rows per step and chunks cut only at multiples of `PREFILL_QUERY_TILE`."""
    return Scheduler(
        SlotLedger(layout),
        max_num_tokens=max_num_tokens,
        chunk=chunk,
        headroom=headroom,
        max_cache_ops=max_cache_ops,
        mixed_steps=not batch_invariant,
        cut_align=PREFILL_QUERY_TILE if batch_invariant else 0,
        drafter=drafter,
    )
