"""Sharded curvature states across device counts (checkpoints restored elsewhere).

A `kfacx.parallel.ShardedEstimatorState` is packed for one number of devices (its
owners and rows). `shard_estimator_state` repacks a state for another count, or packs
an ordinary per-block state (`kfacx.gather_estimator_state`'s, a replicated run's).
The packing is exact (concatenations and slices), so a repacked state takes the same
steps.
"""

from __future__ import annotations

from kfacx.estimator import BlockDiagonalCurvature, EstimatorState
from kfacx.estimator._sharded_curvature import gather_estimator_state, plan_for
from kfacx.parallel._sharded_state import ShardedEstimatorState


def shard_estimator_state(
    estimator: BlockDiagonalCurvature,
    state: EstimatorState | ShardedEstimatorState,
    num_devices: int,
) -> ShardedEstimatorState:
    """``state`` packed for ``num_devices`` owner devices (``shard_curvature_state``).

    For a checkpoint written on another number of devices (restored as host arrays,
    in a template of its own layout: this function's result for that count), or the
    per-block state of a replicated run. Put the result in the `kfacx.OptimizerState`
    you pass to an optimizer whose mesh's data axis has ``num_devices`` devices; its
    `step` lays the rows out over the axis. Eager and exact (no arithmetic).

    Args:
      estimator: the (set-up) estimator the state belongs to (``optimizer.estimator``).
      state: an ordinary `kfacx.EstimatorState`, or a sharded one of any device count.
      num_devices: the devices of the data axis the state is for.

    Raises:
      TypeError: if ``state`` is neither kind of estimator state.
      ValueError: if ``num_devices`` is not a positive integer.
    """
    if not isinstance(num_devices, int) or isinstance(num_devices, bool) or num_devices < 1:
        raise ValueError(f"num_devices must be a positive int, got {num_devices!r}.")
    if isinstance(state, ShardedEstimatorState):
        state = gather_estimator_state(estimator, state)
    if not isinstance(state, EstimatorState):
        raise TypeError(
            "shard_estimator_state takes an EstimatorState or a ShardedEstimatorState "
            f"(e.g. optimizer_state.estimator_state), got {type(state).__name__}."
        )
    return plan_for(estimator, num_devices).shard(state)
