"""`HostedBlock`: kfac-jax's blocks inside kfacx's estimator, against dense references
and against kfacx's own blocks (float64)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kfacx
import kfacx.kfac_jax as kfac_jax
from kfacx.kfac_jax.curvature_blocks import HostedBlock, kfacx_block_ctor

BATCH, D_IN, D_OUT = 7, 4, 3
LAMBDA = 0.3


def _layer(repeats: int | None = None) -> kfacx.LayerInfo:
    lead = (BATCH,) if repeats is None else (BATCH, repeats)
    params = [jnp.zeros((D_IN, D_OUT)), jnp.zeros((D_OUT,))]
    return kfacx.LayerInfo.from_params(
        "dense_tag",
        params,
        input_shapes=(lead + (D_IN,),),
        output_shapes=(lead + (D_OUT,),),
        meta=dict(dimension_numbers=(((len(lead),), (0,)), ((), ()))),
    )


def _data(samples: int = 1, repeats: int | None = None, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    lead = (BATCH,) if repeats is None else (BATCH, repeats)
    x = jnp.asarray(rng.normal(size=lead + (D_IN,)))
    w, b = jnp.asarray(rng.normal(size=(D_IN, D_OUT))), jnp.asarray(rng.normal(size=(D_OUT,)))
    dy = jnp.asarray(rng.normal(size=(samples,) + lead + (D_OUT,)))
    y = x @ w + jnp.broadcast_to(b, lead + (D_OUT,))
    return dict(inputs=(x,), outputs=(y,), params=(w, b), outputs_tangent=(dy,))


def _fold(block, data, vector=None):
    """A fresh state with one batch folded in (``ema_old=0``), its dense matrix, and the
    products of ``vector`` with the damped block and with the cached inverse (one
    compilation instead of one per operation run eagerly)."""

    @jax.jit
    def run(data, vector):
        state = block.init(jax.random.PRNGKey(0), (), (-1.0,), False)
        stats = block.compute_statistics(data, BATCH)
        state = block.update_from_statistics(state, stats, 0.0, 1.0)
        cached = block.update_cache(state, LAMBDA)
        if vector is None:
            return block.to_dense_matrix(state), None, None
        times = block.multiply_matpower(state, vector, LAMBDA, 1)
        inverse = block.multiply_matpower(cached, vector, LAMBDA, -1, False, True)
        return block.to_dense_matrix(state), times, inverse

    return run(data, vector)


def _vector(seed=1):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.normal(size=(D_IN, D_OUT))), jnp.asarray(rng.normal(size=(D_OUT,))))


def _flat(vector):
    return np.concatenate([np.ravel(v) for v in vector])


class PlainSubclass(kfac_jax.DenseTwoKroneckerFactored):
    """A subclass that changes nothing: hosted, it must equal kfacx's own dense block."""


@pytest.mark.parametrize("samples", [1, 3])
def test_hosted_dense_block_matches_the_dense_reference(samples):
    block = HostedBlock(_layer(), PlainSubclass)
    data, v = _data(samples), _vector()
    got_dense, got_times, got_inverse = _fold(block, data, v)
    (x,), (dy,) = data["inputs"], data["outputs_tangent"]
    x1 = np.concatenate([x, np.ones((BATCH, 1))], axis=1)
    a = x1.T @ x1 / BATCH
    g = sum(d.T @ d for d in np.asarray(dy)) / BATCH  # summed over the sampled directions
    dense = np.kron(a, g)
    np.testing.assert_allclose(got_dense, dense, rtol=1e-12)
    np.testing.assert_allclose(_flat(got_times), (dense + LAMBDA * np.eye(len(dense))) @ _flat(v))
    # the cached inverse is kfac-jax's pi-adjusted one: (A + pi s I)^-1 (x) (G + s / pi I)^-1
    pi = np.sqrt((np.trace(a) / a.shape[0]) / (np.trace(g) / g.shape[0]))
    s = np.sqrt(LAMBDA)
    inverse = np.kron(
        np.linalg.inv(a + pi * s * np.eye(len(a))), np.linalg.inv(g + s / pi * np.eye(len(g)))
    )
    np.testing.assert_allclose(_flat(got_inverse), inverse @ _flat(v), rtol=1e-10)


def test_hosted_dense_block_equals_kfacx_block():
    hosted, native = HostedBlock(_layer(), PlainSubclass), kfacx.DenseTwoKroneckerFactored(_layer())
    data, v = _data(samples=2), _vector()
    (dense1, _, inverse1), (dense2, _, inverse2) = _fold(hosted, data, v), _fold(native, data, v)
    np.testing.assert_allclose(dense1, dense2, rtol=1e-12)
    np.testing.assert_allclose(_flat(inverse1), _flat(inverse2), rtol=1e-10)
    # a block used as it is is kfacx's own
    assert kfacx_block_ctor(kfac_jax.DenseTwoKroneckerFactored) is kfacx.DenseTwoKroneckerFactored


