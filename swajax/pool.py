"""The KV pool's algebra: layout, state, pure transforms, scratch ranges and the byte budget.

What a researcher extending the pool reads and calls; `swajax` itself keeps the names a user of
the engine needs. The terms (life cycle, slot, converter, BAD, scratch range, rotation) are
those of `docs/design.md`.
"""

from swajax._budget import (
    AdaptiveSplit,
    KVBytes,
    OnlineRebalance,
    adaptive_split,
    fitted_batch,
    fitted_pool_ratio,
    kv_bytes_per_sequence,
    kv_quota_bytes,
    make_layout,
    plan_num_slots,
    quota_for_tokens,
    request_slots,
    rows_held,
)
from swajax._config import resolve_scratch_policy
from swajax._layout import Converter, GroupSpec, KVLayout, PoolSpec
from swajax._ledger import SlotLedger
from swajax._scratch import BAD, rotation_pages, scratch_range, stale_range
from swajax._state import KVPoolState, init_state
from swajax._transforms import (
    StepMetadata,
    adopt,
    advance,
    free_rows,
    free_slots,
    layer_page_table,
    needed_blocks,
    park,
    release_cached,
    reserve,
    resize,
    rewind,
    row_slots,
    slots_needed,
    step_metadata,
    step_page_tables,
)

__all__ = [
    "OnlineRebalance",
    "BAD",
    "AdaptiveSplit",
    "Converter",
    "GroupSpec",
    "KVBytes",
    "KVLayout",
    "KVPoolState",
    "PoolSpec",
    "SlotLedger",
    "StepMetadata",
    "adaptive_split",
    "adopt",
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
    "needed_blocks",
    "park",
    "plan_num_slots",
    "quota_for_tokens",
    "request_slots",
    "release_cached",
    "reserve",
    "resize",
    "resolve_scratch_policy",
    "rewind",
    "rotation_pages",
    "row_slots",
    "rows_held",
    "scratch_range",
    "slots_needed",
    "stale_range",
    "step_metadata",
    "step_page_tables",
]
