"""The scheduler: which requests run in the next step, with how many tokens, in which rows.

Pure Python (no JAX): it decides each step from the host's `SlotLedger`, which counts exactly
what the pool transforms will hold, and emits a `StepPlan` that the step runner turns into
arrays. The plan also says which slot bookkeeping the compiled step does around the forward:

    free_a -> release -> park_a -> adopt -> free_b -> reserve -> forward -> sample -> advance
    -> park_b

free_a frees the rows of finished requests that park nothing and of preempted ones; release
evicts cached blocks; park_a caches the blocks of finished histories; adopt starts admitted
requests from cached blocks; free_b frees the rows parked in park_a; park_b caches the
prefixes that the step's prefill rows just reached (`swajax._prefix_cache`).

Policy of one step (`Scheduler.schedule`), within a budget of `max_num_tokens` tokens:
1. Requests whose last token was scheduled, or that met a stop token, give their rows back.
2. Running requests in decode take one token each, oldest first; then running requests in
   prefill take their next chunk (up to `chunk` tokens; cut to fit the budget and the slots).
   A row whose step does not fit makes room: cached blocks that no row reads are evicted
   (least recently used), then the most recently admitted running requests are preempted
   (their rows freed; they wait at the head of the queue and are recomputed from prompt +
   generated tokens).
3. Waiting requests are admitted in arrival order while rows, budget and slots last: a
   request is admitted when its first step (its chunk, cut to the budget only) fits and
   leaves `headroom` slots free in every group for the running rows to grow, and when the
   slots its whole prefill will hold, beside what the running prefills will still add, fit
   the free slots too (no headroom and no such check when nothing else runs, so a request
   that fits the pool alone always starts). A prompt longer than a chunk is thus admitted
   only when it can finish its prefill: admitting it on its first chunk alone would let two
   long prefills grow into each other, preempting and recomputing each other without end. A request
   starts from the longest cached prefix of its tokens; one that shares a longer
   block-aligned prefix with a request whose prefill is about to park it waits for that
   prefix, and a request that shares a prefix with queued requests parks it (`park_at`).
Allocation is on demand: a request holds what the transforms hold after each step, never a
reserved lifetime peak.

Without mixed steps (`mixed_steps=False`, for `Engine(batch_invariant=True)`) a step holds
decode rows only or prefill rows only, so that a row's computation does not depend on what else
runs (a prefill row feeds prompt tokens: a running prefill's next chunk, or an admitted
request's first step). The step right after a prefill step is a decode step if a request is in
decode; any other step is a prefill step (2 for the running prefills only, then 3), or a decode
step if no prefill row can run. The two kinds thus alternate while both wait: a request in
decode waits for one prefill step at most. The decode rows left out of a prefill step keep
their rows and slots; the step leaves free the slots their next tokens need, as if they ran in
it, and its prefill rows never preempt them to make room. A prompt's chunks start at multiples
of `cut_align` (the prefill kernel's query tile), whatever the other rows: a chunk is cut to
the budget left only at such a multiple (`cut_align=0`: never, the chunks are whole), and never
to the free slots (a row whose chunk does not fit makes room by preemption as usual, or waits
for the next prefill step). A query's attention output is bitwise the same for any
tile-aligned start of its chunk (`tests/test_paged_attention.py`), so the cuts do not change a
row's numbers. A prefix-cache hit or park boundary still moves them.

Pipelining: a step may be planned before the tokens of the previous one are read. A decode
row then feeds the token its row sampled in the previous step (`StepPlan.tokens` gives None
for it: the runner takes it from the previous step's output on the device). A request that
met a stop token is noticed one step late; the token its row drew meanwhile is dropped.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
from collections.abc import Sequence
from typing import NamedTuple

from swajax._drafter import is_in_step
from swajax._ledger import SlotLedger
from swajax._prefix_cache import Node, PrefixCache

# A request's states: WAITING (queued, no row) -> RUNNING (a row, prefill then decode) ->
# FINISHED (finish_reason "stop", "length", "abort" or "error"); a running request that must
# make room is PREEMPTED: its row freed, it waits at the head of the queue and is recomputed
# from prompt + generated tokens when admitted again (RUNNING).
WAITING, RUNNING, PREEMPTED, FINISHED = "waiting", "running", "preempted", "finished"
FINISH_REASONS = ("stop", "length", "abort", "error")


@dataclasses.dataclass(eq=False)
class Request:
    """One request as the scheduler sees it.

    The sequence is prompt + output; `fed` of its tokens have their KV in the request's row.
    `num_generated` counts sampled tokens including one not yet read (`pending`).
    """

    id: int
    prompt: tuple[int, ...]
    max_new_tokens: int
    stop_token_ids: frozenset[int] = frozenset()
    sampling: object = None  # opaque to the scheduler (the runner reads it)
    key_data: object = None
    output: list[int] = dataclasses.field(default_factory=list)
    num_generated: int = 0
    status: str = WAITING
    finish_reason: str | None = None
    row: int | None = None
    fed: int = 0
    park_at: int = 0
    done_scheduling: bool = False
    preemptions: int = 0
    prefix_hit_tokens: int = 0
    error: str | None = None  # why it finished with "error"
    num_draft_tokens: int = 0  # most drafted tokens per step (0: no speculation)
    drafts: list[int] = dataclasses.field(default_factory=list)  # fed in the step in flight
    # An in-step drafter's drafts: (the sequence length they follow, the tokens), or None.
    proposed: tuple[int, list[int]] | None = None

    @property
    def pending(self) -> bool:
        return self.num_generated > len(self.output)

    @property
    def length(self) -> int:
        """Tokens of the sequence, the pending one included."""
        return len(self.prompt) + self.num_generated

    def tokens(self, start: int, stop: int) -> list[int]:
        """Known tokens [start, stop) of prompt + output."""
        n = len(self.prompt)
        return list(self.prompt[start:stop]) + self.output[max(start - n, 0) : max(stop - n, 0)]


class Park(NamedTuple):
    """Row `row`'s block i < k / page_size becomes node nodes[i] in the groups of masks[i]."""

    row: int
    k: int
    nodes: list[int]
    masks: list[int]


