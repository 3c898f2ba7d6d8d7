"""The stacked matmul (one layer's matrix read in its stack): its contract, its tiling at every
preset geometry, the kernel against float64 numpy in interpret mode and on the GPU with every
other layer NaN, its CUDA lowering, and the WGMMA pipeline discipline of every matmul kernel.

The geometries come from the presets (`gemma.configs.stacked_geometries`), never a hand list.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gemma import configs
from pallas_kernels import _checks
from pallas_kernels import _wgmma_stream as stream
from pallas_kernels.stacked_matmul import (
    MAX_ROWS,
    Tiling,
    stacked_matmul,
    stacked_matmul_reference,
    tiling,
    uses_kernel,
)

GEOMS = configs.stacked_geometries()
IDS = [g.id for g in GEOMS]
ROWS = (1, 7, 64, 256)  # one token, a ragged few (padded to 8s), one 64-row tile, two of 128


def _case(rng, rows, k, n, layers, index):
    """x, a stack whose every layer but `index` is NaN, and the float64 oracle."""
    x = jnp.asarray(rng.standard_normal((rows, k)) / np.sqrt(k), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((k, n)), jnp.bfloat16)
    stack = jnp.full((layers, k, n), jnp.nan, jnp.bfloat16).at[index].set(w)
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    return x, stack, want


def _check(got, want, what):
    got = np.asarray(got, np.float64)
    assert got.shape == want.shape, what
    assert np.isfinite(got).all(), what
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2, err_msg=str(what))


def test_reference_is_the_dot_with_the_indexed_layer():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 24)).astype(np.float32)
    stack = rng.standard_normal((3, 24, 16)).astype(np.float32)
    for index in (0, 2, jnp.int32(1)):
        got = stacked_matmul_reference(jnp.asarray(x), jnp.asarray(stack), index)
        want = x.astype(np.float64) @ stack[int(index)]
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_auto_off_hopper_is_the_reference():
    x = jnp.ones((4, 64), jnp.bfloat16)
    stack = jnp.ones((2, 64, 64), jnp.bfloat16)
    assert not uses_kernel(x, stack)
    assert uses_kernel(x, stack, "pallas")
    got = stacked_matmul(x, stack, 1)
    np.testing.assert_array_equal(
        np.asarray(got), np.asarray(stacked_matmul_reference(x, stack, 1))
    )


@pytest.mark.parametrize(
    "x, stack, index, impl, match",
    [
        ((8, 64), (3, 64, 64), 0, "triton", "implementation must be one of"),
        ((8, 64, 1), (3, 64, 64), 0, "pallas", r"x must be \[M, K\]"),
        ((8, 64), (3, 32, 64), 0, "pallas", "x K=64 must equal stack K=32"),
        ((8, 64), (3, 64, 64), 3, "pallas", r"index must be in \[0, 3\)"),
        ((8, 64), (3, 64, 64), 1.5, "pallas", "index must be an integer scalar"),
        ((8, 96), (3, 96, 64), 0, "pallas", "K a multiple of 64"),
        ((8, 64), (3, 64, 48), 0, "pallas", "N a multiple of 64"),
    ],
)
def test_bad_operands_raise_value_error(x, stack, index, impl, match):
    with pytest.raises(ValueError, match=match):
        stacked_matmul(
            jnp.zeros(x, jnp.bfloat16), jnp.zeros(stack, jnp.bfloat16), index, implementation=impl
        )


def test_bad_tiles_raise_value_error():
    x, stack = jnp.zeros((8, 256), jnp.bfloat16), jnp.zeros((2, 256, 128), jnp.bfloat16)
    for tiles, match in [
        (Tiling(block_m=32), "block_m must be 64 or 128"),
        (Tiling(block_n=96), "block_n=96"),
        (Tiling(splits=3), "splits=3 must divide the 4 K blocks"),
        (Tiling(stages=1), "stages must be more than 1"),
    ]:
        with pytest.raises(ValueError, match=match):
            stacked_matmul(x, stack, 0, implementation="pallas", tiles=tiles)


def test_tiling_fills_the_gpu_at_every_preset_geometry():
    """At every preset geometry and decode row count the default tiles are valid, and the
    products of one-token steps are split over K until the SMs have work or the splits run out
    (each keeps MIN_SPLIT_STEPS K blocks), never past the partials' bytes bound."""
    from pallas_kernels import stacked_matmul as sm

    for g in GEOMS:
        for rows in ROWS:
            t = tiling(rows, g.k, g.n)
            t.check(rows, g.k, g.n)
            programs = -(-rows // t.block_m) * (g.n // t.block_n) * t.splits
            steps = g.k // t.block_k
            assert steps // t.splits >= min(sm.MIN_SPLIT_STEPS, steps), (g, rows, t)
            if t.splits > 1:
                partial = 2 * t.splits * rows * g.n * 4
                assert partial <= sm.MAX_PARTIAL_SHARE * g.k * g.n * 2, (g, rows, t)
            if rows == 1 and programs < sm.NUM_SMS:  # no valid larger split was left
                larger = [
                    s
                    for s in range(t.splits + 1, steps // sm.MIN_SPLIT_STEPS + 1)
                    if steps % s == 0
                ]
                assert not larger, (g, rows, t, larger)


def _interpret_cases():
    """For every (block_m, block_n, split or not) that the presets' default tiles take at the
    decode row counts, the preset geometry and row count with the fewest interpreted K steps;
    each row count of ROWS at least once; and a two-tile 256-row product with forced splits
    (the presets' defaults split at 256 rows only at their largest widths)."""
    found, per_rows = {}, {}
    for g in GEOMS:
        for rows in ROWS:
            t = tiling(rows, g.k, g.n)
            cost = -(-rows // t.block_m) * (g.n // t.block_n) * (g.k // t.block_k)
            for table, key in ((found, (t.block_m, t.block_n, t.splits > 1)), (per_rows, rows)):
                if key not in table or cost < table[key][0]:
                    table[key] = (cost, g, rows)
    chosen = [*found.values(), *per_rows.values()]
    cases = {(g, rows) for cost, g, rows in chosen if cost < 4000}  # else the forced case
    cases = [(g, rows, None) for g, rows in sorted(cases, key=lambda c: (c[0].k, c[0].n, c[1]))]
    small = min(GEOMS, key=lambda g: g.k * g.n if g.k // 64 % 2 == 0 else 1 << 60)
    block_n = 128 if small.n % 128 == 0 else 64
    cases.append((small, 256, Tiling(block_m=128, block_n=block_n, splits=2)))
    return cases


INTERPRET = _interpret_cases()


@pytest.mark.parametrize(
    "geom, rows, tiles",
    INTERPRET,
    ids=[f"{g.id}-m{r}" + ("-forced" if t else "") for g, r, t in INTERPRET],
)
def test_kernel_reads_one_layer_in_interpret_mode(geom, rows, tiles):
    """The kernel (GPU interpret mode, race detection on) against float64 numpy, the index
    traced, every other layer of the stack NaN."""
    rng = np.random.default_rng([geom.k, geom.n, rows])
    layers = max(2, min(geom.stack_layers, 3))
    index = int(rng.integers(layers))
    x, stack, want = _case(rng, rows, geom.k, geom.n, layers, index)
    with _checks.force_interpret():
        got = jax.jit(
            lambda a, b, i: stacked_matmul(a, b, i, implementation="pallas", tiles=tiles)
        )(x, stack, jnp.int32(index))
    _check(got, want, (geom, rows, tiles))


@pytest.mark.parametrize("geom", GEOMS, ids=IDS)
def test_kernel_lowers_for_cuda_at_preset_geometries(geom):
    """Mosaic GPU lowering (TMA boxes, shared memory, the output's clipped row boxes) at every
    preset geometry, stack depth and decode row count."""
    sds = jax.ShapeDtypeStruct
    for rows in ROWS:
        args = (
            sds((rows, geom.k), jnp.bfloat16),
            sds((geom.stack_layers, geom.k, geom.n), jnp.bfloat16),
            sds((), jnp.int32),
        )
        with _checks.force_compiled():
            f = jax.jit(lambda a, b, i: stacked_matmul(a, b, i, implementation="pallas"))
            text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text, (geom, rows)


def test_auto_leaves_prefill_products_to_xla():
    """Above MAX_ROWS rows "auto" is the reference even where the kernel applies."""
    x = jax.ShapeDtypeStruct((MAX_ROWS + 1, 128), jnp.bfloat16)
    stack = jax.ShapeDtypeStruct((2, 128, 128), jnp.bfloat16)
    assert not uses_kernel(x, stack)


# ------------------------------------------------------------------ the pipeline discipline
def _recorded_pipelines(monkeypatch, run):
    """Trace `run()` with `plgpu.emit_pipeline` recording, for each pipeline: its in_specs'
    delay_release, its max_concurrent_steps and the WGMMA calls of its body in order
    (('wgmma',) or ('wait', n))."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    pipelines = []
    real_pipeline, real_wgmma, real_wait = plgpu.emit_pipeline, plgpu.wgmma, plgpu.wgmma_wait

    def emit_pipeline(body, *, in_specs=(), max_concurrent_steps=1, **kw):
        record = dict(
            delays=[getattr(s, "delay_release", 0) for s in in_specs],
            stages=max_concurrent_steps,
            calls=[],
        )
        pipelines.append(record)

        def traced_body(*args):
            def wgmma(*a, **k):
                record["calls"].append(("wgmma",))
                return real_wgmma(*a, **k)

            def wait(n):
                record["calls"].append(("wait", n))
                return real_wait(n)

            monkeypatch.setattr(plgpu, "wgmma", wgmma)
            monkeypatch.setattr(plgpu, "wgmma_wait", wait)
            try:
                return body(*args)
            finally:
                monkeypatch.setattr(plgpu, "wgmma", real_wgmma)
                monkeypatch.setattr(plgpu, "wgmma_wait", real_wait)

        return real_pipeline(
            traced_body, in_specs=in_specs, max_concurrent_steps=max_concurrent_steps, **kw
        )

    monkeypatch.setattr(plgpu, "emit_pipeline", emit_pipeline)
    with _checks.force_compiled():
        run()
    return pipelines


def _lower(f, *args):
    jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))


def test_pipelines_retire_each_wgmma_before_refilling_its_buffers(monkeypatch):
    """Every Mosaic pipeline whose body issues a WGMMA (the stacked matmul, the grouped
    matmul's tile kernel) waits after it until at most `n` remain in flight and releases its
    buffers at least `n` steps late, with more stages than that delay: a refill never lands in
    a buffer that an unfinished WGMMA reads. Interpret mode cannot show a violation (it runs
    each WGMMA to completion); on an H100 the tile kernel without it gave wrong products at
    Gemma 4 26B-A4B's decode geometry."""
    from pallas_kernels.grouped_matmul import grouped_matmul

    sds = jax.ShapeDtypeStruct
    g = max(GEOMS, key=lambda g: g.k * g.n)
    moe = max(configs.moe_geometries(), key=lambda g: g.experts)

    def run():
        for rows in (1, 64, 256):
            _lower(
                lambda a, b, i: stacked_matmul(a, b, i, implementation="pallas"),
                sds((rows, g.k), jnp.bfloat16),
                sds((2, g.k, g.n), jnp.bfloat16),
                sds((), jnp.int32),
            )
        _lower(
            lambda a, b, c, o: grouped_matmul(a, b, c, group_offset=o, implementation="pallas"),
            sds((128, moe.moe_ff), jnp.bfloat16),
            sds((2 * moe.experts, moe.moe_ff, moe.hidden), jnp.bfloat16),
            sds((moe.experts,), jnp.int32),
            sds((), jnp.int32),
        )

    pipelines = _recorded_pipelines(monkeypatch, run)
    assert len(pipelines) == 4
    for p in pipelines:
        assert ("wgmma",) in p["calls"], p
        last = max(i for i, c in enumerate(p["calls"]) if c == ("wgmma",))
        waits = [c[1] for c in p["calls"][last + 1 :] if c[0] == "wait"]
        assert waits, f"no wgmma_wait after the body's last WGMMA: {p}"
        assert min(waits) <= min(p["delays"]), p
        assert p["stages"] > min(p["delays"]), p
    assert stream.WGMMA_IN_FLIGHT <= stream.DELAY_RELEASE


# ------------------------------------------------------------------ on the GPU
@pytest.mark.gpu
@pytest.mark.parametrize("geom", GEOMS, ids=IDS)
def test_kernel_matches_oracle_on_gpu(geom):
    """The compiled kernel at every preset geometry and decode row count, in a stack of the
    preset's depth whose every other layer is NaN, the index static and traced."""
    rng = np.random.default_rng([geom.k, geom.n])
    layers = geom.stack_layers
    for rows in ROWS:
        index = int(rng.integers(layers))
        x, stack, want = _case(rng, rows, geom.k, geom.n, layers, index)
        static = jax.jit(lambda a, b, i=index: stacked_matmul(a, b, i, implementation="pallas"))
        traced = jax.jit(lambda a, b, i: stacked_matmul(a, b, i, implementation="pallas"))
        _check(static(x, stack), want, (geom, rows, "static"))
        _check(traced(x, stack, jnp.int32(index)), want, (geom, rows, "traced"))
        del stack
