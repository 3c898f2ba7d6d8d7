"""Sampling: greedy, temperature, top-k, top-p vs hand-computed distributions; no recompiles."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from swajax._sampling import SamplingParams, sample, verify_drafts

PROBS = np.array([0.5, 0.3, 0.15, 0.05])


def _freqs(params, n=20000, seed=0):
    logits = jnp.log(jnp.asarray(PROBS, jnp.float32))[None].repeat(n, 0)
    tokens = jax.jit(sample)(logits, jax.random.key(seed), **params.as_arrays())
    return np.bincount(np.asarray(tokens), minlength=4) / n


@pytest.mark.parametrize(
    "params, expected",
    [
        (SamplingParams(0.0), [1, 0, 0, 0]),
        (SamplingParams(1.0), PROBS),
        (SamplingParams(1.0, top_k=2), [0.625, 0.375, 0, 0]),
        (SamplingParams(1.0, top_p=0.7), [0.625, 0.375, 0, 0]),
        (SamplingParams(1.0, top_p=0.85), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0]),
        (SamplingParams(1.0, top_k=3, top_p=0.5), [1, 0, 0, 0]),
    ],
)
def test_distribution_matches_hand_computed(params, expected):
    chex.assert_trees_all_close(
        _freqs(params), np.asarray(expected, np.float64), atol=0.015, rtol=1e-7
    )


def test_temperature_sharpens():
    # p_i ** (1/T) renormalised, T = 0.5
    expected = PROBS**2 / np.sum(PROBS**2)
    chex.assert_trees_all_close(_freqs(SamplingParams(0.5)), expected, atol=0.015, rtol=1e-7)


def test_greedy_is_argmax_per_row():
    logits = jax.random.normal(jax.random.key(1), (8, 50))
    out = sample(logits, jax.random.key(2), **SamplingParams().as_arrays())
    chex.assert_trees_all_equal(np.asarray(out), np.argmax(np.asarray(logits), -1))


def test_changing_parameters_does_not_recompile():
    traces = []

    @jax.jit
    def f(logits, key, temperature, top_k, top_p):
        traces.append(1)
        return sample(logits, key, temperature=temperature, top_k=top_k, top_p=top_p)

    logits = jnp.zeros((2, 16))
    for p in [SamplingParams(0.0), SamplingParams(0.7, top_k=5), SamplingParams(1.3, top_p=0.9)]:
        f(logits, jax.random.key(0), **p.as_arrays())
    assert len(traces) == 1


@pytest.mark.parametrize(
    "kwargs", [dict(temperature=-1.0), dict(top_k=-2), dict(top_p=0.0), dict(top_p=1.5)]
)
def test_bad_parameters_raise(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


MODES = [
    (SamplingParams(0.0), "greedy"),
    (SamplingParams(0.0, top_k=3), "greedy"),
    (SamplingParams(0.8), "sample"),
    (SamplingParams(0.8, top_p=1.0), "sample"),
    (SamplingParams(0.8, top_k=3), "filter"),
    (SamplingParams(1.0, top_p=0.6), "filter"),
]


@pytest.mark.parametrize("params, mode", MODES)
def test_mode_of_parameters(params, mode):
    """The step mode each request's parameters select (filter: the general mode)."""
    assert params.mode == mode


@pytest.mark.parametrize("params, mode", [(p, m) for p, m in MODES if m != "filter"])
def test_static_mode_equals_filter_mode(params, mode):
    """The engine's static fast paths draw exactly what the general mode ("filter", the
    default of `sample`, checked against hand-computed distributions above) draws."""
    assert params.mode == mode
    logits = jax.random.normal(jax.random.key(5), (6, 50))
    key = jax.random.key(9)
    want = sample(logits, key, **params.as_arrays())
    got = sample(logits, key, **params.as_arrays(), mode=params.mode)
    chex.assert_trees_all_equal(got, want)


def test_mode_validation():
    with pytest.raises(ValueError, match="mode"):
        sample(jnp.zeros((1, 4)), jax.random.key(0), **SamplingParams().as_arrays(), mode="nucleus")


def _chi_square(counts, probs):
    """Pearson's statistic of observed counts against probabilities (cells with p > 0)."""
    counts, probs = np.asarray(counts, np.float64), np.asarray(probs, np.float64)
    n = counts.sum()
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was drawn"
    expected = n * probs[keep]
    return float(((counts[keep] - expected) ** 2 / expected).sum())


# Pearson chi-square critical values at p = 0.001 by degrees of freedom
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47}


@pytest.mark.parametrize(
    "params, draft",
    [
        (SamplingParams(1.0), 0),  # a likely draft
        (SamplingParams(1.0), 3),  # an unlikely one
        (SamplingParams(0.7, top_k=3), 1),
        (SamplingParams(1.0, top_p=0.85), 3),  # a draft top-p removes: always rejected
    ],
)
def test_speculative_sampling_keeps_the_target_distribution(params, draft):
    """Two positions, a deterministic drafter: the first token emitted is distributed as the
    target's own sample at position 0, and after a kept draft the next one as position 1's
    (chi-square at p = 0.001 on 40,000 rows); greedy rows keep drafts that equal the argmax."""
    n, vocab = 40_000, 4
    p0, p1 = PROBS, np.array([0.1, 0.2, 0.3, 0.4])
    logits = jnp.log(jnp.asarray(np.stack([p0, p1, p1]), jnp.float32))[None].repeat(n, 0)
    drafts = jnp.full((n, 2), draft, jnp.int32)
    keys = jax.random.split(jax.random.key(7), (n, 3))
    tokens, accepted = jax.jit(verify_drafts, static_argnames="mode")(
        logits,
        drafts,
        jnp.full((n,), 2, jnp.int32),
        keys,
        **params.as_arrays(),
        mode=params.mode,
    )
    tokens, accepted = np.asarray(tokens), np.asarray(accepted)

    def target(p):
        z = np.log(p) / params.temperature
        kept = np.ones(vocab, bool)
        order = np.argsort(-z)
        if params.top_k:
            kept[order[params.top_k :]] = False
        q = np.exp(z - z.max()) * kept
        q /= q.sum()
        if params.top_p is not None:
            before = np.cumsum(q[order]) - q[order]
            kept[order[before >= params.top_p]] = False
            q = q * kept
            q /= q.sum()
        return q

    first = np.bincount(tokens[:, 0], minlength=vocab)
    assert _chi_square(first, target(p0)) < CHI2_999[int((target(p0) > 0).sum()) - 1]
    after = tokens[accepted >= 1, 1]  # the draft was kept: the next token follows p1
    if len(after) > 1000:
        second = np.bincount(after, minlength=vocab)
        assert _chi_square(second, target(p1)) < CHI2_999[int((target(p1) > 0).sum()) - 1]
    assert np.all(tokens[np.arange(n), 0][accepted >= 1] == draft)
    # greedy: drafts kept while they equal the argmax (0, then 3), then the argmax
    greedy = SamplingParams(0.0)
    for d, want_tokens, want_accepted in (([0, 3], [0, 3, 3], 2), ([0, 1], [0, 3, 3], 1)):
        t, a = verify_drafts(
            logits[:1],
            jnp.asarray([d], jnp.int32),
            jnp.asarray([2], jnp.int32),
            keys[:1],
            **greedy.as_arrays(),
            mode="greedy",
        )
        assert np.asarray(t)[0].tolist() == want_tokens and int(a[0]) == want_accepted
