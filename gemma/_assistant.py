"""`Gemma4Assistant`: Gemma 4's multi-token-prediction drafter (Hugging Face
`Gemma4AssistantForCausalLM`, model_type "gemma4_assistant").

The assistant is a small Gemma 4 decoder with no K/V of its own: each of its layers attends
to the K/V of the target model's last KV-writing layer of the same type (sliding or full),
as the target's KV-shared layers do. Its input at a draft is the target's scaled embedding
of the last token beside a hidden state of width `backbone_hidden_size` (the target's final,
normed hidden state of the token before it for the first draft, then the assistant's own
projected output), projected down to its width; it stays at the last token's position for
every draft of a round. Its logits come from its own (tied) embedding, or, with
`use_ordered_embeddings`, only over the tokens of the `centroid_top_k` best of
`num_centroids` token clusters (the others get the smallest computed logit less one).

Which K/V a draft reads: with the target's history h tokens long (positions < h, the last
token at position h not yet in it), full layers read positions [0, h) and sliding layers the
last `sliding_window` of them. `forward` takes that through the attention hook contract of
`gemma.Transformer` (`attention_fn(layer, q, None, None, state)`, `layer` naming the
assistant's own layer); `dense_kv_attention_fn` is the hook over K/V arrays and
`draft_reference` a whole drafting round on a dense target forward, the numerical reference
of the paged drafter in `swajax`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gemma._checkpoint import _block_entries, _SafetensorsIndex, _same, _transpose
from gemma._config import TransformerConfig
from gemma._dense_attention import DenseAttentionState, dense_attention, dense_attention_fn
from gemma._hf_config import config_from_hf
from gemma._hook import LayerRef
from gemma._layers import Block, Buffer, RMSNorm, _normal

MODEL_TYPE = "gemma4_assistant"


@dataclasses.dataclass(frozen=True)
class AssistantConfig:
    """Architecture of a Gemma 4 assistant.

    Attributes:
      body: the assistant's decoder layers as a Gemma 4 `TransformerConfig` of KV-writing
        layers (geometry, layer types, RoPE, norms); in the assistant none of them computes
        K/V (HF: `num_kv_shared_layers == num_hidden_layers`).
      backbone_hidden_size: the target model's hidden size.
      use_ordered_embeddings, num_centroids, centroid_top_k: the centroid-masked logits.
    """

    body: TransformerConfig
    backbone_hidden_size: int
    use_ordered_embeddings: bool = False
    num_centroids: int = 2048
    centroid_top_k: int = 32

    def __post_init__(self):
        b = self.body
        if b.family != "gemma4":
            raise ValueError(f"an assistant's layers are Gemma 4 layers, got family {b.family!r}")
        unsupported = [
            name
            for name, on in (
                ("per-layer inputs", b.has_per_layer_inputs),
                ("an MoE block", b.has_moe),
                ("a double-wide MLP", b.use_double_wide_mlp),
                ("KV-writing layers", b.num_kv_shared_layers != 0),
            )
            if on
        ]
        if unsupported:
            raise ValueError(f"a Gemma 4 assistant has no {', '.join(unsupported)}")
        if not isinstance(self.backbone_hidden_size, int) or self.backbone_hidden_size < 1:
            raise ValueError(
                f"backbone_hidden_size must be a positive int, got {self.backbone_hidden_size!r}"
            )
        if self.use_ordered_embeddings:
            nc, k = self.num_centroids, self.centroid_top_k
            if not (isinstance(nc, int) and nc >= 1 and b.vocab_size % nc == 0):
                raise ValueError(
                    f"num_centroids must divide the vocabulary ({b.vocab_size}), got {nc!r}"
                )
            if not (isinstance(k, int) and 1 <= k <= nc):
                raise ValueError(f"centroid_top_k must be in [1, {nc}], got {k!r}")

    def sources(self, target: TransformerConfig) -> tuple[int, ...]:
        """The target layer whose K/V each assistant layer reads (its last writer of the
        layer's type). ValueError naming the mismatch when `target` cannot host this
        assistant (another family, hidden size, vocabulary, window or K/V geometry)."""
        b = self.body
        problems = []
        if target.family != "gemma4":
            problems.append(f"the target is {target.family}, not gemma4")
        if target.hidden_size != self.backbone_hidden_size:
            problems.append(
                f"the target's hidden size is {target.hidden_size}, the assistant's "
                f"backbone_hidden_size {self.backbone_hidden_size}"
            )
        if target.vocab_size != b.vocab_size:
            problems.append(f"vocabularies differ ({target.vocab_size} vs {b.vocab_size})")
        writers = target.kv_writers
        for t in sorted(set(b.layer_types)):
            if t not in writers:
                problems.append(f"the target has no {t} layer writing K/V")
                continue
            mine = (b.type_num_kv_heads(t), b.type_head_dim(t))
            theirs = (target.type_num_kv_heads(t), target.type_head_dim(t))
            if mine != theirs:
                problems.append(
                    f"{t} layers' (KV heads, head_dim) are {mine} in the assistant, {theirs} in "
                    "the target"
                )
        if "sliding" in b.layer_types and b.sliding_window != target.sliding_window:
            problems.append(
                f"sliding windows differ ({b.sliding_window} vs {target.sliding_window})"
            )
        if problems:
            raise ValueError("the assistant does not fit the target model: " + "; ".join(problems))
        return tuple(writers[t] for t in b.layer_types)


def assistant_config_for(
    target: TransformerConfig, *, num_layers: int = 4, hidden_size: int | None = None, **kw
) -> AssistantConfig:
    """An assistant that fits `target` (a Gemma 4 config): num_layers layers (sliding ones, the
    last full), the target's heads, K/V geometry, window, RoPE and vocabulary, width
    hidden_size (default a quarter of the target's) and an MLP four times that; kw: the
    other `AssistantConfig` fields. For random-weight drafters (benchmarks, tests)."""
    d = hidden_size or max(target.hidden_size // 4, 64)
    body = target.replace(
        num_layers=num_layers,
        hidden_size=d,
        intermediate_size=4 * d,
        layer_types=("sliding",) * (num_layers - 1) + ("full",),
        num_kv_shared_layers=0,
        use_double_wide_mlp=False,
        per_layer_input_dim=0,
        per_layer_input_vocab_size=None,
        num_experts=0,
        num_experts_per_token=0,
        moe_intermediate_size=0,
        final_logit_softcap=None,
    )
    return AssistantConfig(body=body, backbone_hidden_size=target.hidden_size, **kw)


def assistant_config_from_hf(hf: dict) -> AssistantConfig:
    """An `AssistantConfig` from a "gemma4_assistant" config.json dict."""
    if hf.get("model_type") != MODEL_TYPE:
        raise ValueError(f"model_type must be {MODEL_TYPE!r}, got {hf.get('model_type')!r}")
    text = hf.get("text_config")
    if not isinstance(text, dict):
        raise ValueError("a gemma4_assistant config needs a text_config object")
    text = dict(text, model_type=text.get("model_type", "gemma4_text"))
    shared = text.get("num_kv_shared_layers")
    if shared not in (None, 0, text.get("num_hidden_layers")):
        raise ValueError(
            f"every assistant layer reads the target's K/V: num_kv_shared_layers must equal "
            f"num_hidden_layers ({text.get('num_hidden_layers')}), got {shared}"
        )
    text["num_kv_shared_layers"] = 0  # the body as writers; none writes in the assistant
    return AssistantConfig(
        body=config_from_hf(text),
        backbone_hidden_size=int(hf.get("backbone_hidden_size", 1536)),
        use_ordered_embeddings=bool(hf.get("use_ordered_embeddings", False)),
        num_centroids=int(hf.get("num_centroids", 2048)),
        centroid_top_k=int(hf.get("centroid_intermediate_top_k", 32)),
    )


def _reader_config(body: TransformerConfig) -> TransformerConfig:
    """body's layers behind one writer of each type: `Block(c, 2 + i)` is assistant layer i
    with no K/V projections (a KV-shared layer)."""
    return body.replace(
        num_layers=body.num_layers + 2,
        layer_types=("sliding", "full", *body.layer_types),
        num_kv_shared_layers=body.num_layers,
    )


class Gemma4Assistant(nnx.Module):
    """The assistant model (see the module text).

    Args:
      config: its `AssistantConfig`.
      rngs: random init (normal, std 0.02; norms and layer scalars at identity).
      dtype, param_dtype: compute and storage dtypes (logits are float32).
    """

    def __init__(
        self, config: AssistantConfig, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=None
    ):
        c = config.body
        self.config = config
        self.dtype = jnp.dtype(dtype)
        self.param_dtype = jnp.dtype(dtype if param_dtype is None else param_dtype)
        d, db = c.hidden_size, config.backbone_hidden_size
        kw = dict(rngs=rngs, dtype=self.dtype, param_dtype=self.param_dtype)
        readers = _reader_config(c)
        self.pre_projection = nnx.Param(_normal(rngs, (2 * db, d), self.param_dtype))
        self.blocks = nnx.List([Block(readers, 2 + i, **kw) for i in range(c.num_layers)])
        self.final_norm = RMSNorm(
            d, eps=c.rms_norm_eps, plus_one=False, param_dtype=self.param_dtype
        )
        self.post_projection = nnx.Param(_normal(rngs, (d, db), self.param_dtype))
        self.embedding = nnx.Param(_normal(rngs, (c.vocab_size, d), self.param_dtype))
        if config.use_ordered_embeddings:
            self.centroids = nnx.Param(_normal(rngs, (d, config.num_centroids), self.param_dtype))
            self.token_ordering = Buffer(jnp.arange(c.vocab_size, dtype=jnp.int32))
        else:
            self.centroids = self.token_ordering = None

    def forward(self, token_embeddings, hidden, positions, *, attention_fn, attention_state):
        """One draft: (logits f32[..., V], projected state [..., Db], attention_state).

        token_embeddings: the target's scaled embedding of the last token, [..., Db];
        hidden: the state beside it, [..., Db]; positions: i32[...] (RoPE of the queries).
        The hook gets `gemma.LayerRef.of(i)` for assistant layer i, q [..., N, H] and
        k = v = None.
        """
        x = jnp.concatenate([token_embeddings, hidden], axis=-1).astype(self.dtype)
        x = jnp.einsum("...e,ed->...d", x, self.pre_projection[...].astype(self.dtype))
        for i, block in enumerate(self.blocks):
            x, attention_state = block(
                x, positions, None, attention_fn, attention_state, LayerRef.of(i)
            )
        y = self.final_norm(x)
        projected = jnp.einsum("...d,de->...e", y, self.post_projection[...].astype(self.dtype))
        return self._logits(y), projected, attention_state

    def _logits(self, y):
        embedding = self.embedding[...].astype(self.dtype)
        if self.centroids is None:
            return jnp.einsum("...d,vd->...v", y, embedding, preferred_element_type=jnp.float32)
        c = self.config
        vocab = embedding.shape[0]
        per = vocab // c.num_centroids
        lead = y.shape[:-1]
        y2 = y.reshape(-1, y.shape[-1])  # [M, D]
        scores = jnp.einsum("md,dc->mc", y2, self.centroids[...].astype(self.dtype))
        _, top = jax.lax.top_k(scores, c.centroid_top_k)  # [M, k]
        clusters = self.token_ordering[...].reshape(c.num_centroids, per)
        chosen = clusters[top].reshape(y2.shape[0], -1)  # [M, k * per] token ids
        picked = jnp.einsum("md,msd->ms", y2, embedding[chosen], preferred_element_type=jnp.float32)
        fill = jnp.min(picked) - 1.0  # HF: the smallest computed logit of the call, less one
        out = jnp.full((y2.shape[0], vocab), fill, jnp.float32)
        out = out.at[jnp.arange(y2.shape[0])[:, None], chosen].set(picked)
        return out.reshape(*lead, vocab)

    @property
    def num_params(self) -> int:
        return int(sum(x.size for x in jax.tree.leaves(nnx.state(self, nnx.Param))))


# ------------------------------------------------------------------ loading


def _assistant_layout(model: Gemma4Assistant) -> list[tuple[str, tuple, nnx.Variable, object]]:
    """Every HF tensor of the assistant: (name, HF shape, Variable, HF array -> Variable)."""
    config = model.config
    c, readers = config.body, _reader_config(config.body)
    d, db = c.hidden_size, config.backbone_hidden_size
    entries = []

    def add(name, shape, var, to_model=_same, to_hf=_same):
        entries.append((name, tuple(shape), var, to_model))

    add("model.embed_tokens.weight", (c.vocab_size, d), model.embedding)
    add("model.norm.weight", (d,), model.final_norm.scale)
    add("pre_projection.weight", (d, 2 * db), model.pre_projection, _transpose)
    add("post_projection.weight", (db, d), model.post_projection, _transpose)
    for i, block in enumerate(model.blocks):
        _block_entries(readers, 2 + i, block, f"model.layers.{i}.", add)
    if model.centroids is not None:
        add(
            "masked_embedding.centroids.weight",
            (config.num_centroids, d),
            model.centroids,
            _transpose,
        )
        add("masked_embedding.token_ordering", (c.vocab_size,), model.token_ordering)
    return entries


def load_assistant(path, dtype=jnp.float32, *, param_dtype=None) -> Gemma4Assistant:
    """A `Gemma4Assistant` from a Hugging Face checkpoint directory (config.json of model_type
    "gemma4_assistant" and safetensors). ValueError naming the file or the tensors for a
    malformed config, missing, mis-shaped or unused tensors."""
    directory = Path(path)
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise ValueError(f"no config.json in {str(directory)!r}")
    try:
        hf = json.loads(config_file.read_text())
        config = assistant_config_from_hf(hf)
    except (ValueError, TypeError, KeyError) as e:
        raise ValueError(f"{str(config_file)!r}: {e}") from e
    tensors = _SafetensorsIndex(directory)
    model = nnx.eval_shape(
        lambda: Gemma4Assistant(config, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=param_dtype)
    )
    entries = _assistant_layout(model)
    missing = sorted(name for name, *_ in entries if name not in tensors)
    if missing:
        raise ValueError(f"missing tensors in {str(directory)!r}: {missing}")
    misshaped = [
        f"{name}: expected {shape}, got {tensors.shape(name)}"
        for name, shape, *_ in entries
        if tensors.shape(name) != shape
    ]
    if misshaped:
        raise ValueError(f"mis-shaped tensors in {str(directory)!r}: " + "; ".join(misshaped))
    used = {name for name, *_ in entries}
    tied = "lm_head.weight"
    if tied in tensors and np.array_equal(tensors.get(tied), tensors.get(entries[0][0])):
        used.add(tied)
    unused = sorted(set(tensors.keys()) - used)
    if unused:
        raise ValueError(f"tensors in {str(directory)!r} the assistant does not use: {unused}")
    for name, _, var, to_model in entries:
        array = np.asarray(to_model(tensors.get(name)))
        dt = jnp.int32 if name.endswith("token_ordering") else model.param_dtype
        var.set_value(jnp.asarray(array, dt))
    return model


# ------------------------------------------------------------------ reference


def dense_kv_attention_fn(config: AssistantConfig, keys, values, lengths):
    """The assistant's attention hook over dense K/V: keys[t] / values[t] ([B, S, K, H], the
    K/V of positions 0..S-1 of the target's writer of layer type t), lengths i32[B] the
    history h per row (full layers see positions < h, sliding ones the last window of them);
    queries q [B, N, H]."""
    b = config.body

    def attention_fn(layer: LayerRef, q, k, v, state):
        assert k is None and v is None, "assistant layers compute no K/V"
        t = b.layer_types[layer.like]
        kk, vv = keys[t], values[t]
        s = kk.shape[1]
        k_pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), kk.shape[:2])
        q_pos = (jnp.asarray(lengths, jnp.int32) - 1)[:, None]  # the newest key's position
        out = dense_attention(
            q[:, None],
            kk,
            vv,
            q_positions=q_pos,
            k_positions=k_pos,
            window=b.sliding_window if t == "sliding" else None,
            scale=1.0,
        )
        return out[:, 0], state

    return attention_fn


def draft_reference(
    target, assistant: Gemma4Assistant, tokens, num_drafts: int, *, return_outputs=False
):
    """The assistant's greedy drafts after `tokens` (a 1-D sequence of n >= 2 ids), on a dense
    forward of the target: history tokens[:-1] (h = n - 1), last token tokens[-1]. A list of
    ids; with return_outputs, also each draft's logits f32[k, V] and projected state [k, Db].

    The history is padded to a power of two (causal attention: positions < h do not see the
    padding), so one compiled program serves every h up to it."""
    tokens = np.asarray(tokens, np.int32)
    h = int(tokens.shape[0]) - 1
    if h < 1:
        raise ValueError(f"need at least two tokens, got {tokens.shape[0]}")
    assistant.config.sources(target.config)  # ValueError if it does not fit
    padded = np.zeros((1, 1 << (h - 1).bit_length()), np.int32)
    padded[0, :h] = tokens[:h]
    t_graphdef, t_params = nnx.split(target)
    a_graphdef, a_params = nnx.split(assistant)
    drafts, logits, projected = _draft(
        t_graphdef, t_params, a_graphdef, a_params, padded, tokens[-1:], h, num_drafts
    )
    drafts = [int(t) for t in np.asarray(drafts)]
    return (drafts, logits, projected) if return_outputs else drafts


@functools.partial(jax.jit, static_argnums=(0, 2, 7))
def _draft(t_graphdef, t_params, a_graphdef, a_params, history, last, h, num_drafts):
    target, assistant = nnx.merge(t_graphdef, t_params), nnx.merge(a_graphdef, a_params)
    tc = target.config
    types = assistant.config.body.layer_types
    writers = dict(zip(types, assistant.config.sources(tc), strict=True))
    n = history.shape[1]
    positions = jnp.arange(n, dtype=jnp.int32)[None]
    inner = dense_attention_fn(tc.layer_specs)
    kv0 = {
        t: jnp.zeros((1, n, tc.type_num_kv_heads(t), tc.type_head_dim(t)), target.dtype)
        for t in writers
    }

    def capture(layer: LayerRef, q, k, v, state):
        dense, keys, values = state
        t = tc.layer_types[layer.like]
        if k is not None and t in writers:  # kept when this is the writer (index traced)
            hit = jnp.asarray(layer.index) == writers[t]
            keys = {**keys, t: jnp.where(hit, k.astype(keys[t].dtype), keys[t])}
            values = {**values, t: jnp.where(hit, v.astype(values[t].dtype), values[t])}
        out, dense = inner(layer, q, k, v, dense)
        return out, (dense, keys, values)

    state = (DenseAttentionState(positions=positions), kv0, dict(kv0))
    _, (_, keys, values), hidden = target.forward(
        history,
        positions,
        attention_fn=capture,
        attention_state=state,
        logits_indices=jnp.reshape(h - 1, (1, 1)),
        return_hidden=True,
    )
    lengths = jnp.reshape(h, (1,)).astype(jnp.int32)
    fn = dense_kv_attention_fn(assistant.config, keys, values, lengths)
    embedding = target.embedding[...]
    scale = jnp.asarray(tc.embed_scale, embedding.dtype)
    state_h, token, drafts, logits_out, projected_out = hidden[:, 0], last, [], [], []
    for _ in range(num_drafts):
        e = (jnp.take(embedding, token, axis=0) * scale).astype(target.dtype)
        logits, state_h, _ = assistant.forward(
            e, state_h, lengths, attention_fn=fn, attention_state=None
        )
        token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        drafts.append(token[0])
        logits_out.append(logits[0])
        projected_out.append(state_h[0])
    return jnp.stack(drafts), jnp.stack(logits_out), jnp.stack(projected_out)
