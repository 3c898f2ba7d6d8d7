"""swajax: a paged KV pool with sliding-window scratch reuse, and generation on it."""

from swajax._spec import LayerRef, LayerSpec

__all__ = ["LayerRef", "LayerSpec"]

# KV memory model: config, layout, state, transforms, scratch, budget.
from swajax._budget import (  # noqa: E402
    AdaptiveSplit,
    KVBytes,
    adaptive_split,
    fitted_batch,
    fitted_pool_ratio,
    kv_bytes_per_sequence,
    kv_quota_bytes,
    plan_num_slots,
    quota_for_tokens,
    request_slots,
    rows_held,
)
from swajax._config import KVCacheConfig, resolve_scratch_policy  # noqa: E402
from swajax._layout import (  # noqa: E402
    Converter,
    GroupSpec,
    KVLayout,
    PoolSpec,
    make_layout,
)
from swajax._scratch import (  # noqa: E402
    BAD,
    rotation_pages,
    scratch_range,
    stale_range,
)
from swajax._state import KVPoolState, init_state  # noqa: E402
from swajax._transforms import (  # noqa: E402
    StepMetadata,
    advance,
    free_rows,
    free_slots,
    layer_page_table,
    reserve,
    row_slots,
    share_prefix,
    slots_needed,
    step_metadata,
    step_page_tables,
)

__all__ += [
    "AdaptiveSplit",
    "BAD",
    "Converter",
    "GroupSpec",
    "KVBytes",
    "KVCacheConfig",
    "KVLayout",
    "KVPoolState",
    "PoolSpec",
    "StepMetadata",
    "adaptive_split",
    "advance",
    "fitted_batch",
    "fitted_pool_ratio",
    "free_rows",
    "free_slots",
    "init_state",
    "kv_bytes_per_sequence",
    "kv_quota_bytes",
    "layer_page_table",
    "make_layout",
    "plan_num_slots",
    "quota_for_tokens",
    "request_slots",
    "rows_held",
    "reserve",
    "resolve_scratch_policy",
    "rotation_pages",
    "row_slots",
    "scratch_range",
    "share_prefix",
    "slots_needed",
    "stale_range",
    "step_metadata",
    "step_page_tables",
]

# Generation on the pool.
from swajax._engine import Engine, RequestOutput, RunStats  # noqa: E402
from swajax._generate import generate  # noqa: E402
from swajax._ledger import SlotLedger  # noqa: E402
from swajax._sampling import SamplingParams  # noqa: E402
from swajax._scheduler import Request, Scheduler, StepPlan  # noqa: E402
from swajax._text import TextChunk, TextOutput, generate_text  # noqa: E402

__all__ += [
    "Engine",
    "Request",
    "RequestOutput",
    "RunStats",
    "SamplingParams",
    "Scheduler",
    "SlotLedger",
    "StepPlan",
    "TextChunk",
    "TextOutput",
    "generate",
    "generate_text",
]
