"""Distributed curvature work: each block's cache refresh runs on one device.

Refreshing the cached inverses / eigendecompositions is the expensive,
O(n^3)-per-factor part of K-FAC, and every device holds the same factors. With
a device axis, each block gets an *owner* device; the owner refreshes the
block's cache, every other device contributes zeros, and a ``psum`` over the
axis hands the result to everyone. A refresh then costs about
``1 / num_devices`` of the serial one (on the slowest device), plus one
all-reduce of the caches. The owner's result plus exact zeros is bit-identical
to computing it locally.

Owners are chosen by cost, not round-robin: blocks are taken from the most to
the least expensive and each goes to the device with the least work so far
(longest-processing-time-first scheduling).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec


def refresh_cost(block: Any) -> float:
    """Relative cost of refreshing ``block``'s cache.

    A block may define ``refresh_cost()`` itself; otherwise its factor shapes
    decide: a square factor ``[..., n, n]`` costs ``n^3`` per leading index
    (an eigendecomposition or Cholesky factorisation), any other factor its size.
    """
    own = getattr(block, "refresh_cost", None)
    if callable(own):
        return float(own())
    cost = 0.0
    for shape in block.factor_shapes():
        shape = tuple(int(s) for s in shape)
        if len(shape) >= 2 and shape[-1] == shape[-2]:
            cost += math.prod(shape[:-2]) * float(shape[-1]) ** 3
        else:
            cost += float(math.prod(shape))
    return cost


def assign_owners(costs: Sequence[float], num_devices: int) -> tuple[int, ...]:
    """The owner device of each block: greedy longest-processing-time-first.

    Blocks are taken by decreasing cost (ties by index) and each goes to the
    device with the least total cost so far (ties by the lower device index),
    so the result is deterministic and the same on every host.

    Raises:
      ValueError: if ``num_devices`` is not positive.
    """
    if num_devices < 1:
        raise ValueError(f"num_devices must be >= 1, got {num_devices}.")
    owners = [0] * len(costs)
    loads = [(0.0, d) for d in range(num_devices)]
    heapq.heapify(loads)
    for index in sorted(range(len(costs)), key=lambda i: (-float(costs[i]), i)):
        load, device = heapq.heappop(loads)
        owners[index] = device
        heapq.heappush(loads, (load + float(costs[index]), device))
    return tuple(owners)


def device_loads(costs: Sequence[float], owners: Sequence[int], num_devices: int) -> list[float]:
    """The total refresh cost each device gets under ``owners``."""
    loads = [0.0] * num_devices
    for cost, owner in zip(costs, owners, strict=True):
        loads[owner] += float(cost)
    return loads


def owned_refresh(
    refreshes: Sequence[Callable[[], Any]], owners: Sequence[int], axis_name: str
) -> tuple[Any, ...]:
    """Runs ``refreshes[i]()`` on device ``owners[i]`` of ``axis_name`` only and
    shares every result with all devices (one ``psum``).

    Must be called where ``axis_name`` is bound (inside `jax.pmap` or
    `jax.shard_map`). Each refresh returns a pytree of arrays; the other
    devices contribute zeros of the same shapes.
    """
    me = jax.lax.axis_index(axis_name)
    results = []
    for refresh, owner in zip(refreshes, owners, strict=True):
        shapes = jax.eval_shape(refresh)
        results.append(
            jax.lax.cond(
                me == owner,
                refresh,
                lambda shapes=shapes: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes),
            )
        )
    return jax.lax.psum(tuple(results), axis_name)


def placed_refresh(
    placement: Any, update_cache: Callable[..., Any], est_state: Any, identity_weight: Any
) -> Any:
    """``update_cache(est_state, identity_weight, pmap_axis_name)`` inside a step staged
    by ``placement`` (a `kfacx.parallel._placement.Placement`), distributed over its
    devices when ``distributed_inverses`` and there are several: under pmap and
    shard_map over the bound axis, under the sharded jit in a shard_map of its own."""
    if not placement.distributed_inverses or placement.kind == "single":
        return update_cache(est_state, identity_weight, None)
    if placement.axis_name is not None:
        return update_cache(est_state, identity_weight, placement.axis_name)
    axis = placement.data_axis_name
    mapped = jax.shard_map(
        lambda e, w: update_cache(e, w, axis),
        mesh=placement.mesh,
        in_specs=(PartitionSpec(), PartitionSpec()),
        out_specs=PartitionSpec(),
        axis_names=frozenset({axis}),
        check_vma=False,
    )
    return mapped(est_state, identity_weight)
