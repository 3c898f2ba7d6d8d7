"""`Transformer`: the Gemma 3 / Gemma 4 text model and its attention hook.

`forward(tokens, positions, attention_fn=..., attention_state=...)` runs the
model with attention delegated to `attention_fn(layer, q, k, v, state) -> (out,
state)` for every layer (`layer` a `gemma.LayerRef`: a static layer with the same
spec, and the layer's own index, traced inside a scanned run; q after q-norm and
RoPE, k/v after k-norm, RoPE and value norm; k = v = None for KV-shared layers,
which read their writer's KV through the hook). The layers of each repeating run
(`config.layer_runs`) run under one `lax.scan` over stacked parameters.
`model(tokens)` is `forward` with the dense attention of `gemma._dense_attention`,
the numerical reference of the paged forward.

Tokens come batched (i32[B, T]) or packed (i32[T], the ragged batch of the KV
pool); positions have the same shape and drive RoPE only.

Axes: B batch, T tokens, D model width, V vocabulary, L layers, P per-layer-input width.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gemma._config import LayerRun, TransformerConfig
from gemma._dense_attention import DenseAttentionState, dense_attention_fn
from gemma._hook import LayerRef
from gemma._layers import (
    Block,
    RMSNorm,
    StackedRow,
    _normal,
    check_moe_implementation,
)
from gemma._sharding import partition_specs
from pallas_kernels.stacked_matmul import MAX_ROWS


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
      moe_implementation: 'auto' (default: only the chosen experts, through the Pallas
        grouped matmul on a Hopper GPU, else `jax.lax.ragged_dot`), 'ragged', 'pallas' or
        'dense' (every expert, the reference); see `gemma._layers.MoE`. Gemma 4 MoE only.
      scan_layers: True (default): the layers of each repeating run of `config.layer_runs`
        are stored stacked (a leading axis of the run's repetitions, built at construction
        and kept so by `from_pretrained` / `restore_params`) and run under one `lax.scan`,
        so compile time does not grow with depth. False: one Block per layer, unrolled (the
        same numbers; the comparison point).

    `blocks[g][r]` is the Block at position r of run `layer_runs[g]`; `layer_block(i)` finds
    layer i's Block and its index in the stack.
    """

    def __init__(
        self,
        config: TransformerConfig,
        *,
        rngs: nnx.Rngs,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        moe_implementation: str = "auto",
        scan_layers: bool = True,
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
        self.scan_layers = bool(scan_layers)
        self.in_place_max_rows = MAX_ROWS
        self.layer_runs = c.layer_runs if scan_layers else (LayerRun(0, c.num_layers, 1),)
        self.blocks = nnx.List(
            [
                _build_run(run, lambda i: Block(c, i, **kw, moe_implementation=moe_implementation))
                for run in self.layer_runs
            ]
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

    def forward(
        self,
        tokens,
        positions,
        *,
        attention_fn,
        attention_state,
        logits_indices=None,
        return_hidden=False,
    ):
        """Logits f32[..., T, V] and the final attention_state, with attention through the hook
        (and, with return_hidden, the final normed hidden states [..., T or M, D] last).

        Args:
          tokens: i32[B, T] or packed i32[T]. Ids outside the vocabulary raise
            ValueError when the ids are concrete.
          positions: i32, same shape as tokens.
          attention_fn: `fn(layer, q, k, v, state) -> (out, state)` with `layer` a
            `gemma.LayerRef`; q [..., T, N, H],
            k/v [..., T, K, H] or None for KV-shared layers, out [..., T, N, H].
          attention_state: any pytree threaded through the hook.
          logits_indices: optional i32[..., M] token indices (per row) whose logits
            are wanted: the output is then f32[..., M, V] and the unembedding runs
            on those tokens only (e.g. the last token of each packed sequence).

        A scanned run reads each layer's matrices in their stack (`gemma._layers.StackedRow`):
        through `pallas_kernels.stacked_matmul` for products of up to `in_place_max_rows`
        rows, the MoE experts through the grouped matmul up to `MoE.in_place_max_rows` token
        copies; larger products (prefill steps) slice the layer's matrix, which XLA copies.
        """
        c = self.config
        _check_tokens(c, tokens, positions)
        embedding = self.embedding[...]
        x = jnp.take(embedding, tokens, axis=0) * jnp.asarray(c.embed_scale, embedding.dtype)
        x = x.astype(self.dtype)  # [..., T, D]
        per_layer_inputs = self._per_layer_inputs(tokens, x) if c.has_per_layer_inputs else None
        for run, blocks in zip(self.layer_runs, self.blocks, strict=True):
            ple = (
                None if per_layer_inputs is None else per_layer_inputs[..., run.first : run.stop, :]
            )
            if run.scanned:
                x, attention_state = _scan_run(
                    run,
                    blocks,
                    x,
                    positions,
                    ple,
                    attention_fn,
                    attention_state,
                    self.in_place_max_rows,
                )
                continue
            for r, block in enumerate(blocks):
                i = run.first + r
                x, attention_state = block(
                    x,
                    positions,
                    None if ple is None else ple[..., r, :],
                    attention_fn,
                    attention_state,
                    LayerRef.of(i),
                )
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
        if return_hidden:
            return logits.astype(jnp.float32), attention_state, x
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

    def layer_block(self, i: int) -> tuple[Block, int | None]:
        """(Block, index): layer i's Block and its index along the stacked axis (None unrolled)."""
        if not 0 <= i < self.config.num_layers:
            raise ValueError(f"layer {i} is outside [0, {self.config.num_layers})")
        for run, blocks in zip(self.layer_runs, self.blocks, strict=True):
            if i in run.layers:
                c, r = divmod(i - run.first, run.period)
                return blocks[r], (c if run.scanned else None)
        raise AssertionError(i)

    def layer_param(self, i: int, name: str) -> jax.Array | None:
        """Layer i's array `name` (a dotted path in its Block, e.g. "attn.q_proj"), its own
        slice of a stacked array; None where the layer has none (k_proj of a KV-shared layer)."""
        var, index = self._layer_variable(i, name)
        if var is None:
            return None
        value = var.get_value()
        if index is None:
            return value
        if isinstance(value, jax.ShapeDtypeStruct):  # an abstract model (nnx.eval_shape)
            return jax.ShapeDtypeStruct(value.shape[1:], value.dtype)
        return value[index]

    def set_layer_param(self, i: int, name: str, value) -> None:
        """Set layer i's array `name` (see `layer_param`); other layers are unchanged."""
        var, index = self._layer_variable(i, name)
        if var is None:
            raise ValueError(f"layer {i} has no {name!r}")
        value = jnp.asarray(value, var[...].dtype)
        var.set_value(value if index is None else var[...].at[index].set(value))

    def _layer_variable(self, i: int, name: str):
        block, index = self.layer_block(i)
        obj = block
        for part in name.split("."):
            if not hasattr(obj, part):
                raise ValueError(f"layer {i} has no {name!r} ({part!r} not found)")
            obj = getattr(obj, part)
            if obj is None:
                return None, index
        if not isinstance(obj, nnx.Variable):
            raise ValueError(f"{name!r} of layer {i} is a {type(obj).__name__}, not an array")
        return obj, index

    def partition_specs(self, tp: int) -> nnx.State:
        """The PartitionSpec of every leaf of the model's state over tp tensor-parallel devices
        (mesh axis "model"; see `gemma._sharding`). ValueError when tp cannot split the heads."""
        return partition_specs(self, tp)

    def for_tensor_parallel(self, tp: int) -> Transformer:
        """The model as a mesh of tp tensor-parallel devices serves it, sharing this one's arrays
        (nothing copied). With tp > 1 every scanned product takes its layer's slice of the stack
        (`in_place_max_rows = 0`, and `set_experts_in_place_max_rows(view, 0)` for the MoE
        experts): the Pallas kernels take whole operands, so a stack sharded over the model
        axis given to one whole would be gathered whole onto every device, where a layer's
        slice is gathered (or, for the dense matrices, multiplied shard by shard) one at a
        time."""
        if tp <= 1:
            return self
        view = nnx.merge(*nnx.split(self))
        view.in_place_max_rows = 0
        set_experts_in_place_max_rows(view, 0)
        return view

    @property
    def num_params(self) -> int:
        """Number of parameters (nnx.Param leaves; buffers such as layer scalars excluded)."""
        return int(sum(x.size for x in jax.tree.leaves(nnx.state(self, nnx.Param))))


def set_unit_size_attention_logits(model: Transformer) -> None:
    """Sets every q-norm scale so that scale * q.k is about unit-size for unit-RMS q and k.

    For random weights: a trained model's attention logits are O(1), random Gemma 4 weights at
    attention scale 1 give |q.k| ~ sqrt(head_dim) and near one-hot softmaxes that turn any
    rounding difference (another batch, another kernel) into other greedy tokens. Tests and
    benchmarks that compare tokens across runs use this. In place.
    """
    for blocks in model.blocks:
        for block in blocks:
            attn = block.attn
            spec = model.config.layer_specs[attn.layer_index]
            norm = attn.q_norm
            head_dim = norm.scale.shape[-1]
            target = 1.0 / (spec.scale * head_dim**0.5)  # |q.k| ~ sqrt(D) for unit-RMS rows
            value = target - 1.0 if norm.plus_one else target
            norm.scale[...] = jnp.full_like(norm.scale[...], value)


def set_experts_in_place_max_rows(model: Transformer, rows: int) -> None:
    """Sets up to how many token copies (tokens x experts per token) every MoE layer reads its
    experts in their stack (`gemma._layers.EXPERTS_IN_PLACE_MAX_ROWS`, the default); 0: never,
    each layer's experts copied out of the stack first as before the tile kernel. In place.
    ValueError for a negative or non-integer `rows`."""
    if isinstance(rows, bool) or not isinstance(rows, int | np.integer) or rows < 0:
        raise ValueError(f"rows must be an integer >= 0, got {rows!r}")
    for blocks in model.blocks:
        for block in blocks:
            if block.moe is not None:
                block.moe.in_place_max_rows = int(rows)


def _build_run(run: LayerRun, make_block) -> nnx.List:
    """The Blocks of one run, built layer by layer in index order (the same random values as
    unrolled construction). A scanned run's Blocks have every array stacked over the run's
    repetitions; each layer is written into the stack and dropped before the next is built, so
    construction holds the model once plus one layer."""
    if not run.scanned:
        return nnx.List([make_block(i) for i in run.layers])
    graphdefs, stacks = [], []
    for c in range(run.count):
        for r in range(run.period):
            graphdef, state = nnx.split(make_block(run.first + c * run.period + r))
            if c == 0:
                graphdefs.append(graphdef)
                stacks.append(
                    jax.tree.map(lambda x: jnp.zeros((run.count, *x.shape), x.dtype), state)
                )
            stacks[r] = jax.tree.map(
                lambda s, x, c=c: _set_row(s, x, jnp.int32(c)), stacks[r], state
            )
    return nnx.List([nnx.merge(g, s) for g, s in zip(graphdefs, stacks, strict=True)])


@functools.partial(jax.jit, donate_argnums=0)
def _set_row(stack, x, c):
    return jax.lax.dynamic_update_index_in_dim(stack, x.astype(stack.dtype), c, 0)


def _scan_run(run: LayerRun, blocks, x, positions, ple, attention_fn, attention_state, max_rows):
    """The run's repetitions under one `lax.scan`: vectors (norm scales, layer scalars) sliced
    per repetition, every matrix left in its stack as a `StackedRow` that `linear` (products
    of up to `max_rows` rows) and the MoE read in place; the activations and the attention
    state carried (pool roots update in place)."""
    graphdef, stacked = nnx.split(blocks)
    if ple is not None:  # [..., T, run layers, P] -> [count, ..., T, period, P]
        ple = ple.reshape(*ple.shape[:-2], run.count, run.period, ple.shape[-1])
        ple = jnp.moveaxis(ple, -3, 0)
    whole = jax.tree.map(lambda a: a.ndim >= 3, stacked)
    sliced = jax.tree.map(lambda a, w: None if w else a, stacked, whole)

    def body(carry, xs):
        x, state = carry
        params, c, ple_c = xs
        # The stacks stay where they are; the vectors come sliced.
        params = jax.tree.map(
            lambda a, w, v: StackedRow(a, c, max_rows) if w else v,
            stacked,
            whole,
            params,
            is_leaf=lambda v: v is None,
        )
        for r, block in enumerate(nnx.merge(graphdef, params)):
            like = run.first + r
            layer = LayerRef(like, like + c * run.period)
            p = None if ple_c is None else ple_c[..., r, :]
            x, state = block(x, positions, p, attention_fn, state, layer)
        return (x, state), None

    reps = jnp.arange(run.count, dtype=jnp.int32)
    xs = (sliced, reps, ple)
    (x, attention_state), _ = jax.lax.scan(body, (x, attention_state), xs)
    return x, attention_state


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
