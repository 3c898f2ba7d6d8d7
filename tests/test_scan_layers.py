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
from pallas_kernels.stacked_matmul import MAX_ROWS


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
    """The dense forward scanned (each product x [M, K] @ the layer's [K, N] in its stack) and
    unrolled (einsums over the per-layer arrays): logits within 1e-5 (the two forms sum the
    contracted axes in other orders)."""
    scanned, unrolled = model_pair(case)
    tokens = jnp.asarray(np.random.default_rng(1).integers(1, 128, (2, 40)), jnp.int32)
    a, b = np.asarray(scanned(tokens)), np.asarray(unrolled(tokens))
    chex.assert_trees_all_close(a, b, rtol=1e-5, atol=1e-5)
    assert (a.argmax(-1) == b.argmax(-1)).all()


@pytest.mark.parametrize(
    "case, scratch",
    [(case, True) for case in sorted(CONFIGS)] + [("gemma4_shared_ple", False)],
    ids=lambda v: {True: "scratch", False: "no-scratch"}.get(v, v) if isinstance(v, bool) else v,
)
def test_scan_matches_unrolled_paged(case, scratch):
    """Chunked prefill larger than the window, then decode, through the paged engine: the
    scanned model (every matrix read in its stack) gives the unrolled model's greedy tokens and
    its logits within 1e-5, for Gemma 3, Gemma 4 with KV sharing and PLE, K=V and MoE, with
    scratch reuse on (the path where a window's pages rotate through scratch) and, for the
    KV-sharing model, off. (Scratch on against off is `test_generate.py`'s parity test; the
    model form does not meet the pool, so one no-scratch case guards the layout.)"""
    scanned, unrolled = model_pair(case)
    prompts = prompts_of([70, 33, 9], seed=5)
    runs = {}
    for name, model in (("scan", scanned), ("unrolled", unrolled)):
        engine, outputs, stats = run_engine(
            model, prompts, 6, scratch=scratch, chunk=48, collect=True
        )
        assert engine.layout.scratch is scratch
        runs[name] = outputs, _logits_by_token(stats)
    assert runs["scan"][0] == runs["unrolled"][0]
    for key, logits in runs["scan"][1].items():
        chex.assert_trees_all_close(logits, runs["unrolled"][1][key], rtol=1e-5, atol=1e-5)


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


def _dense_logits(model, tokens):
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[-1], dtype=jnp.int32), tokens.shape)
    return np.asarray(_dense_forward(model, tokens, positions, None))


def _scan_inputs(model, tokens) -> list[tuple]:
    """Shapes of one layer's stacked matrix (rank >= 2 after the run's repetitions) that enter
    a scan body as an input (`xs`): the slices XLA copies every step."""
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[-1], dtype=jnp.int32), tokens.shape)
    graphdef, params = nnx.split(model)
    counts = {r.count for r in model.layer_runs if r.scanned}
    rows = {tuple(a.shape[1:]) for a in jax.tree.leaves(params) if a.ndim >= 3}
    rows = {r for r in rows if len(r) >= 2}
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "scan":
                for v in eqn.params["jaxpr"].jaxpr.invars:
                    if tuple(v.aval.shape) in rows:
                        found.append(tuple(v.aval.shape))
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    def forward(params):
        return _dense_forward(nnx.merge(graphdef, params), tokens, positions, None)

    assert counts
    walk(jax.make_jaxpr(forward)(params).jaxpr)
    return found


