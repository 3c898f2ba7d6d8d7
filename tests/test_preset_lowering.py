"""Every preset's attention geometry through the whole Mosaic GPU lowering, on CPU.

Under `_checks.force_compiled()`, `jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))`
builds the Mosaic GPU modules as a GPU compile would, TMA box limits and the shared-memory limit
(227 KiB, the H100 / H200 value) included, so a kernel that cannot compile for a preset fails
here, in CI. Lowering does not run ptxas: register and run-time faults need the `gpu` tests.

The geometries come from `gemma.configs.attention_geometries()` and the models from
`gemma.configs.small_preset` (width, MLP and vocabulary shrunk, attention geometry kept), never
from a hand-written list.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from gemma import configs
from pallas_kernels import _checks
from pallas_kernels.kv_write import kv_write
from pallas_kernels.paged_attention import paged_decode_attention, ragged_paged_attention

GEOMETRIES = configs.attention_geometries()
POOL_DTYPES = {"bf16": jnp.bfloat16, "fp8": jnp.float8_e4m3fn}
PAGE_SIZES = [16, 32, 64]


def _distinct(key) -> list:
    """One geometry per distinct value of key(geometry): the kernels' code depends on no more."""
    seen = {}
    for g in GEOMETRIES:
        seen.setdefault(key(g), g)
    return list(seen.values())


# The decode kernel depends on head_dim, the GQA group (its query tile) and whether there is a
# window; prefill (one query head per CUDA block) on head_dim and window; kv_write on the row.
DECODE = _distinct(lambda g: (g.head_dim, g.group, g.window is None))
PREFILL = _distinct(lambda g: (g.head_dim, g.window is None))
KV_WRITE = _distinct(lambda g: (g.num_kv_heads, g.head_dim))
BATCH, NUM_TOKENS, MAX_BLOCKS = 4, 96, 64


def lower_for_cuda(f, *args) -> str:
    with _checks.force_compiled():
        return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _args(g, pool_dtype, page_size):
    sds = jax.ShapeDtypeStruct
    return dict(
        q=sds((NUM_TOKENS, g.num_q_heads, g.head_dim), jnp.bfloat16),
        kv=sds((NUM_TOKENS, g.num_kv_heads, g.head_dim), jnp.bfloat16),
        pool=sds((2 * BATCH * MAX_BLOCKS, page_size, g.num_kv_heads, g.head_dim), pool_dtype),
        page_table=sds((BATCH, 2, MAX_BLOCKS), jnp.int32),
        q_starts=sds((BATCH + 1,), jnp.int32),
        kv_lens=sds((BATCH,), jnp.int32),
    )


def _attention(g, pool_dtype):
    kw = dict(scale=g.scale, window=g.window, softcap=g.softcap, implementation="pallas")
    if pool_dtype == jnp.float8_e4m3fn:
        kw.update(k_scale=jnp.float32(0.5), v_scale=jnp.float32(0.25))
    return kw


def _ids(geometries):
    return [f"{g.id}-{'+'.join(g.presets)}" for g in geometries]


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("dtype", sorted(POOL_DTYPES))
@pytest.mark.parametrize("geometry", DECODE, ids=_ids(DECODE))
def test_decode_kernel_lowers_for_cuda(geometry, dtype, page_size):
    a = _args(geometry, POOL_DTYPES[dtype], page_size)
    kw = _attention(geometry, POOL_DTYPES[dtype])

    def f(q, pool, page_table, kv_lens):
        return paged_decode_attention(q[:BATCH], pool, page_table, kv_lens, **kw)

    assert "mosaic_gpu" in lower_for_cuda(f, a["q"], a["pool"], a["page_table"], a["kv_lens"])


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("dtype", sorted(POOL_DTYPES))
@pytest.mark.parametrize("geometry", PREFILL, ids=_ids(PREFILL))
def test_prefill_kernel_lowers_for_cuda(geometry, dtype, page_size):
    a = _args(geometry, POOL_DTYPES[dtype], page_size)
    kw = _attention(geometry, POOL_DTYPES[dtype])

    def f(q, pool, page_table, q_starts, kv_lens):
        return ragged_paged_attention(q, pool, page_table, q_starts, kv_lens, **kw)

    args = (a["q"], a["pool"], a["page_table"], a["q_starts"], a["kv_lens"])
    assert "mosaic_gpu" in lower_for_cuda(f, *args)


@pytest.mark.parametrize("dtype", sorted(POOL_DTYPES))
@pytest.mark.parametrize("geometry", KV_WRITE, ids=_ids(KV_WRITE))
def test_kv_write_kernel_lowers_for_cuda(geometry, dtype):
    a = _args(geometry, POOL_DTYPES[dtype], 32)
    scales = {}
    if dtype == "fp8":
        scales = dict(k_scale=jnp.float32(0.5), v_scale=jnp.float32(0.25))

    def f(kv, pool, page_table, q_starts, kv_lens):
        return kv_write(
            pool, page_table, kv, kv, q_starts, kv_lens, implementation="pallas", **scales
        )

    args = (a["kv"], a["pool"], a["page_table"], a["q_starts"], a["kv_lens"])
    assert "mosaic_gpu" in lower_for_cuda(f, *args)


@pytest.mark.parametrize("name", configs.PRESET_NAMES)
def test_engine_steps_lower_for_cuda(name):
    """A whole prefill step and decode step of every preset (small_preset: the real attention
    geometry, KV sharing, K=V, PLE and MoE) lower for CUDA with the Pallas kernels: kv_write,
    prefill, decode, the page-table gather, (MoE) the grouped matmul, and in the decode step
    the stacked matmul reading the scanned layers' matrices in their stacks; scratch reuse on
    and a chunk over the window."""
    from flax import nnx

    import gemma
    import swajax

    config = configs.small_preset(name)
    model = gemma.Transformer(
        config,
        rngs=nnx.Rngs(0),
        dtype=jnp.bfloat16,
        param_dtype=jnp.bfloat16,
        moe_implementation="pallas",
    )
    chunk = 2 * config.sliding_window
    kv = swajax.KVCacheConfig(page_size=32, max_gpu_total_bytes=64 << 20)
    engine_kw = dict(
        max_context=4 * chunk, max_batch=4, prefill_chunk_size=chunk, implementation="pallas"
    )
    engine = swajax.Engine(model, kv, **engine_kw)
    assert engine.layout.scratch
    for num_tokens, decode in ((chunk, False), (8, True)):
        with _checks.force_compiled():
            lowered = engine.lower_step(num_tokens, decode=decode, lowering_platforms=("cuda",))
        text = lowered.as_text()
        # Each kernel the step must hold, by its source file among the kernels' locations
        # (the page-table gather alone would make any "mosaic_gpu" test pass).
        attention = "_decode_kernel.py" if decode else "_prefill_kernel.py"
        for kernel in ("_kv_write_kernel.py", attention, "page_table_gather.py"):
            assert f"pallas_kernels/{kernel}" in text, (name, decode, kernel)
        if config.num_experts and any(r.scanned for r in config.layer_runs):
            # the scanned layers' experts read in their stack by the tile kernel (its source
            # file in the kernels' locations; JAX's ragged_dot_mgpu has its own)
            assert "grouped_matmul.py" in text, (name, decode)
        if decode and any(r.scanned for r in config.layer_runs):
            assert "pallas_kernels/stacked_matmul.py" in text, name
