"""Building blocks of the Gemma 3 / Gemma 4 decoder: norms, RoPE, attention projections,
MLP, mixture of experts and the decoder block.

Parameters are stored as einsum-ready arrays (no biases):
q_proj [D, N, H], k_proj / v_proj [D, K, H], o_proj [N, H, D], MLP gate/up
[D, F] and down [F, D], experts gate/up [E, D, F] and down [E, F, D].

Axes: B batch (absent in the packed form), T tokens, D model width, N query
heads, K KV heads, H head dim, F MLP width, E experts, P per-layer-input width.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gemma._config import RopeConfig, TransformerConfig
from gemma._hook import LayerRef
from pallas_kernels._checks import on_gpu, on_hopper
from pallas_kernels.grouped_matmul import grouped_matmul, supports
from pallas_kernels.stacked_matmul import MAX_ROWS, stacked_matmul


class Buffer(nnx.Variable):
    """A non-trainable array saved with the parameters (HF `nn.Buffer`, e.g. layer_scalar)."""


# Arrays up to this size are drawn on the host: XLA compiles a random-normal program per
# shape, which dominates the init time of small models on CPU (about 0.5 s per shape).
_HOST_INIT_MAX_SIZE = 1 << 22


@functools.partial(jax.jit, static_argnames=("shape", "dtype", "std"))
def _scaled_normal(key, shape, dtype, std):
    return (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def _normal(rngs: nnx.Rngs, shape, dtype, std: float = 0.02) -> jax.Array:
    """N(0, std^2) of `shape`, deterministic in the seed and call order of `rngs`."""
    shape, dtype = tuple(shape), jnp.dtype(dtype)
    key = rngs.params()
    if isinstance(key, jax.core.Tracer) or math.prod(shape) > _HOST_INIT_MAX_SIZE:
        return _scaled_normal(key, shape, dtype, std)
    if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    generator = np.random.default_rng(np.asarray(key).ravel())
    values = generator.standard_normal(shape, dtype=np.float32) * np.float32(std)
    return jnp.asarray(values, dtype=dtype)


class StackedRow:
    """Row `index` of a parameter stacked over a scanned run's repetitions, not yet sliced.

    Under `lax.scan`, slicing a layer's matrix out of the stack makes XLA copy it before the
    GEMM that reads it (a device-to-device copy per matrix per layer per step; the copies
    once took half of a decode step, `experiments/NOTES.md` v15). A scanned run therefore
    hands its Blocks their matrices as StackedRows: `linear` multiplies by one through
    `pallas_kernels.stacked_matmul`, which reads the row where it lies for products of up to
    `max_rows` rows (decode steps; above it the row is sliced, a few % of a compute-bound
    GEMM), and the MoE's grouped matmul reads a run's experts in their stack
    (`MoE.in_place_max_rows`). Indexing (`param[...]`) gives the sliced row, so every other use
    is unchanged.
    """

    def __init__(self, stack: jax.Array, index: jax.Array, max_rows: int = MAX_ROWS):
        self.stack, self.index, self.max_rows = stack, index, max_rows

    shape = property(lambda self: self.stack.shape[1:])
    dtype = property(lambda self: self.stack.dtype)
    ndim = property(lambda self: self.stack.ndim - 1)

    def __getitem__(self, key):
        return jax.lax.dynamic_index_in_dim(self.stack, self.index, 0, keepdims=False)[key]


def linear(subscripts: str, x: jax.Array, param: nnx.Variable, dtype) -> jax.Array:
    """`jnp.einsum(subscripts, x, param[...])` for the projections here, whose weight axes are
    the contracted ones (leading, matching x's trailing axes) then the output ones; a
    StackedRow parameter is read in its stack (see `StackedRow`)."""
    w = param.get_value()
    if not isinstance(w, StackedRow):
        return jnp.einsum(subscripts, x, param[...].astype(dtype))
    ins, out = subscripts.split("->")
    x_axes, w_axes = ins.split(",")
    contracted = [a for a in w_axes if a in x_axes]
    k = len(contracted)
    assert w_axes[:k] == "".join(contracted) == x_axes[-k:], subscripts
    assert out == x_axes[:-k] + w_axes[k:], subscripts
    kk, nn = math.prod(w.shape[:k]), math.prod(w.shape[k:])
    x2 = x.astype(dtype).reshape(-1, kk)  # [M, K]
    stack = w.stack.reshape(w.stack.shape[0], kk, nn)  # [R, K, N]: a bitcast, no copy
    implementation = "auto" if x2.shape[0] <= w.max_rows else "reference"
    y = stacked_matmul(x2, stack, w.index, implementation=implementation)
    return y.reshape(*x.shape[: x.ndim - k], *w.shape[k:])


def rms_normalize(x: jax.Array, eps: float) -> jax.Array:
    """x / sqrt(mean(x^2) + eps) over the last axis, in float32."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps)


class RMSNorm(nnx.Module):
    """RMSNorm over the last axis; statistics in float32, output in the input dtype.

    Gemma 3 multiplies by (1 + scale) (scale initialised to 0), Gemma 4 by scale
    (initialised to 1).
    """

    def __init__(self, dim: int, *, eps: float, plus_one: bool, param_dtype):
        self.eps = eps
        self.plus_one = plus_one
        init = jnp.zeros if plus_one else jnp.ones
        self.scale = nnx.Param(init((dim,), param_dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        y = rms_normalize(x, self.eps)
        scale = self.scale[...].astype(jnp.float32)
        y = y * (1.0 + scale) if self.plus_one else y * scale
        return y.astype(x.dtype)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotate x [..., T, heads, H] by positions i32[..., T] (HF rotate-half convention).

    Dimension j pairs with j + H/2 at angle positions * inv_freq[j]; a zero
    frequency leaves its pair unrotated (proportional RoPE).
    """
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [..., T, H/2]
    angles = jnp.concatenate([freqs, freqs], axis=-1)  # [..., T, H]
    cos = jnp.cos(angles).astype(x.dtype)[..., None, :]  # [..., T, 1, H]
    sin = jnp.sin(angles).astype(x.dtype)[..., None, :]
    x1, x2 = jnp.split(x, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return x * cos + rotated * sin


@functools.lru_cache(maxsize=64)
def _inv_freq(rope: RopeConfig, head_dim: int) -> np.ndarray:
    return rope.inv_freq(head_dim)


def gelu_tanh(x: jax.Array) -> jax.Array:
    return jax.nn.gelu(x, approximate=True)


class Attention(nnx.Module):
    """Projections of one attention layer around the attention hook.

    KV-shared layers have no k/v projections; Gemma 4 full layers with
    `attention_k_eq_v` have no v projection (values are the raw key projection).
    """

    def __init__(self, config: TransformerConfig, layer_index: int, *, rngs, dtype, param_dtype):
        c = config
        self.layer_index = layer_index
        self.layer_type = c.layer_types[layer_index]
        self.gemma4 = c.family == "gemma4"
        self.dtype = dtype
        self.rope = c.type_rope(self.layer_type)
        d, n, h = c.hidden_size, c.num_heads, c.type_head_dim(self.layer_type)
        kv = c.type_num_kv_heads(self.layer_type)
        norm = dict(eps=c.rms_norm_eps, plus_one=not self.gemma4, param_dtype=param_dtype)
        self.q_proj = nnx.Param(_normal(rngs, (d, n, h), param_dtype))
        self.o_proj = nnx.Param(_normal(rngs, (n, h, d), param_dtype))
        self.q_norm = RMSNorm(h, **norm)
        self.writes_kv = c.kv_sources[layer_index] == layer_index
        if self.writes_kv:
            self.k_proj = nnx.Param(_normal(rngs, (d, kv, h), param_dtype))
            if c.layer_uses_k_eq_v(layer_index):
                self.v_proj = None
            else:
                self.v_proj = nnx.Param(_normal(rngs, (d, kv, h), param_dtype))
            self.k_norm = RMSNorm(h, **norm)
        else:
            self.k_proj = self.v_proj = self.k_norm = None
        self.value_norm_eps = c.rms_norm_eps if self.gemma4 else None

    def __call__(self, x, positions, attention_fn, attention_state, layer=None):
        """layer: the `gemma.LayerRef` handed to the hook (default: this module's own layer)."""
        x = x.astype(self.dtype)
        inv_freq = _inv_freq(self.rope, self.q_proj.shape[-1])
        q = linear("...td,dnh->...tnh", x, self.q_proj, self.dtype)  # [..., T, N, H]
        q = apply_rope(self.q_norm(q), positions, inv_freq)
        if self.writes_kv:
            k = linear("...td,dkh->...tkh", x, self.k_proj, self.dtype)  # [..., T, K, H]
            if self.v_proj is None:
                v = k
            else:
                v = linear("...td,dkh->...tkh", x, self.v_proj, self.dtype)
            k = apply_rope(self.k_norm(k), positions, inv_freq)
            if self.value_norm_eps is not None:
                v = rms_normalize(v, self.value_norm_eps).astype(v.dtype)
        else:
            k = v = None
        layer = LayerRef.of(self.layer_index) if layer is None else layer
        out, attention_state = attention_fn(layer, q, k, v, attention_state)
        y = linear("...tnh,nhd->...td", out, self.o_proj, self.dtype)  # [..., T, D]
        return y, attention_state


class MLP(nnx.Module):
    """Gated GELU (tanh) MLP: down(gelu(x @ gate) * (x @ up))."""

    def __init__(self, d: int, f: int, *, rngs, dtype, param_dtype):
        self.dtype = dtype
        self.gate_proj = nnx.Param(_normal(rngs, (d, f), param_dtype))
        self.up_proj = nnx.Param(_normal(rngs, (d, f), param_dtype))
        self.down_proj = nnx.Param(_normal(rngs, (f, d), param_dtype))

    def __call__(self, x):
        gate = linear("...d,df->...f", x, self.gate_proj, self.dtype)  # [..., F]
        up = linear("...d,df->...f", x, self.up_proj, self.dtype)
        return linear("...f,fd->...d", gelu_tanh(gate) * up, self.down_proj, self.dtype)


MOE_IMPLEMENTATIONS = ("auto", "ragged", "pallas", "dense")

# Token copies (tokens x top_k) up to which a scanned or unrolled layer's grouped matmuls read
# its experts where they lie in the run's stack (`grouped_matmul(..., group_offset=)`, the
# tile kernel on Hopper); above it they take a copy of the layer's experts (the stack sliced)
# and JAX's persistent `ragged_dot_mgpu`. Byte and FLOP counts at the 26B-A4B geometry (one
# layer's experts 1.52 GB; NOTES v18): the copy costs a read and a write of every expert,
# about 0.73 ms a layer at 4.18 TB/s, whatever the rows; the tile kernel's 64-row tiles only
# cost more where the products' FLOPs dominate. At 16384 copies (2048 tokens) the products are
# 195 GFLOP a layer, 0.5-0.65 ms at 300-400 TFLOP/s, under the copy alone; at an 8192-token
# prefill step (65536 copies) the two are predicted even. `experiments/bench_moe.py` measures
# both forms at 2048 and 8192 tokens: the bound moves with its figures. Each MoE module keeps
# its own (`MoE.in_place_max_rows`, part of the model's structure and so of every compiled
# step's key; `gemma.set_experts_in_place_max_rows`).
EXPERTS_IN_PLACE_MAX_ROWS = 16384


def experts_in_place(w, rows: int, dtype, max_rows: int) -> bool:
    """Whether an MoE grouped matmul of `rows` token copies reads expert stack `w` (a
    `StackedRow`) in place rather than a copy of its row: up to `max_rows` copies (see
    EXPERTS_IN_PLACE_MAX_ROWS)."""
    return isinstance(w, StackedRow) and jnp.dtype(w.dtype) == jnp.dtype(dtype) and rows <= max_rows


def check_moe_implementation(implementation: str) -> None:
    if implementation not in MOE_IMPLEMENTATIONS:
        raise ValueError(
            f"moe_implementation must be one of {MOE_IMPLEMENTATIONS}, got {implementation!r}"
        )


class MoE(nnx.Module):
    """Gemma 4 router + experts.

    The router reads the block's residual stream: RMSNorm without scale, times
    `router_scale` and D**-0.5, a linear map to expert scores, float32 softmax,
    top-k, renormalised, times `per_expert_scale`. Experts are gated GELU MLPs.

    implementation: how the chosen experts run. The token copies are sorted by
    expert and multiplied group by group (`pallas_kernels.grouped_matmul`):
    'ragged' through XLA's `jax.lax.ragged_dot` (group by group on CPU; on the
    GPU XLA makes it a dense dot over all experts, which does not fit memory at
    128 experts), 'pallas' through the Mosaic GPU grouped matmul (Hopper), and
    'auto' (default) the Pallas kernel on a Hopper GPU where it supports the
    shapes, 'dense' on other GPUs and dtypes, 'ragged' on CPU. 'dense' runs
    every expert on every token and weights them by the (mostly zero) gates,
    the simple reference.
    """

    def __init__(
        self, config: TransformerConfig, *, rngs, dtype, param_dtype, implementation="auto"
    ):
        check_moe_implementation(implementation)
        c = config
        d, e, f = c.hidden_size, c.num_experts, c.moe_intermediate_size
        self.implementation = implementation
        self.in_place_max_rows = EXPERTS_IN_PLACE_MAX_ROWS
        self.dtype = dtype
        self.eps = c.rms_norm_eps
        self.top_k = c.num_experts_per_token
        self.router_proj = nnx.Param(_normal(rngs, (d, e), param_dtype))
        self.router_scale = nnx.Param(jnp.ones((d,), param_dtype))
        self.per_expert_scale = nnx.Param(jnp.ones((e,), param_dtype))
        self.gate_proj = nnx.Param(_normal(rngs, (e, d, f), param_dtype))
        self.up_proj = nnx.Param(_normal(rngs, (e, d, f), param_dtype))
        self.down_proj = nnx.Param(_normal(rngs, (e, f, d), param_dtype))

    def route(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x [..., D] -> (f32 weights [..., top_k], i32 expert ids [..., top_k])."""
        d = x.shape[-1]
        h = rms_normalize(x, self.eps).astype(x.dtype)
        h = h * self.router_scale[...].astype(x.dtype) * jnp.asarray(d**-0.5, x.dtype)
        scores = linear("...d,de->...e", h, self.router_proj, x.dtype)  # [..., E]
        probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1)
        weights, experts = jax.lax.top_k(probs, self.top_k)  # [..., top_k]
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        weights = weights * self.per_expert_scale[...].astype(jnp.float32)[experts]
        return weights, experts

    def experts(self, x: jax.Array, weights: jax.Array, experts: jax.Array) -> jax.Array:
        """x [..., D] through the chosen experts, summed with their weights -> [..., D]."""
        implementation = self._resolved_implementation()
        if implementation == "dense":
            return self._experts_dense(x, weights, experts)
        return self._experts_ragged(x, weights, experts, implementation)

    def _resolved_implementation(self) -> str:
        """'auto' -> 'pallas' on a Hopper GPU where the kernel takes the operands; else 'dense'
        on a GPU (XLA lowers `ragged_dot` there to a dense dot over every expert plus masking,
        so the einsums cost the same FLOPs with fewer temporaries); else 'ragged' (CPU)."""
        if self.implementation != "auto":
            return self.implementation
        if not on_gpu():
            return "ragged"
        d, f = self.gate_proj.shape[-2:]
        fits = supports(self.dtype, d, f) and supports(self.dtype, f, d)
        return "pallas" if on_hopper() and fits else "dense"

    def _experts_dense(self, x, weights, experts):
        num_experts = self.router_proj.shape[-1]
        gates = jnp.sum(
            jax.nn.one_hot(experts, num_experts, dtype=jnp.float32) * weights[..., None], axis=-2
        )  # [..., E]
        gate = jnp.einsum(
            "...d,edf->...ef", x, self.gate_proj[...].astype(self.dtype)
        )  # [..., E, F]
        up = jnp.einsum("...d,edf->...ef", x, self.up_proj[...].astype(self.dtype))
        y = jnp.einsum(
            "...ef,efd->...ed", gelu_tanh(gate) * up, self.down_proj[...].astype(self.dtype)
        )  # [..., E, D]
        return jnp.einsum("...ed,...e->...d", y, gates.astype(y.dtype))

    def _experts_ragged(self, x, weights, experts, implementation):
        num_experts = self.router_proj.shape[-1]
        d = x.shape[-1]
        tokens = x.reshape(-1, d)  # [M, D]
        flat_experts = experts.reshape(-1)  # [M*k]; entry j belongs to token j // k
        order = jnp.argsort(flat_experts, stable=True)
        token_of = order // self.top_k  # [M*k], token of each expert-sorted copy
        group_sizes = jnp.bincount(flat_experts, length=num_experts).astype(jnp.int32)  # [E]
        xs = tokens[token_of]  # [M*k, D]
        impl = "reference" if implementation == "ragged" else implementation

        def gmm(lhs, param):
            w = param.get_value()
            if experts_in_place(w, lhs.shape[0], self.dtype, self.in_place_max_rows):
                # The run's whole stack [R * E, K, N]; this layer's E groups read in place.
                stack = w.stack.reshape(-1, *w.shape[1:])
                return grouped_matmul(
                    lhs,
                    stack,
                    group_sizes,
                    group_offset=w.index * num_experts,
                    implementation=impl,
                )
            return grouped_matmul(
                lhs, param[...].astype(self.dtype), group_sizes, implementation=impl
            )

        gate, up = gmm(xs, self.gate_proj), gmm(xs, self.up_proj)  # [M*k, F]
        y = gmm(gelu_tanh(gate) * up, self.down_proj)  # [M*k, D]
        # Back to token order (a scatter to distinct rows) and summed over each token's k experts
        # in a fixed order: a scatter-add would be nondeterministic on the GPU.
        y = jnp.zeros_like(y).at[order].set(y, unique_indices=True).reshape(-1, self.top_k, d)
        w = weights.reshape(-1, self.top_k, 1).astype(jnp.float32)
        out = jnp.sum(y.astype(jnp.float32) * w, axis=1).astype(y.dtype)  # [M, D]
        return out.reshape(x.shape)


class Block(nnx.Module):
    """One decoder layer: attention, dense MLP (+ MoE), per-layer input, layer scalar."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_index: int,
        *,
        rngs,
        dtype,
        param_dtype,
        moe_implementation="auto",
    ):
        c = config
        self.dtype = dtype
        self.gemma4 = c.family == "gemma4"
        d = c.hidden_size
        norm = dict(eps=c.rms_norm_eps, plus_one=not self.gemma4, param_dtype=param_dtype)
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.pre_attention_norm = RMSNorm(d, **norm)
        self.attn = Attention(c, layer_index, **kw)
        self.post_attention_norm = RMSNorm(d, **norm)
        self.pre_ffw_norm = RMSNorm(d, **norm)
        self.mlp = MLP(d, c.mlp_width(layer_index), **kw)
        self.post_ffw_norm = RMSNorm(d, **norm)
        if c.has_moe:
            self.moe = MoE(c, **kw, implementation=moe_implementation)
            self.post_ffw_norm_1 = RMSNorm(d, **norm)
            self.pre_ffw_norm_2 = RMSNorm(d, **norm)
            self.post_ffw_norm_2 = RMSNorm(d, **norm)
        else:
            self.moe = None
        if c.has_per_layer_inputs:
            p = c.per_layer_input_dim
            self.per_layer_input_gate = nnx.Param(_normal(rngs, (d, p), param_dtype))
            self.per_layer_projection = nnx.Param(_normal(rngs, (p, d), param_dtype))
            self.post_per_layer_input_norm = RMSNorm(d, **norm)
        else:
            self.per_layer_input_gate = None
        self.layer_scalar = Buffer(jnp.ones((1,), param_dtype)) if self.gemma4 else None

    def __call__(self, x, positions, per_layer_input, attention_fn, attention_state, layer=None):
        residual = x
        h, attention_state = self.attn(
            self.pre_attention_norm(x), positions, attention_fn, attention_state, layer
        )
        x = residual + self.post_attention_norm(h)

        residual = x
        h = self.mlp(self.pre_ffw_norm(x))
        if self.moe is not None:
            weights, experts = self.moe.route(residual)
            h2 = self.moe.experts(self.pre_ffw_norm_2(residual), weights, experts)
            h = self.post_ffw_norm_1(h) + self.post_ffw_norm_2(h2)
        x = residual + self.post_ffw_norm(h)

        if self.per_layer_input_gate is not None:
            residual = x
            g = linear("...d,dp->...p", x, self.per_layer_input_gate, self.dtype)
            g = gelu_tanh(g) * per_layer_input  # [..., T, P]
            g = linear("...p,pd->...d", g, self.per_layer_projection, self.dtype)
            x = residual + self.post_per_layer_input_norm(g)
        if self.layer_scalar is not None:
            x = x * self.layer_scalar[...].astype(x.dtype)
        return x, attention_state
