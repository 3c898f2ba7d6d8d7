"""The model runner: the pool's device state and the compiled steps that advance it.

`ModelRunner.run(plans)` turns the schedulers' plans (one per data-parallel replica) into one
step on the device and returns what the step before it produced: steps are pipelined, so the
device always has the next step queued while the host reads results and plans. A step whose
shape has not run yet may compile for seconds; the runner then reads the step in flight first,
so its tokens (often a request's first) do not wait for the compile.

Compiled steps: `swajax._runner.step_function` keeps one jitted step per (model structure,
layout, decode, implementation, sampling mode, logits, mesh), shared by every runner of that
model and layout (with the step cache, `swajax._step_cache`, as its on-disk layer; JAX's
persistent compilation cache below it). The runner keeps, per step shape
`StepShape(num_tokens, decode, logits, mode)`, the callable resolved for it (the step cache's
exported step or the jit); a new layout (an adaptive re-split) starts that map afresh.

The pool state (pool roots, page tables, previous tokens) is donated to every step; on a mesh
it holds every replica's arrays concatenated along their first axis (`swajax._sharding`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import signal
import threading
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from swajax import _sharding
from swajax import _transforms as transforms
from swajax._layout import KVLayout
from swajax._runner import (
    bookkeeping_step,
    sharded_bookkeeping_step,
    step_function,
    step_input_shapes,
    step_inputs,
    trace_count,
)
from swajax._sampling import step_mode
from swajax._scheduler import StepPlan
from swajax._state import init_state, initial_tables
from swajax._step_cache import CachedStep, resolve

MIN_BUCKET = 8  # token axis granularity of every step (the decode step's rows)


class StepShape(NamedTuple):
    """Which compiled step runs a plan: its token axis, whether it is a decode step, whether
    it returns logits, and the sampling mode."""

    num_tokens: int
    decode: bool
    logits: bool
    mode: str


@dataclasses.dataclass
class StepResult:
    """What one step produced for one replica's plan (host numpy)."""

    plan: StepPlan
    next_tokens: np.ndarray  # i32[B] the token each sampling row drew
    finite: np.ndarray  # bool[B] whether the row's logits were all finite
    logits: np.ndarray | None  # f32[B, V], when the step returned them
    drafted: np.ndarray | None = None  # i32[B, K + 1] with speculative decoding
    accepted: np.ndarray | None = None  # i32[B] drafts each row kept
    proposals: np.ndarray | None = None  # i32[B, K] next drafts, from an in-step drafter

    def tokens(self, row: int) -> int | list[int]:
        """What row `row` emits: its token, or with drafts its kept drafts then its token."""
        if self.plan.drafts.get(row):
            return [int(t) for t in self.drafted[row, : int(self.accepted[row]) + 1]]
        return int(self.next_tokens[row])


@functools.lru_cache(maxsize=16)
def _resize_fn(old: KVLayout, new: KVLayout, mesh):
    """`resize(old, new, state)` compiled (per replica on a mesh). Not donated: no output has
    an input's shape where a group's slot count changes, and the old pool goes right after."""
    fn = functools.partial(transforms.resize, old, new)
    if mesh is None:
        return jax.jit(fn)
    return jax.jit(
        _sharding.per_replica(fn, mesh, 0),
        out_shardings=(_sharding.replica_sharding(mesh), _sharding.state_shardings(new, mesh)),
    )


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


