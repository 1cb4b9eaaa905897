"""`owned_pmap`: `jax.pmap`'s semantics in one process, as a jit of a `jax.shard_map`
that the caller owns (freed with it), for `kfacx.Optimizer`'s ``multi_device=True``."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec


def owned_pmap(
    fn: Callable[..., Any], axis_name: str, in_axes: Any = 0, donate_argnums: tuple[int, ...] = ()
) -> Callable[..., Any]:
    """``jax.pmap(fn, axis_name=axis_name, in_axes=in_axes, donate_argnums=donate_argnums)``
    (``in_axes`` 0 or None per positional argument, keyword arguments mapped), owned by
    the caller.

    Since jax 0.10, `jax.pmap` is a jit of a `jax.shard_map`, cached process-wide in a
    weak-keyed cache whose entry holds the function strongly, so neither the function
    nor its compiled programs are ever freed: each `kfacx.Optimizer` made with
    ``multi_device=True`` kept its steps alive, and a process that made a few dozen (a
    test suite: FermiNet's training tests) ran out of memory mappings
    (``vm.max_map_count``) and crashed in XLA's compiler. In one process this builds the
    same jit of a shard_map over the local devices here, so it lives as long as the
    returned function; across processes (host-local inputs made global) it is
    `jax.pmap`.
    """
    if jax.process_count() > 1:
        return jax.pmap(fn, axis_name=axis_name, in_axes=in_axes, donate_argnums=donate_argnums)
    compiled: dict[Any, Callable[..., Any]] = {}

    def mapped(*args: Any, **kwargs: Any) -> Any:
        axes = in_axes if isinstance(in_axes, tuple) else (in_axes,) * len(args)
        if len(axes) != len(args):
            raise ValueError(
                f"pmap: in_axes has {len(axes)} entries for {len(args)} positional arguments."
            )
        leaves, leaf_axes, donated = [], [], []
        for i, (arg, axis) in enumerate(zip(args, axes, strict=True)):
            arg_leaves = jax.tree.leaves(arg)
            if i in donate_argnums:
                donated += range(len(leaves), len(leaves) + len(arg_leaves))
            leaves += arg_leaves
            leaf_axes += [axis] * len(arg_leaves)
        kwarg_leaves = jax.tree.leaves(kwargs)
        leaves += kwarg_leaves
        leaf_axes += [0] * len(kwarg_leaves)
        sizes = {np.shape(x)[0] for x, axis in zip(leaves, leaf_axes, strict=True) if axis == 0}
        if len(sizes) != 1 or not 0 < min(sizes) <= jax.local_device_count():
            raise ValueError(
                f"pmap: the mapped arguments' leading axes have sizes {sorted(sizes)}; they "
                f"must share one size of at most the {jax.local_device_count()} local devices."
            )
        treedef = jax.tree.structure((args, kwargs))
        key = (treedef, tuple(leaf_axes), sizes.pop())
        if key not in compiled:
            # As pmap: the first `size` local devices.
            mesh = Mesh(jax.local_devices()[: key[2]], (axis_name,))
            step = _jit_of_shard_map(fn, mesh, axis_name, treedef, key[1], tuple(donated))
            mapped_over, whole = PartitionSpec(axis_name), PartitionSpec()
            placed = [NamedSharding(mesh, mapped_over if a == 0 else whole) for a in key[1]]
            compiled[key] = (step, tuple(placed))
        step, shardings = compiled[key]
        # Every call sees its inputs as the outputs of the last one are placed: arrays
        # placed otherwise (`replicate_all_local_devices`, `jax.pmap`'s outputs, host
        # arrays) would have other types under jit, and the second step would be traced
        # and compiled again. Only those are moved: a `device_put` of every leaf costs
        # about 16 us a leaf even when it moves nothing (8 ms for 500 leaves), the check
        # 0.4 us.
        moved = [
            i
            for i, (x, sharding) in enumerate(zip(leaves, shardings, strict=True))
            if not (isinstance(x, jax.Array) and x.sharding == sharding)
        ]
        if moved:
            placed = jax.device_put(
                [leaves[i] for i in moved], [shardings[i] for i in moved], may_alias=True
            )
            for i, x in zip(moved, placed, strict=True):
                leaves[i] = x
        return step(*leaves)

    return functools.wraps(fn)(mapped)


def _jit_of_shard_map(fn, mesh, axis_name, treedef, leaf_axes, donated=()):
    def per_device(*leaves):
        leaves = [
            x if axis is None else jax.lax.squeeze(x, [0])
            for x, axis in zip(leaves, leaf_axes, strict=True)
        ]
        args, kwargs = jax.tree.unflatten(treedef, leaves)
        out = fn(*args, **kwargs)
        return jax.tree.map(lambda x: jax.lax.expand_dims(x, [0]), out)

    in_specs = tuple(
        PartitionSpec(axis_name) if axis is not None else PartitionSpec() for axis in leaf_axes
    )
    return jax.jit(
        jax.shard_map(
            per_device,
            mesh=mesh,
            in_specs=in_specs,
            out_specs=PartitionSpec(axis_name),
            check_vma=False,
        ),
        donate_argnums=donated,
    )
