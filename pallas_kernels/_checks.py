"""Trace-time validation shared by the paged attention and KV write entry points.

Axis names: T packed new tokens, B sequences of the batch, NB blocks per page table row,
P pages of the pool root, S page_size, Hq query heads, Hkv KV heads, D head_dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels._contract import BAD  # noqa: F401  (re-exported for the kernels)

POOL_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32, jnp.float8_e4m3fn)
IMPLEMENTATIONS = ("auto", "reference", "pallas")


def is_fp8(dtype) -> bool:
    return jnp.dtype(dtype) == jnp.dtype(jnp.float8_e4m3fn)


def check_implementation(implementation: str) -> None:
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")


def on_gpu() -> bool:
    """True when the default device is a GPU."""
    try:
        return jax.devices()[0].platform == "gpu"
    except RuntimeError:
        return False


def on_hopper() -> bool:
    """True when the default device is an sm90 (Hopper) GPU."""
    try:
        dev = jax.devices()[0]
    except RuntimeError:
        return False
    if dev.platform != "gpu":
        return False
    cc = getattr(dev, "compute_capability", None)
    return cc is not None and str(cc).split(".")[0] == "9"


def _shape(x, name: str, ndim: int, what: str) -> tuple[int, ...]:
    shape = getattr(x, "shape", None)
    if shape is None or len(shape) != ndim:
        raise ValueError(f"{name} must have shape {what}, got shape {shape}")
    return tuple(shape)


def _int32(x, name: str) -> None:
    if jnp.dtype(x.dtype) != jnp.dtype(jnp.int32):
        raise TypeError(f"{name} must be int32, got {x.dtype}")


def check_pool(pool, page_table, kv_lens):
    """Checks pool root, page table and kv_lens; returns (P, S, Hkv, D, B, NB)."""
    num_pages, page_size, num_kv_heads, head_dim = _shape(
        pool, "pool", 4, "[num_pages, page_size, num_kv_heads, head_dim]"
    )
    if jnp.dtype(pool.dtype) not in [jnp.dtype(d) for d in POOL_DTYPES]:
        raise TypeError(
            f"pool dtype must be one of bfloat16, float16, float32, float8_e4m3fn, got {pool.dtype}"
        )
    if min(num_pages, page_size, num_kv_heads, head_dim) <= 0:
        raise ValueError(f"pool dimensions must be positive, got {pool.shape}")
    batch, two, max_blocks = _shape(page_table, "page_table", 3, "[batch, 2, max_blocks]")
    if two != 2:
        raise ValueError(f"page_table axis 1 must be 2 (K, V roles), got {page_table.shape}")
    _int32(page_table, "page_table")
    if _shape(kv_lens, "kv_lens", 1, "[batch]") != (batch,):
        raise ValueError(f"kv_lens must have shape [{batch}], got {kv_lens.shape}")
    _int32(kv_lens, "kv_lens")
    return num_pages, page_size, num_kv_heads, head_dim, batch, max_blocks


def check_q_starts(q_starts, batch: int) -> None:
    if _shape(q_starts, "q_starts", 1, "[batch + 1]") != (batch + 1,):
        raise ValueError(f"q_starts must have shape [{batch + 1}], got {q_starts.shape}")
    _int32(q_starts, "q_starts")


def check_heads(q_heads: int, num_kv_heads: int) -> int:
    if q_heads % num_kv_heads:
        raise ValueError(
            f"query heads ({q_heads}) must be a multiple of the pool's KV heads ({num_kv_heads})"
        )
    return q_heads // num_kv_heads


def check_attention_params(scale, window, softcap) -> None:
    if not isinstance(scale, (int, float)) or isinstance(scale, bool):
        raise TypeError(f"scale must be a static Python float, got {type(scale).__name__}")
    if window is not None and (
        not isinstance(window, (int, np.integer)) or isinstance(window, bool) or window <= 0
    ):
        raise ValueError(f"window must be a positive int or None, got {window!r}")
    if softcap is not None and (not isinstance(softcap, (int, float)) or softcap <= 0):
        raise ValueError(f"softcap must be a positive float or None, got {softcap!r}")


def kv_scales(pool, k_scale, v_scale):
    """The (K, V) dequantisation scales as float32 scalars (1.0 where not given)."""

    def one(s, name):
        if s is None:
            return jnp.float32(1.0)
        s = jnp.asarray(s)
        if s.size != 1:
            raise ValueError(f"{name} must be a scalar, got shape {s.shape}")
        return s.reshape(()).astype(jnp.float32)

    return one(k_scale, "k_scale"), one(v_scale, "v_scale")


_FORCED_MODE = [None]


class _forced_mode:
    mode: str

    def __enter__(self):
        self._prev = _FORCED_MODE[0]
        _FORCED_MODE[0] = self.mode

    def __exit__(self, *exc):
        _FORCED_MODE[0] = self._prev


class force_compiled(_forced_mode):
    """Context manager: trace Mosaic GPU kernels for the compiled backend even off-GPU.

    Lets `jax.jit(...).trace(...).lower(lowering_platforms=("cuda",))` build the Mosaic GPU
    module on a CPU-only machine, which checks the kernel's lowering without a GPU.
    """

    mode = "compiled"


class force_interpret(_forced_mode):
    """Context manager: run Mosaic GPU kernels in GPU interpret mode even on a GPU."""

    mode = "interpret"


def kernels_forced() -> bool:
    """Whether a `force_compiled` / `force_interpret` context is active: "auto" dispatchers
    that follow it (`stacked_matmul`) then pick their Mosaic kernel as on a Hopper GPU, so a
    whole model step lowers for CUDA, or runs interpreted, with it."""
    return _FORCED_MODE[0] is not None


def interpret_params():
    """GPU interpret mode (race detection on) off-Hopper or under `force_interpret`, else None."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    mode = _FORCED_MODE[0]
    if mode == "compiled" or (mode is None and on_hopper()):
        return None
    return plgpu.InterpretGPUParams(detect_races=True)
