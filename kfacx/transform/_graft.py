"""Layer-wise grafting: one transformation's direction with another's step size.

Grafting (Agarwal et al., 2020, "Disentangling Adaptive Gradient Methods from Learning
Rates") takes the direction of each parameter's update from one optimizer and its
norm from another. Shampoo's entries in the AlgoPerf training-algorithms benchmark
graft their Kronecker-preconditioned direction onto Adam's per-layer step size: the
learning rate, warmup and decay tuned for Adam then carry over, and the
preconditioner only decides *where* each layer moves.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax


class GraftState(NamedTuple):
    """State of `graft`: the states of its two transformations."""

    magnitude: Any
    direction: Any


def graft(
    magnitude: optax.GradientTransformation,
    direction: optax.GradientTransformation,
    eps: float = 1e-16,
) -> optax.GradientTransformationExtraArgs:
    """Each parameter's update in ``direction``'s direction with ``magnitude``'s norm.

    For every leaf ``p`` of the parameters, with ``m`` the update of ``magnitude`` and
    ``d`` that of ``direction`` (both of the same incoming updates)::

        update_p = d_p * ||m_p|| / max(||d_p||, eps)

    (Frobenius norms over the whole leaf). Typical use, K-FAC's direction with Adam's
    per-layer step size, then momentum, decay and the learning-rate schedule::

        tx = optax.chain(
            kfacx.graft(optax.scale_by_adam(), kfacx.scale_by_kfac(estimator, args, damping=1e-3)),
            optax.add_decayed_weights(1e-4),
            optax.scale_by_learning_rate(optax.warmup_cosine_decay_schedule(0, 1e-3, 30, 300)),
        )
        updates, state = tx.update(grads, state, params, curvature_stats=stats)

    Extra arguments of ``update`` (``curvature_stats``) reach both transformations;
    a transformation that does not take them (``optax.scale_by_adam``) ignores them.

    Args:
      magnitude: the transformation whose per-leaf update norms are kept.
      direction: the transformation whose per-leaf update directions are kept.
      eps: a floor on ``||d_p||``: a leaf whose direction vanishes gets a zero update.

    Raises:
      TypeError: if either transformation is not an optax transformation.
      ValueError: if ``eps`` is not positive.
    """
    for name, tx in (("magnitude", magnitude), ("direction", direction)):
        if not isinstance(tx, optax.GradientTransformation):
            raise TypeError(
                f"graft's {name} must be an optax.GradientTransformation (e.g. "
                f"optax.scale_by_adam() or kfacx.scale_by_kfac(...)), got {type(tx).__name__}."
            )
    if not float(eps) > 0:
        raise ValueError(f"graft's eps must be positive, got {eps}.")
    magnitude = optax.with_extra_args_support(magnitude)
    direction = optax.with_extra_args_support(direction)

    def init_fn(params):
        return GraftState(magnitude.init(params), direction.init(params))

    def update_fn(updates, state, params=None, **extra_args):
        m, m_state = magnitude.update(updates, state.magnitude, params, **extra_args)
        d, d_state = direction.update(updates, state.direction, params, **extra_args)
        out = jax.tree.map(lambda m, d: _grafted(m, d, eps), m, d)
        return out, GraftState(m_state, d_state)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _grafted(m: jax.Array, d: jax.Array, eps: float) -> jax.Array:
    """``d`` rescaled to the norm of ``m`` (norms in float32 or wider)."""
    wide = jnp.promote_types(d.dtype, jnp.float32)
    m_norm = jnp.linalg.norm(m.astype(wide).ravel())
    d_norm = jnp.linalg.norm(d.astype(wide).ravel())
    scale = jnp.where(d_norm > eps, m_norm / jnp.maximum(d_norm, eps), 0.0)
    return (d.astype(wide) * scale).astype(d.dtype)
