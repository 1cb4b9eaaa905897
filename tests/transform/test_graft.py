"""Tests for `kfacx.graft`: one transformation's direction with another's per-leaf norm."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfacx


def _tree(seed):
    rng = np.random.default_rng(seed)
    return {
        "w": jnp.asarray(rng.standard_normal((3, 4)), jnp.float32),
        "b": jnp.asarray(rng.standard_normal((4,)), jnp.float32),
        "zero": jnp.zeros((2,), jnp.float32),
    }


def _scale_by_extra():
    """A direction that multiplies by the extra argument ``factor`` (per leaf)."""

    def update_fn(updates, state, params=None, *, factor, **extra):
        del params, extra
        return jax.tree.map(lambda u, f: u * f, updates, factor), state

    return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update_fn)


def test_each_leaf_has_the_direction_of_one_and_the_norm_of_the_other():
    params, grads = _tree(0), _tree(1)
    grads["zero"] = jnp.asarray([1.0, -2.0])
    factor = {
        "w": jnp.asarray(np.random.default_rng(2).standard_normal((3, 4)), jnp.float32),
        "b": jnp.full((4,), -3.0),
        "zero": jnp.zeros((2,)),  # a vanishing direction: no update for that leaf
    }
    tx = kfacx.graft(optax.scale_by_adam(), _scale_by_extra())
    state = tx.init(params)
    for _ in range(3):  # Adam's state moves: the norms follow it
        out, state = jax.jit(tx.update)(grads, state, params, factor=factor)

    adam = optax.scale_by_adam()
    adam_state = adam.init(params)
    for _ in range(3):
        m, adam_state = adam.update(grads, adam_state, params)
    for name in ("w", "b"):
        d = np.asarray(grads[name] * factor[name], np.float64)
        want = d / np.linalg.norm(d) * np.linalg.norm(np.asarray(m[name], np.float64))
        np.testing.assert_allclose(out[name], want, rtol=1e-5)
    np.testing.assert_array_equal(out["zero"], 0.0)


def test_grafting_onto_itself_is_the_identity():
    params, grads = _tree(3), _tree(4)
    tx = kfacx.graft(optax.scale_by_adam(), optax.scale_by_adam())
    out, _ = tx.update(grads, tx.init(params), params)
    want, _ = optax.scale_by_adam().update(grads, optax.scale_by_adam().init(params), params)
    for name in ("w", "b"):
        np.testing.assert_allclose(out[name], want[name], rtol=1e-5)


def test_kfac_direction_with_adam_norms_in_a_chain():
    """The documented use: K-FAC's direction (curvature_stats reach scale_by_kfac, not
    Adam) grafted onto Adam's norms; each layer's update has Adam's norm and K-FAC's
    direction."""
    rng = np.random.default_rng(5)
    w = jnp.asarray(rng.standard_normal((4, 3)) / 2, jnp.float32)
    params = {"w": w}
    x = jnp.asarray(rng.standard_normal((16, 4)), jnp.float32)
    labels = jnp.asarray(rng.integers(0, 3, 16), jnp.int32)

    def loss_fn(params, batch):
        x, labels = batch
        logits = kfacx.register_dense(x @ params["w"], x, params["w"])
        kfacx.register_softmax_cross_entropy_loss(logits, labels)
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))

    est = kfacx.BlockDiagonalCurvature(loss_fn)
    kfac = kfacx.scale_by_kfac(est, (params, (x, labels)), damping=1e-2)
    tx = kfacx.graft(optax.scale_by_adam(), kfac)

    @jax.jit  # one compilation instead of one per operation run eagerly
    def updates(params, batch):
        _, grads, stats = est.value_grads_and_curvature_stats(jax.random.key(0), (params, batch))
        out, _ = tx.update(grads, tx.init(params), params, curvature_stats=stats)
        d, _ = kfac.update(grads, kfac.init(params), params, curvature_stats=stats)
        m, _ = optax.scale_by_adam().update(grads, optax.scale_by_adam().init(params), params)
        return d, m, out

    d, m, got = (np.asarray(t["w"], np.float64) for t in updates(params, (x, labels)))
    np.testing.assert_allclose(np.linalg.norm(got), np.linalg.norm(m), rtol=1e-5)
    np.testing.assert_allclose(got / np.linalg.norm(got), d / np.linalg.norm(d), atol=1e-6)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(magnitude="adam"), TypeError, "magnitude must be an optax"),
        (dict(direction=lambda g: g), TypeError, "direction must be an optax"),
        (dict(eps=0.0), ValueError, "eps must be positive"),
    ],
)
def test_bad_arguments_are_clear_errors(kwargs, error, match):
    args = dict(magnitude=optax.scale_by_adam(), direction=optax.identity())
    args.update(kwargs)
    with pytest.raises(error, match=match):
        kfacx.graft(**args)
