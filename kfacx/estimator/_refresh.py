"""Refreshing every block's cache in one go: batched inverses, distributed over devices.

The refresh is split into *units*. Blocks that describe their refresh as damped
inverses (`kfacx.blocks.CurvatureBlock.inverse_refresh`: the Kronecker and
embedding blocks with the default cache) contribute their factors to size
buckets (`kfacx.linalg.size_buckets`); each bucket is one unit, inverted as one
padded ``[K, n, n]`` stack by Cholesky (`kfacx.linalg.cholesky_inverse_padded`).
Every other block is a unit of its own (its `update_cache`). Before the units
run, the buckets are padded into their stacks, the traces of all factors are
read from the stacks in one pass, and the dampings (the pi split of every
Kronecker pair vectorised, `kfacx.linalg.PiDamping`) and their floors form one
vector; after, the eigendecomposition fallback for the factors whose Cholesky
inverse failed is shared by all buckets (`kfacx.linalg.repair_padded`). The
deep autoencoder's 16 factors make 5 units instead of 16 separate inverses, for
the same results (to rounding): the refresh compiles in about 3.2 s instead of
10.2 s.

Serially, every unit runs. With a device axis, a bucket that costs more than an
equal share of the whole refresh is cut into pieces of consecutive matrices (a
model of uniform widths has one bucket holding almost all the work), each piece
and each other unit runs on one owner device, chosen by cost
(`kfacx.parallel._distributed.assign_owners`), and a ``psum`` shares the results.
Each matrix is inverted by the same program whichever piece it is in, so the
distributed refresh computes exactly what the serial one does.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kfacx import linalg
from kfacx.blocks import BlockState, CurvatureBlock, InverseRefresh
from kfacx.estimator import _identity_weights
from kfacx.parallel import _distributed

#: Whether `refresh` batches the blocks' inverses in size buckets (tests turn it off to
#: compare with each block refreshing itself).
BATCH_INVERSES = True


class RefreshPlan(NamedTuple):
    """The units of one refresh.

    Attributes:
      runs: per unit, a function computing its result: for a bucket, ``run(lo, hi)``
        gives the padded Cholesky inverses of its matrices ``lo:hi`` and where they
        succeeded (``run()``: all of them); for a block, ``run()`` its new cache.
      costs: per unit, its cost (``K n^3`` for a bucket; `kfacx.parallel._distributed.refresh_cost`
        for a block).
      counts: per unit, the ``K`` matrices of a bucket, or 0 for a block (not cut).
      unit_blocks: per unit, the block of each matrix of a bucket, or the block.
      assemble: ``unit results -> new block states`` (it also runs the shared
        fallback for the inverses that failed).
    """

    runs: tuple[Callable[[], Any], ...]
    costs: tuple[float, ...]
    counts: tuple[int, ...]
    unit_blocks: tuple[tuple[int, ...], ...]
    assemble: Callable[[Sequence[Any]], tuple[BlockState, ...]]


def plan(
    blocks: Sequence[CurvatureBlock], states: Sequence[BlockState], identity_weight: Any
) -> RefreshPlan:
    """Splits the refresh of ``blocks`` into bucket units and per-block units
    (``identity_weight``: one for all blocks, or one per block)."""
    weights = _identity_weights.per_block(identity_weight, len(blocks))
    inverse_plans = [
        b.inverse_refresh(s, w) if BATCH_INVERSES else None
        for b, s, w in zip(blocks, states, weights, strict=True)
    ]
    owner_block = [i for i, p in enumerate(inverse_plans) if p is not None for _ in p.matrices]
    matrices = [m for p in inverse_plans if p is not None for m in p.matrices]
    groups: dict[Any, list[int]] = {}
    for k, m in enumerate(matrices):
        groups.setdefault(jnp.result_type(m), []).append(k)
    bucket_members = []
    for members in groups.values():
        sizes = [matrices[k].shape[-1] for k in members]
        for size, picked in linalg.size_buckets(sizes):
            bucket_members.append(([members[j] for j in picked], size))
    # Each bucket is padded into one stack and its traces are read from the stack (a
    # kernel per bucket, not per matrix); the floored dampings form one vector.
    stacks = [linalg.stack_padded([matrices[k] for k in c], size) for c, size in bucket_members]
    entries = _entries(matrices)
    sums = None
    if stacks:
        order = np.concatenate([entries[k] for c, _ in bucket_members for k in c])
        sums = linalg.padded_diagonal_sums(stacks)[:, np.argsort(order)]
    floors = _floors(inverse_plans, matrices, sums)
    if stacks:  # In bucket order: each bucket's floors are a slice.
        floors = floors[order] if not np.array_equal(order, np.arange(len(order))) else floors
    # The barrier fixes how the stacks and floors are computed (XLA would otherwise
    # simplify e.g. ``root / sqrt(x)`` differently depending on which other values use
    # them), so that a bucket inverted alone or on its owner device (inside a
    # `jax.lax.cond`) gives the same bits.
    stacks, floors = jax.lax.optimization_barrier((stacks, floors))
    padded, start = [], 0
    for stack, (chosen, _) in zip(stacks, bucket_members, strict=True):
        like = [matrices[k] for k in chosen]
        padded.append(_bucket_stack(stack, floors[start : start + stack.shape[0]], like))
        start += stack.shape[0]
    runs, costs, counts, unit_blocks = [], [], [], []
    for build, (chosen, size) in zip(padded, bucket_members, strict=True):
        runs.append(functools.partial(_invert_rows, build))
        entries = [owner_block[k] for k in chosen for _ in range(math.prod(matrices[k].shape[:-2]))]
        costs.append(len(entries) * float(size) ** 3)
        counts.append(len(entries))
        unit_blocks.append(tuple(entries))
    own = [i for i, p in enumerate(inverse_plans) if p is None]
    for i in own:
        runs.append(lambda b=blocks[i], s=states[i], w=weights[i]: b.update_cache(s, w).cache)
        costs.append(_distributed.refresh_cost(blocks[i]))
        counts.append(0)
        unit_blocks.append((i,))

    def assemble(results: Sequence[Any]) -> tuple[BlockState, ...]:
        inverted = [stack for stack, _ in results[: len(bucket_members)]]
        if inverted:
            inverted = linalg.repair_padded(
                lambda: [build() for build in padded],
                inverted,
                [ok for _, ok in results[: len(bucket_members)]],
            )
        inverses: list[Any] = [None] * len(matrices)
        for (chosen, _), stack in zip(bucket_members, inverted, strict=True):
            cropped = linalg.crop_padded(stack, [matrices[k] for k in chosen])
            for k, inverse in zip(chosen, cropped, strict=True):
                inverses[k] = inverse
        new_states = list(states)
        for i, cache in zip(own, results[len(bucket_members) :], strict=True):
            new_states[i] = states[i]._replace(cache=cache)
        return tuple(_finish(inverse_plans, inverses, new_states))

    return RefreshPlan(tuple(runs), tuple(costs), tuple(counts), tuple(unit_blocks), assemble)


def _invert_rows(build, lo=None, hi=None):
    """The Cholesky inverses of the stack ``build()``'s matrices ``lo:hi`` (all by default)."""
    stack = build()
    if lo is not None:
        stack = linalg.PaddedStack(*(x[lo:hi] for x in stack))
    return linalg.cholesky_inverse_padded(stack)


