"""`Engine(batch_invariant=True)`: a step runs decode rows only or prefill rows only, every
prefill step has one token axis (max_num_tokens), and greedy tokens equal the dense model's
with scratch reuse on and off (which admit different numbers of rows).
"""

from __future__ import annotations

import numpy as np
import pytest
from test_generate import dense_greedy, kv_config, make_model, prompts_of

import swajax
from pallas_kernels.paged_attention import PREFILL_QUERY_TILE
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
    schedule, dispatch = scheduler.schedule, engine.runner._dispatch
    kinds, steps = {}, []

    def recorded_schedule():
        remaining = {r.id: r.length - r.fed for r in scheduler.running}
        plan = schedule()
        if plan is not None:
            ids = {scheduler.rows[row].id for row in plan.new_tokens}
            decode = {i for i in ids if remaining.get(i) == 1}
            kinds[plan.index] = (decode, ids - decode)
        return plan

    def recorded_dispatch(plans, shape):
        steps.append((shape.num_tokens, shape.decode, *kinds[plans[0].index]))
        dispatch(plans, shape)

    scheduler.schedule = recorded_schedule
    engine.runner._dispatch = recorded_dispatch
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
    assert make_engine(True, min_prefill_bucket=MAX_NUM_TOKENS).config.min_prefill_bucket == 32
    assert (
        make_engine(True, batch_invariant=False, min_prefill_bucket=16).config.min_prefill_bucket
        == 16
    )


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


def test_chunks_cut_at_the_query_tile_keep_the_tokens():
    """Budget 384, chunks of 256: a second prompt's first chunk is cut to the 128 tokens left
    (`PREFILL_QUERY_TILE`) and its later chunks start at multiples of 128. Gemma 4 (sliding
    window, KV sharing): greedy tokens equal the dense model's; scratch ON and OFF give the same
    tokens and bitwise the same logits; and the cut request run alone (whole chunks from 0 and
    256) gives bitwise its logits in the batch (reference attention on the CPU; the Pallas
    kernel's property is `test_prefill_output_does_not_depend_on_a_tile_aligned_chunk_start`)."""
    model = make_model("gemma4")
    prompts = prompts_of([300, 260, 140], seed=4)
    runs = {}
    for scratch in (False, True):
        engine = swajax.Engine(
            model,
            kv_config(scratch),
            max_context=512,
            max_batch=3,
            max_num_tokens=384,
            prefill_chunk_size=256,
            implementation="reference",
            batch_invariant=True,
        )
        assert engine.scheduler.cut_align == PREFILL_QUERY_TILE == 128
        fed = []  # (request id, tokens fed before, tokens this step) of every prefill row
        schedule = engine.scheduler.schedule

        def recorded(engine=engine, schedule=schedule, fed=fed):
            before = {r.row: (r.id, r.fed) for r in engine.scheduler.running}
            plan = schedule()
            if plan is not None and plan.prefill_step:
                for row, n in plan.new_tokens.items():
                    rid, start = before.get(row, (engine.scheduler.rows[row].id, 0))
                    fed.append((rid, start, n))
            return plan

        engine.scheduler.schedule = recorded
        outputs, stats = engine.run(prompts, MAX_NEW, collect_logits=True)
        assert stats.preemptions == 0
        assert all(start % 128 == 0 for _, start, _ in fed), fed
        assert any(n == 128 and start + n < len(prompts[rid]) for rid, start, n in fed), fed
        runs[scratch] = outputs, {(i, k): x for i, k, x in stats.step_logits}
    assert runs[False][0] == runs[True][0] == dense_greedy(model, prompts, MAX_NEW)
    assert runs[False][1].keys() == runs[True][1].keys()
    for key, value in runs[True][1].items():
        np.testing.assert_array_equal(value, runs[False][1][key])
    # Request 1 alone: whole chunks from 0 and 256 where the batch cut it at 128. Its logits
    # are bitwise those of the batch.
    before = len(fed)
    engine.clear_prefix_cache()  # recomputed from its first token, not from its parked prompt
    alone = engine.run([prompts[1]], MAX_NEW, collect_logits=True)[1]
    assert [(start, n) for _, start, n in fed[before:]] == [(0, 256), (256, 4)]
    assert len(alone.step_logits) == MAX_NEW
    for _, k, value in alone.step_logits:
        np.testing.assert_array_equal(value, runs[True][1][1, k])
