"""Learning rate and momentum of `kfacx.Optimizer`'s step: given, scheduled, or solved
on the quadratic model of the loss along the preconditioned gradient and the previous
update (the directions ``p`` and ``v``; the step is ``coefficients[0] p +
coefficients[1] v``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from kfacx._helpers._checks import Schedule
from kfacx._helpers._tree import tree_dot, tree_gram, tree_scale


def learning_rate_value(given: Any, schedule: Schedule | None, step: Any) -> jax.Array:
    """The ``given`` learning rate, else the ``schedule``'s at ``step``.

    Raises:
      ValueError: if there is neither.
    """
    if given is not None:
        return jnp.asarray(given, jnp.float32)
    if schedule is not None:
        return jnp.asarray(schedule(step), jnp.float32)
    raise ValueError(
        "No learning rate: pass learning_rate= to step, a learning_rate_schedule, or "
        "use_adaptive_learning_rate=True."
    )


def momentum_value(given: Any, schedule: Schedule | None, step: Any) -> jax.Array:
    """The ``given`` momentum, else the ``schedule``'s at ``step``, else 0."""
    if given is not None:
        return jnp.asarray(given, jnp.float32)
    if schedule is not None:
        return jnp.asarray(schedule(step), jnp.float32)
    return jnp.zeros((), jnp.float32)


class QuadraticModel(NamedTuple):
    """The model ``m(c) = 0.5 c^T (gram + w norms + regularizer) c + linear^T c`` of the
    change of the loss along the step ``c[0] p + c[1] v`` (``p`` the preconditioned
    gradient, ``v`` the previous update; ``w`` a weight of the identity).

    Attributes:
      gram: ``[2, 2]`` exact curvature products of ``p`` and ``v``, or None when
        neither the learning rate nor the damping is adaptive (not computed).
      norms: ``[2, 2]`` inner products of ``p`` and ``v``.
      linear: ``[2]`` inner products of the gradient with ``p`` and ``v``.
      regularizer: ``[2, 2]`` curvature of an ``l2_reg`` term on part of the
        parameters (`kfacx.optimizer._l2`), or None (``l2_reg`` is then in ``w``).
      grad_sq: ``g.g``, the gradient's squared norm (computed with ``norms`` and
        ``linear``, in the same pass over the leaves).
    """

    gram: jax.Array | None
    norms: jax.Array
    linear: jax.Array
    regularizer: jax.Array | None = None
    grad_sq: jax.Array | None = None

    def step_sq_norms(self, delta: Any) -> list[jax.Array]:
        """``[g.g, p.p, delta.delta]`` for the step's stats and guard: the first two from
        the model's one pass over the leaves, the update's from the update itself, in its
        own dtype (so that the guard sees an overflow of a low-precision update)."""
        return [self.grad_sq, self.norms[0, 0], tree_dot(delta, delta)]


def direction_norms(precon: Any, velocity: Any) -> jax.Array:
    """``[[p.p, p.v], [p.v, v.v]]``."""
    return tree_gram([precon, velocity])


