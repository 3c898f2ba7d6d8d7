"""The serving mesh's conventions, shared by the model's shardings and the engine's: the axis
names, the normalised mesh, and how query and KV heads split over the "model" axis.

A `jax.sharding.Mesh` with an axis "model" (tensor parallelism, size tp) and optionally "data"
(data-parallel replicas, size dp). Pure of model and pool code.
"""

from __future__ import annotations

import numpy as np

DATA, MODEL = "data", "model"


def serving_mesh(mesh):
    """The mesh with axes ("data", "model"), both Auto; ValueError for a mesh without "model".

    Axes other than "data" and "model" must have size 1 (they are dropped).
    """
    from jax.sharding import AxisType, Mesh  # the head rules below import no JAX

    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    names = tuple(mesh.axis_names)
    if MODEL not in names:
        raise ValueError(
            f"the mesh needs an axis {MODEL!r} (tensor parallelism; optionally {DATA!r} for "
            f"replicas), got axes {names} of sizes {tuple(mesh.devices.shape)}"
        )
    extra = {n: s for n, s in zip(names, mesh.devices.shape, strict=True) if n not in (DATA, MODEL)}
    if any(s > 1 for s in extra.values()):
        raise ValueError(
            f"the mesh may have only the axes {DATA!r} and {MODEL!r} of size > 1, got {extra}"
        )
    order = [names.index(MODEL)] + [names.index(n) for n in extra]
    if DATA in names:
        order.insert(0, names.index(DATA))
    devices = np.transpose(mesh.devices, order).reshape(-1, mesh.shape[MODEL])
    return Mesh(devices, (DATA, MODEL), axis_types=(AxisType.Auto, AxisType.Auto))


def mesh_sizes(mesh) -> tuple[int, int]:
    """(dp, tp) of a `serving_mesh`."""
    return mesh.shape[DATA], mesh.shape[MODEL]


def check_heads(tp: int, num_heads: int, kv_heads=()) -> None:
    """ValueError unless tp devices can split `num_heads` query heads and every KV head count.

    Query heads are split evenly (tp divides them); KV heads are split (tp divides K) or
    repeated (K divides tp), see `stored_kv_heads`.
    """
    divisors = [d for d in range(1, num_heads + 1) if num_heads % d == 0]
    if tp > num_heads:
        raise ValueError(
            f"tensor-parallel size {tp} (the mesh's 'model' axis) exceeds the model's "
            f"{num_heads} query heads: more devices than heads; use one of {divisors}"
        )
    if num_heads % tp:
        raise ValueError(
            f"tensor-parallel size {tp} (the mesh's 'model' axis) does not divide the model's "
            f"{num_heads} query heads; use one of {divisors}"
        )
    for k in sorted(set(kv_heads)):
        stored_kv_heads(k, tp)


def stored_kv_heads(num_kv_heads: int, tp: int) -> int:
    """KV heads of a pool root split over `tp` tensor-parallel devices (one device: all).

    `num_kv_heads % tp == 0`: the heads themselves, `num_kv_heads / tp` per device.
    `tp % num_kv_heads == 0`: `tp` heads, KV head h repeated at stored heads
    [h * tp / K, (h + 1) * tp / K), one per device: each device holds the one KV head its
    query heads read (query head n reads KV head n // (N / K)), so K = 1 is full replication.
    Any other pair cannot give every device whole KV heads: ValueError.
    """
    if num_kv_heads % tp == 0:
        return num_kv_heads
    if tp % num_kv_heads == 0:
        return tp
    raise ValueError(
        f"tensor-parallel size {tp} (the mesh's 'model' axis) must divide the {num_kv_heads} KV "
        f"heads of a pool or be a multiple of {num_kv_heads}"
    )
