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


def _offset_case(rng, m, k, n, e, layers, offset):
    sizes = skewed_sizes(rng, m, e)
    lhs = jnp.asarray(rng.standard_normal((m, k)) / np.sqrt(k), jnp.bfloat16)
    stack = np.asarray(jnp.asarray(rng.standard_normal((layers * e, k, n)), jnp.bfloat16))
    stack = stack.astype(np.float32)
    want = oracle(np.asarray(lhs, np.float32), stack[offset : offset + e], sizes)
    # Other layers' groups and this layer's empty groups are NaN: never to be read.
    poisoned = np.ones(layers * e, bool)
    poisoned[offset + np.flatnonzero(sizes)] = False
    stack[poisoned] = np.nan
    return lhs, jnp.asarray(stack, jnp.bfloat16), jnp.asarray(sizes), want


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


@pytest.mark.gpu
@pytest.mark.parametrize("geom", GEOMS, ids=IDS)
def test_tile_kernel_matches_oracle_on_gpu(geom):
    """The compiled tile kernel at each MoE preset's decode products, one layer of a stack,
    its offset static (unrolled decode) and traced (the layer scan's counter)."""
    rng = np.random.default_rng([geom.hidden, geom.moe_ff, geom.experts, 1])
    for m, k, n, e in _moe_products(geom, COPIES["decode"]):
        lhs, rhs, sizes, want = _offset_case(rng, m, k, n, e, 3, e)
        static = jax.jit(
            lambda a, b, c, o=e: grouped_matmul(a, b, c, group_offset=o, implementation="pallas")
        )(lhs, rhs, sizes)
        traced = jax.jit(
            lambda a, b, c, o: grouped_matmul(a, b, c, group_offset=o, implementation="pallas")
        )(lhs, rhs, sizes, jnp.int32(e))
        for got in (static, traced):
            got = np.asarray(got, np.float32)
            assert np.isfinite(got).all(), (m, k, n, e)
            np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)
