"""The continuous-batching engine against the dense model: preemption, budgets, arrivals, stop
tokens, sampling reproducibility, concurrency, bad input and interrupted runs.

The oracle is `dense_greedy` (the cache-free forward re-run each step), which shares no code
with the scheduler, the pool or the kernels.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading

import hypothesis.strategies as st
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from test_generate import VOCAB, dense_greedy, kv_config, make_model, prompts_of

import swajax
import swajax._ledger


def engine_for(model, *, scratch=True, quota=64 << 20, ratio=None, **kw):
    cfg = kv_config(scratch, max_gpu_total_bytes=quota, pool_ratio=ratio)
    kw.setdefault("max_context", 128)
    kw.setdefault("max_batch", 4)
    kw.setdefault("prefill_chunk_size", 16)
    kw.setdefault("min_prefill_bucket", 64)
    kw.setdefault("max_num_tokens", 64)
    return swajax.Engine(model, cfg, implementation="reference", **kw)


def quota_for(model, requests: int, prompt_len: int, new: int, *, scratch=True, chunk=16):
    """A byte quota and pinned ratio with room for about `requests` requests' peaks."""
    probe = engine_for(model, scratch=scratch, prefill_chunk_size=chunk)
    need = swajax.pool.request_slots(probe.layout, prompt_len, chunk=chunk, max_new_tokens=new - 1)
    size = [probe.layout.slot_bytes(g) for g in range(len(need))]
    share = [requests * n * b for n, b in zip(need, size, strict=True)]
    return int(sum(share) * 1.02) + sum(size), tuple(float(x) for x in share)


# Short prompts with long outputs: rows admitted side by side grow past the pool in decode,
# so the engine preempts (a long prompt waits until its whole prefill fits instead).
SHORT, LONG = [12, 9, 14, 11, 13, 10], 40


def until_stop(tokens, stop):
    return tokens[: tokens.index(stop) + 1] if stop in tokens else tokens


def all_free(engine):
    engine.clear_prefix_cache()
    return list(np.asarray(engine.state.free_count)) == list(engine.num_slots)


@pytest.mark.parametrize("family", ["gemma3", "gemma4"])
def test_repeated_preemption_keeps_greedy_tokens(family):
    model = make_model(family)
    prompts = prompts_of(SHORT, seed=3)
    expected = dense_greedy(model, prompts, LONG)
    quota, ratio = quota_for(model, 1.4, max(SHORT), LONG)
    engine = engine_for(model, quota=quota, ratio=ratio, max_batch=4)
    outputs, stats = engine.run(prompts, LONG)
    assert outputs == expected
    assert stats.preemptions >= 2, stats.preemptions
    assert all_free(engine)


def test_budget_smaller_than_a_chunk_and_scratch_on_off():
    model = make_model("gemma4")
    prompts = prompts_of([37, 20, 5], seed=1)
    expected = dense_greedy(model, prompts, 5)
    for scratch in (True, False):
        engine = engine_for(
            model, scratch=scratch, max_num_tokens=8, prefill_chunk_size=32, min_prefill_bucket=8
        )
        outputs, stats = engine.run(prompts, 5)
        assert outputs == expected, scratch
        assert stats.steps >= (37 + 20 + 5) // 8
        assert all_free(engine)


def test_requests_arriving_while_others_decode_and_stop_tokens():
    model = make_model("gemma3")
    first, later = prompts_of([21, 9], seed=7), prompts_of([14, 30], seed=8)
    want_first = dense_greedy(model, first, 10)
    want_later = dense_greedy(model, later, 6)
    stop = want_later[1][2]  # the third token of the last request stops it
    engine = engine_for(model)
    ids = [engine.add_request(p, 10) for p in first]
    got: dict[int, list[int]] = {}
    reasons = {}
    steps = 0
    late_ids = []
    while engine.has_unfinished_requests:
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
            assert list(out.token_ids) == got[out.request_id]
            if out.finished:
                reasons[out.request_id] = out.finish_reason
        steps += 1
        if steps == 4:  # the first two are decoding by now
            late_ids = [engine.add_request(p, 6, stop_token_ids=[stop]) for p in later]
    assert [got[i] for i in ids] == want_first
    assert got[late_ids[0]] == until_stop(want_later[0], stop)
    assert got[late_ids[1]] == want_later[1][:3] and reasons[late_ids[1]] == "stop"
    assert reasons[ids[0]] == "length"
    assert all_free(engine)


