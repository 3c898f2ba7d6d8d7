"""Page-table gather: the jnp reference and the Mosaic GPU kernel against a hand-written NumPy
loop oracle and the worked example of docs/design.md."""

import re

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

from pallas_kernels import _checks
from pallas_kernels.page_table_gather import page_table_gather, page_table_gather_reference

BAD = -1


def oracle(base_table, kv_lens, scratch_range, scratch_slots, num_layers, page_size):
    """Entry by entry, straight from docs/design.md's converter and rotation definitions."""
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


# --------------------------------------------------------------------------- Pallas kernel
# Interpret mode (CPU, race detection on) at small shapes; compiled on an H200 (`gpu` marker).

MODES = ["interpret", pytest.param("compiled", marks=pytest.mark.gpu)]


def _mode_ctx(mode):
    return _checks.force_interpret() if mode == "interpret" else _checks.force_compiled()


def kernel_gather(args, num_layers, page_size, mode="interpret", out=None, tile_blocks=None):
    base, kv_lens, rng_arr, slots = (jnp.asarray(a) for a in args)
    with _mode_ctx(mode):
        got = page_table_gather(
            base,
            kv_lens,
            rng_arr,
            slots,
            num_layers=num_layers,
            page_size=page_size,
            implementation="pallas",
            out=None if out is None else jnp.asarray(out, jnp.int32),
            tile_blocks=tile_blocks,
        )
    assert got.dtype == jnp.int32
    return np.asarray(got)


# (batch, max_blocks, num_layers, page_size, num_scratch): few shapes, so few compilations.
KERNEL_SHAPES = [(4, 16, 4, 16, 3), (1, 7, 1, 64, 0), (3, 12, 2, 32, 2)]


def random_inputs(rng, batch, max_blocks, page_size, num_scratch):
    """Base tables with BAD holes, rows of length 0 and past NB * page_size, scratch ranges
    inside and outside the extent (some empty or reversed), BAD and missing scratch slots."""
    base = rng.integers(0, 50, (batch, max_blocks)).astype(np.int32)
    base[rng.random(base.shape) < 0.3] = BAD
    kv_lens = rng.integers(0, max_blocks * page_size + page_size + 1, batch).astype(np.int32)
    kv_lens[rng.random(batch) < 0.25] = 0
    begin = rng.integers(0, max_blocks + 1, batch)
    end = begin + rng.integers(-1, 8, batch)
    rng_arr = np.stack([begin, end], 1).astype(np.int32)
    rng_arr[rng.random(batch) < 0.3] = BAD
    slots = rng.integers(50, 80, (batch, num_scratch)).astype(np.int32)
    slots[rng.random(slots.shape) < 0.2] = BAD
    return base, kv_lens, rng_arr, slots


@settings(max_examples=12, deadline=None)
@given(shape=st.sampled_from(KERNEL_SHAPES), seed=st.integers(0, 2**31 - 1), fresh=st.booleans())
def test_kernel_matches_loop_oracle(shape, seed, fresh):
    """Fresh output, and in place over a previous table of other inputs (or all BAD)."""
    batch, max_blocks, num_layers, page_size, num_scratch = shape
    rng = np.random.default_rng(seed)
    args = random_inputs(rng, batch, max_blocks, page_size, num_scratch)
    want = oracle(*args, num_layers, page_size)
    np.testing.assert_array_equal(kernel_gather(args, num_layers, page_size), want)
    if fresh:
        prev = np.full_like(want, BAD)
    else:
        prev_args = random_inputs(rng, batch, max_blocks, page_size, num_scratch)
        prev = oracle(*prev_args, num_layers, page_size)
    got = kernel_gather(args, num_layers, page_size, out=prev)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("mode", MODES)
def test_kernel_design_worked_example(mode):
    """docs/design.md: 3 sliding layers (scale 6), scratch blocks 4..8 in slots 7 and 9."""
    base = np.array([[10, 11, BAD, 12, BAD, BAD, BAD, BAD, BAD, 13, 14]], np.int32)
    kv_lens = np.array([10 * 16], np.int32)  # 10 blocks of 16: block 10 is beyond the extent
    args = (base, kv_lens, np.array([[4, 9]], np.int32), np.array([[7, 9, BAD]], np.int32))
    got = kernel_gather(args, 3, 16, mode)
    table = {  # layer -> K pages of blocks 4..8 (V = K + 1), from docs/design.md
        0: [42, 44, 46, 54, 56],
        1: [44, 46, 42, 56, 58],
        2: [46, 42, 44, 58, 54],
    }
    for j, pages in table.items():
        k = [10 * 6 + 2 * j, 11 * 6 + 2 * j, BAD, 12 * 6 + 2 * j, *pages, 13 * 6 + 2 * j, BAD]
        assert got[j, 0, 0].tolist() == k
        assert got[j, 0, 1].tolist() == [BAD if p == BAD else p + 1 for p in k]


