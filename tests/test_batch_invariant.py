"""`Engine(batch_invariant=True)`: a step runs decode rows only or prefill rows only, every
prefill step has one token axis (max_num_tokens), and greedy tokens equal the dense model's
with scratch reuse on and off (which admit different numbers of rows).
"""

from __future__ import annotations

import pytest
from test_generate import dense_greedy, kv_config, make_model, prompts_of

import swajax
from swajax import _sharding

MAX_NUM_TOKENS = 32
# Prompts prefilled in several 16-token chunks, more prompts than rows: prompts are admitted
# and prefilled while others decode, which the default schedule runs as mixed steps.
LENGTHS = [40, 23, 9, 30]
MAX_NEW = 6


def make_engine(scratch, *, batch_invariant=True, **kw):
    return swajax.Engine(
        make_model("gemma3"),
        kv_config(scratch),
        max_context=128,
        max_batch=3,
        max_num_tokens=MAX_NUM_TOKENS,
        prefill_chunk_size=16,
        implementation="reference",
        batch_invariant=batch_invariant,
        **kw,
    )


def record_steps(engine):
    """Records every dispatched step as (token bucket, decode step, request ids fed their one
    token after the prompt, request ids fed prompt tokens), the rows sorted by what they did
    when the scheduler planned the step."""
    scheduler = engine.scheduler
    schedule, dispatch = scheduler.schedule, engine._dispatch
    kinds, steps = {}, []

    def recorded_schedule():
        remaining = {r.id: r.length - r.fed for r in scheduler.running}
        plan = schedule()
        if plan is not None:
            ids = {scheduler.rows[row].id for row in plan.new_tokens}
            decode = {i for i in ids if remaining.get(i) == 1}
            kinds[plan.index] = (decode, ids - decode)
        return plan

    def recorded_dispatch(plans):
        num_tokens, decode, *_ = engine._variant(plans)
        steps.append((num_tokens, decode, *kinds[plans[0].index]))
        dispatch(plans)

    scheduler.schedule = recorded_schedule
    engine._dispatch = recorded_dispatch
    return steps


@pytest.mark.parametrize("scratch", [False, True], ids=["scratch_off", "scratch_on"])
def test_dense_greedy_tokens_and_one_kind_of_rows_per_step(scratch):
    prompts = prompts_of(LENGTHS, seed=1)
    engine = make_engine(scratch)
    assert engine.layout.scratch is scratch
    steps = record_steps(engine)
    outputs, stats = engine.run(prompts, MAX_NEW)
    assert outputs == dense_greedy(make_model("gemma3"), prompts, MAX_NEW)
    assert stats.preemptions == 0 and stats.steps == len(steps)
    for num_tokens, decode, decode_ids, prefill_ids in steps:
        assert not (decode_ids and prefill_ids), (decode_ids, prefill_ids)
        assert decode == bool(decode_ids)
        if not decode:
            assert num_tokens == MAX_NUM_TOKENS
    assert engine.trace_count == 2  # one decode shape, one prefill shape
    # The same requests without batch invariance: a decoding row rides in a prefill step.
    engine = make_engine(scratch, batch_invariant=False)
    steps = record_steps(engine)
    engine.run(prompts, MAX_NEW)
    assert any(decode_ids and prefill_ids for _, _, decode_ids, prefill_ids in steps)


def test_min_prefill_bucket_must_be_max_num_tokens():
    with pytest.raises(ValueError, match="max_num_tokens=32.*min_prefill_bucket=16"):
        make_engine(True, min_prefill_bucket=16)
    assert make_engine(True, min_prefill_bucket=MAX_NUM_TOKENS).min_prefill_bucket == 32
    assert make_engine(True, batch_invariant=False, min_prefill_bucket=16).min_prefill_bucket == 16


@pytest.mark.parametrize("value", [1, 0, "yes", None])
def test_batch_invariant_must_be_a_bool(value):
    with pytest.raises(ValueError, match="batch_invariant must be True or False"):
        make_engine(True, batch_invariant=value)


def test_batch_invariant_needs_one_replica(monkeypatch):
    """Replicas' plans run in one step: the mesh (two "data" replicas) is refused before
    anything is built."""
    monkeypatch.setattr(_sharding, "serving_mesh", lambda mesh: mesh)
    monkeypatch.setattr(_sharding, "mesh_sizes", lambda mesh: (2, 1))
    with pytest.raises(ValueError, match="one data-parallel replica, got 2"):
        make_engine(True, mesh=object())
