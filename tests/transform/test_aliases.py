"""Tests for the ready-made recipes `kfacx.kfac_adamw` and `kfacx.kfac_soap`: each is
the optax chain its docstring writes out, step for step."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfacx


def _problem():
    rng = np.random.default_rng(0)
    params = {
        "w1": jnp.asarray(rng.standard_normal((5, 6)) / 2, jnp.float32),
        "b1": jnp.zeros((6,), jnp.float32),
        "w2": jnp.asarray(rng.standard_normal((6, 3)) / 2, jnp.float32),
    }
    x = jnp.asarray(rng.standard_normal((16, 5)), jnp.float32)
    labels = jnp.asarray(rng.integers(0, 3, 16), jnp.int32)

    def loss_fn(params, batch):
        x, labels = batch
        h = jnp.tanh(x @ params["w1"] + params["b1"][None])
        logits = kfacx.register_softmax_cross_entropy_loss(h @ params["w2"], labels)
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))

    return loss_fn, params, (x, labels)


def _run(make_tx, steps=4):
    """Parameters after ``steps`` steps of ``make_tx(estimator, func_args)``, one jitted
    program (the statistics of the first half of the batch)."""
    loss_fn, params, batch = _problem()
    est = kfacx.BlockDiagonalCurvature(loss_fn)
    tx = make_tx(est, (params, batch))

    @jax.jit
    def run(params):
        state = tx.init(params)

        def body(carry, i):
            params, state = carry
            grads = jax.grad(loss_fn)(params, batch)
            half = jax.tree.map(lambda a: a[:8], batch)
            stats = est.compute_curvature_stats(
                jax.random.fold_in(jax.random.key(0), i), (params, half)
            )
            updates, state = tx.update(grads, state, params, curvature_stats=stats)
            return (optax.apply_updates(params, updates), state), None

        (params, _), _ = jax.lax.scan(body, (params, state), jnp.arange(steps))
        return params

    return run(params)


def _decay_matrices(params):
    return jax.tree.map(lambda p: p.ndim >= 2, params)


SCHEDULE = optax.warmup_cosine_decay_schedule(0.0, 0.05, 2, 6)


def test_kfac_adamw_is_its_chain():
    got = _run(
        lambda est, args: kfacx.kfac_adamw(
            est, args, SCHEDULE, weight_decay=0.1, damping=1e-2, inverse_update_period=2
        )
    )

    def explicit(est, args):
        kfac = kfacx.scale_by_kfac(est, args, damping=1e-2, inverse_update_period=2)
        return optax.chain(
            kfacx.graft(optax.scale_by_adam(), optax.chain(optax.trace(0.9), kfac)),
            optax.add_decayed_weights(0.1, mask=_decay_matrices),
            optax.scale_by_learning_rate(SCHEDULE),
        )

    want = _run(explicit)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-6, atol=1e-7, err_msg=name)
    assert not np.allclose(got["w1"], _problem()[1]["w1"])  # it moved


def test_kfac_soap_is_its_chain():
    got = _run(
        lambda est, args: kfacx.kfac_soap(
            est,
            args,
            0.01,
            momentum=0.8,
            b2=0.95,
            inverse_update_period=2,
            mask=lambda p: jax.tree.map(lambda _: False, p),  # no decay
        )
    )

    def explicit(est, args):
        return optax.chain(
            kfacx.scale_by_kfac_eigen_adam(est, args, b2=0.95, inverse_update_period=2),
            optax.trace(0.8),
            optax.scale_by_learning_rate(0.01),
        )

    want = _run(explicit)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-6, atol=1e-7, err_msg=name)


@pytest.mark.parametrize("alias", [kfacx.kfac_adamw, kfacx.kfac_soap])
@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(momentum=1.0), ValueError, "momentum must be a number in"),
        (dict(weight_decay=-1.0), ValueError, "weight_decay must be a number >= 0"),
        (dict(learning_rate="1e-3"), TypeError, "learning_rate must be a number or an optax"),
    ],
)
def test_bad_arguments_are_clear_errors(alias, kwargs, error, match):
    loss_fn, params, batch = _problem()
    est = kfacx.BlockDiagonalCurvature(loss_fn)
    kwargs = {"learning_rate": 1e-3, **kwargs}
    with pytest.raises(error, match=match):
        functools.partial(alias, est, (params, batch))(**kwargs)


def test_other_learning_rate_applies_to_the_masked_parameters():
    """``other_learning_rate`` scales the parameters ``other_mask`` chooses (here the
    output layer), ``learning_rate`` the rest: Muon's split of rates."""

    def other(params):
        return {name: name == "w2" for name in params}

    got = _run(
        lambda est, args: kfacx.kfac_soap(
            est, args, 0.01, inverse_update_period=2, other_learning_rate=0.03, other_mask=other
        )
    )

    def explicit(est, args):
        def labels(params):
            return {name: "other" if name == "w2" else "main" for name in params}

        rates = optax.partition(
            {
                "main": optax.scale_by_learning_rate(0.01),
                "other": optax.scale_by_learning_rate(0.03),
            },
            labels,
        )
        return optax.chain(
            kfacx.scale_by_kfac_eigen_adam(est, args, b2=0.95, inverse_update_period=2),
            optax.trace(0.9),
            optax.add_decayed_weights(1e-4, mask=_decay_matrices),
            rates,
        )

    want = _run(explicit)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-6, atol=1e-7, err_msg=name)


def test_other_learning_rate_needs_its_mask():
    loss_fn, params, batch = _problem()
    est = kfacx.BlockDiagonalCurvature(loss_fn)
    with pytest.raises(ValueError, match="Pass other_learning_rate and other_mask together"):
        kfacx.kfac_adamw(est, (params, batch), 1e-3, other_learning_rate=1e-2)
