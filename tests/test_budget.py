"""Budget: Q(T), the slot split, the quota, per-sequence bytes — hand-computed cases, and the
step simulation cross-checked against the jnp transforms."""

import dataclasses

import numpy as np
import pytest

import gemma
import swajax
from swajax import _budget

S = gemma.LayerSpec
# 3 sliding layers (W = 40) and 1 full layer, 1 KV head x 8 dims, bf16: 32 bytes per token and
# layer (K + V). tpb 16: sliding slot = 3 * 16 * 32 = 1536 B, full slot = 512 B. A decoding
# row's window spans 3 or 4 blocks, (40 + 15) / 16 on average: R_w = 55 tokens * 96 B = 5280 B.
SPECS = [S(40, 1, 8, 0), S(40, 1, 8, 1), S(None, 1, 8, 2), S(40, 1, 8, 3)]


def layout(max_context=4096, max_batch=2, scratch=True, num_slots=1, **cfg):
    config = swajax.KVCacheConfig(
        page_size=16, chunk_size=256, enable_swa_scratch_reuse=scratch, **cfg
    )
    return swajax.pool.make_layout(
        SPECS, config, max_context=max_context, max_batch=max_batch, num_slots=num_slots
    )


def test_slot_bytes():
    lay = layout()
    assert [g.window for g in lay.groups] == [40, None]
    assert (lay.slot_bytes(0), lay.slot_bytes(1)) == (1536, 512)


def test_quota_for_tokens_by_hand():
    # T = 1000, B = 4, M = 256. F_full = 32 B/token, F_sliding = 96 B/token.
    # full: 1000 * 32 = 32000. sliding without scratch: 256 * 96 + 4 * 5280 = 45696;
    # with scratch the chunk costs one layer: 256 * 32 + 21120 = 29312.
    lay = layout()
    assert _budget.group_demands(lay, 1000, 4, 256, scratch=False) == (45696, 32000)
    assert swajax.pool.quota_for_tokens(lay, 1000, 4, 256, scratch=False) == 77696
    assert swajax.pool.quota_for_tokens(lay, 1000, 4, 256, scratch=True) == 61312
    assert (
        swajax.pool.quota_for_tokens(lay, 100, 4, 256, scratch=True) == 100 * 32 + 100 * 32 + 21120
    )


@pytest.mark.parametrize("rewind", [0, 20])
def test_window_term_is_what_a_decoding_row_holds(rewind):
    """R_w is what the ledger holds for a decoding row's window after each step's reserve,
    averaged over the tpb positions of its history in a block: W + rewind + tpb - 1 tokens."""
    lay = layout(max_batch=1, scratch=False, num_slots=10_000, max_rewind=rewind)
    ledger = swajax.pool.SlotLedger(lay)
    assert ledger.reserve({0: 300})
    ledger.advance()
    held = []
    for _ in range(64):
        assert ledger.reserve({0: 1})
        held.append(ledger.row_slots(0)[0])
        ledger.advance()
    assert sum(held) == 4 * (40 + rewind + 15)  # 64 steps: each of 16 positions 4 times
    assert _budget.group_demands(lay, 0, 1, 256)[0] == (40 + rewind + 15) * 96


def test_pinned_ratio_split():
    cfg = swajax.KVCacheConfig(page_size=16, max_gpu_total_bytes=100_000, pool_ratio=(1, 3))
    lay = swajax.pool.make_layout(SPECS, cfg, max_context=4096, max_batch=2)
    # sliding: 25000 // 1536 = 16 slots; full: 75000 // 512 = 146 slots
    assert [g.num_slots for g in lay.groups] == [16, 146]
    assert lay.pool_bytes() <= 100_000
    with pytest.raises(ValueError, match="pool_ratio must give one weight per pool group"):
        swajax.pool.make_layout(
            SPECS, dataclasses.replace(cfg, pool_ratio=(1.0,)), max_context=4096, max_batch=2
        )


