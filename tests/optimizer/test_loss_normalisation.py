"""A registered loss is the mean over its own rows, whatever the batch's leading size.

A sequence model's loss is usually written with the logits flattened to
``[batch * positions, classes]`` and the mean over all rows. The curvature (the
K-FAC statistics and the quadratic model's exact Gram matrix) must then be averaged
over those rows, not over the batch's leading axis: otherwise the quadratic model is
``positions`` times too stiff and the solved learning rate that much too small.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _models import dense, init_mlp, normal, output_hessian
from jax.flatten_util import ravel_pytree

import kfacx
from kfacx.estimator._statistics import ggn_gram_upper, gram_from_upper

B, T, D, H, C = 3, 4, 5, 6, 4


@pytest.fixture
def x64():
    with jax.enable_x64(True):
        yield


def _mlp(params, x):
    (w1, b1), (w2, b2) = params
    return dense(jnp.tanh(dense(x, w1, b1)), w2, b2)


def _cross_entropy(logits, labels):
    log_p = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(log_p, labels[..., None], axis=-1))


# Three ways to write the same loss: the mean cross-entropy over all B * T positions.
def _per_sequence(params, batch):
    """Logits registered as ``[B, T, C]`` with weight ``1/T`` (a sum over positions)."""
    x, labels = batch
    logits = kfacx.register_softmax_cross_entropy_loss(
        _mlp(params, x), labels, weight=1.0 / x.shape[1]
    )
    return _cross_entropy(logits, labels)


def _flattened_logits(params, batch):
    """Logits flattened to ``[B * T, C]``, the inputs left as ``[B, T, D]``."""
    x, labels = batch
    logits = _mlp(params, x).reshape(-1, C)
    logits = kfacx.register_softmax_cross_entropy_loss(logits, labels.reshape(-1))
    return _cross_entropy(logits, labels.reshape(-1))


def _flattened_inputs(params, batch):
    """The batch itself flattened to ``B * T`` rows."""
    x, labels = batch
    x, labels = x.reshape(-1, D), labels.reshape(-1)
    logits = kfacx.register_softmax_cross_entropy_loss(_mlp(params, x), labels)
    return _cross_entropy(logits, labels)


def _gram(est, args, vectors):
    """The ``[k, k]`` Gram matrix of the exact curvature in ``vectors`` (one program)."""

    @jax.jit
    def gram(args, vectors):
        losses, jvp = est.linearized_losses(args)
        return gram_from_upper(ggn_gram_upper(losses, jvp, vectors, None), len(vectors))

    return gram(args, vectors)


LAYOUTS = {
    "per_sequence": _per_sequence,
    "flattened_logits": _flattened_logits,
    "flattened_inputs": _flattened_inputs,
}


def _wide(tree):
    """``tree`` in float64 when x64 is on (float32 otherwise)."""
    return jax.tree.map(lambda a: jnp.asarray(a, jnp.result_type(float)), tree)


def _problem(seed=0):
    rng = np.random.default_rng(seed)
    params = _wide(init_mlp((D, H, C), seed=seed))
    x = _wide(normal(rng, B, T, D))
    labels = jnp.asarray(rng.integers(0, C, (B, T)), jnp.int32)
    return params, (x, labels)


def _dense_mean_ggn(params, x, labels) -> np.ndarray:
    """The exact Gauss-Newton matrix of the mean cross-entropy over all positions:
    ``(1 / (B T)) sum_rows J_r^T H_r J_r``, from each row's Jacobian."""
    flat, unravel = ravel_pytree(params)

    @jax.jit  # one compilation instead of one per operation run eagerly
    def logits_and_jacobian(flat):
        return _mlp(unravel(flat), x), jax.jacfwd(lambda f: _mlp(unravel(f), x))(flat)

    z, jac = (np.asarray(a, np.float64) for a in logits_and_jacobian(flat))
    z, jac = z.reshape(-1, C), jac.reshape(-1, C, flat.size)
    rows = [j.T @ output_hessian("softmax", zr, 1.0) @ j for j, zr in zip(jac, z, strict=True)]
    return sum(rows) / len(rows)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_gram_is_the_curvature_of_the_mean_over_all_positions(x64, layout):
    params, (x, labels) = _problem()
    est = kfacx.BlockDiagonalCurvature(LAYOUTS[layout])
    args = (params, (x, labels))
    if layout == "flattened_inputs":
        args = (params, (x.reshape(-1, D), labels.reshape(-1)))
    est.init(jax.random.key(0), args)
    rng = np.random.default_rng(1)
    vectors = [_wide(jax.tree.map(lambda p: normal(rng, *p.shape), params)) for _ in range(2)]
    gram = np.asarray(_gram(est, args, vectors))
    ggn = _dense_mean_ggn(params, x, labels)
    v = np.stack([np.asarray(ravel_pytree(u)[0]) for u in vectors])
    np.testing.assert_allclose(gram, v @ ggn @ v.T, rtol=1e-10)


