"""Layers under `lax.scan`: the runs of a repeating period, stacked parameters, and parity with
the unrolled model (`Transformer(scan_layers=False)`, one Block per layer).

Oracles: hand-computed runs of the presets; the unrolled model built from the same seed (the
same parameters, layer by layer: construction draws them in layer order either way) through the
dense forward and through the paged engine; the lowered step's size at two depths.
"""

from __future__ import annotations

import functools
import re

import chex
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_generate import _logits_by_token, prompts_of, run_engine, tiny_gemma3, tiny_gemma4

import gemma
import swajax
from gemma._transformer import _dense_forward


def runs_of(config):
    return [(r.first, r.period, r.count) for r in config.layer_runs]


def test_runs_of_presets_by_hand():
    """Gemma 3: 5 sliding + 1 full repeated, the remainder unrolled. Gemma 4 E2B / E4B: the
    writer periods, the period holding the two layers whose KV the shared layers read
    (unrolled), then the KV-shared periods."""
    presets = gemma.configs
    assert runs_of(presets.gemma3_1b()) == [(0, 6, 4), (24, 2, 1)]
    assert runs_of(presets.gemma3_27b()) == [(0, 6, 10), (60, 2, 1)]
    assert runs_of(presets.gemma3_12b()) == [(0, 6, 8)]
    assert runs_of(presets.gemma4_e2b()) == [(0, 5, 2), (10, 5, 1), (15, 5, 4)]
    assert runs_of(presets.gemma4_e4b()) == [(0, 6, 3), (18, 6, 1), (24, 6, 3)]
    assert runs_of(presets.gemma4_31b()) == [(0, 6, 10)]
    # No repetition at all: one unrolled run.
    assert runs_of(presets.gemma3_1b(num_layers=2, layer_types=("sliding", "full"))) == [(0, 2, 1)]


@pytest.mark.parametrize("name", gemma.configs.PRESET_NAMES)
def test_runs_cover_layers_with_equal_specs_per_position(name):
    """The runs tile the layers in order, and every repetition of a scanned run has the
    attention spec (window, geometry, scale, writer) and MLP width of the first: what the
    attention hooks and the stacked parameters rely on."""
    config = gemma.configs.preset(name)
    runs = config.layer_runs
    assert [i for r in runs for i in r.layers] == list(range(config.num_layers))
    specs = config.layer_specs
    for run in runs:
        for i in run.layers:
            like = run.first + (i - run.first) % run.period
            a, b = specs[i], specs[like]
            assert (a.window, a.num_kv_heads, a.head_dim, a.scale) == (
                b.window,
                b.num_kv_heads,
                b.head_dim,
                b.scale,
            )
            assert (a.kv_source == i) == (b.kv_source == like)
            if a.kv_source != i:
                assert a.kv_source == b.kv_source  # readers of a run share one writer
            assert config.mlp_width(i) == config.mlp_width(like)
    scanned = sum(r.period * r.count for r in runs if r.scanned)
    assert scanned >= config.num_layers * 0.6, runs


# Tiny configs of every feature the scan must carry: Gemma 3; Gemma 4 with KV sharing and
# per-layer embeddings (the default tiny_gemma4), K=V full layers, MoE.
CONFIGS = {
    "gemma3": lambda: tiny_gemma3(num_layers=8),
    "gemma4_shared_ple": lambda: tiny_gemma4(),
    "gemma4_keqv": lambda: tiny_gemma4(
        num_layers=8, num_kv_shared_layers=0, attention_k_eq_v=True, per_layer_input_dim=0
    ),
    "gemma4_moe": lambda: tiny_gemma4(
        num_layers=8,
        num_kv_shared_layers=0,
        per_layer_input_dim=0,
        num_experts=4,
        num_experts_per_token=2,
        moe_intermediate_size=32,
    ),
}


@functools.cache
def model_pair(case: str):
    config = CONFIGS[case]()
    scanned, unrolled = (
        gemma.Transformer(config, rngs=nnx.Rngs(4), scan_layers=scan) for scan in (True, False)
    )
    for model in (scanned, unrolled):
        gemma.set_unit_size_attention_logits(model)
    return scanned, unrolled


