"""Speculative decoding in the engine: drafts verified through the paged kernels, the rejected
ones taken back (`rewind`) without losing a block the kept history needs.

Greedy outputs with speculation must be the dense forward's (those of an engine without it),
with drafts that are right, partly right or wrong, longer than the sliding window (16 tokens
in the tiny models), across scratch rotations and under preemption; every page of the pool
starts as NaN, so reading a block a rewind lost would show in the tokens.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_engine import all_free, quota_for
from test_generate import VOCAB, dense_greedy, kv_config, make_model, prompts_of, tiny_gemma4

import gemma
import swajax
from swajax._drafter import NgramDrafter


class OracleDrafter:
    """Drafts the dense greedy continuation of each known prompt, with every `wrong`-th
    drafted token (counted over the run) replaced: right, partly right and wrong drafts."""

    def __init__(self, prompts, outputs, wrong: int = 0):
        self.known = [(list(p), list(p) + list(o)) for p, o in zip(prompts, outputs, strict=True)]
        self.wrong, self.count, self.proposed = wrong, 0, 0

    def propose(self, tokens, k):
        tokens = list(tokens)
        for prompt, full in self.known:
            if tokens[: len(prompt)] == prompt and full[: len(tokens)] == tokens:
                drafts = full[len(tokens) : len(tokens) + k]
                break
        else:
            return []
        out = []
        for t in drafts:
            self.count += 1
            out.append((t + 1) % VOCAB if self.wrong and self.count % self.wrong == 0 else t)
        self.proposed += len(out)
        return out


def spec_engine(model, drafter, *, k, scratch=True, quota=64 << 20, ratio=None, **kw):
    engine = swajax.Engine(
        model,
        kv_config(scratch, max_gpu_total_bytes=quota, pool_ratio=ratio),
        max_context=160,
        max_batch=kw.pop("max_batch", 3),
        prefill_chunk_size=kw.pop("prefill_chunk_size", 32),
        max_num_tokens=64,
        min_prefill_bucket=64,
        implementation="reference",
        num_draft_tokens=k,
        drafter=drafter,
        **kw,
    )
    engine.state = dataclasses.replace(
        engine.state, pools=tuple(jnp.full_like(p, jnp.nan) for p in engine.state.pools)
    )
    return engine


def model_of(family):
    if family != "gemma4_keqv":
        return make_model(family)
    config = tiny_gemma4(attention_k_eq_v=True, num_global_kv_heads=1, num_kv_heads=2)
    return gemma.Transformer(config, rngs=nnx.Rngs(7), dtype=jnp.float32)


CASES = [  # (family, scratch, k, every k-th drafted token wrong)
    ("gemma4", True, 4, 3),  # KV-shared layers, per-layer inputs
    ("gemma4_keqv", False, 4, 5),  # K = V in the full layers
    ("gemma3", True, 20, 7),  # drafts longer than the window
    ("gemma3", False, 6, 0),  # every draft right: acceptance 1
]


@pytest.mark.parametrize("family, scratch, k, wrong", CASES)
def test_greedy_speculation_gives_the_dense_tokens(family, scratch, k, wrong):
    model = model_of(family)
    prompts = prompts_of([40, 9, 23], seed=k)
    new = 30
    expected = dense_greedy(model, prompts, new)
    drafter = OracleDrafter(prompts, expected, wrong)
    engine = spec_engine(model, drafter, k=k, scratch=scratch)
    assert engine.layout.max_rewind >= k
    out, stats = engine.run(prompts, new)
    assert out == expected
    assert stats.draft_tokens == drafter.proposed > 0
    if wrong:
        assert 0 < stats.accepted_tokens < stats.draft_tokens
    else:
        assert stats.acceptance_rate == 1.0
    # fewer steps than tokens: several tokens per step
    assert stats.decode_steps < len(prompts) * (new - 1)
    assert all_free(engine)


def test_speculation_under_preemption_and_per_request_opt_out():
    """A quota for about two requests: rows are preempted and recomputed while they speculate;
    a request with num_draft_tokens=0 decodes one token a step beside them; the tokens are the
    dense forward's."""
    model = make_model("gemma4")
    prompts = prompts_of([30, 12, 25, 18], seed=11)
    new = 24
    expected = dense_greedy(model, prompts, new)
    quota, ratio = quota_for(model, 1.6, 30, new)
    drafter = OracleDrafter(prompts, expected, wrong=4)
    engine = spec_engine(model, drafter, k=5, quota=quota, ratio=ratio, max_batch=4)
    sampling = [swajax.SamplingParams(num_draft_tokens=d) for d in (None, 0, 3, None)]
    ids = [engine.add_request(p, new, sampling=s) for p, s in zip(prompts, sampling, strict=True)]
    done = {}
    while engine.has_unfinished_requests:
        for o in engine.step():
            if o.finished:
                done[o.request_id] = list(o.token_ids)
    assert [done[i] for i in ids] == expected
    assert engine.scheduler.counters.preemptions >= 1
    assert engine.scheduler.counters.accepted_tokens > 0
    assert all_free(engine)
    with pytest.raises(ValueError, match="num_draft_tokens=6 exceeds the engine's"):
        engine.add_request(prompts[0], 4, sampling=swajax.SamplingParams(num_draft_tokens=6))