def _entries(matrices: Sequence[jax.Array]) -> list[np.ndarray]:
    """Per stack of matrices, the indices of its matrices in the flat vector of all."""
    offsets = np.cumsum([0] + [math.prod(m.shape[:-2]) for m in matrices])
    return [np.arange(offsets[k], offsets[k + 1]) for k in range(len(matrices))]


def _floors(
    inverse_plans: Sequence[InverseRefresh | None], matrices: list, sums: jax.Array | None
) -> jax.Array:
    """Every matrix's floored damping as one vector, from the ``[2, K]`` diagonal sums,
    with the pi split of every `linalg.PiDamping` pair vectorised."""
    entries = _entries(matrices)
    size = sum(len(e) for e in entries)
    dims = np.array([m.shape[-1] for m, e in zip(matrices, entries, strict=True) for _ in e])
    first, second = np.arange(size), np.arange(size)
    is_pi = np.zeros(size, bool)
    weights, others, k = [], [], 0  # others: (matrix index, the plan it belongs to)
    for p in inverse_plans:
        if p is None:
            continue
        n = len(p.matrices)
        if isinstance(p.dampings, linalg.PiDamping):
            if n != 2 or p.matrices[0].shape[:-2] != p.matrices[1].shape[:-2]:
                raise ValueError(
                    "InverseRefresh: PiDamping needs exactly two matrices (a Kronecker pair) "
                    f"of the same stack shape; got shapes {[m.shape for m in p.matrices]}."
                )
            a, g = entries[k], entries[k + 1]
            first[a], second[a], first[g], second[g] = a, g, a, g
            is_pi[a] = is_pi[g] = True
            weights += [(k, p.dampings.weight), (k + 1, p.dampings.weight)]
        others += [(k + i, p) for i in range(n)]
        k += n

    def dampings(traces: jax.Array) -> jax.Array:
        pieces, done = [], set()
        for i, p in others:
            if isinstance(p.dampings, linalg.PiDamping):
                pieces.append(jnp.zeros((len(entries[i]),), traces.dtype))
            elif id(p) not in done:  # the block's dampings, for all its matrices at once
                done.add(id(p))
                own = range(i, i + len(p.matrices))
                values = p.dampings
                if callable(values):
                    values = values(tuple(linalg.split_flat(traces, [matrices[j] for j in own])))
                for j, d in zip(own, values, strict=True):
                    shape = matrices[j].shape[:-2]
                    pieces.append(jnp.broadcast_to(jnp.asarray(d, traces.dtype), shape).reshape(-1))
        if not is_pi.any():
            return jnp.concatenate(pieces)
        if len({id(w) for _, w in weights}) == 1:
            weight = weights[0][1]
        else:
            parts = [
                jnp.broadcast_to(jnp.asarray(w, traces.dtype), entries[i].shape) for i, w in weights
            ]
            weight = (
                jnp.ones((size,), traces.dtype)
                .at[np.flatnonzero(is_pi)]
                .set(jnp.concatenate(parts))
            )
        split = linalg.pi_damping_vector(traces, dims, first, second, weight)
        if is_pi.all():
            return split
        return jnp.where(jnp.asarray(is_pi), split, jnp.concatenate(pieces))

    return linalg.floored_damping_vector(matrices, dampings, sums)


