"""kfac-jax's data-parallel helpers (``kfac_jax.utils.p_split``, ...), on public JAX.

They behave as kfac-jax 0.0.8's do on the JAX it supports, and run on the newest JAX
(kfac-jax's call ``jax.device_put_replicated``, which JAX 0.10 removed, and read the
bound axis names through a private JAX function).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kfacx import parallel as _kfacx_parallel


def in_pmap(axis_name: str | None) -> bool:
    """Whether the code runs inside a `jax.pmap` (or `jax.shard_map`) binding ``axis_name``."""
    if axis_name is None:
        return False
    try:
        jax.lax.axis_size(axis_name)
    except NameError:
        return False
    return True


def wrap_if_pmap(p_func: Callable[[Any, str], Any]) -> Callable[[Any, str | None], Any]:
    """``p_func(obj, axis_name)`` inside a pmap binding ``axis_name``; ``obj`` outside."""

    def p_func_if_pmap(obj: Any, axis_name: str | None) -> Any:
        return p_func(obj, axis_name) if in_pmap(axis_name) else obj

    p_func_if_pmap.__name__ = getattr(p_func, "__name__", "p_func") + "_if_pmap"
    p_func_if_pmap.__doc__ = p_func.__doc__
    return p_func_if_pmap


def pmean_if_pmap(obj: Any, axis_name: str | None) -> Any:
    """`jax.lax.pmean` over ``axis_name`` when inside that pmap, else ``obj``."""
    return jax.lax.pmean(obj, axis_name) if in_pmap(axis_name) else obj


def psum_if_pmap(obj: Any, axis_name: str | None) -> Any:
    """`jax.lax.psum` over ``axis_name`` when inside that pmap, else ``obj``."""
    return jax.lax.psum(obj, axis_name) if in_pmap(axis_name) else obj


def _tree_is_empty(obj: Any) -> bool:
    return not jax.tree_util.tree_leaves(obj)


_identity_pmap = jax.pmap(lambda x: x)


def _axis_sharding(axis_name: str) -> jax.sharding.NamedSharding:
    """Leading axis split over the local devices, on a mesh whose one axis is named
    ``axis_name`` (what a `jax.pmap` with that axis name takes and gives on JAX's
    shard_map-based pmap)."""
    mesh = jax.sharding.Mesh(jax.local_devices(), (axis_name,))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(axis_name))


def broadcast_all_local_devices(obj: Any, axis_name: str | None = None) -> Any:
    """Puts ``obj``, whose leaves have a leading axis of `jax.local_device_count`, one
    slice on each local device (as a pmap's input or output). With ``axis_name`` the
    leaves are placed on a mesh with that axis name, as kfac-jax does; pass the pmap's
    axis name to feed arrays already placed by a pmap back into it."""
    if _tree_is_empty(obj):
        return obj
    if axis_name is None:
        return _identity_pmap(obj)
    return jax.device_put(obj, _axis_sharding(axis_name))


def replicate_all_local_devices(obj: Any, axis_name: str | None = None) -> Any:
    """One copy of ``obj`` on every local device: leaves ``[local_device_count, ...]``."""
    if _tree_is_empty(obj):
        return obj
    return broadcast_all_local_devices(_kfacx_parallel.replicate_all_local_devices(obj), axis_name)


def make_different_rng_key_on_all_devices(rng: jax.Array) -> jax.Array:
    """A different key on every local device (and in every process)."""
    return broadcast_all_local_devices(_kfacx_parallel.make_different_rng_key_on_all_devices(rng))


#: Splits each device's key in two: ``(keys, subkeys)``, both per device.
p_split = jax.pmap(lambda key: tuple(jax.random.split(key)))

#: Splits each device's key in ``num``.
p_split_num = jax.pmap(
    lambda key, num: tuple(jax.random.split(key, num)), static_broadcasted_argnums=1
)

#: The mean / sum over the local devices of a per-device pytree (a pmapped function).
pmap_mean = jax.pmap(lambda x: jax.lax.pmean(x, "i"), axis_name="i")
pmap_sum = jax.pmap(lambda x: jax.lax.psum(x, "i"), axis_name="i")
pmap_zeros_like = jax.pmap(lambda x: jax.tree_util.tree_map(jnp.zeros_like, x))
jit_zeros_like = jax.jit(lambda x: jax.tree_util.tree_map(jnp.zeros_like, x))


def get_first(obj: Any) -> Any:
    """The first device's slice of a replicated pytree (Python scalars pass through)."""

    def first(x):
        if isinstance(x, (int, float)) or (isinstance(x, jax.Array) and not x.shape):
            return x
        return x[0]

    return jax.tree_util.tree_map(first, obj)


def get_mean(obj: Any) -> Any:
    """The mean over the local devices of a per-device pytree."""
    return get_first(pmap_mean(obj))


def get_sum(obj: Any) -> Any:
    """The sum over the local devices of a per-device pytree."""
    return get_first(pmap_sum(obj))


def copy_array(x: jax.Array) -> jax.Array:
    """A copy of ``x`` in a new buffer (safe to donate the original)."""
    return jnp.array(x, copy=True)


def copy_obj(obj: Any) -> Any:
    """`copy_array` of every leaf."""
    return jax.tree_util.tree_map(copy_array, obj)


pmap_copy_obj = jax.pmap(copy_obj)


def host_sync(obj: Any, sync_op: Callable[[Any, str], Any]) -> Any:
    """``sync_op`` over the processes of a multi-process run (identity with one)."""
    if jax.process_count() == 1:
        return obj
    from jax.experimental import multihost_utils

    gathered = multihost_utils.process_allgather(obj)
    return jax.tree_util.tree_map(
        lambda x: np.asarray(jax.pmap(lambda y: sync_op(y, "i"), axis_name="i")(x[None])[0]),
        gathered,
    )


def host_all_gather(x: Any) -> Any:
    """Every process's ``x``, stacked on a leading axis."""
    if jax.process_count() == 1:
        return jax.tree_util.tree_map(lambda y: jnp.expand_dims(y, 0), x)
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(x)


def host_mean(x: Any) -> Any:
    """The mean of ``x`` over the processes."""
    return jax.tree_util.tree_map(lambda y: jnp.mean(y, axis=0), host_all_gather(x))


def pmap_sync_and_divide_value(value: Any, counter: Any, axis_name: str = "i") -> Any:
    """``psum(value) / psum(counter)`` inside a pmap binding ``axis_name``."""
    return jax.tree_util.tree_map(
        lambda v: psum_if_pmap(v, axis_name) / psum_if_pmap(counter, axis_name), value
    )


def jit_sync_and_divide_value(value: Any, counter: Any) -> Any:
    """``value / counter`` (kfac-jax's jit placement: the arrays are global already)."""
    return jax.tree_util.tree_map(lambda v: v / counter, value)
