"""Tests for `kfacx.BlockDiagonalCurvature` against exact, independently computed
curvature: the estimation modes (exact GGN, exact Fisher, sampling, empirical Fisher),
the moving average, a haiku model end to end and multi-device statistics.

Products with the estimate are in tests/estimator/test_estimator_products.py, block kinds other
than dense Kronecker-factored in tests/estimator/test_estimator_blocks.py, bad input in
tests/estimator/test_estimator_errors.py; shared helpers in tests/_estimator_cases.py.
"""

from __future__ import annotations

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _estimator_cases import (
    DAMPING,
    SIZES_2,
    SIZES_3,
    assert_close,
    estimate,
    flat,
    masked_to_blocks,
    random_like,
    rel_error,
)
from _models import (
    LOSS_KINDS,
    HaikuTaggedMLP,
    autodiff_output_hessian,
    block_diag,
    block_mask,
    dense,
    exact_fisher,
    exact_ggn,
    hand_kfac_factors,
    init_mlp,
    make_batch,
    make_tagged_mlp,
    mlp_layer_index,
    mlp_logits,
    mlp_outputs,
    normal,
    output_hessian,
    per_example_loss_sum,
    squared_error_fisher,
)
from jax.flatten_util import ravel_pytree

import kfacx

# ----------------------------------------------------------------------------- exact GGN


@pytest.mark.parametrize("kind", LOSS_KINDS)
@pytest.mark.parametrize("weight", [1.0, 0.5])
def test_reference_output_hessian_matches_autodiff(kind, weight):
    rng = np.random.default_rng(3)
    z = normal(rng, 3)
    t = make_batch(kind, (2, 3), 1, seed=4)[1][0]
    assert_close(output_hessian(kind, z, weight), autodiff_output_hessian(kind, z, t, weight))


@pytest.mark.parametrize("weight", [1.0, 0.5])
@pytest.mark.parametrize("kind", LOSS_KINDS)
@pytest.mark.parametrize("sizes", [SIZES_2, SIZES_3], ids=["2layer", "3layer"])
def test_ggn_exact_batch_one_equals_exact_ggn_blocks(sizes, kind, weight):
    params = init_mlp(sizes, seed=0)
    x, t = make_batch(kind, sizes, batch=1)
    est = kfacx.BlockDiagonalCurvature(
        make_tagged_mlp(kind, weight), default_estimation_mode="ggn_exact"
    )
    _, matrix = estimate(est, params, (x, t))
    # The reference output Hessian agrees with autodiff at this example's logits.
    z = mlp_logits(params, x)[0]
    assert_close(output_hessian(kind, z, weight), autodiff_output_hessian(kind, z, t[0], weight))
    ggn = exact_ggn(kind, params, x, weight)
    index = mlp_layer_index(params)
    assert matrix.shape == ggn.shape
    for idx in index:
        assert_close(matrix[np.ix_(idx, idx)], ggn[np.ix_(idx, idx)])
    off_diagonal = ~block_mask(index, matrix.shape[0])
    np.testing.assert_array_equal(matrix[off_diagonal], 0.0)


@pytest.mark.parametrize("kind", LOSS_KINDS)
@pytest.mark.parametrize("sizes", [SIZES_2, SIZES_3], ids=["2layer", "3layer"])
def test_ggn_exact_batch_is_kronecker_of_batch_averaged_factors(sizes, kind):
    weight = 0.5 if kind == "squared" else 1.0
    params = init_mlp(sizes, seed=2)
    x, t = make_batch(kind, sizes, batch=3, seed=5)
    est = kfacx.BlockDiagonalCurvature(
        make_tagged_mlp(kind, weight), default_estimation_mode="ggn_exact"
    )
    state, matrix = estimate(est, params, (x, t))
    factors = hand_kfac_factors(kind, params, x, weight)
    for block_state, (a, g) in zip(state.blocks, factors, strict=True):
        assert_close(block_state.factors[0].value[0], a)
        assert_close(block_state.factors[1].value[0], g)
    assert_close(matrix, block_diag(*(np.kron(a, g) for a, g in factors)))


