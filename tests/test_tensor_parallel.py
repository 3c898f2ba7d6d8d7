"""Several devices: tensor parallelism ("model") and replicas ("data") against one device.

The oracle is the one-device engine (itself checked against the dense model by
`test_generate.py`): on a mesh, greedy tokens must be identical and every sampled token's
logits within 1e-5 (float32 KV), through chunked prefill, scratch reuse on and off, KV sharing,
K=V, MoE, per-layer embeddings and preemption.

The mesh tests need 8 devices: `test_in_eight_device_process` runs this file again in a
process with `XLA_FLAGS=--xla_force_host_platform_device_count=8` (set before JAX starts, so
the other test files keep their one CPU device); in this process they are skipped. The
sharding rule, the head checks and the per-device budget need no devices and run here.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_generate import prompts_of, tiny_gemma3, tiny_gemma4
from test_online_split import rows_running_at_resplits

import gemma
import swajax
from gemma import configs
from gemma._checkpoint import abstract_model
from gemma._sharding import device_bytes, partition_spec
from swajax._sharding import MODEL

NUM_DEVICES = 8
HAS_MESH = jax.device_count() >= NUM_DEVICES
needs_mesh = pytest.mark.skipif(
    not HAS_MESH, reason="runs in an 8-device process (test_in_eight_device_process)"
)
no_mesh = pytest.mark.skipif(HAS_MESH, reason="needs no devices: runs in the main test process")


# The mesh tests in two child processes (xdist runs them side by side): the engines of the
# greedy tests are reused by the collectives test, so those two stay together.
EIGHT_DEVICE_SHARDS = {
    "engines": "greedy_tokens or compiled_step_collectives",
    "loading-and-lowering": "not greedy_tokens and not compiled_step_collectives",
}


@pytest.mark.skipif(HAS_MESH, reason="this process already has the devices")
@pytest.mark.parametrize("shard", sorted(EIGHT_DEVICE_SHARDS))
def test_in_eight_device_process(shard):
    """This file's mesh tests in a process with 8 CPU devices (XLA's LLVM optimisation off:
    these tests compile a dozen steps and run them on a few tokens)."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "")
        + f" --xla_force_host_platform_device_count={NUM_DEVICES}"
        + " --xla_backend_optimization_level=0"
    )
    env.pop("PYTEST_XDIST_WORKER", None)
    here = Path(__file__)
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "pytest", str(here), "-q", "-x", "-p", "no:cacheprovider"),
            *("-k", EIGHT_DEVICE_SHARDS[shard]),
        ],
        cwd=here.parent.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and " failed" not in proc.stdout, proc.stdout[-2000:]


# ----------------------------------------------------------------------------- the rule


def _leaf_paths(state):
    for path, leaf in jax.tree_util.tree_leaves_with_path(state):
        names = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
        yield "/".join(n for n in names if n != "value"), leaf


@no_mesh
@pytest.mark.parametrize("name", configs.PRESET_NAMES)
def test_partition_rule_on_every_preset(name):
    """Every preset's abstract model: each spec fits its leaf, a stacked leaf's leading axis
    is never split, a split axis is divisible, and the Megatron pairs are split as designed;
    one device holds about 1/tp of the big matrices."""
    config = configs.preset(name)
    model = abstract_model(config, jnp.bfloat16)
    _, state = nnx.split(model)
    total = sum(int(np.prod(x.shape)) * 2 for x in jax.tree.leaves(state))
    for tp in (1, 2, 4, 8):
        if config.num_heads % tp:
            with pytest.raises(ValueError, match="query heads"):
                model.partition_specs(tp)
            continue
        specs = dict(_leaf_paths(model.partition_specs(tp)))
        for path, leaf in _leaf_paths(state):
            spec = tuple(specs[path])
            assert len(spec) == len(leaf.shape), (path, spec, leaf.shape)
            run = int(path.split("/")[1]) if path.startswith("blocks/") else None
            stacked = run is not None and model.layer_runs[run].scanned
            if stacked:
                assert spec[0] is None, (path, spec)
            for axis, entry in enumerate(spec):
                if entry == MODEL:
                    assert leaf.shape[axis] % tp == 0, (path, spec, leaf.shape)
            if tp > 1 and path.endswith(("attn/q_proj", "attn/o_proj")):
                head_axis = (1 if path.endswith("q_proj") else 0) + int(stacked)
                assert spec[head_axis] == MODEL, (path, spec)
            if tp > 1 and path in ("embedding", "per_layer_embedding"):
                assert spec[0] == MODEL, (path, spec)
            if tp > 1 and path.endswith("mlp/gate_proj"):
                assert spec[-1] == MODEL, (path, spec)
            if tp > 1 and path.endswith("mlp/down_proj"):
                assert spec[-2] == MODEL, (path, spec)
            if tp > 1 and path.endswith("moe/down_proj"):
                assert spec[int(stacked)] == MODEL, (path, spec)  # experts
            if path.endswith(("norm/scale", "layer_scalar", "router_proj")):
                assert MODEL not in spec, (path, spec)
        # Replicated: norms, routers, the PLE projection and the K / V projections where tp
        # exceeds the KV heads (Gemma 3 4B at tp = 8: 4.0 % of the model; else < 2 %).
        share = device_bytes(model, tp) / total
        assert 1 / tp <= share <= 1 / tp + 0.05, (name, tp, share)


