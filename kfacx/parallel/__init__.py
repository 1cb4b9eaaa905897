"""Helpers for data-parallel training with `jax.pmap` (``Optimizer(multi_device=True)``).

With ``multi_device=True`` the parameters and the optimizer state carry a
leading axis of size `jax.local_device_count` (one identical copy per device),
the batch is split along a leading device axis, and each device gets its own
rng key::

    params = kfacx.parallel.replicate_all_local_devices(params)
    rng = kfacx.parallel.make_different_rng_key_on_all_devices(rng)
    batch = kfacx.parallel.shard_batch(batch)

With several processes (`jax.distributed`, as on several hosts) the step is
pmapped over the devices of all processes: each process passes the inputs of its
own devices, made with these helpers from its own rows of the global batch
(tests/parallel/test_multiprocess.py; checkpoints: see `get_first`).

The package also holds kfacx's own multi-device machinery, private modules used
by the layers above (they do no communication of their own beyond JAX's
collectives):

* ``_placement``: where `kfacx.Optimizer`'s step runs (one device, pmap, a mesh,
  shard_map) and how it is staged;
* ``_distributed``: the cost-balanced owner device of each unit of the inverse
  refresh, and the refresh on owners only;
* ``_reductions``: averages over a device axis weighted by each device's examples
  (e.g. the curvature statistics);
* ``_sharded_state``: the curvature state packed per owner device
  (``shard_curvature_state=True``): `ShardedEstimatorState`, its static layout, and
  `sharded_state_specs` for `jax.shard_map`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kfacx.parallel._sharded_state import ShardedEstimatorState, sharded_state_specs

__all__ = [
    "ShardedEstimatorState",
    "get_first",
    "make_different_rng_key_on_all_devices",
    "replicate_all_local_devices",
    "shard_batch",
    "sharded_state_specs",
]


def replicate_all_local_devices(tree: Any) -> Any:
    """Adds a leading axis with one copy of every leaf per local device (this
    process's devices).

    Leaves are copied through the host, so arrays that came out of a `jax.pmap`
    (e.g. `get_first` of a step's output) can be replicated again.

    Args:
      tree: a pytree of arrays (random keys included).

    Returns:
      The pytree with leaves of shape ``[jax.local_device_count(), ...]``.
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
    """One different key per local device (a leading device axis), different in every
    process too.

    The keys are this process's slice of ``jax.random.split(rng, jax.device_count())``,
    so each device of a `jax.pmap` over several processes gets its own key, and the
    processes together hold the keys one process with all the devices would.

    Args:
      rng: one key, the same in every process.

    Returns:
      ``jax.local_device_count()`` keys.
    """
    n = jax.local_device_count()
    start = jax.process_index() * n
    return jax.random.split(rng, jax.device_count())[start : start + n]


def shard_batch(batch: Any) -> Any:
    """Splits every leaf's leading (batch) axis into ``[devices, batch // devices, ...]``
    over the local devices. With several processes, pass this process's rows.

    Args:
      batch: a pytree of arrays with a leading batch axis.

    Returns:
      The pytree with leaves of shape ``[jax.local_device_count(), rows, ...]``.

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
    """The first local device's copy of a replicated pytree (pmap's outputs).

    With several processes the copy lives on this process's devices only, and orbax
    does not save such arrays from several processes: save
    ``jax.device_get(get_first(tree))`` (NumPy arrays) instead.

    Args:
      tree: a pytree of arrays with a leading device axis.

    Returns:
      The pytree without it.
    """
    return jax.tree.map(lambda x: x[0], tree)
