"""`kfac_jax.patches_second_moment` against patches cut out by hand with numpy loops.

The reference pads the input, walks the output positions and takes the window under
each one, so it shares nothing with the library's `conv_general_dilated_patches`.
"""

import itertools

import jax
import numpy as np
import pytest

import kfacx.kfac_jax as kfac_jax

psm = kfac_jax.patches_second_moment


def _reference(x_nhwc, kernel, strides, padding, per_channel, weights):
    """Matrix ``[kh, kw, c, kh, kw, c]`` (or ``[kh, kw, kh, kw, c]`` per channel) and
    vector ``[kh, kw, c]``; ``weights`` is ``[n, oh, ow]`` or None."""
    n, h, w, c = x_nhwc.shape
    if isinstance(padding, str):
        padding = jax.lax.padtype_to_pads((h, w), kernel, strides, padding)
    (t, b), (left, r) = padding
    xp = np.pad(x_nhwc, ((0, 0), (t, b), (left, r), (0, 0)))
    oh = (h + t + b - kernel[0]) // strides[0] + 1
    ow = (w + left + r - kernel[1]) // strides[1] + 1
    size = kernel[0] * kernel[1] * c
    matrix = np.zeros((size, size)) if not per_channel else np.zeros((c, size // c, size // c))
    vector = np.zeros(size)
    for i, j, k in itertools.product(range(n), range(oh), range(ow)):
        y0, x0 = j * strides[0], k * strides[1]
        patch = xp[i, y0 : y0 + kernel[0], x0 : x0 + kernel[1], :]  # [kh, kw, c]
        wt = 1.0 if weights is None else weights[i, j, k]
        vector += wt * patch.reshape(-1)
        if per_channel:
            for ch in range(c):
                p = patch[:, :, ch].reshape(-1)
                matrix[ch] += wt * np.outer(p, p)
        else:
            p = patch.reshape(-1)
            matrix += wt * np.outer(p, p)
    if per_channel:
        matrix = np.moveaxis(matrix, 0, -1).reshape(kernel + kernel + (c,))
    else:
        matrix = matrix.reshape(kernel + (c,) + kernel + (c,))
    return matrix, vector.reshape(kernel + (c,)), oh * ow


@pytest.mark.parametrize(
    "kernel, strides, padding, data_format, per_channel, weighted",
    [
        ((2, 3), (1, 1), "VALID", "NHWC", False, False),
        ((3, 3), (2, 1), "SAME", "NHWC", False, True),
        ((2, 2), (1, 3), ((0, 1), (2, 3)), "NHWC", True, True),
        ((3, 2), (2, 2), "SAME", "NCHW", False, True),
        ((2, 2), (1, 1), "VALID", "NCHW", True, False),
    ],
)
@pytest.mark.parametrize("explicit", [False, True])
def test_patches_moments_match_hand_cut_patches(
    kernel, strides, padding, data_format, per_channel, weighted, explicit
):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 6, 7, 3))
    want_matrix, want_vector, locations = _reference(x, kernel, strides, padding, per_channel, None)
    out_hw = None
    weights = None
    if weighted:
        pads = padding
        if isinstance(pads, str):
            pads = jax.lax.padtype_to_pads((6, 7), kernel, strides, pads)
        out_hw = tuple(
            (d + lo + hi - k) // s + 1
            for d, k, s, (lo, hi) in zip((6, 7), kernel, strides, pads, strict=True)
        )
        weights = 1.0 + rng.uniform(size=(2, *out_hw))
        want_matrix, want_vector, _ = _reference(x, kernel, strides, padding, per_channel, weights)
    assert psm.num_conv_locations((6, 7), kernel, strides, padding) == locations
    inputs = x if data_format == "NHWC" else np.transpose(x, (0, 3, 1, 2))
    fn = psm.patches_moments_explicit if explicit else psm.patches_moments
    matrix, vector = fn(
        inputs,
        kernel_spatial_shape=kernel,
        strides=strides,
        padding=padding,
        data_format=data_format,
        feature_group_count=3 if per_channel else 1,
        weighting_array=weights,
    )
    np.testing.assert_allclose(matrix, want_matrix, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(vector, want_vector, rtol=1e-10, atol=1e-10)


def test_patches_moments_weights_per_example():
    x = np.random.default_rng(1).normal(size=(3, 4, 4, 2))
    per_example = np.array([1.0, 2.0, 0.5])
    matrix, vector = psm.patches_moments(x, 2, weighting_array=per_example)
    full = np.broadcast_to(per_example[:, None, None], (3, 3, 3))
    want_matrix, want_vector, _ = _reference(x, (2, 2), (1, 1), "VALID", False, full)
    np.testing.assert_allclose(matrix, want_matrix, rtol=1e-10)
    np.testing.assert_allclose(vector, want_vector, rtol=1e-10)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(feature_group_count=2), "feature_group_count=2"),
        (dict(batch_group_count=2), "batch_group_count=2"),
        (dict(weighting_array=np.ones((2, 3, 3, 3))), "channel axis must be 1"),
        (dict(weighting_array=np.ones((2, 3))), "does not fit"),
        (dict(padding="FULL"), "padding='FULL'"),
        (dict(strides=(1, 1, 1)), "strides=.* 3 entries"),
    ],
)
def test_patches_moments_errors_name_the_argument(kwargs, match):
    x = np.ones((2, 4, 4, 3))
    with pytest.raises(ValueError, match=match):
        psm.patches_moments_explicit(x, (2, 2), **kwargs)