class Adopt(NamedTuple):
    """Empty row `row` starts from the cached blocks of history k (block i: node nodes[i])."""

    row: int
    k: int
    nodes: list[int]


@dataclasses.dataclass
class StepPlan:
    """One step: per row the new tokens, and the bookkeeping around the forward."""

    index: int
    new_tokens: dict[int, int]  # row -> tokens this step
    tokens: dict[int, list[int | None]]  # row -> token ids (None: the row's previous sample)
    samples: dict[int, tuple[Request, int]]  # row -> (request, index of the token drawn)
    free_a: list[int] = dataclasses.field(default_factory=list)
    release: list[int] = dataclasses.field(default_factory=list)  # cached node ids evicted
    park_a: list[Park] = dataclasses.field(default_factory=list)
    adopt: list[Adopt] = dataclasses.field(default_factory=list)
    free_b: list[int] = dataclasses.field(default_factory=list)
    park_b: list[Park] = dataclasses.field(default_factory=list)
    # Speculative decoding: drafted tokens each row feeds after its last token (row -> count),
    # and the rows whose history goes back to the tokens they kept, before anything else.
    drafts: dict[int, int] = dataclasses.field(default_factory=dict)
    rewind: dict[int, int] = dataclasses.field(default_factory=dict)
    used: tuple[int, ...] = ()  # slots held per group after the reserve (the step's peak)
    # Planned as a prefill step without decode rows (`Scheduler(mixed_steps=False)`): it runs
    # as one even when each of its rows feeds a single token.
    prefill_step: bool = False

    @property
    def num_tokens(self) -> int:
        return sum(self.new_tokens.values())

    @property
    def decode_only(self) -> bool:
        return not self.prefill_step and all(n <= 1 for n in self.new_tokens.values())

    @property
    def verify_only(self) -> bool:
        """Decode rows only, some with drafted tokens (a speculative verification step)."""
        return not self.prefill_step and all(
            n - self.drafts.get(row, 0) <= 1 for row, n in self.new_tokens.items()
        )


@dataclasses.dataclass
class SchedulerCounters:
    preemptions: int = 0
    prefix_hits: int = 0
    prefix_tokens: int = 0
    evictions: int = 0
    draft_tokens: int = 0  # tokens drafted and verified
    accepted_tokens: int = 0  # of them, kept


