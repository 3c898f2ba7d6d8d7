"""The grouped matmul of the MoE layers: its contract, its CUDA lowering at every MoE preset's
expert geometry (on CPU), and the Pallas kernel against a per-group numpy oracle (`gpu`).

The expert geometries come from the presets (`gemma.configs`), never from a hand-written list.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gemma import configs
from pallas_kernels import _checks
from pallas_kernels.grouped_matmul import grouped_matmul, supports, tile_plan

# Every MoE preset geometry, with its users.
GEOMS = list(configs.moe_geometries())
IDS = ["+".join(g.presets) for g in GEOMS]
# Token copies of one step: a 16-row decode, and a prefill step of 8192 tokens.
COPIES = {"decode": 16, "prefill": 8192}


def oracle(lhs, rhs, sizes):
    """Per-group float64 numpy products."""
    lhs, rhs = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
    out, start = np.zeros((lhs.shape[0], rhs.shape[2])), 0
    for g, s in enumerate(np.asarray(sizes)):
        out[start : start + s] = lhs[start : start + s] @ rhs[g]
        start += s
    return out


def skewed_sizes(rng, m: int, groups: int) -> np.ndarray:
    """Group sizes summing to m: a third of the groups empty, the rest uneven (tile straddles)."""
    weights = rng.gamma(0.5, size=groups) * (rng.random(groups) > 1 / 3)
    weights[rng.integers(groups)] += 1.0  # at least one group is non-empty
    sizes = np.floor(weights / weights.sum() * m).astype(np.int64)
    sizes[np.argmax(sizes)] += m - sizes.sum()
    return sizes.astype(np.int32)


def test_reference_matches_per_group_oracle():
    rng = np.random.default_rng(0)
    m, k, n, g = 77, 32, 24, 6
    sizes = skewed_sizes(rng, m, g)
    lhs = rng.standard_normal((m, k)).astype(np.float32)
    rhs = rng.standard_normal((g, k, n)).astype(np.float32)
    got = grouped_matmul(lhs, rhs, jnp.asarray(sizes), implementation="reference")
    np.testing.assert_allclose(np.asarray(got), oracle(lhs, rhs, sizes), rtol=1e-5, atol=1e-4)


def test_auto_off_hopper_is_the_reference():
    """On CPU 'auto' gives the reference (the kernel is compiled-only, Hopper only)."""
    rng = np.random.default_rng(1)
    sizes = jnp.asarray([3, 0, 5], jnp.int32)
    lhs = jnp.asarray(rng.standard_normal((8, 64)), jnp.bfloat16)
    rhs = jnp.asarray(rng.standard_normal((3, 64, 64)), jnp.bfloat16)
    assert supports(lhs.dtype, *rhs.shape[1:])
    want = grouped_matmul(lhs, rhs, sizes, implementation="reference")
    np.testing.assert_array_equal(np.asarray(grouped_matmul(lhs, rhs, sizes)), np.asarray(want))


@pytest.mark.parametrize(
    "shapes, dtype, match",
    [
        (((8, 64), (3, 64, 64), (3,)), jnp.float32, "bf16 or f16"),
        (((8, 96), (3, 96, 64), (3,)), jnp.bfloat16, "K a multiple of 64"),
        (((8, 64), (3, 64, 48), (3,)), jnp.bfloat16, "N a multiple of 64"),
        (((8, 64), (3, 32, 64), (3,)), jnp.bfloat16, "lhs K=64 must equal rhs K=32"),
        (((8, 64), (3, 64, 64), (4,)), jnp.bfloat16, r"group_sizes must be i32\[3\]"),
        (((8, 64, 1), (3, 64, 64), (3,)), jnp.bfloat16, r"lhs must be \[M, K\]"),
    ],
)
def test_bad_operands_raise_value_error(shapes, dtype, match):
    lhs, rhs = jnp.zeros(shapes[0], dtype), jnp.zeros(shapes[1], dtype)
    sizes = jnp.zeros(shapes[2], jnp.int32)
    with pytest.raises(ValueError, match=match):
        grouped_matmul(lhs, rhs, sizes, implementation="pallas")
    with pytest.raises(ValueError, match="implementation must be one of"):
        grouped_matmul(lhs, rhs, sizes, implementation="triton")


def _moe_products(geom, copies):
    """The three products of one MoE layer: (M, K, N, G) for gate/up and down."""
    d, f, e, k = geom.hidden, geom.moe_ff, geom.experts, geom.per_token
    return [(copies * k, d, f, e), (copies * k, f, d, e)]


@pytest.mark.parametrize("step", sorted(COPIES))
@pytest.mark.parametrize("geom", GEOMS, ids=IDS)
def test_kernel_lowers_for_cuda_at_preset_geometries(geom, step):
    """Mosaic GPU lowering (TMA boxes, shared memory) of the kernel at each MoE preset."""
    for m, k, n, g in _moe_products(geom, COPIES[step]):
        sds = jax.ShapeDtypeStruct
        args = (sds((m, k), jnp.bfloat16), sds((g, k, n), jnp.bfloat16), sds((g,), jnp.int32))
        with _checks.force_compiled():
            f = jax.jit(lambda a, b, c: grouped_matmul(a, b, c, implementation="pallas"))
            text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text, (m, k, n, g)


@pytest.mark.gpu
@pytest.mark.parametrize("step", sorted(COPIES))
@pytest.mark.parametrize("geom", GEOMS, ids=IDS)
def test_kernel_matches_oracle_on_gpu(geom, step):
    """The Pallas kernel on skewed groups (empty ones, tile straddles) against float64 numpy.

    Empty groups' weights are NaN: the kernel may multiply them (a straddling tile computes
    once per group) but must never store them.
    """
    rng = np.random.default_rng([geom.hidden, geom.moe_ff, geom.experts, COPIES[step]])
    for m, k, n, g in _moe_products(geom, COPIES[step]):
        sizes = skewed_sizes(rng, m, g)
        lhs = jnp.asarray(rng.standard_normal((m, k)) / np.sqrt(k), jnp.bfloat16)
        rhs = np.asarray(jnp.asarray(rng.standard_normal((g, k, n)), jnp.bfloat16), np.float32)
        rhs[sizes == 0] = np.nan
        rhs = jnp.asarray(rhs, jnp.bfloat16)
        got = jax.jit(lambda a, b, c: grouped_matmul(a, b, c, implementation="pallas"))(
            lhs, rhs, jnp.asarray(sizes)
        )
        want = oracle(
            np.asarray(lhs, np.float32),
            np.where(np.isnan(np.asarray(rhs, np.float32)), 0, rhs),
            sizes,
        )
        got = np.asarray(got, np.float32)
        assert np.isfinite(got).all(), (m, k, n, g)
        np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)


# ------------------------------------------------------------------ groups within a larger stack
def test_tile_plan_by_hand():
    """Sizes [3, 0, 70, 64], 137 rows in 64-row blocks: group 0 has rows in block 0, group 2
    in blocks 0-1, group 3 in blocks 1-2 (a block shared by two groups is a tile of each);
    each row lands at its own group's tile."""
    group, block, count, slot = tile_plan(jnp.asarray([3, 0, 70, 64], jnp.int32), 137)
    assert int(count) == 5 and group.shape == (3 + 4,)  # ceil(137 / 64) + min(4, 137) tiles
    assert group[:5].tolist() == [0, 2, 2, 3, 3] and block[:5].tolist() == [0, 0, 1, 1, 2]
    want = [*range(0, 3), *range(67, 128), *range(128, 137), *range(201, 256), *range(256, 265)]
    assert slot.tolist() == want


