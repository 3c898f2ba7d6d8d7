"""Token sampling: greedy, temperature, top-k and top-p, with per-call parameters as arrays.

Axis names: B = batch rows, V = vocabulary.

The sampling parameters are traced values (arrays); the engine compiles one step per sampling
mode (greedy, sample, filter: `SamplingParams.mode`), so changing temperature, top-k or top-p
within a mode never recompiles the generation step.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

_NEG = -1e30  # finite "minus infinity" for masked logits


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How the next token is drawn from the logits.

    Attributes:
      temperature: 0.0 means greedy (argmax); > 0 samples from softmax(logits / temperature).
      top_k: keep only the k most likely tokens (None or 0: all).
      top_p: keep the smallest set of most likely tokens whose probability reaches p
        (None or 1.0: all).
    """

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self):
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 0:
            raise ValueError(f"top_k must be None or >= 0, got {self.top_k}")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be None or in (0, 1], got {self.top_p}")

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


MODES = ("filter", "sample", "greedy")


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
      key: a PRNG key.
      temperature: f32 scalar; 0 selects argmax.
      top_k: i32 scalar; 0 keeps every token.
      top_p: f32 scalar in (0, 1]; 1 keeps every token.
      mode: static. "filter" (default) is exact for every parameter value, so changing them
        never recompiles; "sample" (temperature > 0, no top-k / top-p) and "greedy"
        (temperature 0) skip the work those parameters make useless: the sort of the
        vocabulary, the softmax. The modes are static rather than a `lax.cond` because a
        conditional on a GPU syncs the host with the device every step.

    Returns:
      i32[B] token ids.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    logits = logits.astype(jnp.float32)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if mode == "greedy":
        return greedy
    scaled = logits / jnp.maximum(temperature, 1e-6)
    masked = _filter(scaled, top_k, top_p) if mode == "filter" else scaled
    drawn = jax.random.categorical(key, masked, axis=-1).astype(jnp.int32)
    return jnp.where(temperature > 0.0, drawn, greedy)


def _filter(scaled, top_k, top_p):
    """scaled logits f[B, V] with the tokens outside top-k / top-p set to a finite -inf."""
    vocab = scaled.shape[-1]
    sorted_logits = jnp.sort(scaled, axis=-1)[:, ::-1]  # [B, V] descending
    rank = jnp.arange(vocab)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    kth = jnp.take_along_axis(sorted_logits, (k - 1)[None, None].repeat(scaled.shape[0], 0), -1)
    # top-p over the top-k survivors: a token stays while the mass before it is < p.
    sorted_probs = jax.nn.softmax(jnp.where(rank[None] < k, sorted_logits, _NEG), axis=-1)
    mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
    keep_sorted = (mass_before < top_p) & (rank[None] < k)
    # The smallest kept logit is the threshold; ties at the threshold are all kept.
    threshold = jnp.min(jnp.where(keep_sorted, sorted_logits, jnp.inf), axis=-1, keepdims=True)
    threshold = jnp.maximum(threshold, kth)
    return jnp.where(scaled >= threshold, scaled, _NEG)
