"""Transforms on hand-computed cases: reserve/advance/free, exhaustion, prefix sharing,
queries, jit without retracing, and pool roots donated without a copy."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gemma
import swajax

S = gemma.LayerSpec
BAD = -1


def small_layout(num_slots=(40, 40), scratch=True, max_batch=2, **cfg):
    # group 0: sliding W = 40 (layers 0, 1, 3), group 1: full (layer 2); tpb 16
    specs = [S(40, 1, 8, 0), S(40, 1, 8, 1), S(None, 1, 8, 2), S(40, 1, 8, 3)]
    config = swajax.KVCacheConfig(
        page_size=16, chunk_size=128, enable_swa_scratch_reuse=scratch, **cfg
    )
    return swajax.pool.make_layout(
        specs, config, max_context=256, max_batch=max_batch, num_slots=num_slots
    )


def leaves_equal(a, b):
    return all(
        np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def test_prefill_step_by_hand():
    layout = small_layout()
    state = swajax.pool.init_state(layout)
    n = np.array([128, 20], np.int32)
    # sliding: row 0 grows 0 -> 128: stale(128) = [0, floor(89/16) = 5) -> scratch blocks 0..4,
    # ceil(5 * 2 / 6) = 2 scratch slots, normal blocks 5..7; row 1: 2 normal blocks.
    # full: 8 + 2 blocks.
    assert np.asarray(swajax.pool.slots_needed(layout, state, n)).tolist() == [3 + 2 + 2, 10]
    per_row = swajax.pool.slots_needed(layout, state, n, per_row=True)
    assert np.asarray(per_row).tolist() == [[5, 2], [8, 2]]
    ok, state = swajax.pool.reserve(layout, state, n)
    assert ok
    assert np.asarray(swajax.pool.row_slots(layout, state)).tolist() == [[5, 2], [8, 2]]
    base_s = np.asarray(state.base_tables[0])
    assert base_s[0, :9].tolist() == [BAD] * 5 + [0, 1, 2, BAD]
    assert base_s[1, :3].tolist() == [3, 4, BAD]
    assert np.asarray(state.scratch_range[0]).tolist() == [[0, 5], [BAD, BAD]]
    assert np.asarray(state.scratch_slots[0]).tolist() == [[5, 6, BAD], [BAD] * 3]
    assert np.asarray(state.base_tables[1])[0, :8].tolist() == list(range(8))
    assert np.asarray(swajax.pool.free_slots(layout, state)).tolist() == [33, 30]
    meta = swajax.pool.step_metadata(layout, state)
    assert np.asarray(meta.kv_lens).tolist() == [128, 20]
    assert np.asarray(meta.q_starts).tolist() == [0, 128, 148]
    tables = swajax.pool.step_page_tables(layout, state)
    chex.assert_shape(tables[0], (3, 2, 2, layout.max_blocks))
    # layer 1 (j = 1) of the sliding pool, row 0, K: rotation over slots 5, 6 (scale 6)
    k = np.asarray(tables[0])[1, 0, 0]
    assert k[:5].tolist() == [32, 34, 30, 38, 40]  # 5*6 + (0,2,4)+2 mod 6, then slot 6
    assert k[5:9].tolist() == [0 * 6 + 2, 1 * 6 + 2, 2 * 6 + 2, BAD]

    state = swajax.pool.advance(layout, state)
    # history 128: stale(128) = [0, 5) (already BAD); scratch released
    assert np.asarray(state.history).tolist() == [128, 20]
    assert np.asarray(state.scratch_slots[0]).tolist() == [[BAD] * 3] * 2
    assert np.asarray(swajax.pool.free_slots(layout, state)).tolist() == [35, 30]
    # decode one token on row 0: block 8 gets the top of the free stack (scratch slot 6, just
    # pushed back); advance to 129: stale = [0, 5) still
    ok, state = swajax.pool.reserve(layout, state, np.array([1, 0], np.int32))
    assert ok and np.asarray(state.scratch_range[0]).tolist() == [[BAD, BAD], [BAD, BAD]]
    state = swajax.pool.advance(layout, state)
    assert np.asarray(state.base_tables[0])[0, :10].tolist() == [BAD] * 5 + [0, 1, 2, 6, BAD]
    # 40 more tokens (blocks 9, 10 get slots 5, 7; no scratch: stale(169) = [0, 8) ends
    # before the chunk) -> blocks 5..7 released
    ok, state = swajax.pool.reserve(layout, state, np.array([40, 0], np.int32))
    state = swajax.pool.advance(layout, state)
    assert np.asarray(state.base_tables[0])[0, :12].tolist() == [BAD] * 8 + [6, 5, 7, BAD]
    state = swajax.pool.free_rows(layout, state, np.array([True, True]))
    assert np.asarray(swajax.pool.free_slots(layout, state)).tolist() == [40, 40]
    assert all(int(jnp.sum(r)) == 0 for r in state.refcount)


def test_exhaustion_leaves_state_unchanged():
    layout = small_layout(num_slots=(6, 9))
    state = swajax.pool.init_state(layout)
    ok, state = swajax.pool.reserve(layout, state, np.array([64, 0], np.int32))  # 4 full blocks
    assert ok
    before = state
    # row 1 wants 96 tokens = 6 full blocks, only 5 left: the whole call fails
    need = np.asarray(swajax.pool.slots_needed(layout, state, np.array([0, 96], np.int32)))
    assert need[1] == 6 and np.asarray(state.free_count)[1] == 5
    ok, after = swajax.pool.reserve(layout, state, np.array([0, 96], np.int32))
    assert not ok and leaves_equal(after, before)
    # a failing row (beyond max_context) fails the call too
    ok, after = swajax.pool.reserve(layout, state, np.array([0, 300], np.int32))
    assert not ok and leaves_equal(after, before)
    # growing a row whose step is in flight (cap > history) is refused
    ok, after = swajax.pool.reserve(layout, state, np.array([5, 0], np.int32))
    assert not ok and leaves_equal(after, before)
    ok, after = swajax.pool.reserve(layout, state, np.array([-1, 0], np.int32))
    assert not ok and leaves_equal(after, before)
    # after the step, freeing gives every slot back
    state = swajax.pool.free_rows(
        layout, swajax.pool.advance(layout, state), np.array([True, True])
    )
    assert np.asarray(state.free_count).tolist() == [6, 9]


def test_share_prefix_refcounts():
    layout = small_layout(scratch=False, max_batch=3)
    state = swajax.pool.init_state(layout)
    ok, state = swajax.pool.reserve(layout, state, np.array([70, 0, 0], np.int32))
    state = swajax.pool.advance(layout, state)
    # row 0: history 70, sliding stale(70) = [0, floor(31/16) = 1): block 0 released
    assert np.asarray(state.base_tables[0])[0, :6].tolist() == [BAD, 1, 2, 3, 4, BAD]
    ok, state2 = swajax.pool.share_prefix(layout, state, 0, 1, 70)
    assert ok
    # k = 64: dst needs sliding blocks outside stale(64) = [0, 1) -> 1..3, full 0..3
    assert int(state2.history[1]) == 64 and int(state2.cap[1]) == 64
    assert np.asarray(state2.base_tables[0])[1, :5].tolist() == [BAD, 1, 2, 3, BAD]
    assert np.asarray(state2.base_tables[1])[1, :5].tolist() == [0, 1, 2, 3, BAD]
    assert np.asarray(state2.refcount[1])[:5].tolist() == [2, 2, 2, 2, 1]
    assert np.asarray(state2.free_count).tolist() == np.asarray(state.free_count).tolist()
    # dst not empty -> refused, unchanged
    ok, state3 = swajax.pool.share_prefix(layout, state2, 0, 1, 64)
    assert not ok and leaves_equal(state3, state2)
    # a prefix whose needed sliding block was released cannot be shared: row 0 moves on
    ok, state4 = swajax.pool.reserve(layout, state2, np.array([100, 0, 0], np.int32))
    state4 = swajax.pool.advance(layout, state4)  # history 170: stale = [0, 8)
    ok, state5 = swajax.pool.share_prefix(layout, state4, 0, 2, 96)  # needs sliding blocks 4, 5
    assert not ok and leaves_equal(state5, state4)
    # freeing the source keeps the shared blocks for row 1
    state6 = swajax.pool.free_rows(layout, state4, np.array([True, False, False]))
    assert np.asarray(state6.refcount[1])[:4].tolist() == [1, 1, 1, 1]
    state6 = swajax.pool.free_rows(layout, state6, np.array([False, True, False]))
    assert np.asarray(state6.free_count).tolist() == [40, 40]


def _count_traces(fn):
    count = [0]

    def wrapped(*args):
        count[0] += 1
        return fn(*args)

    return wrapped, count


def test_transforms_do_not_retrace():
    layout = small_layout()
    state = swajax.pool.init_state(layout)
    reserve, n_reserve = _count_traces(swajax.pool.reserve)
    advance, n_advance = _count_traces(swajax.pool.advance)
    tables, n_tables = _count_traces(swajax.pool.step_page_tables)
    free, n_free = _count_traces(swajax.pool.free_rows)
    share, n_share = _count_traces(swajax.pool.share_prefix)
    reserve, advance = jax.jit(reserve, static_argnums=0), jax.jit(advance, static_argnums=0)
    tables, free = jax.jit(tables, static_argnums=0), jax.jit(free, static_argnums=0)
    share = jax.jit(share, static_argnums=0)
    for n, rows, src in (([128, 3], [False, True], 0), ([1, 100], [True, False], 1)):
        ok, state = reserve(layout, state, jnp.array(n, jnp.int32))
        assert ok
        tables(layout, state)
        state = advance(layout, state)
        share(layout, state, jnp.int32(src), jnp.int32(1 - src), jnp.int32(32))
        state = free(layout, state, jnp.array(rows))
    assert (n_reserve[0], n_advance[0], n_tables[0], n_free[0], n_share[0]) == (1, 1, 1, 1, 1)


def test_pool_roots_donated_without_copy():
    layout = small_layout(num_slots=(64, 64))
    state = swajax.pool.init_state(layout)
    pool_bytes = sum(p.nbytes for p in state.pools)

    def step(layout, state, n):
        ok, state = swajax.pool.reserve(layout, state, n)
        state = swajax.pool.advance(layout, state)
        return ok, state

    f = jax.jit(step, static_argnums=0, donate_argnums=1)
    n = jnp.array([100, 7], jnp.int32)
    compiled = f.lower(layout, state, n).compile()
    stats = compiled.memory_analysis()
    if stats is not None:  # pool roots alias their outputs; no temporary pool-sized buffer
        assert stats.alias_size_in_bytes >= pool_bytes
        assert stats.temp_size_in_bytes < min(p.nbytes for p in state.pools)
    pointers = [p.unsafe_buffer_pointer() for p in state.pools]
    ok, new = f(layout, state, n)
    assert ok
    assert all(p.is_deleted() for p in state.pools)
    assert [p.unsafe_buffer_pointer() for p in new.pools] == pointers


def test_argument_validation():
    layout = small_layout()
    state = swajax.pool.init_state(layout)
    with pytest.raises(ValueError, match=r"new_tokens must have shape \[max_batch=2\]"):
        swajax.pool.reserve(layout, state, np.array([1, 2, 3], np.int32))
    with pytest.raises(TypeError, match="new_tokens must be an integer array"):
        swajax.pool.reserve(layout, state, np.array([1.0, 2.0]))
    with pytest.raises(TypeError, match="rows must be bool"):
        swajax.pool.free_rows(layout, state, np.array([1, 0]))
    with pytest.raises(ValueError, match="src must be an integer scalar"):
        swajax.pool.share_prefix(layout, state, np.array([0]), 1, 5)
    with pytest.raises(ValueError, match=r"layer must be in \[0, 4\)"):
        layout.layer_table_index(4)


def test_rollback_keeps_rewind_tokens():
    layout = small_layout(max_rewind=20)
    state = swajax.pool.init_state(layout)
    # with max_rewind 20, scratch = stale(128 - 20 = 108) = [0, floor(69/16) = 4)
    ok, state = swajax.pool.reserve(layout, state, np.array([128, 0], np.int32))
    assert np.asarray(state.scratch_range[0])[0].tolist() == [0, 4]
    state = swajax.pool.advance(layout, state, np.array([120, 0], np.int32))  # 8 tokens rejected
    assert np.asarray(state.history).tolist() == [120, 0]
    # released: stale(120 - 20) = [0, floor(61/16) = 3) -> nothing normal there; block 7
    # (tokens 112..127) stays held for the rolled-back positions
    base = np.asarray(state.base_tables[0])[0, :9].tolist()
    assert base == [BAD] * 4 + [0, 1, 2, 3, BAD]
    ok, state = swajax.pool.reserve(layout, state, np.array([8, 0], np.int32))
    assert ok and np.asarray(state.base_tables[0])[0, :9].tolist() == base  # reused, no new slot


def test_prefix_shared_with_scratch_at_a_step_boundary():
    layout = small_layout(max_batch=2)
    state = swajax.pool.init_state(layout)
    ok, state = swajax.pool.reserve(layout, state, np.array([128, 0], np.int32))
    assert np.asarray(state.scratch_range[0])[0].tolist() == [0, 5]  # blocks 0..4 scratch
    state = swajax.pool.advance(layout, state)
    # the window ending at 128 (blocks 5..7) is in normal pages: shareable
    ok, shared = swajax.pool.share_prefix(layout, state, 0, 1, 128)
    assert ok and int(shared.history[1]) == 128
    assert np.asarray(shared.base_tables[0])[1, :9].tolist() == [BAD] * 5 + [0, 1, 2, BAD]
    # a boundary inside a scratch range is not: its window was scratch (BAD)
    ok, same = swajax.pool.share_prefix(layout, state, 0, 1, 96)
    assert not ok and leaves_equal(same, state)