def test_default_ratio_moves_bytes_to_full_with_scratch():
    cfg = dict(
        page_size=16,
        max_gpu_total_bytes=1_000_000,
        expected_input_length=250,
        expected_batch_size=4,
        chunk_size=256,
    )
    slots = {}
    for scratch in (False, True):
        c = swajax.KVCacheConfig(enable_swa_scratch_reuse=scratch, **cfg)
        lay = swajax.pool.make_layout(SPECS, c, max_context=8192, max_batch=4)  # no group capped
        # shares of Q for T = 1000, B = 4, M = 256 (see test_quota_for_tokens_by_hand)
        sliding_q = 45696 if not scratch else 29312
        share = sliding_q / (sliding_q + 32000)
        assert lay.groups[0].num_slots == int(1_000_000 * share) // 1536
        assert lay.groups[1].num_slots == int(1_000_000 * (1 - share)) // 512
        slots[scratch] = [g.num_slots for g in lay.groups]
    assert slots[True][1] > slots[False][1]  # scratch frees sliding bytes for full history


def test_cap_and_redistribute():
    # max_context 256 (16 blocks), 2 rows: full can hold at most 2 * 16 = 32 slots
    cfg = swajax.KVCacheConfig(page_size=16, max_gpu_total_bytes=1_000_000, chunk_size=64)
    lay = swajax.pool.make_layout(SPECS, cfg, max_context=256, max_batch=2)
    s_sliding = lay.groups[0].scratch_slots
    assert lay.groups[1].num_slots == 32
    assert lay.groups[0].num_slots == 2 * (16 + s_sliding)  # capped too: bytes to spare
    # pinned: capped, not redistributed
    lay = swajax.pool.make_layout(
        SPECS, dataclasses.replace(cfg, pool_ratio=(1, 50)), max_context=256, max_batch=2
    )
    assert [g.num_slots for g in lay.groups] == [int(1_000_000 / 51) // 1536, 32]


def test_quota_too_small_raises():
    cfg = swajax.KVCacheConfig(page_size=16, max_gpu_total_bytes=1000)
    with pytest.raises(ValueError, match="KV quota of 1000 bytes gives pool group 0"):
        swajax.pool.make_layout(SPECS, cfg, max_context=256, max_batch=2)


def test_kv_quota_bytes(monkeypatch):
    monkeypatch.setattr(_budget, "device_free_bytes", lambda device=None: 10_000)
    kq = swajax.pool.kv_quota_bytes
    assert kq(swajax.KVCacheConfig(max_gpu_total_bytes=123)) == 123
    assert kq(swajax.KVCacheConfig(free_gpu_memory_fraction=0.5)) == 5000
    assert kq(swajax.KVCacheConfig(free_gpu_memory_fraction=0.5, max_gpu_total_bytes=99)) == 99
    assert kq(swajax.KVCacheConfig()) == int(_budget.DEFAULT_FREE_MEMORY_FRACTION * 10_000)


def test_device_free_bytes_cpu_fallback():
    free = _budget.device_free_bytes()
    assert 0 < free
    import jax

    if jax.devices()[0].platform == "cpu":
        assert free <= _budget.CPU_FREE_BYTES_CAP


def test_kv_bytes_per_sequence_by_hand():
    # L = 128 tokens, one chunk of 128. full: 8 blocks in both groups.
    # release: sliding holds 8 blocks during the step, then stale(128) = [0, 5) -> 3 blocks.
    # scratch: R = [0, 5) -> ceil(5 * 2 / 6) = 2 scratch slots + normal blocks 5..7.
    full_bytes = 8 * 512
    cfg = swajax.KVCacheConfig(page_size=16)

    def kb(*args, kv_cache_config=cfg):
        return swajax.pool.kv_bytes_per_sequence(*args, kv_cache_config=kv_cache_config)

    assert kb(SPECS, 128, 128, "full") == (8 * 1536 + full_bytes, 8 * 1536 + full_bytes)
    assert kb(SPECS, 128, 128, "release") == (3 * 1536 + full_bytes, 8 * 1536 + full_bytes)
    assert kb(SPECS, 128, 128, "scratch") == (3 * 1536 + full_bytes, 5 * 1536 + full_bytes)
    # two chunks of 64: step 1 holds blocks 0..3 (peak 4), releases block 0; step 2 adds 4..7
    # (peak 7), then keeps 5..7.
    assert kb(SPECS, 128, 64, "release") == (3 * 1536 + full_bytes, 7 * 1536 + full_bytes)
    with pytest.raises(ValueError, match="mode must be one of"):
        kb(SPECS, 128, 64, "none")
    # A scratch-off layout cannot answer for scratch (its descriptors hold no range).
    with pytest.raises(ValueError, match="scratch off"):
        swajax.pool.kv_bytes_per_sequence(layout(scratch=False), 128, 128, "scratch")
    # fp8: one byte per element
    fp8 = swajax.KVCacheConfig(page_size=16, dtype="float8_e4m3fn")
    assert kb(SPECS, 128, 128, "full", kv_cache_config=fp8) == (
        (8 * 1536 + full_bytes) // 2,
        (8 * 1536 + full_bytes) // 2,
    )


@pytest.mark.parametrize("scratch", [False, True])
def test_request_slots_match_the_transforms(scratch):
    """The Python simulation and the jnp transforms agree on the slots one request holds."""
    lay = layout(max_context=512, max_batch=1, scratch=scratch, num_slots=200)
    input_len, chunk, new = 300, 96, 5
    peak = swajax.pool.request_slots(lay, input_len, chunk=chunk, max_new_tokens=new)
    state = swajax.pool.init_state(lay)
    most = np.zeros(2, int)
    for n in [96, 96, 96, 12] + [1] * new:
        ok, state = swajax.pool.reserve(lay, state, np.array([n], np.int32))
        assert ok
        most = np.maximum(most, 200 - np.asarray(state.free_count))
        state = swajax.pool.advance(lay, state)
    assert tuple(most.tolist()) == peak
    steady = swajax.pool.kv_bytes_per_sequence(lay, input_len + new, chunk, "full")
    assert steady.steady == ((input_len + new + 15) // 16) * (1536 + 512)


def test_default_split_holds_the_longest_request():
    """Hints for short inputs give the full group less than one max_context request holds
    (4095 tokens stored: 256 blocks of 16); the default split raises it to that, the bytes taken
    from the sliding group, and a ledger of the layout runs such a request alone. A quota too
    small for one such request keeps the hint split (the request's own check reports it)."""
    cfg = swajax.KVCacheConfig(
        page_size=16,
        max_gpu_total_bytes=400_000,
        expected_input_length=64,
        expected_batch_size=4,
        chunk_size=256,
        enable_swa_scratch_reuse=True,
    )
    lay = swajax.pool.make_layout(SPECS, cfg, max_context=4096, max_batch=4)
    # the hints' share: full 256 * 32 B against sliding 256 * 32 + 4 * 5280 (scratch ON)
    share = 8192 / (8192 + 29312)
    assert int(400_000 * share) // 512 == 170 < 256
    full, sliding = lay.groups[1].num_slots, lay.groups[0].num_slots
    assert full >= 256 and lay.pool_bytes() <= 400_000
    assert sliding == (400_000 - full * 512) // 1536  # the rest, all of it to the sliding group
    ledger = swajax.pool.SlotLedger(lay)
    for start in range(0, 4095, 256):
        assert ledger.reserve({0: min(256, 4095 - start)}), start
        ledger.advance()
    assert ledger.row_slots(0)[1] == 256
    small = swajax.pool.make_layout(
        SPECS, dataclasses.replace(cfg, max_gpu_total_bytes=100_000), max_context=4096, max_batch=4
    )
    assert small.groups[1].num_slots == int(100_000 * share) // 512