@no_mesh
def test_partition_spec_replicates_what_tp_does_not_divide():
    assert partition_spec("mlp.up_proj", (64, 96), 4) == jax.sharding.PartitionSpec(None, MODEL)
    assert partition_spec("mlp.up_proj", (64, 90), 4) == jax.sharding.PartitionSpec(None, None)
    # experts first, their width where tp does not divide the experts
    assert tuple(partition_spec("moe.gate_proj", (3, 6, 8, 16), 4, stacked=True)) == (
        None,
        None,
        None,
        MODEL,
    )
    assert tuple(partition_spec("moe.gate_proj", (8, 8, 16), 4)) == (MODEL, None, None)


@no_mesh
@pytest.mark.parametrize(
    "tp, heads, kv, match",
    [
        (3, 4, 2, r"tensor-parallel size 3 .* does not divide the model's 4 query heads"),
        (8, 4, 2, r"tensor-parallel size 8 .* exceeds the model's 4 query heads"),
        (6, 12, 4, r"tensor-parallel size 6 .* must divide the 4 KV heads"),
    ],
)
def test_bad_tensor_parallel_size_raises(tp, heads, kv, match):
    config = tiny_gemma3(num_heads=heads, num_kv_heads=kv)
    model = abstract_model(config, jnp.float32)
    with pytest.raises(ValueError, match=match):
        model.partition_specs(tp)
    if heads % tp == 0:  # the KV check of the layout alone
        with pytest.raises(ValueError, match=match):
            swajax.pool.make_layout(config.layer_specs, max_context=64, max_batch=2, tp=tp)


@no_mesh
def test_mesh_without_model_axis_raises():
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]), ("data",))
    model = make_model("gemma3")
    with pytest.raises(ValueError, match=r"needs an axis 'model'.*\('data',\)"):
        swajax.Engine(model, swajax.KVCacheConfig(), max_context=64, max_batch=1, mesh=mesh)


@no_mesh
def test_budget_is_per_device():
    """A quota is per device: slots come from the per-device bytes of a slot, 1/tp where tp
    divides the KV heads, whole where every device holds the KV head (K = 1 pools)."""
    specs = tiny_gemma4().layer_specs  # sliding pool K = 2, full pool K = 1
    cfg = swajax.KVCacheConfig(page_size=16, max_gpu_total_bytes=1 << 20, pool_ratio=(1.0, 1.0))
    kw = dict(max_context=4096, max_batch=64)
    one, two = (swajax.pool.make_layout(specs, cfg, tp=tp, **kw) for tp in (1, 2))
    assert [p.device_kv_heads for p in two.pools] == [1, 1]
    assert [p.stored_kv_heads for p in two.pools] == [2, 2]  # the full pool's head, twice
    assert two.slot_bytes(0) * 2 == one.slot_bytes(0)
    assert two.slot_bytes(1) == one.slot_bytes(1)
    assert two.groups[0].num_slots == 2 * one.groups[0].num_slots
    assert two.groups[1].num_slots == one.groups[1].num_slots
    assert two.pool_bytes() <= 1 << 20
    four = swajax.pool.make_layout(specs, cfg, tp=4, **kw)
    assert [p.stored_kv_heads for p in four.pools] == [4, 4]
    assert four.slot_bytes(0) * 2 == one.slot_bytes(0)


