"""`kfacx.register_ctc_loss`: the CTC loss's value and gradient, and the Fisher of its
per-frame categorical model as curvature, checked against dense references."""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import block_mask, dense, init_mlp, mlp_layer_index, normal
from jax.flatten_util import ravel_pytree

import kfacx

# Batch, frames, classes (the blank is class 0), input width, hidden width, max labels.
B, T, K, D, H, N = 2, 4, 3, 3, 4, 2
LOGIT_PADDINGS = np.array([[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 1.0, 1.0]])
LABELS = np.array([[1, 2], [2, 0]], np.int32)
LABEL_PADDINGS = np.array([[0.0, 0.0], [0.0, 1.0]])
_KEY = jax.random.key(0)


@pytest.fixture
def x64():
    with jax.enable_x64(True):
        yield


def _wide(tree):
    """``tree`` in float64 when x64 is on."""
    return jax.tree.map(lambda a: jnp.asarray(a, jnp.result_type(float)), tree)


def _logits(params, x):
    (w1, b1), (w2, b2) = params
    return dense(jnp.tanh(dense(x, w1, b1)), w2, b2)


def _batch(seed=1, logit_paddings=LOGIT_PADDINGS):
    x = normal(np.random.default_rng(seed), B, T, D)
    return _wide((x, logit_paddings, LABEL_PADDINGS)) + (jnp.asarray(LABELS),)


def _loss_fn(weight=1.0):
    """The typical user loss: the mean over the batch of `optax.ctc_loss`."""

    def loss_fn(params, batch):
        x, logit_paddings, label_paddings, labels = batch
        logits = kfacx.register_ctc_loss(
            _logits(params, x), logit_paddings, labels, label_paddings, weight=weight
        )
        return weight * jnp.mean(optax.ctc_loss(logits, logit_paddings, labels, label_paddings))

    return loss_fn


def _problem(seed=0):
    return _wide(init_mlp((D, H, K), seed=seed)), _batch(seed + 1)


def _full_estimator(weight=1.0, **kwargs):
    return kfacx.BlockDiagonalCurvature(
        _loss_fn(weight), layer_tag_to_block_ctor={"dense_tag": kfacx.Full}, **kwargs
    )


@functools.cache
def _estimator(weight=1.0, num_samples=None):
    """`_full_estimator`, one per configuration, shared by the tests (so that each
    program of `_dense_estimate` is traced and compiled once)."""
    kwargs = {} if num_samples is None else dict(num_samples=num_samples)
    return _full_estimator(weight, **kwargs)


@functools.cache
def _dense_program(est, mode):
    @jax.jit
    def run(params, batch):
        key = jax.random.key(3)
        state = est.init(key, (params, batch))
        state = est.update_curvature_matrix_estimate(
            state, 0.0, 1.0, None, key, (params, batch), mode
        )
        return est.to_dense_matrix(state)

    return run


def _dense_estimate(est, params, batch, mode):
    """The estimator's dense matrix after one update in ``mode`` (one jitted program per
    estimator and mode)."""
    return np.asarray(_dense_program(est, mode)(params, batch), np.float64)


def _frame_fisher_reference(params, batch, weight=1.0):
    """``(weight / B) sum_{b, t real} J_bt^T (diag p_bt - p_bt p_bt^T) J_bt`` over all
    parameters, from the logits' Jacobian: the dense Fisher of the per-frame model."""
    x, logit_paddings = batch[0], np.asarray(batch[1])
    flat, unravel = ravel_pytree(params)

    @jax.jit
    def logits_and_jacobian(flat):
        return _logits(unravel(flat), x), jax.jacfwd(lambda f: _logits(unravel(f), x))(flat)

    z, jac = (np.asarray(a, np.float64) for a in logits_and_jacobian(flat))
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    total = np.zeros((flat.size, flat.size))
    for b, t in itertools.product(range(B), range(T)):
        frame = np.diag(p[b, t]) - np.outer(p[b, t], p[b, t])
        total += (1.0 - logit_paddings[b, t]) * jac[b, t].T @ frame @ jac[b, t]
    return weight * total / B


