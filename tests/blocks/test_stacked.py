"""`kfacx.blocks.StackedBlock` against its inner block applied slice by slice (float64).

For every kind of inner block, a stacked layer of ``L`` slices is estimated from
stacked data (two moving-average updates), and compared with the inner block
estimated on each slice's data separately: the states, the dense matrix (the
block-diagonal of the slices' dense matrices, permuted to the stacked parameters'
row-major flattening) and the products at powers 1 and -1 (exact and approximate,
cached and fresh). Each case is computed by one jitted program.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _linalg_cases import lapack_batches

from kfacx import blocks
from kfacx.blocks._stacked import DATA_LAYER_AXES

from . import _cases as C

L = 3
DAMPING = 0.3
F64 = jnp.float64
NHWC = ("NHWC", "HWIO", "NHWC")
# (power, exact_power, use_cached)
CONFIGS = [
    (1.0, False, False),
    (-1.0, True, False),
    (-1.0, True, True),
    (-1.0, False, False),
    (-1.0, False, True),
]
EMAS = ((0.0, 1.0), (0.5, 0.5))

CASES = [
    C.dense_case("dense_kf", (4, 3), 2, True),
    C.dense_case(
        "dense_kf_seq_transposed",
        (2, 3, 3),
        None,
        True,
        w_shape=(2, 3),
        dimension_numbers=(((2,), (1,)), ((), ())),
    ),
    C.conv_case(
        "conv2d_kf",
        (2, 4, 4, 2),
        (2, 2, 2, 3),
        True,
        window_strides=(2, 2),
        padding="SAME",
        dimension_numbers=NHWC,
    ),
    C.scale_and_shift_case("ss_diag", (3, 2, 4), (4,), (4,), blocks.ScaleAndShiftDiagonal),
    C.scale_and_shift_case("ss_full", (3, 4), (4,), None, blocks.ScaleAndShiftFull),
    C.dense_case("diag_dense", (4, 3), 2, True, blocks.Diagonal),
    C.dense_case("full_dense", (4, 3), 2, False, blocks.Full),
    C.generic_case("diag_generic", (3, 2), blocks.Diagonal),
]


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


def stacked_layer(case: C.Case) -> blocks.LayerInfo:
    info = case.layer(F64)

    def lead(shapes):
        return tuple((L, *s) for s in shapes)

    return dataclasses.replace(
        info,
        parameter_shapes=lead(info.parameter_shapes),
        input_shapes=lead(info.input_shapes),
        output_shapes=lead(info.output_shapes),
        stack_size=L,
    )


def stack(slices: list[dict]) -> dict:
    """Per-slice estimation data -> stacked data (the layer axis after the samples axis
    for ``outputs_tangent``)."""
    # Stacked on the host: eager jnp.stack compiles a program per shape.
    return {
        key: tuple(
            jnp.asarray(np.stack([np.asarray(a) for a in arrays], axis=DATA_LAYER_AXES[key]))
            for arrays in zip(*(d[key] for d in slices), strict=True)
        )
        for key in slices[0]
    }


def slice_index(shapes, layer: int) -> np.ndarray:
    """Positions of slice ``layer``'s flattened parameters in the flattened stacked ones."""
    offsets = np.cumsum([0] + [math.prod(s) for s in shapes])
    return np.concatenate(
        [
            np.arange(o, o + math.prod(s)).reshape(s)[layer].ravel()
            for o, s in zip(offsets, shapes, strict=False)
        ]
    )


@functools.cache
def results(case: C.Case) -> dict:
    """The stacked block's and the per-slice inner blocks' states, dense matrices and
    products (one jitted program for the stacked block, one for the inner block run on
    each slice)."""
    inner = case.block_cls(case.layer(F64))
    block = blocks.StackedBlock(stacked_layer(case), case.block_cls)
    data = [[case.data(seed=10 * s + i, dtype=F64) for i in range(L)] for s in range(len(EMAS))]
    vectors = [case.vector(seed=i, dtype=F64) for i in range(L)]
    stacked_vector = tuple(jnp.asarray(np.stack(v)) for v in zip(*vectors, strict=True))

    def run(blk, datas, vector):
        state = blk.init(jax.random.key(0), (-1.0,), (-1.0,))
        for (old, new), d in zip(EMAS, datas, strict=True):
            state = blk.update_curvature_matrix_estimate(state, d, old, new, case.batch_size)
        state = blk.update_cache(state, DAMPING)
        products = [blk.multiply_matpower(state, vector, DAMPING, *c) for c in CONFIGS]
        return dict(state=state, dense=blk.to_dense_matrix(state), products=products)

    stacked_data = [stack(d) for d in data]
    out = C.fast_jit(functools.partial(run, block))(stacked_data, stacked_vector)
    # The slices have the same shapes: one compilation, run L times.
    run_inner = C.fast_jit(functools.partial(run, inner))
    out["slices"] = [run_inner([d[i] for d in data], vectors[i]) for i in range(L)]
    return dict(out, block=block, inner=inner, vector=stacked_vector)


def assert_close(got, want, rtol=1e-8):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape
    scale = max(np.abs(want).max(), 1e-300)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * scale)


def _ids(cases):
    return [c.name for c in cases]