# ----------------------------------------------------------------------------- on a mesh


def tiny_gemma4_all():
    """KV sharing, K=V full layers, MoE beside the dense MLP, per-layer embeddings."""
    return tiny_gemma4(
        attention_k_eq_v=True, num_experts=4, num_experts_per_token=2, moe_intermediate_size=32
    )


_MODELS = {}


def make_model(family: str):
    if family not in _MODELS:
        config = tiny_gemma3() if family == "gemma3" else tiny_gemma4_all()
        _MODELS[family] = gemma.Transformer(config, rngs=nnx.Rngs(5), dtype=jnp.float32)
    return _MODELS[family]


def mesh_of(dp: int, tp: int):
    return jax.make_mesh((dp, tp), ("data", "model"))


CHUNK = 32  # > window (16) + a page: chunks are scratch-backed with scratch on
# With 1.5 times the slots of the longest request, admission takes two rows and decode growth
# preempts one (checked: every engine below preempts).
PROMPTS = prompts_of([47, 31, 15], seed=21)
MAX_NEW = 4


def _engine(model, scratch, *, mesh=None, slots=None, max_batch=3, **engine_kw):
    tp = 1 if mesh is None else dict(mesh.shape)["model"]
    base = dict(page_size=16, dtype=jnp.float32, enable_swa_scratch_reuse=scratch)
    kw = dict(max_context=128, prefill_chunk_size=CHUNK, implementation="reference")
    if slots is None:
        cfg = swajax.KVCacheConfig(max_gpu_total_bytes=8 << 20, **base)
    else:  # exactly `slots` per group, whatever the per-device bytes of a slot
        probe = swajax.pool.make_layout(
            model.config.layer_specs,
            swajax.KVCacheConfig(**base),
            max_context=kw["max_context"],
            max_batch=max_batch,
            max_chunk=CHUNK,
            num_slots=1,
            tp=tp,
        )
        share = [n * probe.slot_bytes(g) for g, n in enumerate(slots)]
        cfg = swajax.KVCacheConfig(
            max_gpu_total_bytes=sum(share) + 1, pool_ratio=tuple(map(float, share)), **base
        )
    return swajax.Engine(
        model, cfg, max_batch=max_batch, min_prefill_bucket=3 * CHUNK, mesh=mesh, **kw, **engine_kw
    )


def _run(engine):
    outputs, stats = engine.run(PROMPTS, MAX_NEW, collect_logits=True)
    logits = {(i, k): x for i, k, x in stats.step_logits}
    return outputs, logits, stats


def _small_pool(model, scratch):
    """Slots per group for about 1.5 of the prompts' peaks: the engine preempts."""
    probe = _engine(model, scratch)
    need = swajax.pool.request_slots(probe.layout, len(PROMPTS[0]), chunk=CHUNK, max_new_tokens=3)
    return tuple(max(int(n * 1.5), 2) for n in need)


_REFERENCE = {}


def one_device(family, scratch):
    """(slots, outputs, logits) of the one-device engine with a small pool (it preempts)."""
    key = (family, scratch)
    if key not in _REFERENCE:
        model = make_model(family)
        slots = _small_pool(model, scratch)
        engine = _engine(model, scratch, slots=slots)
        assert engine.num_slots == slots
        outputs, logits, stats = _run(engine)
        assert stats.preemptions > 0, "the small pool should preempt"
        _REFERENCE[key] = (slots, outputs, logits, engine)
    return _REFERENCE[key]


# (family, scratch, dp, tp). Tiny configs: N = 4 query heads, sliding K = 2, Gemma 4 full K = 1
# (tp = 2 splits K = 2, tp = 4 repeats it, K = 1 is always repeated), Gemma 4 with 4 experts.
# Every mesh shape, both families, scratch on and off, both KV modes, in three mesh engines and
# two one-device ones (each engine compiles a prefill and a decode step); SWAJAX_TP_FULL=1 runs
# every (family, scratch, mesh) combination.
CASES = [("gemma4", True, 1, 2), ("gemma4", True, 2, 2), ("gemma3", False, 1, 4)]
if os.environ.get("SWAJAX_TP_FULL") == "1":
    CASES += [
        (f, s, dp, tp)
        for f in ("gemma4", "gemma3")
        for s in (True, False)
        for dp, tp in ((1, 2), (1, 4), (2, 2))
        if (f, s, dp, tp) not in CASES
    ]