def split_patterns(rng, m: int, groups: int) -> dict[str, np.ndarray]:
    """Group sizes summing to m that split the 64-row tiles every way: skewed (a third empty),
    one-row groups between larger ones, a group ending one row into a tile, everything in the
    last group (a whole tile of one group), and runs of empty groups between tiny ones."""
    patterns = {"skewed": skewed_sizes(rng, m, groups)}
    ones = np.zeros(groups, np.int32)
    picks = np.sort(rng.choice(groups, size=min(groups, 6), replace=False))
    ones[picks[:-1]] = 1
    ones[picks[-1]] = m - (len(picks) - 1)
    patterns["one_row_groups"] = ones
    ending = np.zeros(groups, np.int32)
    first = min(65, m - 1)  # ends one row into the second tile (or the last row)
    ending[groups // 3], ending[-1] = first, m - first
    patterns["ends_inside_a_tile"] = ending
    last = np.zeros(groups, np.int32)
    last[-1] = m
    patterns["one_group"] = last
    sparse = np.zeros(groups, np.int32)
    sparse[::7] = 1
    sparse[0] += m - sparse.sum()
    patterns["empty_runs"] = sparse
    for name, sizes in patterns.items():
        assert sizes.sum() == m and (sizes >= 0).all(), name
    return patterns


def _offset_case(rng, m, k, n, e, layers, offset, sizes=None):
    """lhs, a stack of `layers` x e groups in which only this layer's non-empty groups hold
    weights (other layers' groups and this layer's empty ones are NaN: never to be read), the
    sizes and the float64 oracle."""
    sizes = skewed_sizes(rng, m, e) if sizes is None else sizes
    lhs = jnp.asarray(rng.standard_normal((m, k)) / np.sqrt(k), jnp.bfloat16)
    stack = np.full((layers * e, k, n), np.nan, np.float32)
    used = offset + np.flatnonzero(sizes)
    stack[used] = np.asarray(
        jnp.asarray(rng.standard_normal((len(used), k, n), np.float32), jnp.bfloat16), np.float32
    )
    want = oracle(np.asarray(lhs, np.float32), np.nan_to_num(stack[offset : offset + e]), sizes)
    return lhs, jnp.asarray(stack, jnp.bfloat16), jnp.asarray(sizes), want


def _check_offset_product(lhs, rhs, sizes, want, offset, what):
    """The tile kernel with `offset` static (unrolled) and traced (the layer scan's counter)."""
    static = jax.jit(
        lambda a, b, c: grouped_matmul(a, b, c, group_offset=offset, implementation="pallas")
    )(lhs, rhs, sizes)
    traced = jax.jit(
        lambda a, b, c, o: grouped_matmul(a, b, c, group_offset=o, implementation="pallas")
    )(lhs, rhs, sizes, jnp.int32(offset))
    for form, got in (("static", static), ("traced", traced)):
        got = np.asarray(got, np.float32)
        assert np.isfinite(got).all(), (what, form)
        np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2, err_msg=f"{what} {form}")


