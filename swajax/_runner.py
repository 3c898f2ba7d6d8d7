"""The step runner: one compiled function per step shape that runs a `StepPlan` on the device.

A step, with the pool state and the previous page tables donated (updated in place):

    free_a -> release -> park_a -> adopt -> free_b -> reserve -> page-table gather -> paged
    forward -> sample -> advance -> park_b

(see `swajax._scheduler` for what each does). Its inputs are arrays of static shapes: the
packed tokens of the step (T = the step's token bucket), per-row token counts, masks and the
prefix cache's op lists, per-row sampling parameters and PRNG key data. A decode row's input
token may be the token its row drew in the previous step (`prev_rows`), read on the device
from that step's output, so the host can plan and dispatch a step before reading the previous one.

The compiled steps are cached per (model structure, layout, decode, sampling mode, logits) and
shared by every engine of the same model and layout; a new token bucket is a new shape of the
same function. `trace_count(layout)` counts traces (the no-recompile tests).

Axis names: T packed tokens, B batch rows, NB blocks per row, S prefix-cache ops per list
(parks, adoptions), E cached blocks released per step (`KVLayout.cache_releases`), G groups,
V vocabulary.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import json
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gemma._hook import LayerRef
from swajax import _sharding, _step_cache
from swajax._layout import KVLayout
from swajax._paged import make_attention_fn, token_positions
from swajax._sampling import sample, token_keys, verify_drafts
from swajax._scheduler import StepPlan
from swajax._state import KVPoolState
from swajax._transforms import (
    StepMetadata,
    adopt,
    advance,
    free_rows,
    park,
    release_cached,
    reserve,
    rewind,
    step_metadata,
    step_page_tables,
)


class StepInputs(NamedTuple):
    """The arrays of one step (built from a `StepPlan` by `step_inputs`)."""

    tokens: jax.Array  # i32[T] packed new tokens (rows in batch order)
    prev_rows: jax.Array  # i32[T] row whose previous sample is this token, or -1 (literal)
    new_tokens: jax.Array  # i32[B] new tokens per row
    rewind: jax.Array  # i32[B] history each row goes back to first (speculation); -1 = none
    free_a: jax.Array  # bool[B]
    release: jax.Array  # i32[E] cached nodes released; -1 = none
    park_a: jax.Array  # i32[S, 2 + 2 NB] (row, k, nodes, group masks); row -1 = none
    adopt: jax.Array  # i32[S, 2 + NB] (row, k, nodes); row -1 = none
    free_b: jax.Array  # bool[B]
    park_b: jax.Array  # i32[S, 2 + 2 NB]
    key_data: jax.Array  # u32[B, 2] each row's request key data
    token_index: jax.Array  # i32[B] index of the token each row draws
    temperature: jax.Array  # f32[B]
    top_k: jax.Array  # i32[B]
    top_p: jax.Array  # f32[B]
    num_drafts: jax.Array  # i32[B] drafted tokens each row feeds after its last token
    propose: jax.Array  # bool[B] rows an in-step drafter drafts for (speculating, sampling)


class StepOutput(NamedTuple):
    """What a step returns (the state and tables are the donated inputs, updated)."""

    state: KVPoolState
    tables: tuple[jax.Array, ...] | None
    next_tokens: jax.Array  # i32[B] token drawn per row (meaningful for sampling rows)
    ok: jax.Array  # bool[]: reserve and every real park and adoption succeeded
    used: jax.Array  # i32[G] slots held after the reserve (the step's peak)
    finite: jax.Array  # bool[B]: every logit of the row's last new token is finite
    logits: jax.Array | None  # f32[B, V] of each row's last new token, if asked for
    # With speculative decoding (draft_tokens = K > 0): the tokens each row emits are
    # drafted[b, : accepted[b] + 1] (its kept drafts, then next_tokens[b]); None otherwise.
    drafted: jax.Array | None = None  # i32[B, K + 1]
    accepted: jax.Array | None = None  # i32[B]
    # With an in-step drafter (a Gemma 4 assistant): each row's K drafts to follow the tokens
    # it emits in this step; None otherwise.
    proposals: jax.Array | None = None  # i32[B, K]


def bookkeeping_before(layout, state, rewind_to, free_a, release, park_a, adopt_ops, free_b):
    """rewind -> free_a -> release -> park_a -> adopt -> free_b; returns (ok, state)."""
    rewound, state = rewind(layout, state, rewind_to)
    state = free_rows(layout, state, free_a)
    state = release_cached(layout, state, release)
    parked, state = park(layout, state, park_a)
    adopted, state = adopt(layout, state, adopt_ops)
    return rewound & parked & adopted, free_rows(layout, state, free_b)


def _step(
    params,
    state: KVPoolState,
    tables,
    prev_tokens,
    inputs: StepInputs,
    *,
    graphdef,
    layout: KVLayout,
    decode: bool,
    implementation: str,
    sampling_mode: str,
    return_logits: bool,
    draft_tokens: int = 0,
    assistant=None,
) -> StepOutput:
    if assistant is not None:  # the step's parameters: (the target's, the assistant's)
        params, assistant_params = params
    ok, state = bookkeeping_before(
        layout,
        state,
        inputs.rewind,
        inputs.free_a,
        inputs.release,
        inputs.park_a,
        inputs.adopt,
        inputs.free_b,
    )
    reserved, state = reserve(layout, state, inputs.new_tokens)
    ok &= reserved
    used = jnp.asarray([g.num_slots for g in layout.groups], jnp.int32) - state.free_count
    meta = step_metadata(layout, state)
    tables = step_page_tables(layout, state, implementation=implementation, out=tables)
    prev = prev_tokens[jnp.clip(inputs.prev_rows, 0, prev_tokens.shape[0] - 1)]
    tokens = jnp.where(inputs.prev_rows >= 0, prev, inputs.tokens)  # [T]
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
    rows = layout.max_batch
    last = jnp.clip(meta.q_starts[1 : rows + 1] - 1, 0, num_tokens - 1)  # [B]
    k = draft_tokens
    # logits of each row's last fed token and, with drafts, of the k before it: position j
    # of row b is its token q_end - 1 - num_drafts + j (clipped to its last)
    j = jnp.arange(k + 1, dtype=jnp.int32)[None, :]
    at = jnp.clip(last[:, None] - inputs.num_drafts[:, None] + j, 0, last[:, None])  # [B, K+1]
    logits, pools, *hidden = model.forward(
        tokens,
        positions,
        attention_fn=attention_fn,
        attention_state=state.pools,
        logits_indices=at.reshape(-1),
        return_hidden=assistant is not None,
    )  # [B * (K + 1), V]: only these tokens are unembedded
    logits = logits.reshape(rows, k + 1, -1)
    sampling = dict(
        temperature=inputs.temperature, top_k=inputs.top_k, top_p=inputs.top_p, mode=sampling_mode
    )
    keys = token_keys(  # [B, K + 1]: the key of the token drawn at each position
        jnp.repeat(inputs.key_data, k + 1, axis=0), (inputs.token_index[:, None] + j).reshape(-1)
    ).reshape(rows, k + 1)
    next_tokens = sample(logits[:, 0], keys[:, 0], **sampling)  # a row without drafts
    drafted = accepted = None
    used_positions = j <= inputs.num_drafts[:, None]  # [B, K + 1]
    if k:
        drafts = tokens[jnp.clip(at[:, 1:], 0, num_tokens - 1)]  # [B, K] the fed drafts
        drafted, accepted = verify_drafts(logits, drafts, inputs.num_drafts, keys, **sampling)
        with_drafts = inputs.num_drafts > 0
        drafted = drafted.at[:, 0].set(jnp.where(with_drafts, drafted[:, 0], next_tokens))
        accepted = jnp.where(with_drafts, accepted, 0)
        next_tokens = jnp.take_along_axis(drafted, accepted[:, None], axis=1)[:, 0]
    # A row whose logits hold NaN or Inf (broken weights, an overflow) is flagged, never
    # silently turned into a token: read with the tokens, no extra host sync.
    finite = jnp.all(jnp.isfinite(logits) | ~used_positions[..., None], axis=(1, 2))  # [B]
    picked = jnp.zeros_like(last) if accepted is None else accepted  # [B] position it emits from
    row_logits = jnp.take_along_axis(logits, picked[:, None, None], axis=1)[:, 0]
    proposals = None
    if assistant is not None:  # only in steps where a row wants drafts (a device-side branch)
        draft_meta = StepMetadata(
            jnp.where(inputs.propose, meta.q_lens, 0),
            meta.q_starts,
            meta.kv_lens - inputs.num_drafts + picked,
        )
        proposals = jax.lax.cond(
            jnp.any(inputs.propose),
            lambda: _assistant_drafts(
                assistant,
                assistant_params,
                model,
                hidden[0].reshape(rows, k + 1, -1),
                picked,
                next_tokens,
                draft_meta,
                make_assistant_hook=lambda m: make_attention_fn(
                    layout,
                    tables,
                    m,
                    state.k_scales,
                    state.v_scales,
                    decode=True,
                    implementation=implementation,
                ),
                pools=tuple(pools),
                num_drafts=k,
            ),
            lambda: jnp.zeros((rows, k), jnp.int32),
        )
    state = advance(layout, dataclasses.replace(state, pools=tuple(pools)))
    shared, state = park(layout, state, inputs.park_b)
    # Per-layer tables are donated to the next step (rewritten in place); shared-mode tables are
    # small and rebuilt every step, so none are carried (the next step gets None again).
    carried = tables if layout.page_table_mode == "per_layer" else None
    return StepOutput(
        state,
        carried,
        next_tokens,
        ok & shared,
        used,
        finite,
        row_logits if return_logits else None,
        drafted,
        accepted,
        proposals,
    )


def _assistant_drafts(
    assistant,
    assistant_params,
    model,
    hidden,
    picked,
    last_tokens,
    meta,
    *,
    make_assistant_hook,
    pools,
    num_drafts,
):
    """The next step's drafts of every row, from a Gemma 4 assistant (`gemma.Gemma4Assistant`)
    run in this step after the target's forward and verification: i32[B, K].

    A row's history after the step is meta.kv_lens (its fed tokens less the drafts it
    rejected) and its last token, at that position, is `last_tokens`; the assistant starts
    from that token's scaled target embedding beside the target's final hidden state of the
    token before it (`hidden[b, picked[b]]`), attends through the target's page tables to the
    K/V of the target's last writer of each of its layer types (positions < history; the
    sliding window of the newest ones), stays at that position and drafts K tokens greedily,
    feeding back its own projected state. The pools are read only (the rejected drafts' K/V
    beyond the history is never read). Rows with meta.q_lens 0 (no tokens, or no drafts
    wanted) draft nothing useful.
    """
    graphdef, sources = assistant
    head = nnx.merge(graphdef, assistant_params)
    rows = hidden.shape[0]
    state_h = jnp.take_along_axis(hidden, picked[:, None, None], axis=1)[:, 0]  # [B, D]
    active = meta.q_lens > 0
    history = jnp.where(active, meta.kv_lens, 0)
    one_each = StepMetadata(
        active.astype(jnp.int32), jnp.arange(rows + 1, dtype=jnp.int32), history
    )
    target_hook = make_assistant_hook(one_each)

    def hook(layer, q, k, v, pools):  # assistant layer i reads target layer sources[i]
        return target_hook(LayerRef.of(sources[layer.like]), q, k, v, pools)

    embedding = model.embedding[...]
    scale = jnp.asarray(model.config.embed_scale, embedding.dtype)
    token, drafts = last_tokens, []
    for _ in range(num_drafts):
        e = (jnp.take(embedding, token, axis=0) * scale).astype(model.dtype)
        draft_logits, state_h, _ = head.forward(
            e, state_h, history, attention_fn=hook, attention_state=pools
        )
        token = jnp.argmax(draft_logits, axis=-1).astype(jnp.int32)
        drafts.append(token)
    return jnp.stack(drafts, axis=1)


_TRACES: collections.Counter = collections.Counter()


def trace_count(layout: KVLayout) -> int:
    """Traces of the step (any variant) for `layout` in this process."""
    return _TRACES[layout]


def _traced_step(*args, **kwargs):
    _TRACES[kwargs["layout"]] += 1
    return _step(*args, **kwargs)


# Compiler options of every jit that donates the pool state. XLA's HLO rematerialization runs
# when its estimate of a program's peak exceeds its memory limit (80 % of device memory less
# the program's inputs and outputs, so a large model plus a large KV pool leaves it little),
# and its clones can read a donated parameter after the step has updated that buffer in place:
# Gemma 4 31B's first step read its new page tables as the old ones and reported the wrong
# slot counts (experiments/NOTES.md, v12). A step that does not fit then fails with an
# out-of-memory error instead of computing on overwritten state.
STEP_COMPILER_OPTIONS = {"xla_disable_hlo_passes": "rematerialization"}


@functools.lru_cache(maxsize=64)
def step_function(
    graphdef,
    layout: KVLayout,
    *,
    decode: bool,
    implementation: str,
    sampling_mode: str,
    logits: bool,
    mesh=None,
    draft_tokens: int = 0,
    assistant=None,
):
    """The jitted step with its static arguments bound (state and tables donated); without a
    mesh wrapped in a `swajax._step_cache.CachedStep` (called the same way; exported steps kept
    on disk when the step cache is on).

    Bound once per (model structure, layout, mode, mesh): hashing a model's GraphDef costs
    about 1.6 ms (Gemma 3 4B), which a jit call with static arguments would pay at every step.
    Up to 64 steps and their executables stay alive.

    mesh: a `swajax._sharding.serving_mesh`, or None (one device). With a mesh, the state,
    tables, previous tokens, inputs and every output hold the dp replicas' arrays concatenated
    along their first axis (`ok` becomes bool[dp]) and the step runs on each replica
    (`swajax._sharding.per_replica`); the parameters are shared.

    assistant: (graphdef, sources) of an in-step drafter (`_assistant_drafts`), whose
    parameters then come as the second of the step's params (target's, assistant's).
    """
    bound = functools.partial(
        _traced_step,
        graphdef=graphdef,
        layout=layout,
        decode=decode,
        implementation=implementation,
        sampling_mode=sampling_mode,
        return_logits=logits,
        draft_tokens=draft_tokens,
        assistant=assistant,
    )
    if mesh is None:
        options = dict(STEP_COMPILER_OPTIONS)
        jitted = jax.jit(bound, donate_argnums=(1, 2), compiler_options=options)  # state, tables
        static = [
            hashlib.sha256(repr(graphdef).encode()).hexdigest(),
            repr(layout),
            decode,
            implementation,
            sampling_mode,
            logits,
            draft_tokens,
            None
            if assistant is None
            else [hashlib.sha256(repr(assistant[0]).encode()).hexdigest(), list(assistant[1])],
        ]
        return _step_cache.CachedStep(
            jitted,
            bound,
            json.dumps(static),
            donate_argnums=(1, 2),
            compiler_options=options,
        )
    replica = _sharding.replica_sharding(mesh)
    out_shardings = StepOutput(
        _sharding.state_shardings(layout, mesh),
        _sharding.table_shardings(layout, mesh),
        replica,
        replica,
        replica,
        replica,
        replica if logits else None,
        replica if draft_tokens else None,
        replica if draft_tokens else None,
        replica if assistant is not None else None,
    )
    # Outputs pinned to the inputs' shardings: the donated pool roots alias in place.
    return jax.jit(
        _sharding.per_replica(bound, mesh, num_shared=1),
        donate_argnums=(1, 2),
        out_shardings=out_shardings,
        compiler_options=dict(STEP_COMPILER_OPTIONS),
    )


@functools.partial(
    jax.jit, static_argnums=0, donate_argnums=1, compiler_options=STEP_COMPILER_OPTIONS
)
def bookkeeping_step(layout, state, rewind_to, free_a, release, park_a, adopt_ops, free_b):
    """A step without a forward: only rewind -> free_a -> release -> park_a -> adopt ->
    free_b (aborts, cache clears)."""
    return bookkeeping_before(layout, state, rewind_to, free_a, release, park_a, adopt_ops, free_b)


@functools.lru_cache(maxsize=16)
def sharded_bookkeeping_step(layout: KVLayout, mesh):
    """`bookkeeping_step` on every replica of a mesh (replicas concatenated in every argument)."""
    replica = _sharding.replica_sharding(mesh)
    return jax.jit(
        _sharding.per_replica(functools.partial(bookkeeping_before, layout), mesh, num_shared=0),
        donate_argnums=0,
        out_shardings=(replica, _sharding.state_shardings(layout, mesh)),
        compiler_options=dict(STEP_COMPILER_OPTIONS),
    )


def _park_array(parks, size: int, nb: int) -> np.ndarray:
    out = np.full((size, 2 + 2 * nb), -1, np.int32)
    out[:, 2 + nb :] = 0
    for i, (row, k, nodes, masks) in enumerate(parks):
        out[i, :2] = row, k
        out[i, 2 : 2 + len(nodes)] = nodes
        out[i, 2 + nb : 2 + nb + len(masks)] = masks
    return out


def _adopt_array(adopts, size: int, nb: int) -> np.ndarray:
    out = np.full((size, 2 + nb), -1, np.int32)
    for i, (row, k, nodes) in enumerate(adopts):
        out[i, :2] = row, k
        out[i, 2 : 2 + len(nodes)] = nodes
    return out


def step_inputs(plan: StepPlan, *, num_tokens: int, layout: KVLayout, max_cache_ops: int, sampling):
    """The `StepInputs` (numpy) of a plan, packed into `num_tokens` token rows.

    sampling(request) -> (temperature, top_k, top_p) of a request's rows.
    """
    max_batch, nb = layout.max_batch, layout.max_blocks
    tokens = np.zeros(num_tokens, np.int32)
    prev_rows = np.full(num_tokens, -1, np.int32)
    new_tokens = np.zeros(max_batch, np.int32)
    t = 0
    for row in sorted(plan.new_tokens):  # packed in batch-row order (q_starts)
        new_tokens[row] = plan.new_tokens[row]
        for token in plan.tokens[row]:
            if token is None:
                prev_rows[t] = row
            else:
                tokens[t] = token
            t += 1
    assert t <= num_tokens, (t, num_tokens)
    rewind_to = np.full(max_batch, -1, np.int32)
    for row, history in plan.rewind.items():
        rewind_to[row] = history
    num_drafts = np.zeros(max_batch, np.int32)
    for row, n in plan.drafts.items():
        num_drafts[row] = n
    propose = np.zeros(max_batch, bool)
    for row, (request, _) in plan.samples.items():
        propose[row] = request.num_draft_tokens > 0
    free_a, free_b = np.zeros(max_batch, bool), np.zeros(max_batch, bool)
    free_a[plan.free_a] = True
    free_b[plan.free_b] = True
    release = np.full(layout.cache_releases, -1, np.int32)
    release[: len(plan.release)] = plan.release
    key_data = np.zeros((max_batch, 2), np.uint32)
    token_index = np.zeros(max_batch, np.int32)
    temperature = np.zeros(max_batch, np.float32)
    top_k = np.zeros(max_batch, np.int32)
    top_p = np.ones(max_batch, np.float32)
    for row, (request, index) in plan.samples.items():
        key_data[row] = request.key_data
        token_index[row] = index
        temperature[row], top_k[row], top_p[row] = sampling(request)
    return StepInputs(
        tokens,
        prev_rows,
        new_tokens,
        rewind_to,
        free_a,
        release,
        _park_array(plan.park_a, max_cache_ops, nb),
        _adopt_array(plan.adopt, max_cache_ops, nb),
        free_b,
        _park_array(plan.park_b, max_cache_ops, nb),
        key_data,
        token_index,
        temperature,
        top_k,
        top_p,
        num_drafts,
        propose,
    )


def step_input_shapes(*, num_tokens: int, layout: KVLayout, max_cache_ops: int) -> StepInputs:
    """The `StepInputs` of a step shape as `jax.ShapeDtypeStruct`s (for lowering)."""
    empty = StepPlan(0, {}, {}, {})
    inputs = step_inputs(
        empty,
        num_tokens=num_tokens,
        layout=layout,
        max_cache_ops=max_cache_ops,
        sampling=lambda r: (0.0, 0, 1.0),
    )
    return StepInputs(*(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in inputs))