@pytest.mark.parametrize("mode", MODES)
def test_kernel_tiles_padding_and_slot_loop(mode):
    """NB = 300 (padded to 384, three tiles of 128), one layer (a slot per block: the select
    runs as a loop), scratch ranges crossing tiles, one row past NB * page_size."""
    rng = np.random.default_rng(3)
    batch, max_blocks, num_layers, page_size = 3, 300, 1, 16
    base, kv_lens, _, _ = random_inputs(rng, batch, max_blocks, page_size, 0)
    kv_lens[:] = [200 * 16 - 5, 300 * 16 + 40, 0]
    rng_arr = np.array([[100, 180], [250, 300], [0, 10]], np.int32)
    slots = rng.integers(50, 1000, (batch, 200)).astype(np.int32)
    slots[0, 30] = BAD
    args = (base, kv_lens, rng_arr, slots)
    want = oracle(*args, num_layers, page_size)
    got = kernel_gather(args, num_layers, page_size, mode, tile_blocks=128)
    np.testing.assert_array_equal(got, want)
    prev = oracle(*random_inputs(rng, batch, max_blocks, page_size, 4), num_layers, page_size)
    got = kernel_gather(args, num_layers, page_size, mode, out=prev, tile_blocks=128)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("mode", MODES)
def test_kernel_serving_steps_in_place(mode):
    """A serving loop: each step's table is computed in place over the previous step's.

    Steps: prefill chunks with scratch, decode across block boundaries with out-of-window
    release, a freed row (kv_len 0) and a new shorter sequence in it.
    """
    batch, max_blocks, num_layers, page_size = 3, 256, 2, 16
    rng = np.random.default_rng(11)
    slot_of = rng.permutation(batch * max_blocks).astype(np.int32).reshape(batch, max_blocks)
    steps = [
        # kv_lens, scratch ranges, released blocks per row (BAD in the base table)
        ([1000, 40, 300], [[10, 50], [BAD, BAD], [0, 5]], [0, 0, 0]),
        ([2000, 41, 300], [[62, 110], [BAD, BAD], [BAD, BAD]], [50, 0, 0]),
        ([2001, 48, 0], [[BAD, BAD]] * 3, [120, 0, 0]),
        ([2017, 49, 33], [[BAD, BAD]] * 3, [121, 0, 0]),
        ([2048, 64, 700], [[BAD, BAD], [BAD, BAD], [1, 30]], [125, 1, 0]),
    ]
    table = np.full((num_layers, batch, 2, max_blocks), BAD, np.int32)
    for kv_lens, rng_arr, released in steps:
        base = slot_of.copy()
        for b, n in enumerate(released):
            base[b, :n] = BAD
        rng_arr = np.asarray(rng_arr, np.int32)
        for b in range(batch):
            if rng_arr[b, 0] < rng_arr[b, 1]:
                base[b, rng_arr[b, 0] : rng_arr[b, 1]] = BAD  # scratch-backed blocks
        slots = rng.integers(5000, 6000, (batch, 30)).astype(np.int32)
        args = (base, np.asarray(kv_lens, np.int32), rng_arr, slots)
        table = kernel_gather(args, num_layers, page_size, mode, out=table, tile_blocks=128)
        np.testing.assert_array_equal(table, oracle(*args, num_layers, page_size))