def _layer_blocks(matrix, params):
    return np.where(block_mask(mlp_layer_index(params), matrix.shape[0]), matrix, 0.0)


# ----------------------------------------------------------------------------- value, gradient


def test_registered_value_and_gradients_are_the_functions(x64):
    """`evaluate` is the user's loss; the per-example and empirical cotangents are
    ``B`` (and ``B / sqrt(weight)``) times its gradient w.r.t. the logits."""
    params, (x, logit_paddings, label_paddings, labels) = _problem()
    weight = 0.5
    est = _full_estimator(weight)
    args = (params, (x, logit_paddings, label_paddings, labels))
    classes = []

    @jax.jit
    def pieces(args):
        (loss,), _ = est.linearized_losses(args)
        classes.append(type(loss))
        z = loss.prediction

        def user(z):
            return weight * jnp.mean(optax.ctc_loss(z, logit_paddings, labels, label_paddings))

        return (
            loss.evaluate(),
            user(z),
            loss.per_example_gradient(),
            loss.empirical_fisher_cotangent(),
            B * jax.grad(user)(z),
        )

    value, want_value, per_example, empirical, want_grad = pieces(args)
    assert classes == [kfacx.CTCLoss]
    np.testing.assert_allclose(value, want_value, rtol=1e-12)
    np.testing.assert_allclose(per_example, want_grad, rtol=1e-10, atol=1e-14)
    np.testing.assert_allclose(empirical, want_grad / np.sqrt(weight), rtol=1e-10, atol=1e-14)
    np.testing.assert_array_equal(np.asarray(per_example)[1, 2:], 0.0)  # padded frames


def test_empirical_modes_agree_with_the_functions_own_gradients(x64):
    """``fisher_empirical`` (the registered loss's gradients) and
    ``fisher_empirical_direct`` (the function's per-example gradients) agree: the
    registered loss is normalised as the function's mean over the batch."""
    params, batch = _problem()
    est = _estimator()
    empirical = _dense_estimate(est, params, batch, "fisher_empirical")
    direct = _dense_estimate(est, params, batch, "fisher_empirical_direct")
    np.testing.assert_allclose(empirical, direct, rtol=1e-9, atol=1e-14)


# ----------------------------------------------------------------------------- curvature


@pytest.mark.parametrize("mode", ["ggn_exact", "fisher_exact"])
def test_exact_curvature_is_the_dense_fisher_of_the_per_frame_model(x64, mode):
    params, batch = _problem()
    weight = 0.5
    got = _dense_estimate(_estimator(weight), params, batch, mode)
    want = _layer_blocks(_frame_fisher_reference(params, batch, weight), params)
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-13)


def test_padded_frames_do_not_contribute(x64):
    """Garbage inputs on padded frames change nothing; unpadding them does."""
    params, batch = _problem()
    x = np.array(batch[0])
    x[1, 2:] = 100.0 * np.random.default_rng(5).standard_normal((T - 2, D))
    garbage = (jnp.asarray(x),) + batch[1:]
    est = _estimator()
    clean = _dense_estimate(est, params, batch, "ggn_exact")
    np.testing.assert_allclose(_dense_estimate(est, params, garbage, "ggn_exact"), clean)
    unpadded = (batch[0], jnp.zeros_like(batch[1])) + batch[2:]
    assert np.abs(_dense_estimate(est, params, unpadded, "ggn_exact") - clean).max() > 1e-3

    loss = kfacx.CTCLoss(
        jnp.asarray(x @ np.ones((D, K))), batch[3], 1.0 - batch[1], label_paddings=batch[2]
    )
    cotangents = jax.jit(jax.vmap(loss.sampled_fisher_cotangent))(jax.random.split(_KEY, 8))
    np.testing.assert_array_equal(np.asarray(cotangents)[:, 1, 2:], 0.0)


