"""`SlotLedger` (host) against the pool transforms (device) on random schedules.

The scheduler decides every step from the ledger alone, so the ledger must agree with the
transforms exactly: free slots per group and slots per row after every reserve, advance,
free_rows and share_prefix, and the same verdict when a reserve does not fit.
"""

import functools

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from test_pool_sim import layouts

import gemma
import swajax
from swajax._ledger import SlotLedger, row_peak_slots


@functools.cache
def _ops(layout):
    jit = functools.partial(jax.jit, static_argnums=0)
    return (
        jit(swajax.pool.reserve),
        jit(swajax.pool.advance),
        jit(swajax.pool.free_rows),
        jit(swajax.pool.share_prefix),
    )


def _agree(layout, ledger, state):
    assert list(np.asarray(state.free_count)) == ledger.free
    per_row = np.asarray(swajax.pool.row_slots(layout, state))  # [G, B]
    for b in range(layout.max_batch):
        assert tuple(per_row[:, b]) == ledger.row_slots(b), b
    assert list(np.asarray(state.history)) == ledger.history


@settings(max_examples=15, deadline=None)
@given(layout=layouts(), seed=st.integers(0, 2**31 - 1), num_steps=st.integers(1, 14))
def test_ledger_matches_transforms(layout, seed, num_steps):
    rng = np.random.default_rng(seed)
    reserve, advance, free_rows, share = _ops(layout)
    state = swajax.pool.init_state(layout)
    ledger = SlotLedger(layout)
    b = layout.max_batch
    for _ in range(num_steps):
        op = rng.choice(["step", "step", "step", "free", "share"])
        if op == "free":
            rows = rng.random(b) < 0.4
            state = free_rows(layout, state, jnp.asarray(rows))
            ledger.free_rows(np.flatnonzero(rows).tolist())
        elif op == "share" and b > 1:
            src, dst = rng.choice(b, 2, replace=False).tolist()
            k = int(rng.integers(0, layout.max_context))
            empty = ledger.is_empty(dst)
            feasible = ledger.can_share(src, k)  # what the scheduler asks before a hit
            ok, state = share(layout, state, jnp.int32(src), jnp.int32(dst), jnp.int32(k))
            assert bool(ok) == ledger.share(src, dst, k)
            if empty:
                assert bool(ok) == feasible
        else:
            room = layout.max_context - np.asarray(state.history)
            n = np.minimum(rng.integers(0, 2 * layout.max_chunk, b), room + (rng.random(b) < 0.1))
            n = np.where(rng.random(b) < 0.3, np.minimum(n, 1), n).astype(np.int32)
            planned = ledger.slots_needed(dict(enumerate(n.tolist())))
            device = np.asarray(swajax.pool.slots_needed(layout, state, jnp.asarray(n)))
            ok, state = reserve(layout, state, jnp.asarray(n))
            assert bool(ok) == ledger.reserve(dict(enumerate(n.tolist())))
            if planned is not None:
                assert tuple(device) == planned
            _agree(layout, ledger, state)
            state = advance(layout, state)
            if bool(ok):
                ledger.advance()
        _agree(layout, ledger, state)


def test_row_peak_slots_hand_computed():
    """One sliding layer (window 64, page 16) and one full layer, chunks of 96 tokens.

    Without scratch, step 1 holds blocks 0..5 (6) and releases the stale ones: stale(96) ends
    at floor((96 + 1 - 64) / 16) = 2; step 2 (h 96 -> 192) adds blocks 6..11: 4 + 6 = 10 at the
    peak, then keeps blocks 8..11 (end floor(129/16) = 8). The full layer holds 12.
    """
    specs = [gemma.LayerSpec(64, 1, 8, kv_source=0), gemma.LayerSpec(None, 1, 8, kv_source=1)]
    config = swajax.KVCacheConfig(page_size=16, enable_swa_scratch_reuse=False)
    layout = swajax.pool.make_layout(
        specs, config, max_context=256, max_batch=1, max_chunk=96, num_slots=(64, 64)
    )
    steady, peak = row_peak_slots(layout, [96, 96])
    assert steady == (4, 12) and peak == (10, 12)
