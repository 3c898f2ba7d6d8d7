"""The KV byte budget: quota, its split into slots per pool group, and per-sequence KV bytes.

Owns (docs/design.md "Budget"):
  - `kv_quota_bytes`: the byte quota of all pool roots on one device (max_gpu_total_bytes and/or
    a fraction of the device's free memory); with tensor parallelism every byte count of the
    layout is per device too (`KVLayout.tp`), so slots come from a slot's per-device bytes.
  - `quota_for_tokens` / per-group demand: Q(T) = T*F + min(T, M)*S_ctx + B*R_w, the bytes a
    batch of B sequences holding T tokens of history with prefill chunk M needs.
  - `plan_num_slots`: slots per pool group from the quota, split by the pinned `pool_ratio` or by
    the default ratio (each group's share of Q for the expected batch; the chunked-prefill term
    always counts, so scratch reuse changes the split and is never inert).
  - `fitted_pool_ratio` / `adaptive_split`: the split for sequences of a given length at the
    batch the quota holds, and the policy of `pool_ratio="adaptive"` (grid, hysteresis).
  - `OnlineRebalance`: the policy of `pool_ratio="online"` (observed demand, moving average,
    threshold, cooldown, the same grid).
  - `kv_bytes_per_sequence` / `request_slots`: exact per-sequence slot counts, simulated step by
    step with the same stale / scratch range formulas as the transforms.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Sequence
from typing import NamedTuple

import jax

from gemma._hook import LayerSpec
from swajax._config import KVCacheConfig
from swajax._layout import KVLayout, build_layout, with_num_slots
from swajax._ledger import row_peak_slots

DEFAULT_FREE_MEMORY_FRACTION = 0.9
CPU_FREE_BYTES_CAP = 2 * 1024**3  # without device memory stats (CPU): min(host available, 2 GiB)
MODES = ("full", "release", "scratch")


def device_free_bytes(device=None) -> int:
    """Free memory of `device` (default: the first JAX device), bytes.

    Uses `device.memory_stats()` (bytes_limit - bytes_in_use) where available (GPU). Otherwise
    (CPU) the host's available physical memory, capped at CPU_FREE_BYTES_CAP so a CPU run never
    plans a pool of many GiB.
    """
    try:
        device = jax.devices()[0] if device is None else device
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - a backend without stats falls back below
        stats = None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    try:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        avail = CPU_FREE_BYTES_CAP
    return int(min(avail, CPU_FREE_BYTES_CAP))


def round_quota(nbytes: int) -> int:
    """A free-memory quota rounded down to 1/32 of the largest power of two in it (>= 64 MiB).

    Free memory moves by a few MiB between engines and processes; the rounded quota does not,
    so the same model and settings get the same layout (and reuse the same compiled steps).
    """
    if nbytes < 1:
        return int(nbytes)
    step = max(64 << 20, (1 << (int(nbytes).bit_length() - 1)) // 32)
    return max(int(nbytes) // step * step, min(int(nbytes), 64 << 20))


def kv_quota_bytes(kv_cache_config: KVCacheConfig, device=None) -> int:
    """Byte quota of all pool roots: max_gpu_total_bytes, fraction * free memory, or the min.

    The free-memory part is rounded down by `round_quota` (deterministic layouts).
    """
    cfg = kv_cache_config
    fraction = cfg.free_gpu_memory_fraction
    if cfg.max_gpu_total_bytes is not None and fraction is None:
        return int(cfg.max_gpu_total_bytes)
    if fraction is None:
        fraction = DEFAULT_FREE_MEMORY_FRACTION
    quota = round_quota(int(fraction * device_free_bytes(device)))
    if cfg.max_gpu_total_bytes is not None:
        quota = min(quota, int(cfg.max_gpu_total_bytes))
    return quota


# ----------------------------------------------------------------------------- Q(T)


def _bytes_per_token(layout: KVLayout, g: int) -> int:
    """F_g: bytes one token costs in every layer of group g."""
    return layout.slot_bytes(g) // layout.page_size


def group_demands(
    layout: KVLayout, total_tokens: int, batch: int, chunk: int, scratch: bool | None = None
) -> tuple[int, ...]:
    """Bytes per group for B = batch sequences holding T = total_tokens of history, chunk M.

    Full group: T * F. Sliding group: min(T, M) * S_ctx + B * R_w with S_ctx = F without
    scratch (the chunk in every layer) or, with scratch, one layer's bytes per token per pool
    (the chunk rotates through one layer's worth), and R_w = (W + max_rewind + tpb - 1) * F:
    the blocks a decoding row's window spans, averaged over where its history ends in a block
    (docs/design.md's ceil(W/tpb) * tpb undercounts the block it straddles; 6 % at W = 512, tpb 32).
    """
    scratch = layout.scratch if scratch is None else scratch
    tpb = layout.page_size
    out = []
    for g, group in enumerate(layout.groups):
        f = _bytes_per_token(layout, g)
        if not group.is_sliding:
            out.append(total_tokens * f)
            continue
        if scratch:
            s_ctx = sum(layout.pools[p].bytes_per_token_per_layer() for p in group.pools)
        else:
            s_ctx = f
        r_w = (group.window + layout.max_rewind + tpb - 1) * f
        out.append(min(total_tokens, chunk) * s_ctx + batch * r_w)
    return tuple(out)


def quota_for_tokens(
    layout: KVLayout, total_tokens: int, batch: int, chunk: int, scratch: bool | None = None
) -> int:
    """Q(T) = T*F + min(T, M)*S_ctx + B*R_w, bytes (docs/design.md "Budget")."""
    return sum(group_demands(layout, total_tokens, batch, chunk, scratch))


def default_pool_ratio(layout: KVLayout, kv_cache_config: KVCacheConfig) -> tuple[float, ...]:
    """Each group's share of Q for the expected batch (hints default to the layout's bounds)."""
    cfg = kv_cache_config
    batch = cfg.expected_batch_size or layout.max_batch
    length = cfg.expected_input_length or layout.max_context
    chunk = cfg.chunk_size or layout.max_chunk
    demands = group_demands(layout, batch * length, batch, chunk)
    total = sum(demands)
    return tuple(d / total for d in demands)


# With the prefix cache on, a pool may usefully hold this many times what its rows can: blocks
# no row reads stay cached until admission needs their slots.
CACHE_ROOM = 5


def _max_useful_slots(layout: KVLayout, g: int) -> int:
    """Slots group g can ever hold: every block of every row plus each row's scratch (times
    CACHE_ROOM with the prefix cache on)."""
    rows = layout.max_batch * (CACHE_ROOM if layout.cache_nodes else 1)
    return rows * (layout.max_blocks + layout.groups[g].scratch_slots)


def prefix_cache_nodes(layout: KVLayout) -> int:
    """`KVLayout.cache_nodes` of a layout with the prefix cache on: the most slots any split
    of any quota gives all groups together, so every cached block can have a node id."""
    rows = layout.max_batch * CACHE_ROOM
    return sum(rows * (layout.max_blocks + g.scratch_slots) for g in layout.groups)


def _split_slots(
    layout: KVLayout,
    quota: int,
    ratio: Sequence[float],
    *,
    redistribute: bool,
    minimum: Sequence[int] | None = None,
) -> list[int]:
    """Slots per group: the quota split in bytes by `ratio`, each group capped at what it could
    ever hold and raised to `minimum[g]`; with `redistribute` the bytes of the groups capped
    or raised are taken out first and the rest is split again among the others."""
    num_groups = len(layout.groups)
    slot_bytes = [layout.slot_bytes(g) for g in range(num_groups)]
    useful = [_max_useful_slots(layout, g) for g in range(num_groups)]
    minimum = [0] * num_groups if minimum is None else list(minimum)
    slots = [0] * num_groups
    open_groups = set(range(num_groups))
    budget = quota
    while open_groups:
        share = sum(ratio[g] for g in open_groups)
        fixed = set()
        for g in open_groups:
            slots[g] = int(budget * ratio[g] / share) // slot_bytes[g] if share > 0 else 0
            if slots[g] >= useful[g]:
                slots[g] = useful[g]
                fixed.add(g)
            elif slots[g] < minimum[g]:
                slots[g] = minimum[g]
                fixed.add(g)
        if not redistribute or not fixed:
            break
        budget -= sum(slots[g] * slot_bytes[g] for g in fixed)
        open_groups -= fixed
    return slots


def _check_slots(layout: KVLayout, quota: int, slots: Sequence[int]) -> tuple[int, ...]:
    for g, n in enumerate(slots):
        if n < 1:
            raise ValueError(
                f"KV quota of {quota} bytes gives pool group {g} (life cycle "
                f"{layout.groups[g].life_cycle}) {n} slots of {layout.slot_bytes(g)} bytes; raise "
                "max_gpu_total_bytes or free_gpu_memory_fraction, or change pool_ratio"
            )
    return tuple(slots)


def plan_num_slots(
    layout: KVLayout, kv_cache_config: KVCacheConfig, quota: int | None = None
) -> tuple[int, ...]:
    """Slots per pool group from the quota (default `kv_quota_bytes(kv_cache_config)`).

    The quota is split in bytes by `pool_ratio` (pinned) or `default_pool_ratio` (None, and
    "adaptive" until the engine has seen requests: see `adaptive_split`). No group gets more
    slots than it could ever hold; with the default ratio the bytes a group cannot use go to
    the others, and every group gets at least what one request of layout.max_context tokens
    needs alone (`longest_request_slots`), the bytes taken from the others, where the quota
    holds that: hints for short inputs must not leave a group too small for the longest request
    the engine accepts. Raises ValueError when a group would get no slot.
    """
    cfg = kv_cache_config
    quota = kv_quota_bytes(cfg) if quota is None else int(quota)
    num_groups = len(layout.groups)
    if cfg.pool_ratio is not None and not cfg.adaptive_pool_ratio:
        if len(cfg.pool_ratio) != num_groups:
            raise ValueError(
                f"pool_ratio must give one weight per pool group ({num_groups}: "
                f"{[g.life_cycle for g in layout.groups]}), got {cfg.pool_ratio}"
            )
        total = sum(cfg.pool_ratio)
        slots = _split_slots(layout, quota, [r / total for r in cfg.pool_ratio], redistribute=False)
    else:
        need = longest_request_slots(layout)
        fits = sum(n * layout.slot_bytes(g) for g, n in enumerate(need)) <= quota
        slots = _split_slots(
            layout,
            quota,
            default_pool_ratio(layout, cfg),
            redistribute=True,
            minimum=need if fits else None,
        )
    return _check_slots(layout, quota, slots)


def longest_request_slots(layout: KVLayout) -> tuple[int, ...]:
    """Peak slots per group of one request of layout.max_context tokens (prompt + new tokens),
    alone: a prompt of max_context - 1 tokens prefilled in chunks of layout.max_chunk (its last
    token is never stored, so no decode step adds to what the prompt holds)."""
    return request_slots(layout, max(layout.max_context - 1, 1))


# ----------------------------------------------------------------------------- fitted split


def fitted_batch(
    layout: KVLayout,
    length: float,
    quota: int,
    *,
    chunk: int | None = None,
    max_batch: int | None = None,
    scratch: bool | None = None,
) -> float:
    """How many sequences of `length` tokens the quota holds: the largest B in (0, max_batch]
    with Q(B * length) <= quota for batch B and prefill chunk `chunk` (docs/design.md "Budget").

    Fractional (Q is piecewise linear in B); max_batch defaults to layout.max_batch, chunk to
    layout.max_chunk, the mode to the layout's. 0 < B < 1 when not even one sequence fits.
    """
    if not length > 0 or quota < 1:
        raise ValueError(f"need length > 0 and quota >= 1, got {length!r}, {quota!r}")
    chunk = layout.max_chunk if chunk is None else chunk
    hi = float(layout.max_batch if max_batch is None else max_batch)
    return _largest_batch(
        lambda b: quota_for_tokens(layout, b * length, b, chunk, scratch) <= quota, hi
    )


def _largest_batch(fits, hi: float) -> float:
    """The largest B in (0, hi] with fits(B), for a demand increasing in B (bisection to well
    below one sequence); 0 when none fits."""
    if fits(hi):
        return hi
    lo = 0.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def fitted_pool_ratio(
    layout: KVLayout,
    length: float,
    quota: int,
    *,
    chunk: int | None = None,
    max_batch: int | None = None,
    scratch: bool | None = None,
) -> tuple[float, ...]:
    """The split of `quota` for sequences of `length` tokens (prompt + new tokens): each
    group's share of Q for B = `fitted_batch(...)` such sequences, the batch the quota holds.

    At this split a pool full of such sequences runs out of every group at once; any other
    split leaves bytes in one group that the other needed. Unlike `default_pool_ratio` it
    needs no batch hint: the batch follows from the quota.
    """
    b = max(
        fitted_batch(layout, length, quota, chunk=chunk, max_batch=max_batch, scratch=scratch), 1e-9
    )
    chunk = layout.max_chunk if chunk is None else chunk
    demands = group_demands(layout, b * length, b, chunk, scratch)
    total = sum(demands)
    return tuple(d / total for d in demands)


# ----------------------------------------------------------------------------- adaptive split

ADAPTIVE_GRID_STEPS = 8  # grid points per octave of each group's weight relative to group 0


class AdaptiveSplit(NamedTuple):
    """A split chosen by the adaptive policy: its grid point, weights and slots per group."""

    point: tuple[int, ...]  # round(steps * log2(w_g / w_0)) per group g
    ratio: tuple[float, ...]  # the weights of the grid point, normalised
    num_slots: tuple[int, ...]


def _log_weights(ratio: Sequence[float], steps: int) -> list[float]:
    return [steps * math.log2(r / ratio[0]) for r in ratio]


def rows_held(
    layout: KVLayout,
    slots: Sequence[int],
    length: float,
    *,
    chunk: int | None = None,
    headroom: float = 0.0,
    max_batch: int | None = None,
) -> float:
    """How many sequences of `length` tokens of history `slots` hold beside a prefill chunk,
    each group keeping `headroom` of its slots free (the admission rule's): the smallest over
    the groups of the largest B whose demand (`group_demands`) fits the group. Fractional."""
    chunk = layout.max_chunk if chunk is None else chunk
    hi = float(layout.max_batch if max_batch is None else max_batch)
    return min(
        _largest_batch(
            lambda b, g=g: (
                group_demands(layout, b * length, b, chunk)[g]
                <= slots[g] * layout.slot_bytes(g) * (1.0 - headroom)
            ),
            hi,
        )
        for g in range(len(layout.groups))
    )


def adaptive_split(
    layout: KVLayout,
    requests: Sequence[tuple[int, int]],
    quota: int,
    *,
    chunk: int | None = None,
    max_batch: int | None = None,
    need: Sequence[int] | None = None,
    current: AdaptiveSplit | None = None,
    steps: int = ADAPTIVE_GRID_STEPS,
    headroom: float = 0.0,
) -> AdaptiveSplit | None:
    """The pool split for queued `requests`, (prompt tokens, max_new_tokens) pairs.

    Policy (`pool_ratio="adaptive"`):
      1. the exact split is `fitted_pool_ratio` at the queue's mean occupancy, prompt + half
         of max_new_tokens (full layers hold the sum of the running rows' histories, and a
         running row is on average half-way through its decode; the window and chunk terms do
         not depend on it);
      2. it is snapped to a grid of `steps` points per octave of each group's weight relative
         to group 0 (within +-4.4 % at 8 steps), so nearby workloads give the same slots and
         reuse the same compiled layout. Of the grid points around the exact split (each weight
         rounded down or up) it takes the one whose slots hold the most whole rows, then the
         most rows (`rows_held` at the mean occupancy, with `headroom` of each group kept free as
         admissions keep it), then the nearest: rounding to the nearest
         point can take from a sliding group the few slots that the last row's window needed;
      3. hysteresis: None (keep `current`) while every weight of the exact split lies within one
         grid step of `current`'s and `current` holds `need`;
      4. every group gets at least `need[g]` slots, by default what the longest prompt with the
         most new tokens needs alone (`request_slots`, prefill chunks of layout.max_chunk); the
         bytes come from the other groups (ValueError if the quota cannot hold that).
    chunk: prefill tokens of one step (default layout.max_chunk); max_batch: rows served at
    once (default layout.max_batch).
    """
    if not requests or any(n < 1 or k < 1 for n, k in requests):
        raise ValueError(
            "requests must be a non-empty list of (prompt tokens >= 1, max_new_tokens >= 1), "
            f"got {list(requests)[:8]}"
        )
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    num_groups = len(layout.groups)
    if need is None:
        prompt, new = max(n for n, _ in requests), max(k for _, k in requests)
        need = request_slots(layout, prompt, max_new_tokens=new - 1)
    occupancy = sum(n + k / 2 for n, k in requests) / len(requests)
    exact = fitted_pool_ratio(layout, occupancy, quota, chunk=chunk, max_batch=max_batch)
    x = _log_weights(exact, steps)
    if (
        current is not None
        and all(abs(a - e) <= 1.0 for a, e in zip(x, current.point, strict=True))
        and all(n >= k for n, k in zip(current.num_slots, need, strict=True))
    ):
        return None
    best = None
    for point in itertools.product(*[sorted({math.floor(a), math.ceil(a)}) for a in x]):
        weights = [2.0 ** (e / steps) for e in point]
        ratio = tuple(w / sum(weights) for w in weights)
        slots = _split_slots(layout, quota, ratio, redistribute=True, minimum=need)
        held = sum(n * layout.slot_bytes(g) for g, n in enumerate(slots))
        if held > quota or any(n < k for n, k in zip(slots, need, strict=True)):
            continue
        rows = rows_held(
            layout, slots, occupancy, chunk=chunk, headroom=headroom, max_batch=max_batch
        )
        distance = sum(abs(e - a) for e, a in zip(point, x, strict=True))
        key = (math.floor(rows + 1e-9), rows, -distance)
        if best is None or key > best[0]:
            best = (key, point, ratio, slots)
    if best is None:
        raise ValueError(
            f"KV quota of {quota} bytes cannot hold one request needing {list(need)} slots per "
            f"pool group of {[layout.slot_bytes(g) for g in range(num_groups)]} bytes"
        )
    _, point, ratio, slots = best
    return AdaptiveSplit(tuple(point), ratio, _check_slots(layout, quota, slots))


class OnlineRebalance:
    """The policy of `pool_ratio="online"`: the split follows the observed slot demand.

    Each step the engine reports every group's demand in slots (`observe`): the slots its
    running rows hold plus what the queue's next admissions need alone (`request_slots`), the
    slots only the prefix cache holds left out (they are evictable). The policy keeps an exponential
    moving average of each group's demand in bytes (weight `ema` per step). `propose` returns a
    new split when
      1. at least `cooldown` steps passed since the last one (or `force`: a queued request
         does not fit the split at all), and
      2. some group's byte share of the average differs from its share of the current split by
         more than `threshold` (relative);
    the new split is the average's shares snapped to the adaptive grid (`ADAPTIVE_GRID_STEPS`
    points per octave relative to group 0, so that nearby demands reuse one compiled layout),
    each group raised to `minimum[g]` (its slots in use, its admission headroom, the largest
    queued request's need), the bytes taken from the others. The re-split itself moves the
    pages of running rows (`swajax._transforms.resize`).
    """

    def __init__(
        self,
        quota: int,
        *,
        ema: float,
        threshold: float,
        cooldown: int,
        steps: int = ADAPTIVE_GRID_STEPS,
    ):
        self.quota, self.ema, self.threshold, self.cooldown = quota, ema, threshold, cooldown
        self.steps = steps
        self.average: list[float] | None = None  # bytes per group
        self.since = cooldown  # steps since the last re-split

    def observe(self, layout: KVLayout, demand: Sequence[float]) -> None:
        """One step's demand, slots per group."""
        nbytes = [d * layout.slot_bytes(g) for g, d in enumerate(demand)]
        if self.average is None:
            self.average = nbytes
        else:
            self.average = [
                a + self.ema * (b - a) for a, b in zip(self.average, nbytes, strict=True)
            ]
        self.since += 1

    def propose(
        self, layout: KVLayout, minimum: Sequence[int], *, force: bool = False
    ) -> tuple[int, ...] | None:
        """The slot counts of a new split, or None to keep the current one."""
        if self.average is None or (not force and self.since < self.cooldown):
            return None
        total = sum(self.average)
        if total <= 0:
            return None
        num_groups = len(layout.groups)
        pool = [layout.slot_bytes(g) * layout.groups[g].num_slots for g in range(num_groups)]
        # a group with no demand keeps a sliver of weight (its minimum slots come below)
        target = [max(a / total, 1e-3) for a in self.average]
        shares = [b / sum(pool) for b in pool]
        moved = any(abs(t / c - 1.0) > self.threshold for t, c in zip(target, shares, strict=True))
        if not moved and not force:
            return None
        point = [round(x) for x in _log_weights(target, self.steps)]
        weights = [2.0 ** (e / self.steps) for e in point]
        ratio = [w / sum(weights) for w in weights]
        slots = _split_slots(layout, self.quota, ratio, redistribute=True, minimum=minimum)
        nbytes = sum(n * layout.slot_bytes(g) for g, n in enumerate(slots))
        current = tuple(g.num_slots for g in layout.groups)
        if nbytes > self.quota or tuple(slots) == current:
            return None
        return tuple(slots)

    def resplit(self) -> None:
        """A proposed split was applied: the cooldown starts again."""
        self.since = 0


# ----------------------------------------------------------------------------- per sequence


class KVBytes(NamedTuple):
    """KV bytes of one sequence: after its prefill (steady) and at most during it (peak)."""

    steady: int
    peak: int


def _chunks(input_len: int, chunk: int) -> list[int]:
    return [min(chunk, input_len - s) for s in range(0, input_len, chunk)]


def request_slots(
    layout: KVLayout, input_len: int, *, chunk: int | None = None, max_new_tokens: int = 0
) -> tuple[int, ...]:
    """Peak slots per group one request needs alone: prefill in chunks, then decode.

    chunk defaults to layout.max_chunk; the mode follows layout.scratch. For admission.
    """
    chunk = layout.max_chunk if chunk is None else chunk
    if input_len < 0 or chunk < 1 or max_new_tokens < 0:
        raise ValueError(
            f"need input_len >= 0, chunk >= 1, max_new_tokens >= 0, got {input_len}, {chunk}, "
            f"{max_new_tokens}"
        )
    return steps_slots(layout, _chunks(input_len, chunk) + [1] * max_new_tokens)


def steps_slots(layout: KVLayout, steps: Sequence[int]) -> tuple[int, ...]:
    """Peak slots per group of one row that grows by `steps[i]` tokens at step i, from empty.

    The mode follows layout.scratch. A first step of k tokens also bounds a row that starts
    from a shared k-token prefix (it holds at most what a k-token chunk would).
    """
    if any(n < 0 for n in steps):
        raise ValueError(f"steps must be token counts >= 0, got {list(steps)}")
    _, peak = row_peak_slots(layout, steps)
    return peak


def kv_bytes_per_sequence(
    layout_or_specs: KVLayout | Sequence[LayerSpec],
    input_len: int,
    chunk: int | None = None,
    mode: str = "scratch",
    *,
    kv_cache_config: KVCacheConfig | None = None,
) -> KVBytes:
    """KV bytes of one sequence of input_len tokens prefilled in chunks of `chunk` tokens.

    mode: "full" (every layer keeps everything), "release" (out-of-window release), "scratch"
    (release + SWA scratch reuse). Returns KVBytes(steady, peak): bytes held after the prefill
    and at most during it (after a step's reserve). From specs, the layout uses kv_cache_config
    (default KVCacheConfig(): page size 32, bf16); chunk defaults to layout.max_chunk (specs:
    input_len).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if not isinstance(input_len, int) or input_len < 0:
        raise ValueError(f"input_len must be an int >= 0, got {input_len!r}")
    if isinstance(layout_or_specs, KVLayout):
        layout = layout_or_specs
        if mode == "scratch" and not layout.scratch:
            raise ValueError(
                "mode='scratch' needs a layout built with scratch on (its scratch descriptors "
                "bound the range); got a layout with scratch off: use mode='release' or build "
                "the layout with scratch=True"
            )
    else:
        layout = build_layout(
            layout_or_specs,
            kv_cache_config or KVCacheConfig(),
            max_context=max(input_len, 1),
            max_batch=1,
            max_chunk=max(chunk or input_len, 1),
            num_slots=1,
            scratch=mode == "scratch",
        )
    chunk = layout.max_chunk if chunk is None else chunk
    if not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be an int >= 1, got {chunk!r}")
    steady, peak = row_peak_slots(layout, _chunks(input_len, chunk), mode)
    size = [layout.slot_bytes(g) for g in range(len(layout.groups))]
    return KVBytes(
        sum(n * b for n, b in zip(steady, size, strict=True)),
        sum(n * b for n, b in zip(peak, size, strict=True)),
    )


class PoolSplit:
    """The byte quota and its split across pool groups: pinned, adaptive (re-split while idle)
    or online (re-split between steps, `OnlineRebalance`); the admission headroom that goes
    with a split."""

    def __init__(self, quota: int, adaptive: bool, fraction: float, online=None):
        self.quota, self.adaptive, self.fraction = quota, adaptive, fraction
        self.current = None  # the adaptive split in effect
        self.headroom: tuple[int, ...] = ()
        self.online: OnlineRebalance | None = online  # pool_ratio="online"

    @classmethod
    def of(cls, kv: KVCacheConfig, fraction: float) -> PoolSplit:
        """The split of `kv`'s quota, read once (a re-split pool must not see the old pool as
        used memory), with its policy."""
        quota = kv_quota_bytes(kv)
        online = None
        if kv.online_pool_ratio:
            online = OnlineRebalance(
                quota,
                ema=kv.rebalance_ema,
                threshold=kv.rebalance_threshold,
                cooldown=kv.rebalance_cooldown,
            )
        return cls(quota, kv.adaptive_pool_ratio, fraction, online)

    def check(self, layout, need, have, prompt_len: int, max_new_tokens: int) -> None:
        """ValueError when a request needing `need` slots per group can never fit."""
        what = f"a request of {prompt_len} prompt tokens + {max_new_tokens} new tokens"
        fix = "raise max_gpu_total_bytes / free_gpu_memory_fraction or shorten the request"
        if self.adaptive:  # the next split gives it what it needs if the quota holds that
            nbytes = sum(n * layout.slot_bytes(g) for g, n in enumerate(need))
            if nbytes > self.quota:
                raise ValueError(
                    f"{what} needs {nbytes} bytes of KV ({list(need)} slots per pool group) "
                    f"but the quota is {self.quota} bytes; {fix}"
                )
            return
        for g, (n, h) in enumerate(zip(need, have, strict=True)):
            if n > h:
                raise ValueError(
                    f"{what} needs {n} slots of pool group {g} (life cycle "
                    f"{layout.groups[g].life_cycle}) but the pool has {h}; {fix}"
                )

    def rebalanced(self, layout, demand, minimum, force: bool):
        """pool_ratio="online": observes one step's slot demand (`Scheduler.slot_demand`) and
        returns the layout of the split the policy proposes, or None to keep the split."""
        self.online.observe(layout, demand)
        slots = self.online.propose(layout, minimum, force=force)
        return None if slots is None else with_num_slots(layout, slots)

    def split(self, layout, requests, config):
        """The slot counts the policy picks for these requests, or None to keep the split."""
        split = adaptive_split(
            layout,
            requests,
            self.quota,
            chunk=config.max_num_tokens,
            max_batch=config.max_batch,
            current=self.current,
            headroom=self.fraction,
        )
        if split is None:
            return None
        self.current = split
        return tuple(split.num_slots)


def make_layout(layer_specs, kv_cache_config: KVCacheConfig | None = None, **kw) -> KVLayout:
    """The layout of a model's KV cache (`swajax._layout.build_layout`'s arguments) with, unless
    `num_slots` is given, the slot counts the byte budget gives (`plan_num_slots`)."""
    cfg = KVCacheConfig() if kv_cache_config is None else kv_cache_config
    if kw.get("num_slots") is not None:
        return build_layout(layer_specs, cfg, **kw)
    layout = build_layout(layer_specs, cfg, **kw)
    return with_num_slots(layout, plan_num_slots(layout, cfg))
