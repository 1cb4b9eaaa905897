"""``kfac_jax.utils``: the helpers behave as kfac-jax's (float64 references)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kfacx.kfac_jax as kfac_jax

utils = kfac_jax.utils


def _psd(n, seed):
    m = np.random.default_rng(seed).normal(size=(n, n + 2))
    return jnp.asarray(m @ m.T / n)


def test_psd_inv():
    a = _psd(4, 0)
    np.testing.assert_allclose(utils.psd_inv(a), np.linalg.inv(a), rtol=1e-9)
    with pytest.raises(ValueError, match="square"):
        utils.psd_inv(jnp.ones((2, 3)))


def test_pi_adjusted_kronecker_inverse_two_factors():
    a, g, d = _psd(3, 1), _psd(2, 2), 0.1
    pi = np.sqrt((np.trace(a) / 3) / (np.trace(g) / 2))
    want = (
        np.linalg.inv(a + pi * np.sqrt(d) * np.eye(3)),
        np.linalg.inv(g + np.sqrt(d) / pi * np.eye(2)),
    )
    got = utils.pi_adjusted_kronecker_inverse(a, g, damping=d)
    np.testing.assert_allclose(np.kron(*got), np.kron(*want), rtol=1e-10)


def test_pi_adjusted_inverse_with_a_scalar_factor_is_exact():
    """A 1x1 factor takes no damping (kfac-jax's rule): the inverse is then exact."""
    a, g, d = _psd(3, 3), jnp.asarray([[2.5]]), 0.2
    got = np.kron(*utils.pi_adjusted_kronecker_inverse(a, g, damping=d))
    np.testing.assert_allclose(got, np.linalg.inv(np.kron(a, g) + d * np.eye(3)), rtol=1e-10)


def test_pi_adjusted_inverse_of_a_zero_factor_is_the_damping():
    got = utils.pi_adjusted_kronecker_inverse(jnp.zeros((2, 2)), _psd(3, 4), damping=0.25)
    np.testing.assert_allclose(np.kron(*got), np.eye(6) / 0.25, rtol=1e-12)


@pytest.mark.parametrize(
    "spec, shape, want",
    [("abc -> (ab)c", (2, 3, 4), (6, 4)), ("a -> 1a", (4,), (1, 4)), ("ab -> ba", (2, 3), (3, 2))],
)
def test_rearrange(spec, shape, want):
    x = jnp.arange(np.prod(shape), dtype=jnp.float64).reshape(shape)
    got = utils.rearrange(x, spec)
    assert got.shape == want
    if spec == "ab -> ba":
        np.testing.assert_array_equal(got, x.T)


def test_kronecker_product_axis_mul_v():
    a, g = _psd(3, 5), _psd(2, 6)
    v = jnp.asarray(np.random.default_rng(7).normal(size=(3, 2)))
    got = utils.kronecker_product_axis_mul_v([a, g], v)
    np.testing.assert_allclose(np.ravel(got), np.kron(a, g) @ np.ravel(v), rtol=1e-12)


def test_pmap_helpers():
    n = jax.local_device_count()
    key = utils.make_different_rng_key_on_all_devices(jax.random.PRNGKey(0))
    keys, subkeys = utils.p_split(key)
    assert jnp.shape(keys)[0] == n and jnp.shape(subkeys)[0] == n
    rep = utils.replicate_all_local_devices({"w": jnp.arange(3.0)})
    assert rep["w"].shape == (n, 3)
    np.testing.assert_array_equal(utils.get_first(rep)["w"], np.arange(3.0))
    assert utils.replicate_all_local_devices({}) == {}

    def f(x):
        inside = utils.pmean_if_pmap(x, "i"), utils.psum_if_pmap(x, "i")
        outside = utils.pmean_if_pmap(x, "other")
        gather = utils.wrap_if_pmap(jax.lax.all_gather)(x, "i")
        return inside, outside, gather, utils.in_pmap("i"), utils.in_pmap(None)

    x = jnp.arange(float(n))
    (mean, total), outside, gather, inside_flag, none_flag = jax.pmap(f, axis_name="i")(x)
    np.testing.assert_allclose(mean, np.full(n, x.mean()))
    np.testing.assert_allclose(total, np.full(n, x.sum()))
    np.testing.assert_allclose(outside, x)
    assert gather.shape == (n, n) and bool(inside_flag[0]) and not bool(none_flag[0])
    assert not utils.in_pmap("i")


def test_broadcast_with_axis_name_takes_arrays_a_pmap_placed():
    """FermiNet's observables: walkers read back from a pmap's output (replicated on that
    pmap's mesh), reshuffled and broadcast with the pmap's axis name, feed the same pmap.
    kfacx's identity pmap (no axis name) refused them: its mesh differs."""
    n = jax.local_device_count()
    f = jax.pmap(lambda a: a * 2 + jax.lax.psum(a, "qmc"), axis_name="qmc")
    pos = f(jnp.ones((n, 5, 3))).reshape(-1, 3)
    idx = np.random.default_rng(0).integers(0, pos.shape[0] - 1, size=n * 5)
    walkers = utils.broadcast_all_local_devices(pos[idx].reshape(n, 5, -1), axis_name="qmc")
    np.testing.assert_array_equal(np.asarray(f(walkers)), np.full((n, 5, 3), (n + 2.0) ** 2))
    moves = utils.replicate_all_local_devices(jnp.asarray([0.1]), axis_name="qmc")
    assert moves.shape == (n, 1)
    np.testing.assert_allclose(np.asarray(jax.pmap(lambda m: m, axis_name="qmc")(moves)), 0.1)