def test_sampled_tokens_reproducible_under_preemption():
    model = make_model("gemma3")
    prompts = prompts_of(SHORT[:4], seed=9)
    sampling = swajax.SamplingParams(temperature=1.0, top_k=16)
    roomy = engine_for(model)
    free_run, free_stats = roomy.run(prompts, LONG, sampling=sampling, seed=5)
    quota, ratio = quota_for(model, 1.4, max(SHORT), LONG)
    tight = engine_for(model, quota=quota, ratio=ratio)
    tight_run, tight_stats = tight.run(prompts, LONG, sampling=sampling, seed=5)
    assert free_stats.preemptions == 0 and tight_stats.preemptions >= 1
    assert tight_run == free_run
    other, _ = roomy.run(prompts, LONG, sampling=sampling, seed=6)
    assert other != free_run


def test_on_demand_allocation_serves_many_rows_without_scratch():
    """Scratch off, chunk far above the window: one request's lifetime peak holds its whole
    prompt in every sliding layer, but after its prefill it keeps only the window. A quota
    with room for one peak plus six requests at steady state serves about six at once.
    (Prefix caching off: its rewind pages would change the slot arithmetic.)"""
    model = make_model("gemma3")  # window 16, page 16
    prompts = prompts_of([96] * 8, seed=2)
    probe = engine_for(
        model, scratch=False, prefill_chunk_size=96, max_num_tokens=96, enable_prefix_caching=False
    )
    peak = swajax.pool.request_slots(probe.layout, 96, chunk=96, max_new_tokens=7)
    steady = swajax._ledger.row_peak_slots(probe.layout, [96])[0]
    size = [probe.layout.slot_bytes(g) for g in range(len(peak))]
    slots = [p + 6 * (s + 1) for p, s in zip(peak, steady, strict=True)]
    quota = sum(n * b for n, b in zip(slots, size, strict=True)) + sum(size)
    engine = engine_for(
        model,
        scratch=False,
        quota=quota,
        ratio=tuple(float(n * b) for n, b in zip(slots, size, strict=True)),
        max_batch=8,
        prefill_chunk_size=96,
        max_num_tokens=96,
        min_prefill_bucket=96,
        enable_prefix_caching=False,
    )
    # Reserving lifetime peaks would admit this many at once:
    lifetime = min(n // p for n, p in zip(engine.num_slots, peak, strict=True))
    assert lifetime <= 3
    outputs, stats = engine.run(prompts, 8)
    assert outputs == dense_greedy(model, prompts, 8)
    assert stats.max_concurrent >= 5, (stats.max_concurrent, lifetime)


def test_multi_turn_prefix_hits_with_scratch():
    model = make_model("gemma4")
    engine = engine_for(model, max_batch=2)
    turn = prompts_of([40], seed=4)[0]
    hits = []
    for k in range(3):
        out, stats = engine.run([turn], 6)
        assert out == dense_greedy(model, [turn], 6)
        hits.append(stats.prefix_tokens)
        turn = turn + out[0] + prompts_of([5], seed=10 + k)[0]
    assert hits[0] == 0 and hits[1] >= 32 and hits[2] >= 48, hits
    assert all_free(engine)


def test_cached_prefixes_outnumber_the_rows_and_unwritten_pages_are_never_read():
    """10 x max_batch distinct prompts are served, then each again with more tokens: every
    repeat starts from its cached blocks (the cache is bounded by free KV memory, not by a
    count of rows), and its tokens are dense greedy's although every page of the pool started
    as NaN (a cached block read before it was written, or after its slot was reused, would
    poison the logits). Then a quota for two requests: admissions evict cached blocks, least
    recently used first, and no request is lost."""
    model = make_model("gemma4")
    engine = engine_for(model, max_batch=2, prefill_chunk_size=32)
    engine.state = dataclasses.replace(
        engine.state, pools=tuple(jnp.full_like(p, jnp.nan) for p in engine.state.pools)
    )
    first = prompts_of([36] * 20, seed=30)
    engine.run(first, 2)
    again = [p + q for p, q in zip(first, prompts_of([3] * 20, seed=31), strict=True)]
    out, stats = engine.run(again, 3)
    assert out == dense_greedy(model, again, 3)
    assert (stats.prefix_hits, stats.prefix_tokens) == (20, 20 * 32)
    assert all_free(engine)
    quota, ratio = quota_for(model, 2, 40, 3)
    tight = engine_for(model, quota=quota, ratio=ratio, max_batch=2, prefill_chunk_size=32)
    tight.run(first[:10], 2)
    last_first = again[:10][::-1]  # the most recently cached first
    out, stats = tight.run(last_first, 3)
    assert out == dense_greedy(model, last_first, 3)
    assert tight.scheduler.counters.evictions > 0 and stats.prefix_hits >= 1
    assert all_free(tight)


def test_round_robin_chat_sessions_reuse_their_histories():
    """4 chat sessions x 4 turns, round robin, scratch on, the default prefix cache: each
    turn starts from the session's last history (its blocks extend those of the turn before,
    cached once). At least 80 % of the
    reusable tokens (every earlier turn) come from the cache, and the tokens equal those of an
    engine with prefix caching off."""
    cached, plain, hit, reusable = chat_rounds(sessions=4, turns=4, new=4, seed=20)
    assert cached == plain
    assert hit >= 0.8 * reusable, (hit, reusable)


def chat_rounds(*, sessions, turns, new, seed, re_encode=lambda answer: answer, **engine_kw):
    """Round-robin chat turns (each the session's history plus 5 new tokens, greedy) with
    prefix caching on and off: (cached outputs, uncached outputs, prompt tokens served from
    the cache, reusable tokens = the earlier turns' histories). `re_encode` maps an answer to
    the ids the next turn carries. The uncached engine's hits are asserted to be 0."""
    model = make_model("gemma4")
    runs = {}
    for cached in (True, False):
        engine = engine_for(model, enable_prefix_caching=cached, max_batch=4, **engine_kw)
        history = [prompts_of([50], seed=seed + s)[0] for s in range(sessions)]
        outs, reusable, hit = [], 0, 0
        for turn in range(turns):
            for s in range(sessions):
                more = prompts_of([5], seed=seed + 20 + sessions * turn + s)[0]
                prompt = history[s] + more
                reusable += len(history[s]) if turn else 0
                out, stats = engine.run([prompt], new)
                hit += stats.prefix_tokens
                outs.append(out[0])
                history[s] = prompt + re_encode(out[0])
        runs[cached] = outs, hit, reusable
        assert all_free(engine)
    (cached, hit, reusable), (plain, none, _) = runs[True], runs[False]
    assert none == 0
    return cached, plain, hit, reusable


def test_next_turn_starts_from_the_prompt_when_the_answer_re_encodes_differently():
    """A chat client re-encodes the model's answer into the next turn; with real tokenizers it
    can differ from the generated ids (here: each answer's first token replaced). The history
    parked at the end then shares only up to the previous prompt, which is 40 tokens back
    (past the window of 16 and its two rewind pages): the window cached when the prompt's
    prefill ended serves it. Scratch on; the tokens equal an uncached engine's."""
    cached, plain, hit, reusable = chat_rounds(
        sessions=3,
        turns=3,
        new=40,
        seed=60,
        re_encode=lambda answer: [(answer[0] + 1) % VOCAB, *answer[1:]],
        max_context=256,
    )
    assert cached == plain
    # every earlier prompt (the reusable tokens less the answers) whole blocks from the cache
    assert hit >= 0.8 * (reusable - 6 * 40), (hit, reusable)


@settings(max_examples=6, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=6),
    new=st.integers(1, 6),
    arrivals=st.lists(st.integers(0, 6), min_size=6, max_size=6),
    budget=st.sampled_from([8, 64]),
    tight=st.booleans(),
)
def test_random_arrivals_budgets_and_quotas_lose_nothing(lengths, new, arrivals, budget, tight):
    model = make_model("gemma3")
    prompts = prompts_of(lengths, seed=sum(lengths))
    quota, ratio = quota_for(model, 1.2, 40, new) if tight else (64 << 20, None)
    engine = engine_for(
        model, quota=quota, ratio=ratio, max_num_tokens=budget, min_prefill_bucket=8
    )
    pending = sorted(zip(arrivals[: len(prompts)], range(len(prompts)), strict=True))
    ids, got, steps = {}, {}, 0
    while pending or engine.has_unfinished_requests:
        while pending and pending[0][0] <= steps:
            _, i = pending.pop(0)
            ids[engine.add_request(prompts[i], new)] = i
        for out in engine.step():
            got[ids[out.request_id]] = list(out.token_ids)
        steps += 1
    assert [got[i] for i in range(len(prompts))] == dense_greedy(model, prompts, new)
    assert all_free(engine)


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "prompt, kwargs, match",
    [
        ([1, 2.0], {}, "integer token ids"),
        ([1, True], {}, "integer token ids"),
        ([], {}, "empty"),
        ([1, VOCAB], {}, "outside"),
        ([1] * 120, {"max_new_tokens": 20}, "max_context"),
        ([1, 2], {"max_new_tokens": 0}, "max_new_tokens"),
        ([1, 2], {"max_new_tokens": 2.0}, "max_new_tokens"),
        ([1, 2], {"stop_token_ids": [VOCAB + 1]}, "stop_token_ids"),
        ([1, 2], {"sampling": "greedy"}, "SamplingParams"),
    ],
)
def test_add_request_rejects_bad_input_and_keeps_the_queue(prompt, kwargs, match):
    engine = engine_for(make_model("gemma3"))
    good = engine.add_request([3, 4, 5], 2)
    kwargs.setdefault("max_new_tokens", 3)
    with pytest.raises(ValueError, match=match):
        engine.add_request(prompt, **kwargs)
    outs = []
    while engine.has_unfinished_requests:
        outs += engine.step()
    assert [o.request_id for o in outs if o.finished] == [good]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(temperature=-1.0), "temperature"),
        (dict(top_k=2.5), "top_k"),
        (dict(top_k=True), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(seed=-1), "seed"),
        (dict(seed=2**63), "seed"),
        (dict(seed=1.5), "seed"),
    ],
)
def test_sampling_params_validated(kwargs, match):
    with pytest.raises(ValueError, match=match):
        swajax.SamplingParams(**kwargs)


