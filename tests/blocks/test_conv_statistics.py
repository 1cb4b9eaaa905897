"""Statistics of `ConvTwoKroneckerFactored` against explicitly extracted patches.

The library takes patches from `jax.lax.conv_general_dilated_patches`. The
reference here never calls it: the patch at output position ``t`` is the kernel
gradient of `jax.lax.conv_general_dilated` for a one-hot output cotangent at
``t`` (see `_cases.conv_patches_reference`), mapped to the block's matrix layout
with `params_to_matrix`. The reference factors are
``A[g] = mean over (batch, positions) of [p, 1][p, 1]^T`` and
``G[g] = sum over (samples, batch, positions) of dy dy^T / batch_size``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kfacx import blocks

from . import _cases as C

NHWC = ("NHWC", "HWIO", "NHWC")

CASES = [
    C.conv_case("1d_valid_bias", (2, 3, 7), (4, 3, 3), True),
    C.conv_case(
        "1d_stride2_asymmetric_padding",
        (2, 3, 8),
        (4, 3, 3),
        False,
        window_strides=(2,),
        padding=((2, 1),),
    ),
    C.conv_case(
        "1d_nwc_rhs_dilation",
        (2, 9, 2),
        (3, 2, 4),
        True,
        rhs_dilation=(2,),
        dimension_numbers=("NWC", "WIO", "NWC"),
    ),
    C.conv_case("2d_same_bias", (2, 3, 5, 6), (4, 3, 3, 2), True, padding="SAME"),
    C.conv_case(
        "2d_nhwc_stride_asymmetric_padding",
        (2, 6, 5, 3),
        (3, 2, 3, 4),
        True,
        window_strides=(2, 1),
        padding=((1, 0), (0, 2)),
        dimension_numbers=NHWC,
    ),
    C.conv_case(
        "2d_stride2_same", (2, 2, 6, 5), (3, 2, 3, 3), False, window_strides=(2, 2), padding="SAME"
    ),
    C.conv_case(
        "2d_lhs_dilation_transposed",
        (2, 2, 4, 3),
        (3, 2, 3, 3),
        True,
        lhs_dilation=(2, 2),
        padding=((2, 2), (2, 1)),
    ),
    C.conv_case("2d_rhs_dilation", (2, 2, 7, 6), (3, 2, 2, 2), False, rhs_dilation=(2, 3)),
    C.conv_case(
        "2d_groups2", (2, 4, 5, 5), (6, 2, 2, 2), True, window_strides=(1, 2), feature_group_count=2
    ),
    C.conv_case(
        "2d_depthwise_nhwc",
        (2, 5, 4, 3),
        (2, 2, 1, 6),
        True,
        padding="SAME",
        feature_group_count=3,
        dimension_numbers=NHWC,
    ),
    C.conv_case("2d_depthwise_nchw", (2, 3, 4, 4), (6, 1, 3, 3), False, feature_group_count=3),
    C.conv_case(
        "2d_nhwc_dilations_groups",
        (2, 4, 4, 4),
        (3, 3, 2, 4),
        True,
        lhs_dilation=(2, 1),
        rhs_dilation=(1, 2),
        padding=((1, 1), (2, 0)),
        feature_group_count=2,
        dimension_numbers=NHWC,
    ),
    C.conv_case("3d_valid_bias", (2, 2, 4, 3, 3), (3, 2, 2, 2, 2), True),
    C.conv_case(
        "3d_ndhwc_stride_same",
        (2, 4, 4, 3, 2),
        (2, 2, 2, 2, 3),
        False,
        window_strides=(2, 1, 2),
        padding="SAME",
        dimension_numbers=("NDHWC", "DHWIO", "NDHWC"),
    ),
]
IDS = [c.name for c in CASES]


@functools.cache
def _setup(case):
    """``(block, data, reference rows [rows, groups, n])`` (ones appended for a bias)."""
    block = case.block()
    data = case.data(seed=5)
    rows = C.conv_patches_reference(block, data["inputs"][0])
    if block.has_bias:
        rows = np.concatenate([rows, np.ones(rows.shape[:-1] + (1,))], axis=-1)
    return block, data, rows


@functools.cache
def _statistics(case):
    block, data, _ = _setup(case)
    return C.jit_statistics(block)(data, case.batch_size)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_input_factor_is_patch_second_moment(case):
    block, data, rows = _setup(case)
    a_ref = np.einsum("rgi,rgj->gij", rows, rows) / rows.shape[0]
    a = _statistics(case)[0]
    assert a.shape == (block.num_groups, block.input_size, block.input_size)
    assert a_ref.shape == a.shape
    C.assert_close_rel(a, a_ref, 1e-5, "A")


def test_reference_patches_are_sliding_windows():
    """Sanity check of the reference on a plain 1-D convolution (stride 2, no padding):
    the patch at position t of example b is ``x[b, :, 2t : 2t + k]`` (channel-major)."""
    case = CASES[0]
    x = np.random.default_rng(0).standard_normal((2, 3, 8)).astype(np.float32)
    meta = dict(case.meta, window_strides=(2,))
    block = C.CONV(blocks.LayerInfo.from_params("conv_tag", case.params(), meta=meta))
    rows = C.conv_patches_reference(block, jnp.asarray(x))
    k, positions = 3, (8 - 3) // 2 + 1
    expected = np.stack(
        [x[b, :, 2 * t : 2 * t + k].reshape(-1) for b in range(2) for t in range(positions)]
    )
    np.testing.assert_array_equal(rows[:, 0, :], expected)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_output_factor(case):
    block, data, _ = _setup(case)
    dy = np.asarray(data["outputs_tangent"][0], np.float64)
    channel_axis = case.meta["dimension_numbers"].out_spec[1] + 1  # After the samples axis.
    dy = np.moveaxis(dy, channel_axis, -1)
    groups = case.meta["feature_group_count"]
    dy = dy.reshape(-1, groups, dy.shape[-1] // groups)
    g_ref = np.einsum("rgi,rgj->gij", dy, dy) / case.batch_size
    g = _statistics(case)[1]
    assert g.shape == (block.num_groups, block.output_size, block.output_size)
    C.assert_close_rel(g, g_ref, 1e-5, "G")


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_patches_match_kernel_gradients(case):
    """The library's patch rows are the reference rows, in the same order."""
    block, data, rows = _setup(case)
    patches = jax.jit(block.patches)(data["inputs"][0])
    if block.has_bias:
        rows = rows[..., :-1]
    assert patches.shape == rows.shape
    C.assert_close_rel(patches, rows, 1e-6, "patches")


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_gradient_factorizes_over_patches(case):
    """The weight gradient of one example, in matrix layout, is ``sum_t p_t dy_t^T`` per group:
    the layout of `params_to_matrix` matches the patch features."""
    block, data, rows = _setup(case)
    (x,), params = data["inputs"], data["params"]
    dy = data["outputs_tangent"][0][0]  # One sample.

    @C.fast_jit
    def grads(params):
        _, vjp = jax.vjp(lambda p: case.tag.compute((x,), p, **case.meta)[0], params)
        return block.params_to_matrix(vjp(dy)[0])

    channel_axis = case.meta["dimension_numbers"].out_spec[1]
    dy_rows = np.moveaxis(np.asarray(dy, np.float64), channel_axis, -1)
    dy_rows = dy_rows.reshape(-1, block.num_groups, block.output_size)
    expected = np.einsum("rgi,rgj->gij", rows, dy_rows)
    C.assert_close_rel(grads(params), expected, 1e-5, "gradient")


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_params_matrix_roundtrip(case):
    block = case.block()
    params = case.params(seed=7)
    shape = (block.num_groups, block.input_size, block.output_size)

    @C.fast_jit
    def roundtrips(params, matrix):
        m = block.params_to_matrix(params)
        return m, block.matrix_to_params(m), block.params_to_matrix(block.matrix_to_params(matrix))

    matrix = jnp.asarray(np.random.default_rng(8).standard_normal(shape), jnp.float32)
    m, back, matrix_back = roundtrips(params, matrix)
    assert m.shape == shape
    assert len(back) == len(params)
    for p, q in zip(params, back, strict=True):
        assert q.shape == p.shape
        np.testing.assert_array_equal(q, p)
    np.testing.assert_array_equal(matrix_back, matrix)
    # A permutation (plus the bias row): every parameter appears exactly once.
    flat = blocks.flatten_params(params)
    np.testing.assert_array_equal(np.sort(np.asarray(m).ravel()), np.sort(np.asarray(flat)))
    if block.has_bias:
        # The bias is the last row of every group, in output-feature order.
        np.testing.assert_array_equal(np.asarray(m[:, -1, :]).ravel(), params[1])
