"""The damping of `kfacx.Optimizer`'s step: chosen (adaptive, given, scheduled or
constant) and adapted by the Levenberg-Marquardt rule."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from kfacx._helpers._checks import Schedule
from kfacx.optimizer._configs import DampingConfig


def choose_damping(
    config: DampingConfig, current: jax.Array, given: Any, schedule: Schedule | None, step: Any
) -> jax.Array:
    """This step's damping: the state's ``current`` one when adaptive, else the
    ``given`` one, else the ``schedule``'s at ``step``, else the constant one (the
    state's, from ``initial_damping``).

    Raises:
      ValueError: if there is none.
    """
    if config.use_adaptive_damping:
        return current
    if given is not None:
        return jnp.asarray(given, jnp.float32)
    if schedule is not None:
        return jnp.asarray(schedule(step), jnp.float32)
    if config.initial_damping is not None:
        return current
    raise ValueError(
        "No damping: pass damping= to step, a damping_schedule, initial_damping, or "
        "use_adaptive_damping=True with initial_damping."
    )


def levenberg_marquardt(config: DampingConfig, damping: jax.Array, ratio: jax.Array):
    """The Levenberg-Marquardt rule: the damping divided by
    ``decay**interval`` when the reduction ratio ``ratio`` (actual over predicted
    change of the loss) is below ``damping_lower_threshold``, multiplied by it when
    above ``damping_upper_threshold``, unchanged for a non-finite ratio; clipped to
    ``[min_damping, max_damping]``."""
    decay = config.damping_adaptation_decay**config.damping_adaptation_interval
    d = damping
    d = jnp.where(ratio < config.damping_lower_threshold, d / decay, d)
    d = jnp.where(ratio > config.damping_upper_threshold, d * decay, d)
    d = jnp.where(jnp.isfinite(ratio), d, damping)
    return jnp.clip(d, config.min_damping, config.max_damping)


def is_adaptation_step(config: DampingConfig, step: Any) -> Any:
    """Whether the damping is adapted at (0-based) step ``step``: every
    ``damping_adaptation_interval`` steps counted from ``damping_adaptation_interval_start``
    (the last step of each interval), never before it."""
    interval, start = config.damping_adaptation_interval, config.damping_adaptation_interval_start
    if not start:
        return (step + 1) % interval == 0
    return (step >= start) & ((step + 1 - start) % interval == 0)


def adapt_damping(
    config: DampingConfig,
    damping: jax.Array,
    step: jax.Array,
    reduction_ratio: Callable[[], jax.Array],
    force: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """``(new_damping, ratio)``: on the steps of `is_adaptation_step` (or always, with
    ``force``) the `levenberg_marquardt` update from ``reduction_ratio()`` (computed
    only then, in a `jax.lax.cond`); ``(damping, nan)`` otherwise."""
    if force:
        ratio = reduction_ratio()
        return levenberg_marquardt(config, damping, ratio), ratio
    adapt = is_adaptation_step(config, step)

    def adapted(_):
        ratio = reduction_ratio()
        return levenberg_marquardt(config, damping, ratio), ratio

    return jax.lax.cond(adapt, adapted, lambda _: (damping, jnp.asarray(jnp.nan)), None)


def precon_damping(
    config: DampingConfig, damping: jax.Array, schedule: Schedule | None, step: Any
) -> jax.Array:
    """The preconditioner's damping: ``precon_damping_schedule``'s at ``step``, else
    ``precon_damping_mult`` times ``damping`` (``damping`` itself for a multiplier of 1)."""
    if schedule is not None:
        return jnp.asarray(schedule(step), jnp.float32)
    if config.precon_damping_mult != 1.0:
        return damping * config.precon_damping_mult
    return damping


def positive_or_nan(damping: jax.Array) -> jax.Array:
    """0 for a positive damping, NaN otherwise (so that the guard treats a damping
    <= 0 as non-finite)."""
    return jnp.where(damping > 0, 0.0, jnp.nan)