def test_engine_config_prefix_caching_defaults_and_errors():
    """On by default: two pages past each window; off: the user's max_rewind; a bad value is
    a ValueError naming the field."""
    kv = swajax.KVCacheConfig(page_size=16)
    on = swajax.EngineConfig(kv_cache=kv, max_batch=3).resolved(256)
    assert on.enable_prefix_caching
    assert on.kv_cache.max_rewind == 32 and kv.max_rewind == 0
    off = swajax.EngineConfig(kv_cache=kv, max_batch=3, enable_prefix_caching=False).resolved(256)
    assert off.kv_cache == kv
    assert off.resolved(256) == off and on.resolved(256) == on  # resolving is idempotent
    with pytest.raises(ValueError, match="unknown engine settings"):
        swajax.EngineConfig.of(prefix_cache_rows=4)
    with pytest.raises(ValueError, match="enable_prefix_caching must be True or False"):
        swajax.EngineConfig(enable_prefix_caching=1)


def test_engine_and_generate_arguments_validated():
    model = make_model("gemma3")
    with pytest.raises(ValueError, match="max_num_tokens"):
        engine_for(model, max_num_tokens=-1)
    with pytest.raises(ValueError, match="max_batch"):
        swajax.generate(model, [[1, 2]], 2, max_batch=0)
    engine = engine_for(model)
    with pytest.raises(ValueError, match="unknown request"):
        engine.abort([12345])
    with pytest.raises(ValueError, match="seed"):
        engine.run([[1, 2]], 2, seed=-3)
    # NumPy integers are ints; a huge max_batch is capped at the prompts.
    out = swajax.generate(
        model,
        [np.array([1, 2, 3]), [np.int64(4), 5]],
        np.int64(2),
        max_batch=10**5,
        kv_cache=kv_config(True),
    )
    assert out == dense_greedy(model, [[1, 2, 3], [4, 5]], 2)


