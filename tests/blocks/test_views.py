"""`kfacx.blocks.ViewBlock` against its inner block on the fused parameters (float64).

A dense layer whose weight is ``concatenate([w_a, w_b], 1)`` (per-gate leaves) and
whose bias is ``concatenate([b_a, b_b])``, or whose weight stacks ``[w_x; w_h]`` along
its input axis, is estimated from the same data as the layer written with one fused
weight: the dense matrix is the fused one permuted onto the leaves, the products are
the fused ones split back, whatever the inner block.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kfacx import blocks, tags
from kfacx._helpers import _views

N, DX, DH, G = 5, 3, 2, 2
DAMPING = 0.3
GATE_VIEWS = (
    ("concat", 1, (("leaf", 0), ("leaf", 1))),
    ("concat", 0, (("leaf", 2), ("leaf", 3))),
)
INPUT_VIEWS = (("concat", 0, (("leaf", 1), ("reshape", (DH, 2 * G), ("leaf", 0)))),)


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


def _layer(shapes, views, d_in, d_out) -> blocks.LayerInfo:
    meta = tags.dense_meta((N, d_in), (d_in, d_out))
    return blocks.LayerInfo(
        tag_name="dense_tag",
        parameter_paths=tuple(f"p{i}" for i in range(len(shapes))),
        parameter_shapes=tuple(shapes),
        parameter_dtypes=(jnp.float64,) * len(shapes),
        input_shapes=((N, d_in),),
        output_shapes=((N, d_out),),
        meta={**meta, _views.VIEWS: views},
        compute=tags.dense.compute,
    )


#: name -> (leaf shapes, views, d_in, d_out): per-gate weights and biases concatenated
#: along the output axis; [w_x; w_h] along the input axis (w_h stored flat, reshaped).
CASES = {
    "gates": (((DX, G), (DX, G), (G,), (G,)), GATE_VIEWS, DX, 2 * G),
    "inputs": (((DH * 2 * G,), (DX, 2 * G)), INPUT_VIEWS, DX + DH, 2 * G),
}
INNER = {"kf": blocks.DenseTwoKroneckerFactored, "full": blocks.Full}


def _random(shape, seed):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape))


@functools.cache
def run(case: str, inner: str):
    """The view block's and the inner block's (on gathered parameters) dense matrices and
    products at powers 1 and -1 of one vector, from the same two updates."""
    shapes, views, d_in, d_out = CASES[case]
    layer = _layer(shapes, views, d_in, d_out)
    block = blocks.ViewBlock(layer, INNER[inner])
    fused = INNER[inner](blocks.effective_layer(layer))
    params = tuple(_random(s, i) for i, s in enumerate(shapes))
    vector = tuple(_random(s, 10 + i) for i, s in enumerate(shapes))
    data = dict(inputs=(_random((N, d_in), 20),), outputs_tangent=(_random((2, N, d_out), 21),))

    def go(b, params, vector):
        d = dict(data, params=params)
        state = b.init(jax.random.PRNGKey(0), approx_powers_to_cache=(-1.0,))
        state = b.update_curvature_matrix_estimate(state, d, 0.0, 1.0, N)
        state = b.update_curvature_matrix_estimate(state, d, 0.5, 0.5, N)
        state = b.update_cache(state, DAMPING)
        products = [b.multiply(state, vector, DAMPING)]
        products.append(b.multiply_inverse(state, vector, DAMPING, exact_power=True))
        products.append(b.multiply_inverse(state, vector, DAMPING, use_cached=True))
        return b.to_dense_matrix(state), products

    gather = functools.partial(_views.effective, views=views)
    mine = jax.jit(functools.partial(go, block))(params, vector)
    theirs = jax.jit(functools.partial(go, fused))(gather(params), gather(vector))
    return block, mine, theirs, views, shapes


@pytest.mark.parametrize("case, inner", [("gates", "kf"), ("gates", "full"), ("inputs", "kf")])
def test_view_block_is_the_fused_block_permuted(case, inner):
    block, (dense, products), (fused_dense, fused_products), views, shapes = run(case, inner)
    perm = _views.positions(views, shapes)
    np.testing.assert_allclose(dense[np.ix_(perm, perm)], fused_dense, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dense, dense.T, atol=1e-12)
    for got, want in zip(products, fused_products, strict=True):
        assert [g.shape for g in got] == [tuple(s) for s in shapes]
        for a, b in zip(_views.effective(got, views), want, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)
    assert block.block_name == f"ViewBlock({INNER[inner].__name__})"
    assert block.factor_shapes() == block.inner.factor_shapes()


def test_view_block_checks_its_views():
    shapes, views, d_in, d_out = CASES["gates"]
    layer = _layer(shapes, views, d_in, d_out)
    plain = dataclasses.replace(layer, meta=_views.without_views(layer.meta))
    with pytest.raises(ValueError, match="has no 'param_views'"):
        blocks.ViewBlock(plain, blocks.DenseTwoKroneckerFactored)
    twice = (("concat", 1, (("leaf", 0), ("leaf", 0))), ("leaf", 2))
    bad = dataclasses.replace(layer, meta={**layer.meta, _views.VIEWS: twice})
    with pytest.raises(ValueError, match="exactly once"):
        blocks.ViewBlock(bad, blocks.DenseTwoKroneckerFactored)
    assert blocks.view_ctor(plain, blocks.Full) is blocks.Full
    block = blocks.layer_block(layer, {"dense_tag": blocks.Full})
    assert isinstance(block, blocks.ViewBlock) and isinstance(block.inner, blocks.Full)
    assert block.inner.layer.parameter_paths == ("concat[1](p0, p1)", "concat[0](p2, p3)")
    assert block.inner.parameters_shapes == ((DX, 2 * G), (2 * G,))


def test_stacked_layer_of_views_is_a_stacked_block_of_view_blocks():
    shapes, views, d_in, d_out = CASES["gates"]
    layer = _layer(shapes, views, d_in, d_out)
    stack = 3
    stacked = dataclasses.replace(
        layer,
        parameter_shapes=tuple((stack, *s) for s in shapes),
        input_shapes=((stack, N, d_in),),
        output_shapes=((stack, N, d_out),),
        stack_size=stack,
    )
    block = blocks.layer_block(stacked, {"dense_tag": blocks.DenseTwoKroneckerFactored})
    assert block.block_name == "StackedBlock(ViewBlock(DenseTwoKroneckerFactored))"
    vector = tuple(_random((stack, *s), i) for i, s in enumerate(shapes))
    state = block.init(jax.random.PRNGKey(0))
    out = block.multiply(state, vector, DAMPING)  # zero factors: the damping only
    for a, b in zip(out, vector, strict=True):
        np.testing.assert_allclose(a, DAMPING * b, rtol=1e-12)


# ----------------------------------------------------------------------------- SlicedBlock


def _sliced_layer(boxes):
    """A sliced layer over one weight ``w [DX, 2G]``: a dense role per column box."""
    roles = []
    for start, stop in boxes:
        view = (("slice", (0, start), (DX, stop), ("leaf", 0)),)
        role = _layer([(DX, 2 * G)], view, DX, stop - start)
        roles.append(role)
    return blocks.LayerInfo(
        tag_name=blocks.SLICED_TAG,
        parameter_paths=("w",),
        parameter_shapes=((DX, 2 * G),),
        parameter_dtypes=(jnp.float64,),
        roles=tuple(roles),
        role_params=((0,),) * len(roles),
    )


def test_sliced_block_is_block_diagonal_over_the_slices():
    layer = _sliced_layer([(0, G), (G, 2 * G)])
    block = blocks.layer_block(layer, {"dense_tag": blocks.Full})
    assert block.block_name == "SlicedBlock(Full, Full)"
    data = [
        dict(
            inputs=(_random((N, DX), 30 + r),),
            outputs_tangent=(_random((1, N, G), 40 + r),),
            params=(_random((DX, 2 * G), 50),),
        )
        for r in range(2)
    ]
    v = (_random((DX, 2 * G), 60),)

    @jax.jit
    def run(data, v):
        state = block.init(jax.random.PRNGKey(0))
        state = block.update_curvature_matrix_estimate(state, dict(roles=data), 0.0, 1.0, N)
        inverse = block.multiply_inverse(state, v, DAMPING, exact_power=True)
        return block.to_dense_matrix(state), inverse

    dense, (got,) = run(tuple(data), v)
    dense = np.asarray(dense)
    # Entries of different column slices never meet: w is row-major [DX, 2G].
    col = np.tile(np.arange(2 * G), DX) // G
    assert not dense[np.ix_(col == 0, col == 1)].any() and dense[np.ix_(col == 0, col == 0)].any()
    want = np.linalg.solve(dense + DAMPING * np.eye(len(dense)), np.ravel(v[0]))
    np.testing.assert_allclose(np.ravel(got), want, rtol=1e-10)


@pytest.mark.parametrize(
    "boxes, why", [([(0, G), (G - 1, 2 * G)], "exactly once"), ([(0, G)], "exactly once")]
)
def test_sliced_block_needs_disjoint_slices_covering_the_parameters(boxes, why):
    with pytest.raises(ValueError, match=why):
        blocks.SlicedBlock(_sliced_layer(boxes), lambda role: blocks.Full)