@pytest.mark.parametrize("kind", ["softmax", "squared"])
def test_ggn_exact_sequence_inputs(kind):
    params = init_mlp(SIZES_2, seed=3)
    x, t = make_batch(kind, SIZES_2, batch=3, seed=6, seq=2)
    assert x.shape == (3, 2, SIZES_2[0])
    est = kfacx.BlockDiagonalCurvature(make_tagged_mlp(kind), default_estimation_mode="ggn_exact")
    state, matrix = estimate(est, params, (x, t), jit=True)
    factors = hand_kfac_factors(kind, params, x, 1.0)
    for block_state, (a, g) in zip(state.blocks, factors, strict=True):
        assert_close(block_state.factors[0].value[0], a)
        assert_close(block_state.factors[1].value[0], g)
    assert_close(matrix, block_diag(*(np.kron(a, g) for a, g in factors)))


def test_ggn_exact_two_losses_sum_their_curvatures():
    """Two heads on a shared trunk: every block is the sum of both losses' GGN blocks."""
    trunk, head_a, head_b = init_mlp((3, 4, 3), seed=7) + init_mlp((4, 2), seed=8)
    params = [trunk, head_a, head_b]
    rng = np.random.default_rng(9)
    x = normal(rng, 1, 3)
    labels = jnp.asarray([1], jnp.int32)
    targets = normal(rng, 1, 2)

    def loss_fn(params, batch):
        x, labels, targets = batch
        (w1, b1), (w2, b2), (w3, b3) = params
        h = jnp.tanh(kfacx.register_dense(dense(x, w1, b1), x, w1, b1))
        logits = kfacx.register_dense(dense(h, w2, b2), h, w2, b2)
        prediction = kfacx.register_dense(dense(h, w3, b3), h, w3, b3)
        kfacx.register_softmax_cross_entropy_loss(logits, labels)
        kfacx.register_squared_error_loss(prediction, targets, weight=0.5)
        return 0.0

    est = kfacx.BlockDiagonalCurvature(loss_fn, default_estimation_mode="ggn_exact")
    _, matrix = estimate(est, params, (x, labels, targets), jit=True)

    flat_params, unravel = ravel_pytree(params)

    def heads(f):
        (w1, b1), (w2, b2), (w3, b3) = unravel(f)
        h = jnp.tanh(dense(x, w1, b1))
        return dense(h, w2, b2)[0], dense(h, w3, b3)[0]

    z_a, _ = heads(flat_params)
    jac_a, jac_b = (np.asarray(j, np.float64) for j in jax.jit(jax.jacfwd(heads))(flat_params))
    ggn = jac_a.T @ output_hessian("softmax", z_a, 1.0) @ jac_a
    ggn += jac_b.T @ output_hessian("squared", np.zeros(2), 0.5) @ jac_b
    index = mlp_layer_index(params)
    assert_close(matrix, masked_to_blocks(ggn, index))


def test_params_index_and_explicit_batch_size():
    params = init_mlp(SIZES_2, seed=0)
    x, t = make_batch("softmax", SIZES_2, batch=1)
    tagged = make_tagged_mlp("softmax")
    est = kfacx.BlockDiagonalCurvature(
        lambda batch, params: tagged(params, batch),
        params_index=1,
        default_estimation_mode="ggn_exact",
    )
    key = jax.random.PRNGKey(0)
    state = est.init(key, ((x, t), params))
    state = est.update_curvature_matrix_estimate(state, 0.0, 1.0, 1, key, ((x, t), params))
    ggn = exact_ggn("softmax", params, x, 1.0)
    assert_close(est.to_dense_matrix(state), masked_to_blocks(ggn, mlp_layer_index(params)))


# ----------------------------------------------------------------------------- exact Fisher


@pytest.mark.parametrize("weight", [1.0, 0.5])
@pytest.mark.parametrize("kind", LOSS_KINDS)
def test_fisher_exact_batch_one_equals_exact_fisher_blocks(kind, weight):
    params = init_mlp(SIZES_2, seed=4)
    x, t = make_batch(kind, SIZES_2, batch=1, seed=8)
    est = kfacx.BlockDiagonalCurvature(make_tagged_mlp(kind, weight))
    _, matrix = estimate(est, params, (x, t), mode="fisher_exact")
    if kind == "squared":
        fisher = squared_error_fisher(params, x, weight)
    else:
        fisher = exact_fisher(kind, params, x, weight)
    index = mlp_layer_index(params)
    for idx in index:
        assert_close(matrix[np.ix_(idx, idx)], fisher[np.ix_(idx, idx)])
    assert_close(matrix, masked_to_blocks(fisher, index))


# ----------------------------------------------------------------------------- sampling modes


