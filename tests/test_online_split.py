"""pool_ratio="online": the split follows the observed slot demand between steps, with the
running requests' pages moved into the new split.

Oracles: the pages each row reads before and after `resize` (random contents, free pages
NaN-poisoned), the transforms' own invariants (refcounts, free stack), hand-computed policy
decisions, the runner's ledger-vs-device check of every step, and dense greedy generation.
"""

import dataclasses

import numpy as np
import pytest
from test_adaptive_split import NEW, engine, lengths, quota_for_three
from test_generate import dense_greedy, make_model, prompts_of
from test_pool_sim import share_prefix
from test_pool_transforms import small_layout

import swajax
from swajax import _budget

BAD = -1


def _random_pool(layout, seed):
    """A pool after a random schedule (reserve / advance / share / free), every held page
    filled with random values and every free one NaN."""
    rng = np.random.default_rng(seed)
    pool = swajax.pool
    state = pool.init_state(layout)
    for step in range(6):
        n = np.where(rng.random(layout.max_batch) < 0.7, rng.integers(1, 40, layout.max_batch), 0)
        hist = np.asarray(state.history)
        n = np.minimum(n, layout.max_context - hist).astype(np.int32)
        ok, new = pool.reserve(layout, state, n)
        if bool(ok):
            state = pool.advance(layout, new)
        if step == 2:  # row 2 shares row 0's prefix, then row 1 goes
            state = pool.free_rows(layout, state, np.arange(layout.max_batch) == 2)
            _, state = share_prefix(layout, state, 0, 2, 48)
        if step == 4:
            state = pool.free_rows(layout, state, np.arange(layout.max_batch) == 1)
    roots = []
    for p, spec in enumerate(layout.pools):
        root = rng.standard_normal(state.pools[p].shape).astype(np.float32)
        held = np.asarray(state.refcount[spec.group]) > 0
        root[~np.repeat(held, spec.scale)] = np.nan
        roots.append(root)
    return dataclasses.replace(state, pools=tuple(roots))


def _row_pages(layout, state):
    """{(row, group, block): [page contents of every pool of the group]}: what rows read."""
    out = {}
    for g in range(len(layout.groups)):
        base = np.asarray(state.base_tables[g])
        for b, o in zip(*np.nonzero(base != BAD), strict=True):
            slot = base[b, o]
            out[b, g, o] = [
                np.asarray(state.pools[p])[slot * spec.scale : (slot + 1) * spec.scale]
                for p, spec in enumerate(layout.pools)
                if spec.group == g
            ]
    return out


@pytest.mark.parametrize("num_slots", [(60, 70), "tight"])
def test_resize_moves_every_read_page_and_keeps_the_invariants(num_slots):
    old = small_layout(num_slots=(40, 40), max_batch=4)
    state = _random_pool(old, seed=3)
    held = [int(np.sum(np.asarray(r) > 0)) for r in state.refcount]
    assert all(h > 5 for h in held)
    if num_slots == "tight":  # exactly the held slots (the high ids were in use: compaction)
        num_slots = tuple(held)
    new = small_layout(num_slots=num_slots, max_batch=4)
    ok, moved = swajax.pool.resize(old, new, state)
    assert bool(ok)
    before, after = _row_pages(old, state), _row_pages(new, moved)
    assert before.keys() == after.keys()
    for key, pages in before.items():
        for a, b in zip(pages, after[key], strict=True):
            assert not np.isnan(a).any()  # a read page was never a free (poisoned) one
            np.testing.assert_array_equal(a, b)
    for g, group in enumerate(new.groups):
        ref_old, ref_new = np.asarray(state.refcount[g]), np.asarray(moved.refcount[g])
        assert sorted(ref_old[ref_old > 0]) == sorted(ref_new[ref_new > 0])
        count = int(np.asarray(moved.free_count)[g])
        assert count == group.num_slots - held[g]
        free = np.asarray(moved.free_stack[g])[:count]
        assert sorted(free) == np.flatnonzero(ref_new == 0).tolist()
        assert count == 0 or free[-1] == held[g]  # the lowest free id is popped first
    for f in ("history", "cap"):
        np.testing.assert_array_equal(np.asarray(getattr(state, f)), np.asarray(getattr(moved, f)))
    # the moved pool serves on: every row grows by a block where the slots allow
    n = np.full((4,), 16, np.int32)
    ok, grown = swajax.pool.reserve(new, moved, n)
    need = np.asarray(swajax.pool.slots_needed(new, moved, n))
    assert bool(ok) == bool(np.all(need <= np.asarray(moved.free_count)))


def test_resize_refuses_a_split_below_the_slots_in_use_and_a_step_in_flight():
    old = small_layout(num_slots=(40, 40), max_batch=4)
    state = _random_pool(old, seed=4)
    held = [int(np.sum(np.asarray(r) > 0)) for r in state.refcount]
    small = small_layout(num_slots=(held[0] - 1, 40), max_batch=4)
    ok, _ = swajax.pool.resize(old, small, state)
    assert not bool(ok)
    ok, in_flight = swajax.pool.reserve(old, state, np.full((4,), 1, np.int32))
    assert bool(ok)
    ok, _ = swajax.pool.resize(old, old, in_flight)
    assert not bool(ok)
    other = small_layout(num_slots=(9, 9), max_batch=2)
    with pytest.raises(ValueError, match="slot counts"):
        swajax.pool.resize(old, other, state)
    ledger = swajax.pool.SlotLedger(old)
    ledger.reserve({0: 40})
    with pytest.raises(RuntimeError, match="in flight"):
        ledger.resize(small)
    ledger.advance()
    with pytest.raises(ValueError, match="cannot hold"):
        ledger.resize(small_layout(num_slots=(1, 1), max_batch=4))