# ----------------------------------------------------------------------------- faults


def test_exception_in_callback_leaves_the_engine_consistent():
    model = make_model("gemma3")
    prompts = prompts_of([30, 12, 25], seed=12)
    expected = dense_greedy(model, prompts, 6)
    engine = engine_for(model)

    def boom(i, out):
        if len(out.token_ids) == 3:
            raise RuntimeError("user callback failed")

    with pytest.raises(RuntimeError, match="user callback"):
        engine.run(prompts, 6, callback=boom)
    assert all_free(engine)
    outputs, _ = engine.run(prompts, 6)
    assert outputs == expected


def test_sigint_during_a_run_is_deferred_and_the_engine_survives():
    model = make_model("gemma3")
    prompts = prompts_of([30, 12, 25, 18], seed=13)
    expected = dense_greedy(model, prompts, 12)
    engine = engine_for(model)
    engine.run(prompts, 2)  # compile first, so the signal lands in the serving loop

    def interrupt(i, out):
        if len(out.token_ids) == 4 and i == 0:
            threading.Timer(0.0, os.kill, (os.getpid(), signal.SIGINT)).start()

    with pytest.raises(KeyboardInterrupt):
        engine.run(prompts, 12, callback=interrupt)
        for _ in range(200):  # the timer fires after the run: wait for it here
            threading.Event().wait(0.01)
    assert all_free(engine)
    outputs, _ = engine.run(prompts, 12)
    assert outputs == expected