@pytest.mark.parametrize(
    "mode, kind",
    [
        ("fisher_gradients", "softmax"),
        ("fisher_gradients", "sigmoid"),
        ("fisher_gradients", "squared"),
        ("fisher_curvature_prop", "softmax"),
        ("ggn_curvature_prop", "softmax"),
    ],
)
def test_sampling_modes_converge_to_exact(mode, kind):
    params = init_mlp(SIZES_2, seed=5)
    batch = make_batch(kind, SIZES_2, batch=1, seed=9)
    loss_fn = make_tagged_mlp(kind, weight=1.0 if kind == "softmax" else 0.5)
    exact_est = kfacx.BlockDiagonalCurvature(loss_fn, default_estimation_mode="ggn_exact")
    _, exact = estimate(exact_est, params, batch)
    errors = {}
    for n in (40, 4000):
        est = kfacx.BlockDiagonalCurvature(loss_fn, default_estimation_mode=mode, num_samples=n)
        _, matrix = estimate(est, params, batch, seed=1)
        errors[n] = rel_error(matrix, exact)
    assert errors[4000] < 0.1, errors
    assert errors[4000] < errors[40], errors


def test_sampling_mode_is_deterministic_given_rng():
    params = init_mlp(SIZES_2)
    batch = make_batch("softmax", SIZES_2, batch=3)
    est = kfacx.BlockDiagonalCurvature(make_tagged_mlp("softmax"), num_samples=3)
    _, first = estimate(est, params, batch, seed=3)
    _, again = estimate(est, params, batch, seed=3)
    _, other = estimate(est, params, batch, seed=4)
    np.testing.assert_array_equal(first, again)
    assert not np.allclose(first, other)


@pytest.mark.parametrize("kind, weight", [("softmax", 1.0), ("sigmoid", 1.0), ("squared", 0.5)])
def test_fisher_empirical_uses_true_label_gradients(kind, weight):
    """Factors of the per-example gradients of the registered loss at the observed
    targets, scaled like the other modes (linear in the weight w):
    ``G = (1/(B w)) sum_b dy_b dy_b^T`` with ``dy_b = d(w l_b)/dy_b``."""
    params = init_mlp(SIZES_2, seed=6)
    x, t = make_batch(kind, SIZES_2, batch=3, seed=10)
    batch_size = x.shape[0]
    est = kfacx.BlockDiagonalCurvature(make_tagged_mlp(kind, weight), num_samples=7)
    state, matrix = estimate(est, params, (x, t), mode="fisher_empirical")

    # Per-example gradients of the loss w.r.t. every layer's output, by
    # perturbing the layer outputs of an untagged forward pass.
    outs = mlp_outputs(params, x)
    eps = [jnp.zeros_like(o) for o in outs]

    def summed_loss(eps):
        return per_example_loss_sum(kind, mlp_outputs(params, x, eps)[-1], t, weight)

    grads = jax.grad(summed_loss)(eps)
    inputs = [x] + [jnp.tanh(o) for o in outs[:-1]]
    blocks = []
    for block_state, inp, dy in zip(state.blocks, inputs, grads, strict=True):
        rows = np.concatenate([np.asarray(inp), np.ones((batch_size, 1))], axis=1)
        a = rows.T @ rows / batch_size
        dy = np.asarray(dy, np.float64)
        g = dy.T @ dy / (batch_size * weight)
        assert_close(block_state.factors[0].value[0], a)
        assert_close(block_state.factors[1].value[0], g)
        blocks.append(np.kron(a, g))
    assert_close(matrix, block_diag(*blocks))


# ----------------------------------------------------------------------------- moving average


def test_ema_two_updates_average_the_factors():
    params = init_mlp(SIZES_2)
    loss_fn = make_tagged_mlp("softmax")
    first = make_batch("softmax", SIZES_2, batch=3, seed=1)
    second = make_batch("softmax", SIZES_2, batch=3, seed=2)
    est = kfacx.BlockDiagonalCurvature(loss_fn, default_estimation_mode="ggn_exact")
    key = jax.random.PRNGKey(0)
    single_1, _ = estimate(est, params, first)
    single_2, _ = estimate(est, params, second)

    state = est.init(key, (params, first))
    state = est.update_curvature_matrix_estimate(state, 0.0, 1.0, None, key, (params, first))
    state = est.update_curvature_matrix_estimate(state, 0.5, 0.5, None, key, (params, second))
    for got, s1, s2 in zip(state.blocks, single_1.blocks, single_2.blocks, strict=True):
        for f, f1, f2 in zip(got.factors, s1.factors, s2.factors, strict=True):
            assert_close(f.value, 0.5 * (np.asarray(f1.value) + np.asarray(f2.value)))


