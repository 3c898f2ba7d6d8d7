"""Transforms on hand-computed cases: reserve/advance/free, exhaustion, the prefix cache's
park / adopt / release, queries, jit without retracing, and pool roots donated without a
copy."""

import dataclasses

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


def cached_layout(nodes=8, **kw):
    return dataclasses.replace(small_layout(**kw), cache_nodes=nodes)


def park_ops(layout, *parks):
    """i32[S, 2 + 2 NB] of (row, k, nodes, masks) parks."""
    nb = layout.max_blocks
    out = np.full((len(parks), 2 + 2 * nb), -1, np.int32)
    out[:, 2 + nb :] = 0
    for i, (row, k, nodes, masks) in enumerate(parks):
        out[i, :2] = row, k
        out[i, 2 : 2 + len(nodes)] = nodes
        out[i, 2 + nb : 2 + nb + len(masks)] = masks
    return out


def adopt_ops(layout, *adopts):
    nb = layout.max_blocks
    out = np.full((len(adopts), 2 + nb), -1, np.int32)
    for i, (row, k, nodes) in enumerate(adopts):
        out[i, :2] = row, k
        out[i, 2 : 2 + len(nodes)] = nodes
    return out


def test_park_adopt_release_refcounts():
    """By hand: a row parks its blocks, another row adopts them, the cache releases them."""
    layout = cached_layout(scratch=False, max_batch=3)
    state = swajax.pool.init_state(layout)
    assert [c.shape for c in state.cached] == [(8,), (8,)]
    ok, state = swajax.pool.reserve(layout, state, np.array([70, 0, 0], np.int32))
    state = swajax.pool.advance(layout, state)
    # row 0: history 70, sliding stale(70) = [0, floor(31/16) = 1): block 0 released
    assert np.asarray(state.base_tables[0])[0, :6].tolist() == [BAD, 1, 2, 3, 4, BAD]
    # park k = 64 as nodes 3, 4, 5, 6: block 0 in the full group only (bit 1)
    park = park_ops(layout, (0, 64, [3, 4, 5, 6], [2, 3, 3, 3]))
    ok, parked = swajax.pool.park(layout, state, park)
    assert ok
    assert np.asarray(parked.cached[0]).tolist() == [BAD] * 4 + [1, 2, 3, BAD]
    assert np.asarray(parked.cached[1]).tolist() == [BAD] * 3 + [0, 1, 2, 3, BAD]
    assert np.asarray(parked.refcount[1])[:5].tolist() == [2, 2, 2, 2, 1]
    assert np.asarray(parked.refcount[0])[:5].tolist() == [0, 2, 2, 2, 1]
    assert np.asarray(parked.free_count).tolist() == np.asarray(state.free_count).tolist()
    # a block the row does not hold, or a node that names a block already: refused, unchanged
    for bad in ((0, 64, [0, 1, 2, 7], [3, 3, 3, 3]), (0, 32, [3, 1], [2, 0])):
        ok, same = swajax.pool.park(layout, parked, park_ops(layout, bad))
        assert not ok and leaves_equal(same, parked)
    ok, same = swajax.pool.park(layout, parked, park_ops(layout, (0, 80, list(range(5)), [2] * 5)))
    assert not ok and leaves_equal(same, parked)  # k beyond the row's history
    # row 1 adopts k = 64: sliding blocks outside stale(64) = [0, 1) -> 1..3, full 0..3
    ok, adopted = swajax.pool.adopt(layout, parked, adopt_ops(layout, (1, 64, [3, 4, 5, 6])))
    assert ok and int(adopted.history[1]) == 64 and int(adopted.cap[1]) == 64
    assert np.asarray(adopted.base_tables[0])[1, :5].tolist() == [BAD, 1, 2, 3, BAD]
    assert np.asarray(adopted.base_tables[1])[1, :5].tolist() == [0, 1, 2, 3, BAD]
    assert np.asarray(adopted.refcount[1])[:5].tolist() == [3, 3, 3, 3, 1]
    # a row that is not empty, or a needed block not cached: refused, unchanged
    ok, same = swajax.pool.adopt(layout, adopted, adopt_ops(layout, (1, 64, [3, 4, 5, 6])))
    assert not ok and leaves_equal(same, adopted)
    released = swajax.pool.release_cached(layout, adopted, np.array([4, -1], np.int32))
    assert int(released.cached[0][4]) == BAD and int(released.cached[1][4]) == BAD
    ok, same = swajax.pool.adopt(layout, released, adopt_ops(layout, (2, 64, [3, 4, 5, 6])))
    assert not ok and leaves_equal(same, released)
    # the cache lets go: rows 0 and 1 keep their references; freeing them returns every slot
    state = swajax.pool.release_cached(layout, released, np.array([3, 5, 6], np.int32))
    assert all((np.asarray(c) == BAD).all() for c in state.cached)
    assert np.asarray(state.refcount[1])[:5].tolist() == [2, 2, 2, 2, 1]
    state = swajax.pool.free_rows(layout, state, np.array([True, True, False]))
    assert np.asarray(state.free_count).tolist() == [40, 40]
    # a cached block outlives its row and is freed by its release
    ok, state = swajax.pool.reserve(layout, state, np.array([32, 0, 0], np.int32))
    state = swajax.pool.advance(layout, state)
    ok, state = swajax.pool.park(layout, state, park_ops(layout, (0, 32, [0, 1], [3, 3])))
    state = swajax.pool.free_rows(layout, state, np.array([True, False, False]))
    assert ok and np.asarray(state.free_count).tolist() == [38, 38]
    state = swajax.pool.release_cached(layout, state, np.array([1, 0], np.int32))
    assert np.asarray(state.free_count).tolist() == [40, 40]


