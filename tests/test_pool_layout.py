"""Layout construction, converters, KVCacheConfig validation and the scratch policy."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gemma
import swajax

S = gemma.LayerSpec


def gemma4_e2b_like(num_layers=10, shared=4):
    """Gemma 4 E2B pattern at toy size: 4 sliding (W 512, 1 x 256) : 1 full (1 x 512) layers,
    the last `shared` layers read the last writer of their type."""
    specs = []
    for i in range(num_layers):
        full = i % 5 == 4
        specs.append(S(None, 1, 512, kv_source=i) if full else S(512, 1, 256, kv_source=i))
    first_reader = num_layers - shared
    for i in range(first_reader, num_layers):
        w = max(
            k for k in range(first_reader) if (specs[k].window is None) == (specs[i].window is None)
        )
        specs[i] = dataclasses.replace(specs[i], kv_source=w)
    return specs


def test_gemma4_like_layout():
    specs = gemma4_e2b_like()
    cfg = swajax.KVCacheConfig(page_size=32, chunk_size=256)
    layout = swajax.pool.make_layout(specs, cfg, max_context=2048, max_batch=4, num_slots=(100, 30))
    assert layout.scratch  # text model, per-layer backend: policy default on
    # writers 0..5: sliding 0,1,2,3,5 and full 4; readers 6..9 (sliding 6,7,8 -> 5, full 9 -> 4)
    assert [g.life_cycle for g in layout.groups] == [(512, 0), (None, 0)]
    sliding, full = layout.pools
    assert sliding.layers == (0, 1, 2, 3, 5) and sliding.scale == 10
    assert full.layers == (4,) and full.scale == 2
    assert sliding.shape(32) == (100 * 10, 32, 1, 256)
    assert full.shape(32) == (30 * 2, 32, 1, 512)  # never forced to one array shape
    state = swajax.pool.init_state(layout)
    assert [p.shape for p in state.pools] == [(1000, 32, 1, 256), (60, 32, 1, 512)]
    assert all(p.dtype == jnp.bfloat16 for p in state.pools)
    # converters: layer_offset = 2j + role, V = K + 1; readers use their writer's converter
    assert layout.converter(3, 0) == swajax.pool.Converter(0, 10, 6)
    assert layout.converter(3, 1) == swajax.pool.Converter(0, 10, 7)
    assert layout.converter(5, 0) == swajax.pool.Converter(0, 10, 8)
    assert layout.converter(7, 1) == layout.converter(5, 1)
    assert layout.converter(9, 0) == swajax.pool.Converter(1, 2, 0)
    assert layout.layer_table_index(8) == (0, 4)
    assert int(layout.converter(3, 0).page(7)) == 76 and int(layout.converter(3, 0).page(-1)) == -1
    # slot bytes: one block of K and V of every layer of the pool, bf16 = 2 bytes
    assert layout.slot_bytes(0) == 5 * 2 * 32 * 256 * 2
    assert layout.slot_bytes(1) == 1 * 2 * 32 * 512 * 2
    hash(layout)  # static jit argument
    # scratch descriptors sized for chunk 256 = 8 blocks: ceil(8 * 2 / 10) = 2 slots
    assert layout.groups[0].scratch_slots == 2 and layout.groups[1].scratch_slots == 0


def test_shared_kv_reader_between_writers_raises():
    specs = [S(64, 1, 8, 0), S(64, 1, 8, 1), S(64, 1, 8, kv_source=0), S(64, 1, 8, 3)]
    cfg = swajax.KVCacheConfig(enable_swa_scratch_reuse=True)
    with pytest.raises(ValueError, match=r"layers \[1\] of the same pool write scratch"):
        swajax.pool.make_layout(specs, cfg, max_context=256, max_batch=1, num_slots=4)
    # a writer of another pool (other geometry) in between is harmless
    specs = [S(64, 1, 8, 0), S(64, 2, 8, 1), S(64, 1, 8, kv_source=0)]
    swajax.pool.make_layout(specs, cfg, max_context=256, max_batch=1, num_slots=4)
    # full layers never use scratch
    specs = [S(None, 1, 8, 0), S(None, 1, 8, 1), S(None, 1, 8, kv_source=0)]
    swajax.pool.make_layout(specs, cfg, max_context=256, max_batch=1, num_slots=4)


@pytest.mark.parametrize(
    "specs, match",
    [
        ([S(64, 1, 8, 1)], "kv_source must be an earlier layer"),
        ([S(64, 1, 8, 0), S(64, 1, 8, 0), S(64, 1, 8, 1)], "itself reads layer 0"),
        ([S(64, 1, 8, 0), S(64, 2, 8, 0)], "differs in"),
        ([S(64, 1, 8, 0), S(32, 1, 8, 0)], "differs in"),
        ([], "at least one layer"),
    ],
)
def test_bad_specs(specs, match):
    with pytest.raises(ValueError, match=match):
        swajax.pool.make_layout(specs, max_context=64, max_batch=1, num_slots=1)


def test_make_layout_argument_errors():
    specs = [S(64, 1, 8, 0)]
    with pytest.raises(ValueError, match="max_batch must be an int >= 1"):
        swajax.pool.make_layout(specs, max_context=64, num_slots=1)
    with pytest.raises(ValueError, match="max_context"):
        swajax.pool.make_layout(specs, max_context=0, max_batch=1, num_slots=1)
    with pytest.raises(ValueError, match="num_slots must give one count per pool group"):
        swajax.pool.make_layout(specs, max_context=64, max_batch=1, num_slots=(1, 2))
    with pytest.raises(ValueError, match=r"num_slots\[0\] must be an int >= 1"):
        swajax.pool.make_layout(specs, max_context=64, max_batch=1, num_slots=0)
    layout = swajax.pool.make_layout(
        specs, swajax.KVCacheConfig(max_batch=3), max_context=64, num_slots=1
    )
    assert layout.max_batch == 3


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(page_size=0), "page_size must be an int >= 1"),
        (dict(max_gpu_total_bytes=-5), "max_gpu_total_bytes"),
        (dict(free_gpu_memory_fraction=1.5), r"free_gpu_memory_fraction must be in \(0, 1\]"),
        (dict(pool_ratio=(1.0, -1.0)), "pool_ratio"),
        (dict(pool_ratio="a"), "pool_ratio"),
        (dict(dtype=jnp.int8), "dtype must be one of"),
        (dict(dtype=jnp.float16), "dtype must be one of"),
        (dict(max_rewind=-1), "max_rewind must be an int >= 0"),
        (dict(page_table_mode="global"), "page_table_mode must be one of"),
        (dict(enable_swa_scratch_reuse="yes"), "enable_swa_scratch_reuse"),
        (dict(chunk_size=0), "chunk_size"),
        (dict(max_batch=0), "max_batch"),
    ],
)
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        swajax.KVCacheConfig(**kwargs)


@pytest.mark.parametrize("dtype", ["bfloat16", jnp.float32, jnp.float8_e4m3fn])
def test_kv_dtypes(dtype):
    cfg = swajax.KVCacheConfig(dtype=dtype, page_size=16)
    hash(cfg)
    layout = swajax.pool.make_layout(
        [S(32, 2, 8, 0)], cfg, max_context=64, max_batch=1, num_slots=3
    )
    state = swajax.pool.init_state(layout, k_scales=0.5)
    assert state.pools[0].dtype == jnp.dtype(dtype)
    assert state.k_scales.dtype == jnp.float32 and state.k_scales.tolist() == [0.5]
    assert state.v_scales.tolist() == [1.0]
    itemsize = jnp.dtype(dtype).itemsize
    assert layout.slot_bytes(0) == 2 * 16 * 2 * 8 * itemsize


def test_scratch_policy():
    r = swajax.pool.resolve_scratch_policy
    none, on, off = (
        swajax.KVCacheConfig(),
        swajax.KVCacheConfig(enable_swa_scratch_reuse=True),
        swajax.KVCacheConfig(enable_swa_scratch_reuse=False),
    )
    assert r(none) is True
    assert r(none, is_multimodal=True) is False
    assert r(none, has_external_kv_draft=True) is False
    assert r(none, backend_supports_per_layer=False) is False
    assert r(swajax.KVCacheConfig(page_table_mode="shared")) is False
    assert r(off) is False
    assert r(off, backend_supports_per_layer=False) is False  # explicit False always wins
    assert r(on, is_multimodal=True) is True
    with pytest.raises(ValueError, match="'flash-shared' cannot express scratch rotation"):
        r(on, backend_supports_per_layer=False, backend_name="flash-shared")
    shared_on = dataclasses.replace(on, page_table_mode="shared")
    with pytest.raises(ValueError, match="page_table_mode='shared'"):
        r(shared_on)
    with pytest.raises(ValueError, match="page_table_mode='shared'"):
        swajax.pool.make_layout(
            [S(32, 1, 8, 0)], shared_on, max_context=64, max_batch=1, num_slots=1
        )
    with pytest.raises(ValueError, match="per_layer"):
        swajax.pool.make_layout(
            [S(32, 1, 8, 0)],
            swajax.KVCacheConfig(page_table_mode="shared"),
            max_context=64,
            max_batch=1,
            num_slots=1,
            scratch=True,
        )


def test_shared_page_table_mode_matches_per_layer():
    specs = [S(None, 1, 8, 0), S(48, 1, 8, 1), S(None, 1, 8, 2), S(48, 1, 8, 3), S(48, 1, 8, 1)]
    tables = {}
    for mode in ("per_layer", "shared"):
        cfg = swajax.KVCacheConfig(
            page_size=16, page_table_mode=mode, enable_swa_scratch_reuse=False
        )
        layout = swajax.pool.make_layout(specs, cfg, max_context=160, max_batch=2, num_slots=40)
        ok, state = swajax.pool.reserve(
            layout, swajax.pool.init_state(layout), np.array([100, 7], np.int32)
        )
        assert ok
        t = swajax.pool.step_page_tables(layout, state)
        if mode == "shared":
            assert [x.shape[0] for x in t] == [1, 1]
        tables[mode] = [
            np.asarray(swajax.pool.layer_page_table(layout, t, layer))
            for layer in range(len(specs))
        ]
    for a, b in zip(tables["per_layer"], tables["shared"], strict=True):
        chex.assert_trees_all_equal(a, b)


def test_state_is_a_pytree():
    layout = swajax.pool.make_layout(
        [S(32, 1, 8, 0), S(None, 1, 8, 1)], max_context=64, max_batch=2, num_slots=5
    )
    state = swajax.pool.init_state(layout)
    leaves, treedef = jax.tree.flatten(state)
    assert all(isinstance(x, jax.Array) for x in leaves)
    again = jax.tree.unflatten(treedef, leaves)
    assert isinstance(again, swajax.pool.KVPoolState)
    with pytest.raises(dataclasses.FrozenInstanceError):
        state.history = None