def test_ema_bias_correction_and_zero_init():
    params = init_mlp(SIZES_2)
    batch = make_batch("softmax", SIZES_2, batch=3)
    est = kfacx.BlockDiagonalCurvature(
        make_tagged_mlp("softmax"), default_estimation_mode="ggn_exact"
    )
    key = jax.random.PRNGKey(0)
    state = est.init(key, (params, batch))
    np.testing.assert_array_equal(est.to_dense_matrix(state), 0.0)
    _, reference = estimate(est, params, batch)
    # A first update with small ema_new is bias-corrected to the statistic itself.
    state = est.update_curvature_matrix_estimate(state, 0.95, 0.05, None, key, (params, batch))
    assert_close(est.to_dense_matrix(state), reference)


# ----------------------------------------------------------------------------- haiku


def test_haiku_model_end_to_end():
    def forward(batch):
        x, labels = batch
        logits = HaikuTaggedMLP(SIZES_2[1:], name="mlp")(x)
        kfacx.register_softmax_cross_entropy_loss(logits, labels)
        return jnp.mean(-jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1))

    model = hk.without_apply_rng(hk.transform(forward))
    x, labels = make_batch("softmax", SIZES_2, batch=1, seed=19)
    shapes = jax.eval_shape(model.init, jax.random.PRNGKey(1), (x, labels))
    params = random_like(shapes, seed=1)
    est = kfacx.BlockDiagonalCurvature(model.apply, default_estimation_mode="ggn_exact")
    state, matrix = estimate(est, params, (x, labels))
    assert [b.layer.parameter_paths for b in est.blocks] == [
        ("mlp/~/linear_0/w", "mlp/~/linear_0/b"),
        ("mlp/~/linear_1/w", "mlp/~/linear_1/b"),
    ]

    # Exact GGN in ravel_pytree order (b before w within each module).
    flat_params, unravel = ravel_pytree(params)

    def logits(f):
        p = unravel(f)
        as_list = [(p[f"mlp/~/linear_{i}"]["w"], p[f"mlp/~/linear_{i}"]["b"]) for i in range(2)]
        return mlp_logits(as_list, x)[0]

    jac = np.asarray(jax.jit(jax.jacfwd(logits))(flat_params), np.float64)
    ggn = jac.T @ output_hessian("softmax", jax.jit(logits)(flat_params), 1.0) @ jac
    sizes = [leaf.size for leaf in jax.tree_util.tree_leaves(params)]
    layer_index = [np.arange(0, sizes[0] + sizes[1]), np.arange(sizes[0] + sizes[1], sum(sizes))]
    assert_close(matrix, masked_to_blocks(ggn, layer_index))

    v = random_like(params, seed=7)
    got = est.multiply_inverse(est.update_cache(state, DAMPING), v, DAMPING, use_cached=True)
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(params)
    exact = est.multiply_inverse(state, v, DAMPING, exact_power=True)
    want = np.linalg.solve(matrix + DAMPING * np.eye(len(matrix)), flat(v))
    assert_close(flat(exact), want, rtol=1e-3, atol_scale=1e-4)
    assert np.all(np.isfinite(flat(got)))


# ----------------------------------------------------------------------------- multi-device


def test_pmap_statistics_equal_full_batch_statistics():
    num_devices = 4
    assert jax.local_device_count() >= num_devices
    params = init_mlp(SIZES_2, seed=20)
    x, t = make_batch("softmax", SIZES_2, batch=2 * num_devices, seed=21)
    loss_fn = make_tagged_mlp("softmax")
    key = jax.random.PRNGKey(0)

    shard_x = x.reshape(num_devices, 2, -1)
    shard_t = t.reshape(num_devices, 2)
    est = kfacx.BlockDiagonalCurvature(loss_fn, default_estimation_mode="ggn_exact")
    state0 = est.init(key, (params, (shard_x[0], shard_t[0])))

    def update(state, params, x, t, key):
        return est.update_curvature_matrix_estimate(
            state, 0.0, 1.0, None, key, (params, (x, t)), pmap_axis_name="i"
        )

    states = jax.pmap(update, axis_name="i", in_axes=(None, None, 0, 0, None))(
        state0, params, shard_x, shard_t, key
    )
    single = kfacx.BlockDiagonalCurvature(loss_fn, default_estimation_mode="ggn_exact")
    _, want = estimate(single, params, (x, t), jit=True)
    for d in range(num_devices):
        state_d = jax.tree_util.tree_map(lambda leaf, d=d: np.asarray(leaf)[d], states)
        assert_close(est.to_dense_matrix(state_d), want)