def _bucket_stack(
    stack: jax.Array, floors: jax.Array, matrices: list
) -> Callable[[], linalg.PaddedStack]:
    """Builds the bucket's `linalg.PaddedStack` when called (in the owner's branch)."""
    return lambda: linalg.PaddedStack(
        stack, floors.astype(stack.dtype), linalg.stack_sizes(matrices)
    )


def _finish(
    inverse_plans: Sequence[InverseRefresh | None],
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
        cut = pieces(refresh_plan, num_devices)
        owners = _distributed.assign_owners([p.cost for p in cut], num_devices)
        runs = [_piece_run(refresh_plan, p) for p in cut]
        done = _distributed.owned_refresh(runs, owners, axis_name)
        results = [
            done[i] if len(group) == 1 else jax.tree.map(lambda *r: jnp.concatenate(r), *group)
            for i, group in _by_unit(cut, done)
        ]
    return refresh_plan.assemble(results)


class Piece(NamedTuple):
    """Matrices ``lo:hi`` of a bucket unit (``lo = hi = None``: a whole unit)."""

    unit: int
    lo: int | None
    hi: int | None
    cost: float


#: The smallest (padded) matrices whose buckets `pieces` cuts: each piece compiles a
#: factorisation loop of its own, which costs more than the distribution saves for
#: small matrices (a 256 x 256 Cholesky inverse takes about a millisecond on a CPU).
MIN_CUT_SIZE = 512


def pieces(refresh_plan: RefreshPlan, num_devices: int) -> list[Piece]:
    """The pieces of a refresh distributed over ``num_devices``, in unit order: a
    bucket of matrices of at least `MIN_CUT_SIZE` costing more than half a device's
    share (``1 / (2 num_devices)`` of the whole refresh) is cut into pieces of
    consecutive matrices of at most about half a share each (never more pieces than
    it has matrices), small enough for the owners' loads to even out; every other
    unit is one piece."""
    half_share = sum(refresh_plan.costs) / (2 * num_devices)
    out = []
    for unit, (cost, count) in enumerate(zip(refresh_plan.costs, refresh_plan.counts, strict=True)):
        # A bucket's cost is count * size**3 (`plan`).
        large = count and cost / count >= float(MIN_CUT_SIZE) ** 3
        k = (
            min(count, math.ceil(cost / half_share * (1 - 1e-9)))
            if num_devices > 1 and half_share > 0 and large
            else 1
        )
        if k <= 1:
            out.append(Piece(unit, None, None, cost))
            continue
        bounds = [round(j * count / k) for j in range(k + 1)]
        out += [
            Piece(unit, lo, hi, cost * (hi - lo) / count) for lo, hi in itertools.pairwise(bounds)
        ]
    return out


def _piece_run(refresh_plan: RefreshPlan, piece: Piece) -> Callable[[], Any]:
    run = refresh_plan.runs[piece.unit]
    return run if piece.lo is None else (lambda: run(piece.lo, piece.hi))


def _by_unit(cut: Sequence[Piece], results: Sequence[Any]) -> list[tuple[int, list[Any]]]:
    """``(index of the unit's first piece, the results of its pieces)`` per unit."""
    grouped: dict[int, tuple[int, list[Any]]] = {}
    for i, (piece, result) in enumerate(zip(cut, results, strict=True)):
        grouped.setdefault(piece.unit, (i, []))[1].append(result)
    return [grouped[u] for u in sorted(grouped)]


def block_owners(refresh_plan: RefreshPlan, num_blocks: int, num_devices: int) -> tuple[int, ...]:
    """For each block, the device that runs its most expensive piece (its first, on a tie)."""
    cut = pieces(refresh_plan, num_devices)
    owners = _distributed.assign_owners([p.cost for p in cut], num_devices)
    best: list[tuple[float, int]] = [(-1.0, 0)] * num_blocks
    for piece, owner in zip(cut, owners, strict=True):
        for i in refresh_plan.unit_blocks[piece.unit][piece.lo : piece.hi]:
            if piece.cost > best[i][0]:
                best[i] = (piece.cost, owner)
    return tuple(owner for _, owner in best)


def abstract_plan(blocks: Sequence[CurvatureBlock], cache_spec: tuple) -> RefreshPlan:
    """The `plan` of the refresh of ``blocks`` with caches ``cache_spec`` (the arguments
    of `kfacx.blocks.CurvatureBlock.init` after its key), on abstract states (nothing is
    computed; its runs are not for calling)."""

    def units(_):
        states = [b.init(jax.random.key(0), *cache_spec) for b in blocks]
        found.append(plan(blocks, states, 1.0))
        return 0

    found: list[RefreshPlan] = []
    jax.eval_shape(units, 0)
    return found[0]


def planned_block_owners(
    blocks: Sequence[CurvatureBlock], cache_spec: tuple, num_devices: int
) -> tuple[int, ...]:
    """`block_owners` of the refresh of ``blocks`` with caches ``cache_spec``."""
    return block_owners(abstract_plan(blocks, cache_spec), len(blocks), num_devices)


def refresh_on_schedule(
    count: Any, inverse_update_period: Any, refresh: Callable[..., Any], operand: Any, *args: Any
) -> Any:
    """``refresh(operand, *args)`` when ``count`` is a multiple of ``inverse_update_period``
    (the first update included), else ``operand`` (a `jax.lax.cond`)."""
    return jax.lax.cond(
        count % inverse_update_period == 0, refresh, lambda x, *_: x, operand, *args
    )