def test_ngram_drafts_on_repetitive_text_and_sampling():
    """Prompt lookup on a repetitive prompt: greedy tokens are dense greedy's; sampled runs
    with speculation finish with valid tokens, reproducibly for a seed."""
    model = make_model("gemma3")
    unit = prompts_of([7], seed=3)[0]
    prompts = [unit * 5, prompts_of([20], seed=4)[0]]
    expected = dense_greedy(model, prompts, 16)
    engine = spec_engine(model, "ngram", k=4)
    out, stats = engine.run(prompts, 16)
    assert out == expected and stats.draft_tokens > 0
    sampling = swajax.SamplingParams(temperature=0.8, top_k=20)
    a, _ = engine.run(prompts, 16, sampling=sampling, seed=5)
    b, _ = engine.run(prompts, 16, sampling=sampling, seed=5)
    assert a == b and all(len(x) == 16 and all(0 <= t < VOCAB for t in x) for x in a)
    assert all_free(engine)


def test_ngram_drafter():
    d = NgramDrafter(max_n=3)
    assert d.propose([1, 2, 3, 4, 1, 2, 3], 3) == [4, 1, 2]  # the longest match: 1 2 3
    assert d.propose([5, 1, 2, 9, 1, 2], 2) == [9, 1]
    assert d.propose([1, 2, 3], 2) == [] and d.propose([7], 2) == []
    assert d.propose([4, 7, 5, 7], 3) == [5, 7]  # the most recent match of the longest n
    assert d.propose([1, 2, 1, 2], 0) == []
    with pytest.raises(ValueError, match="min_n <= max_n"):
        NgramDrafter(max_n=1, min_n=2)


def test_rewind_transform_and_config_errors():
    layout = swajax.pool.make_layout(
        [gemma.LayerSpec(40, 1, 8, 0), gemma.LayerSpec(None, 1, 8, 1)],
        swajax.KVCacheConfig(page_size=16, max_rewind=8),
        max_context=128,
        max_batch=2,
        num_slots=(20, 20),
    )
    state = swajax.pool.init_state(layout)
    ok, state = swajax.pool.reserve(layout, state, np.array([70, 5], np.int32))
    state = swajax.pool.advance(layout, state)
    ok, back = swajax.pool.rewind(layout, state, np.array([64, -1], np.int32))
    assert ok and np.asarray(back.history).tolist() == [64, 5]
    assert np.asarray(back.free_count).tolist() == np.asarray(state.free_count).tolist()
    for bad in ([71, -1], [61, -1]):  # forward, or more than max_rewind back
        ok, same = swajax.pool.rewind(layout, state, np.array(bad, np.int32))
        assert not ok and np.asarray(same.history).tolist() == [70, 5]
    with pytest.raises(ValueError, match="needs mixed steps"):
        swajax.EngineConfig(num_draft_tokens=2, batch_invariant=True)
    with pytest.raises(ValueError, match="drafter must be"):
        swajax.EngineConfig(num_draft_tokens=2, drafter="eagle")
    with pytest.raises(ValueError, match="num_draft_tokens must be None or an int"):
        swajax.SamplingParams(num_draft_tokens=-1)


