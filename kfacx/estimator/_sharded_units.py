"""The units of a sharded curvature state: whole blocks, and runs of slices of a large
`kfacx.blocks.StackedBlock`.

A block's state lives on one owner device (`kfacx.estimator._sharded_curvature`). A model whose
state is mostly in a few large blocks (a Transformer written with a scan over its
layers has one stacked block per kind of weight) would leave most devices with
nothing to hold. A `StackedBlock` is ``L`` independent slices, so a large one is cut
into runs of consecutive slices, each a `StackedBlock` of its own with the same inner
block: every slice is computed as in the whole block, and the cut changes nothing but
where the slices live. Every array of a stacked block's state, statistics and vectors
has the slices on its leading axis, so cutting is slicing and joining is
concatenating.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from kfacx._helpers import _tree
from kfacx.blocks import BlockState, CurvatureBlock, StackedBlock
from kfacx.estimator import _refresh, _statistics


class Unit(NamedTuple):
    """Block ``block``, or its slices ``lo:hi`` (``lo = hi = None``: all of it)."""

    block: int
    lo: int | None = None
    hi: int | None = None


def cut(
    blocks: Sequence[CurvatureBlock], sizes: Sequence[int], num_devices: int, allowed: bool
) -> tuple[Unit, ...]:
    """The units of ``blocks`` (state bytes ``sizes``) on ``num_devices``: a
    `StackedBlock` holding more than half a device's share of the bytes (``1 / (2
    num_devices)`` of all) is cut into runs of slices of at most about half a share (at
    most one run per slice), when ``allowed``; every other block is one unit."""
    half_share = sum(sizes) / (2 * num_devices)
    units = []
    for i, (block, size) in enumerate(zip(blocks, sizes, strict=True)):
        slices = block.stack_size if type(block) is StackedBlock else 0
        k = 1
        if allowed and num_devices > 1 and half_share > 0:
            k = min(slices, math.ceil(size / half_share * (1 - 1e-9)))
        if k <= 1:
            units.append(Unit(i))
            continue
        bounds = [round(j * slices / k) for j in range(k + 1)]
        units += [Unit(i, lo, hi) for lo, hi in itertools.pairwise(bounds)]
    return tuple(units)


def _restacked(block: StackedBlock, size: int) -> StackedBlock:
    """``block`` with ``size`` slices (the same inner block)."""

    def resize(shapes):
        return tuple((size, *tuple(s)[1:]) for s in shapes)

    layer = block.layer
    layer = dataclasses.replace(
        layer,
        parameter_shapes=resize(layer.parameter_shapes),
        input_shapes=resize(layer.input_shapes),
        output_shapes=resize(layer.output_shapes),
        stack_size=size,
    )
    return StackedBlock(layer, lambda _: block.inner)


class Units:
    """``blocks`` as ``units``: their blocks, and per-block pytrees cut and joined.

    Args:
      blocks: the estimator's blocks.
      units: from `cut`, in block order.
    """

    def __init__(self, blocks: Sequence[CurvatureBlock], units: Sequence[Unit]):
        self.units = tuple(units)
        self.num_blocks = len(blocks)
        self.blocks = tuple(
            blocks[u.block] if u.lo is None else _restacked(blocks[u.block], u.hi - u.lo)
            for u in self.units
        )

    @property
    def whole(self) -> bool:
        """Whether every unit is a whole block."""
        return all(u.lo is None for u in self.units)

    def split(self, per_block: Sequence[Any]) -> list[Any]:
        """Per unit, its part of the per-block pytrees ``per_block`` (slices ``lo:hi`` of
        the leading axis of every leaf, for a run of slices)."""
        return [
            per_block[u.block]
            if u.lo is None
            else jax.tree.map(lambda x, u=u: x[u.lo : u.hi], per_block[u.block])
            for u in self.units
        ]

    def join(self, per_unit: Sequence[Any]) -> list[Any]:
        """The per-block pytrees from their units' parts (inverse of `split`)."""
        parts: list[list[Any]] = [[] for _ in range(self.num_blocks)]
        for u, x in zip(self.units, per_unit, strict=True):
            parts[u.block].append(x)
        return [
            p[0] if len(p) == 1 else jax.tree.map(lambda *xs: jnp.concatenate(xs), *p)
            for p in parts
        ]

    def per_unit(self, per_block: Sequence[Any]) -> tuple[Any, ...]:
        """Per unit, its block's entry of ``per_block`` (e.g. identity weights)."""
        return tuple(per_block[u.block] for u in self.units)


def state_groups(
    blocks: Sequence[CurvatureBlock],
    states: Sequence[BlockState],
    stats: Sequence[Any],
    covered: Sequence[bool],
) -> tuple[list[list[int]], bool]:
    """Per unit, the group (`kfacx.parallel._sharded_state.PackLayout`'s ``front``) of
    each leaf of its state: 0 for the moving averages and for every cache leaf that the
    statistics' update writes (`kfacx.blocks.MappedBlock` keeps its map's derivative
    there), 1 for the rest of the cache, which only refreshes write. And whether a
    refresh writes a cache leaf of group 0 (then it writes both groups; a refresh never
    changes the moving averages, `kfacx.blocks.CurvatureBlock.update_cache`).

    Read from each unit's update traced on ``states`` and ``stats`` (shapes), and its
    refresh where the update writes its cache: a leaf passed on untouched is not written,
    so a user's block is laid out right too.
    """
    scalar = jax.ShapeDtypeStruct((), jnp.float32)
    groups, refresh_writes_front = [], False
    for block, state, stat, cov in zip(blocks, states, stats, covered, strict=True):
        num_factors = len(jax.tree.leaves(state.factors))

        def fold(state, stat, ema_old, ema_new, block=block, cov=cov):
            return _statistics.update_block(block, state, stat, ema_old, ema_new, cov)

        def refresh(state, weight, block=block):
            return _refresh.refresh([block], [state], weight)[0]

        folded = _tree.leaves_changed(fold, state, stat, scalar, scalar)
        unit = [int(j >= num_factors and not w) for j, w in enumerate(folded)]
        if 0 in unit[num_factors:]:  # Tracing a refresh costs more than a fold: only here.
            refreshed = _tree.leaves_changed(refresh, state, scalar)[num_factors:]
            refresh_writes_front |= any(
                w and g == 0 for w, g in zip(refreshed, unit[num_factors:], strict=True)
            )
        groups.append(unit)
    return groups, refresh_writes_front
