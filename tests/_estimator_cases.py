"""Helpers of the `kfacx.BlockDiagonalCurvature` tests (tests/estimator/test_estimator*.py):
model sizes, closeness checks, one estimator update to a dense matrix, flattening.
"""

from __future__ import annotations

import jax
import numpy as np
from _models import block_mask, normal
from jax.flatten_util import ravel_pytree

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


DAMPING = 0.1