@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_scan_and_unrolled_hold_the_same_parameters(case):
    scanned, unrolled = model_pair(case)
    assert any(r.scanned for r in scanned.layer_runs), scanned.layer_runs
    assert [r.scanned for r in unrolled.layer_runs] == [False]
    paths = ["attn.q_proj", "attn.o_proj", "mlp.down_proj", "pre_attention_norm.scale"]
    for i in range(scanned.config.num_layers):
        for name in paths:
            chex.assert_trees_all_equal(scanned.layer_param(i, name), unrolled.layer_param(i, name))
    assert scanned.num_params == unrolled.num_params


@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_scan_matches_unrolled_dense(case):
    scanned, unrolled = model_pair(case)
    tokens = jnp.asarray(np.random.default_rng(1).integers(1, 128, (2, 40)), jnp.int32)
    a, b = np.asarray(scanned(tokens)), np.asarray(unrolled(tokens))
    chex.assert_trees_all_close(a, b, rtol=1e-6, atol=1e-6)
    assert (a.argmax(-1) == b.argmax(-1)).all()


@pytest.mark.parametrize(
    "case, scratch, in_place",
    [
        ("gemma3", False, False),
        ("gemma4_shared_ple", True, False),
        ("gemma4_shared_ple", False, True),
        ("gemma4_moe", True, "grouped"),
    ],
)
def test_scan_matches_unrolled_paged(case, scratch, in_place):
    """Chunked prefill larger than the window, then decode: the same greedy tokens and logits
    within 1e-6 (1e-5 with the decode steps reading the weights in place: unrolled over static
    slices, or the grouped matmul, which accumulates in another order), with scratch reuse on
    and off."""
    scanned, unrolled = model_pair(case)
    prompts = prompts_of([70, 33, 9], seed=5)
    runs = {}
    for name, model in (("scan", scanned), ("unrolled", unrolled)):
        engine_kw = dict(decode_weights_in_place=in_place if name == "scan" else False)
        engine, outputs, stats = run_engine(
            model, prompts, 6, scratch=scratch, chunk=48, collect=True, engine_kw=engine_kw
        )
        assert engine.layout.scratch is scratch
        runs[name] = outputs, _logits_by_token(stats)
    assert runs["scan"][0] == runs["unrolled"][0]
    for key, logits in runs["scan"][1].items():
        tol = 1e-5 if in_place else 1e-6
        chex.assert_trees_all_close(logits, runs["unrolled"][1][key], rtol=tol, atol=tol)


def _lowered_step_size(num_layers: int) -> int:
    """Operations in the lowered prefill step of a Gemma 3 model of `num_layers` layers."""
    config = tiny_gemma3(num_layers=num_layers)
    model = gemma.Transformer(config, rngs=nnx.Rngs(0))
    engine = swajax.Engine(
        model,
        swajax.KVCacheConfig(page_size=16, dtype=jnp.float32, max_gpu_total_bytes=16 << 20),
        max_context=128,
        max_batch=2,
        prefill_chunk_size=32,
    )
    text = engine.lower_step(64, decode=False).as_text()
    return sum(1 for line in text.splitlines() if " = " in line)


def test_lowered_step_is_flat_in_depth():
    """The step of a 48-layer model lowers to at most 1.3x the operations of a 12-layer one
    (unrolled, it grew by about 520 operations per layer)."""
    small, large = _lowered_step_size(12), _lowered_step_size(48)
    assert large <= 1.3 * small, (small, large)


def test_layer_param_accessors():
    scanned, _ = model_pair("gemma3")
    block, index = scanned.layer_block(7)
    assert index is not None and block.attn.q_proj.shape[0] > 1  # a stacked Block
    before = scanned.layer_param(7, "layer_scalar")
    assert before is None  # Gemma 3 has no layer scalars
    value = jnp.full_like(scanned.layer_param(7, "post_ffw_norm.scale"), 0.25)
    old6 = scanned.layer_param(6, "post_ffw_norm.scale")
    model = gemma.Transformer(scanned.config, rngs=nnx.Rngs(4))
    model.set_layer_param(7, "post_ffw_norm.scale", value)
    chex.assert_trees_all_equal(model.layer_param(7, "post_ffw_norm.scale"), value)
    chex.assert_trees_all_equal(model.layer_param(6, "post_ffw_norm.scale"), old6)
    with pytest.raises(ValueError, match="outside"):
        model.layer_block(8)
    with pytest.raises(ValueError, match="no 'attn.nope'"):
        model.layer_param(0, "attn.nope")
    with pytest.raises(ValueError, match="not an array"):
        model.layer_param(0, "attn")


