"""Run statistics: `RunStats`, and the recorder an engine feeds while a recording is open.

`Engine.run` records its steps into a `RunStats`; `Engine.recording()` does the same around any
block (streams, a loop over `step`). The recorder counts per step (tokens fed, slots held after
the reserve, rows) and per output token (time to first token, inter-token latency, optionally
the logits that drew it).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import numpy as np


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
    `ttft_s` per request (from its arrival in the queue to its first token on the host) and
    `itl_s` (gaps between its tokens), with `ttft` / `itl` summaries (mean, p50, p99). Prefix
    cache: `prefix_hits` requests started from a cached prefix, skipping `prefix_tokens` prompt
    tokens (`prefix_hit_rate`: their share of the prompt tokens admitted). `resplits`: times the
    pool was split anew during the run (pool_ratio "adaptive" or "online"; `num_slots` is the
    last split's). Time by step kind: `prefill_s` / `decode_s`, host-observed (the loop keeps
    one step in flight, so the gap between two dispatches is the time of the step dispatched
    before them; the last two steps' time is not attributed); `mean_decode_rows`: rows per
    decode-only step. Speculative decoding: `draft_tokens` drafted tokens verified,
    `accepted_tokens` of them kept (`acceptance_rate`); a step emits several tokens of a row at
    once, and each of them counts the gap since the row's previous step shared among them
    as its inter-token latency.
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
    resplits: int = 0
    prefix_hits: int = 0  # requests that started from a cached prefix
    prefix_tokens: int = 0  # prompt tokens they did not prefill
    errors: int = 0  # requests finished with "error" (non-finite logits)
    draft_tokens: int = 0  # drafted tokens verified (speculative decoding)
    accepted_tokens: int = 0  # of them, kept
    ttft_s: list[float] = dataclasses.field(default_factory=list)
    itl_s: list[float] = dataclasses.field(default_factory=list)
    step_logits: list | None = None  # (request index, token index, f32[V]) when collected
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_steps: int = 0
    decode_rows: int = 0  # summed over decode-only steps
    _dispatched: list = dataclasses.field(default_factory=list, repr=False)  # (time, decode)

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
    def prefix_hit_rate(self) -> float:
        """Prompt tokens served from the prefix cache over the prompt tokens fed or skipped."""
        return self.prefix_tokens / max(self.prefix_tokens + self.prefill_tokens, 1)

    @property
    def acceptance_rate(self) -> float:
        """Drafted tokens kept over drafted tokens verified (nan without speculation)."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else float("nan")

    @property
    def ttft(self) -> dict[str, float]:
        return _summary(self.ttft_s)

    @property
    def itl(self) -> dict[str, float]:
        return _summary(self.itl_s)

    @property
    def mean_decode_rows(self) -> float:
        return self.decode_rows / max(self.decode_steps, 1)

    def on_step(self, plans, now: float | None = None) -> None:
        """A dispatched step: its tokens (prefill or decode), the slots it holds and its kind
        (timed when the steps after it are dispatched)."""
        now = time.perf_counter() if now is None else now
        decode = all(p.decode_only or p.verify_only for p in plans)
        if decode:
            self.decode_steps += 1
            self.decode_rows += sum(len(p.new_tokens) for p in plans)
        self._dispatched = [*self._dispatched[-2:], (now, decode)]
        if len(self._dispatched) == 3:  # the gap since the last dispatch is two steps back's
            (_, was_decode), (last, _), _ = self._dispatched
            if was_decode:
                self.decode_s += now - last
            else:
                self.prefill_s += now - last
        self.steps += 1
        for plan in plans:
            for row, n in plan.new_tokens.items():
                n -= plan.drafts.get(row, 0)  # drafted tokens are counted when verified
                if n > 1 or row not in plan.samples or plan.samples[row][1] == 0:
                    self.prefill_tokens += n
                else:
                    self.decode_tokens += n
        used = np.sum([p.used for p in plans], axis=0)  # over the replicas
        self.max_concurrent = max(self.max_concurrent, sum(len(p.new_tokens) for p in plans))
        self.peak_slots = tuple(int(x) for x in np.maximum(self.peak_slots, used))
        self.slot_steps = tuple(int(x) for x in np.add(self.slot_steps, used))
        self.step_slots.append(tuple(int(x) for x in used))

    def on_token(self, arrival: float, last: float | None, now: float, count: int = 1) -> None:
        """`count` tokens of one request arrived at `now` (its previous ones at `last`)."""
        self.output_tokens += count
        if last is None:
            self.ttft_s.append(now - arrival)
            self.itl_s += [0.0] * (count - 1)
        else:
            self.itl_s += [(now - last) / count] * count


class Recording:
    """An open `recording` block: its stats, the requests whose tokens it counts (None: all),
    and the schedulers' counters when it opened."""

    def __init__(self, stats: RunStats, ids: set | None, counters):
        self.stats, self.ids, self.counters = stats, ids, counters

    def on_output(self, r, t, now: float, logits, row: int, index: int):
        if r.finish_reason == "error":
            self.stats.errors += 1
            return
        count = max(len(r.output) - index, 1)
        self.stats.on_token(t.arrival, t.last, now, count)
        if self.stats.step_logits is not None and logits is not None:  # the last token's
            self.stats.step_logits.append((t.index, index + count - 1, logits[row]))
