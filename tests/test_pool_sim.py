"""End-to-end property test of the KV pool against a token-level memory oracle.

For random layouts (layer counts, windows, sinks, page sizes 16/32/64, two head geometries,
KV-shared readers, scratch on/off, max_rewind) and random steps (chunked prefill, decode,
rollback, freeing, prefix sharing), a NumPy "device memory" plays the forward pass: each writer
layer stores a unique id per (token version, layer, role) into the pages its page table names,
in layer order, and each layer then reads every key any of its queries may see (within the
window, < cap) through its page table and must find exactly what its writer stored for that
token. This checks the scratch rotation (later layers overwrite earlier layers' scratch pages),
out-of-window release, refcounted sharing and allocation together; slot accounting is checked
after every transform, and every slot must be free once all rows are freed.
"""

import collections
import dataclasses

import chex
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import event, given, settings

import gemma
import swajax
import swajax._layout
from swajax._scratch import BAD, ceil_div

GEOMETRIES = [(1, 8), (2, 4)]
# the gather's lax.cond re-traces on every eager call; one compilation per layout is cheaper
step_page_tables = jax.jit(swajax.pool.step_page_tables, static_argnums=0)


@st.composite
def layouts(draw):
    page_size = draw(st.sampled_from([16, 32, 64]))
    windows = [None, draw(st.integers(1, 80)), draw(st.integers(1, 80))]
    specs = []
    for i in range(draw(st.integers(1, 5))):
        window = draw(st.sampled_from(windows))
        heads, dim = draw(st.sampled_from(GEOMETRIES))
        sink = draw(st.sampled_from([0, 0, 0, 1])) if window is not None else 0
        specs.append(gemma.LayerSpec(window, heads, dim, kv_source=i, sink_blocks=sink))
    # KV-shared readers after all writers read the last writer of their kind (Gemma 4 style)
    for _ in range(draw(st.integers(0, 2))):
        w = draw(st.integers(0, len(specs) - 1))
        key = (specs[w].life_cycle, specs[w].num_kv_heads, specs[w].head_dim)
        last = max(
            i
            for i, s in enumerate(specs)
            if s.kv_source == i and (s.life_cycle, s.num_kv_heads, s.head_dim) == key
        )
        s = specs[last]
        specs.append(
            gemma.LayerSpec(
                s.window, s.num_kv_heads, s.head_dim, kv_source=last, sink_blocks=s.sink_blocks
            )
        )
    config = swajax.KVCacheConfig(
        page_size=page_size,
        max_rewind=draw(st.sampled_from([0, 0, 5, 40])),
        chunk_size=draw(st.sampled_from([64, 160])),
        enable_swa_scratch_reuse=draw(st.sampled_from([True, True, True, False])),
    )
    # few distinct array shapes: eager op compilations are then shared between examples
    max_context = draw(st.sampled_from([192, 320]))
    probe = swajax.pool.make_layout(
        specs, config, max_context=max_context, max_batch=1, num_slots=1
    )
    num_slots = tuple(draw(st.sampled_from([4, 12, 48])) for _ in probe.groups)
    return swajax.pool.make_layout(
        specs,
        config,
        max_context=max_context,
        max_batch=draw(st.sampled_from([1, 3])),
        num_slots=num_slots,
    )


def check_accounting(layout, state):
    """Free stack, refcounts and table references agree; pages of held slots are in bounds."""
    assert np.all(np.asarray(state.history) <= np.asarray(state.cap))
    for g, group in enumerate(layout.groups):
        rc = np.asarray(state.refcount[g])
        count = int(state.free_count[g])
        free = np.asarray(state.free_stack[g])[:count]
        assert np.all(rc >= 0)
        assert len(set(free.tolist())) == count and np.all(rc[free] == 0)
        assert int(np.sum(rc == 0)) == count
        base = np.asarray(state.base_tables[g])
        scratch = np.asarray(state.scratch_slots[g])
        refs = collections.Counter(base[base != BAD].tolist())
        scratch_ids = scratch[scratch != BAD].tolist()
        assert not set(scratch_ids) & set(refs)  # scratch slots are exclusive
        refs.update(scratch_ids)
        for s in range(group.num_slots):
            assert rc[s] == refs.get(s, 0), (g, s)
        # a slot named by several rows is a shared prefix block: the same block index
        for s, n in refs.items():
            if n > 1:
                assert len(set(np.argwhere(base == s)[:, 1].tolist())) == 1