def test_padding_mask_zeroes_the_inputs_of_padded_examples():
    block = HostedBlock(_layer(), PlainSubclass)
    data = _data()
    mask = jnp.asarray([1.0] * 5 + [0.0] * 2)
    masked = dict(
        data, mask=mask, outputs_tangent=(data["outputs_tangent"][0] * mask[None, :, None],)
    )
    kept = {k: (v[0][:5],) for k, v in data.items() if k != "params"}
    kept = dict(kept, params=data["params"], outputs_tangent=(data["outputs_tangent"][0][:, :5],))
    got = jax.jit(block.compute_statistics)(masked, jnp.asarray(5.0))
    want = jax.jit(block.compute_statistics, static_argnums=1)(kept, 5)
    want = dict(zip("ag", want, strict=True))
    np.testing.assert_allclose(got[0], want["a"], rtol=1e-12)
    np.testing.assert_allclose(got[1], want["g"], rtol=1e-12)


def test_repeated_dense_block_keeps_its_average_repeats():
    """kfac-jax's RepeatedDenseKroneckerFactored: a third moving average (the positions per
    example) becomes a third kfacx factor, and scales the curvature down by it."""
    repeats = 5
    block = HostedBlock(_layer(repeats), kfac_jax.RepeatedDenseKroneckerFactored)
    assert len(block.factor_shapes()) == 3
    data = _data(repeats=repeats)
    dense, _, _ = _fold(block, data)
    (x,), (dy,) = data["inputs"], data["outputs_tangent"]
    rows = np.concatenate([np.reshape(x, (-1, D_IN)), np.ones((BATCH * repeats, 1))], axis=1)
    a = rows.T @ rows / BATCH
    g = np.reshape(dy, (-1, D_OUT)).T @ np.reshape(dy, (-1, D_OUT)) / BATCH
    np.testing.assert_allclose(dense, np.kron(a, g) / repeats, rtol=1e-12)


def test_two_factor_state_layouts():
    wma = kfac_jax.utils.WeightedMovingAverage.zeros_array
    state = kfac_jax.KroneckerFactored.State(
        cache={}, inputs_factor=wma((2, 2)), outputs_factor=wma((3, 3))
    )
    assert state.factors[0] is state.inputs_factor and state.outputs_factor.shape == (3, 3)
    same = kfac_jax.KroneckerFactored.State(cache={}, factors=(wma((2, 2)), wma((3, 3))))
    assert jax.tree.structure(same) == jax.tree.structure(state)
    with pytest.raises(TypeError, match="not both"):
        kfac_jax.KroneckerFactored.State(cache={}, factors=(), inputs_factor=wma((2, 2)))


def test_moving_average_is_kfacx_average():
    """kfac-jax's average (value, weight) and kfacx's (raw_value = value * weight) agree,
    also for kfac-jax's negative new weight (a sum that leaves the weight alone)."""
    ours = kfac_jax.utils.WeightedMovingAverage.zeros_array((2,))
    theirs = kfacx.blocks.WeightedMovingAverage.zeros((2,), jnp.float64)
    for k, (old, new) in enumerate([(0.0, 1.0), (0.9, 0.1), (0.5, 0.5)]):
        stat = jnp.asarray([1.0 + k, -2.0 * k])
        ours.update(stat, old, new)
        theirs = theirs.update(stat, old, new)
    np.testing.assert_allclose(ours.value, theirs.value, rtol=1e-14)
    np.testing.assert_allclose(ours.raw_value, theirs.raw_value, rtol=1e-14)
    before = ours.weight
    ours.update(jnp.ones(2), 1.0, -0.5)
    assert ours.weight == before


def test_block_needs_kfacx_layer_info():
    with pytest.raises(TypeError, match="layer_tag_to_block_ctor"):
        PlainSubclass("not a layer")


def test_a_fresh_block_instance_refreshes_a_state_it_did_not_make():
    """kfacx's estimator builds new block objects when it traces the function again and
    calls ``init`` on none of them: the cache spec travels in the state. (FermiNet's
    energy run crashed at its first scheduled refresh: the new instance rebuilt a state
    with no cached inverses, and the refresh's ``cond`` branches differed.)"""
    maker, fresh = HostedBlock(_layer(), PlainSubclass), HostedBlock(_layer(), PlainSubclass)
    data, v = _data(), _vector()

    @jax.jit
    def run(data, vector, count):
        state = maker.init(jax.random.PRNGKey(0), (), (-1.0,), False)
        state = fresh.update_from_statistics(state, fresh.compute_statistics(data, BATCH), 0.0, 1.0)
        state = jax.lax.cond(
            count % 2 == 0, lambda s: fresh.update_cache(s, LAMBDA), lambda s: s, state
        )
        return fresh.multiply_matpower(state, vector, LAMBDA, -1, False, True)

    _, _, expected = _fold(HostedBlock(_layer(), PlainSubclass), data, v)
    np.testing.assert_allclose(_flat(run(data, v, 0)), _flat(expected), rtol=1e-10)