@pytest.mark.parametrize("case", CASES, ids=_ids(CASES))
def test_state_is_the_stack_of_slice_states(case):
    r = results(case)
    leaves = jax.tree_util.tree_leaves(r["state"])
    assert leaves and all(leaf.shape[0] == L for leaf in leaves)
    for i, s in enumerate(r["slices"]):
        want = s["state"]
        got = jax.tree_util.tree_map(lambda a, i=i: np.asarray(a)[i], r["state"])
        assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
        for g, w in zip(
            jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True
        ):
            # Eigenvectors are compared through the products and dense matrices.
            if g.ndim < 2 or np.abs(np.asarray(w)).max() == 0 or g.shape[-1] != g.shape[-2]:
                assert_close(g, w)
    factors = [f.value for f in r["state"].factors]
    assert all(np.abs(np.asarray(f)).max() > 0 for f in factors)


@pytest.mark.parametrize("case", CASES, ids=_ids(CASES))
def test_dense_matrix_is_permuted_block_diagonal_of_slices(case):
    r = results(case)
    block = r["block"]
    assert block.parameters_shapes == tuple((L, *s) for s in case.param_shapes)
    want = np.zeros((block.dim, block.dim))
    for i, s in enumerate(r["slices"]):
        index = slice_index(block.parameters_shapes, i)
        want[np.ix_(index, index)] = np.asarray(s["dense"])
    assert_close(r["dense"], want)


@pytest.mark.parametrize("config", CONFIGS, ids=[str(c) for c in CONFIGS])
@pytest.mark.parametrize("case", CASES, ids=_ids(CASES))
def test_products_equal_slice_by_slice(case, config):
    r = results(case)
    k = CONFIGS.index(config)
    got = r["products"][k]
    assert [g.shape for g in got] == [v.shape for v in r["vector"]]
    for i, s in enumerate(r["slices"]):
        for g, w in zip(got, s["products"][k], strict=True):
            assert_close(np.asarray(g)[i], w)
    # Exact powers agree with the dense matrix (the vector and matrix layouts match).
    power, exact, _ = config
    if exact or power == 1 or not issubclass(case.block_cls, blocks.TwoKroneckerFactored):
        dense = np.asarray(r["dense"]) + DAMPING * np.eye(r["block"].dim)
        v = np.asarray(C.flat(r["vector"]))
        want = dense @ v if power == 1 else np.linalg.solve(dense, v)
        assert_close(C.flat(got), want)


def test_requires_a_stacked_layer():
    case = CASES[0]
    with pytest.raises(ValueError, match="not stacked"):
        blocks.StackedBlock(case.layer(F64), case.block_cls)
    with pytest.raises(ValueError, match="not stacked"):
        case.layer(F64).unstacked()
    info = stacked_layer(case)
    assert info.unstacked() == case.layer(F64)


def test_names_and_vector_check():
    r = results(CASES[0])
    block = r["block"]
    assert block.block_name == "StackedBlock(DenseTwoKroneckerFactored)"
    assert repr(block).startswith(f"StackedBlock({L} x DenseTwoKroneckerFactored(")
    assert block.factor_shapes() == ((L, 1, 4, 4), (L, 1, 2, 2))
    with pytest.raises(ValueError, match="expected the parameter shapes"):
        block.multiply(r["state"], tuple(v[0] for v in r["vector"]))


def test_stacked_refresh_and_uncached_products_run_slice_after_slice():
    """The EKFAC inner block refreshes each slice's eigenbases in turn (a loop, not
    `jax.vmap`): vmapped, two stacked layers' refreshes were two batched eigendecompositions
    at once, which hung on a 2-core CPU (`kfacx.linalg._common.one_at_a_time_on_cpu`).
    The result is each slice's own refresh. Products without the cache, which decompose
    the factors themselves, loop over the slices too."""

    case = CASES[0]
    block = blocks.StackedBlock(stacked_layer(case), blocks.DenseEKFAC)
    inner = blocks.DenseEKFAC(case.layer(F64))
    rng = np.random.default_rng(3)
    state = block.init(jax.random.key(0))
    factors = []
    for f in state.factors:
        a = rng.standard_normal((*f.raw_value.shape[:-1], f.raw_value.shape[-1] + 1))
        factors.append(
            f._replace(
                raw_value=jnp.asarray(a @ np.swapaxes(a, -1, -2)), weight=jnp.ones_like(f.weight)
            )
        )
    state = state._replace(factors=type(state.factors)(factors))
    compiled = jax.jit(block.update_cache).lower(state, DAMPING).compile()
    assert set(lapack_batches(compiled.as_text())) == {1}
    # So do the products that decompose the factors themselves (no cache).
    kronecker = blocks.StackedBlock(stacked_layer(case), case.block_cls)
    vector = tuple(jnp.zeros(s, F64) for s in kronecker.layer.parameter_shapes)
    product = jax.jit(
        lambda s, v: kronecker.multiply_matpower(s, v, DAMPING, -1.0, True, use_cached=False)
    )
    text = product.lower(kronecker.init(jax.random.key(0)), vector).compile().as_text()
    assert set(lapack_batches(text)) == {1}
    refreshed = compiled(state, DAMPING)
    for i in range(L):
        one = jax.tree.map(lambda x, i=i: x[i], state)
        want = jax.jit(inner.update_cache)(one, DAMPING)
        got = jax.tree.map(lambda x, i=i: x[i], refreshed)
        jax.tree.map(assert_close, got.cache, want.cache)
