"""pool_ratio="adaptive": the split follows the queued requests.

Oracles: hand-computed splits of Q (docs/design.md "Budget") on a four-layer layout, a ratio pinned
for the queue's length, dense greedy generation (`test_generate.dense_greedy`) and the step
trace counter (no recompiles while the workload stays in a grid cell).
"""

import functools

import numpy as np
import pytest
from test_generate import dense_greedy, kv_config, make_model, prompts_of

import gemma
import swajax
from swajax import _budget
from swajax._runner import trace_count

S = gemma.LayerSpec
# 3 sliding layers (W = 40) and 1 full layer, 1 KV head x 8 dims, bf16: 32 bytes per token and
# layer. Page 16: sliding slot 3 * 16 * 32 = 1536 B, full slot 512 B; a decoding row's window
# spans (40 + 15) / 16 blocks on average: R_w = 55 * 96 = 5280 B.
SPECS = [S(40, 1, 8, 0), S(40, 1, 8, 1), S(None, 1, 8, 2), S(40, 1, 8, 3)]


def layout(**cfg):
    config = swajax.KVCacheConfig(page_size=16, enable_swa_scratch_reuse=True, **cfg)
    return swajax.pool.make_layout(SPECS, config, max_context=8192, max_batch=64, max_chunk=256)