def test_sampled_fisher_is_unbiased_for_the_per_frame_fisher(x64):
    """``fisher_gradients`` averages sampled frame labels' cotangents: with many samples
    it matches the exact per-frame Fisher (Monte-Carlo error about 1 / sqrt(samples))."""
    params, batch = _problem()
    est = _estimator(num_samples=20_000)
    sampled = _dense_estimate(est, params, batch, "fisher_gradients")
    exact = _dense_estimate(_estimator(), params, batch, "ggn_exact")
    error = np.linalg.norm(sampled - exact) / np.linalg.norm(exact)
    assert error < 0.02, error


def test_curvature_products_equal_softmax_cross_entropy_on_real_frames(x64):
    """Per frame the CTC tag's curvature is the softmax cross-entropy's (same logits,
    the frame mask as the cross-entropy's mask), whatever the frame targets."""
    rng = np.random.default_rng(2)
    z, v = _wide((normal(rng, B, T, K), normal(rng, B, T, K)))
    mask = 1.0 - jnp.asarray(LOGIT_PADDINGS)
    ctc = kfacx.CTCLoss(z, jnp.asarray(LABELS), mask, 0.5, label_paddings=LABEL_PADDINGS)
    ce = kfacx.SoftmaxCrossEntropyLoss(z, jnp.zeros((B, T), jnp.int32), mask, 0.5)
    for name in ("multiply_ggn", "multiply_fisher_factor", "multiply_ggn_factor_transpose"):
        np.testing.assert_allclose(getattr(ctc, name)(v), getattr(ce, name)(v), rtol=1e-12)


def _collapse(path, blank=0):
    """CTC's many-to-one map: merge repeats, then drop blanks."""
    merged = [s for i, s in enumerate(path) if i == 0 or s != path[i - 1]]
    return tuple(s for s in merged if s != blank)


def test_per_frame_fisher_bounds_the_ctc_hessian_and_fisher(x64):
    """The documented approximation, by enumerating every alignment of one example:
    CTC's Hessian w.r.t. the logits is ``F - Sigma_y`` (``Sigma_y`` the alignment
    posterior's covariance), and CTC's Fisher over label sequences is
    ``F - E_y[Sigma_y]``: both at most the registered ``F``."""
    z = np.asarray(normal(np.random.default_rng(4), 1, T, K), np.float64)
    labels = jnp.asarray([[1, 1]], jnp.int32)  # a repeat: alignments need a blank between
    hess = jax.jit(
        jax.hessian(lambda z: optax.ctc_loss(z, jnp.zeros((1, T)), labels, jnp.zeros((1, N)))[0])
    )(jnp.asarray(z))
    hess = np.asarray(hess).reshape(T * K, T * K)

    p = np.exp(z[0]) / np.exp(z[0]).sum(-1, keepdims=True)
    frames = np.zeros((T * K, T * K))
    for t in range(T):
        frames[t * K : (t + 1) * K, t * K : (t + 1) * K] = np.diag(p[t]) - np.outer(p[t], p[t])
    paths = np.array(list(itertools.product(range(K), repeat=T)))
    prob = np.prod(p[np.arange(T), paths], axis=1)  # q(pi), the per-frame model
    onehots = np.eye(K)[paths].reshape(len(paths), T * K)
    sequences = [_collapse(tuple(path)) for path in paths]

    def posterior_covariance(y):
        w = np.array([s == y for s in sequences]) * prob
        mean = (w / w.sum()) @ onehots
        return (onehots - mean).T @ ((w / w.sum())[:, None] * (onehots - mean)), w.sum(), mean

    sigma_y, _, _ = posterior_covariance((1, 1))
    np.testing.assert_allclose(hess, frames - sigma_y, atol=1e-9)

    fisher_ctc, expected_sigma = np.zeros_like(frames), np.zeros_like(frames)
    for y in set(sequences):
        sigma, p_y, mean = posterior_covariance(y)
        score = mean - p.reshape(-1)  # gradient of log p(y) w.r.t. the logits
        fisher_ctc += p_y * np.outer(score, score)
        expected_sigma += p_y * sigma
    np.testing.assert_allclose(fisher_ctc, frames - expected_sigma, atol=1e-12)
    assert np.linalg.eigvalsh(frames - fisher_ctc).min() > -1e-12
    assert np.linalg.eigvalsh(hess).min() < 0  # CTC's own Hessian is indefinite here


