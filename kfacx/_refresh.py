"""Refreshing every block's cache in one go: batched inverses, distributed over devices.

The refresh is split into *units*. Blocks that describe their refresh as damped
inverses (`kfacx.blocks.CurvatureBlock.inverse_refresh`: the Kronecker and
embedding blocks with the default cache) contribute their factors to size
buckets (`kfacx.linalg.size_buckets`); each bucket is one unit, inverted as one
padded ``[K, n, n]`` stack (`kfacx.linalg.psd_inverse_padded`). Every other
block is a unit of its own (its `update_cache`). The deep autoencoder's 16
factors make 5 units instead of 16 separate inverses: a third of the
factorisations to compile, for the same results (to rounding). This batching
is behind `BATCH_INVERSES` (off for now, see there).

Serially, every unit runs. With a device axis, each unit runs on one owner
device, chosen by cost (`kfacx._distributed.assign_owners`), and a ``psum``
shares the results, so the distributed refresh computes exactly what the
serial one does.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from kfacx import _distributed, linalg
from kfacx.blocks import BlockState, CurvatureBlock, InverseRefresh

#: Whether `refresh` batches the blocks' inverses in size buckets. Off for now: the
#: bucketed refresh compiles 30% faster on the autoencoder, but inside a whole step the
#: distributed and the serial refresh then differ in the last bits (float32), which the
#: placements' equivalence tests forbid; each block refreshes itself until that is found.
BATCH_INVERSES = False


class _Operand(NamedTuple):
    block: int  # The block whose `inverse_refresh` gives the matrix.
    matrix: jax.Array
    damping: jax.Array


class RefreshPlan(NamedTuple):
    """The units of one refresh.

    Attributes:
      runs: per unit, a function computing its result (a padded inverse stack for
        a bucket, the block's new cache otherwise).
      costs: per unit, its cost (``K n^3`` for a bucket; `kfacx._distributed.refresh_cost`
        for a block).
      unit_blocks: per unit, the blocks it serves.
      assemble: ``unit results -> new block states``.
    """

    runs: tuple[Callable[[], Any], ...]
    costs: tuple[float, ...]
    unit_blocks: tuple[tuple[int, ...], ...]
    assemble: Callable[[Sequence[Any]], tuple[BlockState, ...]]


def plan(
    blocks: Sequence[CurvatureBlock], states: Sequence[BlockState], identity_weight: Any
) -> RefreshPlan:
    """Splits the refresh of ``blocks`` into bucket units and per-block units."""
    inverse_plans = [
        b.inverse_refresh(s, identity_weight) if BATCH_INVERSES else None
        for b, s in zip(blocks, states, strict=True)
    ]
    operands = [
        (i, m, d)
        for i, p in enumerate(inverse_plans)
        if p is not None
        for m, d in zip(p.matrices, p.dampings, strict=True)
    ]
    # The barrier fixes how the matrices and dampings are computed (XLA would otherwise
    # simplify e.g. ``root / sqrt(x)`` differently depending on which other values use
    # them), so that a bucket inverted alone or on its owner device (inside a
    # `jax.lax.cond`) gives the same bits.
    values = jax.lax.optimization_barrier(
        [(m, jnp.broadcast_to(jnp.asarray(d, m.dtype), m.shape[:-2])) for _, m, d in operands]
    )
    operands = [_Operand(i, m, d) for (i, _, _), (m, d) in zip(operands, values, strict=True)]
    runs, costs, unit_blocks = [], [], []
    bucket_members = []
    by_dtype: dict[Any, list[int]] = {}
    for k, op in enumerate(operands):
        by_dtype.setdefault(jax.numpy.result_type(op.matrix), []).append(k)
    for members in by_dtype.values():
        sizes = [operands[k].matrix.shape[-1] for k in members]
        for size, picked in linalg.size_buckets(sizes):
            chosen = [operands[members[j]] for j in picked]
            runs.append(_bucket_run(chosen, size))
            costs.append(sum(math.prod(o.matrix.shape[:-2]) for o in chosen) * float(size) ** 3)
            unit_blocks.append(tuple(sorted({o.block for o in chosen})))
            bucket_members.append([members[j] for j in picked])
    own = [i for i, p in enumerate(inverse_plans) if p is None]
    for i in own:
        runs.append(lambda b=blocks[i], s=states[i]: b.update_cache(s, identity_weight).cache)
        costs.append(_distributed.refresh_cost(blocks[i]))
        unit_blocks.append((i,))

    def assemble(results: Sequence[Any]) -> tuple[BlockState, ...]:
        inverses: list[Any] = [None] * len(operands)
        for members, stack in zip(bucket_members, results, strict=False):
            cropped = linalg.crop_padded(stack, [operands[k].matrix for k in members])
            for k, inverse in zip(members, cropped, strict=True):
                inverses[k] = inverse
        new_states = list(states)
        for i, cache in zip(own, results[len(bucket_members) :], strict=True):
            new_states[i] = states[i]._replace(cache=cache)
        return tuple(_finish(inverse_plans, operands, inverses, new_states))

    return RefreshPlan(tuple(runs), tuple(costs), tuple(unit_blocks), assemble)


def _bucket_run(chosen: Sequence[_Operand], size: int) -> Callable[[], jax.Array]:
    return lambda: linalg.psd_inverse_padded(
        [o.matrix for o in chosen], [o.damping for o in chosen], size
    )


def _finish(
    inverse_plans: Sequence[InverseRefresh | None],
    operands: Sequence[_Operand],
    inverses: Sequence[jax.Array],
    new_states: list[BlockState],
) -> list[BlockState]:
    start = 0
    for i, p in enumerate(inverse_plans):
        if p is None:
            continue
        count = len(p.matrices)
        new_states[i] = p.finish(tuple(inverses[start : start + count]))
        start += count
    return new_states


def refresh(
    blocks: Sequence[CurvatureBlock],
    states: Sequence[BlockState],
    identity_weight: Any,
    axis_name: str | None = None,
) -> tuple[BlockState, ...]:
    """Every block's refreshed state; with ``axis_name`` (inside `jax.pmap` or
    `jax.shard_map`) each unit runs on its owner device only."""
    refresh_plan = plan(blocks, states, identity_weight)
    num_devices = 1 if axis_name is None else jax.lax.axis_size(axis_name)
    if num_devices == 1:
        results = [run() for run in refresh_plan.runs]
    else:
        owners = _distributed.assign_owners(refresh_plan.costs, num_devices)
        results = _distributed.owned_refresh(refresh_plan.runs, owners, axis_name)
    return refresh_plan.assemble(results)


def block_owners(refresh_plan: RefreshPlan, num_blocks: int, num_devices: int) -> tuple[int, ...]:
    """For each block, the device that runs its most expensive unit."""
    owners = _distributed.assign_owners(refresh_plan.costs, num_devices)
    best: list[tuple[float, int]] = [(-1.0, 0)] * num_blocks
    for cost, owner, members in zip(
        refresh_plan.costs, owners, refresh_plan.unit_blocks, strict=True
    ):
        for i in members:
            if cost > best[i][0]:
                best[i] = (cost, owner)
    return tuple(owner for _, owner in best)
