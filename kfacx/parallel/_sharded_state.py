"""Sharded curvature state: each block's state on its owner device only.

A `jax.jit` program cannot place an array on one device of a mesh, so the state is
*packed*: the blocks get owners (`assign_owners_by_bytes`), and for each dtype the
state leaves of each owner's blocks are flattened and concatenated into one vector,
padded to the longest owner's (the moving averages, which change every step, and the
caches, which change at refreshes, in vectors of their own). Stacked, that is one
``[num_devices, length]`` array per buffer (a `ShardedEstimatorState`), laid out
with ``PartitionSpec(axis)`` so that device ``d`` holds row ``d``: its own blocks'
state and nothing else. `PackLayout`
is that static layout (offsets and shapes), for any list of pytrees with an owner
each; it packs and unpacks exactly (concatenation and slices, no arithmetic).

This module knows nothing of curvature blocks; `kfacx.estimator._sharded_curvature` builds the
layouts of an estimator's state, statistics and preconditioned gradients.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec


class ShardedEstimatorState(NamedTuple):
    """The curvature blocks' state packed per owner device (``shard_curvature_state``).

    Attributes:
      buffers: ``[num_devices, length]`` arrays (per dtype: the moving averages', then
        the caches'); row ``d`` holds the flattened state of the blocks device ``d``
        owns (zero-padded). On a mesh it
        is sharded over the data axis: each device stores its own row only. Read the
        ordinary per-block state back with `kfacx.gather_estimator_state`.
    """

    buffers: tuple[jax.Array, ...]


def is_sharded(x: Any) -> bool:
    """Whether ``x`` is a `ShardedEstimatorState` (for ``is_leaf`` of tree maps)."""
    return isinstance(x, ShardedEstimatorState)


def has_sharded(tree: Any) -> bool:
    """Whether ``tree`` holds a `ShardedEstimatorState`."""
    return any(is_sharded(x) for x in jax.tree.leaves(tree, is_leaf=is_sharded))


def sharded_state_specs(tree: Any, axis_name: str) -> Any:
    """Partition specs for ``tree`` in a `jax.shard_map`: ``PartitionSpec(axis_name)``
    for the arrays of every `ShardedEstimatorState` (each device gets its own row),
    ``PartitionSpec()`` (replicated) for every other leaf.

    Use it for the ``in_specs`` / ``out_specs`` of an optax state holding
    ``kfacx.scale_by_kfac(..., shard_curvature_state=True)``'s state.
    """

    def spec(x):
        if is_sharded(x):
            return ShardedEstimatorState(tuple(PartitionSpec(axis_name) for _ in x.buffers))
        return PartitionSpec()

    return jax.tree.map(spec, tree, is_leaf=is_sharded)


def assign_owners_by_bytes(
    sizes: Sequence[int], costs: Sequence[float], num_devices: int
) -> tuple[int, ...]:
    """The owner device of each block, balancing the bytes of state each device holds.

    Greedy, largest first: blocks are taken by decreasing bytes (ties by decreasing
    refresh cost, then by index) and each goes to the device with the fewest bytes so
    far (ties by the lower device index). Deterministic, so every host computes the
    same owners.

    Raises:
      ValueError: if ``num_devices`` is not positive or the lists differ in length.
    """
    if num_devices < 1:
        raise ValueError(f"num_devices must be >= 1, got {num_devices}.")
    if len(sizes) != len(costs):
        raise ValueError(f"{len(sizes)} sizes but {len(costs)} costs: pass one of each per block.")
    owners = [0] * len(sizes)
    loads = [(0, d) for d in range(num_devices)]
    heapq.heapify(loads)
    order = sorted(range(len(sizes)), key=lambda i: (-int(sizes[i]), -float(costs[i]), i))
    for i in order:
        load, device = heapq.heappop(loads)
        owners[i] = device
        heapq.heappush(loads, (load + int(sizes[i]), device))
    return tuple(owners)


def _leaf_groups(front: Any, num_leaves: int, item: int) -> list[int]:
    """The group of each of an item's leaves (`PackLayout`'s ``front``)."""
    if isinstance(front, (int, np.integer)):
        return [int(j >= front) for j in range(num_leaves)]
    groups = [int(g) for g in front]
    if len(groups) != num_leaves or not set(groups) <= {0, 1}:
        raise ValueError(
            f"front[{item}] = {front!r}: expected a count of leading leaves or a group "
            f"(0 or 1) for each of the item's {num_leaves} leaves."
        )
    return groups


class _Entry(NamedTuple):
    item: int  # which pytree
    leaf: int  # which leaf of it
    offset: int  # where it starts in its owner's vector of its dtype
    shape: tuple[int, ...]


class PackLayout:
    """The static layout of a list of pytrees packed per owner and dtype.

    Args:
      items: the pytrees (arrays or `jax.ShapeDtypeStruct` leaves; only shapes and
        dtypes are read).
      owners: the owner device of each item.
      num_devices: the number of devices (rows).
      front: per item, how many of its leading leaves are in *group 0* (the others
        are in group 1), or the group (0 or 1) of each of its leaves; each group has
        buffers of its own, so that `pack_owner` can rewrite one group and pass the
        other's rows on (e.g. the moving averages, which change every step, and the
        caches, which change at refreshes). None: one group.
    """

    def __init__(
        self,
        items: Sequence[Any],
        owners: Sequence[int],
        num_devices: int,
        front: Sequence[int | Sequence[int]] | None = None,
    ):
        if len(items) != len(owners):
            raise ValueError(f"{len(items)} items but {len(owners)} owners.")
        self.num_devices = num_devices
        self.owners = tuple(int(o) for o in owners)
        self.treedefs = []
        keys: list[tuple[int, Any]] = []  # (group, dtype) of each buffer
        leaves_of = []
        front = [0] * len(items) if front is None else list(front)
        for i, item in enumerate(items):
            leaves, treedef = jax.tree.flatten(item)
            self.treedefs.append(treedef)
            groups = _leaf_groups(front[i], len(leaves), i)
            leaves_of.append(
                [
                    (tuple(np.shape(x)), (g, jnp.dtype(x.dtype)))
                    for g, x in zip(groups, leaves, strict=True)
                ]
            )
            keys.extend(key for _, key in leaves_of[-1] if key not in keys)
        keys.sort(key=lambda k: k[0])  # stable: group 0's buffers first
        self.keys = tuple(keys)
        #: The dtype of each buffer.
        self.dtypes = tuple(dtype for _, dtype in keys)
        dtypes = keys
        # entries[d][k]: the leaves owner d keeps in its vector of dtype k, in order.
        self.entries: list[list[list[_Entry]]] = [[[] for _ in dtypes] for _ in range(num_devices)]
        used = np.zeros((num_devices, len(dtypes)), np.int64)
        self.owned: list[list[int]] = [[] for _ in range(num_devices)]
        for i, (leaves, owner) in enumerate(zip(leaves_of, self.owners, strict=True)):
            self.owned[owner].append(i)
            for j, (shape, dtype) in enumerate(leaves):
                k = dtypes.index(dtype)
                self.entries[owner][k].append(_Entry(i, j, int(used[owner, k]), shape))
                used[owner, k] += math.prod(shape)
        self.used = used
        #: Per dtype, the length of every row: the longest owner's (at least 1).
        self.lengths = tuple(max(int(used[:, k].max(initial=0)), 1) for k in range(len(dtypes)))
        self.num_leaves = [len(leaves) for leaves in leaves_of]

    # ---------------------------------------------------------------- sizes

    def owner_bytes(self) -> list[int]:
        """The bytes of (unpadded) data each device owns."""
        itemsize = np.array([d.itemsize for d in self.dtypes], np.int64)
        return [int((self.used[d] * itemsize).sum()) for d in range(self.num_devices)]

    def row_bytes(self) -> int:
        """The bytes of one row of all buffers (what each device stores, padding included)."""
        return int(sum(n * d.itemsize for n, d in zip(self.lengths, self.dtypes, strict=True)))

    def shapes(self) -> tuple[jax.ShapeDtypeStruct, ...]:
        """The global buffers' shapes: ``[num_devices, length]`` each."""
        return tuple(
            jax.ShapeDtypeStruct((self.num_devices, n), d)
            for n, d in zip(self.lengths, self.dtypes, strict=True)
        )

    # ---------------------------------------------------------------- one owner

    def pack_owner(
        self,
        device: int,
        items: dict[int, Any],
        base: Sequence[jax.Array] | None = None,
        group: int | None = None,
    ) -> tuple[jax.Array, ...]:
        """Owner ``device``'s row of every buffer, from its items (``index -> pytree``);
        with ``group``, of that group's buffers only, the others' rows taken from
        ``base`` as they are."""
        leaves = {i: jax.tree.leaves(items[i]) for i in self.owned[device]}
        rows = []
        for k, dtype in enumerate(self.dtypes):
            if group is not None and self.keys[k][0] != group:
                rows.append(base[k])
                continue
            parts = [
                jnp.ravel(leaves[e.item][e.leaf]).astype(dtype) for e in self.entries[device][k]
            ]
            pad = self.lengths[k] - int(self.used[device, k])
            if pad or not parts:
                parts.append(jnp.zeros((pad,), dtype))
            rows.append(parts[0] if len(parts) == 1 else jnp.concatenate(parts))
        return tuple(rows)

    def unpack_owner(self, device: int, rows: Sequence[jax.Array]) -> dict[int, Any]:
        """Owner ``device``'s items (``index -> pytree``) from its row of every buffer."""
        leaves: dict[int, list[Any]] = {i: [None] * self.num_leaves[i] for i in self.owned[device]}
        for k, row in enumerate(rows):
            for e in self.entries[device][k]:
                size = math.prod(e.shape)
                leaves[e.item][e.leaf] = row[e.offset : e.offset + size].reshape(e.shape)
        return {i: jax.tree.unflatten(self.treedefs[i], leaves[i]) for i in self.owned[device]}

    # ---------------------------------------------------------------- all owners

    def pack(self, items: Sequence[Any]) -> tuple[jax.Array, ...]:
        """All owners' rows: one ``[num_devices, length]`` array per buffer."""
        by_index = dict(enumerate(items))
        rows = [self.pack_owner(d, by_index) for d in range(self.num_devices)]
        return tuple(jnp.stack([r[k] for r in rows]) for k in range(len(self.dtypes)))

    def unpack(self, buffers: Sequence[jax.Array]) -> list[Any]:
        """The items from the global buffers (inverse of `pack`)."""
        out: dict[int, Any] = {}
        for d in range(self.num_devices):
            out.update(self.unpack_owner(d, [b[d] for b in buffers]))
        return [out[i] for i in range(len(self.owners))]
