"""`kfacx.blocks.MappedBlock` (through `kfacx.blocks.ViewBlock`) against its inner block on
the effective parameters ``w = f(theta)`` (float64).

A layer computing with an elementwise map of its leaves (``softplus(s)``, ``-0.5 * w``,
``w * mask``, ``exp(w)``) is estimated from the same data as the layer written with
``w`` as its leaf (the inner block): its matrix is ``D C D`` with ``D = diag(f'(theta))``
at the last update's parameters, its product exact, and its damped inverse exact for a
diagonal inner block and a constant ``d``, and otherwise the documented
``S (C + l/m I)^-1 S + Z``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kfacx import blocks, tags
from kfacx._helpers import _elementwise, _views

N, DX, DO = 5, 3, 2
DAMPING = 0.3
MASK = np.array([[1.0, 0.0], [1.0, 1.0], [0.0, 1.0]])


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


def _random(shape, seed):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape))


def _dense_layer(shapes, views) -> blocks.LayerInfo:
    return blocks.LayerInfo(
        tag_name="dense_tag",
        parameter_paths=tuple(f"p{i}" for i in range(len(shapes))),
        parameter_shapes=tuple(shapes),
        parameter_dtypes=(jnp.float64,) * len(shapes),
        input_shapes=((N, DX),),
        output_shapes=((N, DO),),
        meta={**tags.dense_meta((N, DX), (DX, DO)), _views.VIEWS: views},
        compute=tags.dense.compute,
    )


def _scale_layer(views) -> blocks.LayerInfo:
    return blocks.LayerInfo(
        tag_name="scale_and_shift_tag",
        parameter_paths=("s",),
        parameter_shapes=((DX,),),
        parameter_dtypes=(jnp.float64,),
        input_shapes=((N, DX),),
        output_shapes=((N, DX),),
        meta=dict(has_scale=True, has_shift=False, **{_views.VIEWS: views}),
        compute=tags.scale_and_shift.compute,
    )


def _map(name, args, e):
    return ("map", name, args, e)


#: name -> (layer, inner block class, d is one constant, f'(theta) of the leaves).
CASES = {
    "softplus_scale": (
        _scale_layer((_map("softplus", (), ("leaf", 0)),)),
        blocks.ScaleAndShiftDiagonal,
        False,
        lambda p: (jax.nn.sigmoid(p[0]),),
    ),
    "negative_constant": (
        _dense_layer([(DX, DO)], (_map("mul", (-0.5,), ("leaf", 0)),)),
        blocks.DenseTwoKroneckerFactored,
        True,
        lambda p: (jnp.full(p[0].shape, -0.5),),
    ),
    "mask": (
        _dense_layer(
            [(DX, DO), (DO,)],
            (_map("mul", (_elementwise.Const(MASK),), ("leaf", 0)), ("leaf", 1)),
        ),
        blocks.DenseTwoKroneckerFactored,
        False,
        lambda p: (jnp.asarray(MASK), jnp.ones(DO)),
    ),
    "exp_weight": (
        _dense_layer([(DX, DO), (DO,)], (_map("exp", (), ("leaf", 0)), ("leaf", 1))),
        blocks.DenseTwoKroneckerFactored,
        False,
        lambda p: (jnp.exp(p[0]), jnp.ones(DO)),
    ),
}


def _flat(arrays):
    return np.concatenate([np.ravel(np.asarray(a)) for a in arrays])


def _scales(d, power):
    """``S = sign(d) |d|^p`` (zero where ``d = 0``) and ``m``, the mean of ``d^2`` where
    ``d != 0``: the documented form's."""
    safe = jnp.where(d != 0, d, 1)
    s = jnp.where(d != 0, jnp.sign(d) * jnp.abs(safe) ** power, 0)
    return s, jnp.sum(d * d) / jnp.sum(d != 0)


@functools.cache
def run(case: str):
    """One program per case: the mapped block's and the inner block's (at ``f(theta_1)``)
    states after two updates, the first at ``theta_0``, the second at ``theta_1``; the
    dense matrices, ``d``, a vector and its products (`_products`)."""
    layer, inner_ctor, _, fprime = CASES[case]
    block = blocks.ViewBlock(layer, inner_ctor)
    ref = inner_ctor(blocks.effective_layer(layer))
    shapes = layer.parameter_shapes
    thetas = [tuple(_random(s, 10 * k + i) for i, s in enumerate(shapes)) for k in range(2)]
    out = layer.output_shapes[0][-1]
    data = [
        dict(inputs=(_random((N, DX), 20 + k),), outputs_tangent=(_random((2, N, out), 30 + k),))
        for k in range(2)
    ]
    vector = tuple(_random(s, 50 + i) for i, s in enumerate(shapes))

    def go(b, params):
        state = b.init(jax.random.PRNGKey(0), approx_powers_to_cache=(-1.0,))
        for k, (ema_old, ema_new) in enumerate([(0.0, 1.0), (0.5, 0.5)]):
            d = dict(data[k], params=params[k])
            state = b.update_curvature_matrix_estimate(state, d, ema_old, ema_new, N)
        return state

    @jax.jit
    def program(thetas, v):
        state = go(block, thetas)
        ref_state = go(ref, [_views.effective(t, block.views) for t in thetas])
        d = blocks.flatten_params(fprime(thetas[1]))
        s, m = _scales(d, -1.0)
        sv = blocks.unflatten_params(s * blocks.flatten_params(v), ref.parameters_shapes)
        cached = block.update_cache(state, DAMPING)
        return dict(
            state=state,
            dense=block.to_dense_matrix(state),
            ref_dense=ref.to_dense_matrix(ref_state),
            d=d,
            product=block.multiply(state, v, DAMPING),
            exact={p: block.multiply_matpower(state, v, DAMPING, p, True) for p in (-1.0, -0.5)},
            factored=block.multiply_inverse(cached, v, DAMPING, use_cached=True),
            inner_factored=ref.multiply_inverse(ref_state, sv, DAMPING / m),
        )

    out = jax.tree_util.tree_map(np.asarray, program(thetas, vector))
    return block, out, vector


