"""Shared property tests of all curvature blocks (see tests/blocks/test_blocks.py): the
error messages of wrong vectors, unsupported powers, missing caches, bad parameters and
missing metadata.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kfacx import blocks, tags

from ._block_table import CACHED_CASES, CASES, CONV, KF, KRONECKER_CASES, _ids

# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize("case", CASES, ids=_ids(CASES))
def test_wrong_vector_shapes(case):
    block, state, _ = case.fitted()
    v = case.vector()
    v = tuple(np.asarray(x) for x in v)  # Only shapes matter (and numpy needs no compiles).
    bad = [
        v[:-1] if len(v) > 1 else v + (np.zeros(3),),  # Wrong number of arrays.
        (np.zeros(v[0].shape + (1,)),) + v[1:],  # Extra axis.
        (v[0].reshape(-1)[:-1],) + v[1:],  # Wrong size.
        list(v[:-1]) + [v[-1][..., None]],  # Last array wrong.
    ]
    if v[0].shape[::-1] != v[0].shape:
        bad.append((np.zeros(v[0].shape[::-1]),) + v[1:])  # Permuted axes.
    for vector in bad:
        with pytest.raises(ValueError, match="vector has shapes"):
            block.multiply_matpower(state, vector, 0.1, -1.0, exact_power=True)
        with pytest.raises(ValueError, match="vector has shapes"):
            block.multiply(state, vector)


@pytest.mark.parametrize("case", KRONECKER_CASES, ids=_ids(KRONECKER_CASES))
def test_kronecker_unsupported_powers(case):
    block, state, _ = case.fitted()
    v = case.vector()
    for power in (-2, 0.5, 2):
        with pytest.raises(ValueError, match=rf"power {float(power)} is not supported with exact"):
            block.multiply_matpower(state, v, 0.1, power, exact_power=False)
    with pytest.raises(ValueError, match="power -2 is not supported in approx_powers_to_cache"):
        block.init(jax.random.key(0), approx_powers_to_cache=(-2,))


@pytest.mark.parametrize("case", CACHED_CASES, ids=_ids(CACHED_CASES))
def test_use_cached_without_cache(case):
    block, state, _ = case.fitted()
    v = case.vector()
    with pytest.raises(ValueError, match="use_cached=True needs an eigendecomposition"):
        block.multiply_matpower(state, v, 0.1, -1.0, exact_power=True, use_cached=True)
    if case.is_kronecker:
        with pytest.raises(ValueError, match=r"use_cached=True needs the power -1\.0"):
            block.multiply_matpower(state, v, 0.1, -1.0, exact_power=False, use_cached=True)
        # Only the -1 approximation is cached: -0.5 is missing.
        block, state, _ = case.fitted(approx_powers_to_cache=(-1.0,))
        with pytest.raises(ValueError, match=r"use_cached=True needs the power -0\.5"):
            block.multiply_matpower(state, v, 0.1, -0.5, exact_power=False, use_cached=True)


def test_dense_kronecker_rejects_bad_parameters():
    dnums = (((1,), (0,)), ((), ()))
    for params, meta in [
        ((jnp.zeros(4),), {}),  # 1-D weight.
        ((jnp.zeros((4, 3)), jnp.zeros((4,))), {}),  # Bias of the wrong size.
        ((jnp.zeros((4, 3)), jnp.zeros((3, 1))), {}),  # Bias of the wrong layout.
        ((jnp.zeros((4, 2, 3)), jnp.zeros((3,))), {}),  # Bias without all output axes.
        ((jnp.zeros((4, 3)),), {"dimension_numbers": (((1, 2), (0, 1)), ((), ()))}),  # No output.
        ((jnp.zeros((4, 3)), jnp.zeros((4,))), {"dimension_numbers": dnums}),
    ]:
        with pytest.raises(ValueError, match=r"expected parameters \(w\) or \(w, b\)"):
            KF(blocks.LayerInfo.from_params("dense_tag", params, meta=meta))


def test_dense_kronecker_accepts_row_vector_bias():
    """A ``[1, d_out]`` bias (leading axes of size 1) is the same bias row."""
    w, b = jnp.arange(12.0).reshape(4, 3), jnp.arange(3.0).reshape(1, 3)
    block = KF(blocks.LayerInfo.from_params("dense_tag", (w, b)))
    m = block.params_to_matrix((w, b))
    np.testing.assert_array_equal(m[0, 4], b[0])
    for p, q in zip(block.matrix_to_params(m), (w, b), strict=True):
        np.testing.assert_array_equal(p, q)


def test_dense_kronecker_multi_axis_weight_layout():
    """A 3-D weight (default contraction: its first axis) is a [d_in, h * k] matrix; its
    bias is an extra row; the round trip through the matrix layout is exact."""
    w, b = jnp.arange(24.0).reshape(4, 2, 3), jnp.arange(6.0).reshape(2, 3) + 100
    block = KF(blocks.LayerInfo.from_params("dense_tag", (w, b)))
    assert (block.input_size, block.output_size) == (5, 6)
    m = block.params_to_matrix((w, b))
    np.testing.assert_array_equal(m[0, :4], w.reshape(4, 6))
    np.testing.assert_array_equal(m[0, 4], b.reshape(6))
    for p, q in zip(block.matrix_to_params(m), (w, b), strict=True):
        np.testing.assert_array_equal(p, q)


def test_conv_kronecker_requires_metadata():
    layer = blocks.LayerInfo.from_params(
        "conv_tag", (jnp.zeros((4, 3, 2, 2)),), compute=tags.conv.compute
    )
    with pytest.raises(
        ValueError, match=r"no \['dimension_numbers', 'padding', 'window_strides'\]"
    ):
        CONV(layer)


def test_conv_kronecker_rejects_indivisible_groups():
    meta = tags.conv_meta((2, 4, 5, 5), (6, 2, 2, 2), feature_group_count=2)
    meta["feature_group_count"] = 4
    layer = blocks.LayerInfo.from_params("conv_tag", (jnp.zeros((6, 2, 2, 2)),), meta=meta)
    with pytest.raises(ValueError, match="not divisible"):
        CONV(layer)


@pytest.mark.parametrize("cls", [blocks.ScaleAndShiftDiagonal, blocks.ScaleAndShiftFull])
def test_scale_and_shift_requires_metadata(cls):
    params = (jnp.zeros(4), jnp.zeros(4))
    for meta in ({}, {"has_shift": True}, {"has_scale": True}):
        with pytest.raises(ValueError, match="has_scale/has_shift metadata"):
            cls(blocks.LayerInfo.from_params("scale_and_shift_tag", params, meta=meta))
    with pytest.raises(ValueError, match="parameter count does not match"):
        cls(
            blocks.LayerInfo.from_params(
                "scale_and_shift_tag", params, meta=dict(has_scale=True, has_shift=False)
            )
        )