# ----------------------------------------------------------------------------- training


def test_optimizer_steps_lower_the_ctc_loss():
    rng = np.random.default_rng(6)
    batch_size, frames, width = 4, 6, 5
    x = normal(rng, batch_size, frames, width)
    logit_paddings = jnp.asarray(np.arange(frames) >= np.array([[6], [5], [6], [4]]), jnp.float32)
    labels = jnp.asarray([[1, 2, 0], [2, 2, 1], [1, 0, 0], [2, 1, 0]], jnp.int32)
    label_paddings = jnp.asarray([[0, 0, 1], [0, 0, 0], [0, 1, 1], [0, 0, 1]], jnp.float32)
    batch = (x, logit_paddings, label_paddings, labels)
    params = init_mlp((width, 8, K), seed=7)
    opt = kfacx.Optimizer(
        jax.value_and_grad(_loss_fn()),
        use_adaptive_learning_rate=True,
        use_adaptive_momentum=True,
        use_adaptive_damping=True,
        initial_damping=1.0,
        curvature_batch_fraction=1.0,
    )
    key = jax.random.key(8)
    state = opt.init(params, key, batch)
    loss = jax.jit(_loss_fn())
    start = float(loss(params, batch))
    for _ in range(8):
        params, state, _ = opt.step(params, state, key, batch)
    end = float(loss(params, batch))
    assert np.isfinite(end) and end < 0.6 * start, (start, end)


# ----------------------------------------------------------------------------- bad input


def _bad(**changes):
    args = dict(
        logits=jnp.zeros((B, T, K)),
        logit_paddings=jnp.zeros((B, T)),
        labels=jnp.zeros((B, N), jnp.int32),
        label_paddings=jnp.zeros((B, N)),
    )
    args.update(changes)
    return args


@pytest.mark.parametrize(
    "changes, error, match",
    [
        (dict(logits=jnp.zeros((B * T, K))), ValueError, r"logits must have shape \[batch"),
        (dict(logits=jnp.zeros((B, T, K), jnp.int32)), TypeError, "logits must be floating"),
        (dict(logit_paddings=jnp.zeros((B, T + 1))), ValueError, "logit_paddings has shape"),
        (dict(logit_paddings=jnp.zeros((B,))), ValueError, "logit_paddings has shape"),
        (dict(labels=jnp.zeros((B,), jnp.int32)), ValueError, "labels must have shape"),
        (dict(labels=jnp.zeros((B + 1, N), jnp.int32)), ValueError, "labels must have shape"),
        (dict(labels=jnp.zeros((B, N))), TypeError, "labels must be integer"),
        (dict(label_paddings=jnp.zeros((B, N + 1))), ValueError, "label_paddings has shape"),
        (dict(blank_id=K), ValueError, "blank_id=3 is not a class"),
        (dict(blank_id=0.0), TypeError, "blank_id must be a Python int"),
        (dict(weight=0.0), ValueError, "weight must be finite and positive"),
        (dict(log_epsilon=1.0), ValueError, "log_epsilon .* negative"),
    ],
)
def test_bad_input_is_a_clear_error(changes, error, match):
    args = _bad(**changes)
    with pytest.raises(error, match=f"register_ctc_loss: {match}"):
        kfacx.register_ctc_loss(
            args.pop("logits"),
            args.pop("logit_paddings"),
            args.pop("labels"),
            args.pop("label_paddings"),
            **args,
        )


def test_traced_weight_is_a_clear_error():
    def loss(weight):
        args = _bad()
        return kfacx.register_ctc_loss(*args.values(), weight=weight)

    with pytest.raises(TypeError, match="weight must be a Python float known at trace time"):
        jax.jit(loss)(1.0)
