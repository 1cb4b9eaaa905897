"""K-FAC as an optax transformation, and an aggregator for micro-batch accumulation.

`scale_by_kfac` preconditions gradients with the damped inverse of the
block-diagonal curvature. It does not compute statistics itself: the caller
gets them, together with the loss and the gradients, from
`kfacx.BlockDiagonalCurvature.value_grads_and_curvature_stats` and passes them
as the extra argument ``curvature_stats``::

    estimator = kfacx.BlockDiagonalCurvature(loss_fn)
    tx = optax.chain(
        kfacx.scale_by_kfac(estimator, (params, batch), damping=1e-3),
        optax.sgd(learning_rate=0.1, momentum=0.9),
    )
    opt_state = tx.init(params)
    loss, grads, stats = estimator.value_grads_and_curvature_stats(rng, (params, batch))
    updates, opt_state = tx.update(grads, opt_state, params, curvature_stats=stats)

`accumulate_curvature_stats` is the matching aggregator for
``optax.experimental.aggregating.process``: it averages gradients *and*
curvature statistics over micro-batches and hands both to the postprocessor
once the last micro-batch has arrived.

Its wing: ``_transform_parts`` (what the K-FAC transformations share),
``_eigen_adam`` (`scale_by_kfac_eigen_adam`), ``_partition`` (`block_labels`),
``_graft`` (`graft`), ``_aliases`` (the chains `kfac_adamw` and `kfac_soap`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from kfacx._helpers import _checks
from kfacx._helpers._checks import is_traced
from kfacx.blocks._base import check_precon_power
from kfacx.estimator import BlockDiagonalCurvature, CurvatureStats, EstimatorState
from kfacx.estimator._refresh import refresh_on_schedule
from kfacx.estimator._sharded_curvature import ShardedCurvature
from kfacx.parallel._sharded_state import ShardedEstimatorState
from kfacx.transform import _partition
from kfacx.transform._transform_parts import (
    check_curvature_stats,
    checked_ema,
    checked_period,
    fold_statistics,
    reject_multi_steps,
    replace_params,
)


class ScaleByKfacState(NamedTuple):
    """State of `scale_by_kfac`.

    Attributes:
      count: number of updates so far.
      estimator_state: the curvature blocks' moving averages and cached inverses
        (inside `optax.masked` / `optax.partition`: of the kept parameters' blocks only).
    """

    count: jax.Array
    estimator_state: EstimatorState


def estimator_state(opt_state: Any) -> EstimatorState | ShardedEstimatorState:
    """The curvature estimator's state inside an optax state holding one `scale_by_kfac`
    or `kfacx.scale_by_kfac_eigen_adam` (in `optax.chain`, `optax.inject_hyperparams`,
    ...; any state tuple with an ``estimator_state`` field counts), for the blocks whose
    statistics need it (EKFAC)::

        loss, grads, stats = estimator.value_grads_and_curvature_stats(
            rng, (params, batch), estimator_state=kfacx.estimator_state(opt_state))

    With ``shard_curvature_state=True`` it is the `kfacx.parallel.ShardedEstimatorState`
    (read it per block with `kfacx.gather_estimator_state`).

    Raises:
      ValueError: if ``opt_state`` holds no such state, or several.
    """

    def is_kfac(x: Any) -> bool:
        return isinstance(x, tuple) and isinstance(
            getattr(x, "estimator_state", None), EstimatorState | ShardedEstimatorState
        )

    found = [x for x in jax.tree_util.tree_leaves(opt_state, is_leaf=is_kfac) if is_kfac(x)]
    if len(found) != 1:
        raise ValueError(
            f"estimator_state: the optimizer state holds {len(found)} scale_by_kfac states "
            "(or scale_by_kfac_eigen_adam states); expected exactly one (with several, take "
            "the estimator_state field of the one you mean)."
        )
    return found[0].estimator_state


def precondition(
    estimator: BlockDiagonalCurvature,
    estimator_state: EstimatorState,
    count: Any,
    grads: Any,
    curvature_stats: CurvatureStats,
    damping: Any,
    *,
    curvature_ema: float,
    inverse_update_period: int,
    use_exact_inverses: bool = False,
    update_curvature: Any = True,
    stats_axis_name: str | None = None,
    refresh_axis_name: str | None = None,
    refresh: Callable[[EstimatorState, Any], EstimatorState] | None = None,
    power: float = -1.0,
) -> tuple[Any, EstimatorState]:
    """The K-FAC preconditioning step shared by `scale_by_kfac` and `kfacx.Optimizer`.

    Folds ``curvature_stats`` into the blocks' moving averages, refreshes the
    cached damped inverses when ``count`` is a multiple of
    ``inverse_update_period`` (the first update included), and returns
    ``((C + damping I)^-1 grads, new_estimator_state)``. Pure: jit, pmap and
    shard it as you like.

    Args:
      estimator: the (set-up) curvature estimator.
      estimator_state: its state.
      count: updates so far (an int array); decides the refresh.
      grads: a parameter-shaped pytree to precondition.
      curvature_stats: this batch's `kfacx.CurvatureStats`.
      damping: the damping (identity weight) of the inverse and its refresh (one
        number, or one per curvature block).
      curvature_ema: weight of the old moving average in each update.
      inverse_update_period: refresh the cached inverses every this many updates.
      use_exact_inverses: exact inverses of the damped Kronecker products
        (cached eigendecompositions) instead of factored damping.
      update_curvature: whether to fold the statistics in (a bool or a traced
        bool; False leaves the moving averages as they are).
      stats_axis_name: average the statistics over this device axis first.
      refresh_axis_name: distribute the refresh over this device axis (see
        `kfacx.BlockDiagonalCurvature.update_cache`).
      refresh: ``(estimator_state, damping) -> estimator_state`` replacing
        ``estimator.update_cache`` (e.g. a refresh placed on a mesh).
      power: precondition with ``(C + damping I)^power`` instead of the inverse
        (the estimator must cache that power, e.g. ``approx_powers_to_cache=(-0.5,)``).

    Returns:
      ``(preconditioned, estimator_state)``.
    """
    state = fold_statistics(
        estimator,
        estimator_state,
        curvature_stats,
        curvature_ema,
        update_curvature,
        stats_axis_name,
    )
    if refresh is None:
        refresh = lambda e, w: estimator.update_cache(e, w, refresh_axis_name)  # noqa: E731
    state = refresh_on_schedule(count, inverse_update_period, refresh, state, damping)
    precon = estimator.multiply_matpower(
        state, grads, damping, power, exact_power=use_exact_inverses, use_cached=True
    )
    return precon, state


def _static_power(power: Any, use_exact_inverses: bool) -> float:
    """``precon_power`` as a float (-1 for None), from a number or a concrete array."""
    if power is None:
        return -1.0
    if is_traced(power):
        raise ValueError(
            "scale_by_kfac: precon_power chooses a cached power and must be a number: with "
            "optax.inject_hyperparams, pass static_args=('precon_power',)."
        )
    if isinstance(power, (jax.Array, np.ndarray)) and power.shape == ():
        power = power.item()
    return check_precon_power(power, use_exact_inverses)


def _damping_schedule(damping: Any) -> Callable[[jax.Array], Any]:
    """``count -> damping`` from a number, an array (`optax.inject_hyperparams` passes
    its hyperparameters as arrays, traced under jit) or a schedule."""
    if callable(damping):
        return damping
    if isinstance(damping, (jax.Array, np.ndarray)):
        if np.shape(damping) != () or not jnp.issubdtype(jnp.result_type(damping), jnp.floating):
            raise TypeError(f"damping must be a float scalar, got {damping!r}.")
        if not is_traced(damping):
            _checks.check_damping(damping, "scale_by_kfac", allow_zero=False)
        return lambda count: damping
    return _checks.as_schedule(damping, "damping")


def scale_by_kfac(
    estimator: BlockDiagonalCurvature,
    func_args: Sequence[Any],
    damping: float | Callable[[jax.Array], Any] = 1e-3,
    curvature_ema: float = 0.95,
    inverse_update_period: int = 5,
    use_exact_inverses: bool = False,
    pmap_axis_name: str | None = None,
    distributed_inverses: bool = True,
    precon_power: float | None = None,
    shard_curvature_state: bool = False,
    mesh: jax.sharding.Mesh | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Preconditions gradients with the damped inverse of the K-FAC curvature.

    Each update folds the ``curvature_stats`` extra argument into the
    curvature blocks' moving averages, refreshes the cached damped inverses
    every ``inverse_update_period`` updates (the first update included), and
    returns ``(C + damping I)^-1 grads``. Chain it with an optax optimizer that
    applies the learning rate (and momentum), e.g. ``optax.sgd``. For weight
    decay ``l2``, put ``optax.add_decayed_weights(l2)`` before it and add
    ``l2`` to ``damping``: that is what `kfacx.Optimizer` does with ``l2_reg``.

    It works inside optax's wrappers (docs/optax.md shows each):

    - `optax.masked` and `optax.partition` / `optax.multi_transform`: it then
      receives part of the gradient (the rest is `optax.MaskedNode`) and keeps
      and preconditions only the blocks of those parameters, from the whole
      model's ``curvature_stats``. A block's parameters must be kept or masked
      together: `kfacx.block_labels` labels them block by block.
    - `optax.inject_hyperparams`: ``damping``, ``curvature_ema`` and
      ``inverse_update_period`` become hyperparameters that can be changed or
      scheduled between steps (``estimator`` and ``func_args`` stay static).
    - `optax.apply_if_finite`: a non-finite gradient skips the step and keeps
      the state; `kfacx.flag_non_finite_stats` in front of it makes non-finite
      statistics do the same.
    - Not `optax.MultiSteps`, which would not accumulate the statistics (a
      ValueError); use `kfacx.accumulate_curvature_stats`.

    Args:
      estimator: the curvature estimator of the loss function.
      func_args: example arguments of the loss function, e.g. ``(params, batch)``
        (only shapes and dtypes matter). The estimator is set up from them now,
        so that aggregators created afterwards know the statistics' shapes.
      damping: the damping, a number or a schedule ``count -> damping``.
      curvature_ema: weight of the old moving average in each update.
      inverse_update_period: refresh the cached inverses every this many updates.
      use_exact_inverses: use exact inverses of the damped Kronecker products
        (the estimator must cache them: ``exact_powers_to_cache=(-1,)``)
        instead of factored "pi" damping.
      pmap_axis_name: average the statistics over this device axis (weighted
        by each device's batch size), inside `jax.pmap` or `jax.shard_map`.
      distributed_inverses: with ``pmap_axis_name``, refresh each block's
        inverse on one owner device and share it (see
        `kfacx.BlockDiagonalCurvature.update_cache`); the result is identical.
      precon_power: precondition with ``(C + damping I)^precon_power`` (kfac-jax's
        option; None means -1; -1 or -0.5 with factored damping, any negative
        power with ``use_exact_inverses``). The estimator must cache that power,
        e.g. ``BlockDiagonalCurvature(..., approx_powers_to_cache=(-0.5,))``. It
        chooses a cached power, so it cannot be a hyperparameter of
        `optax.inject_hyperparams`: name it in ``static_args`` there.
      shard_curvature_state: keep each block's factors and cached inverses on one
        owner device of the ``pmap_axis_name`` axis of ``mesh`` (a
        `kfacx.parallel.ShardedEstimatorState`; see docs/scaling.md): ``init`` (called
        outside the `jax.shard_map`) lays the state out over the axis, and ``update``
        (inside it, with each device's own statistics) reduce-scatters the
        statistics to their owners and all-gathers the preconditioned gradient. Give
        the state's ``in_specs`` / ``out_specs`` with
        `kfacx.parallel.sharded_state_specs`. Same results as the replicated state.
        Not inside `optax.masked` / `optax.partition`, nor with EKFAC blocks, yet.
      mesh: the `jax.sharding.Mesh` of the `jax.shard_map` (with
        ``shard_curvature_state`` only).

    Returns:
      An `optax.GradientTransformationExtraArgs` whose ``update`` requires the
      keyword argument ``curvature_stats`` (a `kfacx.CurvatureStats`).

    Raises:
      ValueError: on a bad period, moving-average weight or power; inside
        `optax.MultiSteps`; on a mask that splits a block.
      TypeError: if ``estimator`` is not a `kfacx.BlockDiagonalCurvature`.
    """
    if not isinstance(estimator, BlockDiagonalCurvature):
        raise TypeError(
            f"scale_by_kfac: estimator must be a kfacx.BlockDiagonalCurvature, got {estimator!r}."
        )
    damping_fn = _damping_schedule(damping)
    ema = checked_ema(curvature_ema)
    period = checked_period(inverse_update_period)
    power = _static_power(precon_power, use_exact_inverses)
    func_args = tuple(func_args)
    estimator.set_up(func_args)
    example_params = func_args[estimator.params_index]
    refresh_axis = pmap_axis_name if distributed_inverses else None
    sharded = _sharded_plan(estimator, shard_curvature_state, mesh, pmap_axis_name)

    def init_fn(params):
        reject_multi_steps()
        if sharded is not None:
            _reject_masked(params)
            args = replace_params(func_args, params, estimator.params_index)
            state = sharded.shard(estimator.init(jax.random.key(0), args))
            return ScaleByKfacState(jnp.zeros((), jnp.int32), state)
        if not _partition.has_masked_nodes(params):
            args = replace_params(func_args, params, estimator.params_index)
            return ScaleByKfacState(
                jnp.zeros((), jnp.int32), estimator.init(jax.random.key(0), args)
            )
        subset = _partition.BlockSubset(estimator, example_params, params)
        state = subset.select(estimator.init(jax.random.key(0), func_args))
        return ScaleByKfacState(jnp.zeros((), jnp.int32), state)

    def update_fn(updates, state, params=None, *, curvature_stats=None, **extra_args):
        del params, extra_args
        reject_multi_steps()
        check_curvature_stats(curvature_stats, "scale_by_kfac.update")
        if sharded is not None:
            _reject_masked(updates)
            precon, est = sharded.precondition(
                state.estimator_state,
                state.count,
                updates,
                sharded.reduce_stats(curvature_stats, pmap_axis_name),
                jnp.asarray(damping_fn(state.count)),
                curvature_ema=ema,
                inverse_update_period=period,
                use_exact_inverses=use_exact_inverses,
                update_curvature=True,
                power=power,
                bound=True,
            )
            return precon, ScaleByKfacState(state.count + 1, est)
        curvature = estimator
        if _partition.has_masked_nodes(updates):
            curvature = _partition.BlockSubset(estimator, example_params, updates)
            curvature.check_state(state.estimator_state)
        precon, est = precondition(
            curvature,
            state.estimator_state,
            state.count,
            updates,
            curvature_stats,
            jnp.asarray(damping_fn(state.count)),
            curvature_ema=ema,
            inverse_update_period=period,
            use_exact_inverses=use_exact_inverses,
            stats_axis_name=pmap_axis_name,
            refresh_axis_name=refresh_axis,
            power=power,
        )
        return precon, ScaleByKfacState(state.count + 1, est)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _sharded_plan(
    estimator: BlockDiagonalCurvature, shard: bool, mesh: Any, axis: str | None
) -> ShardedCurvature | None:
    """`scale_by_kfac`'s plan of the sharded state, or None (replicated).

    Raises:
      ValueError: for ``shard_curvature_state`` without ``pmap_axis_name`` and a
        ``mesh`` that has it, or ``mesh`` without ``shard_curvature_state``.
    """
    if not shard:
        if mesh is not None:
            raise ValueError(
                "scale_by_kfac: mesh= is only used with shard_curvature_state=True; "
                "drop it, or pass shard_curvature_state=True."
            )
        return None
    if axis is None or not isinstance(mesh, jax.sharding.Mesh) or axis not in mesh.axis_names:
        raise ValueError(
            "scale_by_kfac: shard_curvature_state=True needs pmap_axis_name= (the axis of the "
            "jax.shard_map that runs update) and mesh= (the jax.sharding.Mesh with that axis); "
            f"got pmap_axis_name={axis!r}, mesh={mesh!r}. For jax.pmap it is not supported yet."
        )
    estimator.blocks  # noqa: B018  (set up: raises if not)
    return ShardedCurvature(estimator, int(mesh.shape[axis]), axis, mesh)


def _reject_masked(tree: Any) -> None:
    if _partition.has_masked_nodes(tree):
        raise ValueError(
            "scale_by_kfac: shard_curvature_state=True is not supported inside optax.masked / "
            "optax.partition yet; use shard_curvature_state=False there."
        )


def flag_non_finite_stats() -> optax.GradientTransformationExtraArgs:
    """Turns the updates into NaNs when the ``curvature_stats`` are not finite.

    `optax.apply_if_finite` skips a step (and keeps its inner state) when the
    *gradient* has a NaN or an infinity, but it does not look at the extra
    arguments. Put this transformation in front of it, so that non-finite
    curvature statistics skip the step as well::

      tx = optax.chain(
          kfacx.flag_non_finite_stats(),
          optax.apply_if_finite(
              optax.chain(kfacx.scale_by_kfac(estimator, (params, batch)), optax.sgd(0.1)),
              max_consecutive_errors=5,
          ),
      )

    Returns:
      A stateless `optax.GradientTransformationExtraArgs` whose ``update``
      takes the keyword argument ``curvature_stats`` and returns the updates
      unchanged if all its entries are finite, and all-NaN updates otherwise.
    """

    def update_fn(updates, state, params=None, *, curvature_stats=None, **extra_args):
        del params, extra_args
        if not isinstance(curvature_stats, CurvatureStats):
            raise TypeError(
                "flag_non_finite_stats.update needs the keyword argument curvature_stats=... "
                f"(a kfacx.CurvatureStats); got {type(curvature_stats).__name__}."
            )
        leaves = jax.tree_util.tree_leaves(curvature_stats)
        finite = jnp.all(jnp.asarray([jnp.all(jnp.isfinite(x)) for x in leaves]))
        flagged = jax.tree_util.tree_map(lambda u: jnp.where(finite, u, math.nan), updates)
        return flagged, state

    return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update_fn)


