"""Tests for `kfacx.BlockDiagonalCurvature` against exact, independently computed curvature."""

from __future__ import annotations

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
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

SIZES_2 = (3, 4, 3)
SIZES_3 = (3, 4, 4, 3)


def assert_close(got, want, rtol=2e-4, atol_scale=2e-5):
    """Elementwise closeness with an absolute tolerance relative to the largest entry."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape
    atol = atol_scale * max(np.abs(want).max(), 1e-12)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)


def rel_error(got, want) -> float:
    return float(np.linalg.norm(np.asarray(got) - want) / np.linalg.norm(want))


def estimate(est, params, batch, mode=None, seed=0, jit=False):
    """One update with (ema_old, ema_new) = (0, 1); returns ``(state, dense_matrix)``.

    Runs eagerly: with many small models of the same shapes the per-primitive
    compilation cache makes that much faster than a fresh `jax.jit` per call (jit is
    tested separately). ``jit=True``: one program, cheaper for a model whose shapes or
    blocks no other test runs eagerly.
    """
    key = jax.random.PRNGKey(seed)
    args = (params, batch)
    state = est.init(key, args)

    def run(state, args):
        state = est.update_curvature_matrix_estimate(
            state, 0.0, 1.0, None, key, args, estimation_mode=mode
        )
        return state, est.to_dense_matrix(state)

    state, dense = (jax.jit(run) if jit else run)(state, args)
    return state, np.asarray(dense, np.float64)


def _jitted_ggn_exact_dense(est, state, args) -> np.ndarray:
    """`estimate`'s dense matrix (mode ``ggn_exact``) as one jitted program: faster than
    running eagerly for models with many operations (attention-like, embeddings)."""

    @jax.jit
    def dense(state, args):
        state = est.update_curvature_matrix_estimate(
            state, 0.0, 1.0, None, jax.random.PRNGKey(2), args, "ggn_exact"
        )
        return est.to_dense_matrix(state)

    return np.asarray(dense(state, args))


def random_like(tree, seed):
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_map(lambda p: normal(rng, *p.shape), tree)


def flat(tree) -> np.ndarray:
    return np.asarray(ravel_pytree(tree)[0], np.float64)


def masked_to_blocks(matrix: np.ndarray, index_sets) -> np.ndarray:
    return np.where(block_mask(index_sets, matrix.shape[0]), matrix, 0.0)


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


# ----------------------------------------------------------------------------- products


@pytest.fixture(scope="module")
def fitted():
    """An estimator and state (ggn_exact, batch 3) on a 2-layer MLP."""
    params = init_mlp(SIZES_2, seed=11)
    batch = make_batch("softmax", SIZES_2, batch=3, seed=12)
    est = kfacx.BlockDiagonalCurvature(
        make_tagged_mlp("softmax"),
        default_estimation_mode="ggn_exact",
        exact_powers_to_cache=(-1,),
    )
    state, matrix = estimate(est, params, batch)
    return est, state, matrix, params


DAMPING = 0.1


def test_multiply_equals_dense_matrix_product(fitted):
    est, state, matrix, params = fitted
    v = random_like(params, seed=0)
    got = est.multiply(state, v, DAMPING)
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(params)
    want = (matrix + DAMPING * np.eye(len(matrix))) @ flat(v)
    assert_close(flat(got), want)
    assert_close(flat(est.multiply(state, v)), matrix @ flat(v))


def test_multiply_inverse_exact_equals_dense_solve(fitted):
    est, state, matrix, params = fitted
    v = random_like(params, seed=1)
    got = est.multiply_inverse(state, v, DAMPING, exact_power=True)
    want = np.linalg.solve(matrix + DAMPING * np.eye(len(matrix)), flat(v))
    assert_close(flat(got), want, rtol=1e-3, atol_scale=1e-4)
    # (C + l I) (C + l I)^-1 v = v
    assert_close(flat(est.multiply(state, got, DAMPING)), flat(v), rtol=1e-3, atol_scale=1e-4)


def test_multiply_matpower_inverse_sqrt_exact(fitted):
    est, state, matrix, params = fitted
    v = random_like(params, seed=2)
    got = est.multiply_matpower(state, v, DAMPING, -0.5, exact_power=True)
    vals, vecs = np.linalg.eigh(matrix + DAMPING * np.eye(len(matrix)))
    want = vecs @ (vals**-0.5 * (vecs.T @ flat(v)))
    assert_close(flat(got), want, rtol=1e-3, atol_scale=1e-4)


def test_multiply_inverse_exact_cached_matches_uncached(fitted):
    est, state, _, params = fitted
    v = random_like(params, seed=3)
    cached_state = est.update_cache(state, DAMPING)
    got = est.multiply_inverse(cached_state, v, DAMPING, exact_power=True, use_cached=True)
    want = est.multiply_inverse(state, v, DAMPING, exact_power=True)
    assert_close(flat(got), flat(want), rtol=1e-4)


def test_approximate_inverse_uses_pi_damping(fitted):
    est, state, _, params = fitted
    v = random_like(params, seed=4)
    got = est.params_to_blocks(est.multiply_inverse(state, v, DAMPING))
    for block_state, v_layer, g_layer in zip(
        state.blocks, est.params_to_blocks(v), got, strict=True
    ):
        a = np.asarray(block_state.factors[0].value[0], np.float64)
        g = np.asarray(block_state.factors[1].value[0], np.float64)
        pi = np.sqrt((np.trace(a) / len(a)) / (np.trace(g) / len(g)))
        root = np.sqrt(DAMPING)
        v_mat = np.concatenate([np.asarray(v_layer[0]), np.asarray(v_layer[1])[None]], axis=0)
        want = np.linalg.solve(a + pi * root * np.eye(len(a)), v_mat)
        want = np.linalg.solve(g + root / pi * np.eye(len(g)), want.T).T
        assert_close(g_layer[0], want[:-1], rtol=1e-3, atol_scale=1e-4)
        assert_close(g_layer[1], want[-1], rtol=1e-3, atol_scale=1e-4)


def test_update_cache_then_cached_inverse_matches_uncached_under_jit(fitted):
    # The fixture uses the default approx_powers_to_cache=(-1,).
    est, state, _, params = fitted
    v = random_like(params, seed=5)

    uncached = est.multiply_inverse(state, v, DAMPING)
    cached_state = est.update_cache(state, DAMPING)
    cached = est.multiply_inverse(cached_state, v, DAMPING, use_cached=True)
    assert_close(flat(cached), flat(uncached), rtol=1e-4)

    jit_cache = jax.jit(est.update_cache)
    jit_inverse = jax.jit(lambda s, v, d: est.multiply_inverse(s, v, d, use_cached=True))
    jit_cached = jit_inverse(jit_cache(state, DAMPING), v, DAMPING)
    assert_close(flat(jit_cached), flat(uncached), rtol=1e-4)
    # -0.5 was not requested for caching.
    with pytest.raises(ValueError, match="cache"):
        est.multiply_matpower(cached_state, v, DAMPING, -0.5, use_cached=True)


def test_full_update_and_products_under_jit(fitted):
    est, _, matrix, params = fitted
    batch = make_batch("softmax", SIZES_2, batch=3, seed=12)  # the fixture's batch
    key = jax.random.PRNGKey(0)
    state0 = est.init(key, (params, batch))
    v = random_like(params, seed=6)

    @jax.jit
    def step(state, params, batch, v):
        state = est.update_curvature_matrix_estimate(state, 0.0, 1.0, None, key, (params, batch))
        state = est.update_cache(state, DAMPING)
        return (
            state,
            est.multiply(state, v, DAMPING),
            est.multiply_inverse(state, v, DAMPING, use_cached=True),
        )

    state, product, inverse = step(state0, params, batch, v)
    assert_close(est.to_dense_matrix(state), matrix)
    assert_close(flat(product), (matrix + DAMPING * np.eye(len(matrix))) @ flat(v))
    assert_close(flat(inverse), flat(est.multiply_inverse(state, v, DAMPING)), rtol=1e-4)


def test_approximate_inverse_under_rank_promotion_raise(fitted):
    """The default (approximate) inverse path needs no implicit rank promotion."""
    est, state, _, params = fitted
    v = random_like(params, seed=8)
    approx = est.multiply_inverse(state, v, DAMPING)
    est.update_cache(state, DAMPING)
    assert np.all(np.isfinite(flat(approx)))


def test_to_dense_matrix_under_jit(fitted):
    est, state, matrix, _ = fitted
    assert_close(jax.jit(est.to_dense_matrix)(state), matrix)


# ----------------------------------------------------------------------------- other blocks


@pytest.mark.parametrize("batch_size", [1, 3])
def test_full_blocks_equal_exact_ggn_blocks(batch_size):
    params = init_mlp(SIZES_2, seed=17)
    x, t = make_batch("softmax", SIZES_2, batch=batch_size, seed=18)
    est = kfacx.BlockDiagonalCurvature(
        make_tagged_mlp("softmax"),
        layer_tag_to_block_ctor={"dense_tag": kfacx.blocks.Full},
        default_estimation_mode="ggn_exact",
    )
    _, matrix = estimate(est, params, (x, t), jit=True)
    assert all(type(b) is kfacx.blocks.Full for b in est.blocks)
    ggn = exact_ggn("softmax", params, x, 1.0)
    assert_close(matrix, masked_to_blocks(ggn, mlp_layer_index(params)))


def test_diagonal_blocks_equal_exact_ggn_diagonal():
    params = init_mlp(SIZES_2, seed=17)
    x, t = make_batch("softmax", SIZES_2, batch=1, seed=18)
    est = kfacx.BlockDiagonalCurvature(
        make_tagged_mlp("softmax"),
        layer_tag_to_block_ctor={"dense_tag": kfacx.blocks.Diagonal},
        default_estimation_mode="ggn_exact",
    )
    _, matrix = estimate(est, params, (x, t), jit=True)
    assert all(type(b) is kfacx.blocks.Diagonal for b in est.blocks)
    ggn = exact_ggn("softmax", params, x, 1.0)
    assert_close(matrix, np.diag(np.diag(ggn)))


def test_default_blocks_are_dense_kronecker():
    params = init_mlp(SIZES_2)
    est = kfacx.BlockDiagonalCurvature(make_tagged_mlp("softmax"))
    est.init(jax.random.PRNGKey(0), (params, make_batch("softmax", SIZES_2, 2)))
    assert len(est.blocks) == 2
    assert all(type(b) is kfacx.DenseTwoKroneckerFactored for b in est.blocks)


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


# ----------------------------------------------------------------------------- errors


def _fitted_small():
    params = init_mlp(SIZES_2)
    batch = make_batch("softmax", SIZES_2, batch=3)
    est = kfacx.BlockDiagonalCurvature(
        make_tagged_mlp("softmax"), default_estimation_mode="ggn_exact"
    )
    state, _ = estimate(est, params, batch)
    return est, state, params, batch


def test_unknown_estimation_mode_raises():
    with pytest.raises(ValueError, match="estimation_mode"):
        kfacx.BlockDiagonalCurvature(make_tagged_mlp("softmax"), default_estimation_mode="bogus")
    est, state, params, batch = _fitted_small()
    with pytest.raises(ValueError, match="bogus"):
        est.update_curvature_matrix_estimate(
            state, 0.0, 1.0, None, jax.random.PRNGKey(0), (params, batch), estimation_mode="bogus"
        )


@pytest.mark.parametrize("num_samples", [0, -1, 2.0])
def test_bad_num_samples_raises(num_samples):
    with pytest.raises(ValueError, match="num_samples"):
        kfacx.BlockDiagonalCurvature(make_tagged_mlp("softmax"), num_samples=num_samples)


def test_parameter_without_tag_raises_naming_it():
    params = {"layers": init_mlp(SIZES_2), "temperature": jnp.ones((), jnp.float32)}
    batch = make_batch("softmax", SIZES_2, batch=3)

    def loss_fn(params, batch):
        x, t = batch
        (w1, b1), (w2, b2) = params["layers"]
        h = jnp.tanh(kfacx.register_dense(dense(x, w1, b1), x, w1, b1))
        logits = kfacx.register_dense(dense(h, w2, b2), h, w2, b2) * params["temperature"]
        return kfacx.register_softmax_cross_entropy_loss(logits, t).sum()

    est = kfacx.BlockDiagonalCurvature(loss_fn, auto_register_tags=False)
    with pytest.raises(ValueError, match="temperature"):
        est.init(jax.random.PRNGKey(0), (params, batch))


def test_non_callable_block_ctor_raises():
    with pytest.raises(TypeError, match="dense_tag"):
        kfacx.BlockDiagonalCurvature(
            make_tagged_mlp("softmax"), layer_tag_to_block_ctor={"dense_tag": "Full"}
        )


def test_non_callable_func_raises():
    with pytest.raises(TypeError, match="callable"):
        kfacx.BlockDiagonalCurvature(None)


@pytest.mark.parametrize("damping", [0.0, -1.0, float("nan")])
def test_bad_damping_raises(damping):
    est, state, params, _ = _fitted_small()
    v = random_like(params, seed=0)
    with pytest.raises(ValueError, match="damping"):
        est.multiply_inverse(state, v, damping)
    with pytest.raises(ValueError, match="damping"):
        est.multiply_inverse(state, v, damping, exact_power=True)
    with pytest.raises(ValueError, match="damping"):
        est.multiply_matpower(state, v, damping, -0.5)
    with pytest.raises(ValueError, match="damping"):
        est.update_cache(state, damping)


def test_use_before_init_raises():
    params = init_mlp(SIZES_2)
    est = kfacx.BlockDiagonalCurvature(make_tagged_mlp("softmax"))
    with pytest.raises(ValueError, match="init"):
        _ = est.blocks
    with pytest.raises(ValueError, match="init"):
        est.multiply(None, params)
    with pytest.raises(ValueError, match="init"):
        est.to_dense_matrix(None)


def test_vector_with_wrong_structure_raises():
    est, state, params, _ = _fitted_small()
    with pytest.raises(ValueError, match="structure"):
        est.multiply(state, params[:1])
    with pytest.raises(ValueError, match="structure"):
        est.multiply(state, {"w": params[0][0]})
    with pytest.raises(ValueError, match="shape"):
        est.multiply(state, [(params[0][0].T, params[0][1]), params[1]])


def test_params_to_blocks_round_trip():
    est, _, params, _ = _fitted_small()
    split = est.params_to_blocks(params)
    assert len(split) == 2
    back = est.blocks_to_params(split)
    assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(params)
    for a, b in zip(
        jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(params), strict=True
    ):
        np.testing.assert_array_equal(a, b)


# ----------------------------------------------------------------------------- multi-axis dense


def _attention_like_loss(params, batch):
    x, labels = batch
    w1, b1, w2 = params["w1"], params["b1"], params["w2"]
    dn1 = (((2,), (0,)), ((), ()))
    h = jnp.einsum("btd,dhk->bthk", x, w1) + jnp.broadcast_to(b1, (*x.shape[:2], *b1.shape))
    h = jnp.tanh(kfacx.register_dense(h, x, w1, b1, dimension_numbers=dn1))
    logits = jnp.einsum("bthk,hko->bto", h, w2)
    logits = kfacx.register_dense(logits, h, w2, dimension_numbers=(((2, 3), (0, 1)), ((), ())))
    logits = kfacx.register_softmax_cross_entropy_loss(logits, labels)
    log_p = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(log_p, labels[..., None], axis=-1))


def test_multi_axis_dense_blocks_equal_exact_ggn_blocks():
    """einsum('btd,dhk->bthk') and einsum('bthk,hko->bto') layers: the Kronecker blocks
    of ggn_exact equal the exact Gauss-Newton blocks for one example and position."""
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    params = {
        "w1": 0.7 * jax.random.normal(keys[0], (4, 2, 3)),
        "b1": 0.1 * jax.random.normal(keys[1], (2, 3)),
        "w2": 0.7 * jax.random.normal(keys[2], (2, 3, 5)),
    }
    x = jax.random.normal(keys[3], (1, 1, 4))
    labels = jnp.array([[2]])
    est = kfacx.BlockDiagonalCurvature(_attention_like_loss)
    state = est.init(jax.random.PRNGKey(1), (params, (x, labels)))

    got = _jitted_ggn_exact_dense(est, state, (params, (x, labels)))

    flat, unravel = ravel_pytree(params)

    def logits_fn(f):
        p = unravel(f)
        h = jnp.einsum("btd,dhk->bthk", x, p["w1"])
        h = jnp.tanh(h + jnp.broadcast_to(p["b1"], h.shape))
        return jnp.einsum("bthk,hko->bto", h, p["w2"]).reshape(-1)

    jac = np.asarray(jax.jit(jax.jacfwd(logits_fn))(flat), np.float64)
    prob = np.asarray(jax.nn.softmax(logits_fn(flat)), np.float64)
    exact = jac.T @ (np.diag(prob) - np.outer(prob, prob)) @ jac
    # Leaf order (sorted dict keys): b1, w1, w2; the first block is (w1, b1).
    sizes = {"b1": 6, "w1": 24, "w2": 30}
    offsets = {"b1": 0, "w1": 6, "w2": 30}
    first = np.r_[offsets["b1"] : 6, offsets["w1"] : 30]
    second = np.arange(30, 60)
    for idx in (first, second):
        np.testing.assert_allclose(got[np.ix_(idx, idx)], exact[np.ix_(idx, idx)], atol=1e-5)
    np.testing.assert_allclose(got[np.ix_(first, second)], 0.0)
    assert sum(sizes.values()) == got.shape[0]


# ----------------------------------------------------------------------------- embeddings


def test_detected_embedding_block_equals_exact_ggn_block():
    """hk.Embed is detected; for one example and one position its Kronecker block
    (diagonal input factor) equals the exact Gauss-Newton block."""

    def fn(ids):
        e = hk.Embed(7, 4)(ids)
        return hk.Linear(3)(jnp.tanh(e.reshape(e.shape[0], -1)))

    net = hk.without_apply_rng(hk.transform(fn))
    ids, labels = np.array([[5]], np.int32), np.array([2])
    params = net.init(jax.random.PRNGKey(0), ids)

    def loss(params, batch):
        ids, labels = batch
        logits = kfacx.register_softmax_cross_entropy_loss(net.apply(params, ids), labels)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], 1))

    est = kfacx.BlockDiagonalCurvature(loss)
    state = est.init(jax.random.PRNGKey(1), (params, (ids, labels)))
    assert isinstance(est.blocks[0], kfacx.EmbeddingKroneckerFactored)
    assert est.report.unmatched == ()
    got = _jitted_ggn_exact_dense(est, state, (params, (ids, labels)))
    flat, unravel = ravel_pytree(params)
    logits = jax.jit(jax.jacfwd(lambda f: net.apply(unravel(f), ids).reshape(-1)))
    jac = np.asarray(logits(flat), np.float64)
    prob = np.asarray(jax.nn.softmax(net.apply(params, ids)).reshape(-1), np.float64)
    exact = jac.T @ (np.diag(prob) - np.outer(prob, prob)) @ jac
    table = np.arange(28)  # ravel_pytree order: embed/embeddings first
    np.testing.assert_allclose(got[np.ix_(table, table)], exact[np.ix_(table, table)], atol=1e-6)


# ----------------------------------------------------------------------------- weight sharing


def _tied_loss(params, batch, eps=(0.0, 0.0)):
    x, t = batch
    w, b = params["w"], params["b"]
    h1 = x @ w + jnp.broadcast_to(b, (x.shape[0], 3)) + eps[0]
    h2 = jnp.tanh(h1) @ w + jnp.broadcast_to(b, (x.shape[0], 3)) + eps[1]
    logits = kfacx.register_softmax_cross_entropy_loss(jnp.tanh(h2) @ params["out"], t)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), t[:, None], 1)), (x, h1)


def test_tied_weights_are_one_block_with_uses_folded_into_the_batch():
    """The same dense layer applied twice: one block whose input factor averages the
    inputs of both uses and whose output factor sums their cotangent moments."""
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    params = dict(
        w=jax.random.normal(keys[0], (3, 3)),
        b=0.1 * jax.random.normal(keys[1], (3,)),
        out=jax.random.normal(keys[2], (3, 4)),
    )
    x, t = jax.random.normal(keys[3], (5, 3)), jnp.arange(5) % 4
    loss = lambda p, batch: _tied_loss(p, batch)[0]  # noqa: E731
    est = kfacx.BlockDiagonalCurvature(loss)
    state = est.init(jax.random.PRNGKey(1), (params, (x, t)))
    update = jax.jit(  # one program instead of every operation compiled on its own
        lambda s, args: est.update_curvature_matrix_estimate(
            s, 0.0, 1.0, None, jax.random.PRNGKey(2), args, "fisher_empirical"
        )
    )
    state = update(state, (params, (x, t)))
    assert len(est.blocks) == 2 and est.report.unmatched == ()
    assert {e.path: e.uses for e in est.report.entries} == {"b": 2, "out": 1, "w": 2}
    assert "0 (x2)" in str(est.report)
    a, g = (np.asarray(f.value[0], np.float64) for f in state.blocks[0].factors)

    # Reference: per-example gradients w.r.t. each use's output, by perturbation.
    def summed(eps):
        return _tied_loss(params, (x, t), eps)[0] * x.shape[0]

    eps = (jnp.zeros((5, 3)), jnp.zeros((5, 3)))
    dy1, dy2 = (np.asarray(d, np.float64) for d in jax.jit(jax.grad(summed))(eps))
    _, (x1, h1) = _tied_loss(params, (x, t))
    rows = np.concatenate([np.asarray(x1), np.tanh(np.asarray(h1))], 0)
    rows = np.concatenate([rows, np.ones((10, 1))], 1)
    np.testing.assert_allclose(a, rows.T @ rows / 10, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(g, (dy1.T @ dy1 + dy2.T @ dy2) / 5, rtol=1e-4, atol=1e-6)
