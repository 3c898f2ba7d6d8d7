"""Scratch reuse: stale/scratch ranges and the rotation against hand-computed cases.

The worked example is docs/design.md's table, typed in by hand. The invariants (V = K + 1, no two
layers share a page at one block position, pages inside the row's scratch slots, BAD never
transformed, too few slots -> ValueError) are checked over many ranges and pool sizes.
"""

import chex
import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings

import swajax
from swajax._scratch import ceil_div, scratch_slot_count

# docs/design.md worked example: N = 3 sliding layers (scale 6), scratch range blocks 4..8,
# scratch slots 7 and 9; K/V pages of each layer per block.
WORKED_EXAMPLE = {
    0: [(42, 43), (44, 45), (46, 47), (54, 55), (56, 57)],
    1: [(44, 45), (46, 47), (42, 43), (56, 57), (58, 59)],
    2: [(46, 47), (42, 43), (44, 45), (58, 59), (54, 55)],
}


def test_worked_example():
    for layer, expected in WORKED_EXAMPLE.items():
        k = swajax.pool.rotation_pages(4, 9, [7, 9], scale=6, layer_offset=2 * layer)
        v = swajax.pool.rotation_pages(4, 9, [7, 9], scale=6, layer_offset=2 * layer + 1)
        assert list(zip(k.tolist(), v.tolist(), strict=True)) == expected
    assert scratch_slot_count(5, 6) == 2


def test_worked_example_through_gather():
    # The same table from the page-table gather: one row, blocks 0..9, scratch range [4, 9).
    from pallas_kernels.page_table_gather import page_table_gather

    base = np.full((1, 12), -1, np.int32)
    base[0, :4] = [0, 1, 2, 3]
    base[0, 9] = 5
    tables = np.asarray(
        page_table_gather(
            base,
            np.array([10 * 16], np.int32),
            np.array([[4, 9]], np.int32),
            np.array([[7, 9]], np.int32),
            num_layers=3,
            page_size=16,
        )
    )
    for layer, expected in WORKED_EXAMPLE.items():
        k, v = tables[layer, 0, 0, 4:9].tolist(), tables[layer, 0, 1, 4:9].tolist()
        got = list(zip(k, v, strict=True))
        assert got == expected
        # normal blocks through the converter: slot * 6 + 2j (+1 for V)
        assert tables[layer, 0, 0, :4].tolist() == [s * 6 + 2 * layer for s in range(4)]
        assert tables[layer, 0, 0, 9] == 5 * 6 + 2 * layer
        assert tables[layer, 0, 0, 10:].tolist() == [-1, -1]  # beyond ceil(cap / tpb)


@settings(max_examples=50, deadline=None)
@given(
    num_layers=st.integers(1, 6),
    size=st.integers(0, 40),
    begin=st.integers(0, 20),
    first_slot=st.integers(0, 50),
)
def test_rotation_invariants(num_layers, size, begin, first_slot):
    scale = 2 * num_layers
    n = scratch_slot_count(size, scale)
    slots = list(range(first_slot, first_slot + 3 * n, 3))  # distinct, non-contiguous ids
    own = {s * scale + i for s in slots for i in range(scale)}
    pages = {}
    for j in range(num_layers):
        k = swajax.pool.rotation_pages(begin, begin + size, slots, scale=scale, layer_offset=2 * j)
        v = swajax.pool.rotation_pages(
            begin, begin + size, slots, scale=scale, layer_offset=2 * j + 1
        )
        chex.assert_trees_all_equal(v, k + 1)
        assert set(k.tolist()) | set(v.tolist()) <= own
        # one layer's blocks never collide (the whole chunk is written before attention)
        assert len(set(k.tolist()) | set(v.tolist())) == 2 * size
        pages[j] = (k, v)
    for o in range(size):  # within a column no page repeats
        col = [p for j in range(num_layers) for p in (pages[j][0][o], pages[j][1][o])]
        assert len(set(col)) == len(col)


def test_too_few_slots_raises():
    with pytest.raises(ValueError, match="needs 2 scratch slots"):
        swajax.pool.rotation_pages(4, 9, [7], scale=6, layer_offset=0)
    with pytest.raises(ValueError, match="needs 2 scratch slots"):
        swajax.pool.rotation_pages(4, 9, [7, -1], scale=6, layer_offset=0)
    with pytest.raises(ValueError, match="layer_offset"):
        swajax.pool.rotation_pages(4, 9, [7, 9], scale=6, layer_offset=6)


def test_stale_range_hand_computed():
    # W = 64, tpb = 16: the next query (position h) sees keys > h - 64. h = 128: keys >= 65,
    # block 3 (tokens 48..63) is stale, block 4 (64..79) still holds a visible key.
    assert swajax.pool.stale_range(128, 64, 0, 16) == (0, 4)
    assert swajax.pool.stale_range(127, 64, 0, 16) == (0, 4)  # keys >= 64: block 3 still stale
    assert swajax.pool.stale_range(126, 64, 0, 16) == (0, 3)
    assert swajax.pool.stale_range(10, 64, 0, 16) == (0, 0)
    assert swajax.pool.stale_range(500, None, 0, 16) == (0, 0)
    assert swajax.pool.stale_range(128, 64, 2, 16) == (2, 4)  # sink blocks never stale
    assert swajax.pool.stale_range(8, 4, 2, 16) == (1, 1)  # start = min(ceil(8/16), 2)


def test_scratch_range_hand_computed():
    # prefill 0 -> 128, W = 64, tpb = 16: stale(128) = [0, 4), chunk blocks [0, 8).
    assert swajax.pool.scratch_range(0, 128, 64, 0, 16, 0) == (0, 4)
    # max_rewind 20: stale(108) = [0, 2)
    assert swajax.pool.scratch_range(0, 128, 64, 0, 16, 20) == (0, 2)
    # second chunk 100 -> 300: stale(300) = [0, 14), chunk blocks [ceil(100/16)=7, 19)
    assert swajax.pool.scratch_range(100, 300, 64, 0, 16, 0) == (7, 14)
    # decode 299 -> 300: nothing of the chunk is stale
    b, e = swajax.pool.scratch_range(299, 300, 64, 0, 16, 0)
    assert b == e
    b, e = swajax.pool.scratch_range(0, 128, None, 0, 16, 0)  # full layers: empty
    assert b == e


@settings(max_examples=50, deadline=None)
@given(
    h=st.integers(0, 400),
    n=st.integers(1, 300),
    window=st.integers(1, 200),
    tpb=st.sampled_from([16, 32, 64]),
    rewind=st.integers(0, 40),
    sink=st.integers(0, 2),
)
def test_scratch_blocks_not_read_after_the_step(h, n, window, tpb, rewind, sink):
    """Oracle: a scratch block lies in the chunk and no query at position >= cap - rewind sees
    any of its tokens (brute force over positions)."""
    cap = h + n
    begin, end = (int(x) for x in swajax.pool.scratch_range(h, cap, window, sink, tpb, rewind))
    for o in range(begin, end):
        assert o >= sink
        assert o * tpb >= h and o < ceil_div(cap, tpb)  # never a block holding history
        last = (o + 1) * tpb - 1
        first_query = max(cap - rewind, 0)
        assert first_query - last >= window  # outside every later query's window
