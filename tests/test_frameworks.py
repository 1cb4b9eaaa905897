"""Detection on Flax linen and Equinox models: every parameter matched, curvature exact."""

from __future__ import annotations

import functools

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

import kfacx


def _xent(logits, labels):
    logits = kfacx.register_softmax_cross_entropy_loss(logits, labels)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], 1))


class _FlaxMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.tanh(nn.Dense(6)(x))
        x = nn.LayerNorm()(x)
        x = nn.DenseGeneral((2, 3))(x)
        return nn.Dense(4)(x.reshape(x.shape[0], -1))


class _FlaxCNN(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(4, (3, 3), strides=2)(x))
        x = nn.relu(nn.Conv(4, (3,), feature_group_count=2)(x.reshape(x.shape[0], -1, 4)))
        return nn.Dense(3)(x.reshape(x.shape[0], -1))


def _flax_problem(module, x_shape, classes):
    x = np.random.default_rng(0).standard_normal(x_shape).astype(np.float32)
    labels = np.arange(x_shape[0]) % classes
    # one compilation instead of one per operation run eagerly
    params = jax.jit(module.init)(jax.random.PRNGKey(0), x)
    return (lambda p, b: _xent(module.apply(p, b[0]), b[1])), params, (x, labels)


@functools.cache  # (built once: the test needs its static part again)
def _equinox_mlp():
    # one compilation instead of one per operation run eagerly
    make = eqx.filter_jit(lambda key: eqx.nn.MLP(4, 3, 8, 2, activation=jnp.tanh, key=key))
    mlp = make(jax.random.PRNGKey(0))
    return eqx.partition(mlp, eqx.is_array)


def _equinox_problem():
    params, static = _equinox_mlp()
    x = np.random.default_rng(1).standard_normal((1, 4)).astype(np.float32)
    labels = np.array([2])

    def loss(p, batch):
        return _xent(jax.vmap(eqx.combine(p, static))(batch[0]), batch[1])

    return loss, params, (x, labels)


def _check_fully_matched(loss, params, batch, tags):
    tagged, report = kfacx.auto_register_tags(loss, (params, batch), on_unmatched="error")
    assert report.unmatched == ()
    assert {e.tag for e in report.entries} == tags, str(report)
    (value_tagged, g_tagged), (value, g) = (
        _value_and_flat_grad(f)(params, batch) for f in (tagged, loss)
    )
    np.testing.assert_allclose(value_tagged, value, rtol=1e-6)
    np.testing.assert_allclose(g_tagged, g, atol=1e-6)
    return report


def _value_and_flat_grad(f):
    @jax.jit  # one compilation instead of one per operation run eagerly
    def value_and_flat_grad(params, batch):
        return f(params, batch), ravel_pytree(jax.grad(f)(params, batch))[0]

    return value_and_flat_grad


def test_flax_mlp_with_layernorm_and_dense_general_is_fully_matched():
    report = _check_fully_matched(
        *_flax_problem(_FlaxMLP(), (3, 5), 4), {"dense_tag", "scale_and_shift_tag"}
    )
    kernel = next(e for e in report.entries if e.path == "params/DenseGeneral_0/kernel")
    assert kernel.source == "dense_with_bias"


def test_flax_cnn_is_fully_matched():
    _check_fully_matched(*_flax_problem(_FlaxCNN(), (2, 6, 6, 2), 3), {"conv_tag", "dense_tag"})


def test_equinox_mlp_is_fully_matched_and_exact():
    """Equinox computes ``weight @ x`` per example under vmap; detection reads it as a
    dense layer, and for one example the blocks equal the exact Gauss-Newton blocks."""
    loss, params, batch = _equinox_problem()
    report = _check_fully_matched(loss, params, batch, {"dense_tag"})
    assert {e.source for e in report.entries} == {"weight_first_dense_with_bias"}
    est = kfacx.BlockDiagonalCurvature(loss)
    state = est.init(jax.random.PRNGKey(0), (params, batch))

    @jax.jit  # one compilation instead of one per operation run eagerly
    def curvature(state, args):
        state = est.update_curvature_matrix_estimate(
            state, 0.0, 1.0, None, jax.random.PRNGKey(1), args, "ggn_exact"
        )
        return est.to_dense_matrix(state)

    got = np.asarray(curvature(state, (params, batch)))
    flat, unravel = ravel_pytree(params)
    _, static = _equinox_mlp()

    def model_logits(f):
        return jax.vmap(eqx.combine(unravel(f), static))(batch[0])

    @jax.jit  # one compilation instead of one per operation run eagerly
    def jacobian_and_probabilities(flat):
        jac = jax.jacfwd(lambda f: model_logits(f).reshape(-1))(flat)
        return jac, jax.nn.softmax(model_logits(flat).reshape(-1))

    jac, prob = (np.asarray(a, np.float64) for a in jacobian_and_probabilities(flat))
    exact = jac.T @ (np.diag(prob) - np.outer(prob, prob)) @ jac
    sizes = [int(np.prod(np.shape(leaf))) for leaf in jax.tree_util.tree_leaves(params)]
    offsets = np.cumsum([0] + sizes)
    for layer in range(3):  # leaves: (weight, bias) per layer
        idx = np.arange(offsets[2 * layer], offsets[2 * layer + 2])
        np.testing.assert_allclose(got[np.ix_(idx, idx)], exact[np.ix_(idx, idx)], atol=1e-6)


class _FlaxBlock(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        h = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=8)(h, h)
        x = x + nn.Dense(8)(jnp.tanh(nn.Dense(16)(nn.LayerNorm()(x))))
        return x, None


class _FlaxScannedTransformer(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(8)(x)
        layers = nn.scan(
            _FlaxBlock, variable_axes={"params": 0}, split_rngs={"params": True}, length=2
        )
        h, _ = layers()(h, None)
        return nn.Dense(3)(h[:, 0])


def test_flax_scanned_transformer_with_attention_is_stacked_and_trains():
    """`nn.scan` over Transformer blocks with `MultiHeadDotProductAttention`: every
    parameter of the blocks is a stacked layer (2 stacked), nothing falls back; also
    under ``jax.value_and_grad``, whose scan saves residuals for the backward pass
    (before `kfacx._helpers._jaxpr.dce` dropped them, the LayerNorm scales fell back)."""
    from _models import fixed_rate_run

    loss, params, batch = _flax_problem(_FlaxScannedTransformer(), (4, 3, 5), 3)
    opt, losses = fixed_rate_run(loss, params, batch, 4, learning_rate=0.02)
    report = opt.estimator.report
    assert report.notes == () and report.unmatched == (), str(report)
    blocks = [e for e in report.entries if "Scan_FlaxBlock" in e.path]
    assert blocks and {e.stack_size for e in blocks} == {2}, str(report)
    assert {e.tag for e in blocks} == {"dense_tag", "scale_and_shift_tag"}, str(report)
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0], losses
