"""`kfacx.scale_by_kfac_eigen_adam` block by block and on a small MLP, in float64: each
block kind's rotation into its eigenbasis and change of basis against a hand
computation, the identity basis before the first refresh, stacked blocks, EKFAC blocks'
own basis, jit against eager.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _eigen_adam_cases import (
    B2,
    COMPILER,
    EPS,
    LR,
    PERIOD,
    STEPS,
    _bases,
    _change,
    _eigenvectors,
    _mlp,
    _mlp_estimator,
    _rotate,
    _t,
    close,
    reference,
    x64,  # noqa: F401  (autouse fixture)
)

import kfacx
from kfacx import blocks
from kfacx.transform._eigen_adam import scale_by_kfac_eigen_adam

# ----------------------------------------------------------------------------- a small MLP


def test_jit_matches_eager():
    params, batch = _mlp()
    est = _mlp_estimator()
    tx = scale_by_kfac_eigen_adam(est, (params, batch), b2=B2, eps=EPS, inverse_update_period=1)
    stats_fn = jax.jit(lambda p, k: est.value_grads_and_curvature_stats(k, (p, batch)))
    update = jax.jit(tx.update)
    eager_state = jit_state = tx.init(params)
    for t in range(2):
        _, grads, stats = stats_fn(params, jax.random.key(t))
        eager, eager_state = tx.update(grads, eager_state, curvature_stats=stats)
        jitted, jit_state = update(grads, jit_state, curvature_stats=stats)
        close(jitted, eager, f"step {t}", 1e-12)


def test_ekfac_blocks_use_their_own_basis():
    """EKFAC's cached basis is the eigenbasis of its K-FAC factors at the refresh: the
    same reference holds, with the statistics taken in the basis of the optax state."""
    params, batch = _mlp()
    est = _mlp_estimator("ekfac")
    tx = scale_by_kfac_eigen_adam(
        est, (params, batch), b2=B2, eps=EPS, inverse_update_period=PERIOD
    )

    @functools.partial(jax.jit, compiler_options=COMPILER)
    def step(params, state, key):
        _, grads, stats = est.value_grads_and_curvature_stats(
            key, (params, batch), estimator_state=kfacx.estimator_state(state)
        )
        updates, state = tx.update(grads, state, curvature_stats=stats)
        return (
            jax.tree_util.tree_map(lambda p, u: p - LR * u, params, updates),
            state,
            grads,
            updates,
        )

    state, steps = tx.init(params), []
    for t in range(STEPS):
        params, state, grads, updates = step(params, state, jax.random.key(t))
        factors = [[np.asarray(f.value) for f in s.factors] for s in state.estimator_state.blocks]
        as_numpy = functools.partial(jax.tree_util.tree_map, np.asarray)
        steps.append(dict(grads=as_numpy(grads), factors=factors, updates=as_numpy(updates)))
        steps[-1]["nu"] = as_numpy(state.nu)
    for index, (w, b) in enumerate([("w1", "b1"), ("w2", "b2")]):

        def layout(g, w=w, b=b):
            return np.concatenate([g[w], g[b][None]])[None]

        bases_of = functools.partial(_bases, "DenseEKFAC")
        for t, (nu, update) in enumerate(reference(layout, bases_of, steps, index, True)):
            close(steps[t]["nu"][index], nu, f"{w} nu, step {t}")
            close(layout(steps[t]["updates"]), update, f"{w} update, step {t}")


# ----------------------------------------------------------------------------- blocks


def _random_psd(rng, shape) -> np.ndarray:
    x = rng.normal(size=(*shape[:-1], 2 * shape[-1] + 1))
    return x @ _t(x) / x.shape[-1]


def _refreshed(block, seed: int):
    """A state whose factors are random PSD matrices (diagonal factors: positive vectors),
    refreshed: its cache holds their eigenbases."""
    rng = np.random.default_rng(seed)
    state = block.init(jax.random.key(0), (), (), True)
    factors = tuple(
        blocks.WeightedMovingAverage(
            jnp.ones_like(f.weight),
            _random_psd(rng, s) if len(s) >= 2 and s[-1] == s[-2] else rng.random(s),
        )
        for f, s in zip(state.factors, block.factor_shapes(), strict=True)
    )
    # one compilation instead of one per operation run eagerly
    return jax.jit(block.update_cache)(state._replace(factors=factors), 1.0)


def _vector(block, seed: int = 7):
    rng = np.random.default_rng(seed)
    return tuple(rng.normal(size=s) for s in block.parameters_shapes)


def _dense_layer():
    return blocks.LayerInfo.from_params(
        "dense_tag", [jnp.zeros((3, 2), jnp.float64), jnp.zeros((2,), jnp.float64)]
    )


def _tied_layer():
    """``w [4, 3]`` used as ``x @ w + b1`` and ``h @ w.T + b2`` (a tied autoencoder)."""

    def role(shapes, dnums):
        return blocks.LayerInfo.from_params(
            "dense_tag",
            [jnp.zeros(s, jnp.float64) for s in shapes],
            meta={"dimension_numbers": (dnums, ((), ()))},
        )

    enc, dec = role([(4, 3), (3,)], ((1,), (0,))), role([(4, 3), (4,)], ((1,), (1,)))
    params = [jnp.zeros(s, jnp.float64) for s in ((4, 3), (3,), (4,))]
    return blocks.LayerInfo.from_params(
        blocks.TIED_TAG, params, roles=(enc, dec), role_params=((0, 1), (0, 2))
    )


def _full_bases(block, state):
    return [(_eigenvectors(np.asarray(state.factors[0].value)), None)]


def _tied_bases(block, state):
    rows, cols = (np.asarray(f) for f in jax.jit(block.fitted_factors)(state))
    b1, b2 = (np.asarray(f) for f in jax.jit(block._bias_factors)(state))
    return [
        (_eigenvectors(rows), _eigenvectors(cols)),
        (_eigenvectors(b1), None),
        (_eigenvectors(b2), None),
    ]


def _kron_bases(block, state):
    return [tuple(_eigenvectors(np.asarray(f.value)) for f in state.factors)]


BLOCKS = {
    "full": (lambda: kfacx.Full(_dense_layer()), _full_bases),
    "tied": (lambda: blocks.TiedKroneckerFactored(_tied_layer()), _tied_bases),
    "dense": (lambda: kfacx.DenseTwoKroneckerFactored(_dense_layer()), _kron_bases),
}


def _as_parts(block, x) -> list:
    """The coordinates (or parameters) as one array per basis of ``*_bases``."""
    if isinstance(block, blocks.TiedKroneckerFactored):
        return list(x)
    if isinstance(block, kfacx.Full):
        return [blocks.flatten_params(x) if isinstance(x, tuple) else x]
    return [block.params_to_matrix(x) if isinstance(x, tuple) else x]


@pytest.mark.parametrize("name", list(BLOCKS))
def test_block_rotation_and_basis_change_by_hand(name):
    """For a full block, a tied weight and a dense block: the coordinates are numpy's
    ``U^T v`` (up to the eigenvectors' signs: compared squared), ``from_eigenbasis``
    inverts ``to_eigenbasis``, and ``eigenbasis_change`` is ``(R o R)`` per side."""
    make, bases_of = BLOCKS[name]
    block = make()
    old, new = _refreshed(block, 1), _refreshed(block, 2)
    v = _vector(block)
    coordinates = jax.jit(block.to_eigenbasis)(new, v)
    parts, bases = _as_parts(block, coordinates), bases_of(block, new)
    for got, x, basis in zip(parts, _as_parts(block, v), bases, strict=True):
        close(np.square(got), np.square(_rotate(np.asarray(x), basis)), f"{name} coordinates")
    close(jax.jit(block.from_eigenbasis)(new, coordinates), v, f"{name} round trip", 1e-12)
    rng = np.random.default_rng(3)
    diagonal = jax.tree_util.tree_map(lambda c: rng.random(c.shape), coordinates)
    changed = _as_parts(block, jax.jit(block.eigenbasis_change)(old, new, diagonal))
    old_bases = bases_of(block, old)
    for got, d, o, n in zip(changed, _as_parts(block, diagonal), old_bases, bases, strict=True):
        close(got, _change(np.asarray(d), o, n), f"{name} basis change")


@pytest.mark.parametrize("name", ["dense", "tied", "full"])
def test_basis_before_the_first_refresh_is_the_identity(name):
    block = BLOCKS[name][0]()
    state = block.init(jax.random.key(0), (), (), True)
    v = _vector(block)
    close(_as_parts(block, block.to_eigenbasis(state, v)), _as_parts(block, v), name, 0.0)


def test_stacked_block_rotates_each_slice_by_its_own_basis():
    layer = blocks.LayerInfo.from_params(
        "dense_tag",
        [jnp.zeros((2, 3, 2), jnp.float64), jnp.zeros((2, 2), jnp.float64)],
        stack_size=2,
    )
    block = blocks.StackedBlock(layer, kfacx.DenseTwoKroneckerFactored)
    state = _refreshed(block, 4)
    v = _vector(block)
    coordinates = np.asarray(jax.jit(block.to_eigenbasis)(state, v))
    for l in range(2):
        a, g = (_eigenvectors(np.asarray(f.value)[l, 0]) for f in state.factors)
        matrix = np.concatenate([v[0][l], v[1][l][None]])
        close(np.square(coordinates[l, 0]), np.square(_rotate(matrix, (a, g))), f"slice {l}")
    close(jax.jit(block.from_eigenbasis)(state, coordinates), v, "round trip", 1e-12)


def test_a_cache_without_eigenbasis_is_an_error():
    block = kfacx.DenseTwoKroneckerFactored(_dense_layer())
    state = block.init(jax.random.key(0), (), (-1,), False)
    with pytest.raises(ValueError, match="cache_eigenvalues=True"):
        block.to_eigenbasis(state, _vector(block))
