"""Page-table gather: the jnp reference against a hand-written NumPy loop oracle."""

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

from pallas_kernels.page_table_gather import page_table_gather, page_table_gather_reference

BAD = -1


def oracle(base_table, kv_lens, scratch_range, scratch_slots, num_layers, page_size):
    """Entry by entry, straight from DESIGN.md's converter and rotation definitions."""
    batch, max_blocks = base_table.shape
    scale = 2 * num_layers
    out = np.full((num_layers, batch, 2, max_blocks), BAD, np.int64)
    for j in range(num_layers):
        for b in range(batch):
            extent = -(-int(kv_lens[b]) // page_size)
            begin, end = int(scratch_range[b, 0]), int(scratch_range[b, 1])
            for role in range(2):
                layer_offset = 2 * j + role
                for o in range(min(extent, max_blocks)):
                    if begin <= o < end:
                        t = (o - begin) * 2
                        if t // scale >= scratch_slots.shape[1]:
                            continue
                        slot = int(scratch_slots[b, t // scale])
                        if slot == BAD:
                            continue
                        out[j, b, role, o] = slot * scale + ((t % scale) + layer_offset) % scale
                    elif base_table[b, o] != BAD:
                        out[j, b, role, o] = int(base_table[b, o]) * scale + layer_offset
    return out


@st.composite
def gather_inputs(draw):
    batch = draw(st.integers(1, 4))
    max_blocks = draw(st.integers(1, 12))
    num_layers = draw(st.integers(1, 4))
    page_size = draw(st.sampled_from([16, 32, 64]))
    num_scratch = draw(st.integers(0, 3))
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    base = rng.integers(0, 50, (batch, max_blocks)).astype(np.int32)
    base[rng.random(base.shape) < 0.3] = BAD
    kv_lens = rng.integers(0, max_blocks * page_size + 1, batch).astype(np.int32)
    begin = rng.integers(0, max_blocks + 1, batch)
    end = begin + rng.integers(0, 5, batch)
    rng_arr = np.stack([begin, end], 1).astype(np.int32)
    if draw(st.booleans()):  # some rows without scratch, marked BAD
        rng_arr[rng.random(batch) < 0.5] = BAD
    slots = rng.integers(50, 80, (batch, num_scratch)).astype(np.int32)
    slots[rng.random(slots.shape) < 0.2] = BAD
    return base, kv_lens, rng_arr, slots, num_layers, page_size


@settings(max_examples=30, deadline=None)
@given(args=gather_inputs())
def test_reference_matches_loop_oracle(args):
    base, kv_lens, rng_arr, slots, num_layers, page_size = args
    got = page_table_gather(
        jnp.asarray(base),
        jnp.asarray(kv_lens),
        jnp.asarray(rng_arr),
        jnp.asarray(slots),
        num_layers=num_layers,
        page_size=page_size,
        implementation="reference",
    )
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(
        np.asarray(got), oracle(base, kv_lens, rng_arr, slots, num_layers, page_size)
    )


def test_fast_path_and_jit():
    """No row with scratch: the converter only; jit gives the same, with and without scratch."""
    base = np.array([[3, BAD, 5, 6], [BAD, 1, 2, BAD]], np.int32)
    kv_lens = np.array([64, 40], np.int32)  # page_size 16: 4 and 3 valid blocks
    none = np.full((2, 2), BAD, np.int32)
    slots = np.full((2, 1), BAD, np.int32)
    f = jax.jit(page_table_gather_reference, static_argnames=("num_layers", "page_size"))
    got = np.asarray(f(base, kv_lens, none, slots, num_layers=2, page_size=16))
    # layer 1 (offset 2), K role, by hand: slot * 4 + 2
    assert got[1, 0, 0].tolist() == [14, BAD, 22, 26]
    assert got[1, 1, 1].tolist() == [BAD, 7, 11, BAD]  # V = K + 1, block 3 beyond the extent
    with_scratch = np.array([[1, 3], [BAD, BAD]], np.int32)
    slots = np.array([[9], [BAD]], np.int32)
    got = np.asarray(f(base, kv_lens, with_scratch, slots, num_layers=2, page_size=16))
    # row 0 blocks 1, 2 rotate through slot 9 (pages 36..39): layer 1 K at (0+2)%4, (2+2)%4
    assert got[1, 0, 0].tolist() == [14, 38, 36, 26]
    np.testing.assert_array_equal(
        got, oracle(base, kv_lens, with_scratch, slots, num_layers=2, page_size=16)
    )


def test_validation():
    base = jnp.zeros((2, 4), jnp.int32)
    lens = jnp.zeros((2,), jnp.int32)
    rng = jnp.full((2, 2), BAD, jnp.int32)
    slots = jnp.full((2, 1), BAD, jnp.int32)
    kw = dict(num_layers=2, page_size=16)
    with pytest.raises(TypeError, match="base_table must be int32"):
        page_table_gather(base.astype(jnp.float32), lens, rng, slots, **kw)
    with pytest.raises(ValueError, match=r"kv_lens must have shape \[batch\]"):
        page_table_gather(base, jnp.zeros((3,), jnp.int32), rng, slots, **kw)
    with pytest.raises(ValueError, match="scratch_range must have shape"):
        page_table_gather(base, lens, rng[:, :1], slots, **kw)
    with pytest.raises(ValueError, match="scratch_slots must have shape"):
        page_table_gather(base, lens, rng, slots[0], **kw)
    with pytest.raises(ValueError, match="num_layers must be a positive static int"):
        page_table_gather(base, lens, rng, slots, num_layers=0, page_size=16)
    with pytest.raises(ValueError, match="implementation must be one of"):
        page_table_gather(base, lens, rng, slots, implementation="triton", **kw)
