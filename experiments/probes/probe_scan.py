"""Does the compiled step copy a pool root, with the layers scanned and unrolled? (GPU probe)

    PYTHONPATH=. python3 experiments/probes/probe_scan.py gemma3_4b

A preset shrunk by `gemma.configs.small_preset` (its attention geometry kept), bf16 weights and
KV, the Pallas kernels, a 1 GiB pool: for the prefill and decode steps, prints the compiled
memory analysis (arguments, temporaries, aliased bytes) and the `copy` instructions whose result
has a pool root's shape. Every pool root aliased and no such copy: the pools, carried through
the scan over layers and written by kv_write, are updated in place.
"""

import sys

import jax.numpy as jnp
from flax import nnx

import gemma
import swajax


def main(name: str) -> None:
    for scan in (True, False):
        config = gemma.configs.small_preset(name)
        model = gemma.Transformer(
            config,
            rngs=nnx.Rngs(0),
            dtype=jnp.bfloat16,
            param_dtype=jnp.bfloat16,
            scan_layers=scan,
        )
        kv = swajax.KVCacheConfig(page_size=32, dtype=jnp.bfloat16, max_gpu_total_bytes=1 << 30)
        engine = swajax.Engine(
            model, kv, max_context=4096, max_batch=8, max_num_tokens=2048, implementation="pallas"
        )
        shapes = {f"bf16[{','.join(map(str, p.shape))}]" for p in engine.state.pools}
        for decode, num_tokens in ((False, 2048), (True, 8)):
            compiled = engine.lower_step(num_tokens, decode=decode).compile()
            copies = [
                line.strip()[:160]
                for line in compiled.as_text().splitlines()
                if " copy(" in line and any(f"= {s}" in line for s in shapes)
            ]
            m = compiled.memory_analysis()
            mib = 1 << 20
            print(
                f"{name} scan={scan} decode={decode} "
                f"pool {engine.layout.pool_bytes() / mib:.0f} MiB, "
                f"arguments {m.argument_size_in_bytes / mib:.0f} MiB, "
                f"temporaries {m.temp_size_in_bytes / mib:.0f} MiB, "
                f"aliased {m.alias_size_in_bytes / mib:.0f} MiB, pool copies {len(copies)}",
                flush=True,
            )
            for line in copies[:6]:
                print("   ", line)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "gemma3_4b")
