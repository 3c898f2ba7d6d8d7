"""Token sampling: greedy, temperature, top-k and top-p, with per-call parameters as arrays.

Axis names: B = batch rows, V = vocabulary.

The sampling parameters are traced values (arrays), so changing temperature,
top-k or top-p between calls never recompiles the generation step.
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

    def as_arrays(self) -> dict[str, jax.Array]:
        """The parameters as float32/int32 scalars, ready to pass into a jitted step."""
        return dict(
            temperature=jnp.float32(self.temperature),
            top_k=jnp.int32(self.top_k or 0),
            top_p=jnp.float32(1.0 if self.top_p is None else self.top_p),
        )


def sample(
    logits: jax.Array,
    key: jax.Array,
    *,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
) -> jax.Array:
    """Draws one token per row.

    Args:
      logits: f[B, V].
      key: a PRNG key.
      temperature: f32 scalar; 0 selects argmax.
      top_k: i32 scalar; 0 keeps every token.
      top_p: f32 scalar in (0, 1]; 1 keeps every token.

    Returns:
      i32[B] token ids.
    """
    logits = logits.astype(jnp.float32)

    def greedy():
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def drawn():
        scaled = logits / jnp.maximum(temperature, 1e-6)
        # The sort of the vocabulary runs only when top-k or top-p filters something.
        filtering = (top_k > 0) | (top_p < 1.0)
        masked = jax.lax.cond(filtering, lambda: _filter(scaled, top_k, top_p), lambda: scaled)
        return jax.random.categorical(key, masked, axis=-1).astype(jnp.int32)

    # Greedy steps (temperature 0) pay for one argmax, not for the sampling path.
    return jax.lax.cond(temperature > 0.0, drawn, greedy)


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