_MESH_ENGINES = {}


@needs_mesh
@pytest.mark.parametrize("family, scratch, dp, tp", CASES)
def test_greedy_tokens_and_logits_equal_one_device(family, scratch, dp, tp):
    slots, expected, expected_logits, reference = one_device(family, scratch)
    model = make_model(family)
    engine = _engine(model, scratch, mesh=mesh_of(dp, tp), slots=slots, max_batch=3 // dp + 1)
    assert engine.num_slots == slots and engine.layout.scratch is scratch
    outputs, logits, stats = _run(engine)
    assert outputs == expected
    assert logits.keys() == expected_logits.keys()
    for key, value in logits.items():
        np.testing.assert_allclose(value, expected_logits[key], rtol=1e-5, atol=1e-5)
    # One replica preempts as the one-device engine does; two replicas split the three prompts,
    # each with a pool of that size, and (with two rewind pages per sliding row since prefix
    # caching is on by default) no longer run short.
    assert stats.preemptions > 0 or dp > 1, stats
    assert engine.trace_count == 2  # one prefill and one decode variant
    # Every slot of every replica is back on its free stacks; every replica served rows.
    engine.clear_prefix_cache()  # parked prefixes hold slots by design
    np.testing.assert_array_equal(np.asarray(engine.state.free_count), list(slots) * dp)
    assert (
        all(s._steps > 0 for s in engine.replicas.schedulers)
        and len(engine.replicas.schedulers) == dp
    )
    assert stats.num_slots == tuple(dp * n for n in slots)
    if dp > 1:  # an abort's frees run in the per-replica bookkeeping step
        rid = engine.add_request(PROMPTS[1], MAX_NEW)
        engine.step()
        engine.abort([rid])
        while engine.has_unfinished_requests:
            engine.step()
        engine.clear_prefix_cache()  # parked prefixes hold slots by design
        np.testing.assert_array_equal(np.asarray(engine.state.free_count), list(slots) * dp)
    _MESH_ENGINES[family, scratch, dp, tp] = engine
    _check_device_bytes(reference, engine, tp)


@needs_mesh
def test_online_split_on_a_mesh_re_splits_with_requests_running(monkeypatch):
    """pool_ratio="online" on two replicas x tp 2: short requests with long answers, then long
    prompts arriving while they decode, so the demand moves to the full group (the workload of
    `test_online_engine_re_splits_while_requests_run_and_keeps_their_tokens`). The policy
    re-splits with requests running, the sharded resize (per replica, the pool roots split over
    KV heads) moves their pages, and the greedy tokens are the dense forward's. (A workload
    whose demand keeps its shares, as the three staggered prompts of the tests above, re-splits
    only once, on one device as on the mesh.)"""
    from test_adaptive_split import quota_for_three
    from test_online_split import shifting_demand_run

    model = make_model("gemma4")
    cfg = swajax.KVCacheConfig(
        page_size=16,
        dtype=jnp.float32,
        enable_swa_scratch_reuse=True,
        max_gpu_total_bytes=quota_for_three(),
        pool_ratio="online",
        rebalance_cooldown=6,
        rebalance_ema=0.5,
    )
    engine = swajax.Engine(
        model,
        cfg,
        max_batch=2,
        mesh=mesh_of(2, 2),
        max_context=128,
        prefill_chunk_size=16,
        max_num_tokens=16,
        min_prefill_bucket=16,
        implementation="reference",
    )
    running = rows_running_at_resplits(engine, monkeypatch)
    tokens, expected, stats = shifting_demand_run(engine, model)
    assert tokens == expected
    assert stats.resplits == len(running) >= 2, running
    assert any(n > 0 for n in running), running  # pages moved under running requests
    engine.clear_prefix_cache()
    np.testing.assert_array_equal(np.asarray(engine.state.free_count), list(engine.num_slots) * 2)


def _check_device_bytes(reference, engine, tp):
    """Per device: the parameters as the rule says (about 1/tp of one device's: presets in
    `test_partition_rule_on_every_preset`; at these widths the replicated norms and K / V
    projections weigh more), each pool root 1/tp where tp divides its KV heads, else one whole
    KV head (all of a K = 1 pool)."""
    one = sum(x.nbytes for x in jax.tree.leaves(reference.params))
    local = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(engine.params))
    model = nnx.merge(engine.runner.graphdef, engine.params)
    assert local == device_bytes(model, tp) and one / tp <= local <= one / tp * 1.5, (local, one)
    pairs = zip(reference.state.pools, engine.state.pools, strict=True)
    for spec, (ref_pool, pool) in zip(engine.layout.pools, pairs, strict=True):
        shard = pool.addressable_shards[0].data
        assert shard.nbytes == ref_pool.nbytes * spec.device_kv_heads // spec.num_kv_heads
        if spec.num_kv_heads % tp == 0:
            assert shard.nbytes * tp == ref_pool.nbytes
    assert engine.layout.pool_bytes() == sum(
        p.addressable_shards[0].data.nbytes for p in engine.state.pools
    )