def test_fitted_split_by_hand():
    # Q(B) for B sequences of 1000 tokens, chunk 256, scratch (the chunk costs one layer,
    # 32 B/token): 32000 B + 256 * 32 + 5280 B = 37280 B + 8192 <= 10^6 -> B = 26.6043...
    lay = layout()
    b = swajax.pool.fitted_batch(lay, 1000, 1_000_000)
    assert b == pytest.approx(991_808 / 37_280, rel=1e-9)
    sliding, full = 8192 + 5280 * b, 32000 * b
    ratio = swajax.pool.fitted_pool_ratio(lay, 1000, 1_000_000)
    assert ratio == pytest.approx((sliding / (sliding + full), full / (sliding + full)))
    # capped at max_batch: the ratio of Q for 10 sequences
    capped = swajax.pool.fitted_pool_ratio(lay, 1000, 1_000_000, max_batch=10)
    assert capped == pytest.approx((60992 / 380992, 320000 / 380992))
    # adaptive, at the mean occupancy 999.5 (prompt + half the new token): about 20.14 steps of
    # 1/8 octave; point 20 holds 26.6 rows of 999.5 tokens, point 21 (90, 1680 slots) 24.6
    split = swajax.pool.adaptive_split(lay, [(899, 1), (1099, 1), (999, 1)], 1_000_000)
    assert split.point == (0, 20)
    w = 2 ** (20 / 8)
    assert split.ratio == pytest.approx((1 / (1 + w), w / (1 + w)))
    # slots: int(10^6 * share) // slot bytes; the exact split would give 96 and 1662
    assert split.num_slots == (int(1e6 / (1 + w)) // 1536, int(1e6 * w / (1 + w)) // 512)
    assert split.num_slots == (97, 1659)


def test_adaptive_split_takes_the_grid_point_holding_more_whole_rows():
    # 4 x (293 + 64): mean occupancy 293 + 64 / 2 = 325 tokens (10,400 B of full slots per row),
    # the exact split at 7.54 steps, nearest grid point 8. Rows beside a 256-token chunk
    # (8192 B of sliding bytes), at most max_batch = 64:
    #   point 7: w = 2^(7/8), slots (352861 // 1536, 647138 // 512) = (229, 1263): sliding
    #     (229 * 1536 - 8192) / 5280 = 65.07 -> 64, full 1263 * 512 / 10400 = 62.18 -> 62 rows
    #   point 8: w = 2, slots (217, 1302): sliding (217 * 1536 - 8192) / 5280 = 61.58 -> 61
    lay = layout()
    split = swajax.pool.adaptive_split(lay, [(293, 64)] * 4, 1_000_000)
    assert split.point == (0, 7) and split.num_slots == (229, 1263)
    assert swajax.pool.rows_held(lay, (229, 1263), 325) == pytest.approx(
        1263 * 512 / 10400, rel=1e-6
    )
    assert swajax.pool.rows_held(lay, (217, 1302), 325) == pytest.approx(325_120 / 5280, rel=1e-6)
    # the admission headroom counts: 10 % of each group kept free
    assert swajax.pool.rows_held(lay, (217, 1302), 325, headroom=0.1) == pytest.approx(
        (217 * 1536 * 0.9 - 8192) / 5280, rel=1e-6
    )


def test_adaptive_split_hysteresis_and_minimum():
    lay = layout()
    split = swajax.pool.adaptive_split(lay, [(996, 4)] * 4, 1_000_000)
    # a 3 % longer queue stays in the cell (no re-split); 4x longer moves on
    assert swajax.pool.adaptive_split(lay, [(1026, 4)] * 4, 1_000_000, current=split) is None
    longer = swajax.pool.adaptive_split(lay, [(3996, 4)] * 4, 1_000_000, current=split)
    assert longer is not None and longer.num_slots[1] > split.num_slots[1]
    # the current split must still hold the largest request alone, else it is split anew
    need = (split.num_slots[0] + 10, 1)
    raised = swajax.pool.adaptive_split(lay, [(1026, 4)] * 4, 1_000_000, current=split, need=need)
    assert raised.num_slots[0] == need[0]
    assert sum(n * lay.slot_bytes(g) for g, n in enumerate(raised.num_slots)) <= 1_000_000
    with pytest.raises(ValueError, match="cannot hold one request"):
        swajax.pool.adaptive_split(lay, [(999, 1)], 1_000_000, need=(700, 1))
    with pytest.raises(ValueError, match="requests"):
        swajax.pool.adaptive_split(lay, [], 1_000_000)
    with pytest.raises(ValueError, match=r"\(5, 0\)"):
        swajax.pool.adaptive_split(lay, [(5, 0)], 1_000_000)


@pytest.mark.parametrize(
    "ratio, match",
    [("adaptve", "'adaptve'"), ("", "''"), ((1.0, 0.0), "pool_ratio"), ((), "pool_ratio")],
)
def test_bad_pool_ratio_values(ratio, match):
    with pytest.raises(ValueError, match=match):
        swajax.KVCacheConfig(pool_ratio=ratio)


def test_adaptive_config_plans_with_the_hints_until_requests_come():
    cfg = dict(max_gpu_total_bytes=1_000_000, expected_input_length=250, expected_batch_size=4)
    hinted = layout(**cfg)
    adaptive = layout(pool_ratio="adaptive", **cfg)
    assert swajax.KVCacheConfig(pool_ratio="adaptive").adaptive_pool_ratio
    assert [g.num_slots for g in adaptive.groups] == [g.num_slots for g in hinted.groups]


# ----------------------------------------------------------------------------- engine

ROWS, NEW, CHUNK = 8, 4, 64  # chunk 64 >> window 16: scratch reuse matters


def engine(model, ratio, quota, *, scratch=True, **kw):
    cfg = kv_config(scratch, max_gpu_total_bytes=quota, pool_ratio=ratio, **kw)
    return swajax.Engine(
        model,
        cfg,
        max_context=128,
        max_batch=ROWS,
        prefill_chunk_size=CHUNK,
        max_num_tokens=CHUNK,
        min_prefill_bucket=CHUNK,
        implementation="reference",
    )


@functools.cache
def quota_for_three():
    """Room for about three 100-token requests at their peak (the pool binds, not the rows)."""
    probe = engine(make_model("gemma4"), None, 64 << 20)
    need = swajax.pool.request_slots(probe.layout, 100, chunk=CHUNK, max_new_tokens=NEW - 1)
    return 3 * sum(n * probe.layout.slot_bytes(g) for g, n in enumerate(need))


def lengths(mean, seed):
    return np.random.default_rng(seed).integers(mean - 5, mean + 6, size=8).tolist()


def test_adaptive_matches_a_ratio_pinned_for_the_queue_and_dense_greedy():
    model = make_model("gemma4")
    quota = quota_for_three()
    prompts = prompts_of(lengths(96, 1), seed=1)  # 8x the hinted 12 tokens
    adaptive = engine(model, "adaptive", quota, expected_input_length=12)
    hinted = adaptive.num_slots
    assert adaptive.adapt_pool([len(p) for p in prompts], NEW)
    mean = np.mean([len(p) for p in prompts]) + NEW
    ratio = swajax.pool.fitted_pool_ratio(adaptive.layout, mean, quota, chunk=CHUNK, max_batch=ROWS)
    pinned = engine(model, ratio, quota)
    # the same split within the grid (+-4.4 % of a weight, one slot of rounding)
    for a, p in zip(adaptive.num_slots, pinned.num_slots, strict=True):
        assert abs(a - p) <= 0.045 * p + 1, (adaptive.num_slots, pinned.num_slots)
    # and far from the split the hint of 12 tokens gave (full layers get the bytes)
    assert adaptive.num_slots[1] > 1.5 * hinted[1], (hinted, adaptive.num_slots)
    expected = dense_greedy(model, prompts, NEW)
    out_a, stats_a = adaptive.run(prompts, NEW)
    out_p, stats_p = pinned.run(prompts, NEW)
    assert out_a == out_p == expected
    assert stats_a.num_slots == adaptive.num_slots and 2 <= stats_a.max_concurrent < ROWS
    adaptive.clear_prefix_cache()  # parked prefixes hold slots by design
    np.testing.assert_array_equal(np.asarray(adaptive.state.free_count), adaptive.num_slots)


def test_no_recompile_within_a_grid_cell_and_layouts_reused():
    model = make_model("gemma4")
    eng = engine(model, "adaptive", quota_for_three())
    a, b, c = (prompts_of(lengths(m, s), seed=s) for m, s in ((96, 2), (98, 3), (20, 4)))
    out_a, _ = eng.run(a, NEW)  # the first step splits the pool for the queue
    layout_a, traces = eng.layout, eng.trace_count
    compiled_a = trace_count(layout_a)  # here, or by an engine of this layout before
    assert compiled_a >= 2  # one prefill and one decode variant
    out_b, _ = eng.run(b, NEW)  # mean length +2 %: same cell, no re-split, no trace
    assert eng.layout == layout_a and eng.trace_count == traces
    out_c, _ = eng.run(c, NEW)  # 5x shorter requests: split anew (a new layout, compiled once)
    assert eng.layout.groups != layout_a.groups and trace_count(eng.layout) >= 2
    traces = eng.trace_count
    again, _ = eng.run(a, NEW)  # back: the first layout's compiled steps serve it again
    assert eng.layout == layout_a and eng.trace_count == traces
    assert trace_count(layout_a) == compiled_a
    assert again == out_a and len(out_b) == len(out_c) == 8


def test_a_re_split_drops_parked_prefixes():
    """Cached blocks do not hold the split (with prefix caching on by default they would
    hold it for good): a re-split while no request runs drops them with the old pool, and the
    engine then serves the same tokens from the new split."""
    model = make_model("gemma4")
    cfg = kv_config(True, max_gpu_total_bytes=quota_for_three(), pool_ratio="adaptive")
    eng = swajax.Engine(
        model,
        cfg,
        max_context=128,
        max_batch=2,
        prefill_chunk_size=CHUNK,
        max_num_tokens=CHUNK,
        min_prefill_bucket=CHUNK,
        implementation="reference",
    )
    long, short = prompts_of([100], seed=5), prompts_of([10], seed=6)
    eng.run(long, NEW)  # its prompt and history stay cached
    again, stats = eng.run(long, NEW)
    assert stats.prefix_tokens >= 96  # served from the cache while the split holds
    slots = eng.num_slots
    assert eng.adapt_pool([10], NEW) and eng.num_slots != slots
    np.testing.assert_array_equal(np.asarray(eng.state.free_count), eng.num_slots)
    out, _ = eng.run(short, NEW)
    assert out == dense_greedy(model, short, NEW)
    assert eng.adapt_pool([100], NEW) and eng.num_slots == slots
    third, stats = eng.run(long, NEW)
    assert stats.prefix_tokens == 0 and third == again == dense_greedy(model, long, NEW)


def test_adaptive_engine_rejects_bad_requests():
    model = make_model("gemma4")
    quota = quota_for_three()
    eng = engine(model, "adaptive", quota)
    with pytest.raises(ValueError, match="prompt_lengths"):
        eng.adapt_pool([0], NEW)
    with pytest.raises(ValueError, match="bytes of KV"):
        tiny = engine(model, "adaptive", quota // 4)
        tiny.add_request(list(range(1, 121)), 4)
    with pytest.raises(ValueError, match="pool_ratio='adaptive'"):
        engine(model, None, quota).adapt_pool([10])
    with pytest.raises(RuntimeError, match="idle"):
        eng.add_request(list(range(1, 50)), 4)
        eng.step()  # admitted and running: the pool cannot be rebound now
        eng.scheduler.rebind(eng.ledger, eng.pool.headroom)
    assert _budget.ADAPTIVE_GRID_STEPS == 8
