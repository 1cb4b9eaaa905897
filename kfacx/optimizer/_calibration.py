"""``use_initial_damping_calibration``: the initial damping adapted to the first batch.

Before the first step (after the burn-in), `calibrate` applies the Levenberg-Marquardt
rule of the damping adaptation (`kfacx.optimizer._damping.levenberg_marquardt`) to the reduction
ratio of the first step itself, computed for one damping after the other without taking
the step, until the ratio is between the thresholds (see `kfacx.DampingConfig`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from kfacx.optimizer._configs import CALIBRATION_STEPS, DampingConfig


def calibrated_state(
    staged_ratio: Callable[..., Any],
    args: Sequence[Any],
    values: Sequence[Any],
    config: DampingConfig,
) -> Any:
    """The optimizer state ``args[1]`` with its damping calibrated (`calibrate`).

    Args:
      staged_ratio: the staged `kfacx.optimizer._step.KfacStep.calibration_ratio`.
      args: ``(params, state, rng, batch, func_state)`` of the first step.
      values: ``(learning_rate, momentum, global_step_int)`` passed to it.
      config: the damping options.
    """
    state = args[1]

    def ratio_at(damping: float) -> float:
        rho = staged_ratio(*args, jnp.float32(damping), *values)
        return float(np.asarray(rho).reshape(-1)[0])

    initial = float(np.asarray(state.damping).reshape(-1)[0])
    damping = calibrate(ratio_at, config, initial)
    return state._replace(damping=jnp.full(np.shape(state.damping), damping, jnp.float32))


def calibrate(ratio_at: Callable[[float], float], config: DampingConfig, initial: float) -> float:
    """The calibrated damping, from ``initial``.

    Args:
      ratio_at: ``damping -> rho`` of the first step with that damping.
      config: the damping options (thresholds, decay and interval, bounds).
      initial: the damping to start from.

    Returns:
      The first damping whose ratio lies in ``[damping_lower_threshold,
      damping_upper_threshold]``; if the ratio jumps over that interval between two
      dampings, the larger of them (the one above it); the bound reached, or the last
      damping after `CALIBRATION_STEPS` tries. A non-finite ratio counts as too low
      (the damping grows).
    """
    factor = config.damping_adaptation_decay**config.damping_adaptation_interval
    damping, previous = float(initial), None
    for _ in range(CALIBRATION_STEPS):
        rho = ratio_at(damping)
        if config.damping_lower_threshold <= rho <= config.damping_upper_threshold:
            return damping
        grow = not (math.isfinite(rho) and rho > config.damping_upper_threshold)
        if previous is not None and previous[0] != grow:
            return max(damping, previous[1])
        following = damping / factor if grow else damping * factor
        following = min(max(following, config.min_damping), config.max_damping)
        if following == damping:
            return damping
        previous, damping = (grow, damping), following
    return damping