def test_online_policy_by_hand():
    lay = small_layout(num_slots=(100, 100), max_batch=64)  # sliding slot 1536 B, full 512 B
    assert (lay.slot_bytes(0), lay.slot_bytes(1)) == (1536, 512)
    quota = 100 * 1536 + 100 * 512  # 204,800 B: shares 0.75 / 0.25
    policy = _budget.OnlineRebalance(quota, ema=0.5, threshold=0.1, cooldown=3)
    policy.observe(lay, (100, 100))  # the current shares: nothing moves
    assert policy.propose(lay, (0, 0)) is None
    policy.observe(lay, (10, 370))  # average (55, 235) slots = (84,480, 120,320) B
    # cooldown: 2 steps since the start count as 3 (a first split may come at once)
    slots = policy.propose(lay, (0, 0))
    # shares 0.4125 / 0.5875: log2(0.5875 / 0.4125) * 8 = 4.08 -> point 4, w = 2^(1/2)
    w = 2**0.5
    expected = (int(quota / (1 + w)) // 1536, int(quota * w / (1 + w)) // 512)
    assert slots == expected == (55, 234)
    policy.resplit()
    moved = small_layout(num_slots=slots, max_batch=64)
    policy.observe(lay, (100, 100))  # a shift back, inside the cooldown
    assert policy.propose(moved, (0, 0)) is None
    assert policy.propose(moved, (80, 0), force=True) is not None  # a request that cannot fit
    policy.observe(moved, (55, 234))
    policy.observe(moved, (55, 234))  # back near the current shares: within the threshold
    policy.average = [55 * 1536, 234 * 512]
    assert policy.propose(moved, (0, 0)) is None
    # minimums are kept (slots in use, the next request's need), the bytes from the others
    policy.average = [1.0, 1000.0]
    raised = policy.propose(moved, (30, 0))
    assert raised[0] == 30 and raised[0] * 1536 + raised[1] * 512 <= quota


@pytest.mark.parametrize(
    "field, value",
    [
        ("rebalance_ema", 0.0),
        ("rebalance_ema", 1.5),
        ("rebalance_threshold", -0.1),
        ("rebalance_cooldown", 0),
        ("pool_ratio", "onlin"),
    ],
)
def test_bad_online_settings(field, value):
    with pytest.raises(ValueError, match=field):
        swajax.KVCacheConfig(**{field: value})


def rows_running_at_resplits(engine, monkeypatch) -> list[int]:
    """A list that gets, at each re-split of `engine`'s pool, the requests running then."""
    running = []
    resize = engine.runner.resize

    def spy(layout):
        running.append(sum(len(s.running) for s in engine.replicas.schedulers))
        resize(layout)

    monkeypatch.setattr(engine.runner, "resize", spy)
    return running


def shifting_demand_run(engine, model):
    """Short requests with long answers, then long prompts added while they decode (the demand
    moves to the full group); returns (tokens, dense greedy tokens, RunStats)."""
    short, short_new = prompts_of(lengths(12, 12), seed=12)[:4], 24
    long_ = prompts_of(lengths(100, 11), seed=11)[:4]
    outputs = {}
    with engine.recording() as stats:
        ids = [engine.add_request(p, short_new) for p in short]
        for _ in range(4):
            outputs.update((o.request_id, o) for o in engine.step())
        ids += [engine.add_request(p, NEW) for p in long_]
        while engine.has_unfinished_requests:
            outputs.update((o.request_id, o) for o in engine.step())
    tokens = [list(outputs[i].token_ids) for i in ids]
    expected = dense_greedy(model, short, short_new) + dense_greedy(model, long_, NEW)
    return tokens, expected, stats


@pytest.mark.parametrize("scratch", [True, False])
def test_online_engine_re_splits_while_requests_run_and_keeps_their_tokens(scratch, monkeypatch):
    """Short requests with long answers, then long prompts arriving while they run: the
    demand moves to the full group and the pool is split anew between steps with requests
    running; every token is dense greedy's and the ledger matches the device every step (the
    runner's check)."""
    model = make_model("gemma4")
    quota = quota_for_three()
    eng = engine(model, "online", quota, scratch=scratch, rebalance_cooldown=6, rebalance_ema=0.5)
    running_at_resplit = rows_running_at_resplits(eng, monkeypatch)
    tokens, expected, stats = shifting_demand_run(eng, model)
    assert tokens == expected
    assert stats.resplits == len(running_at_resplit) >= 2
    assert any(n > 0 for n in running_at_resplit), running_at_resplit
    assert stats.num_slots == eng.num_slots
    used = sum(n * eng.layout.slot_bytes(g) for g, n in enumerate(eng.num_slots))
    assert used <= quota
    eng.clear_prefix_cache()
    np.testing.assert_array_equal(np.asarray(eng.state.free_count), eng.num_slots)
