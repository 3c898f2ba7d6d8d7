"""The user-facing KV-cache configuration (`KVCacheConfig`) and the scratch-reuse policy.

`KVCacheConfig` holds the user's choices only; everything derived from a model (life cycles,
pools, converters, slot counts) lives in the layout (`swajax._layout.KVLayout`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import ml_dtypes
import numpy as np

KV_DTYPES = ("bfloat16", "float32", "float8_e4m3fn")
PAGE_TABLE_MODES = ("per_layer", "shared")
ADAPTIVE = "adaptive"  # pool_ratio mode: the split follows the queued requests (while idle)
ONLINE = "online"  # pool_ratio mode: the split follows the observed slot demand (between steps)
POOL_RATIO_MODES = (ADAPTIVE, ONLINE)


def _positive_int(name: str, value, *, allow_none: bool = True, minimum: int = 1) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class KVCacheConfig:
    """User settings of the paged KV cache (frozen, hashable).

    Attributes:
      page_size: tokens per block (tpb); 16, 32 and 64 are the tested sizes.
      max_gpu_total_bytes: byte quota of all pool roots together, or None. With a mesh
        (`Engine(..., mesh=)`) the quota is per device: the pool roots' shards on one device.
      free_gpu_memory_fraction: fraction in (0, 1] of the device's free memory to use for pool
        roots, or None. With both set the quota is the smaller of the two; with neither,
        `DEFAULT_FREE_MEMORY_FRACTION` of free memory. On a device without memory statistics (CPU)
        "free memory" is the host's available memory capped at `CPU_FREE_BYTES_CAP` (see
        `swajax._budget.device_free_bytes`).
      pool_ratio: how the quota is split across pool groups.
        - a tuple: pinned, one positive weight per group in layout group order (normalised; the
          byte share of each group);
        - None: derived once from the expected_* hints (docs/design.md "Budget");
        - "adaptive": sized by the engine from the requests actually queued (their prompt +
          max_new_tokens lengths), no hints needed. The split is the one that fits the most
          such requests in the quota (`swajax.fitted_pool_ratio`), snapped to a coarse grid,
          and changed only while the engine is idle (see `swajax.Engine`); the quota stays
          the quota. Before the first request it is the hint default.
      enable_swa_scratch_reuse: None (policy default, see `resolve_scratch_policy`), True, False.
      dtype: KV dtype of every pool root: bfloat16, float32 or float8_e4m3fn (then each pool root
        has float32 K and V scales).
      max_rewind: tokens speculative decoding may roll back; kept in normal pages (never scratch)
        and not released out-of-window until history passes them by that much.
      page_table_mode: "per_layer" (one page table per layer; needed for scratch) or "shared"
        (one table per pool, layers add their layer_offset; no scratch).
      expected_input_length: typical prompt length (tokens) for the default pool ratio.
      expected_batch_size: typical number of sequences for the default pool ratio.
      chunk_size: prefill chunk (tokens per row per step); default ratio hint and the static bound
        of a row's scratch range (a longer chunk keeps its excess in normal pages).
      max_batch: rows of the batch (the layout's batch axis), or None to let the caller decide.
      max_num_tokens: token budget of one engine step (decode rows first, then prefill
        chunks), or None for the engine's default (8192, TensorRT-LLM's default).
    """

    page_size: int = 32
    max_gpu_total_bytes: int | None = None
    free_gpu_memory_fraction: float | None = None
    pool_ratio: tuple[float, ...] | str | None = None
    enable_swa_scratch_reuse: bool | None = None
    dtype: Any = ml_dtypes.bfloat16
    max_rewind: int = 0
    page_table_mode: str = "per_layer"
    expected_input_length: int | None = None
    expected_batch_size: int | None = None
    chunk_size: int | None = None
    max_batch: int | None = None
    max_num_tokens: int | None = None
    rebalance_ema: float = 0.1
    rebalance_threshold: float = 0.1
    rebalance_cooldown: int = 32

    @property
    def adaptive_pool_ratio(self) -> bool:
        """Whether the engine sizes the split (pool_ratio "adaptive" or "online")."""
        return isinstance(self.pool_ratio, str)

    @property
    def online_pool_ratio(self) -> bool:
        """Whether pool_ratio="online": the split follows the observed demand between steps."""
        return self.pool_ratio == ONLINE

    def __post_init__(self):
        _positive_int("page_size", self.page_size, allow_none=False)
        _positive_int("max_gpu_total_bytes", self.max_gpu_total_bytes)
        f = self.free_gpu_memory_fraction
        if f is not None and (
            not isinstance(f, (int, float)) or isinstance(f, bool) or not 0.0 < f <= 1.0
        ):
            raise ValueError(f"free_gpu_memory_fraction must be in (0, 1], got {f!r}")
        if isinstance(self.pool_ratio, str):
            if self.pool_ratio not in POOL_RATIO_MODES:
                raise ValueError(
                    f"pool_ratio must be None, one of {POOL_RATIO_MODES} or a tuple of positive "
                    f"floats (one per pool group), got {self.pool_ratio!r}"
                )
        elif self.pool_ratio is not None:
            ratio = self.pool_ratio
            if isinstance(ratio, (int, float)):
                ratio = (ratio,)
            try:
                ratio = tuple(float(r) for r in ratio)
            except (TypeError, ValueError):
                raise ValueError(
                    f"pool_ratio must be None, one of {POOL_RATIO_MODES} or a tuple of positive "
                    "floats, got "
                    f"{self.pool_ratio!r}"
                ) from None
            if not ratio or any(not math.isfinite(r) or r <= 0 for r in ratio):
                raise ValueError(
                    f"pool_ratio must be a non-empty tuple of positive finite floats, got {ratio!r}"
                )
            object.__setattr__(self, "pool_ratio", ratio)
        if self.enable_swa_scratch_reuse not in (None, True, False):
            raise ValueError(
                "enable_swa_scratch_reuse must be None, True or False, got "
                f"{self.enable_swa_scratch_reuse!r}"
            )
        try:
            dtype = np.dtype(self.dtype)
        except TypeError:
            raise ValueError(f"dtype must be one of {KV_DTYPES}, got {self.dtype!r}") from None
        if dtype.name not in KV_DTYPES:
            raise ValueError(f"dtype must be one of {KV_DTYPES}, got {dtype.name}")
        object.__setattr__(self, "dtype", dtype)
        _positive_int("max_rewind", self.max_rewind, allow_none=False, minimum=0)
        if self.page_table_mode not in PAGE_TABLE_MODES:
            raise ValueError(
                f"page_table_mode must be one of {PAGE_TABLE_MODES}, got {self.page_table_mode!r}"
            )
        _positive_int("expected_input_length", self.expected_input_length)
        _positive_int("expected_batch_size", self.expected_batch_size)
        _positive_int("chunk_size", self.chunk_size)
        _positive_int("max_batch", self.max_batch)
        _positive_int("max_num_tokens", self.max_num_tokens)
        for name, allowed, inside in (
            ("rebalance_ema", "(0, 1]", lambda v: 0.0 < v <= 1.0),
            ("rebalance_threshold", ">= 0", lambda v: v >= 0.0),
        ):
            v = getattr(self, name)
            number = isinstance(v, (int, float)) and not isinstance(v, bool)
            if not number or not math.isfinite(v) or not inside(v):
                raise ValueError(f"{name} must be a float in {allowed}, got {v!r}")
        _positive_int("rebalance_cooldown", self.rebalance_cooldown, allow_none=False)


def resolve_scratch_policy(
    kv_cache_config: KVCacheConfig,
    *,
    is_multimodal: bool = False,
    has_external_kv_draft: bool = False,
    backend_supports_per_layer: bool = True,
    backend_name: str = "the attention backend",
) -> bool:
    """Whether SWA scratch reuse is on (docs/design.md "SWA scratch reuse").

    None -> on for text models whose backend supports per-layer page tables (and
    page_table_mode="per_layer"); off for multimodal configs and external shared-KV draft (MTP)
    configs. An explicit False always wins. An explicit True with a backend (or page_table_mode)
    that cannot express scratch rotation raises ValueError naming it.
    """
    flag = kv_cache_config.enable_swa_scratch_reuse
    if flag is False:
        return False
    if flag is True:
        if not backend_supports_per_layer:
            raise ValueError(
                f"enable_swa_scratch_reuse=True needs per-layer page tables, but {backend_name!r} "
                "cannot express scratch rotation; use enable_swa_scratch_reuse=None or False"
            )
        if kv_cache_config.page_table_mode != "per_layer":
            raise ValueError(
                "enable_swa_scratch_reuse=True needs page_table_mode='per_layer', got "
                f"page_table_mode={kv_cache_config.page_table_mode!r} (one table per pool cannot "
                "express scratch rotation)"
            )
        return True
    return (
        backend_supports_per_layer
        and kv_cache_config.page_table_mode == "per_layer"
        and not is_multimodal
        and not has_external_kv_draft
    )
