"""Token sampling: greedy, temperature, top-k and top-p, with per-row parameters as arrays.

Axis names: B = batch rows, V = vocabulary.

Every row of a step carries its own temperature, top-k, top-p and PRNG key (traced arrays), so
requests with different sampling parameters share one compiled step. The one static choice is
the mode (greedy, sample, filter: `SamplingParams.mode`, the cheapest exact for every row of
the step), because a conditional on a GPU syncs the host with the device every step.

Reproducibility: request r's token k is drawn with `fold_in(request_key(r), k)`, independent
of the batch row, the step and the other requests, so a preempted and recomputed request
draws the same tokens as an uninterrupted one.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

_NEG = -1e30  # finite "minus infinity" for masked logits
MAX_SEED = 2**63 - 1


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def check_seed(seed, name: str = "seed") -> int:
    """The seed as a Python int; ValueError unless an integer in [0, 2**63 - 1]."""
    if not _is_int(seed) or not 0 <= int(seed) <= MAX_SEED:
        raise ValueError(f"{name} must be an integer in [0, 2**63 - 1], got {seed!r}")
    return int(seed)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How the next token is drawn from the logits.

    Attributes:
      temperature: 0.0 means greedy (argmax); > 0 samples from softmax(logits / temperature).
      top_k: keep only the k most likely tokens (None or 0: all).
      top_p: keep the smallest set of most likely tokens whose probability reaches p
        (None or 1.0: all).
      seed: the request's PRNG seed (an integer in [0, 2**63 - 1]); None takes the engine
        call's seed combined with the request's position in it.
      num_draft_tokens: speculative decoding for this request: most drafted tokens verified
        per step, at most the engine's `EngineConfig.num_draft_tokens`; None: the engine's;
        0: none. The tokens are distributed as without it (greedy: the same tokens).
    """

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    num_draft_tokens: int | None = None

    def __post_init__(self):
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, numbers.Real) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
        object.__setattr__(self, "temperature", float(t))
        if self.top_k is not None:
            if not _is_int(self.top_k) or self.top_k < 0:
                raise ValueError(f"top_k must be None or an int >= 0, got {self.top_k!r}")
            object.__setattr__(self, "top_k", int(self.top_k))
        p = self.top_p
        if p is not None:
            if isinstance(p, bool) or not isinstance(p, numbers.Real) or not 0.0 < p <= 1.0:
                raise ValueError(f"top_p must be None or in (0, 1], got {p!r}")
            object.__setattr__(self, "top_p", float(p))
        if self.seed is not None:
            object.__setattr__(self, "seed", check_seed(self.seed))
        d = self.num_draft_tokens
        if d is not None and (not _is_int(d) or d < 0):
            raise ValueError(f"num_draft_tokens must be None or an int >= 0, got {d!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def mode(self) -> str:
        """The cheapest `sample` mode exact for these parameters (a static choice)."""
        if self.greedy:
            return "greedy"
        if (self.top_k or 0) > 0 or (self.top_p is not None and self.top_p < 1.0):
            return "filter"
        return "sample"

    def as_arrays(self) -> dict[str, jax.Array]:
        """The parameters as float32/int32 scalars, ready to pass into a jitted step."""
        return dict(
            temperature=jnp.float32(self.temperature),
            top_k=jnp.int32(self.top_k or 0),
            top_p=jnp.float32(1.0 if self.top_p is None else self.top_p),
        )

    def row_values(self) -> tuple[float, int, float]:
        """(temperature, top_k, top_p) of one batch row (0 and 1.0 for "keep all")."""
        return self.temperature, self.top_k or 0, 1.0 if self.top_p is None else self.top_p


MODES = ("filter", "sample", "greedy")


def step_mode(params) -> str:
    """The cheapest mode exact for every SamplingParams in `params` (greedy if none)."""
    modes = {p.mode for p in params}
    return next((m for m in MODES if m in modes), "greedy")


def request_key_data(seed: int, index: int | None = None) -> np.ndarray:
    """u32[2]: the threefry key data of a request from its seed (and position in a call).

    Host-side (numpy's SeedSequence mixes the entropy), so choosing a request's key costs no
    device work. `jax.random.wrap_key_data` turns it into a key.
    """
    entropy = [check_seed(seed)] if index is None else [check_seed(seed), int(index)]
    return np.random.SeedSequence(entropy).generate_state(2, np.uint32)


def token_keys(key_data: jax.Array, token_index: jax.Array) -> jax.Array:
    """Keys [B] for each row's next token: fold_in(key of the row's request, token index).

    key_data: u32[B, 2] (`request_key_data` per row); token_index: i32[B].
    """
    keys = jax.random.wrap_key_data(key_data)
    return jax.vmap(jax.random.fold_in)(keys, token_index.astype(jnp.uint32))


def sample(
    logits: jax.Array,
    key: jax.Array,
    *,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    mode: str = "filter",
) -> jax.Array:
    """Draws one token per row.

    Args:
      logits: f[B, V].
      key: one PRNG key (split per row) or keys [B], one per row.
      temperature: f32 scalar or [B]; 0 selects argmax.
      top_k: i32 scalar or [B]; 0 keeps every token.
      top_p: f32 scalar or [B] in (0, 1]; 1 keeps every token.
      mode: static. "filter" (default) is exact for every parameter value, so changing them
        never recompiles; "sample" (temperature > 0, no top-k / top-p) and "greedy"
        (temperature 0) skip the work those parameters make useless: the sort of the
        vocabulary, the softmax.

    Returns:
      i32[B] token ids.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    logits = logits.astype(jnp.float32)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if mode == "greedy":
        return greedy
    batch = logits.shape[0]
    temperature = jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), (batch,))
    top_k = jnp.broadcast_to(jnp.asarray(top_k, jnp.int32), (batch,))
    top_p = jnp.broadcast_to(jnp.asarray(top_p, jnp.float32), (batch,))
    keys = key if key.shape == (batch,) else jax.random.split(key, batch)
    scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
    masked = _filter(scaled, top_k, top_p) if mode == "filter" else scaled
    drawn = jax.vmap(jax.random.categorical)(keys, masked).astype(jnp.int32)
    return jnp.where(temperature > 0.0, drawn, greedy)


def _filter(scaled, top_k, top_p):
    """scaled logits f[B, V] with the tokens outside top-k / top-p set to a finite -inf.

    top_k i32[B], top_p f32[B].
    """
    vocab = scaled.shape[-1]
    sorted_logits = jnp.sort(scaled, axis=-1)[:, ::-1]  # [B, V] descending
    rank = jnp.arange(vocab)[None]  # [1, V]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)[:, None]  # [B, 1]
    kth = jnp.take_along_axis(sorted_logits, k - 1, axis=-1)  # [B, 1]
    # top-p over the top-k survivors: a token stays while the mass before it is < p.
    sorted_probs = jax.nn.softmax(jnp.where(rank < k, sorted_logits, _NEG), axis=-1)
    mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
    keep_sorted = (mass_before < top_p[:, None]) & (rank < k)
    # The smallest kept logit is the threshold; ties at the threshold are all kept.
    threshold = jnp.min(jnp.where(keep_sorted, sorted_logits, jnp.inf), axis=-1, keepdims=True)
    threshold = jnp.maximum(threshold, kth)
    return jnp.where(scaled >= threshold, scaled, _NEG)


def verify_drafts(
    logits: jax.Array,
    drafts: jax.Array,
    num_drafts: jax.Array,
    keys: jax.Array,
    *,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    mode: str = "filter",
) -> tuple[jax.Array, jax.Array]:
    """Speculative verification: which drafted tokens each row keeps, and its next token.

    Row b fed its last token and then `num_drafts[b]` drafted tokens d_1 .. d_n; logits[b, j]
    are the target's logits after its j-th fed token (j = 0: after the last accepted token),
    so position j judges d_{j+1}. Greedy rows keep the drafts while each equals the argmax,
    then take the argmax. Sampling rows use the rejection rule of speculative sampling for a
    deterministic drafter (q = one-hot at the draft): d_{j+1} is kept with probability
    p_j(d_{j+1}) under the row's temperature / top-k / top-p; at the first rejection the next
    token is drawn from p_j with d_{j+1} removed (p renormalised), and when every draft is
    kept from p_n (the bonus token). The tokens a row emits are thus distributed exactly as
    the target's own samples.

    Args:
      logits: f[B, K + 1, V].
      drafts: i32[B, K] drafted tokens (entries past num_drafts are ignored).
      num_drafts: i32[B] in [0, K].
      keys: PRNG keys [B, K + 1], one per position (the key of the token drawn there).
      temperature, top_k, top_p: per row [B] (as `sample`).
      mode: static, as `sample`.

    Returns:
      (tokens i32[B, K + 1], accepted i32[B]): row b emits tokens[b, : accepted[b] + 1]
      (the kept drafts, then its next token).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    batch, positions, vocab = logits.shape
    k = positions - 1
    if drafts.shape != (batch, k) or num_drafts.shape != (batch,):
        raise ValueError(
            f"drafts must be [B={batch}, K={k}] and num_drafts [B], got {drafts.shape} and "
            f"{num_drafts.shape}"
        )
    logits = logits.astype(jnp.float32)
    real = jnp.arange(k)[None, :] < num_drafts[:, None]  # [B, K]
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, K + 1]
    kept = jnp.cumprod(((greedy[:, :k] == drafts) & real).astype(jnp.int32), axis=1)
    greedy_accepted = jnp.sum(kept, axis=1).astype(jnp.int32)
    if mode == "greedy":
        return greedy, greedy_accepted
    t = jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), (batch,))
    rep = lambda x: jnp.repeat(jnp.broadcast_to(x, (batch,)), positions)  # noqa: E731
    scaled = (logits / jnp.maximum(t, 1e-6)[:, None, None]).reshape(batch * positions, vocab)
    if mode == "filter":
        scaled = _filter(
            scaled, rep(jnp.asarray(top_k, jnp.int32)), rep(jnp.asarray(top_p, jnp.float32))
        )
    masked = scaled.reshape(batch, positions, vocab)
    probs = jax.nn.softmax(masked, axis=-1)
    flat_keys = keys.reshape(batch * positions)
    u_keys = jax.vmap(lambda key: jax.random.fold_in(key, 1))(flat_keys)
    r_keys = jax.vmap(lambda key: jax.random.fold_in(key, 2))(flat_keys)
    u = jax.vmap(jax.random.uniform)(u_keys).reshape(batch, positions)[:, :k]
    p_draft = jnp.take_along_axis(probs[:, :k], drafts[..., None], axis=-1)[..., 0]  # [B, K]
    kept = jnp.cumprod(((u < p_draft) & real).astype(jnp.int32), axis=1)
    accepted = jnp.sum(kept, axis=1).astype(jnp.int32)
    # position j's next token if d_{j+1} is rejected there (j < n), or the bonus (j = n)
    removed = jnp.concatenate([drafts, jnp.full((batch, 1), -1, drafts.dtype)], axis=1)
    removed = jnp.where(jnp.arange(positions)[None, :] < num_drafts[:, None], removed, -1)
    vocab_ids = jnp.arange(vocab)[None, None, :]
    residual = jnp.where(vocab_ids == removed[..., None], _NEG, masked)
    drawn = jax.vmap(jax.random.categorical)(r_keys, residual.reshape(-1, vocab))
    drawn = drawn.reshape(batch, positions).astype(jnp.int32)
    padded = jnp.concatenate([drafts, jnp.zeros((batch, 1), drafts.dtype)], axis=1)
    sampled = jnp.where(jnp.arange(positions)[None, :] < accepted[:, None], padded, drawn)
    sampling = t > 0.0
    tokens = jnp.where(sampling[:, None], sampled, greedy)
    return tokens.astype(jnp.int32), jnp.where(sampling, accepted, greedy_accepted)
