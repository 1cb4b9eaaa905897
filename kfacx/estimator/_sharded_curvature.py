"""K-FAC with sharded curvature state (``shard_curvature_state=True``).

Each curvature block's moving averages and cached inverses live on one *owner*
device of the mesh's data axis (owners balanced by bytes,
`kfacx.parallel._sharded_state.assign_owners_by_bytes`), packed into a
`kfacx.parallel.ShardedEstimatorState`. One step, on each device of the axis:

1. the statistics and the gradient of every block are packed per owner and reduced
   to their owner (``psum_scatter``: each device receives the sum of its own blocks'
   statistics and gradients, not all of them), the statistics then averaged as
   `kfacx.estimator.weighted_mean_stats` does (`OwnedGradient` serves the gradient's
   dot products the step needs besides); under the sharded jit the compiler reduces
   them globally, and each owner reads its part;
2. a `jax.lax.switch` on the device index runs the owner's branch: it unpacks its
   blocks' states and statistics (static offsets), folds the statistics into the
   moving averages, refreshes the caches on schedule and preconditions its blocks'
   gradients with the ordinary block methods, and packs the results;
3. one ``all_gather`` hands every device every block's preconditioned gradient.

The results equal the replicated state's to rounding (tests/estimator/test_sharded_state.py).
Blocks whose statistics read their state (EKFAC) are not supported yet: their
statistics would need every device to hold every basis.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from kfacx._helpers import _tree
from kfacx._helpers._checks import is_traced
from kfacx.estimator import (
    BlockDiagonalCurvature,
    CurvatureStats,
    EstimatorState,
    _identity_weights,
    _refresh,
    _sharded_units,
    _statistics,
)
from kfacx.estimator._refresh import refresh_on_schedule
from kfacx.parallel import _distributed
from kfacx.parallel._sharded_state import PackLayout, ShardedEstimatorState, assign_owners_by_bytes

#: Option name used in error messages.
OPTION = "shard_curvature_state"


class PackedStats(NamedTuple):
    """Statistics reduced to their owners.

    Attributes:
      rows: per buffer, this device's row ``[1, length]`` (inside the axis), or every
        owner's rows ``[num_devices, length]`` (sharded jit: the statistics are global).
      check: what the non-finite guard checks (NaN iff a statistic is not finite).
    """

    rows: tuple[jax.Array, ...]
    check: Any


class ShardedCurvature:
    """The static plan of an estimator's sharded state on ``num_devices`` devices.

    Args:
      estimator: the curvature estimator (set up by the time the plan is used).
      num_devices: the devices of the data axis.
      axis_name: the data axis.
      mesh: the mesh (for placing the state; needed under the sharded jit).

    Raises:
      ValueError: if a block's statistics need its state (EKFAC).
    """

    def __init__(
        self,
        estimator: BlockDiagonalCurvature,
        num_devices: int,
        axis_name: str | None,
        mesh: jax.sharding.Mesh | None = None,
    ):
        self.estimator = estimator
        self.num_devices = int(num_devices)
        self.axis_name = axis_name
        self.mesh = mesh
        self._built: tuple | None = None
        self._precon_layouts: dict[Any, PackLayout] = {}

    # ---------------------------------------------------------------- layouts

    def _build(self) -> tuple[PackLayout, PackLayout]:
        if self._built is not None and self._built[0] is self.estimator.blocks:
            return self._built[1:3]
        est = self.estimator
        blocks = est.blocks
        needing = [b for b in blocks if getattr(b, "statistics_need_state", False)]
        if needing:
            raise ValueError(
                f"{OPTION}=True does not support blocks whose statistics read their state "
                f"yet ({needing[0]!r}, e.g. curvature_block='ekfac'); use another "
                f"curvature_block or {OPTION}=False."
            )
        spec = est._cache_spec
        states = jax.eval_shape(lambda: [b.init(jax.random.key(0), *spec) for b in blocks])
        # Large stacked blocks are cut into runs of slices, unless a norm of each whole
        # block scales its damping.
        whole = est.norm_to_scale_identity_weight_per_block is not None
        cut = _sharded_units.cut(blocks, _bytes(states), self.num_devices, not whole)
        units = _sharded_units.Units(blocks, cut)
        states = jax.eval_shape(units.split, states)
        costs = [_distributed.refresh_cost(b) for b in units.blocks]
        owners = assign_owners_by_bytes(_bytes(states), costs, self.num_devices)
        self.state_shapes = states
        stats = jax.eval_shape(lambda: units.split(est.zero_curvature_stats().blocks))
        # Buffers of the moving averages (they change every step) apart from those of
        # the caches (at refreshes): a step rewrites the former and passes on the latter.
        covered = [c is not None for c in units.per_unit(est._coverage_shapes)]
        front, self._refresh_writes_front = _sharded_units.state_groups(
            units.blocks, states, stats, covered
        )
        state_layout = PackLayout(states, owners, self.num_devices, front)
        stats_layout = PackLayout(stats, owners, self.num_devices)
        self._built = (blocks, state_layout, stats_layout, units)
        self._precon_layouts = {}
        return state_layout, stats_layout

    @property
    def state_layout(self) -> PackLayout:
        """The layout of the blocks' states (owners, offsets, buffer lengths)."""
        return self._build()[0]

    @property
    def units(self) -> _sharded_units.Units:
        """The units of the state (whole blocks, runs of slices of large stacked ones)."""
        self._build()
        return self._built[3]

    @property
    def owners(self) -> tuple[int, ...]:
        """The owner device of each unit (`units`)."""
        return self.state_layout.owners

    def _precon_layout(self, vectors, weights, power, exact) -> PackLayout:
        shapes = [(jnp.shape(x), jnp.result_type(x)) for x in jax.tree.leaves((vectors, weights))]
        key = (power, exact, tuple(shapes))
        if key not in self._precon_layouts:
            blocks = self.units.blocks
            outs = jax.eval_shape(
                lambda s, v: [
                    b.multiply_matpower(si, vi, w, power, exact, True)
                    for b, si, vi, w in zip(blocks, s, v, weights, strict=True)
                ],
                self.state_shapes,
                vectors,
            )
            self._precon_layouts[key] = PackLayout(outs, self.owners, self.num_devices)
        return self._precon_layouts[key]

    # ---------------------------------------------------------------- state

    def shard(self, state: EstimatorState) -> ShardedEstimatorState:
        """``state`` packed per owner, laid out over the data axis when there is a mesh."""
        buffers = self.state_layout.pack(self.units.split(state.blocks))
        if self.mesh is not None:
            sharding = NamedSharding(self.mesh, P(self.axis_name))
            if any(map(is_traced, buffers)):
                buffers = jax.lax.with_sharding_constraint(buffers, sharding)
            else:
                buffers = jax.device_put(buffers, sharding)
        return ShardedEstimatorState(tuple(buffers))

    def own_rows(self, state: ShardedEstimatorState) -> ShardedEstimatorState:
        """This device's rows ``[1, length]`` of ``state`` (inside the data axis: under
        `jax.pmap` each device keeps its own)."""
        me = jax.lax.axis_index(self.axis_name)
        return ShardedEstimatorState(
            tuple(jax.lax.dynamic_slice_in_dim(b, me, 1) for b in state.buffers)
        )

    def gather(self, state: ShardedEstimatorState) -> EstimatorState:
        """The ordinary per-block state from the global buffers (``[devices, length]``,
        or ``[devices, 1, length]`` from `jax.pmap`)."""
        buffers = tuple(b.reshape(b.shape[0], -1) for b in state.buffers)
        if not any(map(is_traced, buffers)):
            buffers = jax.device_get(buffers)
            blocks = self.units.join(self.state_layout.unpack(buffers))
            return EstimatorState(tuple(jax.tree.map(jnp.asarray, blocks)))
        return EstimatorState(tuple(self.units.join(self.state_layout.unpack(buffers))))

    def local_shapes(self, expected: Any) -> Any:
        """``expected`` (shapes of a global state) with the rows one device sees."""

        def local(x):
            if isinstance(x, ShardedEstimatorState):
                return ShardedEstimatorState(
                    tuple(jax.ShapeDtypeStruct((1, *b.shape[1:]), b.dtype) for b in x.buffers)
                )
            return x

        return jax.tree.map(local, expected, is_leaf=lambda x: isinstance(x, ShardedEstimatorState))

    # ---------------------------------------------------------------- statistics

    def reduce_stats(self, stats: CurvatureStats, axis_name: str | None) -> PackedStats:
        """The statistics reduced to their owners: inside the axis (``axis_name``) each
        device's weighted statistics are reduce-scattered; under the sharded jit
        (``None``) the global statistics are laid out over the data axis."""
        layout = self._build()[1]
        if axis_name is None:
            # The compiler all-reduces the statistics it computes over the global batch;
            # each owner then reads its rows (laying them out over the axis here makes
            # GSPMD add all-to-alls, no reduce-scatter).
            rows = layout.pack(self.units.split(stats.blocks))
            return PackedStats(rows, rows)
        # As `kfacx.parallel._reductions.weighted_mean`, summed to the owner only.
        weight = jnp.asarray(stats.batch_size, jnp.float32)
        total = jax.lax.psum(weight, axis_name)
        safe = jnp.where(total > 0, total, 1.0)
        weighted = jax.tree.map(lambda s: s * weight.astype(s.dtype), stats.blocks)
        packed = layout.pack(self.units.split(weighted))
        mine = jax.lax.psum_scatter(packed, axis_name, scatter_dimension=0, tiled=True)
        rows = tuple(m / safe.astype(m.dtype) for m in mine)
        check = jax.lax.psum(
            sum(jnp.sum(r * jnp.zeros((), r.dtype)).astype(jnp.float32) for r in rows),
            axis_name,
        )
        return PackedStats(rows, check)

    # ---------------------------------------------------------------- the step

    def precondition(
        self,
        state: ShardedEstimatorState,
        count: Any,
        grads: Any,
        stats: PackedStats,
        identity_weight: Any,
        *,
        curvature_ema: Any,
        inverse_update_period: Any,
        use_exact_inverses: bool,
        update_curvature: Any,
        power: float,
        bound: bool,
    ) -> tuple[Any, ShardedEstimatorState]:
        """`kfacx.transform.precondition` on the sharded state: ``(preconditioned grads,
        new state)``. ``bound``: called inside the data axis (shard_map); otherwise
        (sharded jit) the work runs in a `jax.shard_map` over it."""
        if power != 1:
            _identity_weights.check(identity_weight, "multiply_matpower", allow_zero=False)
        ema_old, ema_new = _statistics.ema_weights(curvature_ema, update_curvature)
        weights = _identity_weights.per_block(identity_weight, len(self.estimator.blocks))
        weights = self.units.per_unit(weights)
        run = functools.partial(
            self._local_precondition,
            period=inverse_update_period,
            exact=use_exact_inverses,
            power=power,
        )
        args = (state.buffers, stats.rows, grads, count, weights, ema_old, ema_new)
        if bound:
            precon, rows = run(*args)
        else:
            precon, rows = self._mapped(run, args, num_outputs=(1, 1))
        return precon, ShardedEstimatorState(tuple(rows))

    def fold(
        self,
        state: ShardedEstimatorState,
        stats: PackedStats,
        ema_old: Any,
        ema_new: Any,
        bound: bool,
    ) -> ShardedEstimatorState:
        """The statistics folded into the moving averages (no refresh, no product)."""
        args = (state.buffers, stats.rows, ema_old, ema_new)
        if bound:
            rows = self._local_fold(*args)
        else:
            rows = self._mapped(self._local_fold, args, num_outputs=None)
        return ShardedEstimatorState(tuple(rows))

    def _mapped(self, fn, args, num_outputs):
        """``fn(state rows, stat rows, *rest)`` in a `jax.shard_map` over the data axis:
        ``args`` has the global buffers (split over the axis), all owners' statistics
        (each device takes its row) and the rest (replicated); the last output is split
        over the axis."""
        axis = self.axis_name
        in_specs = (P(axis),) + (P(),) * (len(args) - 1)
        out_specs = P(axis) if num_outputs is None else (P(), P(axis))

        def own_stats(rows, stat_rows, *rest):
            me = jax.lax.axis_index(axis)
            mine = tuple(jax.lax.dynamic_slice_in_dim(r, me, 1) for r in stat_rows)
            return fn(rows, mine, *rest)

        return jax.shard_map(
            own_stats,
            mesh=self.mesh,
            in_specs=in_specs,
            out_specs=out_specs,
            axis_names=frozenset({axis}),
            check_vma=False,
        )(*args)

    def _on_owner(self, branch, *operands):
        """``branch(d, *operands)`` on device ``d`` of the axis (one `jax.lax.switch`)."""
        if self.num_devices == 1:
            return branch(0, *operands)
        branches = [functools.partial(branch, d) for d in range(self.num_devices)]
        return jax.lax.switch(jax.lax.axis_index(self.axis_name), branches, *operands)

    def _fold_owner(self, d, rows, stat_rows, ema_old, ema_new):
        """Owner ``d``'s block states (``index -> state``) after folding its statistics."""
        state_layout, stats_layout = self._build()
        states = state_layout.unpack_owner(d, rows)
        stats = stats_layout.unpack_owner(d, stat_rows)
        blocks = self.units.blocks
        coverage = self.units.per_unit(self.estimator._coverage_shapes)
        return {
            i: _statistics.update_block(
                blocks[i], states[i], stats[i], ema_old, ema_new, coverage[i] is not None
            )
            for i in states
        }

    def _local_fold(self, rows, stat_rows, ema_old, ema_new):
        rows, stat_rows = [r[0] for r in rows], [r[0] for r in stat_rows]

        def branch(d, rows, stat_rows, ema_old, ema_new):
            states = self._fold_owner(d, rows, stat_rows, ema_old, ema_new)
            return self.state_layout.pack_owner(d, states, rows, group=0)

        out = self._on_owner(branch, rows, stat_rows, ema_old, ema_new)
        return tuple(r[None] for r in out)

    def _local_precondition(
        self, rows, stat_rows, grads, count, weights, ema_old, ema_new, *, period, exact, power
    ):
        est, units = self.estimator, self.units
        owned = isinstance(grads, OwnedGradient)
        like = grads.like if owned else grads
        vectors = units.split(est.params_to_blocks(like))
        precon_layout = self._precon_layout(vectors, weights, power, exact)
        if owned:  # This device's units only, packed.
            vectors = tuple(r[0] for r in grads.rows)
        rows, stat_rows = [r[0] for r in rows], [r[0] for r in stat_rows]
        norm = est.norm_to_scale_identity_weight_per_block

        def branch(d, rows, stat_rows, vectors, count, weights, ema_old, ema_new):
            if owned:
                vectors = self._vector_layout(like).unpack_owner(d, vectors)
            layout = self.state_layout
            states = self._fold_owner(d, rows, stat_rows, ema_old, ema_new)
            rows = layout.pack_owner(d, states, rows, group=0)
            mine = sorted(states)
            blocks = [units.blocks[i] for i in mine]
            own_weights = tuple(weights[i] for i in mine)

            # On the rows: the steps between refreshes pass them on as they are.
            def refresh(rows, w):
                states = layout.unpack_owner(d, rows)
                before = tuple(states[i] for i in mine)
                scaled = _identity_weights.scaled(blocks, before, w, norm)
                new = _refresh.refresh(blocks, before, scaled, None)
                group = None if self._refresh_writes_front else 1
                return layout.pack_owner(d, dict(zip(mine, new, strict=True)), rows, group=group)

            if mine:
                rows = refresh_on_schedule(count, period, refresh, rows, own_weights)
            states = layout.unpack_owner(d, rows)
            new = tuple(states[i] for i in mine)
            scaled = _identity_weights.scaled(blocks, new, own_weights, norm)
            outs = {
                i: b.multiply_matpower(s, vectors[i], w, power, exact, True)
                for i, b, s, w in zip(mine, blocks, new, scaled, strict=True)
            }
            return rows, precon_layout.pack_owner(d, outs)

        operands = (rows, stat_rows, vectors, count, weights, ema_old, ema_new)
        new_rows, precon_row = self._on_owner(branch, *operands)
        if self.num_devices == 1:
            gathered = tuple(r[None] for r in precon_row)
        else:
            gathered = tuple(jax.lax.all_gather(r, self.axis_name) for r in precon_row)
        precon = est.blocks_to_params(units.join(precon_layout.unpack(gathered)), like=like)
        return precon, tuple(r[None] for r in new_rows)

    # ---------------------------------------------------------------- the gradient

    def _vector_layout(self, grads: Any) -> PackLayout:
        """The layout of ``grads``'s units packed per owner (cached by shapes)."""
        key = ("vectors", tuple((jnp.shape(x), jnp.result_type(x)) for x in jax.tree.leaves(grads)))
        if key not in self._precon_layouts:
            vectors = self.units.split(self.estimator.params_to_blocks(grads))
            self._precon_layouts[key] = PackLayout(vectors, self.owners, self.num_devices)
        return self._precon_layouts[key]

    def scatter_grads(self, grads: Any, axis_name: str) -> OwnedGradient:
        """The mean of the devices' ``grads`` over the axis, each device receiving its
        own units' part only (a reduce-scatter instead of an all-reduce)."""
        layout = self._vector_layout(grads)
        packed = layout.pack(self.units.split(self.estimator.params_to_blocks(grads)))
        mine = jax.lax.psum_scatter(packed, axis_name, scatter_dimension=0, tiled=True)
        return OwnedGradient(self, tuple(m / self.num_devices for m in mine), grads)