@pytest.mark.parametrize(
    "m, layers, offset",
    [(150, 3, 6), (64, 2, 0), (200, 3, 12), (1, 2, 6)],
    ids=["middle", "one-tile", "last", "one-row"],
)
def test_tile_kernel_reads_one_layer_s_groups_in_interpret_mode(m, layers, offset):
    """The tile kernel (GPU interpret mode, race detection on) on skewed groups against float64
    numpy: groups of several tiles, tiles that read into the next group, empty groups."""
    rng = np.random.default_rng([m, layers, offset])
    lhs, rhs, sizes, want = _offset_case(rng, m, 128, 192, 6, layers, offset)
    with _checks.force_interpret():
        got = grouped_matmul(lhs, rhs, sizes, group_offset=offset, implementation="pallas")
    got = np.asarray(got, np.float32)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)
    # the reference takes a traced offset
    clean = jnp.where(jnp.isnan(rhs), 0, rhs)
    ref = jax.jit(
        lambda a, b, c, o: grouped_matmul(a, b, c, group_offset=o, implementation="reference")
    )(lhs, clean, sizes, jnp.int32(offset))
    np.testing.assert_allclose(np.asarray(ref, np.float32), want, rtol=2e-2, atol=2e-2)


# The largest MoE geometry's down product (K = moe_ff, N = hidden) at its real width and
# expert count, rows giving one to four 64-row tiles.
_DOWN = max(GEOMS, key=lambda g: g.experts * g.hidden)


def test_tile_kernel_splits_tiles_at_the_preset_geometry_in_interpret_mode():
    """The tile kernel at a preset's real expert geometry (its down product: all E experts, K
    and N as in the preset), 200 rows (four 64-row tiles), in GPU interpret mode with race
    detection, the offset traced, every other group NaN: one-row groups, a group ending one
    row into a tile and runs of empty groups in one pattern, so that few tiles are interpreted.

    Interpret mode cannot show a fault of the hardware's ordering: it runs each WGMMA to
    completion before the next statement, so a buffer refilled while a WGMMA still reads it
    (the fault found at this geometry on an H100) computes correctly here. That discipline is
    checked on the kernels' traces instead (`test_stacked_matmul.py::
    test_pipelines_retire_each_wgmma_before_refilling_its_buffers`), and the compiled kernel
    on every pattern of `split_patterns`, offsets static and traced, by
    `test_tile_kernel_matches_oracle_on_gpu`."""
    e, k, n, m = _DOWN.experts, _DOWN.moe_ff, _DOWN.hidden, 200
    sizes = np.zeros(e, np.int32)
    sizes[[3, 4, 9, 40, e - 1]] = [1, 64, 1, 70, m - 136]  # 1 | 64 | 1 | 70 ends in tile 3
    rng = np.random.default_rng([m, k, n])
    lhs, rhs, sizes, want = _offset_case(rng, m, k, n, e, 2, e, sizes)
    with _checks.force_interpret():
        got = jax.jit(
            lambda a, b, c, o: grouped_matmul(a, b, c, group_offset=o, implementation="pallas")
        )(lhs, rhs, sizes, jnp.int32(e))
    got = np.asarray(got, np.float32)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)