@contextlib.contextmanager
def sigint_deferred():
    """Holds SIGINT back during the block (main thread only) and raises it afterwards, so that
    a donating call never loses the state it donated."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught = []
    previous = signal.signal(signal.SIGINT, lambda *a: caught.append(a))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        raise KeyboardInterrupt


class ModelRunner:
    """Runs step plans for one model on one pool layout (every replica's pool).

    Args:
      graphdef, params: the model split by `nnx.split` (params already on their shardings).
      layout: the pool layout of one replica.
      max_num_tokens, min_prefill_bucket: the step shapes (see `swajax.EngineConfig`).
      max_cache_ops: the length of the step's park and adopt lists (0: no prefix cache).
      draft_tokens: most drafted tokens a row feeds in one step (speculative decoding; 0:
        none). Steps of decode rows with drafts run at a token axis of max_batch x
        (draft_tokens + 1).
      assistant: (graphdef, params, sources) of an in-step drafter (a `gemma.Gemma4Assistant`
        split by `nnx.split`, the target layer each of its layers reads), or None. Every step
        then also returns each row's next draft_tokens drafts.
      implementation: the attention kernels.
      mesh: a serving mesh (`swajax._sharding.serving_mesh`) or None; num_replicas its dp.
    """

    def __init__(
        self,
        graphdef,
        params,
        layout: KVLayout,
        *,
        max_num_tokens: int,
        min_prefill_bucket: int,
        max_cache_ops: int,
        implementation: str,
        draft_tokens: int = 0,
        assistant=None,
        mesh=None,
        num_replicas: int = 1,
    ):
        self.graphdef, self.params = graphdef, params
        self.assistant = None if assistant is None else (assistant[0], tuple(assistant[2]))
        self.assistant_params = None if assistant is None else assistant[1]
        self.max_num_tokens = max_num_tokens
        self.min_prefill_bucket = min(min_prefill_bucket, max_num_tokens)
        self.max_cache_ops = max_cache_ops
        self.draft_tokens = draft_tokens
        self.implementation = implementation
        self.mesh, self.num_replicas = mesh, num_replicas
        self._traces_at_start: dict[KVLayout, int] = {}
        self.set_layout(layout)
        self.collect_logits = False  # whether steps return logits (a recording asks for them)

    # ------------------------------------------------------------------ pool

    def set_layout(self, layout: KVLayout) -> None:
        """A fresh, empty pool of `layout` (the old pool roots go before the new ones come)."""
        self.state = self.tables = self.prev_tokens = None
        self._use_layout(layout)
        if self.mesh is None:
            state = init_state(layout)
            prev_tokens = jnp.zeros((layout.max_batch,), jnp.int32)
            # Committed to their device (no copy), as every step's outputs are: a first step
            # with uncommitted inputs would be a second compile of the same step.
            device = next(iter(jax.tree.leaves(state)[0].devices()))
            self.state, self.prev_tokens = jax.device_put((state, prev_tokens), device)
        else:  # every replica's, concatenated along the first axis
            self.state = _sharding.init_state_sharded(layout, self.mesh)
            self.prev_tokens = jax.device_put(
                np.zeros((self.num_replicas * layout.max_batch,), np.int32),
                _sharding.replica_sharding(self.mesh),
            )
        self.tables = self._fresh_tables()

    @property
    def _device(self):
        """The device of the pool state (one of them on a mesh)."""
        return next(iter(jax.tree.leaves(self.state)[0].devices()))

    def _fresh_tables(self):
        """All-BAD page tables of the layout beside the state (updated in place by the gather
        in per_layer mode; None in shared mode)."""
        if self.mesh is None:
            return jax.device_put(initial_tables(self.layout), self._device)
        return _sharding.initial_tables_sharded(self.layout, self.mesh)

    def _use_layout(self, layout: KVLayout) -> None:
        self.layout = layout
        self._traces_at_start.setdefault(layout, trace_count(layout))
        self._compiled: dict[StepShape, object] = {}
        self.ran: set[StepShape] = set()  # step shapes dispatched on this layout
        self.in_flight: tuple[list[StepPlan], object] | None = None

    def can_resize(self, layout: KVLayout) -> bool:
        """Whether the device has room for `layout`'s pool roots beside the current ones (a
        re-split holds both while it moves the pages); True without memory statistics."""
        need = sum(layout.slot_bytes(g) * grp.num_slots for g, grp in enumerate(layout.groups))
        try:
            stats = self._device.memory_stats()
        except Exception:  # noqa: BLE001 - a backend without statistics (CPU)
            stats = None
        if not stats or "bytes_limit" not in stats:
            return True
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0)) >= need

    def resize(self, layout: KVLayout) -> None:
        """Moves the pool, its rows kept, into `layout` (the same but for its slot counts per
        group; `swajax._transforms.resize`). Between steps only; the page tables start afresh
        and the new layout's steps compile on first use."""
        if self.in_flight is not None:
            raise RuntimeError("resize needs the step in flight collected first")
        fn = _resize_fn(self.layout, layout, self.mesh)
        ok, state = fn(self.state)
        if not bool(np.all(np.asarray(ok))):  # the old state is still whole: keep serving it
            raise RuntimeError(
                "internal error: the pool cannot be resized (more slots held than the new "
                "split has, or a step in flight) although the ledger allowed it"
            )
        self.state = state
        self._use_layout(layout)
        self.tables = self._fresh_tables()

    @property
    def state_lost(self) -> bool:
        """Whether a failed step consumed the donated state (the pool must be rebuilt)."""
        leaves = jax.tree.leaves((self.state, self.tables, self.prev_tokens))
        return any(x.is_deleted() for x in leaves)

    @property
    def trace_count(self) -> int:
        """Traces of the step for this runner's layouts since it was made."""
        return sum(trace_count(lay) - n for lay, n in self._traces_at_start.items())

    # ------------------------------------------------------------------ steps

    def shape_of(self, plans: list[StepPlan]) -> StepShape:
        """The compiled step that runs these plans (None entries: replicas with no step)."""
        plans = [p for p in plans if p is not None and p.new_tokens]
        if all(p.decode_only for p in plans):
            num_tokens, decode = round_up(self.layout.max_batch, MIN_BUCKET), True
        elif self.draft_tokens and all(p.verify_only for p in plans):
            num_tokens, decode = self._verify_tokens, False
        else:
            n = max(max(p.num_tokens for p in plans), self.min_prefill_bucket, MIN_BUCKET)
            num_tokens, decode = min(1 << (n - 1).bit_length(), self.max_num_tokens), False
        mode = step_mode([r.sampling for p in plans for r, _ in p.samples.values()])
        num_tokens = max([num_tokens] + [p.num_tokens for p in plans])
        return StepShape(num_tokens, decode, self.collect_logits, mode)

    def step_shapes(self) -> list[tuple[int, bool]]:
        """Every (token axis, decode) this runner's steps can have."""
        buckets, n = [], max(self.min_prefill_bucket, MIN_BUCKET)
        while True:
            t = min(1 << (n - 1).bit_length(), self.max_num_tokens)
            buckets.append((t, False))
            if t >= self.max_num_tokens:
                break
            n = t + 1
        verify = [(self._verify_tokens, False)] if self.draft_tokens else []
        return [(round_up(self.layout.max_batch, MIN_BUCKET), True), *verify, *buckets]

    @property
    def _verify_tokens(self) -> int:
        """The token axis of a step of decode rows with drafts."""
        return round_up(self.layout.max_batch * (self.draft_tokens + 1), MIN_BUCKET)

    def run(self, plans: list[StepPlan]) -> list[StepResult]:
        """Dispatches a step for `plans` (one per replica, each with new tokens or bookkeeping
        only, or None) and returns the results of the step that was in flight."""
        results = []
        if any(p is not None and p.new_tokens for p in plans):
            shape = self.shape_of(plans)
            if shape not in self.ran:
                results += self.collect()  # read it before a compile can delay it
            previous, self.in_flight = self.in_flight, None
            self._dispatch(plans, shape)
            current, self.in_flight = self.in_flight, previous
            results += self.collect()
            self.in_flight = current
            return results
        if any(p is not None for p in plans):
            self.bookkeeping(plans)
        return results + self.collect()

    def _dispatch(self, plans: list[StepPlan], shape: StepShape) -> None:
        self.ran.add(shape)
        inputs = [
            step_inputs(
                plan,
                num_tokens=shape.num_tokens,
                layout=self.layout,
                max_cache_ops=self.max_cache_ops,
                sampling=lambda r: r.sampling.row_values(),
            )
            for plan in plans
        ]
        args = (self._step_params, self.state, self.tables, self.prev_tokens, self._joined(inputs))
        step = self._compiled.get(shape)
        if step is None:
            step = self._compiled[shape] = resolve(self._step_function(shape), args)
        with sigint_deferred():
            out = step(*args)
            self.state, self.tables, self.prev_tokens = out.state, out.tables, out.next_tokens
        self.in_flight = (plans, out)

    def collect(self) -> list[StepResult]:
        """Reads the step in flight (a host sync): one result per replica's plan."""
        if self.in_flight is None:
            return []
        plans, out = self.in_flight
        self.in_flight = None
        dp = self.num_replicas
        next_tokens = np.asarray(out.next_tokens).reshape(dp, -1)
        finite = np.asarray(out.finite).reshape(dp, -1)
        ok, used = np.asarray(out.ok).reshape(dp), np.asarray(out.used).reshape(dp, -1)
        logits = drafted = accepted = proposals = None
        if out.logits is not None:
            logits = np.asarray(out.logits).reshape(dp, -1, out.logits.shape[-1])
        if out.drafted is not None:
            drafted = np.asarray(out.drafted).reshape(dp, -1, out.drafted.shape[-1])
            accepted = np.asarray(out.accepted).reshape(dp, -1)
        if out.proposals is not None:
            proposals = np.asarray(out.proposals).reshape(dp, -1, out.proposals.shape[-1])
        for plan, ok_r, used_r in zip(plans, ok, used, strict=True):
            if not bool(ok_r):
                raise RuntimeError(
                    "internal error: a step's slot reservation or prefix-cache op failed on the "
                    "device although the host ledger planned it "
                    f"(new_tokens={plan.new_tokens})"
                )
            if tuple(int(x) for x in used_r) != tuple(plan.used):
                raise RuntimeError(
                    f"internal error: the device holds {tuple(used_r)} slots per group, the "
                    f"ledger {plan.used}"
                )
        return [
            StepResult(
                plan,
                next_tokens[i],
                finite[i],
                None if logits is None else logits[i],
                None if drafted is None else drafted[i],
                None if accepted is None else accepted[i],
                None if proposals is None else proposals[i],
            )
            for i, plan in enumerate(plans)
        ]

    def bookkeeping(self, plans: list[StepPlan]) -> None:
        """Runs plans without tokens (frees and cache ops only) on the device."""
        inputs = [
            step_inputs(
                plan,
                num_tokens=0,
                layout=self.layout,
                max_cache_ops=self.max_cache_ops,
                sampling=lambda r: (0.0, 0, 1.0),
            )
            for plan in plans
        ]
        inputs = self._joined(inputs)
        args = (
            inputs.rewind,
            inputs.free_a,
            inputs.release,
            inputs.park_a,
            inputs.adopt,
            inputs.free_b,
        )
        with sigint_deferred():
            if self.mesh is None:
                ok, self.state = bookkeeping_step(self.layout, self.state, *args)
            else:
                step = sharded_bookkeeping_step(self.layout, self.mesh)
                ok, self.state = step(self.state, *args)
        if not bool(np.all(np.asarray(ok))):
            raise RuntimeError("internal error: a bookkeeping cache op failed on the device")

    def _joined(self, inputs: list):
        """One replica's inputs as they are; with a mesh, every replica's concatenated."""
        if self.mesh is None:
            return inputs[0]
        joined = jax.tree.map(lambda *x: np.concatenate(x), *inputs)
        return jax.device_put(joined, _sharding.replica_sharding(self.mesh))

    def _step_function(self, shape: StepShape):
        return step_function(
            self.graphdef,
            self.layout,
            decode=shape.decode,
            implementation=self.implementation,
            sampling_mode=shape.mode,
            logits=shape.logits,
            mesh=self.mesh,
            draft_tokens=self.draft_tokens,
            assistant=self.assistant,
        )

    # ------------------------------------------------------------------ compilation

    def lower(
        self,
        num_tokens: int,
        decode: bool,
        mode: str = "greedy",
        *,
        logits=False,
        lowering_platforms=None,
    ):
        """The `jax.stages.Lowered` step of a shape (for compiling ahead and for inspection;
        lowering_platforms e.g. ("cuda",) with `pallas_kernels._checks.force_compiled()`)."""
        step = self._step_function(StepShape(num_tokens, decode, logits, mode))
        if lowering_platforms is not None and isinstance(step, CachedStep):
            step = step.jitted  # the step cache stores this backend's lowering only
        return step.trace(*self.step_args(num_tokens)).lower(lowering_platforms=lowering_platforms)

    def step_args(self, num_tokens: int) -> tuple:
        """The step's arguments for a token axis, its inputs as shapes."""
        inputs = step_input_shapes(
            num_tokens=num_tokens, layout=self.layout, max_cache_ops=self.max_cache_ops
        )
        if self.mesh is not None:  # every replica's inputs, concatenated
            sharding = _sharding.replica_sharding(self.mesh)
            inputs = jax.tree.map(
                lambda a: jax.ShapeDtypeStruct(
                    (self.num_replicas * a.shape[0], *a.shape[1:]), a.dtype, sharding=sharding
                ),
                inputs,
            )
        return (self._step_params, self.state, self.tables, self.prev_tokens, inputs)

    @property
    def _step_params(self):
        """The step's parameters: the model's, or (the model's, the in-step drafter's)."""
        return self.params if self.assistant is None else (self.params, self.assistant_params)

    def precompile(self, modes=("greedy",)) -> None:
        """Compiles every step shape for the sampling modes, in threads."""
        import concurrent.futures

        jobs = [(t, d, m) for t, d in self.step_shapes() for m in modes]
        with concurrent.futures.ThreadPoolExecutor(max_workers=min(4, len(jobs))) as pool:
            list(pool.map(lambda job: self.lower(*job).compile(), jobs))