def _collectives(text: str) -> list[tuple[str, str, str]]:
    """(result shape, op, replica groups) of every collective of a compiled HLO module (a
    tuple result, e.g. of a combined all-reduce or an async start, whole)."""
    op = r"= (\([^=]*?\)|\S+) (all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)"
    groups = r"replica_groups=(mesh\[[^\]]*\] \{[^}]*\}|\[[\d,]*\]<=\[\d+\]|\{[{}\d,]*\})"
    return re.findall(op + r"(?:-start)?\(.*?" + groups, text)


def _over_model_only(groups: str, dp: int, tp: int) -> bool:
    """Whether HLO replica groups are the rows of tp consecutive devices of a dp x tp mesh:
    iota form "[dp,tp]<=[dp*tp]", or a mesh form whose grouped axis is the last, of size tp
    ("mesh['data'=2,'model'=2] {'model'}", "mesh['axis_0'=2,'axis_1'=2] {'axis_1'}")."""
    if groups in (f"[{dp},{tp}]<=[{dp * tp}]", f"[1,{tp}]<=[{tp}]" if dp == 1 else ""):
        return True
    match = re.fullmatch(r"mesh\[(.*)\] \{'(\w+)'\}", groups)
    if match is None:
        return False
    axes = [(a.split("=")[0].strip("'"), int(a.split("=")[1])) for a in match[1].split(",")]
    sizes = [n for _, n in axes]
    return axes[-1] == (match[2], tp) and int(np.prod(sizes)) == dp * tp