@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_scan_takes_no_matrix_as_a_scan_input(case):
    """No stacked matrix enters the layer scan as a per-layer slice (a scan input, which XLA
    copies out of the stack every step): the matrices stay in their stacks for the stacked
    matmul and the MoE's grouped matmul to read; only vectors come sliced."""
    scanned, _ = model_pair(case)
    assert _scan_inputs(scanned, jnp.ones((1, 8), jnp.int32)) == []


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
def test_experts_are_read_in_the_stack(monkeypatch, copied):
    """The experts' grouped matmul is a custom call: a slice of a stack given to it is a copy
    of every expert. So the expert stacks are never scan inputs and stay whole: each grouped
    matmul gets one layer's E group sizes and that layer's offset in the stack (the scan's
    counter; not count x E sizes: the Hopper kernel's work and code grow with the groups it is
    given). Above `EXPERTS_IN_PLACE_MAX_ROWS` token copies the layer's experts are sliced out
    instead (one [E, K, N] operand, no offset)."""
    import gemma._layers

    scanned, _ = model_pair("gemma4_moe")
    config = scanned.config
    tokens = jnp.ones((1, 8), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(8, dtype=jnp.int32), tokens.shape)
    graphdef, params = nnx.split(scanned)
    leaves = jax.tree_util.tree_leaves_with_path(params)
    expert_pattern = r"\['moe'\]\['(gate|up|down)_proj'\]"
    experts = {
        tuple(a.shape) for p, a in leaves if re.search(expert_pattern, jax.tree_util.keystr(p))
    }
    experts = {s for s in experts if len(s) == 4}
    assert experts

    calls = []
    grouped_matmul = gemma._layers.grouped_matmul

    def recording(lhs, rhs, group_sizes, **kw):
        offset = kw.get("group_offset")
        if isinstance(offset, jax.core.Tracer):
            offset = "traced"
        calls.append((rhs.shape[0], group_sizes.shape[0], offset))
        return grouped_matmul(lhs, rhs, group_sizes, **kw)

    monkeypatch.setattr(gemma._layers, "grouped_matmul", recording)
    # 8 tokens x top 2 = 16 token copies per grouped matmul
    gemma.set_experts_in_place_max_rows(scanned, 15 if copied else 16)
    try:
        graphdef = nnx.split(scanned)[0]

        def forward(params):  # traced anew (a jitted forward may hold an earlier test's trace)
            model = nnx.merge(graphdef, params)
            logits, _ = model.forward(
                tokens,
                positions,
                attention_fn=gemma.dense_attention_fn(config.layer_specs),
                attention_state=gemma.DenseAttentionState(positions=positions, segment_ids=None),
            )
            return logits

        jaxpr = jax.make_jaxpr(forward)(params).jaxpr
    finally:  # the model is shared with other tests
        gemma.set_experts_in_place_max_rows(scanned, gemma._layers.EXPERTS_IN_PLACE_MAX_ROWS)
    e = config.num_experts
    assert any(run.count > 1 for run in scanned.layer_runs)  # offsets past the first layer
    want = [
        (e, e, None) if run.count == 1 or copied else (run.count * e, e, "traced")
        for run in scanned.layer_runs
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


def test_tensor_parallel_view_slices_every_matrix_and_shares_the_arrays():
    """`Transformer.for_tensor_parallel(tp)`, what an engine on a mesh runs: with tp > 1 every
    scanned product multiplies by its layer's slice (`in_place_max_rows` 0, the MoE layers'
    bound 0: a Pallas kernel given a whole sharded stack would have it gathered whole), the
    same arrays, the model itself untouched; tp = 1: the model itself."""
    moe, _ = model_pair("gemma4_moe")
    dense, _ = model_pair("gemma3")
    assert moe.for_tensor_parallel(1) is moe and dense.for_tensor_parallel(1) is dense
    for model in (moe, dense):
        view = model.for_tensor_parallel(2)
        assert view.in_place_max_rows == 0
        assert model.in_place_max_rows == MAX_ROWS
        leaves = zip(
            jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(view)), strict=True
        )
        assert all(a is b for a, b in leaves)
    default = gemma._layers.EXPERTS_IN_PLACE_MAX_ROWS
    bounds = lambda m: {b.moe.in_place_max_rows for bs in m.blocks for b in bs}  # noqa: E731
    assert bounds(moe.for_tensor_parallel(2)) == {0} and bounds(moe) == {default}


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


@pytest.mark.usefixtures("no_persistent_cache_writes")
def test_scanned_experts_in_place_run_the_tile_kernel_in_interpret_mode():
    """The scan's experts read in place by the tile kernel (GPU interpret mode, race detection
    on) with the scan's counter as the traced offset, against the per-layer unrolled model
    (ragged_dot on its own experts): the same greedy tokens, logits within bf16 rounding."""
    from pallas_kernels import _checks

    scanned, unrolled = _moe_kernel_model(True), _moe_kernel_model(False)
    assert [(r.count, r.scanned) for r in scanned.layer_runs] == [(3, True)]
    tokens = jnp.asarray(np.random.default_rng(3).integers(1, 128, (1, 12)), jnp.int32)
    with _checks.force_interpret():
        got = _dense_logits(scanned, tokens)
    want = np.asarray(unrolled(tokens))
    assert np.isfinite(got).all()
    # logits of magnitude ~0.6; a wrong offset (layer 0's experts throughout) is off by ~0.5
    np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2)
    assert (got.argmax(-1) == want.argmax(-1)).mean() > 0.9


