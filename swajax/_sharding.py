"""Serving on several devices: the mesh, the shardings of the pool state, the per-replica step.

A `jax.sharding.Mesh` with an axis "model" (tensor parallelism, size tp) and optionally an axis
"data" (data parallelism, size dp). Owns:

  - `serving_mesh`: the user's mesh checked and normalised to axes ("data", "model") of Auto
    type (a missing "data" axis has size 1), so the SPMD partitioner splits the dense math.
  - `check_heads`: a tp that query heads or KV heads cannot be split over is a ValueError.
  - `state_shardings` / `init_state_sharded`, `table_shardings` / `initial_tables_sharded`:
    where every leaf of `KVPoolState` and the page tables lives, created in place (no full copy
    on one device first).
  - `per_replica`: a function of one replica (one-device shapes) run on every replica at once.

Tensor parallelism ("model"). The parameters are split Megatron-style by the model
(`model.partition_specs(tp)`, see `gemma._sharding`); the partitioner splits the dense math from
them. Pool roots are split over KV heads: `PoolSpec.stored_kv_heads` heads, `device_kv_heads` per
device. Where tp divides the KV heads a device holds K / tp of them; where tp is a multiple of K
(Gemma 4 E2B and Gemma 3 1B: K = 1; the full layers of Gemma 4 31B at tp = 8: K = 4) each KV head is
repeated on the tp / K devices whose query heads read it, so a device holds exactly the one KV head
its queries need and the kernels read it without slicing a pool. K = 1 is full replication: the pool
costs every device what it costs one device (no KV memory is saved by tp, only parameter memory),
and kv_write writes identical values on every device. The bookkeeping (free stacks, refcounts, base
tables, scratch descriptors) and the page tables are replicated: the page-table gather runs once per
step beside the forward, outside the per-shard code; only the Pallas calls (kv_write, paged
attention) run per shard, under `jax.shard_map` in the attention hook (`swajax._paged`).

Data parallelism ("data"). Each replica serves its own rows from its own pool: every leaf of the
pool state, the page tables, the previous step's tokens and the step's inputs holds the replicas'
arrays concatenated along its first axis, split over "data" (pool roots [dp * pages, ...], base
tables [dp * B, NB], ...), and the step is `shard_map`ped over "data" (with "model" left to the
partitioner), so each replica runs exactly the one-device step (same transforms, same kernels, the
same shapes) on its pool. The host runs one scheduler and slot ledger per replica and dispatches all
replicas in one compiled program. Rejected: one pool whose page axis is split over replicas, with
rows partitioned among them (the allocator, the transforms and the ledger would have to confine a
row's slot ids to its replica's pages); vmap over replicas (batches the Pallas kernels); one engine
per replica (a compiled step per sub-mesh and one dispatch per replica).

Axis names: dp replicas ("data"), tp tensor-parallel devices ("model").
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from gemma._mesh import DATA, MODEL, check_heads, mesh_sizes, serving_mesh  # noqa: F401
from swajax._layout import KVLayout
from swajax._state import KVPoolState, init_state, initial_tables


def model_on_mesh(model, mesh: Mesh | None):
    """(model, parameter shardings) for serving on `mesh`, a `serving_mesh` (None: (model,
    None)). The model must have `partition_specs(tp)` (TypeError otherwise; ValueError for a
    tp its heads cannot be split over); with tp > 1 its `for_tensor_parallel(tp)`, where it
    has one, is what runs."""
    if mesh is None:
        return model, None
    _, tp = mesh_sizes(mesh)
    if not callable(getattr(model, "partition_specs", None)):
        raise TypeError(
            f"a mesh needs a model with partition_specs(tp), got {type(model).__name__}"
        )
    specs = model.partition_specs(tp)
    if tp > 1 and callable(getattr(model, "for_tensor_parallel", None)):
        model = model.for_tensor_parallel(tp)
    return model, jax.tree.map(lambda s: NamedSharding(mesh, s), specs)


# ----------------------------------------------------------------------------- pool state


def state_shardings(layout: KVLayout, mesh: Mesh) -> KVPoolState:
    """`KVPoolState` of NamedShardings: every leaf's first axis (its replicas, concatenated) over
    "data"; pool roots also over KV heads ("model"); the rest replicated over "model"."""
    replica = NamedSharding(mesh, P(DATA))
    fields = {f.name: replica for f in dataclasses.fields(KVPoolState)}
    for name in (
        "free_stack",
        "refcount",
        "base_tables",
        "scratch_range",
        "scratch_slots",
        "cached",
    ):
        fields[name] = (replica,) * len(layout.groups)
    # [dp * pages, page_size, stored_kv_heads, head_dim]
    fields["pools"] = (NamedSharding(mesh, P(DATA, None, MODEL, None)),) * len(layout.pools)
    return KVPoolState(**fields)


def _replicate(tree, dp: int):
    return jax.tree.map(lambda x: jnp.concatenate([x] * dp) if dp > 1 else x, tree)


def init_state_sharded(layout: KVLayout, mesh: Mesh) -> KVPoolState:
    """`init_state` of every replica, concatenated, created on its devices."""
    dp, _ = mesh_sizes(mesh)
    make = jax.jit(
        lambda: _replicate(init_state(layout), dp), out_shardings=state_shardings(layout, mesh)
    )
    return make()


def table_shardings(layout: KVLayout, mesh: Mesh):
    """Shardings of the per-pool page tables [dp * L_p, B, 2, NB] (None in shared mode)."""
    if layout.page_table_mode != "per_layer":
        return None
    return (NamedSharding(mesh, P(DATA)),) * len(layout.pools)


def initial_tables_sharded(layout: KVLayout, mesh: Mesh):
    """`initial_tables` of every replica, concatenated (None in shared mode)."""
    if layout.page_table_mode != "per_layer":
        return None

    dp, _ = mesh_sizes(mesh)
    make = jax.jit(
        lambda: _replicate(initial_tables(layout), dp), out_shardings=table_shardings(layout, mesh)
    )
    return make()


def replica_sharding(mesh: Mesh) -> NamedSharding:
    """Arrays of every replica concatenated along the first axis, replicated over "model"."""
    return NamedSharding(mesh, P(DATA))


# ----------------------------------------------------------------------------- replicas


def per_replica(fn, mesh: Mesh, num_shared: int):
    """fn(*shared, *own) of one replica, called on every replica in one program.

    Every leaf of the `own` arguments holds the replicas' values concatenated along its first
    axis (split over "data"), and so does every output leaf (a scalar output becomes [dp]); the
    first `num_shared` arguments are the same on every replica (the parameters, split over
    "model" only). Inside, "data" is manual and "model" is left to the partitioner. A
    concatenated axis rather than a new leading one: squeezing a replica axis of size 1 next
    to another axis of size 1 (one KV head per device) made XLA pick a transposed layout for
    the pool root and copy it at the step's boundary.

    Empty arrays (the scratch slots of a full-attention group, [B, 0]) do not cross the
    `shard_map` boundary (XLA's CPU compiler crashes on them there): they are rebuilt on the
    other side from their shapes.
    """
    dp, _ = mesh_sizes(mesh)

    @functools.wraps(fn)
    def call(*args):
        leaves, treedef = jax.tree.flatten(args)
        num_shared_leaves = len(jax.tree.leaves(args[:num_shared]))
        kept = [i for i, x in enumerate(leaves) if x.size]
        out_empty: dict[int, jax.ShapeDtypeStruct] = {}  # filled while `one` is traced
        out_tree = []

        def local_shape(i, x):
            return x.shape if i < num_shared_leaves else (x.shape[0] // dp, *x.shape[1:])

        def one(*kept_leaves):
            full = [jnp.zeros(local_shape(i, x), x.dtype) for i, x in enumerate(leaves)]
            for i, x in zip(kept, kept_leaves, strict=True):
                full[i] = x
            out_leaves, out_def = jax.tree.flatten(fn(*jax.tree.unflatten(treedef, full)))
            out_tree.append(out_def)
            result = []
            for i, y in enumerate(out_leaves):
                if y.size:
                    result.append(y.reshape(1) if y.ndim == 0 else y)
                else:
                    out_empty[i] = jax.ShapeDtypeStruct((dp * y.shape[0], *y.shape[1:]), y.dtype)
            return result

        specs = [P() if i < num_shared_leaves else P(DATA) for i in kept]
        result = jax.shard_map(
            one,
            mesh=mesh,
            in_specs=tuple(specs),
            out_specs=P(DATA),
            axis_names={DATA},
            check_vma=False,
        )(*(leaves[i] for i in kept))
        result = iter(result)
        out_leaves = [
            jnp.zeros(out_empty[i].shape, out_empty[i].dtype) if i in out_empty else next(result)
            for i in range(out_tree[0].num_leaves)
        ]
        return jax.tree.unflatten(out_tree[0], out_leaves)

    return call
