"""``l2_reg`` with kfac-jax's meaning (the loss contains the regularizer; the optimizer
adds its curvature) and ``add_l2_reg=True`` (the optimizer adds the term itself)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _optimizer_cases import (
    ADAPTIVE,
    DETERMINISTIC,
    assert_trees_close,
    make_batch,
    make_params,
    mlp_loss,
    run,
)

import kfacx

L2 = 1e-2


def _with_term(exclude: str | None = None):
    """``mlp_loss`` plus ``0.5 * L2 * |params|^2`` over the parameters whose name does not
    match ``exclude``: a loss written for kfac-jax, which keeps its regularizer."""

    def loss(params, batch):
        kept = [v for k, v in sorted(params.items()) if not (exclude and re.search(exclude, k))]
        return mlp_loss(params, batch) + 0.5 * L2 * sum(jnp.sum(v * v) for v in kept)

    return loss


def test_l2_reg_is_kfac_jax_definition_with_fixed_coefficients():
    """kfac-jax's step: the gradient of the user's (regularized) loss, preconditioned by
    ``(C + (damping + l2_reg) I)^-1``; nothing else is added."""
    params, batch = make_params(), make_batch()
    lr, mom, damping = 0.2, 0.8, 1e-2
    loss = _with_term()
    opt = kfacx.Optimizer(
        jax.value_and_grad(loss),
        l2_reg=L2,
        learning_rate_schedule=lr,
        momentum_schedule=mom,
        initial_damping=damping,
        **DETERMINISTIC,
    )
    opt_params, _, _ = run(opt, params, batch, 4)

    estimator = kfacx.BlockDiagonalCurvature(loss, default_estimation_mode="fisher_empirical")
    tx = optax.chain(
        kfacx.scale_by_kfac(estimator, (params, batch), damping=damping + L2),
        optax.sgd(lr, momentum=mom),
    )

    @jax.jit
    def step(p, s):
        _, grads, stats = estimator.value_grads_and_curvature_stats(jax.random.key(0), (p, batch))
        updates, s = tx.update(grads, s, p, curvature_stats=stats)
        return optax.apply_updates(p, updates), s

    p, state = params, tx.init(params)
    for _ in range(4):
        p, state = step(p, state)
    assert_trees_close(opt_params, p, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("exclude", [None, r"^b"])
def test_a_loss_with_the_term_steps_as_the_term_added(exclude):
    """Adaptive learning rate, momentum and damping: a loss that contains the regularizer
    with ``l2_reg`` takes the steps of the loss without it with ``add_l2_reg=True`` (the
    same gradient, quadratic model and ``rho``), with and without excluded parameters."""
    params, batch = make_params(), make_batch()
    excl = () if exclude is None else (exclude,)
    kw = dict(l2_reg=L2, regularized_parameters_path_exclusions=excl, **ADAPTIVE, **DETERMINISTIC)
    ported = kfacx.Optimizer(jax.value_and_grad(_with_term(exclude)), **kw)
    added = kfacx.Optimizer(jax.value_and_grad(mlp_loss), add_l2_reg=True, **kw)
    p1, s1, h1 = run(ported, params, batch, 5)
    p2, s2, h2 = run(added, params, batch, 5)
    assert_trees_close(p1, p2, rtol=1e-4, atol=1e-6)
    assert jnp.allclose(s1.damping, s2.damping, rtol=1e-4)
    for a, b in zip(h1, h2, strict=True):
        assert jnp.allclose(a["rho"], b["rho"], rtol=1e-3, atol=1e-5, equal_nan=True)
    assert any(bool(jnp.isfinite(s["rho"])) for s in h1)  # adaptation steps compared


def test_the_term_added_to_a_loss_that_has_it_counts_it_twice():
    """``add_l2_reg=True`` on a ported loss regularizes twice (the migration pitfall the
    default avoids): its first step differs from the default's."""
    params, batch = make_params(), make_batch()
    kw = dict(l2_reg=0.5, learning_rate_schedule=0.1, momentum_schedule=0.0, initial_damping=1e-2)
    kw.update(DETERMINISTIC)
    once, _, _ = run(kfacx.Optimizer(jax.value_and_grad(_with_term()), **kw), params, batch, 1)
    twice, _, _ = run(
        kfacx.Optimizer(jax.value_and_grad(_with_term()), add_l2_reg=True, **kw), params, batch, 1
    )
    assert float(jnp.max(jnp.abs(once["w1"] - twice["w1"]))) > 1e-3


def test_l2_reg_and_add_l2_reg_are_checked():
    value_and_grad = jax.value_and_grad(mlp_loss)
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="l2_reg must be >= 0 and finite"):
            kfacx.Optimizer(value_and_grad, l2_reg=bad)
    for bad in ("1e-3", True, None):
        with pytest.raises(TypeError, match="l2_reg must be a number"):
            kfacx.Optimizer(value_and_grad, l2_reg=bad)
    with pytest.raises(TypeError, match="add_l2_reg must be True or False, got 'yes'"):
        kfacx.Optimizer(value_and_grad, add_l2_reg="yes")
    assert kfacx.Optimizer(value_and_grad, l2_reg=np.float32(1e-3)) is not None
