"""`Transformer`: the Gemma 3 / Gemma 4 text model and its attention hook.

`forward(tokens, positions, attention_fn=..., attention_state=...)` runs the
model with attention delegated to `attention_fn(i, q, k, v, state) -> (out,
state)` for every layer i (q after q-norm and RoPE, k/v after k-norm, RoPE and
value norm; k = v = None for KV-shared layers, which read their writer's KV
through the hook). `model(tokens)` is `forward` with the dense attention of
`gemma._dense_attention`, the numerical reference of the paged forward.

Tokens come batched (i32[B, T]) or packed (i32[T], the ragged batch of the KV
pool); positions have the same shape and drive RoPE only.

Axes: B batch, T tokens, D model width, V vocabulary, L layers, P per-layer-input width.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gemma._config import TransformerConfig
from gemma._dense_attention import DenseAttentionState, dense_attention_fn
from gemma._layers import Block, RMSNorm, _normal, check_moe_implementation


def _check_tokens(config: TransformerConfig, tokens, positions) -> None:
    """TypeError / ValueError for non-integer, mis-shaped or out-of-vocabulary token ids.

    The id range is checked only when the ids are concrete (not under tracing),
    before any conversion that could wrap large ids.
    """
    if not isinstance(tokens, jax.core.Tracer):
        tokens = np.asarray(tokens)
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise TypeError(f"tokens must be an integer array, got dtype {tokens.dtype}")
    if tokens.ndim not in (1, 2):
        raise ValueError(
            f"tokens must be i32[B, T] or packed i32[T], got shape {tuple(tokens.shape)}"
        )
    if positions is not None and tuple(np.shape(positions)) != tuple(tokens.shape):
        raise ValueError(
            f"positions shape {tuple(np.shape(positions))} must equal tokens shape "
            f"{tuple(tokens.shape)}"
        )
    if isinstance(tokens, jax.core.Tracer) or tokens.size == 0:
        return
    low, high = int(tokens.min()), int(tokens.max())
    limit = config.input_vocab_size
    if low < 0 or high >= limit:
        bad = low if low < 0 else high
        raise ValueError(f"token id {bad} is outside the vocabulary [0, {limit})")


class Transformer(nnx.Module):
    """Gemma 3 / Gemma 4 decoder-only text model (tied embeddings unless configured otherwise).

    Args:
      config: the architecture.
      rngs: random init of every parameter (normal, std 0.02; norms, layer
        scalars and router scales start at their identity values).
      dtype: compute dtype of activations (logits are always float32).
      param_dtype: storage dtype of the parameters.
      moe_implementation: 'ragged' (only the chosen experts, `jax.lax.ragged_dot`)
        or 'dense' (every expert, the reference); Gemma 4 MoE configs only.
    """

    def __init__(
        self,
        config: TransformerConfig,
        *,
        rngs: nnx.Rngs,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        moe_implementation: str = "ragged",
    ):
        if not isinstance(config, TransformerConfig):
            raise TypeError(f"config must be a TransformerConfig, got {type(config).__name__}")
        # Checked here too: the MoE blocks that also check it exist only in MoE configs.
        check_moe_implementation(moe_implementation)
        c = config
        self.config = config
        self.dtype = jnp.dtype(dtype)
        self.param_dtype = jnp.dtype(param_dtype)
        kw = dict(rngs=rngs, dtype=self.dtype, param_dtype=self.param_dtype)
        d = c.hidden_size
        self.embedding = nnx.Param(_normal(rngs, (c.vocab_size, d), self.param_dtype))
        self.layers = nnx.List(
            [Block(c, i, **kw, moe_implementation=moe_implementation) for i in range(c.num_layers)]
        )
        self.final_norm = RMSNorm(
            d, eps=c.rms_norm_eps, plus_one=c.family == "gemma3", param_dtype=self.param_dtype
        )
        self.lm_head = (
            None
            if c.tie_word_embeddings
            else nnx.Param(_normal(rngs, (d, c.vocab_size), self.param_dtype))
        )
        if c.has_per_layer_inputs:
            width = c.num_layers * c.per_layer_input_dim
            vocab = c.per_layer_input_vocab_size or c.vocab_size
            self.per_layer_embedding = nnx.Param(_normal(rngs, (vocab, width), self.param_dtype))
            self.per_layer_model_projection = nnx.Param(_normal(rngs, (d, width), self.param_dtype))
            self.per_layer_projection_norm = RMSNorm(
                c.per_layer_input_dim,
                eps=c.rms_norm_eps,
                plus_one=False,
                param_dtype=self.param_dtype,
            )
        else:
            self.per_layer_embedding = None

    # ----------------------------------------------------------------- forward

    def __call__(self, tokens, positions=None, *, segment_ids=None) -> jax.Array:
        """Dense forward: f32 logits [B, T, V] (or [T, V] for packed tokens).

        positions default to 0..T-1 per row; segment_ids (same shape, optional)
        separate sequences packed in one row.
        """
        _check_tokens(self.config, tokens, positions)
        tokens = jnp.asarray(tokens, jnp.int32)
        if positions is None:
            positions = jnp.broadcast_to(
                jnp.arange(tokens.shape[-1], dtype=jnp.int32), tokens.shape
            )
        positions = jnp.asarray(positions, jnp.int32)
        return _dense_forward(self, tokens, positions, segment_ids)

    def forward(self, tokens, positions, *, attention_fn, attention_state, logits_indices=None):
        """Logits f32[..., T, V] and the final attention_state, with attention through the hook.

        Args:
          tokens: i32[B, T] or packed i32[T]. Ids outside the vocabulary raise
            ValueError when the ids are concrete.
          positions: i32, same shape as tokens.
          attention_fn: `fn(i, q, k, v, state) -> (out, state)`; q [..., T, N, H],
            k/v [..., T, K, H] or None for KV-shared layers, out [..., T, N, H].
          attention_state: any pytree threaded through the hook.
          logits_indices: optional i32[..., M] token indices (per row) whose logits
            are wanted: the output is then f32[..., M, V] and the unembedding runs
            on those tokens only (e.g. the last token of each packed sequence).
        """
        c = self.config
        _check_tokens(c, tokens, positions)
        embedding = self.embedding[...]
        x = jnp.take(embedding, tokens, axis=0) * jnp.asarray(c.embed_scale, embedding.dtype)
        x = x.astype(self.dtype)  # [..., T, D]
        per_layer_inputs = self._per_layer_inputs(tokens, x) if c.has_per_layer_inputs else None
        for i, layer in enumerate(self.layers):
            ple = None if per_layer_inputs is None else per_layer_inputs[..., i, :]
            x, attention_state = layer(x, positions, ple, attention_fn, attention_state)
        if logits_indices is not None:
            x = jnp.take_along_axis(x, jnp.asarray(logits_indices)[..., None], axis=-2)
        x = self.final_norm(x)  # [..., T or M, D]
        if self.lm_head is None:
            logits = jnp.einsum(
                "...td,vd->...tv",
                x,
                embedding.astype(self.dtype),
                preferred_element_type=jnp.float32,
            )
        else:
            logits = jnp.einsum(
                "...td,dv->...tv",
                x,
                self.lm_head[...].astype(self.dtype),
                preferred_element_type=jnp.float32,
            )
        if c.final_logit_softcap is not None:
            cap = jnp.float32(c.final_logit_softcap)
            logits = jnp.tanh(logits / cap) * cap
        return logits.astype(jnp.float32), attention_state

    def _per_layer_inputs(self, tokens, x):
        """Gemma 4 per-layer embeddings (PLE): [..., T, L, P] from the token ids and embeddings."""
        c = self.config
        table = self.per_layer_embedding[...]
        p = c.per_layer_input_dim
        token_part = jnp.take(table, tokens, axis=0) * jnp.asarray(p**0.5, table.dtype)
        token_part = token_part.reshape(*tokens.shape, c.num_layers, p).astype(self.dtype)
        proj = jnp.einsum(
            "...td,dw->...tw", x, self.per_layer_model_projection[...].astype(self.dtype)
        )  # [..., T, L*P]
        proj = proj * jnp.asarray(c.hidden_size**-0.5, self.dtype)
        proj = self.per_layer_projection_norm(proj.reshape(*tokens.shape, c.num_layers, p))
        return (proj + token_part) * jnp.asarray(2.0**-0.5, self.dtype)

    # ------------------------------------------------------------------- utils

    @property
    def num_params(self) -> int:
        """Number of parameters (nnx.Param leaves; buffers such as layer scalars excluded)."""
        return int(sum(x.size for x in jax.tree.leaves(nnx.state(self, nnx.Param))))


@nnx.jit
def _dense_forward(model: Transformer, tokens, positions, segment_ids):
    state = DenseAttentionState(positions=positions, segment_ids=segment_ids)
    logits, _ = model.forward(
        tokens,
        positions,
        attention_fn=dense_attention_fn(model.config.layer_specs),
        attention_state=state,
    )
    return logits
