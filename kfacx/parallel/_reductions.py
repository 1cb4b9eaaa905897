"""Averages over a device axis weighted by each device's number of examples.

Devices may hold different numbers of real examples (padding masked out, uneven
micro-batches): their averages are combined weighted by those numbers, so the
result is the average over all the examples, as on one device.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def weighted_mean(tree: Any, weight: Any, axis_name: str) -> tuple[Any, jax.Array]:
    """``(sum_d weight_d * tree_d / sum_d weight_d, sum_d weight_d)`` over ``axis_name``.

    Must be called where ``axis_name`` is bound (inside `jax.pmap` or
    `jax.shard_map`). A total weight of 0 (no real example on any device) gives
    zeros, not NaN.

    Args:
      tree: this device's averages (a pytree of arrays).
      weight: the number of examples they average over on this device.
      axis_name: the device axis.

    Returns:
      ``(mean, total_weight)``; ``total_weight`` in float32.
    """
    weight = jnp.asarray(weight, jnp.float32)
    total = jax.lax.psum(weight, axis_name)
    safe = jnp.where(total > 0, total, 1.0)
    mean = jax.tree_util.tree_map(
        lambda s: jax.lax.psum(s * weight.astype(s.dtype), axis_name) / safe.astype(s.dtype), tree
    )
    return mean, total
