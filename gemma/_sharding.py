"""Tensor-parallel layout of the parameters: one rule from a parameter to its PartitionSpec.

Megatron-style over the mesh axis "model" (tp devices; see `swajax._sharding` for the mesh and
the KV pool):

  - attention: q_proj [D, N, H] over query heads (column-parallel) and o_proj [N, H, D] over
    query heads (row-parallel: one all-reduce per layer); k_proj / v_proj [D, K, H] over KV
    heads where tp divides K, else replicated (every device computes the K heads; the pool
    repeats them, `swajax._layout.stored_kv_heads`).
  - MLP: gate_proj / up_proj [D, F] over F, down_proj [F, D] over F (one all-reduce).
  - MoE (Gemma 4): experts gate_proj / up_proj [E, D, F] and down_proj [E, F, D] over experts
    (expert parallelism: each device runs its experts on every token, one all-reduce); over F
    where tp does not divide E. The router is replicated.
  - embedding [V, D] and lm_head [D, V] over the vocabulary; Gemma 4's per-layer embedding
    [V_p, L * P] over its vocabulary, per_layer_input_gate [D, P] / per_layer_projection
    [P, D] over P.
  - everything else (norms, layer scalars, router, per_layer_model_projection): replicated.

A dimension the rule would split but tp does not divide stays replicated (query heads must
divide: `swajax._sharding.check_heads`). A stacked (scanned) parameter's leading axis is None.

`partition_specs(model, tp)` gives the specs of a model's whole state; `shard_model` moves a
model onto a mesh; `gemma._checkpoint.init_sharded` draws random parameters straight into their
shards; `from_pretrained(..., mesh=)` and `restore_params(..., mesh=)` load into them.
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from gemma._mesh import MODEL, check_heads, serving_mesh

# Block-relative name -> the axis split over "model" (of the unstacked parameter).
_BLOCK_AXES = {
    "attn.q_proj": 1,  # [D, N, H]
    "attn.k_proj": 1,  # [D, K, H]
    "attn.v_proj": 1,
    "attn.o_proj": 0,  # [N, H, D]
    "mlp.gate_proj": 1,  # [D, F]
    "mlp.up_proj": 1,
    "mlp.down_proj": 0,  # [F, D]
    "moe.gate_proj": (0, 2),  # [E, D, F]: experts, else F
    "moe.up_proj": (0, 2),
    "moe.down_proj": (0, 1),  # [E, F, D]
    "per_layer_input_gate": 1,  # [D, P]
    "per_layer_projection": 0,  # [P, D]
}
_TOP_AXES = {
    "embedding": 0,  # [V, D]
    "lm_head": 1,  # [D, V]
    "per_layer_embedding": 0,  # [V_p, L * P]
}


def partition_spec(name: str, shape, tp: int, *, stacked: bool = False) -> P:
    """The PartitionSpec of parameter `name` of `shape` over tp "model" devices.

    name: a Block-relative dotted name ("attn.q_proj", "moe.down_proj", "mlp.up_proj") or a
    top-level one ("embedding", "lm_head"); stacked: the shape has a leading stack axis.
    """
    shape = tuple(shape)
    inner = shape[1:] if stacked else shape
    axes = _BLOCK_AXES.get(name, _TOP_AXES.get(name, ()))
    axes = (axes,) if isinstance(axes, int) else axes
    spec = [None] * len(inner)
    for axis in axes:
        if tp > 1 and inner[axis] % tp == 0:
            spec[axis] = MODEL
            break
    return P(*([None] if stacked else []), *spec)


def check_tp(config, tp: int) -> None:
    """ValueError unless tp devices can split the config's query heads and KV heads."""
    check_heads(tp, config.num_heads, {s.num_kv_heads for s in config.layer_specs})


def _spec_at(model, path: tuple, shape, tp: int) -> P:
    """The spec of the Variable at `path` (nnx graph path, without a trailing 'value')."""
    names = [str(k) for k in path]
    if names and names[0] == "blocks":
        stacked = model.layer_runs[int(names[1])].scanned
        return partition_spec(".".join(names[3:]), shape, tp, stacked=stacked)
    return partition_spec(".".join(names), shape, tp)


def variable_specs(model, tp: int) -> dict[int, P]:
    """id(Variable) -> PartitionSpec for every Variable of `model` (concrete or abstract)."""
    check_tp(model.config, tp)
    return {
        id(node): _spec_at(model, path, node.shape, tp)
        for path, node in nnx.iter_graph(model)
        if isinstance(node, nnx.Variable)
    }


def partition_specs(model, tp: int) -> nnx.State:
    """The model's state (`nnx.split(model)[1]`) with a PartitionSpec at every leaf.

    Raises ValueError when tp cannot split the query heads or the KV heads evenly.
    """
    check_tp(model.config, tp)
    _, state = nnx.split(model)

    def spec(path, leaf):
        names = [getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))) for k in path]
        if names and names[-1] == "value":
            names = names[:-1]
        return _spec_at(model, tuple(names), leaf.shape, tp)

    return jax.tree_util.tree_map_with_path(spec, state)


def param_shardings(model, mesh) -> nnx.State:
    """The model's state with the NamedSharding of every leaf on `mesh` (replicated over
    "data")."""
    mesh = serving_mesh(mesh)
    specs = partition_specs(model, mesh.shape[MODEL])
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs)


def for_mesh(model, mesh):
    """The model as it runs on `mesh` (or None: the model itself): its tensor-parallel view,
    `Transformer.for_tensor_parallel`, which every sharded model given out here is."""
    if mesh is None:
        return model
    return model.for_tensor_parallel(serving_mesh(mesh).shape[MODEL])


def shard_model(model, mesh):
    """The model with every parameter moved to its sharding on `mesh` (a new model, its
    tensor-parallel view)."""
    graphdef, state = nnx.split(model)
    return for_mesh(nnx.merge(graphdef, jax.device_put(state, param_shardings(model, mesh))), mesh)


def device_bytes(model, tp: int) -> int:
    """Bytes of the model's state on one of tp "model" devices (from shapes; abstract models
    work)."""
    specs = partition_specs(model, tp)
    _, state = nnx.split(model)
    total = 0
    for leaf, spec in zip(jax.tree.leaves(state), jax.tree.leaves(specs), strict=True):
        size = int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize
        total += size // tp if MODEL in tuple(spec) else size
    return total
