"""What a K-FAC step hands back: its guard against non-finite results, and its stats.

`guard` decides, from values the step computes anyway, whether the step's parameters
and state are kept or the old ones are returned bit for bit; `step_stats` is the dict
`kfacx.Optimizer.step` returns beside them. Both run last in
`kfacx.optimizer._step.KfacStep`."""

from __future__ import annotations

import jax.numpy as jnp

from kfacx._helpers import _tree
from kfacx.optimizer import _damping


def guard(loss, sq_norms, lam, stats, new, old, select_small):
    """``(finite, new or old)``: skip the step (keep params and state bit for bit) on a
    non-finite loss, gradient, statistic or update, or a damping that is not positive
    (e.g. a schedule returning NaN).

    ``new`` and ``old`` are ``(params, state, func_state)``. The squared norms
    ``sq_norms`` (of the gradient, the preconditioned gradient and the update), needed
    for the returned stats anyway, stand in for a scan of every leaf: a non-finite
    entry (or an overflowing norm) makes them so. The factors are moving averages of
    finite statistics, and a non-finite cached inverse would show in the update, so the
    (large) curvature state is not scanned. `kfacx._helpers._tree.keep_unless` keeps or
    replaces the whole state (``select_small``: by selects alone, on one device).
    """
    _, new_state, new_func_state = new
    params, state, func_state = old
    grad_sq, _, update_sq = sq_norms
    # A damping <= 0 (also of the preconditioner's, ``lam = (damping, precon_damping)``)
    # counts as non-finite.
    if isinstance(lam, tuple):
        positive = _damping.positive_or_nan(lam[0]) + _damping.positive_or_nan(lam[1])
    else:
        positive = _damping.positive_or_nan(lam)
    checked = (loss, grad_sq, update_sq, new_state.damping, positive, stats)
    old_func_state = None if new_func_state is None else func_state
    previous = (params, state, old_func_state)
    return _tree.guard_non_finite((*checked, new_func_state), new, previous, select_small)


def step_stats(loss, lr, mom, lam, rho, quad_change, sq_norms, step, new_state, finite):
    """The stats `kfacx.Optimizer.step` returns (without ``aux``, added by the step).

    Each field is documented in `kfacx.Optimizer.step`'s "Returns" section and, with
    its dtype and kfac-jax's counterpart, in docs/logging.md;
    tests/optimizer/test_step_stats.py checks that both list exactly these keys.
    ``rho`` and ``quad_model_change`` arrive as NaN when not computed (see
    `kfacx.optimizer._step.KfacStep._adapt_damping`); ``step`` is the counter before
    the step and ``data_seen`` the (guarded) new state's, so neither advances on a
    skipped step.
    """
    grad_sq, precon_sq, update_sq = sq_norms
    return dict(
        loss=loss,
        learning_rate=jnp.asarray(lr, jnp.float32),
        momentum=jnp.asarray(mom, jnp.float32),
        damping=jnp.asarray(lam, jnp.float32),
        rho=jnp.asarray(rho, jnp.float32),
        quad_model_change=jnp.asarray(quad_change, jnp.float32),
        grad_norm=jnp.sqrt(grad_sq),
        precon_grad_norm=jnp.sqrt(precon_sq),
        update_norm=jnp.sqrt(update_sq),
        step=step,
        data_seen=new_state.data_seen,
        skipped=~finite,
    )