class OwnedGradient:
    """The gradient reduce-scattered to the owners (`ShardedCurvature.scatter_grads`):
    each device holds the mean gradient of the units it owns, packed (``rows``, one
    ``[1, length]`` per buffer). The sharded precondition reads it; a dot product with a
    whole pytree (`kfacx._helpers._tree.tree_dot` calls `dot_with`) sums the owners' parts over
    the axis, which is all the step needs of the gradient besides."""

    def __init__(self, plan: ShardedCurvature, rows: tuple[jax.Array, ...], like: Any):
        self.plan, self.rows, self.like = plan, rows, like

    def dot_with(self, other: Any) -> jax.Array:
        plan, rows = self.plan, [r[0] for r in self.rows]
        if other is self:
            local = _dots(rows, rows)
        else:
            layout = plan._vector_layout(self.like)
            vectors = plan.units.split(plan.estimator.params_to_blocks(other))

            def branch(d, rows, vectors):
                return _dots(rows, layout.pack_owner(d, {i: vectors[i] for i in layout.owned[d]}))

            local = plan._on_owner(branch, rows, vectors)
        return jax.lax.psum(local, plan.axis_name)


def _dots(xs: Sequence[jax.Array], ys: Sequence[jax.Array]) -> jax.Array:
    """``sum(x * y)`` over the pairs, in float32 or wider (as `kfacx._helpers._tree.tree_dot`)."""
    wide = _tree.wide
    return sum(
        (jnp.sum(wide(x) * wide(y)) for x, y in zip(xs, ys, strict=True)),
        jnp.zeros((), jnp.float32),
    )