class AccumulateCurvatureStatsState(NamedTuple):
    """State of `accumulate_curvature_stats`.

    Attributes:
      micro_step: micro-batches accumulated since the last update.
      ready: whether the last call completed a full batch.
      grads: the batch-size-weighted sum of the gradients so far.
      stats: the batch-size-weighted sum of the curvature statistics so far.
    """

    micro_step: jax.Array
    ready: jax.Array
    grads: Any
    stats: CurvatureStats


def accumulate_curvature_stats(
    estimator: BlockDiagonalCurvature, num_microbatches: int
) -> optax.GradientTransformationExtraArgs:
    """Averages gradients and curvature statistics over ``num_microbatches`` calls.

    For ``optax.experimental.aggregating.process(..., aggregator_has_aux=True)``
    with `scale_by_kfac` in the postprocessor: every call takes one
    micro-batch's gradients and its ``curvature_stats`` extra argument; the
    last call of each group returns the averages (weighted by each
    micro-batch's number of real examples, so padded micro-batches count
    exactly as much as their real examples) and sets ``ready``.

    Args:
      estimator: the estimator the statistics come from; it must be set up
        when ``init`` is called (creating `scale_by_kfac` sets it up, so the
        order of construction does not matter).
      num_microbatches: micro-batches per update.

    Returns:
      An `optax.GradientTransformationExtraArgs` whose update returns
      ``((grads, {"curvature_stats": stats}), state)``.
    """
    _checks.check_int(num_microbatches, "num_microbatches", minimum=1)

    def init_fn(params):
        return AccumulateCurvatureStatsState(
            jnp.zeros((), jnp.int32),
            jnp.zeros((), bool),
            optax.tree.zeros_like(params),
            estimator.zero_curvature_stats(),
        )

    def update_fn(updates, state, params=None, *, curvature_stats=None, **extra_args):
        del params, extra_args
        if not isinstance(curvature_stats, CurvatureStats):
            raise TypeError(
                "accumulate_curvature_stats needs the keyword argument curvature_stats=... "
                f"(a kfacx.CurvatureStats); got {type(curvature_stats).__name__}."
            )
        w = jnp.asarray(curvature_stats.batch_size, jnp.float32)
        grads = jax.tree_util.tree_map(lambda a, g: a + w.astype(g.dtype) * g, state.grads, updates)
        blocks = jax.tree_util.tree_map(
            lambda a, s: a + w.astype(s.dtype) * s, state.stats.blocks, curvature_stats.blocks
        )
        total = state.stats.batch_size + w
        step = state.micro_step + 1
        ready = step == num_microbatches
        safe = jnp.where(total > 0, total, 1.0)
        mean_grads = jax.tree_util.tree_map(lambda g: g / safe.astype(g.dtype), grads)
        mean_stats = CurvatureStats(
            jax.tree_util.tree_map(lambda s: s / safe.astype(s.dtype), blocks), total
        )
        zero = jax.tree_util.tree_map(jnp.zeros_like, mean_grads)
        out_grads = jax.tree_util.tree_map(lambda m, z: jnp.where(ready, m, z), mean_grads, zero)
        zero_stats = jax.tree_util.tree_map(jnp.zeros_like, state.stats)
        new_state = jax.tree_util.tree_map(
            lambda reset, keep: jnp.where(ready, reset, keep),
            AccumulateCurvatureStatsState(step * 0, ready, zero, zero_stats),
            AccumulateCurvatureStatsState(step, ready, grads, CurvatureStats(blocks, total)),
        )
        return (out_grads, {"curvature_stats": mean_stats}), new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