def _dense_logits(model, tokens, weights_in_place):
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[-1], dtype=jnp.int32), tokens.shape)
    return np.asarray(_dense_forward(model, tokens, positions, None, weights_in_place))


@pytest.mark.parametrize("form", ["unrolled", "grouped"])
@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_weights_in_place_matches_unrolled(case, form):
    """The scanned model reading each layer's matrices in place (`weights_in_place`: unrolled
    over static slices of the stacks, or the grouped matmul over the whole stack, MoE experts
    included) gives the per-layer unrolled model's logits."""
    scanned, unrolled = model_pair(case)
    tokens = jnp.asarray(np.random.default_rng(2).integers(1, 128, (2, 24)), jnp.int32)
    got = _dense_logits(scanned, tokens, form)
    chex.assert_trees_all_close(got, np.asarray(unrolled(tokens)), rtol=1e-5, atol=1e-5)


def _sliced_operands(model, tokens, weights_in_place) -> list[tuple]:
    """Shapes of the stacked matrices (rank >= 3, a run's repetitions leading) that the traced
    forward slices per layer: scan inputs (`xs`) and dynamic slices inside the scan body."""

    positions = jnp.broadcast_to(jnp.arange(tokens.shape[-1], dtype=jnp.int32), tokens.shape)
    graphdef, params = nnx.split(model)
    stacked = {
        tuple(a.shape)
        for a in jax.tree.leaves(params)
        if a.ndim >= 3 and a.shape[0] in {r.count for r in model.layer_runs if r.scanned}
    }

    rows = {shape[1:] for shape in stacked}

    def forward(params):
        return _dense_forward(
            nnx.merge(graphdef, params), tokens, positions, None, weights_in_place
        )

    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "scan":  # a body input of one layer's matrix shape
                for v in eqn.params["jaxpr"].jaxpr.invars:
                    if tuple(v.aval.shape) in rows:
                        found.append(("xs", tuple(v.aval.shape)))
            if eqn.primitive.name == "dynamic_slice":
                if tuple(eqn.invars[0].aval.shape) in stacked:
                    found.append(("dynamic_slice", tuple(eqn.invars[0].aval.shape)))
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(forward)(params).jaxpr)
    return found


@pytest.mark.parametrize("case", ["gemma4_shared_ple", "gemma4_moe"])
def test_weights_in_place_slices_no_matrix(case):
    """The scan slices every stacked dense matrix per layer by default (dynamically: XLA
    copies each; the experts: `test_experts_are_read_in_the_stack`); in place it slices none
    dynamically (unrolled: static slices, which XLA fuses
    into the GEMMs; grouped: the vectors still come sliced)."""
    scanned, _ = model_pair(case)
    tokens = jnp.ones((1, 8), jnp.int32)
    assert _sliced_operands(scanned, tokens, False)
    assert _sliced_operands(scanned, tokens, "grouped") == []
    assert _sliced_operands(scanned, tokens, True) == []