class Scheduler:
    """Queue, admission, token budget, preemption and prefix parking over a `SlotLedger`.

    Args:
      ledger: the host mirror of the pool's slots (one row per batch row of its layout).
      max_num_tokens: token budget of one step.
      chunk: most prompt tokens one row takes in one step.
      headroom: slots per group an admission must leave free (see the module docstring).
      max_cache_ops: most rows in each of park_a, adopt and park_b of one step (the compiled
        step's static capacity; 0: no prefix cache). The prefix cache also needs
        `layout.cache_nodes` node ids; one step evicts at most `layout.cache_releases`.
      mixed_steps: whether decode rows and prefill rows may share a step (False: each step
        holds one kind; see the module docstring).
      drafter: proposes the tokens of speculative decoding (`swajax._drafter`) for requests
        with `num_draft_tokens` > 0; None: no speculation. A speculating request in decode
        feeds its last token and up to that many drafted tokens in one step, and is planned
        only once its last token was read. An in-step drafter (`swajax._drafter.is_in_step`)
        is not called: a request's drafts are those the step that drew its last token
        returned (`update_from_output(proposals=)`).
      cut_align: without mixed steps, the multiple of tokens at which a prompt's chunk may be
        cut to the budget left (0: chunks are whole). Cuts are made only when the chunk is a
        multiple of it and only to a chunk that starts at a multiple of it, so every chunk of
        a prompt without a prefix-cache hit starts at one, cut or not.
    """

    def __init__(
        self,
        ledger: SlotLedger,
        *,
        max_num_tokens: int,
        chunk: int,
        headroom: Sequence[int],
        max_cache_ops: int = 0,
        mixed_steps: bool = True,
        cut_align: int = 0,
        drafter=None,
    ):
        layout = ledger.layout
        if not isinstance(cut_align, int) or cut_align < 0:
            raise ValueError(f"cut_align must be an int >= 0, got {cut_align!r}")
        self.ledger = ledger
        self.page_size = layout.page_size
        self.num_rows = layout.max_batch
        self.max_num_tokens = max_num_tokens
        # Without mixed steps a prompt's chunks are whole: they start at multiples of the chunk
        # whatever else runs (a chunk longer than the budget could then never run).
        self.chunk = chunk if mixed_steps else min(chunk, max_num_tokens)
        self.headroom = tuple(headroom)
        self.max_cache_ops = max_cache_ops
        self.drafter = drafter
        self.max_releases = layout.cache_releases
        self.mixed_steps = mixed_steps
        # (no cuts unless a whole chunk keeps the next start aligned)
        self.cut_align = cut_align if cut_align and self.chunk % cut_align == 0 else 0
        self.cache = (
            PrefixCache(layout.page_size, layout.cache_nodes)
            if layout.cache_nodes and max_cache_ops
            else None
        )
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.rows: list[Request | None] = [None] * self.num_rows
        self.requests: dict[int, Request] = {}
        self.counters = SchedulerCounters()
        self._release: list[Request] = []  # finished requests whose rows go back next step
        self._free_next: list[int] = []  # rows freed in the ledger, on the device next step
        self._release_next: list[int] = []  # cached nodes released likewise
        self._rewind_next: dict[int, int] = {}  # row -> history kept after a verification
        self._steps = 0
        self._prefill_last = False  # whether the last step planned was a prefill step

    # ------------------------------------------------------------------ queue

    def add(self, request: Request) -> None:
        if request.id in self.requests:
            raise ValueError(f"request id {request.id} is already queued")
        request.status = WAITING
        self.requests[request.id] = request
        self.waiting.append(request)

    @property
    def has_work(self) -> bool:
        return bool(
            self.waiting
            or self.running
            or self._release
            or self._free_next
            or self._release_next
            or self._rewind_next
        )

    @property
    def awaits_tokens(self) -> bool:
        """Whether a speculating request waits for its last token (the engine then reads the
        step in flight before planning: its drafts follow that token)."""
        return any(r.pending and r.num_draft_tokens for r in self.running)

    @property
    def pool_idle(self) -> bool:
        """Whether the pool may be split anew: no running request and no finished one whose
        rows are still to be released or parked (waiting requests hold no slot; cached
        blocks go with the old split)."""
        return not self.running and not self._release

    def rebind(self, ledger: SlotLedger, headroom: Sequence[int]) -> None:
        """Serves from `ledger`, a fresh pool of the same rows (e.g. split anew), keeping the
        queue; only while `pool_idle`. Rows and cached blocks still held in the old pool are
        forgotten with it."""
        if not self.pool_idle:
            raise RuntimeError("rebind needs an idle pool (no running or finishing request)")
        if ledger.layout.max_batch != self.ledger.layout.max_batch:
            raise ValueError(
                f"the new pool has {ledger.layout.max_batch} rows, the old one "
                f"{self.ledger.layout.max_batch}"
            )
        for r in self._release:
            r.row = None
        self.ledger, self.headroom = ledger, tuple(headroom)
        if self.cache is not None:
            self.cache = PrefixCache(self.page_size, ledger.layout.cache_nodes)
        self.rows = [None] * self.num_rows
        self._release, self._free_next, self._release_next = [], [], []

    def slot_demand(self) -> tuple[list[int], list[int], bool]:
        """What the "online" split policy observes (`swajax._budget.OnlineRebalance`):
        (demand, minimum, force), per group. demand: slots held by running rows (blocks only
        the prefix cache holds left out) + what the queued requests that have a free row would
        each need alone; minimum: slots held + admission headroom, and at least the next
        queued request's need; force: that request does not fit the split at all."""
        led = self.ledger
        held = list(led.used())
        demand = list(held)
        if self.cache is not None and len(self.cache):
            parked = led.cache_only_slots()
            demand = [d - p for d, p in zip(demand, parked, strict=True)]
        minimum = [h + r for h, r in zip(held, self.headroom or (0,) * len(held), strict=True)]
        force = False
        free_rows = self.num_rows - len(self.running)
        for i, r in enumerate(itertools.islice(self.waiting, max(free_rows, 1))):
            left = max(r.max_new_tokens - len(r.output), 1)
            need = led.prefill_peak(len(r.prompt) + len(r.output) + left, self.chunk)
            if i == 0:
                minimum = [max(m, n) for m, n in zip(minimum, need, strict=True)]
                force = any(n > k for n, k in zip(need, led.num_slots, strict=True))
            if i < free_rows:
                demand = [d + n for d, n in zip(demand, need, strict=True)]
        return demand, minimum, force

    def resize(self, layout, headroom: Sequence[int]) -> None:
        """Serves on from the same pool split anew (`SlotLedger.resize`): running requests keep
        their rows and cached blocks stay cached; admissions keep `headroom` slots free."""
        self.ledger.resize(layout)
        self.headroom = tuple(headroom)

    def abort(self, request_ids: Sequence[int], reason: str = "abort") -> list[int]:
        """Finishes these requests where they stand (`reason`, default "abort") and drops them;
        returns the rows to free (their KV is released next step)."""
        rows = []
        for rid in request_ids:
            r = self.requests.pop(rid, None)
            if r is None:
                continue
            if r in self.waiting:
                self.waiting.remove(r)
            if r in self.running:
                self.running.remove(r)
            if r in self._release:
                self._release.remove(r)
            if r.row is not None:
                rows.append(r.row)
                self.rows[r.row] = None
                r.row = None
            r.status, r.finish_reason = FINISHED, r.finish_reason or reason
        if rows:
            self.ledger.free_rows(rows)
            self._free_next += rows
        return rows

    def clear_cache(self) -> None:
        """Evicts every cached block (released on the device by the next plans)."""
        if self.cache is None:
            return
        for node_id in self.cache.clear():
            self.ledger.release_cached(node_id)
            self._release_next.append(node_id)

    def _take_pending(self, plan: StepPlan) -> None:
        """Moves the rows and nodes released between steps into `plan` (at most
        `max_releases` nodes; the rest wait for the next plan)."""
        plan.rewind.update(self._rewind_next)
        self._rewind_next = {}
        plan.free_a += self._free_next
        self._free_next = []
        n = self.max_releases
        plan.release += self._release_next[:n]
        self._release_next = self._release_next[n:]

    def bookkeeping_plan(self) -> StepPlan | None:
        """A plan with only the frees of aborted requests and the releases of cleared cached
        blocks (some of them, if there are more than one step releases), or None."""
        if not self._free_next and not self._release_next and not self._rewind_next:
            return None
        plan = StepPlan(self._steps, {}, {}, {})
        self._take_pending(plan)
        plan.used = self.ledger.used()
        return plan

    # ------------------------------------------------------------------ tokens back

    def update_from_output(
        self,
        plan: StepPlan,
        tokens: dict[int, int],
        finite: dict[int, bool] | None = None,
        proposals: dict[int, list[int]] | None = None,
    ) -> list[Request]:
        """Records the tokens a step drew (row -> id, or the list of ids a row with drafts
        kept: its kept drafts, then its next token) and whether each row's logits were all
        finite (a row that was not finishes with "error": its tokens are not recorded);
        returns the requests that changed. proposals: an in-step drafter's drafts per row,
        to follow the tokens recorded here."""
        changed = []
        for row, (r, index) in plan.samples.items():
            drafted = plan.drafts.get(row, 0)
            if drafted:
                r.drafts = []
            if r.status == FINISHED or index != len(r.output):
                continue  # stopped earlier (this token is dropped) or aborted
            if finite is not None and not finite[row]:
                r.error = (
                    f"non-finite logits (NaN or Inf) at generated token {index}: the model's "
                    "weights or activations hold NaN / Inf"
                )
                self._finish(r, "error")
                changed.append(r)
                continue
            drawn = tokens[row]
            drawn = [int(t) for t in drawn] if isinstance(drawn, list | tuple) else [int(drawn)]
            if drafted:  # the kept drafts' KV stays; the row's history goes back to it
                kept = len(drawn) - 1
                self.counters.draft_tokens += drafted
                self.counters.accepted_tokens += kept
                r.fed += kept
                r.num_generated = len(r.output) + len(drawn)
                self.ledger.rewind(row, r.fed)
                self._rewind_next[row] = r.fed
            changed.append(r)
            for token in drawn:
                r.output.append(token)
                if token in r.stop_token_ids:
                    self._finish(r, "stop")
                    break
                if len(r.output) == r.max_new_tokens:
                    self._finish(r, "length")
                    break
            if proposals is not None and row in proposals and r.status != FINISHED:
                r.proposed = (len(r.prompt) + len(r.output), list(proposals[row]))
        return changed

    def _finish(self, r: Request, reason: str) -> None:
        r.status, r.finish_reason = FINISHED, reason
        r.num_generated = len(r.output)
        if r in self.running:
            self.running.remove(r)
            self._release.append(r)
        elif r in self.waiting:  # preempted, then finished by its last pending token
            self.waiting.remove(r)

    # ------------------------------------------------------------------ planning

    def _need(self, row: int, n: int) -> tuple[int, ...]:
        need = self.ledger.slots_needed({row: n})
        assert need is not None, (row, n)
        return need

    def _fits(self, planned: list[int], need, headroom=None) -> bool:
        room = headroom or (0,) * len(need)
        return all(
            p + n + h <= f for p, n, h, f in zip(planned, need, room, self.ledger.free, strict=True)
        )

    def _largest_fit(self, row: int, n: int, planned, headroom=None) -> int:
        """The most tokens in [1, n] row can take this step within the free slots, or 0."""
        if self._fits(planned, self._need(row, n), headroom):
            return n
        lo, hi = 0, n - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._fits(planned, self._need(row, mid), headroom):
                lo = mid
            else:
                hi = mid - 1
        while lo > 0 and not self._fits(planned, self._need(row, lo), headroom):
            lo -= 1
        return lo

    def _prefill_commitments(self, plan: StepPlan) -> list[int]:
        """Slots per group the running prefills will still add after this step's tokens, up to
        the peak of their prefill (what admitting another request must leave them)."""
        total = [0] * len(self.ledger.free)
        for r in self.running:
            n = plan.new_tokens.get(r.row, 0)
            if r.fed + max(n, 1) >= r.length:  # in decode (run or not), or its prefill ends now
                continue
            held = self.ledger.row_slots(r.row)
            step = self._need(r.row, n) if n else (0,) * len(total)
            peak = self.ledger.prefill_peak(r.length, self.chunk)
            for g in range(len(total)):
                total[g] += max(0, peak[g] - held[g] - step[g])
        return total

    def _admits(self, planned, r: Request, n: int, headroom, commitments) -> bool:
        """Whether request r (in its row) may take its first n tokens this step."""
        first = self._need(r.row, n)
        if headroom is None:  # nothing else runs: it only has to fit
            return self._fits(planned, first)
        peak = self.ledger.prefill_peak(r.length, self.chunk) if r.length > n else first
        whole = [max(a, b) + c for a, b, c in zip(first, peak, commitments, strict=True)]
        return self._fits(planned, first, headroom) and self._fits(planned, whole, headroom)

    def _step_tokens(self, r: Request) -> int:
        """Tokens r wants this step: 1 in decode, else a chunk (ending at park_at if set)."""
        remaining = r.length - r.fed
        if remaining <= 1:
            return remaining
        n = min(remaining, self.chunk)
        if r.park_at > r.fed:
            n = min(n, r.park_at - r.fed)
        return n

    def _tokens_within(self, r: Request, budget: int) -> int:
        """Tokens r takes this step within `budget`: with mixed steps its step cut to the budget;
        without, its whole step, else (cut_align, from an aligned start) the budget rounded
        down to a multiple of cut_align, else 0 (it waits for the next prefill step)."""
        want = self._step_tokens(r)
        if want <= budget or self.mixed_steps:
            return min(want, budget)
        if self.cut_align and r.fed % self.cut_align == 0:
            return budget // self.cut_align * self.cut_align
        return 0

    def _evict(self, plan: StepPlan, protect=(), frees_only: bool = True) -> bool:
        """Evicts the next cached node (`PrefixCache.victim`; with frees_only, one whose
        release frees a slot), released on the device by this plan; False if none may go."""
        if self.cache is None or len(plan.release) >= self.max_releases:
            return False
        victim = self.cache.victim(self.ledger.frees_of if frees_only else None, protect)
        if victim is None:
            return False
        self.ledger.release_cached(victim.id)
        self.cache.remove(victim)
        plan.release.append(victim.id)
        self.counters.evictions += 1
        return True

    def _preempt(self, r: Request, plan: StepPlan) -> None:
        self.running.remove(r)
        self.ledger.free_rows([r.row])
        plan.free_a.append(r.row)
        self.rows[r.row] = None
        r.row, r.fed, r.park_at, r.status = None, 0, 0, PREEMPTED
        r.preemptions += 1
        self.counters.preemptions += 1
        self.waiting.appendleft(r)

    def _cached(self, tokens: Sequence[int], k: int) -> bool:
        """Whether a request could start from the first k tokens (k whole blocks) of `tokens`
        from cached blocks alone."""
        if self.cache is None:
            return False
        path = self.cache.match(tokens, k // self.page_size)
        return len(path) * self.page_size == k and self.ledger.can_adopt(k, [n.id for n in path])

    def _park(
        self, parks: list[Park], row: int, tokens: Sequence[int], step: _Step, evict=True
    ) -> None:
        """Caches the blocks `row` holds of `tokens` (whole blocks; nothing if the plan's list
        is full): nodes made where needed; with `evict`, node ids freed by evicting unreachable
        or least recently used nodes if they ran out (else a shorter prefix is parked)."""
        n = len(tokens) // self.page_size
        if self.cache is None or n == 0 or len(parks) >= self.max_cache_ops:
            return
        have = len(self.cache.match(tokens, n))
        while evict and self.cache.free_ids < n - have:
            if not self._evict(step.plan, step.protect, frees_only=False):
                break
        path = self.cache.extend(tokens, n)
        ids = [node.id for node in path]
        k = len(path) * self.page_size
        masks = self.ledger.park(row, k, ids)
        for node in reversed(path):  # made for nothing: the row held none of its blocks
            if not self.ledger.cached_groups(node.id) and not node.children:
                self.cache.remove(node)
        path = [node for node in path if node.id in self.cache.nodes]
        step.protect.update(path)
        self.cache.touch(path)
        if any(masks):
            parks.append(Park(row, k, ids, masks))

    def _release_rows(self, step: _Step) -> None:
        """Frees the rows of finished requests, caching their histories' blocks first."""
        plan = step.plan
        released_a = []
        for r in self._release:
            row, r.row = r.row, None
            self.rows[row] = None
            k = min(self.ledger.history[row], len(r.prompt) + len(r.output))
            k = k // self.page_size * self.page_size
            parked = len(plan.park_a)
            self._park(plan.park_a, row, r.tokens(0, k), step)
            if len(plan.park_a) > parked:
                plan.free_b.append(row)
            else:
                plan.free_a.append(row)
                released_a.append(row)
        self.ledger.free_rows(released_a + plan.free_b)
        self._release = []

    def _plan_park(self, r: Request, start: int) -> None:
        """r.park_at: the longest block-aligned prefix r shares with a waiting request."""
        if self.cache is None:
            return
        best, seq = 0, r.tokens(0, r.length)
        for other in self.waiting:
            if other is r or other.pending:
                continue
            o = other.tokens(0, other.length)
            n = 0
            limit = min(len(seq), len(o)) - 1
            while n < limit and seq[n] == o[n]:
                n += 1
            best = max(best, n // self.page_size * self.page_size)
        if best > start and not self._cached(seq, best):
            r.park_at = best

    def _awaits_park(self, r: Request, hit: int) -> bool:
        """Whether a running request is about to park a longer prefix of r's tokens."""
        for other in self.running:
            k = other.park_at
            if k > max(other.fed, hit) and k < r.length and r.tokens(0, k) == other.tokens(0, k):
                return True
        return False

    def schedule(self) -> StepPlan | None:
        """Plans the next step (mutating the ledger as the step will); None if idle."""
        step = _Step(StepPlan(self._steps, {}, {}, {}), self)
        self._take_pending(step.plan)
        for r in self.running:
            if r.num_generated >= r.max_new_tokens:
                r.done_scheduling = True
        for r in [r for r in self.running if r.done_scheduling]:
            self.running.remove(r)
            self._release.append(r)
        self._release_rows(step)
        # 1-2. running requests: decode first, then prefill chunks; make room by preempting
        decode = [r for r in self.running if r.length - r.fed == 1]
        prefill = [r for r in self.running if r.length - r.fed > 1]
        prefill_step = not self.mixed_steps and not (decode and self._prefill_last)
        step.drafts = self._propose(decode, step.budget)
        if self.mixed_steps:
            self._run_rows(step, decode + prefill)
        elif prefill_step:  # the decode rows wait, the slots of their next token kept free
            for r in decode:
                for g, x in enumerate(self._need(r.row, 1)):
                    step.planned[g] += x
            self._run_rows(step, prefill, kept=decode)
        else:
            self._run_rows(step, decode)
        # 3. admission
        if self.mixed_steps or prefill_step:
            self._admit(step)
        plan = step.plan
        if prefill_step and not plan.new_tokens and decode:  # no prefill row runs: decode
            prefill_step = False
            step.planned[:] = [0] * len(step.planned)
            self._run_rows(step, decode)
        plan.prefill_step = prefill_step and bool(plan.new_tokens)
        self._prefill_last = plan.prefill_step
        if not plan.new_tokens and not (plan.free_a or plan.free_b or plan.release):
            return None
        ok = self.ledger.reserve(plan.new_tokens)
        assert ok, plan.new_tokens
        plan.used = self.ledger.used()
        self.ledger.advance()
        self._parks_after(step)
        self._feed(plan)
        self._steps += 1
        return plan

    def _run_rows(self, step: _Step, rows: list[Request], kept: Sequence[Request] = ()) -> None:
        """Schedules running rows in order; a row that does not fit makes room by evicting,
        then by preempting the newest running request neither scheduled nor in `kept`."""
        plan = step.plan
        for r in rows:
            if r not in self.running or step.budget == 0:
                continue
            want = self._tokens_within(r, step.budget)
            if want == 0:
                continue  # without mixed steps: it waits for the next prefill step
            drafts = []
            if r.num_draft_tokens and self.drafter is not None and r.length - r.fed == 1:
                if r.pending:
                    continue  # its drafts follow its last token: it runs once that is read
                drafts = step.drafts.get(r.id, [])[: step.budget - 1]
                want += len(drafts)
            while True:
                n = self._largest_fit(r.row, want, step.planned)
                if not self.mixed_steps and n < want:
                    n = 0  # not cut to the free slots either: make room for all of it
                if n > 0:
                    step.take(r, n)
                    r.drafts = drafts[: n - 1]
                    if r.drafts:
                        plan.drafts[r.row] = len(r.drafts)
                    break
                if self._evict(plan, step.protect):
                    continue
                newest = next(
                    x
                    for x in reversed(self.running)
                    if x.row not in plan.new_tokens and x not in kept
                )
                self._preempt(newest, plan)
                if newest is r:
                    break

    def _propose(self, decode: list[Request], budget: int) -> dict[int, list[int]]:
        """The drafter's tokens for each speculating request in decode whose last token is
        known (request id -> drafts), asked for all at once (`propose_batch` where the
        drafter has it): at most its num_draft_tokens, the tokens it may still generate less
        one, what its row and the budget have room for."""
        if self.drafter is None:
            return {}
        wanted = []
        for r in decode:
            if not r.num_draft_tokens or r.pending:
                continue
            k = min(
                r.num_draft_tokens,
                r.max_new_tokens - r.num_generated - 1,
                self.ledger.layout.max_context - r.length,
                budget - 1,
            )
            if k > 0:
                wanted.append((r, k))
        if not wanted:
            return {}
        if is_in_step(self.drafter):  # drafted by the step that drew the last token
            return {
                r.id: r.proposed[1][:k]
                for r, k in wanted
                if r.proposed is not None and r.proposed[0] == r.length
            }
        asks = [(r.tokens(0, r.length), k) for r, k in wanted]
        batch = getattr(self.drafter, "propose_batch", None)
        got = batch(asks) if batch is not None else [self.drafter.propose(*a) for a in asks]
        return {r.id: [int(t) for t in g[:k]] for (r, k), g in zip(wanted, got, strict=True)}

    def _admit(self, step: _Step) -> None:
        """Admits waiting requests in arrival order while rows, budget and slots last (see the
        module text), each from the longest cached prefix of its tokens."""
        plan = step.plan
        commitments = self._prefill_commitments(plan)
        free_rows = [b for b in range(self.num_rows) if self.rows[b] is None]
        blocked_rows = set(plan.free_b)  # freed after adopt: no cached prefix into them
        while self.waiting and step.budget > 0 and free_rows:
            r = self.waiting[0]
            if r.pending:  # its last token is still in flight: recompute once it is read
                break
            path, k = [], 0
            if self.cache is not None:
                path, k = self.cache.longest_hit(
                    r.tokens(0, r.length), r.length - 1, self.ledger.can_adopt
                )
            if self._awaits_park(r, k):
                break
            rows = [b for b in free_rows if b not in blocked_rows] if path else free_rows
            if not rows or (path and len(plan.adopt) >= self.max_cache_ops):
                break
            row = rows[0]
            self.waiting.popleft()
            r.row, r.fed, r.status = row, k, RUNNING
            self.rows[row] = r
            ids = [node.id for node in path]
            if path:
                ok = self.ledger.adopt(row, k, ids)
                assert ok, (row, k, ids)
            self._plan_park(r, k)
            headroom = self.headroom if self.running else None
            # The first step as the budget allows, never cut to the free slots (a sliver of a
            # prefill would hold slots only to be preempted as its neighbours grow).
            n = self._tokens_within(r, step.budget)  # 0: it waits for the next prefill step
            protect = step.protect | set(path)
            while n and not self._admits(step.planned, r, n, headroom, commitments):
                if not self._evict(plan, protect):
                    n = 0
                    break
            if n == 0:  # does not fit: back to the head of the queue
                self.ledger.free_rows([row])
                self.rows[row] = None
                r.row, r.fed, r.park_at, r.status = None, 0, 0, WAITING
                self.waiting.appendleft(r)
                break
            free_rows.remove(row)
            self.running.append(r)
            r.prefix_hit_tokens = k  # of this admission
            if path:
                step.protect.update(path)
                self.cache.touch(path)
                plan.adopt.append(Adopt(row, k, ids))
                self.counters.prefix_hits += 1
                self.counters.prefix_tokens += k
            step.take(r, n)
            commitments = self._prefill_commitments(plan)  # later admissions leave it room

    def _parks_after(self, step: _Step) -> None:
        """park_b: each prefill row that reaches its park_at (a boundary queued requests
        share) or the end of its prompt this step caches its blocks up to there (the prompt
        floored to a block, when longer than the prefix it started from)."""
        if self.cache is None:
            return
        plan = step.plan
        for row, n in plan.new_tokens.items():
            r = self.rows[row]
            if r.park_at and r.fed + n == r.park_at:
                k, r.park_at = r.park_at, 0
            elif r.fed + n == r.length and (n > 1 or r.fed == r.prefix_hit_tokens):
                k = r.length // self.page_size * self.page_size  # its prefill ends now
                if k <= r.prefix_hit_tokens:
                    continue
            else:
                continue
            self._park(plan.park_b, row, r.tokens(0, k), step, evict=False)

    def _feed(self, plan: StepPlan) -> None:
        """The token ids each row feeds (None: its previous sample, read on the device) and
        the rows that draw a token."""
        for row, n in plan.new_tokens.items():
            r = self.rows[row]
            drafted = plan.drafts.get(row, 0)
            n -= drafted  # a row with drafts feeds its last token, then the drafts
            known = len(r.prompt) + len(r.output)
            plan.tokens[row] = r.tokens(r.fed, r.fed + n) + [None] * max(r.fed + n - known, 0)
            assert plan.tokens[row].count(None) <= 1 and len(plan.tokens[row]) == n
            assert not drafted or None not in plan.tokens[row], (row, drafted)
            plan.tokens[row] += r.drafts
            r.fed += n
            if r.fed == r.length:
                plan.samples[row] = (r, r.num_generated)
                r.num_generated += 1


class _Step:
    """The working state of one `Scheduler.schedule` call: the plan, the slots planned per
    group, the token budget left, and the cached nodes this step parks or adopts (never
    evicted in it: the device releases before it parks and adopts)."""

    def __init__(self, plan: StepPlan, scheduler: Scheduler):
        self.plan, self._scheduler = plan, scheduler
        self.planned = [0] * len(scheduler.ledger.free)
        self.budget = scheduler.max_num_tokens
        self.protect: set[Node] = set()
        self.drafts: dict[int, list[int]] = {}  # request id -> the drafter's tokens

    def take(self, r: Request, n: int) -> None:
        """Row r feeds n tokens this step."""
        for g, x in enumerate(self._scheduler._need(r.row, n)):
            self.planned[g] += x
        self.plan.new_tokens[r.row] = n
        self.budget -= n


def default_headroom(num_slots: Sequence[int], fraction: float = 0.01) -> tuple[int, ...]:
    """Slots per group an admission leaves free: `fraction` of the group, at least one."""
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"headroom fraction must be in [0, 1), got {fraction}")
    return tuple(max(1, math.ceil(fraction * n)) if fraction > 0 else 0 for n in num_slots)
