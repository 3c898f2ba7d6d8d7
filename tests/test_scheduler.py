"""The scheduler's policy on a toy slot ledger (no model, no device arrays).

`ToyLedger` holds one block per `page_size` tokens of each row, in one pool group, and
releases nothing: a request's slots are ceil(length / page_size), so every figure below can be
computed by hand. The drivers play the engine: plan a step, then hand back a token for every
sampling row (right away, or one step late as the pipelined engine does).
"""

from __future__ import annotations

import dataclasses
import math

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from swajax._scheduler import FINISHED, Adopt, Park, Request, Scheduler, StepPlan

PAGE = 4


@dataclasses.dataclass(frozen=True)
class _Layout:
    page_size: int
    max_batch: int
    cache_nodes: int = 0
    cache_releases: int = 0


class ToyLedger:
    """One pool group; a row holds ceil(history / page_size) blocks (block offset -> id); the
    prefix cache names blocks by node (node -> id), one reference each."""

    def __init__(self, num_slots: int, rows: int, cache_nodes: int = 0):
        self.layout = _Layout(PAGE, rows, cache_nodes, 8 if cache_nodes else 0)
        self.num_slots = num_slots
        self.free = [num_slots]
        self.history = [0] * rows
        self.blocks = [{} for _ in range(rows)]  # offset -> block id (shared ids count once)
        self.cached: dict[int, int] = {}  # node -> block id
        self.refs: dict = {}
        self._next = 0

    def used(self):
        return (self.num_slots - self.free[0],)

    def row_slots(self, row):
        return (len(self.blocks[row]),)

    def prefill_peak(self, length, chunk):
        return (math.ceil(length / PAGE),)  # nothing is released

    def is_empty(self, row):
        return self.history[row] == 0 and not self.blocks[row]

    def slots_needed(self, new_tokens):
        total = 0
        for b, n in new_tokens.items():
            if n < 0:
                return None
            total += math.ceil((self.history[b] + n) / PAGE) - len(self.blocks[b])
        return (total,)

    def reserve(self, new_tokens):
        need = self.slots_needed(new_tokens)
        if need is None or need[0] > self.free[0]:
            return False
        for b, n in new_tokens.items():
            for o in range(len(self.blocks[b]), math.ceil((self.history[b] + n) / PAGE)):
                self.blocks[b][o] = self._next
                self.refs[self._next] = 1
                self._next += 1
            self.history[b] += n
        self.free[0] -= need[0]
        return True

    def advance(self):
        pass

    def _drop(self, block_id):
        self.refs[block_id] -= 1
        if self.refs[block_id] == 0:
            self.free[0] += 1

    def free_rows(self, rows):
        for b in rows:
            for i in self.blocks[b].values():
                self._drop(i)
            self.blocks[b] = {}
            self.history[b] = 0

    def park(self, row, k, nodes):
        masks = []
        for o in range(k // PAGE):
            block_id = self.blocks[row].get(o)
            if nodes[o] < 0 or block_id is None or nodes[o] in self.cached:
                masks.append(0)
                continue
            self.cached[nodes[o]] = block_id
            self.refs[block_id] += 1
            masks.append(1)
        return masks

    def can_adopt(self, k, nodes):  # every block of a row is kept (no sliding layers)
        return all(o < len(nodes) and nodes[o] in self.cached for o in range(k // PAGE))

    def adopt(self, row, k, nodes):
        if not self.is_empty(row) or not self.can_adopt(k, nodes):
            return False
        for o in range(k // PAGE):
            self.blocks[row][o] = self.cached[nodes[o]]
            self.refs[self.cached[nodes[o]]] += 1
        self.history[row] = k
        return True

    def release_cached(self, node):
        if node in self.cached:
            self._drop(self.cached.pop(node))

    def cached_groups(self, node):
        return int(node in self.cached)

    def frees_of(self, node):
        return int(node in self.cached and self.refs[self.cached[node]] == 1)

    def cache_only_slots(self):
        return (sum(1 for i in self.cached.values() if self.refs[i] == 1),)


def make(
    num_slots=100,
    rows=4,
    budget=64,
    chunk=32,
    headroom=0,
    cache=False,
    mixed_steps=True,
    cut_align=0,
):
    ledger = ToyLedger(num_slots, rows, cache_nodes=64 if cache else 0)
    return Scheduler(
        ledger,
        max_num_tokens=budget,
        chunk=chunk,
        headroom=(headroom,),
        max_cache_ops=4 if cache else 0,
        mixed_steps=mixed_steps,
        cut_align=cut_align,
    )


def req(i, n, new, stop=()):
    return Request(
        id=i, prompt=tuple(range(1, n + 1)), max_new_tokens=new, stop_token_ids=frozenset(stop)
    )


def drive(s, *, token=lambda r, k: 1000 + k, pipelined=False, max_steps=10_000):
    """Runs the scheduler to the end; returns the plans."""
    plans, previous = [], None
    for _ in range(max_steps):
        plan = s.schedule() if s.has_work else None
        if pipelined and previous is not None:
            s.update_from_output(
                previous, {row: token(r, k) for row, (r, k) in previous.samples.items()}
            )
        if plan is None:
            if previous is None and not s.has_work:
                return plans
            previous = None
            continue
        plans.append(plan)
        if pipelined:
            previous = plan
        else:
            s.update_from_output(plan, {row: token(r, k) for row, (r, k) in plan.samples.items()})
    raise AssertionError("the scheduler did not finish")


def test_decode_rows_first_then_prefill_fills_the_budget():
    s = make(budget=10, chunk=32)
    for i in range(3):
        s.add(req(i, 2, 5))
    s.schedule()  # three 2-token prefills
    s.add(req(3, 40, 2))
    plan = s.schedule()
    assert [plan.new_tokens[r] for r in range(3)] == [1, 1, 1]  # the decodes first
    assert plan.new_tokens[3] == 7  # the rest of the budget: a chunk cut to fit
    assert plan.num_tokens == 10


def test_budget_smaller_than_a_chunk_takes_several_steps():
    s = make(budget=5, chunk=32)
    s.add(req(0, 23, 1))
    plans = drive(s)
    assert [p.new_tokens[0] for p in plans if p.new_tokens] == [5, 5, 5, 5, 3]
    assert plans[-1].free_a == [0] and not plans[-1].new_tokens  # the row goes back
    assert s.requests[0].output == [1000]


def test_admission_is_on_demand_not_lifetime_peak():
    """Each request needs 3 blocks after its prefill (10 tokens) and 4 at its peak (2 + 3 new
    tokens reach 13): 10 slots hold 3 requests at once by their next step, not 2."""
    s = make(num_slots=10, rows=4, budget=64, chunk=64)
    for i in range(4):
        s.add(req(i, 10, 4))
    first = s.schedule()
    assert sorted(first.new_tokens) == [0, 1, 2]  # 3 x 3 slots, a fourth would need 12


def test_preemption_takes_the_newest_and_requeues_it_first():
    s = make(num_slots=6, rows=3, budget=64, chunk=64)
    for i in range(3):
        s.add(req(i, 4, 8))  # one block each after the prefill; decode grows a block per 4
    plans = drive(s)
    preempted = [r for r in s.requests.values() if r.preemptions]
    assert s.counters.preemptions >= 1
    assert all(r.id == 2 or r.id == 1 for r in preempted)  # never the oldest
    assert s.requests[0].preemptions == 0
    for r in s.requests.values():
        assert r.status == FINISHED and r.output == [1000 + k for k in range(8)]
    assert s.ledger.free == [6]
    assert sum(len(p.free_a) for p in plans) >= 3 + s.counters.preemptions


def test_a_long_prompt_is_admitted_only_when_its_whole_prefill_fits():
    """Two 32-token prompts prefilled in 8-token chunks need 8 blocks each by the end of their
    prefill; 12 slots hold one. Admitting the second on its first chunk alone would let the two
    prefills grow into each other and preempt each other; it waits for the first instead."""
    s = make(num_slots=12, rows=2, budget=16, chunk=8)
    s.add(req(0, 32, 2))
    s.add(req(1, 32, 2))
    first = s.schedule()
    assert list(first.new_tokens) == [0]  # the second's 8 blocks do not fit beside the first's
    s.update_from_output(first, {})
    drive(s)
    assert s.counters.preemptions == 0
    for r in s.requests.values():
        assert r.status == FINISHED and r.output == [1000, 1001]
    assert s.ledger.free == [12]


def test_fifo_admission_does_not_starve_a_long_request():
    """A long request at the head waits for room; shorter later ones never overtake it."""
    s = make(num_slots=12, rows=4, budget=64, chunk=64)
    s.add(req(0, 30, 4))  # 9 blocks at its peak
    s.add(req(1, 30, 4))
    for i in range(2, 8):
        s.add(req(i, 2, 2))
    order = []
    while s.has_work:
        plan = s.schedule()
        for row in sorted(plan.new_tokens):
            if s.rows[row].id not in order:
                order.append(s.rows[row].id)
        s.update_from_output(plan, {row: 1000 + k for row, (r, k) in plan.samples.items()})
    assert order == list(range(8))  # first scheduled in arrival order
    assert all(r.status == FINISHED for r in s.requests.values())


def test_stop_token_ends_a_request_one_step_late_when_pipelined():
    s = make(budget=64)
    s.add(req(0, 3, 10, stop=(1002,)))
    s.add(req(1, 3, 4))
    drive(s, pipelined=True)
    a, b = s.requests[0], s.requests[1]
    assert a.output == [1000, 1001, 1002] and a.finish_reason == "stop"
    assert b.output == [1000, 1001, 1002, 1003] and b.finish_reason == "length"
    assert s.ledger.free == [100]


def test_pipelined_decode_feeds_the_previous_sample():
    s = make(budget=64)
    s.add(req(0, 3, 3))
    plans = drive(s, pipelined=True)
    assert plans[0].tokens[0] == [1, 2, 3]
    assert plans[1].tokens[0] == [None]  # the token drawn by the step before, on the device
    assert s.requests[0].output == [1000, 1001, 1002]


def test_prefix_cache_parks_finished_history_and_next_turn_hits():
    s = make(budget=64, cache=True)
    s.add(req(0, 10, 7))  # history 10 + 6 = 16 tokens = 4 blocks when it finishes
    drive(s)
    turn2 = Request(
        id=1,
        prompt=tuple(range(1, 11)) + tuple(1000 + k for k in range(7)) + (9,),
        max_new_tokens=2,
    )
    s.add(turn2)
    plans = drive(s)
    assert s.counters.prefix_hits == 1 and s.counters.prefix_tokens == 16
    assert plans[0].adopt == [Adopt(0, 16, [0, 1, 2, 3])] and plans[0].new_tokens[0] == 18 - 16


@settings(max_examples=200, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=10),
    new=st.lists(st.integers(1, 12), min_size=10, max_size=10),
    budget=st.integers(1, 64),
    chunk=st.integers(1, 48),
    slots=st.integers(13, 40),
    rows=st.integers(1, 5),
    pipelined=st.booleans(),
    cache=st.sampled_from([False, False, True]),
)
def test_every_request_finishes_and_no_slot_leaks(
    lengths, new, budget, chunk, slots, rows, pipelined, cache
):
    s = make(num_slots=slots, rows=rows, budget=budget, chunk=chunk, cache=cache)
    for i, n in enumerate(lengths):
        s.add(req(i, n, new[i]))
    drive(s, pipelined=pipelined)
    for i in range(len(lengths)):
        r = s.requests[i]
        assert r.status == FINISHED and r.output == [1000 + k for k in range(new[i])], i
    s.clear_cache()
    assert s.ledger.free == [slots]


# ------------------------------------------------------------------ without mixed steps


@dataclasses.dataclass
class Step:
    """One planned step: the requests it feeds their one token after the prompt (`decode`),
    those it feeds prompt tokens (`prefill`), and whether a request was decoding when it was
    planned (`decoding`)."""

    plan: StepPlan
    decode: set[int]
    prefill: set[int]
    decoding: bool
    # request id -> (tokens fed before the step, tokens it feeds, row) of the rows it feeds
    before: dict = dataclasses.field(default_factory=dict)


def drive_steps(s, arrivals, *, pipelined=False, max_steps=10_000):
    """`drive` with requests arriving: arrivals[k] are queued before step k. Returns a `Step`
    per plan, its rows sorted by what they did when it was planned."""
    steps, previous, last_arrival = [], None, max(arrivals, default=0)
    for k in range(max_steps):
        for r in arrivals.get(k, ()):
            s.add(r)
        remaining = {
            r.id: r.length - r.fed for r in s.running if r.num_generated < r.max_new_tokens
        }
        plan = s.schedule() if s.has_work else None
        if plan is not None:
            ids = {s.rows[row].id for row in plan.new_tokens}
            decode = {i for i in ids if remaining.get(i) == 1}
            before = {
                s.rows[row].id: (s.rows[row].fed - n, n, row) for row, n in plan.new_tokens.items()
            }
            steps.append(Step(plan, decode, ids - decode, 1 in remaining.values(), before))
        if pipelined and previous is not None:
            s.update_from_output(
                previous, {row: 1000 + i for row, (r, i) in previous.samples.items()}
            )
        if plan is None:
            if previous is None and not s.has_work and k >= last_arrival:
                return steps
            previous = None
            continue
        if pipelined:
            previous = plan
        else:
            s.update_from_output(plan, {row: 1000 + i for row, (r, i) in plan.samples.items()})
    raise AssertionError("the scheduler did not finish")


def check_whole_chunks(s, steps):
    """Every prefill row of every step feeds a whole chunk: it starts at a multiple of the
    chunk and takes the chunk, or less only where its prefill ends (it samples this step);
    never cut by the budget or the free slots, so where a prompt's chunks fall does not depend
    on the other rows."""
    for i, step in enumerate(steps):
        for rid in step.prefill:
            start, n, row = step.before[rid]
            assert start % s.chunk == 0, (i, rid, start)
            assert n == s.chunk or row in step.plan.samples, (i, rid, n)


def check_aligned_chunks(s, steps):
    """With `cut_align`: every prefill row starts at a multiple of it and takes the whole chunk,
    or less where its prefill ends, or a multiple of it after which the step's budget has less
    than one multiple left (a cut),
    so where a prompt's chunks start depends on the other rows only through that multiple."""
    align = s.cut_align
    assert align and s.chunk % align == 0
    for i, step in enumerate(steps):
        fed = sum(step.before[rid][1] for rid in step.prefill)
        for rid in step.prefill:
            start, n, row = step.before[rid]
            assert start % align == 0, (i, rid, start)
            cut = n % align == 0 and n < s.chunk and s.max_num_tokens - fed < align
            assert n == s.chunk or row in step.plan.samples or cut, (i, rid, n)


def check_chunks(s, steps):
    if s.cut_align:
        check_aligned_chunks(s, steps)
    else:
        check_whole_chunks(s, steps)


def check_one_kind_per_step(steps):
    """No step feeds both kinds of rows, the plan says which kind it runs as, and a request in
    decode never waits for two prefill steps in a row (nor for a step without tokens)."""
    for i, step in enumerate(steps):
        assert not (step.decode and step.prefill), (i, step)
        if step.decode or step.prefill:
            assert step.plan.decode_only == bool(step.decode), (i, step)
        if step.decoding:
            assert step.decode or step.prefill, (i, step)
            assert not (step.prefill and i > 0 and steps[i - 1].prefill), (i, step)


def arriving_requests():
    """Prompts (prefilled in several 8-token chunks) that arrive while others decode."""
    return {
        0: [req(0, 20, 6), req(1, 5, 8)],
        2: [req(2, 30, 5)],
        5: [req(3, 9, 8)],
        9: [req(4, 17, 4), req(5, 3, 3)],
    }


@pytest.mark.parametrize("pipelined", [False, True])
def test_without_mixed_steps_a_step_holds_decode_rows_or_prefill_rows(pipelined):
    s = make(rows=4, budget=16, chunk=8, mixed_steps=False)
    steps = drive_steps(s, arriving_requests(), pipelined=pipelined)
    check_one_kind_per_step(steps)
    check_whole_chunks(s, steps)
    assert any(step.prefill and step.decoding for step in steps)  # both kinds did wait at once
    for r in s.requests.values():
        assert r.status == FINISHED and r.output == [1000 + k for k in range(r.max_new_tokens)]
    assert s.ledger.free == [100]
    # Mixed steps (the default) on the same requests: a decode row rides in a prefill step.
    mixed = drive_steps(make(rows=4, budget=16, chunk=8), arriving_requests(), pipelined=pipelined)
    assert any(step.decode and step.prefill for step in mixed)
    assert not any(step.plan.prefill_step for step in mixed)


def test_without_mixed_steps_requests_wait_for_slots_and_all_finish():
    """A quota of about two requests at a time: requests wait for slots, preemptions recompute
    some; every request finishes, no step mixes kinds, every slot comes back."""
    s = make(num_slots=16, rows=3, budget=16, chunk=8, headroom=1, mixed_steps=False)
    arrivals = {0: [req(i, n, 12) for i, n in enumerate([22, 30, 14, 26])], 4: [req(4, 18, 5)]}
    steps = drive_steps(s, arrivals)
    check_one_kind_per_step(steps)
    check_whole_chunks(s, steps)
    assert len(steps[0].prefill) < 4  # the rest wait for room
    assert s.counters.preemptions > 0  # decode rows grew into a prefill's slots
    for r in s.requests.values():
        assert r.status == FINISHED and r.output == [1000 + k for k in range(r.max_new_tokens)]
    assert s.ledger.free == [16]


def test_a_prefill_step_keeps_free_the_next_slots_of_the_decode_rows():
    """Request 0 decodes and its 9th token needs a third block; request 1's first chunk needs
    the 6 blocks left. It waits instead of taking the block request 0 is about to need (the
    next decode step would preempt it), and request 0 decodes every step meanwhile."""
    s = make(num_slots=8, rows=2, budget=64, chunk=64, mixed_steps=False)
    s.add(req(0, 7, 4))
    for _ in range(2):  # its prefill, then its first decode step: 8 tokens in two blocks
        plan = s.schedule()
        s.update_from_output(plan, {row: 1000 + k for row, (r, k) in plan.samples.items()})
    assert s.ledger.history[0] == 8 and s.ledger.free == [6]
    s.add(req(1, 24, 1))
    plans = drive(s)
    assert [p.new_tokens for p in plans[:3]] == [{0: 1}, {0: 1}, {0: 24}]
    assert [p.decode_only for p in plans[:3]] == [True, True, False]
    assert s.counters.preemptions == 0 and s.ledger.free == [8]


@settings(max_examples=200, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=10),
    new=st.lists(st.integers(1, 12), min_size=10, max_size=10),
    arrive=st.lists(st.integers(0, 12), min_size=10, max_size=10),
    budget=st.integers(5, 64),
    chunk=st.integers(1, 48),
    slots=st.integers(13, 40),
    rows=st.integers(1, 5),
    pipelined=st.booleans(),
    cache=st.sampled_from([False, False, True]),
    cut_align=st.sampled_from([0, 1, 2, 4, 8]),
)
def test_without_mixed_steps_every_request_finishes_and_no_slot_leaks(
    lengths, new, arrive, budget, chunk, slots, rows, pipelined, cache, cut_align
):
    s = make(
        num_slots=slots,
        rows=rows,
        budget=budget,
        chunk=chunk,
        cache=cache,
        mixed_steps=False,
        cut_align=cut_align,
    )
    arrivals = {}
    for i, n in enumerate(lengths):
        arrivals.setdefault(arrive[i], []).append(req(i, n, new[i]))
    steps = drive_steps(s, arrivals, pipelined=pipelined)
    check_one_kind_per_step(steps)
    if not cache:  # (a prefix hit or a park boundary moves the chunks of a prompt)
        check_chunks(s, steps)
    for i in range(len(lengths)):
        r = s.requests[i]
        assert r.status == FINISHED and r.output == [1000 + k for k in range(new[i])], i
    s.clear_cache()
    assert s.ledger.free == [slots]


def test_a_prefix_is_parked_once():
    """Request 0's prompt (20 tokens) is parked when its prefill ends; in the next step request
    1's prefill reaches its boundary park at the same 20 tokens (which request 2 shares) and
    request 0 finishes with the same 20 tokens of history: neither parks those blocks again,
    and request 2 starts from the cached prompt. Every later turn's blocks are cached once."""
    s = make(rows=2, budget=64, chunk=8, cache=True)
    prefix = tuple(range(1, 21))
    s.add(Request(id=0, prompt=prefix, max_new_tokens=1))
    steps = drive_steps(
        s,
        {
            1: [
                Request(id=1, prompt=prefix + tuple(range(21, 31)), max_new_tokens=2),
                Request(id=2, prompt=prefix + (99, 98, 97), max_new_tokens=2),
            ]
        },
    )
    blocks = [0, 1, 2, 3, 4]
    assert steps[2].plan.park_b == [Park(0, 20, blocks, [1] * 5)]  # the prompt, at its end
    both = steps[3].plan
    assert both.new_tokens[1] == 4 and not both.park_b  # the boundary park: cached already
    assert both.free_a == [0] and not both.park_a  # nor is the history parked again
    assert both.adopt == [Adopt(0, 20, blocks)]
    assert s.counters.prefix_hits == 1 and s.counters.prefix_tokens == 20
    assert all(r.status == FINISHED for r in s.requests.values())
    # cached: the 5 shared blocks, request 1's next 2 (28 of 31 tokens), request 2's next 1
    assert len(s.cache) == 8 and s.ledger.free == [100 - 8]
    assert all(s.ledger.is_empty(row) for row in range(2))
    s.clear_cache()
    assert s.ledger.free == [100] and not s.cache.nodes


def test_cached_blocks_are_bounded_by_free_slots_only():
    """Many more cached prefixes than rows: every finished history stays cached while slots
    are free, each repeat of a prompt starts from its blocks, and when admission needs slots
    the least recently used blocks go first."""
    s = make(num_slots=40, rows=1, budget=64, cache=True)
    prompts = [tuple(range(100 * i + 1, 100 * i + 9)) for i in range(8)]  # 2 blocks each
    for i, p in enumerate(prompts):
        s.add(Request(id=i, prompt=p, max_new_tokens=1))
    drive(s)
    assert len(s.cache) == 16 and s.ledger.free == [40 - 16]  # 8 prefixes, 1 row
    for i, p in enumerate(prompts):
        s.add(Request(id=10 + i, prompt=p + (7,), max_new_tokens=1))
    drive(s)
    assert s.counters.prefix_hits == 8 and s.counters.prefix_tokens == 8 * 8
    # a request needing 30 slots evicts least recently used first: prompt 0's blocks
    s.add(Request(id=20, prompt=tuple(range(1000, 1120)), max_new_tokens=1))
    drive(s)
    assert s.counters.evictions > 0
    assert not s.cache.match(prompts[0] + (7,), 2) and s.cache.match(prompts[7] + (7,), 2)
