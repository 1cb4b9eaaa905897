"""Whole architectures: every parameter matched to a non-fallback tag."""

from __future__ import annotations

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

import kfacx


def _xent(logits, labels):
    logits = kfacx.register_softmax_cross_entropy_loss(logits, labels)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], 1))


def _transformer_block(x):
    h = hk.LayerNorm(-1, True, True)(x)
    h = hk.MultiHeadAttention(num_heads=2, key_size=4, w_init=hk.initializers.VarianceScaling())(
        h, h, h
    )
    x = x + h
    h = hk.nets.MLP([16, 8])(hk.LayerNorm(-1, True, True)(x))
    x = hk.RMSNorm(-1)(x + h)
    return hk.Linear(5)(x[:, 0])


def _resnet_block(x, is_training=True):
    h = hk.Conv2D(4, 3, with_bias=False)(x)
    h = jax.nn.relu(hk.BatchNorm(True, True, 0.9)(h, is_training))
    h = hk.Conv2D(4, 3, with_bias=False)(h)
    h = hk.BatchNorm(True, True, 0.9)(h, is_training)
    shortcut = hk.Conv2D(4, 1)(x)
    h = jax.nn.relu(h + shortcut)
    return hk.Linear(3)(jnp.mean(h, axis=(1, 2)))


def _check(loss, params, batch):
    tagged, report = kfacx.auto_register_tags(loss, (params, batch), on_unmatched="error")
    assert report.unmatched == () and report.matched_fraction == 1.0, str(report)
    (value_tagged, g_tagged), (value, g) = (
        _value_and_flat_grad(f)(params, batch) for f in (tagged, loss)
    )
    np.testing.assert_allclose(value_tagged, value, rtol=1e-5)
    np.testing.assert_allclose(g_tagged, g, atol=1e-5)
    return report


def _value_and_flat_grad(f):
    @jax.jit  # one compilation instead of one per operation run eagerly
    def value_and_flat_grad(params, batch):
        return f(params, batch), ravel_pytree(jax.grad(f)(params, batch))[0]

    return value_and_flat_grad


def test_transformer_block_is_fully_matched():
    net = hk.without_apply_rng(hk.transform(_transformer_block))
    x = np.random.default_rng(0).standard_normal((3, 4, 8)).astype(np.float32)
    labels = np.arange(3) % 5
    # one compilation instead of one per operation run eagerly
    params = jax.jit(net.init)(jax.random.PRNGKey(0), x)
    report = _check(lambda p, b: _xent(net.apply(p, b[0]), b[1]), params, (x, labels))
    tags = {e.path: e.tag for e in report.entries}
    assert tags["multi_head_attention/query/w"] == "dense_tag"
    assert tags["rms_norm/scale"] == "scale_and_shift_tag"
    assert sum(t == "dense_tag" for t in tags.values()) == 14  # q, k, v, out, 2 mlp, head (w, b)


def test_resnet_block_with_batch_norm_state_is_fully_matched():
    net = hk.transform_with_state(_resnet_block)
    x = np.random.default_rng(1).standard_normal((2, 6, 6, 3)).astype(np.float32)
    labels = np.arange(2) % 3
    # one compilation instead of one per operation run eagerly
    params, state = jax.jit(net.init)(jax.random.PRNGKey(0), x)

    def loss(p, batch):
        logits, _ = net.apply(p, state, None, batch[0])
        return _xent(logits, batch[1])

    report = _check(loss, params, (x, labels))
    sources = {e.path: e.source for e in report.entries}
    assert sources["batch_norm/scale"] == "normalization"
    assert sources["conv2_d/w"] == "conv"
    assert sources["conv2_d_2/w"] == "conv_with_bias"
    est = kfacx.BlockDiagonalCurvature(loss)
    curvature = est.init(jax.random.PRNGKey(0), (params, (x, labels)))

    @jax.jit  # one compilation instead of one per operation run eagerly
    def preconditioned_grads(curvature, params, batch):
        curvature = est.update_curvature_matrix_estimate(
            curvature, 0.0, 1.0, None, jax.random.PRNGKey(1), (params, batch)
        )
        curvature = est.update_cache(curvature, 1e-3)
        grads = jax.grad(loss)(params, batch)
        return est.multiply_inverse(curvature, grads, 1e-3, use_cached=True)

    step = preconditioned_grads(curvature, params, (x, labels))
    assert np.all(np.isfinite(ravel_pytree(step)[0]))


def test_group_norm_affine_parameters_are_scale_and_shift():
    net = hk.without_apply_rng(
        hk.transform(lambda x: hk.Linear(3)(hk.GroupNorm(2)(x).reshape(x.shape[0], -1)))
    )
    x = np.random.default_rng(2).standard_normal((2, 4, 4, 4)).astype(np.float32)
    labels = np.arange(2)
    # one compilation instead of one per operation run eagerly
    params = jax.jit(net.init)(jax.random.PRNGKey(0), x)
    report = _check(lambda p, b: _xent(net.apply(p, b[0]), b[1]), params, (x, labels))
    tags = {e.path: e.tag for e in report.entries}
    assert tags["group_norm/scale"] == tags["group_norm/offset"] == "scale_and_shift_tag"