def test_optimizer_steps_do_not_depend_on_the_layout():
    """The adaptive learning rate, momentum and damping all use the quadratic model: the
    three layouts of one loss take the same steps."""
    params, (x, labels) = _problem(seed=2)
    results = {}
    for name, fn in LAYOUTS.items():
        batch = (x, labels)
        if name == "flattened_inputs":
            batch = (x.reshape(-1, D), labels.reshape(-1))
        opt = kfacx.Optimizer(
            jax.value_and_grad(fn),
            use_adaptive_learning_rate=True,
            use_adaptive_momentum=True,
            use_adaptive_damping=True,
            initial_damping=1.0,
            curvature_batch_fraction=1.0,
            num_burnin_steps=0,
        )
        rng = jax.random.key(3)
        state = opt.init(params, rng, batch)
        p = params
        rates = []
        for _ in range(3):
            p, state, stats = opt.step(p, state, rng, batch)
            rates.append(float(stats["learning_rate"]))
        results[name] = (ravel_pytree(p)[0], rates)
    want_params, want_rates = results["per_sequence"]
    for name in ("flattened_logits", "flattened_inputs"):
        got_params, got_rates = results[name]
        np.testing.assert_allclose(got_rates, want_rates, rtol=1e-4, err_msg=name)
        np.testing.assert_allclose(got_params, want_params, rtol=1e-4, atol=1e-6, err_msg=name)


def test_losses_with_different_row_counts_each_average_over_their_own(x64):
    """Two networks, one loss each: ``[1, C]`` and ``[T, C]``. Each block's factors are
    averages over its own loss's rows (``ggn_exact``: the output factor is the mean of
    the rows' output Hessians), and the Gram matrix is that of the sum of the two means."""
    params = _wide(init_mlp((D, C), seed=4) + init_mlp((D, C), seed=5))
    rng = np.random.default_rng(7)
    x_a, x_b = _wide(normal(rng, 1, D)), _wide(normal(rng, T, D))
    label_a = jnp.asarray([1], jnp.int32)
    labels_b = jnp.asarray(rng.integers(0, C, (T,)), jnp.int32)

    def heads(params, x_a, x_b):
        return tuple(
            kfacx.register_dense(dense(x, w, b), x, w, b)
            for (w, b), x in zip(params, (x_a, x_b), strict=True)
        )

    def loss_fn(params, batch):
        x_a, x_b, label_a, labels_b = batch
        z_a, z_b = heads(params, x_a, x_b)
        kfacx.register_softmax_cross_entropy_loss(z_a, label_a)
        kfacx.register_softmax_cross_entropy_loss(z_b, labels_b)
        return _cross_entropy(z_a, label_a) + _cross_entropy(z_b, labels_b)

    batch = (x_a, x_b, label_a, labels_b)
    est = kfacx.BlockDiagonalCurvature(loss_fn, default_estimation_mode="ggn_exact")
    key = jax.random.key(0)

    @jax.jit  # one program: much faster than running the update op by op
    def estimate(params, batch):
        state = est.init(key, (params, batch))
        return est.update_curvature_matrix_estimate(state, 0.0, 1.0, None, key, (params, batch))

    state = estimate(params, batch)

    # one compilation instead of one per operation run eagerly
    z_a, z_b = (np.asarray(z, np.float64) for z in jax.jit(heads)(params, x_a, x_b))
    for block, x, z in zip(state.blocks, (x_a, x_b), (z_a, z_b), strict=True):
        rows = np.concatenate([np.asarray(x), np.ones((len(x), 1))], axis=1)
        want_a = rows.T @ rows / len(rows)
        want_g = sum(output_hessian("softmax", zr, 1.0) for zr in z) / len(z)
        np.testing.assert_allclose(block.factors[0].value[0], want_a, rtol=1e-10)
        np.testing.assert_allclose(block.factors[1].value[0], want_g, rtol=1e-8, atol=1e-14)

    flat, unravel = ravel_pytree(params)
    jac_a, jac_b = (
        np.asarray(j, np.float64).reshape(-1, C, flat.size)
        for j in jax.jit(jax.jacfwd(lambda f: heads(unravel(f), x_a, x_b)))(flat)
    )
    ggn = sum(
        sum(j.T @ output_hessian("softmax", zr, 1.0) @ j for j, zr in zip(jac, z, strict=True))
        / len(z)
        for jac, z in ((jac_a, z_a), (jac_b, z_b))
    )
    vectors = [_wide(jax.tree.map(lambda p: normal(rng, *p.shape), params)) for _ in range(2)]
    gram = np.asarray(_gram(est, (params, batch), vectors))
    v = np.stack([np.asarray(ravel_pytree(u)[0]) for u in vectors])
    np.testing.assert_allclose(gram, v @ ggn @ v.T, rtol=1e-10)


def test_a_batch_mask_that_does_not_fit_the_registered_rows_is_an_error():
    """An example mask is per batch example: with logits flattened to ``B * T`` rows it
    cannot say which rows are padding, and the error says what to do."""
    params, (x, labels) = _problem()
    est = kfacx.BlockDiagonalCurvature(_flattened_logits)
    args = (params, (x, labels))
    est.init(jax.random.key(0), args)
    losses, jvp = est.linearized_losses(args)
    with pytest.raises(ValueError, match="example_mask must have shape"):
        ggn_gram_upper(losses, jvp, [params], jnp.ones((B,)))
