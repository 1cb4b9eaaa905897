"""What K-FAC's optax transformations share (`kfacx.scale_by_kfac`,
`kfacx.scale_by_kfac_eigen_adam`): checks of their arguments, the curvature update
from the ``curvature_stats`` extra argument, the refresh schedule, and the guard
against `optax.MultiSteps`."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from kfacx._helpers import _checks
from kfacx._helpers._checks import is_traced
from kfacx.estimator import CurvatureStats, EstimatorState
from kfacx.estimator._statistics import ema_weights


def replace_params(func_args: Sequence[Any], params: Any, index: int) -> tuple:
    """``func_args`` with ``params`` at position ``index``."""
    args = list(func_args)
    args[index] = params
    return tuple(args)


def fold_statistics(
    estimator: Any,
    estimator_state: EstimatorState,
    curvature_stats: CurvatureStats,
    curvature_ema: Any,
    update_curvature: Any = True,
    stats_axis_name: str | None = None,
) -> EstimatorState:
    """Folds ``curvature_stats`` into the blocks' moving averages with weight
    ``curvature_ema`` for the old average (``update_curvature`` False, a bool or a traced
    bool, leaves them as they are); the first step of `kfacx.precondition`."""
    ema_old, ema_new = ema_weights(curvature_ema, update_curvature)
    return estimator.update_curvature_estimate_from_stats(
        estimator_state, curvature_stats, ema_old, ema_new, stats_axis_name
    )


def check_curvature_stats(curvature_stats: Any, who: str) -> None:
    """Raises a TypeError unless ``curvature_stats`` (``who``'s extra argument) is a
    `kfacx.CurvatureStats`."""
    if not isinstance(curvature_stats, CurvatureStats):
        raise TypeError(
            f"{who} needs the keyword argument curvature_stats=..., the "
            "kfacx.CurvatureStats from estimator.value_grads_and_curvature_stats; got "
            f"{type(curvature_stats).__name__}."
        )


def checked_ema(curvature_ema: Any) -> Any:
    """``curvature_ema`` checked (in [0, 1)); a traced one as it is."""
    if is_traced(curvature_ema):
        return curvature_ema
    _checks.check_ema(curvature_ema)
    return curvature_ema if isinstance(curvature_ema, jax.Array) else float(curvature_ema)


def checked_period(period: Any) -> Any:
    """An int >= 1, or an int scalar array (`optax.inject_hyperparams`)."""
    is_array = isinstance(period, (jax.Array, np.ndarray)) and np.shape(period) == ()
    if is_array and jnp.issubdtype(jnp.result_type(period), jnp.integer):
        if not is_traced(period):
            _checks.check_int(int(period), "inverse_update_period", minimum=1)
        return period
    return _checks.check_int(period, "inverse_update_period", minimum=1)


#: The code of the functions of `optax.MultiSteps` that call the inner transformation.
_MULTI_STEPS_CODE = frozenset(
    getattr(optax.MultiSteps, name).__code__ for name in ("init", "update")
)


def reject_multi_steps(who: str = "scale_by_kfac") -> None:
    """Raises a ValueError naming ``who`` when called (at any depth) from `optax.MultiSteps`."""
    frame = inspect.currentframe()
    while frame is not None:
        if frame.f_code in _MULTI_STEPS_CODE:
            raise ValueError(
                f"{who} cannot run inside optax.MultiSteps: MultiSteps averages the "
                "gradients of its mini-steps but gives the inner transformation only the last "
                "mini-step's curvature_stats, and discards the inner state of the others, so the "
                "curvature statistics would not be accumulated. Accumulate both with "
                "optax.experimental.aggregating.process(optax.with_extra_args_support("
                "optax.identity()), kfacx.accumulate_curvature_stats(estimator, k), "
                "<the K-FAC chain>, aggregator_has_aux=True) (docs/optax.md, 'Micro-batches'), "
                "or use kfacx.Optimizer(..., num_microbatches=k)."
            )
        frame = frame.f_back