def test_kernel_lowers_for_cuda_in_place():
    """The Mosaic GPU module builds (layout inference included) off-GPU; with `out` the
    table argument is aliased to the result (no copy) when NB is a multiple of 128."""
    sds = jax.ShapeDtypeStruct

    def lower(batch, max_blocks, num_layers, num_scratch, with_out, tile_blocks=None):
        def f(base, kv_lens, rng_arr, slots, out):
            return page_table_gather(
                base,
                kv_lens,
                rng_arr,
                slots,
                num_layers=num_layers,
                page_size=32,
                implementation="pallas",
                out=out,
                tile_blocks=tile_blocks,
            )

        i32 = jnp.int32
        out = sds((num_layers, batch, 2, max_blocks), i32) if with_out else None
        args = (
            sds((batch, max_blocks), i32),
            sds((batch,), i32),
            sds((batch, 2), i32),
            sds((batch, num_scratch), i32),
            out,
        )
        with _checks.force_compiled():
            jitted = jax.jit(f, donate_argnums=4) if with_out else jax.jit(f)
            return jitted.trace(*args).lower(lowering_platforms=("cuda",)).as_text()

    def in_place(text) -> tuple[int, int]:
        """(kernel outputs aliased to an operand, pads of the table)."""
        aliases = len(
            re.findall(r"output_operand_aliases = \[\s*#stablehlo.output_operand_alias", text)
        )
        return aliases, text.count("stablehlo.pad")

    text = lower(2, 4096, 52, 79, True)  # Gemma 3 27B sliding pool at 128K context
    assert "mosaic_gpu" in text
    # The kernel writes the donated table where it lies: its output aliases that operand, and
    # nothing pads (copies) the table on the way in or out.
    assert in_place(text) == (1, 0), in_place(text)
    # Control: NB not a multiple of 128 is padded in and sliced out (the documented copy).
    assert in_place(lower(2, 4000, 52, 79, True))[1] > 0
    assert "mosaic_gpu" in lower(2, 256, 1, 300, False, tile_blocks=128)  # slot loop


def test_kernel_validation():
    base = jnp.zeros((2, 4), jnp.int32)
    lens = jnp.zeros((2,), jnp.int32)
    rng_arr = jnp.full((2, 2), BAD, jnp.int32)
    slots = jnp.full((2, 1), BAD, jnp.int32)
    kw = dict(num_layers=2, page_size=16, implementation="pallas")
    with pytest.raises(ValueError, match=r"out must have shape \[num_layers, batch, 2, NB\]"):
        page_table_gather(base, lens, rng_arr, slots, out=jnp.zeros((1, 2, 2, 4), jnp.int32), **kw)
    with pytest.raises(TypeError, match="out must be int32"):
        page_table_gather(base, lens, rng_arr, slots, out=jnp.zeros((2, 2, 2, 4)), **kw)
    with pytest.raises(ValueError, match="tile_blocks must be a multiple of 128"):
        page_table_gather(base, lens, rng_arr, slots, tile_blocks=100, **kw)
    empty = page_table_gather(base[:0], lens[:0], rng_arr[:0], slots[:0], **kw)
    assert empty.shape == (2, 0, 2, 4)


@pytest.mark.gpu
def test_kernel_gpu_gemma3_27b_sliding_pool():
    """52 layers, 64 rows of 8K-32K tokens (window 1024 and chunk 2048 of scratch on 8 rows),
    NB = 1024: fresh and in place over the previous step's table, against the reference
    (itself checked against the loop oracle above)."""
    rng = np.random.default_rng(0)
    batch, max_blocks, num_layers, page_size, num_scratch = 64, 1024, 52, 32, 79
    kv_lens = rng.integers(8192, 32769, batch).astype(np.int32)
    blocks = np.arange(max_blocks)[None, :]
    extent = -(-kv_lens[:, None] // page_size)
    start = np.maximum(kv_lens[:, None] - 1024, 0) // page_size - 1  # window + one block
    base = rng.permutation(batch * max_blocks).astype(np.int32).reshape(batch, max_blocks)
    base = np.where((blocks >= start) & (blocks < extent), base, BAD).astype(np.int32)
    rng_arr = np.full((batch, 2), BAD, np.int32)
    rows = rng.choice(batch, 8, replace=False)
    rng_arr[rows, 0] = extent[rows, 0] - 64
    rng_arr[rows, 1] = extent[rows, 0] - 33
    slots = rng.integers(10**5, 2 * 10**5, (batch, num_scratch)).astype(np.int32)
    args = [jnp.asarray(a) for a in (base, kv_lens, rng_arr, slots)]
    kw = dict(num_layers=num_layers, page_size=page_size)
    want = np.asarray(jax.jit(page_table_gather_reference, static_argnames=tuple(kw))(*args, **kw))
    got = page_table_gather(*args, **kw, implementation="pallas")
    np.testing.assert_array_equal(np.asarray(got), want)
    prev_lens = jnp.asarray(kv_lens - 1)
    prev = page_table_gather(args[0], prev_lens, args[2], args[3], **kw, implementation="pallas")
    f = jax.jit(
        lambda *a, out: page_table_gather(*a, out=out, **kw, implementation="pallas"),
        donate_argnames="out",
    )
    np.testing.assert_array_equal(np.asarray(f(*args, out=prev)), want)