def _count_traces(fn):
    count = [0]

    def wrapped(*args):
        count[0] += 1
        return fn(*args)

    return wrapped, count


def test_transforms_do_not_retrace():
    layout = cached_layout()
    state = swajax.pool.init_state(layout)
    reserve, n_reserve = _count_traces(swajax.pool.reserve)
    advance, n_advance = _count_traces(swajax.pool.advance)
    tables, n_tables = _count_traces(swajax.pool.step_page_tables)
    free, n_free = _count_traces(swajax.pool.free_rows)
    park, n_park = _count_traces(swajax.pool.park)
    adopt, n_adopt = _count_traces(swajax.pool.adopt)
    release, n_release = _count_traces(swajax.pool.release_cached)
    reserve, advance = jax.jit(reserve, static_argnums=0), jax.jit(advance, static_argnums=0)
    tables, free = jax.jit(tables, static_argnums=0), jax.jit(free, static_argnums=0)
    park, adopt = jax.jit(park, static_argnums=0), jax.jit(adopt, static_argnums=0)
    release = jax.jit(release, static_argnums=0)
    for n, rows, src in (([128, 3], [False, True], 0), ([1, 100], [True, False], 1)):
        ok, state = reserve(layout, state, jnp.array(n, jnp.int32))
        assert ok
        tables(layout, state)
        state = advance(layout, state)
        _, state = park(layout, state, park_ops(layout, (src, 32, [0, 1], [2, 2])))
        adopt(layout, state, adopt_ops(layout, (1 - src, 32, [0, 1])))
        state = release(layout, state, jnp.array([0, 1], jnp.int32))
        state = free(layout, state, jnp.array(rows))
    counts = (n_reserve, n_advance, n_tables, n_free, n_park, n_adopt, n_release)
    assert [c[0] for c in counts] == [1] * 7


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
    with pytest.raises(ValueError, match=r"park ops must be an integer array of shape \[n, 34\]"):
        swajax.pool.park(layout, state, np.zeros((1, 3), np.int32))
    with pytest.raises(ValueError, match=r"adopt ops must be an integer array of shape \[n, 18\]"):
        swajax.pool.adopt(layout, state, np.zeros((1, 18), np.float32))
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


def test_cached_prefix_with_scratch_at_a_step_boundary():
    layout = cached_layout(nodes=16, max_batch=2)
    state = swajax.pool.init_state(layout)
    ok, state = swajax.pool.reserve(layout, state, np.array([128, 0], np.int32))
    assert np.asarray(state.scratch_range[0])[0].tolist() == [0, 5]  # blocks 0..4 scratch
    state = swajax.pool.advance(layout, state)
    # the window ending at 128 (blocks 5..7) is in normal pages: cached in both groups
    masks = [2] * 5 + [3] * 3
    ok, state = swajax.pool.park(layout, state, park_ops(layout, (0, 128, range(8), masks)))
    assert ok
    ok, shared = swajax.pool.adopt(layout, state, adopt_ops(layout, (1, 128, range(8))))
    assert ok and int(shared.history[1]) == 128
    assert np.asarray(shared.base_tables[0])[1, :9].tolist() == [BAD] * 5 + [0, 1, 2, BAD]
    # a boundary inside the scratch range is not: its window was scratch (never cached)
    ok, same = swajax.pool.adopt(layout, state, adopt_ops(layout, (1, 96, range(6))))
    assert not ok and leaves_equal(same, state)