def test_an_engine_of_a_draft_model_drafts_in_its_own_pool():
    """`EngineConfig(drafter=engine)`: the draft model's greedy continuation, computed in its
    own engine and pool, each call prefilling only what its prefix cache lacks. The target as
    its own drafter keeps every draft; a perturbed copy keeps some; the tokens are the dense
    forward's either way."""
    model = make_model("gemma4")
    prompts = prompts_of([30, 12], seed=21)
    new = 14
    expected = dense_greedy(model, prompts, new)
    graphdef, state = nnx.split(model)
    noise = jax.tree.map(
        lambda x: x * (1 + 0.3 * jax.random.normal(jax.random.key(1), x.shape, x.dtype)), state
    )
    for draft_model, all_kept in ((model, True), (nnx.merge(graphdef, noise), False)):
        draft = swajax.Engine(
            draft_model,
            kv_config(True),
            max_context=160,
            max_batch=2,
            prefill_chunk_size=32,
            max_num_tokens=64,
            min_prefill_bucket=64,
            implementation="reference",
        )
        engine = spec_engine(model, draft, k=4, max_batch=2)
        out, stats = engine.run(prompts, new)
        assert out == expected
        assert (stats.acceptance_rate == 1.0) == all_kept and stats.accepted_tokens > 0
        assert draft.scheduler.counters.prefix_hits > 0  # earlier calls' sequences reused
        assert all_free(engine) and all_free(draft)


FIXTURES = Path(__file__).parent / "fixtures" / "hf"


@pytest.mark.parametrize(
    "case, scratch", [("gemma4_assistant", None), ("gemma4_assistant_ordered", True)]
)
def test_gemma4_assistant_drafts_in_the_step_as_its_dense_reference(case, scratch):
    """Gemma 4's multi-token-prediction assistant (Hugging Face `Gemma4AssistantForCausalLM`,
    random weights) drafting inside the steps of its target (the `gemma4_ple_shared`
    checkpoint: KV-shared layers, per-layer inputs, window 8): the greedy tokens are the dense
    forward's, and every row's drafts are those of `gemma.draft_reference` (the target's dense
    forward and the assistant on its K/V) for the tokens the row has then; pages start NaN.
    scratch None: the policy's default (off with an assistant); True: on, explicitly."""
    target = gemma.from_pretrained(FIXTURES / "gemma4_ple_shared")
    assistant = gemma.load_assistant(FIXTURES / case)
    prompts = prompts_of([21, 9, 30], seed=5)
    new = 12
    expected = dense_greedy(target, prompts, new)
    engine = swajax.Engine(
        target,
        kv_config(scratch, page_size=8),
        max_context=64,
        max_batch=3,
        prefill_chunk_size=16,
        max_num_tokens=32,
        min_prefill_bucket=32,
        implementation="reference",
        num_draft_tokens=3,
        drafter=assistant,
    )
    assert engine.layout.scratch == bool(scratch)
    engine.state = dataclasses.replace(
        engine.state, pools=tuple(jnp.full_like(p, jnp.nan) for p in engine.state.pools)
    )
    seen = []  # (request, tokens it has after the step, the step's drafts for it)
    collect = engine.runner.collect

    def recording_collect():
        results = collect()
        for res in results:
            for row, (r, index) in res.plan.samples.items():
                emitted = res.tokens(row)
                n = index + (len(emitted) if isinstance(emitted, list) else 1)
                seen.append((r, n, [int(t) for t in res.proposals[row]]))
        return results

    engine.runner.collect = recording_collect
    out, stats = engine.run(prompts, new)
    assert out == expected
    assert stats.draft_tokens > 0
    checked = 0
    for r, n, drafts in seen:
        if n > len(r.output):
            continue  # cut by max_new_tokens: nothing follows
        context = list(r.prompt) + r.output[:n]
        assert drafts == gemma.draft_reference(target, assistant, context, 3), (r.id, n)
        checked += 1
    assert checked >= len(prompts) * 3
    assert all_free(engine)
