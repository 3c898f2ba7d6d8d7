"""Probe: does the compiled step copy a pool root with the layers scanned vs unrolled (GPU)?"""

import re
import sys

import jax
import jax.numpy as jnp
from flax import nnx

import gemma
import swajax

name = sys.argv[1] if len(sys.argv) > 1 else "gemma3_4b"
for scan in (True, False):
    config = gemma.configs.small_preset(name)
    model = gemma.Transformer(
        config, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, scan_layers=scan
    )
    kv = swajax.KVCacheConfig(page_size=32, dtype=jnp.bfloat16, max_gpu_total_bytes=1 << 30)
    engine = swajax.Engine(
        model, kv, max_context=4096, max_batch=8, max_num_tokens=2048, implementation="pallas"
    )
    shapes = {f"bf16[{','.join(map(str, p.shape))}]" for p in engine.state.pools}
    for decode, n in ((False, 2048), (True, 8)):
        compiled = engine.lower_step(n, decode=decode).compile()
        hlo = compiled.as_text()
        copies = [ln.strip()[:160] for ln in hlo.splitlines() if "copy" in ln and any(s in ln for s in shapes)]
        m = compiled.memory_analysis()
        print(
            f"{name} scan={scan} decode={decode} pool_bytes={engine.layout.pool_bytes()/2**20:.0f}MiB "
            f"temp={m.temp_size_in_bytes/2**20:.0f}MiB arg={m.argument_size_in_bytes/2**20:.0f}MiB "
            f"alias={m.alias_size_in_bytes/2**20:.0f}MiB pool_copies={len(copies)}",
            flush=True,
        )
        for c in copies[:6]:
            print("   ", c)
