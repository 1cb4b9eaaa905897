"""`kfacx.BlockDiagonalCurvature` products against dense linear algebra on one fitted
estimate: multiply, exact and approximate (pi-damped) inverses, matrix powers, cached
inverses, jit.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from _estimator_cases import DAMPING, SIZES_2, assert_close, estimate, flat, random_like
from _models import init_mlp, make_batch, make_tagged_mlp

import kfacx

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
