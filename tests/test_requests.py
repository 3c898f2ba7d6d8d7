"""The request API as a server, a notebook and a batch script use it: several threads on one
engine, aborts mid-stream, a forgotten generator, outputs never lost, bad ids and prompts,
non-finite logits (`swajax._requests`, `swajax._engine`).

Threaded tests join with timeouts and assert, so that a hang fails instead of stalling CI. The
oracle for tokens is `dense_greedy` (the cache-free forward) or a serial run.
"""

from __future__ import annotations

import random
import threading

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_engine import all_free, engine_for
from test_generate import dense_greedy, make_model, prompts_of, tiny_gemma3

import gemma
import gemma._checkpoint

TIMEOUT = 60.0  # seconds for any thread of these tests (a step takes milliseconds here)


def run_threads(*targets):
    """Runs the callables in threads; fails (instead of hanging) if one does not end in time,
    and re-raises the first exception of a thread."""
    errors = []

    def wrap(f):
        def go():
            try:
                f()
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        return go

    threads = [threading.Thread(target=wrap(f), daemon=True) for f in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
        assert not t.is_alive(), "a thread hung"
    if errors:
        raise errors[0]


@pytest.fixture(scope="module")
def engine():
    model = make_model("gemma3")
    e = engine_for(model)
    e.run(prompts_of([10, 7], seed=1), 3)  # compile
    return e


def test_abort_inside_a_stream_ends_it_with_a_final_output(engine):
    """Row 3: aborting a request from inside its own stream ends the stream with a final
    output (finished, "abort", the tokens so far); the same from a `run` callback."""
    rid = engine.add_request(prompts_of([12], seed=2)[0], 20)
    outs = []

    def consume():
        for o in engine.stream_requests([rid]):
            outs.append(o)
            if len(outs) == 2:
                engine.abort([rid])

    run_threads(consume)
    assert outs[-1].finished and outs[-1].finish_reason == "abort"
    assert outs[-1].token_ids == outs[-2].token_ids and len(outs[-1].token_ids) >= 1
    seen = []

    def with_callback():
        def cb(i, o):
            seen.append(o)
            if not o.finished:
                engine.abort(o.request_id)

        out, _ = engine.run(prompts_of([9, 11], seed=3), 30, callback=cb)
        assert all(len(t) < 30 for t in out)

    run_threads(with_callback)
    assert all(o.finish_reason in (None, "abort") for o in seen)
    assert sum(o.finished for o in seen) == 2
    assert all_free(engine) and not engine.has_unfinished_requests


def test_abort_from_another_thread_takes_effect_at_the_next_step(engine):
    """Row 4: thread A streams a 60-token request; thread B aborts it once A has seen two
    outputs. B never waits for A's request to end; A's stream ends with the abort's output."""
    rid = engine.add_request(prompts_of([8], seed=4)[0], 60)
    started, aborted = threading.Event(), threading.Event()
    outs = []

    def reader():
        for o in engine.stream_requests([rid]):
            outs.append(o)
            if len(outs) == 2:
                started.set()
                assert aborted.wait(TIMEOUT)

    def aborter():
        assert started.wait(TIMEOUT)
        engine.abort([rid])  # while A's generator is suspended in its yield
        aborted.set()

    run_threads(reader, aborter)
    assert outs[-1].finish_reason == "abort" and len(outs[-1].token_ids) < 60
    # a finished id is a no-op, an id never issued a clear error, never a wait
    engine.abort([rid])
    with pytest.raises(ValueError, match="unknown request ids"):
        engine.abort([10**9])
    assert all_free(engine)


def test_a_suspended_stream_does_not_block_other_callers(engine):
    """Row 5: thread A takes one output of a stream and keeps the generator; thread B's
    `run` completes meanwhile; then A's stream resumes and completes. A forgotten (dropped)
    generator aborts its requests."""
    prompts = prompts_of([10, 13], seed=5)
    want = dense_greedy(engine_model(), prompts, 4)
    g = engine.stream(prompts[:1], 4)
    first = next(g)
    got = {}

    def other():
        got["b"] = engine.run(prompts[1:], 4)[0]

    run_threads(other)
    assert got["b"] == want[1:]
    rest = [o for _, o in g]
    assert list(rest[-1].token_ids) == want[0] and first[1].request_id == rest[-1].request_id
    rid = engine.add_request(prompts[0], 30)
    s = engine.stream_requests([rid])
    next(s)
    del s  # forgotten: its request is aborted, its rows freed
    for _ in range(3):
        engine.step()
    assert not engine.has_unfinished_requests and all_free(engine)


def engine_model():
    return make_model("gemma3")


def test_one_consumer_per_request(engine):
    """Row 6: a second stream of a request that has one raises ValueError naming the id; the
    first stream still gets every output."""
    rid = engine.add_request(prompts_of([9], seed=6)[0], 5)
    g1 = engine.stream_requests([rid])
    first = next(g1)
    with pytest.raises(ValueError, match=rf"\[{rid}\] already have a consumer"):
        engine.stream_requests([rid])
    rest = list(g1)
    assert len(rest[-1].token_ids) == 5 and rest[-1].finished
    assert [len(o.token_ids) for o in [first, *rest]] == sorted(
        len(o.token_ids) for o in [first, *rest]
    )


def test_the_step_loop_loses_no_output(engine):
    """Row 7: outputs of requests without a stream wait for a `step()` caller while another
    request is streamed; `has_unfinished_requests` stays true until they are handed over, and
    `run` neither returns nor swallows requests it did not create."""
    prompts = prompts_of([8, 11, 6], seed=7)
    want = dense_greedy(engine_model(), prompts, 5)
    r1, r2 = engine.add_request(prompts[0], 5), engine.add_request(prompts[1], 5)
    streamed = list(engine.stream_requests([r1]))
    assert list(streamed[-1].token_ids) == want[0]
    out, _ = engine.run(prompts[2:], 5)  # r2 keeps going, its outputs kept for step()
    assert out == want[2:]
    assert engine.has_unfinished_requests
    collected = {}
    while engine.has_unfinished_requests:
        for o in engine.step():
            collected.setdefault(o.request_id, []).append(o)
    assert set(collected) == {r2}
    assert list(collected[r2][-1].token_ids) == want[1] and collected[r2][-1].finished


def test_a_request_that_finished_before_its_stream_still_reaches_it(engine):
    """A request that finished (or was aborted) while another stream drove the steps, before
    its own consumer called `stream_requests`, is still streamed to it: its outputs wait
    unclaimed and move to the stream; once delivered, its id is unknown."""
    prompts = prompts_of([7, 12], seed=11)
    want = dense_greedy(engine_model(), prompts, 4)
    early, late = engine.add_request(prompts[0], 2), engine.add_request(prompts[1], 4)
    aborted = engine.add_request(prompts[1], 4)
    engine.abort(aborted)
    assert list(list(engine.stream_requests([late]))[-1].token_ids) == want[1]
    got = list(engine.stream_requests([early, aborted]))
    finals = {o.request_id: o for o in got if o.finished}
    assert list(finals[early].token_ids) == want[0][:2]
    assert finals[aborted].finish_reason == "abort"
    with pytest.raises(ValueError, match="not queued or running"):
        engine.stream_requests([early])
    assert not engine.has_unfinished_requests and all_free(engine)


def test_abort_takes_one_id_or_a_sequence_and_rejects_other_types(engine):
    """Row 11."""
    a = engine.add_request([1, 2, 3], 4)
    b = engine.add_request([4, 5, 6], 4)
    engine.abort(a)
    engine.abort((b,))
    with pytest.raises(ValueError, match="an id or a sequence of ids"):
        engine.abort("3")
    with pytest.raises(ValueError, match="unknown request ids"):
        engine.abort([-1])
    outs = engine.step()
    assert {o.request_id: o.finish_reason for o in outs} == {a: "abort", b: "abort"}
    assert not engine.has_unfinished_requests and all_free(engine)


def test_prompts_as_jax_arrays(engine):
    """Row 12: a JAX array of ids is a prompt like a NumPy array; floats are refused with a
    message that says so."""
    rid = engine.add_request(jnp.array([1, 2, 3]), 3)
    assert list(engine.stream_requests([rid]))[-1].finished
    with pytest.raises(ValueError, match="integer"):
        engine.add_request(jnp.array([1.0, 2.0]), 3)


def test_non_finite_logits_end_the_request_with_an_error():
    """Row 13: a model with a NaN in one weight: every request ends with finish_reason "error"
    and a message (never token 0); loading warns; a healthy engine afterwards is unaffected."""
    config = tiny_gemma3(num_layers=2)
    model = gemma.Transformer(config, rngs=nnx.Rngs(3))
    w = model.layer_param(1, "mlp.down_proj")
    model.set_layer_param(1, "mlp.down_proj", w.at[0, 0].set(jnp.nan))
    with pytest.warns(RuntimeWarning, match="hold NaN or Inf"):
        gemma._checkpoint.warn_non_finite(model, "test")
    broken = engine_for(model)
    out, stats = broken.run(prompts_of([9, 5], seed=8), 4)
    assert out == [[], []] and stats.errors == 2
    rid = broken.add_request([1, 2, 3], 4)
    last = list(broken.stream_requests([rid]))[-1]
    assert last.finish_reason == "error" and "non-finite" in last.error and last.token_ids == ()
    assert all_free(broken)
    healthy = gemma.Transformer(config, rngs=nnx.Rngs(3))
    prompts = prompts_of([9, 5], seed=8)
    assert engine_for(healthy).run(prompts, 4)[0] == dense_greedy(healthy, prompts, 4)


def test_four_threads_add_stream_and_abort_at_random():
    """Stress: 4 threads x 50 requests, each added and streamed, some aborted at random by
    their own thread or another; every request ends exactly once with a final output, the
    greedy tokens of those not aborted equal a serial run, no slot leaks."""
    model = make_model("gemma3")
    engine = engine_for(model, max_batch=6)
    rng = random.Random(0)
    prompts = [list(p) for p in prompts_of([rng.randint(3, 20) for _ in range(200)], seed=9)]
    news = [rng.randint(1, 6) for _ in prompts]
    serial = {}
    finals: dict[int, list] = {}
    ids: dict[int, int] = {}  # prompt index -> request id
    lock = threading.Lock()

    def worker(w):
        r = random.Random(w)
        for k in range(w, len(prompts), 4):
            rid = engine.add_request(prompts[k], news[k])
            with lock:
                ids[k] = rid
            if r.random() < 0.15:  # aborted at once by another thread's hand
                with lock:
                    victim = rng.choice(list(ids.values()))
                engine.abort(victim)
            for o in engine.stream_requests([rid]):
                if o.finished:
                    with lock:
                        finals.setdefault(rid, []).append(o)
                elif r.random() < 0.1:
                    engine.abort([rid])

    run_threads(*[lambda w=w: worker(w) for w in range(4)])
    assert set(finals) == set(ids.values())
    assert all(len(v) == 1 for v in finals.values())  # exactly one final output each
    done = [k for k in range(len(prompts)) if finals[ids[k]][0].finish_reason != "abort"]
    assert len(done) > 100
    serial_out, _ = engine_for(model, max_batch=6).run([prompts[k] for k in done[:40]], 6)
    for j, k in enumerate(done[:40]):
        serial[k] = serial_out[j][: news[k]]
        assert list(finals[ids[k]][0].token_ids) == serial[k], k
    assert not engine.has_unfinished_requests and all_free(engine)
    assert np.all(np.asarray(engine.state.free_count) == np.asarray(engine.num_slots))


def test_generate_text_names_a_lone_surrogate():
    """Row 9: a prompt string with a lone surrogate is a ValueError naming the prompt and the
    code point (not the tokenizer's TypeError); in a conversation, the message."""
    from test_text import TINY

    import swajax

    model, tok = gemma.from_pretrained(TINY), gemma.load_tokenizer(TINY)
    with pytest.raises(ValueError, match=r"prompt 0 holds U\+D800 at character 3"):
        swajax.generate_text(model, tok, "abc\ud800def", 4)
    with pytest.raises(ValueError, match=r"prompt 1: message 0 content holds U\+DFFF"):
        swajax.generate_text(model, tok, ["ok", [{"role": "user", "content": "\udfff"}]], 4)