def _slices_of(jaxpr, shapes) -> list[tuple]:
    """(primitive, shape) of every slice, dynamic slice or gather of an operand whose shape is
    in `shapes`, nested jaxprs included."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("slice", "dynamic_slice", "gather"):
            if tuple(eqn.invars[0].aval.shape) in shapes:
                found.append((eqn.primitive.name, tuple(eqn.invars[0].aval.shape)))
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found += _slices_of(sub, shapes)
    return found


@pytest.mark.parametrize("copied", [False, True], ids=["in-place", "copied"])
@pytest.mark.parametrize("weights_in_place", [True, False], ids=["unrolled", "scan"])
def test_experts_are_read_in_the_stack(monkeypatch, weights_in_place, copied):
    """The experts' grouped matmul is a custom call: a slice of a stack given to it is a copy
    of every expert. So, scanned or unrolled, the expert stacks are never scan inputs and stay
    whole: each grouped matmul gets one layer's E group sizes and that layer's offset in the
    stack (static unrolled, the scan's counter in the scan; not count x E sizes: the Hopper
    kernel's work and code grow with the groups it is given). Above
    `EXPERTS_IN_PLACE_MAX_ROWS` token copies the layer's experts are sliced out instead (one
    [E, K, N] operand, no offset). The dense matrices: static slices unrolled (fused into their
    GEMMs), scan inputs in the scan."""
    import gemma._layers

    scanned, _ = model_pair("gemma4_moe")
    config = scanned.config
    tokens = jnp.ones((1, 8), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(8, dtype=jnp.int32), tokens.shape)
    # 8 tokens x top 2 = 16 token copies per grouped matmul
    gemma.set_experts_in_place_max_rows(scanned, 15 if copied else 16)
    try:
        graphdef, params = nnx.split(scanned)
        sliced = _sliced_operands(scanned, tokens, weights_in_place)
        scan_inputs = [s for kind, s in sliced if kind == "xs"]  # one layer's shapes
    finally:  # the model is shared with other tests
        gemma.set_experts_in_place_max_rows(scanned, gemma._layers.EXPERTS_IN_PLACE_MAX_ROWS)
    leaves = jax.tree_util.tree_leaves_with_path(params)

    def shapes(pattern):
        return {tuple(a.shape) for p, a in leaves if re.search(pattern, jax.tree_util.keystr(p))}

    expert_pattern = r"\['moe'\]\['(gate|up|down)_proj'\]"
    others = {
        tuple(a.shape) for p, a in leaves if not re.search(expert_pattern, jax.tree_util.keystr(p))
    }
    # The stacks (a run's repetitions leading) of shapes no other parameter has.
    experts = {s for s in shapes(expert_pattern) - others if len(s) == 4}
    dense = {s for s in shapes(r"\['mlp'\]\['(gate|up|down)_proj'\]") if s[0] > 1}
    assert experts and dense and not experts & dense

    calls = []
    grouped_matmul = gemma._layers.grouped_matmul

    def recording(lhs, rhs, group_sizes, **kw):
        offset = kw.get("group_offset")
        if isinstance(offset, jax.core.Tracer):
            offset = "traced"
        calls.append((rhs.shape[0], group_sizes.shape[0], offset))
        return grouped_matmul(lhs, rhs, group_sizes, **kw)

    monkeypatch.setattr(gemma._layers, "grouped_matmul", recording)

    def forward(params):  # traced anew (a jitted forward may hold an earlier test's trace)
        model = nnx.merge(graphdef, params)
        logits, _ = model.forward(
            tokens,
            positions,
            attention_fn=gemma.dense_attention_fn(config.layer_specs),
            attention_state=gemma.DenseAttentionState(positions=positions, segment_ids=None),
            weights_in_place=weights_in_place,
        )
        return logits

    jaxpr = jax.make_jaxpr(forward)(params).jaxpr
    e = config.num_experts
    assert any(run.count > 1 for run in scanned.layer_runs)  # offsets past the first layer
    if weights_in_place:  # unrolled: every repetition traced, static offsets
        reps = [(run, [c * e for c in range(run.count)]) for run in scanned.layer_runs]
        assert _slices_of(jaxpr, dense)  # the dense MLP's stacks: static slices
    else:  # one scan body per run, at the scan's counter
        reps = [(run, ["traced"] if run.count > 1 else [None]) for run in scanned.layer_runs]
        assert scan_inputs  # the dense matrices
        assert not [s for s in scan_inputs if s in {e[1:] for e in experts}]
    want = [
        (e, e, None) if run.count == 1 or copied else (run.count * e, e, offset)
        for run, offsets in reps
        for offset in offsets
        for _ in range(run.period)
        for _ in range(3)
    ]
    assert calls == want, (calls, [(r.count, r.period) for r in scanned.layer_runs])
    assert bool(_slices_of(jaxpr, experts)) == copied


def test_experts_in_place_bound_is_checked_and_keys_the_step():
    """`gemma.set_experts_in_place_max_rows` takes an integer >= 0 (ValueError naming the value
    otherwise) and is part of the model's structure, so a step compiled for one bound is never
    served for another (the step cache keys on the GraphDef)."""
    config = CONFIGS["gemma4_moe"]()
    model = gemma.Transformer(config, rngs=nnx.Rngs(0))
    before = repr(nnx.split(model)[0])
    for bad in (-1, 1.5, True, "8"):
        with pytest.raises(ValueError, match="rows must be an integer >= 0"):
            gemma.set_experts_in_place_max_rows(model, bad)
    gemma.set_experts_in_place_max_rows(model, 0)
    assert repr(nnx.split(model)[0]) != before
    moes = [b.moe for blocks in model.blocks for b in blocks if b.moe is not None]
    assert moes and all(m.in_place_max_rows == 0 for m in moes)


def test_tensor_parallel_view_copies_experts_out_and_shares_the_arrays():
    """`Transformer.for_tensor_parallel(tp)`, what an engine on a mesh runs: with tp > 1 its
    MoE layers copy each layer's experts out of the stack (a kernel given the whole sharded
    stack would have it gathered whole), the same arrays, the model itself untouched; tp = 1
    or no MoE: the model itself."""
    moe, _ = model_pair("gemma4_moe")
    dense, _ = model_pair("gemma3")
    assert moe.for_tensor_parallel(1) is moe and dense.for_tensor_parallel(4) is dense
    view = moe.for_tensor_parallel(2)
    default = gemma._layers.EXPERTS_IN_PLACE_MAX_ROWS
    bounds = lambda m: {b.moe.in_place_max_rows for bs in m.blocks for b in bs}  # noqa: E731
    assert bounds(view) == {0} and bounds(moe) == {default}
    for a, b in zip(jax.tree.leaves(nnx.state(moe)), jax.tree.leaves(nnx.state(view)), strict=True):
        assert a is b


def _moe_kernel_model(scan: bool):
    """A small MoE model in bf16 whose expert products the Pallas kernel takes (K and N
    multiples of 64), every layer in one scanned run of three repetitions (the kernel without
    an offset, JAX's, has no interpret mode), Pallas experts when scanned."""
    config = tiny_gemma4(
        num_layers=15,
        num_kv_shared_layers=0,
        per_layer_input_dim=0,
        num_experts=6,
        num_experts_per_token=2,
        moe_intermediate_size=64,
    )
    model = gemma.Transformer(
        config,
        rngs=nnx.Rngs(5),
        scan_layers=scan,
        dtype=jnp.bfloat16,
        param_dtype=jnp.bfloat16,
        moe_implementation="pallas" if scan else "ragged",
    )
    gemma.set_unit_size_attention_logits(model)
    return model


def test_scanned_experts_in_place_run_the_tile_kernel_in_interpret_mode():
    """The scan's experts read in place by the tile kernel (GPU interpret mode, race detection
    on) with the scan's counter as the traced offset, against the per-layer unrolled model
    (ragged_dot on its own experts): the same greedy tokens, logits within bf16 rounding."""
    from pallas_kernels import _checks

    scanned, unrolled = _moe_kernel_model(True), _moe_kernel_model(False)
    assert [(r.count, r.scanned) for r in scanned.layer_runs] == [(3, True)]
    tokens = jnp.asarray(np.random.default_rng(3).integers(1, 128, (1, 12)), jnp.int32)
    with _checks.force_interpret():
        got = _dense_logits(scanned, tokens, False)
    want = np.asarray(unrolled(tokens))
    assert np.isfinite(got).all()
    # logits of magnitude ~0.6; a wrong offset (layer 0's experts throughout) is off by ~0.5
    np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2)
    assert (got.argmax(-1) == want.argmax(-1)).mean() > 0.9


