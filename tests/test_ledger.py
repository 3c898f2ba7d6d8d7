"""`SlotLedger` (host) against the pool transforms (device) on random schedules.

The scheduler decides every step from the ledger alone, so the ledger must agree with the
transforms exactly: free slots per group and slots per row after every reserve, advance,
free_rows and the prefix cache's park / adopt / release, and the same verdict when a reserve
or an adoption does not fit.
"""

import dataclasses
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
        jit(swajax.pool.park),
        jit(swajax.pool.adopt),
        jit(swajax.pool.release_cached),
        jit(swajax.pool.rewind),
    )


NODES = 12  # the prefix cache's node ids in these schedules


def _agree(layout, ledger, state):
    assert list(np.asarray(state.free_count)) == ledger.free
    per_row = np.asarray(swajax.pool.row_slots(layout, state))  # [G, B]
    for b in range(layout.max_batch):
        assert tuple(per_row[:, b]) == ledger.row_slots(b), b
    assert list(np.asarray(state.history)) == ledger.history
    for g, cached in enumerate(state.cached):
        assert set(np.flatnonzero(np.asarray(cached) != -1).tolist()) == set(ledger.cached[g])


@settings(max_examples=15, deadline=None)
@given(layout=layouts(), seed=st.integers(0, 2**31 - 1), num_steps=st.integers(1, 14))
def test_ledger_matches_transforms(layout, seed, num_steps):
    """Random reserve / advance / free / park / adopt / release / rewind schedules: the
    ledger and the device agree on free slots, slots per row, histories and cached blocks
    after every op, and on the verdict of every reserve and adoption."""
    layout = dataclasses.replace(layout, cache_nodes=NODES)
    rng = np.random.default_rng(seed)
    reserve, advance, free_rows, park, adopt, release, rewind = _ops(layout)
    state = swajax.pool.init_state(layout)
    ledger = SlotLedger(layout)
    b, tpb, nb = layout.max_batch, layout.page_size, layout.max_blocks

    def path(n):
        return rng.choice(NODES, min(n, NODES), replace=False).tolist() if n else []

    parked = []
    for _ in range(num_steps):
        ops = ["step", "step", "step", "free", "park", "park", "adopt", "release", "rewind"]
        op = rng.choice(ops)
        if op == "free":
            rows = rng.random(b) < 0.4
            state = free_rows(layout, state, jnp.asarray(rows))
            ledger.free_rows(np.flatnonzero(rows).tolist())
        elif op == "park":
            row = int(rng.integers(b))
            k = int(rng.integers(0, min(ledger.history[row], NODES * tpb) // tpb + 1)) * tpb
            nodes = path(k // tpb)
            masks = ledger.park(row, k, nodes)
            ops = np.full((1, 2 + 2 * nb), -1, np.int32)
            ops[0, :2], ops[0, 2 + nb :] = (row, k), 0
            ops[0, 2 : 2 + len(nodes)], ops[0, 2 + nb : 2 + nb + len(masks)] = nodes, masks
            ok, state = park(layout, state, jnp.asarray(ops))
            assert bool(ok)
            parked.append((k, nodes))
        elif op == "adopt":
            row = int(rng.integers(b))
            if parked and rng.random() < 0.7:  # a parked path (a hit is then likely)
                k, nodes = parked[int(rng.integers(len(parked)))]
                k = int(rng.integers(0, k // tpb + 1)) * tpb
            else:
                k = int(rng.integers(0, min(NODES, layout.max_context // tpb) + 1)) * tpb
                nodes = path(k // tpb)
            nodes = nodes[: k // tpb]
            ops = np.full((1, 2 + nb), -1, np.int32)
            ops[0, :2] = row, k
            ops[0, 2 : 2 + len(nodes)] = nodes
            feasible = ledger.is_empty(row) and ledger.can_adopt(k, nodes)
            ok, state = adopt(layout, state, jnp.asarray(ops))
            assert bool(ok) == ledger.adopt(row, k, nodes) == feasible
        elif op == "rewind":  # a verification kept fewer tokens than it fed
            row = int(rng.integers(b))
            back = int(rng.integers(0, min(layout.max_rewind, ledger.history[row]) + 1))
            to = np.full(b, -1, np.int32)
            to[row] = ledger.history[row] - back
            ok, state = rewind(layout, state, jnp.asarray(to))
            assert bool(ok)
            ledger.rewind(row, int(to[row]))
        elif op == "release":
            nodes = path(int(rng.integers(0, NODES)))
            state = release(layout, state, jnp.asarray(nodes + [-1], jnp.int32))
            for node in nodes:
                ledger.release_cached(node)
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