def test_threads_share_one_engine_safely():
    model = make_model("gemma3")
    prompts = [prompts_of([10 + 3 * i, 7], seed=20 + i) for i in range(4)]
    expected = [dense_greedy(model, p, 4) for p in prompts]
    engine = engine_for(model)
    engine.run(prompts[0], 4)  # compile
    results = [None] * 4

    def work(i):
        results[i] = engine.run(prompts[i], 4)[0]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == expected
    assert all_free(engine)


def test_logits_of_a_preempted_request_match_an_unpreempted_run():
    model = make_model("gemma4")
    prompts = prompts_of(SHORT[:4], seed=14)
    roomy = engine_for(model)
    _, a = roomy.run(prompts, LONG, collect_logits=True)
    quota, ratio = quota_for(model, 1.4, max(SHORT), LONG)
    _, b = engine_for(model, quota=quota, ratio=ratio).run(prompts, LONG, collect_logits=True)
    assert b.preemptions >= 1
    la = {(i, k): x for i, k, x in a.step_logits}
    lb = {(i, k): x for i, k, x in b.step_logits}
    assert la.keys() == lb.keys()
    for key in la:
        np.testing.assert_allclose(lb[key], la[key], rtol=1e-4, atol=1e-4)
    assert jnp.isfinite(jnp.asarray(list(la.values()))).all()