def test_decode_weights_in_place_is_checked():
    scanned, _ = model_pair("gemma3")
    with pytest.raises(ValueError, match="decode_weights_in_place must be True, False or"):
        run_engine(
            scanned,
            prompts_of([9]),
            2,
            scratch=False,
            chunk=16,
            engine_kw=dict(decode_weights_in_place=1),
        )
    with pytest.raises(ValueError, match="needs mesh=None"):
        run_engine(
            scanned,
            prompts_of([9]),
            2,
            scratch=False,
            chunk=16,
            engine_kw=dict(decode_weights_in_place="grouped", mesh=jax.make_mesh((1,), ("model",))),
        )


def _stacked_products(name: str) -> set[tuple[int, int, int]]:
    """(groups, K, N) of every in-place product of preset `name` at full size: each scanned
    run's stacked matrices as `linear` and the MoE experts multiply by them."""
    from gemma._checkpoint import abstract_model

    model = abstract_model(gemma.configs.preset(name), jnp.bfloat16)
    products = set()
    for run, blocks in zip(model.layer_runs, model.blocks, strict=True):
        if not run.scanned:
            continue
        for path, leaf in jax.tree_util.tree_leaves_with_path(nnx.state(blocks)):
            shape, keys = leaf.shape, [str(getattr(k, "key", k)) for k in path]
            if len(shape) < 3:
                continue
            if "moe" in keys and len(shape) == 4:  # experts [R, E, K, N]
                products.add((shape[0] * shape[1], shape[2], shape[3]))
            elif "o_proj" in keys:  # [R, N, H, D]
                products.add((shape[0], shape[1] * shape[2], shape[3]))
            elif len(shape) == 4:  # q/k/v [R, D, N, H]
                products.add((shape[0], shape[1], shape[2] * shape[3]))
            else:
                products.add(shape)
    return products