def test_group_offset_is_checked():
    lhs = jnp.zeros((8, 64), jnp.bfloat16)
    rhs = jnp.zeros((6, 64, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"group_offset must be in \[0, 3\]"):
        grouped_matmul(lhs, rhs, jnp.zeros((3,), jnp.int32), group_offset=4)
    with pytest.raises(ValueError, match="describes 7 groups but rhs has only 6"):
        grouped_matmul(lhs, rhs, jnp.zeros((7,), jnp.int32), group_offset=0)
    with pytest.raises(ValueError, match="N a multiple of 64"):
        rhs48 = jnp.zeros((6, 64, 48), jnp.bfloat16)
        grouped_matmul(
            lhs, rhs48, jnp.zeros((3,), jnp.int32), group_offset=0, implementation="pallas"
        )


@pytest.mark.parametrize("geom", GEOMS, ids=IDS)
def test_tile_kernel_lowers_for_cuda_at_preset_geometries(geom):
    """Mosaic GPU lowering of the tile kernel at each MoE preset's decode products, reading
    the last layer's experts of its largest stack."""
    layers = geom.stack_layers
    for m, k, n, e in _moe_products(geom, COPIES["decode"]):
        sds = jax.ShapeDtypeStruct
        args = (sds((m, k), jnp.bfloat16), sds((layers * e, k, n), jnp.bfloat16))
        args += (sds((e,), jnp.int32),)
        offset = (layers - 1) * e
        with _checks.force_compiled():
            f = jax.jit(
                lambda a, b, c, o=offset: grouped_matmul(
                    a, b, c, group_offset=o, implementation="pallas"
                )
            )
            text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text, (m, k, n, e)


def _device_offset_case(key, lhs_rows, sizes, stack, offset):
    """On the device: lhs, the stack with every group but this layer's non-empty ones NaN, and
    the float32 (highest precision) per-group oracle; for stacks too large for host numpy."""
    k = stack.shape[1]
    lhs = (jax.random.normal(key, (lhs_rows, k), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
    keep = np.zeros(stack.shape[0], bool)
    keep[offset + np.flatnonzero(sizes)] = True
    poisoned = jnp.where(jnp.asarray(keep)[:, None, None], stack, jnp.nan).astype(stack.dtype)
    want, start = [], 0
    for g, size in enumerate(np.asarray(sizes)):
        if size:
            rows = lhs[start : start + size].astype(jnp.float32)
            w = stack[offset + g].astype(jnp.float32)
            want.append(jnp.dot(rows, w, precision=jax.lax.Precision.HIGHEST))
        start += size
    want = np.asarray(jnp.concatenate(want), np.float32)
    return lhs, poisoned, jnp.asarray(sizes), want


@pytest.mark.gpu
@pytest.mark.parametrize("geom", GEOMS, ids=IDS)
def test_tile_kernel_matches_oracle_on_gpu(geom):
    """The compiled tile kernel at each MoE preset's products (gate/up and down), one layer's
    experts of a three-layer stack whose other groups are NaN, offsets static and traced: a
    16-row decode step's routed copies, and 64 to 256 copies in every pattern that splits a
    64-row tile (`split_patterns`: one-row groups, a group ending inside a tile, runs of empty
    groups, one group)."""
    rng = np.random.default_rng([geom.hidden, geom.moe_ff, geom.experts, 1])
    key = jax.random.key(geom.hidden)
    for m0, k, n, e in _moe_products(geom, COPIES["decode"]):
        key, sub = jax.random.split(key)
        stack = jax.random.normal(sub, (3 * e, k, n), jnp.bfloat16)
        for m in sorted({m0, 64, 200, 256}):
            for name, sizes in split_patterns(rng, m, e).items():
                key, sub = jax.random.split(key)
                lhs, rhs, sizes_, want = _device_offset_case(sub, m, sizes, stack, e)
                _check_offset_product(lhs, rhs, sizes_, want, e, (m, k, n, e, name))
                del rhs
        del stack
