"""Tests of `kfacx.parallel._reductions`: example-weighted means over a device axis."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kfacx.parallel import _reductions


def _pmapped(tree, weights):
    return jax.pmap(lambda t, w: _reductions.weighted_mean(t, w, "d"), axis_name="d")(tree, weights)


def test_weighted_mean_is_the_mean_over_all_examples():
    means = {"a": jnp.array([[1.0, 2.0], [4.0, 8.0]]), "b": jnp.array([3.0, 6.0])}
    weights = jnp.array([1, 3])
    mean, total = _pmapped(means, weights)
    np.testing.assert_allclose(mean["a"][0], (1 * means["a"][0] + 3 * means["a"][1]) / 4)
    np.testing.assert_allclose(mean["b"], [5.25, 5.25])
    np.testing.assert_array_equal(total, [4.0, 4.0])
    assert total.dtype == jnp.float32


def test_no_examples_anywhere_gives_zeros_not_nan():
    mean, total = _pmapped(jnp.array([[1.0], [2.0]]), jnp.zeros((2,)))
    np.testing.assert_array_equal(mean, 0.0)
    np.testing.assert_array_equal(total, 0.0)