def model_products(
    grads: Any, precon: Any, velocity: Any
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(norms, linear, g.g)``: ``[[p.p, p.v], [p.v, v.v]]``, ``[g.p, g.v]`` and the
    gradient's squared norm, from one pass over the leaves (`kfacx._helpers._tree.tree_gram`)."""
    gram = tree_gram([grads, precon, velocity])
    return gram[1:, 1:], gram[0, 1:], gram[0, 0]


def adaptive_coefficients(
    gram: jax.Array,
    grads: Any,
    precon: Any,
    velocity: Any,
    identity_weight: jax.Array,
    momentum: Callable[[], jax.Array] | None,
    momentum_bounds: tuple[float, float] | None,
    regularizer: jax.Array | None = None,
) -> tuple[jax.Array, QuadraticModel]:
    """The coefficients minimising the damped quadratic model (the curvature plus
    ``identity_weight`` times the identity), and the model.

    Args:
      gram: the exact curvature products of ``precon`` and ``velocity``.
      grads, precon, velocity: the gradient, the preconditioned gradient and the
        previous update.
      identity_weight: the damping plus ``l2_reg``.
      momentum: None to solve for the momentum too (within ``momentum_bounds``),
        else a function giving the fixed momentum (only the learning rate is solved).
      momentum_bounds: ``(low, high)`` or None (see `kfacx.LearningRateConfig`).
      regularizer: see `QuadraticModel` (``identity_weight`` is then the damping).

    Returns:
      ``(coefficients, model)``: the learning rate is ``-coefficients[0]``, the
      momentum ``coefficients[1]``.
    """
    norms, b, grad_sq = model_products(grads, precon, velocity)
    damped = gram + identity_weight * norms
    if regularizer is not None:
        damped = damped + regularizer
    if momentum is None:
        coeffs = solve_2x2(damped, b, momentum_bounds)
    else:
        mom = momentum()
        c0 = -(b[0] + damped[0, 1] * mom) / _safe(damped[0, 0])
        coeffs = jnp.stack([c0, jnp.asarray(mom, jnp.float32)])
    return coeffs, QuadraticModel(gram, norms, b, regularizer, grad_sq)


def constrain_norm(precon: Any, grads: Any, learning_rate: jax.Array, norm_constraint: float):
    """``precon`` scaled so that ``learning_rate**2 * precon^T grads`` is at most
    ``norm_constraint`` (see `kfacx.LearningRateConfig`)."""
    sq = tree_dot(precon, grads) * learning_rate**2
    scale = jnp.minimum(1.0, jnp.sqrt(norm_constraint / _safe(sq)))
    return tree_scale(scale, precon)


def fixed_coefficients(
    learning_rate: jax.Array,
    momentum: jax.Array,
    gram: jax.Array | None,
    grads: Any,
    precon: Any,
    velocity: Any,
    regularizer: jax.Array | None = None,
) -> tuple[jax.Array, QuadraticModel]:
    """The coefficients ``[-learning_rate, momentum]`` and the quadratic model."""
    norms, b, grad_sq = model_products(grads, precon, velocity)
    coeffs = jnp.stack([-learning_rate, momentum])
    return coeffs, QuadraticModel(gram, norms, b, regularizer, grad_sq)


def solve_2x2(m: jax.Array, b: jax.Array, bounds: Sequence[float] | None = None) -> jax.Array:
    """Minimiser ``-m^-1 b`` of ``0.5 c^T m c + b^T c``; only the first coordinate
    when the second direction is zero (the first step, with no velocity yet).

    With ``bounds = (low, high)`` the second coordinate is constrained to that
    interval: the model is convex, so when the free minimiser lies outside, the
    constrained one has the second coordinate at the nearer bound and the first
    minimising along it."""
    det = m[0, 0] * m[1, 1] - m[0, 1] * m[1, 0]
    full = -jnp.array([m[1, 1] * b[0] - m[0, 1] * b[1], m[0, 0] * b[1] - m[1, 0] * b[0]]) / _safe(
        det
    )

    def along(second):  # the best first coordinate for a given second one
        return jnp.stack([-(b[0] + m[0, 1] * second) / _safe(m[0, 0]), second])

    degenerate = (m[1, 1] <= 0) | (jnp.abs(det) <= 1e-12 * jnp.abs(m[0, 0] * m[1, 1]))
    if bounds is None:
        return jnp.where(degenerate, along(jnp.zeros(())), full)
    second = jnp.clip(full[1], bounds[0], bounds[1])
    full = jnp.where(second == full[1], full, along(second))
    return jnp.where(degenerate, along(jnp.clip(jnp.zeros(()), bounds[0], bounds[1])), full)


def update_direction(coeffs: jax.Array, precon: Any, velocity: Any) -> Any:
    """The update ``delta = coeffs[0] * precon + coeffs[1] * velocity``."""
    return jax.tree.map(
        lambda p, v: (coeffs[0] * p + coeffs[1] * v).astype(p.dtype), precon, velocity
    )


def quadratic_model_change(model: QuadraticModel, coeffs: jax.Array, weight: Any) -> jax.Array:
    """``m(coeffs)`` with identity weight ``weight`` (see `QuadraticModel`)."""
    if model.regularizer is None:
        return 0.5 * coeffs @ (model.gram + weight * model.norms) @ coeffs + coeffs @ model.linear
    curvature = model.gram + weight * model.norms + model.regularizer
    return 0.5 * coeffs @ curvature @ coeffs + coeffs @ model.linear


def _safe(x: jax.Array) -> jax.Array:
    return jnp.where(jnp.abs(x) > 0, x, 1.0)
