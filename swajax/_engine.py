"""The generation engine: admission in waves, chunked prefill, decode, on one KV pool.

Owns the jitted step (free finished rows, reserve, page-table gather, paged forward, sample,
advance) and the host loop that schedules requests onto batch rows.

A step is one call of a compiled function whose pool state is donated (updated in place).
Its shapes depend only on the token bucket T and on whether the step is decode-only, so a
run compiles a handful of variants and decode steps never recompile (`Engine.trace_count`);
the compiled steps are shared by engines of the same model structure and layout.

Admission is decided in slots, never by running out of memory: a request is admitted into a
free row only when, for every pool group, the peak slots of the admitted requests plus its
own (`request_slots`, simulated from the layout) fit the group. A request that does not fit
waits for others to finish: a batch larger than the pool is served in waves, never dropped.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from swajax._budget import request_slots, steps_slots
from swajax._config import KVCacheConfig, resolve_scratch_policy
from swajax._layout import KVLayout, make_layout
from swajax._paged import make_attention_fn, token_positions
from swajax._sampling import SamplingParams, sample
from swajax._scratch import BAD
from swajax._state import KVPoolState, init_state
from swajax._transforms import (
    advance,
    free_rows,
    reserve,
    row_slots,
    share_prefix,
    step_metadata,
    step_page_tables,
)

MIN_BUCKET = 8


def _bucket(n: int) -> int:
    """Static token-axis length for n tokens: the next power of two (at least MIN_BUCKET)."""
    return max(MIN_BUCKET, 1 << max(n - 1, 0).bit_length())


def _step(
    params,
    state: KVPoolState,
    tokens,
    new_tokens,
    finished,
    key,
    sampling,
    tables=None,
    *,
    graphdef,
    layout: KVLayout,
    decode: bool,
    implementation: str,
    return_logits: bool = False,
    sampling_mode: str = "filter",
):
    """One engine step; returns (state, next_tokens, ok, row_logits, free, tables).

    next_tokens i32[B], ok bool[], free i32[G] slots free after the reserve, tables the step's
    per-pool page tables. `tables`, the previous step's (donated), lets the gather update them in
    place (per_layer mode).

    tokens: i32[T] packed new tokens; new_tokens: i32[B] per row; finished: bool[B] rows to free
    first. next_tokens[b] is sampled from the logits of row b's last new token; row_logits
    (f32[B, V]) are returned only with `return_logits` (tests, analysis), else None.
    """
    state = free_rows(layout, state, finished)
    ok, state = reserve(layout, state, new_tokens)
    free_after_reserve = state.free_count
    meta = step_metadata(layout, state)
    tables = step_page_tables(layout, state, implementation=implementation, out=tables)
    num_tokens = tokens.shape[0]
    positions = token_positions(meta, num_tokens)
    attention_fn = make_attention_fn(
        layout,
        tables,
        meta,
        state.k_scales,
        state.v_scales,
        decode=decode,
        implementation=implementation,
    )
    model = nnx.merge(graphdef, params)
    last = jnp.clip(meta.q_starts[1:] - 1, 0, num_tokens - 1)  # [B]
    logits, pools = model.forward(
        tokens,
        positions,
        attention_fn=attention_fn,
        attention_state=state.pools,
        logits_indices=last,
    )  # [B, V]: only each row's last new token is unembedded
    next_tokens = sample(logits, key, **sampling, mode=sampling_mode)
    state = advance(layout, dataclasses.replace(state, pools=tuple(pools)))
    logits = logits if return_logits else None
    return state, next_tokens, ok, logits, free_after_reserve, tables


# One compiled step per (model structure, layout, bucket, mode), shared by every engine: repeated
# `swajax.generate` calls with the same shapes reuse it instead of recompiling.
_TRACES: collections.Counter = collections.Counter()


def _traced_step(*args, **kwargs):
    _TRACES[kwargs["layout"]] += 1
    return _step(*args, **kwargs)


def initial_tables(layout: KVLayout):
    """All-BAD per-pool page tables, the `tables` of a first step (None in shared mode)."""
    if layout.page_table_mode != "per_layer":
        return None
    shape = (layout.max_batch, 2, layout.max_blocks)
    return tuple(jnp.full((p.num_layers, *shape), BAD, jnp.int32) for p in layout.pools)


@functools.lru_cache(maxsize=64)
def step_function(
    graphdef,
    layout: KVLayout,
    *,
    decode: bool,
    implementation: str,
    logits: bool,
    sampling_mode: str = "filter",
):
    """The jitted step with its static arguments bound (state and tables donated).

    Bound once per engine and mode: hashing a model's GraphDef costs about 1.6 ms (Gemma 3
    4B), which a jit call with static arguments would pay at every decode step. The cache
    keeps up to 64 (model structure, layout, mode) steps and their executables alive.
    """
    bound = functools.partial(
        _traced_step,
        graphdef=graphdef,
        layout=layout,
        decode=decode,
        implementation=implementation,
        return_logits=logits,
        sampling_mode=sampling_mode,
    )
    return jax.jit(bound, donate_argnums=(1, 7))


@dataclasses.dataclass
class _Request:
    index: int
    prompt: list[int]
    max_new_tokens: int
    need: tuple[int, ...]
    fed: int = 0
    out: list[int] = dataclasses.field(default_factory=list)
    reuse: int = 0  # tokens of a cached prefix this request may start from (0: none)
    park_at: int = 0  # a prefill step ends here and the prefix is parked for reuse (0: never)

    @property
    def done(self) -> bool:
        return len(self.out) >= self.max_new_tokens

    def next_piece(self, chunk: int) -> list[int]:
        """Prompt tokens of the next prefill step (a step ends exactly at park_at)."""
        limit = self.park_at if self.fed < self.park_at else len(self.prompt)
        return self.prompt[self.fed : min(self.fed + chunk, limit)]


def _prefill_steps(prompt_len: int, chunk: int, start: int, park_at: int) -> list[int]:
    """Tokens per prefill step of a request starting from a `start`-token shared prefix."""
    steps, fed = ([start] if start else []), start
    while fed < prompt_len:
        limit = park_at if fed < park_at else prompt_len
        steps.append(min(chunk, limit - fed))
        fed += steps[-1]
    return steps


def _common_prefix(a: list[int], b) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@dataclasses.dataclass
class RunStats:
    """What one `Engine.run` did: steps, tokens, time, peak slots held per pool group."""

    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    seconds: float = 0.0
    peak_slots: tuple[int, ...] = ()
    slot_steps: tuple[int, ...] = ()  # per group: sum over steps of the slots held in the step
    num_slots: tuple[int, ...] = ()
    max_concurrent: int = 0
    prefix_hits: int = 0  # requests that started from a cached prefix
    prefix_tokens: int = 0  # prompt tokens they did not prefill
    step_logits: list | None = None

    @property
    def tokens_per_second(self) -> float:
        return (self.prefill_tokens + self.decode_tokens) / max(self.seconds, 1e-9)


class Engine:
    """Serves prompts on a paged KV pool sized from a `KVCacheConfig`.

    Args:
      model: a model with `config.layer_specs`, `config.vocab_size`, `config.max_context`
        and `forward(tokens, positions, *, attention_fn, attention_state, logits_indices)`
        (e.g. `gemma.Transformer`).
      kv_cache_config: the KV cache settings (page size, byte quota, scratch policy, dtype...).
      max_context: longest sequence this engine serves (prompt + new tokens).
      max_batch: batch rows (default kv_cache_config.max_batch, else 16).
      prefill_chunk_size: prompt tokens per row per step (default kv_cache_config.chunk_size,
        else 512).
      implementation: kernels: "reference", "pallas" or "auto".
      min_prefill_bucket: smallest token-axis length of a prefill step (steps are padded to
        powers of two from here; a large value means one compiled prefill variant).
      prefix_cache_rows: extra batch rows that park shared prompt prefixes for reuse (0: no
        prefix cache). A prompt whose block-aligned prefix it shares with another prompt (or a
        parked one) starts from that prefix: its source ends a prefill step exactly at the
        boundary and the prefix's blocks are shared by reference (`share_prefix`). The window
        ending at the boundary is then in normal pages, so prefixes hit with scratch reuse on.
        Parked prefixes hold slots and are evicted (least recently used) when a request needs
        them.
    """

    def __init__(
        self,
        model,
        kv_cache_config: KVCacheConfig,
        *,
        max_context: int,
        max_batch: int | None = None,
        prefill_chunk_size: int | None = None,
        implementation: str = "auto",
        min_prefill_bucket: int = MIN_BUCKET,
        prefix_cache_rows: int = 0,
    ):
        config = model.config
        if not isinstance(prefix_cache_rows, int) or prefix_cache_rows < 0:
            raise ValueError(f"prefix_cache_rows must be an int >= 0, got {prefix_cache_rows!r}")
        if prefill_chunk_size is None:
            prefill_chunk_size = kv_cache_config.chunk_size or 512
        if not isinstance(prefill_chunk_size, int) or prefill_chunk_size < 1:
            raise ValueError(f"prefill_chunk_size must be an int >= 1, got {prefill_chunk_size!r}")
        max_batch = max_batch or kv_cache_config.max_batch or 16
        scratch = resolve_scratch_policy(
            kv_cache_config,
            is_multimodal=getattr(config, "is_multimodal", False),
            has_external_kv_draft=getattr(config, "has_external_kv_draft", False),
        )
        self.chunk = min(prefill_chunk_size, max_context)
        self.layout = make_layout(
            config.layer_specs,
            kv_cache_config,
            max_context=max_context,
            max_batch=max_batch + prefix_cache_rows,
            max_chunk=self.chunk,
            scratch=scratch,
        )
        self.serving_rows = max_batch
        # Parked prefixes: prompt prefix -> cache row, least recently used first.
        self.prefix_entries: collections.OrderedDict[tuple[int, ...], int] = (
            collections.OrderedDict()
        )
        self._entry_slots: dict[int, np.ndarray] = {}
        self.vocab_size = config.vocab_size
        self.implementation = implementation
        self.min_prefill_bucket = min_prefill_bucket
        self.graphdef, self.params = nnx.split(model)
        self._steps: dict[tuple[bool, bool, str], Callable] = {}
        self.state = init_state(self.layout)
        # The previous step's page tables, updated in place by the gather (per_layer mode).
        self.tables = initial_tables(self.layout)
        self._need_cache: dict[tuple[int, ...], tuple[int, ...]] = {}
        self._traces_at_start = _TRACES[self.layout]

    @property
    def trace_count(self) -> int:
        """Traces of the step for this engine's layout since the engine was made."""
        return _TRACES[self.layout] - self._traces_at_start

    @property
    def num_slots(self) -> tuple[int, ...]:
        return tuple(g.num_slots for g in self.layout.groups)

    def request_need(self, prompt_len: int, max_new_tokens: int) -> tuple[int, ...]:
        """Peak slots per pool group of one request (cached per shape).

        The last prefill step samples the first new token, so a request runs
        max_new_tokens - 1 decode steps.
        """
        k = (prompt_len, max_new_tokens)
        if k not in self._need_cache:
            self._need_cache[k] = request_slots(
                self.layout, prompt_len, chunk=self.chunk, max_new_tokens=max_new_tokens - 1
            )
        return self._need_cache[k]

    def check_fits(self, prompt_len: int, max_new_tokens: int) -> None:
        """ValueError if one request alone can never fit the pool or the context."""
        total = prompt_len + max_new_tokens
        if total > self.layout.max_context:
            raise ValueError(
                f"prompt of {prompt_len} tokens + max_new_tokens={max_new_tokens} = {total} "
                f"exceeds the engine's max_context={self.layout.max_context}"
            )
        need = self.request_need(prompt_len, max_new_tokens)
        for g, (n, have) in enumerate(zip(need, self.num_slots, strict=True)):
            if n > have:
                raise ValueError(
                    f"a request of {prompt_len} prompt tokens + {max_new_tokens} new tokens needs "
                    f"{n} slots of pool group {g} (life cycle {self.layout.groups[g].life_cycle}) "
                    f"but the pool has {have}; raise max_gpu_total_bytes / "
                    "free_gpu_memory_fraction or shorten the request"
                )

    def lower_step(self, num_tokens: int, *, decode: bool, lowering_platforms=None):
        """The `jax.stages.Lowered` step for a token bucket, for HLO and memory inspection.

        lowering_platforms: e.g. ("cuda",) to lower for a GPU on a machine without one (with
        `pallas_kernels._checks.force_compiled()` for the Mosaic GPU kernels).
        """
        b = self.layout.max_batch
        step = self._step_function(decode, False, SamplingParams().mode)
        return step.trace(
            self.params,
            self.state,
            jnp.zeros((num_tokens,), jnp.int32),
            jnp.zeros((b,), jnp.int32),
            jnp.zeros((b,), bool),
            jax.random.key(0),
            SamplingParams().as_arrays(),
            self.tables,
        ).lower(lowering_platforms=lowering_platforms)

    def _step_function(self, decode: bool, logits: bool, sampling_mode: str):
        key = (decode, logits, sampling_mode)
        if key not in self._steps:
            self._steps[key] = step_function(
                self.graphdef,
                self.layout,
                decode=decode,
                implementation=self.implementation,
                logits=logits,
                sampling_mode=sampling_mode,
            )
        return self._steps[key]

    def _plan_prefixes(self, requests: list[_Request]) -> None:
        """Sets each request's `reuse` (a shared block-aligned prefix) and `park_at`."""
        tpb = self.layout.page_size
        for i, r in enumerate(requests):
            limit = len(r.prompt) - 1  # the last prompt token is always computed
            best, source = 0, None
            for key in self.prefix_entries:
                if len(key) <= limit and r.prompt[: len(key)] == list(key) and len(key) > best:
                    best, source = len(key), None
            for s in requests[:i]:
                k = min(_common_prefix(r.prompt, s.prompt), limit, len(s.prompt) - 1)
                k = k // tpb * tpb
                if k > best:
                    best, source = k, s
            r.reuse = best
            if source is not None:
                source.park_at = max(source.park_at, best)

    def _need(self, r: _Request, hit: bool) -> tuple[int, ...]:
        """Peak slots per group of request r's planned steps (from its shared prefix if hit)."""
        n = len(r.prompt)
        k = (n, r.max_new_tokens, r.park_at, r.reuse if hit else 0)
        if k not in self._need_cache:
            decode = [1] * (r.max_new_tokens - 1)
            need = steps_slots(self.layout, _prefill_steps(n, self.chunk, 0, r.park_at) + decode)
            if hit:  # also cover the fallback to a full prefill if the share fails
                shared = _prefill_steps(n, self.chunk, r.reuse, r.park_at) + decode
                need = tuple(np.maximum(need, steps_slots(self.layout, shared)))
            self._need_cache[k] = need
        return self._need_cache[k]

    def _evict(self, keep=None) -> bool:
        """Frees the least recently used parked prefix other than `keep`; False if none."""
        for key, row in self.prefix_entries.items():
            if key != keep:
                del self.prefix_entries[key]
                del self._entry_slots[row]
                self._free_rows([row])
                return True
        return False

    def clear_prefix_cache(self) -> None:
        """Drops every parked prefix, returning its slots (shared blocks stay with other rows)."""
        while self._evict():
            pass

    def _free_rows(self, rows) -> None:
        mask = np.zeros(self.layout.max_batch, bool)
        mask[list(rows)] = True
        self.state = _free_jit(self.layout, self.state, jnp.asarray(mask))

    def _share(self, src: int, dst: int, num_tokens: int) -> bool:
        ok, self.state = _share_jit(
            self.layout, self.state, jnp.int32(src), jnp.int32(dst), jnp.int32(num_tokens)
        )
        return bool(ok)

    def _park(self, row: int, r: _Request) -> None:
        """Parks the first r.park_at tokens of row's history in a cache row."""
        key = tuple(r.prompt[: r.park_at])
        if key in self.prefix_entries:
            return
        used = set(self.prefix_entries.values())
        free = [c for c in range(self.serving_rows, self.layout.max_batch) if c not in used]
        if not free:
            self._evict()
            used = set(self.prefix_entries.values())
            free = [c for c in range(self.serving_rows, self.layout.max_batch) if c not in used]
        if self._share(row, free[0], r.park_at):
            self.prefix_entries[key] = free[0]
            self._entry_slots[free[0]] = np.asarray(_row_slots_jit(self.layout, self.state))[
                :, free[0]
            ]

    def run(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        *,
        sampling: SamplingParams | None = None,
        seed: int = 0,
        collect_logits: bool = False,
        progress: bool = False,
    ) -> tuple[list[list[int]], RunStats]:
        """Generates max_new_tokens tokens for every prompt; returns (outputs, stats)."""
        sampling = sampling or SamplingParams()
        for p in prompts:
            self.check_fits(len(p), max_new_tokens)
        sampling_arrays = sampling.as_arrays()
        base_key = jax.random.key(seed)
        layout, num_rows = self.layout, self.serving_rows
        caching = layout.max_batch > num_rows
        requests = [
            _Request(i, list(p), max_new_tokens, self.request_need(len(p), max_new_tokens))
            for i, p in enumerate(prompts)
        ]
        if caching:
            self._plan_prefixes(requests)
        waiting = collections.deque(requests)
        rows: list[_Request | None] = [None] * num_rows
        held = np.zeros(len(self.num_slots), np.int64)
        capacity = np.asarray(self.num_slots)
        finished = np.zeros(layout.max_batch, bool)
        outputs: list[list[int]] = [[] for _ in prompts]
        zeros = (0,) * len(capacity)
        stats = RunStats(num_slots=self.num_slots, peak_slots=zeros, slot_steps=zeros)
        stats.step_logits = [] if collect_logits else None
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(prompts) * max_new_tokens, unit="tok", desc="generate")
        t0 = time.perf_counter()
        while waiting or any(r is not None for r in rows):
            if caching and finished.any():  # rows must be empty before a prefix is shared in
                self._free_rows(np.flatnonzero(finished))
                finished[:] = False
            for b in range(num_rows):
                if rows[b] is not None or not waiting:
                    continue
                r = waiting[0]
                key = tuple(r.prompt[: r.reuse])
                entry = self.prefix_entries.get(key) if r.reuse else None
                if caching:
                    r.need = self._need(r, hit=entry is not None)
                while not np.all(held + r.need + sum(self._entry_slots.values(), 0) <= capacity):
                    if not self._evict(keep=key if entry is not None else None):
                        break
                if not np.all(held + r.need + sum(self._entry_slots.values(), 0) <= capacity):
                    break
                rows[b] = waiting.popleft()
                held += r.need
                if entry is not None and self._share(entry, b, r.reuse):
                    self.prefix_entries.move_to_end(key)
                    r.fed = r.reuse
                    stats.prefix_hits += 1
                    stats.prefix_tokens += r.reuse
            active = [b for b in range(num_rows) if rows[b] is not None]
            if not active:  # cannot happen: check_fits guarantees one request fits an empty pool
                raise RuntimeError("no request could be admitted into an empty pool")
            stats.max_concurrent = max(stats.max_concurrent, len(active))
            new_tokens = np.zeros(layout.max_batch, np.int32)
            chunks = []
            for b in active:
                r = rows[b]
                piece = r.next_piece(self.chunk) if r.fed < len(r.prompt) else [r.out[-1]]
                new_tokens[b] = len(piece)
                chunks.append(piece)
            decode = bool(np.all(new_tokens <= 1))
            flat = [t for piece in chunks for t in piece]
            size = (
                _bucket(len(flat)) if decode else _bucket(max(len(flat), self.min_prefill_bucket))
            )
            tokens = np.zeros(size, np.int32)
            tokens[: len(flat)] = flat
            key = jax.random.fold_in(base_key, stats.steps)
            step = self._step_function(decode, collect_logits, sampling.mode)
            self.state, next_tokens, ok, logits, free, tables = step(
                self.params,
                self.state,
                jnp.asarray(tokens),
                jnp.asarray(new_tokens),
                jnp.asarray(finished),
                key,
                sampling_arrays,
                self.tables,
            )
            if self.tables is not None:
                self.tables = tables
            next_tokens = np.asarray(next_tokens)
            if not bool(ok):
                raise RuntimeError(
                    "internal error: a step's slot reservation failed despite admission control "
                    f"(new_tokens={new_tokens.tolist()}); the pool state is unchanged"
                )
            used = capacity - np.asarray(free)
            stats.peak_slots = tuple(int(x) for x in np.maximum(stats.peak_slots, used))
            stats.slot_steps = tuple(int(x) for x in np.add(stats.slot_steps, used))
            stats.steps += 1
            finished[:] = False
            for b in active:
                r = rows[b]
                if r.fed < len(r.prompt):
                    r.fed += int(new_tokens[b])
                    stats.prefill_tokens += int(new_tokens[b])
                    if caching and r.park_at and r.fed == r.park_at:
                        self._park(b, r)
                    if r.fed < len(r.prompt):
                        continue
                else:
                    stats.decode_tokens += 1
                r.out.append(int(next_tokens[b]))
                if collect_logits:
                    stats.step_logits.append((r.index, len(r.out) - 1, np.asarray(logits[b])))
                if bar is not None:
                    bar.update(1)
                if r.done:
                    outputs[r.index] = r.out
                    rows[b] = None
                    held -= r.need
                    finished[b] = True
        if finished.any():
            self._free_rows(np.flatnonzero(finished))
        jax.block_until_ready(self.state)
        stats.seconds = time.perf_counter() - t0
        if bar is not None:
            bar.close()
        return outputs, stats


@functools.partial(jax.jit, static_argnums=0, donate_argnums=1)
def _share_jit(layout, state, src, dst, num_tokens):
    return share_prefix(layout, state, src, dst, num_tokens)


@functools.partial(jax.jit, static_argnums=0)
def _row_slots_jit(layout, state):
    return row_slots(layout, state)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=1)
def _free_jit(layout, state, rows):
    return free_rows(layout, state, rows)
