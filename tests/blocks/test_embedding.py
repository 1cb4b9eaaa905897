"""The embedding block: diagonal input factor, exact against dense references."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kfacx
from kfacx import blocks, tags

VOCAB, WIDTH = 6, 3


def _fitted(ids, dy, batch_size, **init_kwargs):
    layer = blocks.LayerInfo.from_params(
        "embedding_tag", [jnp.zeros((VOCAB, WIDTH))], compute=tags.embedding.compute
    )
    block = blocks.EmbeddingKroneckerFactored(layer)
    data = dict(
        inputs=(ids,), outputs=(), params=(jnp.zeros((VOCAB, WIDTH)),), outputs_tangent=(dy,)
    )
    state = block.init(jax.random.PRNGKey(0), **init_kwargs)
    state = block.update_curvature_matrix_estimate(state, data, 0.0, 1.0, batch_size)
    return block, state, data


def _data(batch=4, positions=2, samples=2, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, VOCAB - 1, (batch, positions)).astype(np.int32)  # last id unused
    dy = rng.standard_normal((samples, batch, positions, WIDTH)).astype(np.float32)
    return jnp.asarray(ids), jnp.asarray(dy)


def test_factors_are_id_frequencies_and_output_second_moment():
    ids, dy = _data()
    block, state, _ = _fitted(ids, dy, batch_size=4)
    a, g = (np.asarray(f.value) for f in state.factors)
    counts = np.bincount(np.asarray(ids).ravel(), minlength=VOCAB)
    np.testing.assert_allclose(a, counts / ids.size, rtol=1e-6)
    rows = np.asarray(dy).reshape(-1, WIDTH)
    np.testing.assert_allclose(g, rows.T @ rows / 4, rtol=1e-5)
    assert a[-1] == 0.0  # an id that never occurs has a zero diagonal entry
    dense = np.asarray(block.to_dense_matrix(state))
    np.testing.assert_allclose(dense, np.kron(np.diag(a), g), rtol=1e-6)


def test_single_lookup_block_equals_per_example_outer_product():
    """One example, one position, one sample: K-FAC is exact (equals the Full block)."""
    ids, dy = _data(batch=1, positions=1, samples=1)
    block, state, data = _fitted(ids, dy, batch_size=1)
    full = blocks.Full(block.layer)
    full_state = full.update_curvature_matrix_estimate(
        full.init(jax.random.PRNGKey(0)), data, 0.0, 1.0, 1
    )
    np.testing.assert_allclose(
        block.to_dense_matrix(state), full.to_dense_matrix(full_state), atol=1e-6
    )


def _dense_power(matrix, damping, power):
    vals, vecs = np.linalg.eigh(np.asarray(matrix, np.float64))
    vals = np.maximum(vals, 0.0) + damping
    return (vecs * vals**power) @ vecs.T


@pytest.mark.parametrize("power", [1, -1, -0.5])
@pytest.mark.parametrize("use_cached", [False, True])
def test_exact_powers_match_dense_matrix(power, use_cached):
    ids, dy = _data(seed=1)
    block, state, _ = _fitted(ids, dy, 4, exact_powers_to_cache=(-1, -0.5))
    state = block.update_cache(state, 0.1)
    v = (jnp.asarray(np.random.default_rng(2).standard_normal((VOCAB, WIDTH)), jnp.float32),)
    cached = use_cached and power != 1
    (got,) = block.multiply_matpower(state, v, 0.1, power, exact_power=True, use_cached=cached)
    want = _dense_power(block.to_dense_matrix(state), 0.1, power) @ np.ravel(v[0])
    np.testing.assert_allclose(np.ravel(got), want, rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("power", [-1, -0.5])
@pytest.mark.parametrize("use_cached", [False, True])
def test_approximate_powers_use_pi_damping(power, use_cached):
    ids, dy = _data(seed=3)
    block, state, _ = _fitted(ids, dy, 4, approx_powers_to_cache=(-1, -0.5))
    state = block.update_cache(state, 0.1)
    a, g = (np.asarray(f.value, np.float64) for f in state.factors)
    pi = np.sqrt((a.sum() / VOCAB) / (np.trace(g) / WIDTH))
    a_part = np.diag((a + pi * np.sqrt(0.1)) ** power)
    g_part = _dense_power(g, np.sqrt(0.1) / pi, power)
    v = (jnp.asarray(np.random.default_rng(4).standard_normal((VOCAB, WIDTH)), jnp.float32),)
    (got,) = block.multiply_matpower(state, v, 0.1, power, use_cached=use_cached)
    np.testing.assert_allclose(
        np.asarray(got), a_part @ np.asarray(v[0]) @ g_part, rtol=2e-4, atol=2e-5
    )


def test_errors():
    ids, dy = _data()
    block, state, _ = _fitted(ids, dy, 4)
    with pytest.raises(ValueError, match="exact_powers_to_cache"):
        block.multiply_matpower(state, (jnp.zeros((VOCAB, WIDTH)),), 0.1, -1, True, True)
    with pytest.raises(ValueError, match="power -2"):
        block.multiply_matpower(state, (jnp.zeros((VOCAB, WIDTH)),), 0.1, -2)
    with pytest.raises(ValueError, match="vocab, dim"):
        blocks.EmbeddingKroneckerFactored(
            blocks.LayerInfo.from_params("embedding_tag", [jnp.zeros(3)])
        )
    table = jnp.zeros((VOCAB, WIDTH))
    with pytest.raises(TypeError, match="ids must be integers"):
        kfacx.register_embedding(jnp.zeros((2, WIDTH)), jnp.zeros((2,)), table)
    with pytest.raises(ValueError, match="register_embedding: y has shape"):
        kfacx.register_embedding(jnp.zeros((2, 5)), jnp.zeros((2,), jnp.int32), table)