STACKED_PRODUCTS = sorted(set().union(*map(_stacked_products, gemma.configs.PRESET_NAMES)))


def test_stacked_matmul_lowers_for_cuda_at_preset_geometries():
    """Every preset's in-place product at full size lowers for CUDA through the grouped
    matmul's Mosaic kernel (TMA boxes, shared memory), at a decode step's rows; products the
    kernel does not take fall back to the slice, as `in_place_implementation` says."""
    from gemma._layers import in_place_implementation, stacked_matmul
    from pallas_kernels import _checks

    # One lowering per (K, N) at its largest group count: the groups size only group_sizes.
    largest = {}
    for g, k, n in STACKED_PRODUCTS:
        largest[k, n] = max(g, largest.get((k, n), 0))
    assert len(largest) > 10
    kernels = 0
    for (k, n), g in sorted(largest.items()):
        impl = in_place_implementation(jnp.bfloat16, k, n, "pallas")
        sds = jax.ShapeDtypeStruct
        args = (sds((8, k), jnp.bfloat16), sds((g, k, n), jnp.bfloat16), sds((), jnp.int32))
        f = jax.jit(lambda x, w, i, impl=impl: stacked_matmul(x, w, i, impl))
        with _checks.force_compiled():
            text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert ("mosaic_gpu" in text) == (impl == "pallas"), (g, k, n)
        kernels += impl == "pallas"
    assert kernels == len(largest)  # every preset product takes the kernel


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 8, 32])
def test_stacked_matmul_reads_one_row_on_gpu(rows):
    """The in-place product of every preset geometry against a float64 oracle, the stack's
    other rows NaN: the kernel must read layer `index` only."""
    from gemma._layers import stacked_matmul

    rng = np.random.default_rng(rows)
    for g, k, n in STACKED_PRODUCTS:
        index = int(rng.integers(g))
        x = jnp.asarray(rng.standard_normal((rows, k)) / np.sqrt(k), jnp.bfloat16)
        w = jnp.asarray(rng.standard_normal((k, n)), jnp.bfloat16)
        stack = jnp.full((g, k, n), jnp.nan, jnp.bfloat16).at[index].set(w)
        got = jax.jit(lambda x, s, i: stacked_matmul(x, s, i, "pallas"))(x, stack, index)
        want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
        got = np.asarray(got, np.float64)
        assert np.isfinite(got).all(), (g, k, n)
        np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)
        del stack