def _bytes(states: Any) -> list[int]:
    """The bytes of each state (of shapes)."""
    return [sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(s)) for s in states]


def sharded_curvature(placement: Any, estimator: BlockDiagonalCurvature) -> Any:
    """The plan of `kfacx.Optimizer`'s sharded state on its placement's mesh, or None
    when the state is replicated."""
    if not placement.shard_state:
        return None
    if placement.kind == "pmap":
        return ShardedCurvature(estimator, placement.state_shards, placement.axis_name)
    mesh, axis = placement.mesh, placement.data_axis_name
    return ShardedCurvature(estimator, placement.num_shards, axis, mesh)


_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def plan_for(estimator: BlockDiagonalCurvature, num_devices: int) -> ShardedCurvature:
    """A (cached) plan of ``estimator``'s state on ``num_devices`` devices, for reading
    states back (`gather_estimator_state`)."""
    plans = _PLANS.setdefault(estimator, {})
    if num_devices not in plans:
        plans[num_devices] = ShardedCurvature(estimator, num_devices, None)
    return plans[num_devices]


def gather_estimator_state(
    estimator: BlockDiagonalCurvature, state: ShardedEstimatorState
) -> EstimatorState:
    """The ordinary `kfacx.EstimatorState` (one state per block) of a sharded one.

    For inspecting, comparing or checkpointing the curvature state of
    ``shard_curvature_state=True`` (`kfacx.Optimizer`'s ``state.estimator_state``,
    `kfacx.scale_by_kfac`'s). Eagerly, the buffers are copied to the host and the
    result is a state of (single-device) arrays; under `jax.jit` it is traced.

    Args:
      estimator: the estimator the state belongs to (``optimizer.estimator``).
      state: a `kfacx.parallel.ShardedEstimatorState`.

    Raises:
      TypeError: if ``state`` is not a `kfacx.parallel.ShardedEstimatorState`.
    """
    if not isinstance(state, ShardedEstimatorState):
        raise TypeError(
            "gather_estimator_state takes the ShardedEstimatorState of "
            f"{OPTION}=True (e.g. optimizer_state.estimator_state), got {type(state).__name__}."
        )
    return plan_for(estimator, state.buffers[0].shape[0]).gather(state)