def _tree_equal(a, b):
    return all(
        np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def check_pages(layout, state, layer, table):
    """Each page of a layer's table lies in the slot that backs its block: the base slot (with
    the converter's layer_offset) or one of the row's scratch slots; scratch pages are never
    shared by two blocks of the layer."""
    pool, j = layout.layer_table_index(layer)
    scale = layout.pools[pool].scale
    g = layout.pools[pool].group
    base = np.asarray(state.base_tables[g])
    scratch = np.asarray(state.scratch_slots[g])
    rng = np.asarray(state.scratch_range[g])
    scratch_pages = []
    for b in range(layout.max_batch):
        for o in np.nonzero(table[b, 0] != BAD)[0]:
            k = int(table[b, 0, o])
            if rng[b, 0] <= o < rng[b, 1]:
                assert base[b, o] == BAD  # scratch-backed blocks are BAD in the base table
                assert k // scale in scratch[b][scratch[b] != BAD].tolist()
                scratch_pages.append(k)
            else:
                assert (k // scale, k % scale) == (base[b, o], 2 * j)
    assert len(set(scratch_pages)) == len(scratch_pages)
    return len(scratch_pages)


def run_step(layout, state, mem, content, new_tokens, rng, ids, stats):
    """reserve -> per-layer write + read check -> advance; returns the new state."""
    tpb = layout.page_size
    need = np.asarray(swajax.pool.slots_needed(layout, state, new_tokens))
    ok, new = swajax.pool.reserve(layout, state, new_tokens)
    assert bool(ok) == bool(np.all(need <= np.asarray(swajax.pool.free_slots(layout, state))))
    if not ok:
        assert _tree_equal(new, state)
        return state
    state = new
    check_accounting(layout, state)
    h, cap = np.asarray(state.history), np.asarray(state.cap)
    for b in range(layout.max_batch):  # fresh token versions for this step's positions
        content[b, h[b] : cap[b]] = next(ids) + np.arange(cap[b] - h[b])
    tables = step_page_tables(layout, state)
    meta = swajax.pool.step_metadata(layout, state)
    chex.assert_trees_all_equal(np.asarray(meta.kv_lens), cap)
    chex.assert_trees_all_equal(np.asarray(meta.q_lens), cap - h)
    scale_l = 2 * layout.num_layers
    for layer, spec in enumerate(layout.layer_specs):
        table = np.asarray(swajax.pool.layer_page_table(layout, tables, layer))  # [B, 2, NB]
        pool, _ = layout.layer_table_index(layer)
        num_pages = layout.pools[pool].num_pages
        valid = table != BAD
        assert np.all(table[valid] < num_pages) and np.all(table[valid] >= 0)
        # BAD beyond each row's valid extent (bounded gather)
        for b in range(layout.max_batch):
            assert np.all(table[b, :, ceil_div(int(cap[b]), tpb) :] == BAD)
        chex.assert_trees_all_equal(
            table[:, 1][table[:, 0] != BAD], table[:, 0][table[:, 0] != BAD] + 1
        )
        stats["scratch_pages"] += check_pages(layout, state, layer, table)
        writer = spec.kv_source
        for b in range(layout.max_batch):
            if cap[b] == h[b]:
                continue
            if writer == layer:
                pos = np.arange(h[b], cap[b])
                for role in (0, 1):
                    pages = table[b, role, pos // tpb]
                    assert np.all(pages != BAD)
                    mem[pool][pages, pos % tpb] = content[b, pos] * scale_l + 2 * layer + role
            lo = 0 if spec.window is None else max(0, int(h[b]) - spec.window + 1)
            keys = np.arange(lo, cap[b])
            for role in (0, 1):
                pages = table[b, role, keys // tpb]
                assert np.all(pages != BAD), (layer, b, keys[pages == BAD])
                got = mem[pool][pages, keys % tpb]
                chex.assert_trees_all_equal(got, content[b, keys] * scale_l + 2 * writer + role)
    # speculative rollback of up to max_rewind tokens of this step
    accept = cap.copy()
    if layout.max_rewind:
        back = rng.integers(0, np.minimum(layout.max_rewind, cap - h) + 1)
        accept = cap - back
    state = swajax.pool.advance(layout, state, accept)
    check_accounting(layout, state)
    return state


def share_prefix(layout, state, src, dst, want):
    """Row dst starts from row src's first k = floor(min(want, history) / tpb) * tpb tokens
    through the prefix cache's transforms: src's blocks below k are parked as nodes 0 ..
    k / tpb - 1 (a cache of max_blocks nodes beside the state), dst adopts them, the cache
    releases them. Returns (ok, state); the state is unchanged where dst could not adopt."""
    nb, tpb = layout.max_blocks, layout.page_size
    cached = dataclasses.replace(layout, cache_nodes=nb)
    with_cache = dataclasses.replace(
        state, cached=tuple(jnp.full((nb,), -1, jnp.int32) for _ in layout.groups)
    )
    k = min(int(want), int(state.history[src])) // tpb * tpb
    n = k // tpb
    park = np.full((1, 2 + 2 * nb), -1, np.int32)
    park[0, :2], park[0, 2 + nb :] = (src, k), 0
    park[0, 2 : 2 + n] = np.arange(n)
    for g, base in enumerate(state.base_tables):
        park[0, 2 + nb : 2 + nb + n] |= (np.asarray(base)[src, :n] != -1).astype(np.int32) << g
    adopt = np.full((1, 2 + nb), -1, np.int32)
    adopt[0, :2], adopt[0, 2 : 2 + n] = (dst, k), np.arange(n)
    ok, new = swajax.pool.park(cached, with_cache, park)
    assert bool(ok)
    ok, new = swajax.pool.adopt(cached, new, adopt)
    new = swajax.pool.release_cached(cached, new, np.arange(nb, dtype=np.int32))
    return ok, dataclasses.replace(new, cached=state.cached)


@settings(max_examples=25, deadline=None)
@given(layout=layouts(), seed=st.integers(0, 2**31 - 1), num_steps=st.integers(1, 12))
def test_pool_matches_memory_oracle(layout, seed, num_steps):
    rng = np.random.default_rng(seed)
    mem = [np.full((p.num_pages, layout.page_size), -1, np.int64) for p in layout.pools]
    content = np.full((layout.max_batch, layout.max_context), -1, np.int64)
    ids = iter(range(1, 10**9, 10**4))
    state = swajax.pool.init_state(layout)
    stats = collections.Counter()
    check_accounting(layout, state)
    for _ in range(num_steps):
        h = np.asarray(state.history)
        op = rng.random()
        if op < 0.1:
            rows = rng.random(layout.max_batch) < 0.5
            state = swajax.pool.free_rows(layout, state, rows)
            check_accounting(layout, state)
            continue
        if op < 0.2 and layout.max_batch > 1:
            src, dst = rng.choice(layout.max_batch, 2, replace=False)
            want = int(rng.integers(0, h[src] + 1))
            ok, new = share_prefix(layout, state, src, dst, want)
            if ok:
                k = int(new.history[dst])
                assert k == (min(want, h[src]) // layout.page_size) * layout.page_size
                content[dst, :k] = content[src, :k]
            else:
                assert _tree_equal(new, state)
            state = new
            check_accounting(layout, state)
            continue
        room = layout.max_context - h
        kind = rng.random(layout.max_batch)
        n = np.where(
            kind < 0.3, np.minimum(1, room), rng.integers(0, np.minimum(room, 220) + 1)
        ).astype(np.int32)
        state = run_step(layout, state, mem, content, n, rng, ids, stats)
    if stats["scratch_pages"]:
        event("scratch pages in use")
    state = swajax.pool.free_rows(layout, state, np.ones(layout.max_batch, bool))
    check_accounting(layout, state)
    chex.assert_trees_all_equal(
        np.asarray(state.free_count), np.asarray([g.num_slots for g in layout.groups])
    )


def _run(layout, steps, seed=0):
    rng = np.random.default_rng(seed)
    mem = [np.full((p.num_pages, layout.page_size), -1, np.int64) for p in layout.pools]
    content = np.full((layout.max_batch, layout.max_context), -1, np.int64)
    ids = iter(range(1, 10**9, 10**4))
    state = swajax.pool.init_state(layout)
    stats = collections.Counter()
    for n in steps:
        ok, _ = swajax.pool.reserve(layout, state, np.asarray(n, np.int32))
        assert ok
        state = run_step(layout, state, mem, content, np.asarray(n, np.int32), rng, ids, stats)
    assert stats["scratch_pages"] > 0
    return state


def _gemma4_like(num_layers_sliding=3):
    """Sliding (2 x 8) and full (1 x 16) writers, then KV-shared readers of the last of each."""
    specs = []
    for i in range(2 * num_layers_sliding):
        sliding = i % 2 == 0 or i < num_layers_sliding
        specs.append(
            gemma.LayerSpec(40, 2, 8, kv_source=i)
            if sliding
            else gemma.LayerSpec(None, 1, 16, kv_source=i)
        )
    last_s = max(i for i, s in enumerate(specs) if s.window)
    last_f = max(i for i, s in enumerate(specs) if s.window is None)
    specs += [
        gemma.LayerSpec(40, 2, 8, kv_source=last_s),
        gemma.LayerSpec(None, 1, 16, kv_source=last_f),
        gemma.LayerSpec(40, 2, 8, kv_source=last_s),
    ]
    return specs


def test_gemma4_like_chunked_prefill_then_decode_with_scratch():
    layout = swajax.pool.make_layout(
        _gemma4_like(),
        swajax.KVCacheConfig(page_size=16, chunk_size=128, enable_swa_scratch_reuse=True),
        max_context=400,
        max_batch=3,
        num_slots=(60, 60),
    )
    steps = [[128, 100, 37], [128, 0, 128], [100, 1, 1]] + [[1, 1, 1]] * 3
    # the first step has scratch: stale(128) = blocks [0, 5) with W = 40
    _, new = swajax.pool.reserve(
        layout, swajax.pool.init_state(layout), np.array(steps[0], np.int32)
    )
    sliding = [g for g, grp in enumerate(layout.groups) if grp.is_sliding][0]
    assert np.asarray(new.scratch_range[sliding])[0].tolist() == [0, 5]
    state = _run(layout, steps)
    state = swajax.pool.free_rows(layout, state, np.ones(3, bool))
    chex.assert_trees_all_equal(np.asarray(state.free_count), np.asarray([60, 60]))


def test_shared_kv_writer_check_is_needed(monkeypatch):
    """A reader whose writer is followed by another scratch writer of its pool reads garbage:
    make_layout refuses it, and with the check bypassed the memory oracle catches it."""
    specs = [
        gemma.LayerSpec(16, 1, 8, kv_source=0),
        gemma.LayerSpec(16, 1, 8, kv_source=1),
        gemma.LayerSpec(16, 1, 8, kv_source=0),  # reads layer 0; layer 1 wrote scratch since
    ]
    config = swajax.KVCacheConfig(page_size=16, chunk_size=128, enable_swa_scratch_reuse=True)
    with pytest.raises(ValueError, match="KV-shared layer 2 reads layer 0"):
        swajax.pool.make_layout(specs, config, max_context=256, max_batch=1, num_slots=40)
    # scratch off: fine
    swajax.pool.make_layout(
        specs,
        dataclasses.replace(config, enable_swa_scratch_reuse=False),
        max_context=256,
        max_batch=1,
        num_slots=40,
    )
    monkeypatch.setattr(swajax._layout, "_check_shared_kv_scratch", lambda *a: None)
    layout = swajax.pool.make_layout(specs, config, max_context=256, max_batch=1, num_slots=40)
    with pytest.raises(AssertionError, match="not equal"):
        _run(layout, [[128]])