@pytest.mark.parametrize("case", sorted(CASES))
def test_matrix_is_d_c_d_at_the_last_update(case):
    block, out, _ = run(case)
    d = out["d"]
    want = d[:, None] * out["ref_dense"] * d[None, :]
    np.testing.assert_allclose(out["dense"], want, rtol=1e-12, atol=1e-12)
    assert block.block_name == f"ViewBlock(MappedBlock({CASES[case][1].__name__}))"


@pytest.mark.parametrize("case", sorted(CASES))
def test_product_is_exact(case):
    _, out, v = run(case)
    dense = out["dense"]
    want = (dense + DAMPING * np.eye(len(dense))) @ _flat(v)
    np.testing.assert_allclose(_flat(out["product"]), want, rtol=1e-11)


def _documented(out, v, power, inner=None):
    """``S (C + l/m I)^p S v + Z v`` (``inner``: the inner block's power of ``S v``)."""
    s, m = (np.asarray(a) for a in _scales(jnp.asarray(out["d"]), power))
    if inner is None:
        c = out["ref_dense"]
        w, q = np.linalg.eigh(c + DAMPING / m * np.eye(len(c)))
        inner = (q * w**power) @ q.T @ (s * _flat(v))
    return s * inner + np.where(out["d"] == 0, DAMPING**power, 0) * _flat(v)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("power", [-1.0, -0.5])
def test_exact_powers(case, power):
    block, out, v = run(case)
    if CASES[case][2] or block.inner.eigenbasis_is_identity:  # (D C D + l I)^p exactly
        dense = out["dense"]
        w, q = np.linalg.eigh(dense + DAMPING * np.eye(len(dense)))
        want = (q * w**power) @ q.T @ _flat(v)
    else:
        want = _documented(out, v, power)
    np.testing.assert_allclose(_flat(out["exact"][power]), want, rtol=1e-10, atol=1e-12)


def test_masked_entries_are_exact():
    # Their rows of D C D are zero: the damped matrix is l I there.
    _, out, v = run("mask")
    masked = out["d"] == 0
    got = _flat(out["exact"][-1.0])[masked]
    np.testing.assert_allclose(got, _flat(v)[masked] / DAMPING, rtol=1e-12)


@pytest.mark.parametrize("case", ["negative_constant", "mask", "exp_weight"])
def test_factored_inverse_is_the_inner_one_at_the_scaled_damping(case):
    _, out, v = run(case)
    inner = _flat(out["inner_factored"])
    got = _flat(out["factored"])
    np.testing.assert_allclose(got, _documented(out, v, -1.0, inner), rtol=1e-10)
    if case == "negative_constant":  # c^-2 (C + l/c^2)^-1, the inner block's own form
        np.testing.assert_allclose(got, inner / -0.5, rtol=1e-12)


def test_diagonal_inner_block_keeps_its_identity_eigenbasis_and_norms():
    block, out, v = run("softplus_scale")
    assert block.inner.eigenbasis_is_identity
    np.testing.assert_allclose(block.to_eigenbasis(out["state"], v), _flat(v))
    trace = np.trace(out["dense"])
    np.testing.assert_allclose(blocks.block_norm(block, out["state"], "trace"), trace)
    kf, kf_out, kf_v = run("exp_weight")
    with pytest.raises(NotImplementedError, match="eigenbasis"):
        kf.to_eigenbasis(kf_out["state"], kf_v)
    fro = np.linalg.norm(kf_out["dense"])
    np.testing.assert_allclose(blocks.block_norm(kf, kf_out["state"], "fro"), fro)


def test_scales_survive_averages_and_are_kept_when_the_layer_did_not_run():
    layer, inner_ctor, _, fprime = CASES["softplus_scale"]
    block = blocks.ViewBlock(layer, inner_ctor)
    theta = (_random((DX,), 1),)
    data = dict(inputs=(_random((N, DX), 2),), outputs_tangent=(_random((1, N, DX), 3),))
    stats = block.compute_statistics(dict(data, params=theta), N)
    state = block.update_from_statistics(block.init(jax.random.PRNGKey(0)), stats, 0.0, 1.0)
    halved = tuple(0.5 * s for s in stats)  # e.g. a coverage of 1/2 before its rescaling
    again = block.update_from_statistics(state, halved, 0.5, 0.5)
    np.testing.assert_allclose(again.cache.scales, _flat(fprime(theta)), rtol=1e-14)
    kept = block.update_from_statistics(state, tuple(0 * s for s in stats), 1.0, 0.0)
    np.testing.assert_allclose(kept.cache.scales, _flat(fprime(theta)), rtol=1e-14)


def test_mapped_block_needs_the_scales():
    layer, inner_ctor, _, _ = CASES["softplus_scale"]
    block = blocks.MappedBlock(blocks.effective_layer(layer), inner_ctor)
    data = dict(inputs=(_random((N, DX), 2),), outputs_tangent=(_random((1, N, DX), 3),))
    with pytest.raises(ValueError, match="params_scales"):
        block.compute_statistics(data, N)