def _kernel_model(scan: bool):
    """A small Gemma 4 in bf16 (KV sharing and PLE) whose matrices the stacked matmul takes
    (K and N multiples of 64) in scanned runs of several repetitions."""
    config = tiny_gemma4(
        hidden_size=128, intermediate_size=256, num_heads=2, head_dim=64, global_head_dim=64
    )
    model = gemma.Transformer(
        config, rngs=nnx.Rngs(6), scan_layers=scan, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16
    )
    gemma.set_unit_size_attention_logits(model)
    return model


@pytest.mark.usefixtures("no_persistent_cache_writes")
def test_scanned_decode_runs_the_stacked_kernel_in_interpret_mode():
    """The paged engine's decode steps with every scanned matrix read in its stack by the
    stacked matmul kernel (GPU interpret mode, race detection on, the layer the scan's
    counter), against the unrolled model on XLA's dots: the same greedy tokens, logits within
    bf16 rounding (a wrong layer's matrix is off by O(1))."""
    from pallas_kernels import _checks

    scanned, unrolled = _kernel_model(True), _kernel_model(False)
    assert any(r.scanned and r.count > 1 for r in scanned.layer_runs)
    prompts = prompts_of([20, 9], seed=7)
    with _checks.force_interpret():
        _, got, got_stats = run_engine(scanned, prompts, 3, scratch=True, chunk=32, collect=True)
    _, want, want_stats = run_engine(unrolled, prompts, 3, scratch=True, chunk=32, collect=True)
    assert got == want
    want_logits = _logits_by_token(want_stats)
    for key, logits in _logits_by_token(got_stats).items():
        np.testing.assert_allclose(logits, want_logits[key], rtol=3e-2, atol=3e-2)


def _stacks(model) -> set[str]:
    """The stacked matrices' shapes as StableHLO tensor types ('8x3840x15360xbf16')."""
    return {
        "x".join(map(str, a.shape)) + "x" + str(a.dtype)
        for a in jax.tree.leaves(nnx.state(model))
        if a.ndim >= 3 and a.shape[0] in {r.count for r in model.layer_runs if r.scanned}
    }


@pytest.mark.parametrize("name", gemma.configs.PRESET_NAMES)
def test_full_size_decode_reads_every_matrix_in_its_stack(name):
    """Every preset at full size (abstract weights), its 8-row decode forward lowered for CUDA
    on the CPU: the stacked matmul kernel multiplies every scanned layer's matrices (one
    Mosaic kernel per dense matrix of the run's period) and no stacked matrix is sliced
    (`dynamic_slice` of a stack: a copy of the weights every step) anywhere in the step."""
    from gemma._checkpoint import abstract_model
    from pallas_kernels import _checks

    config = gemma.configs.preset(name)
    model = abstract_model(config, jnp.bfloat16)
    graphdef, params = nnx.split(model)
    tokens = jax.ShapeDtypeStruct((1, 8), jnp.int32)

    def forward(params, tokens):
        positions = jnp.broadcast_to(jnp.arange(8, dtype=jnp.int32), tokens.shape)
        logits, _ = nnx.merge(graphdef, params).forward(
            tokens,
            positions,
            attention_fn=gemma.dense_attention_fn(config.layer_specs),
            attention_state=gemma.DenseAttentionState(positions=positions, segment_ids=None),
        )
        return logits

    with _checks.force_compiled():
        text = jax.jit(forward).trace(params, tokens).lower(lowering_platforms=("cuda",))
        text = text.as_text()
    stacks = _stacks(model)
    assert stacks
    sliced = [
        line
        for line in text.splitlines()
        if "dynamic_slice" in line and any(f"tensor<{s}>" in line.split("->")[0] for s in stacks)
    ]
    assert not sliced, sliced[:3]
    # one kernel per dense matrix of every scanned run's period, in the lowered program once
    dense = 0
    for run, blocks in zip(model.layer_runs, model.blocks, strict=True):
        if run.scanned:
            for path, leaf in jax.tree_util.tree_leaves_with_path(nnx.state(blocks)):
                keys = [str(getattr(p, "key", p)) for p in path]
                dense += leaf.ndim >= 3 and not ("moe" in keys and leaf.ndim == 4)
    kernels = text.count("pallas_kernels/stacked_matmul.py")
    assert kernels >= dense, (kernels, dense)
