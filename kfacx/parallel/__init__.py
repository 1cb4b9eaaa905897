"""Helpers for data-parallel training with `jax.pmap` (``Optimizer(multi_device=True)``).

With ``multi_device=True`` the parameters and the optimizer state carry a
leading axis of size `jax.local_device_count` (one identical copy per device),
the batch is split along a leading device axis, and each device gets its own
rng key::

    params = kfacx.parallel.replicate_all_local_devices(params)
    rng = kfacx.parallel.make_different_rng_key_on_all_devices(rng)
    batch = kfacx.parallel.shard_batch(batch)

The package also holds kfacx's own multi-device machinery, private modules used
by the layers above (they do no communication of their own beyond JAX's
collectives):

* ``_placement``: where `kfacx.Optimizer`'s step runs (one device, pmap, a mesh,
  shard_map) and how it is staged;
* ``_distributed``: the cost-balanced owner device of each unit of the inverse
  refresh, and the refresh on owners only;
* ``_reductions``: averages over a device axis weighted by each device's examples
  (e.g. the curvature statistics).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "get_first",
    "make_different_rng_key_on_all_devices",
    "replicate_all_local_devices",
    "shard_batch",
]


def replicate_all_local_devices(tree: Any) -> Any:
    """Adds a leading axis with one copy of every leaf per local device.

    Leaves are copied through the host, so arrays that came out of a `jax.pmap`
    (e.g. `get_first` of a step's output) can be replicated again.
    """
    n = jax.local_device_count()

    def replicate(x):
        if jnp.issubdtype(jnp.result_type(x), jax.dtypes.prng_key):
            data = replicate(jax.random.key_data(x))
            return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
        host = np.asarray(jax.device_get(x))
        return np.broadcast_to(host, (n, *host.shape))

    return jax.tree.map(replicate, tree)


def make_different_rng_key_on_all_devices(rng: jax.Array) -> jax.Array:
    """One different key per local device (a leading device axis)."""
    return jax.random.split(rng, jax.local_device_count())


def shard_batch(batch: Any) -> Any:
    """Splits every leaf's leading (batch) axis into ``[devices, batch // devices, ...]``.

    Raises:
      ValueError: if the number of local devices does not divide the batch.
    """
    n = jax.local_device_count()

    def split(x):
        size = jnp.shape(x)[0]
        if size % n:
            raise ValueError(f"The batch size {size} is not divisible by the {n} local devices.")
        return jnp.reshape(x, (n, size // n, *jnp.shape(x)[1:]))

    return jax.tree.map(split, batch)


def get_first(tree: Any) -> Any:
    """The first device's copy of a replicated pytree."""
    return jax.tree.map(lambda x: x[0], tree)