@needs_mesh
@pytest.mark.parametrize("dp, tp", [(1, 2), (2, 2)])
def test_compiled_step_collectives(dp, tp):
    """The prefill step all-reduces the row-parallel outputs, every collective stays inside
    one replica's "model" devices, and it gathers no pool root and no parameter and copies no
    pool root (it updates them in place)."""
    engine = _MESH_ENGINES.get(("gemma4", True, dp, tp))
    if engine is None:  # run alone: the engine test_greedy_tokens_and_logits_equal_one_device runs
        slots = one_device("gemma4", True)[0]
        mesh = mesh_of(dp, tp)
        engine = _engine(make_model("gemma4"), True, mesh=mesh, slots=slots, max_batch=3 // dp + 1)
        _run(engine)
    # The step the run compiled (prefill bucket, logits on): JAX's caches hand it back.
    bucket = engine.step_buckets()[1][0]
    text = engine.runner.lower(bucket, False, "greedy", logits=True).compile().as_text()
    ops = _collectives(text)
    assert any(op == "all-reduce" for _, op, _ in ops), ops
    # Over "model" only: groups of tp consecutive device ids, the mesh's rows (one replica each).
    assert engine.runner.mesh.devices.flatten().tolist() == jax.devices()[: dp * tp]
    for *_, groups in ops:
        assert _over_model_only(groups, dp, tp), (groups, ops)
    pools = [p.addressable_shards[0].data.shape for p in engine.state.pools]
    pools += [p.shape for p in engine.state.pools]
    # Parameters, whole or one layer of a stacked run (the expert weights among them).
    big = {tuple(x.shape) for x in jax.tree.leaves(engine.params) if x.size >= 1024}
    big |= {s[1:] for s in big if len(s) > 2}
    # and an expert stack's layers merged ([R * E, K, N]), the grouped matmul's operand
    big |= {(s[0] * s[1], *s[2:]) for s in big if len(s) == 4}
    for shape, op, _ in ops:
        for inner in re.findall(r"\[([\d,]*)\]", shape):  # every array of a tuple result
            dims = tuple(int(d) for d in inner.split(",") if d)
            assert dims not in pools, (op, shape)
            assert op != "all-gather" or dims not in big, (op, shape)
    for line in text.splitlines():
        if " copy(" in line:
            assert not any(f"[{','.join(map(str, s))}]" in line.split("copy(")[0] for s in pools), (
                line
            )
    assert "input_output_alias" in text


@needs_mesh
def test_sharded_loading_equals_host_loading(tmp_path):
    """from_pretrained(mesh=) and restore_params(mesh=) give the model's values with every
    array on its sharding, as its tensor-parallel view (the MoE experts copied out per layer,
    `Transformer.for_tensor_parallel`); init_sharded draws straight into the shards."""
    model = make_model("gemma4")
    mesh = mesh_of(2, 4)
    gemma.save_pretrained(model, tmp_path / "hf")
    gemma.save_params(model, tmp_path / "orbax")
    want = gemma.param_shardings(model, mesh)
    host = jax.tree.leaves(nnx.state(model))
    for loaded in (
        gemma.from_pretrained(tmp_path / "hf", mesh=mesh),
        gemma.restore_params(None, tmp_path / "orbax", mesh=mesh),
    ):
        leaves = jax.tree.leaves(nnx.state(loaded))
        for a, b, s in zip(host, leaves, jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
            assert b.sharding.is_equivalent_to(s, b.ndim), (b.sharding, s)
        moes = [b.moe for blocks in loaded.blocks for b in blocks if b.moe is not None]
        assert moes and {m.in_place_max_rows for m in moes} == {0}
    sharded = gemma.shard_model(model, mesh)
    assert {b.moe.in_place_max_rows for bs in sharded.blocks for b in bs if b.moe} == {0}
    # A jit of the whole constructor: a small config keeps its compile short.
    small = tiny_gemma3(num_layers=2)
    drawn = gemma.init_sharded(small, mesh, seed=1)
    want = gemma.param_shardings(drawn, mesh)
    for b, s in zip(jax.tree.leaves(nnx.state(drawn)), jax.tree.leaves(want), strict=True):
        assert b.sharding.is_equivalent_to(s, b.ndim), (b.sharding, s)
    local = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(nnx.state(drawn)))
    assert local == device_bytes(drawn, 4)
    assert np.isfinite(np.asarray(drawn.embedding[...])).all()


@needs_mesh
def test_more_devices_than_heads_raises():
    with pytest.raises(ValueError, match=r"size 8 .* exceeds the model's 4 query heads"):
        swajax.generate(make_model("gemma3"), [[1, 2, 3]], 2, mesh=mesh_of(1, 8))
    with pytest.raises(ValueError, match=r"size 3 .* does not divide the model's 4 query heads"):
        swajax.generate(make_model("gemma3"), [[1, 2, 3]], 2, mesh=mesh_of(1, 3))


@needs_mesh
def test_pallas_step_lowers_for_cuda_at_tp_2():
    """A Gemma 4 31B-geometry prefill step (small_preset: 32 query heads, sliding K = 16
    split, full K = 4 split, head_dim 256 / 512) with the Mosaic GPU kernels under shard_map
    lowers for CUDA, each kernel on its shard's heads."""
    from pallas_kernels import _checks

    config = configs.small_preset("gemma4_31b")
    model = gemma.Transformer(
        config, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16
    )
    chunk = 2 * config.sliding_window
    engine = swajax.Engine(
        model,
        swajax.KVCacheConfig(page_size=32, max_gpu_total_bytes=64 << 20),
        max_context=4 * chunk,
        max_batch=4,
        prefill_chunk_size=chunk,
        implementation="pallas",
        mesh=mesh_of(1, 2),
    )
    assert engine.layout.scratch
    local_pools = [p.addressable_shards[0].data.shape for p in engine.state.pools]
    assert [s[2] for s in local_pools] == [8, 2]
    # The prefill step (KV write, ragged prefill, page-table gather); the decode kernel's
    # per-shard GQA groups (2 and 8) equal one device's, lowered by test_preset_lowering.py.
    with _checks.force_compiled():
        text = engine.lower_step(chunk, decode=False, lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text and "sdy.manual_computation" in text
    # The kernels' pool operands are the shards: 8 of 16 sliding KV heads, 2 of 4 full.
    for pages, size, heads, dim in local_pools:
        assert f"tensor<{pages}x{size}x{heads}x{dim}xbf16>" in text
