"""The layer tags of `kfacx.tags` on bad input: the register functions' shape, bias
and argument checks, and `tags.LayerTag`'s name and count checks.
"""

from __future__ import annotations

import uuid

import jax
import numpy as np
import pytest

from kfacx import tags

from ._layer_tag_cases import _normal

# ----------------------------------------------------------------------------- errors


def _dense_data():
    rng = np.random.default_rng(0)
    return _normal(rng, 4, 3), _normal(rng, 3, 2), _normal(rng, 2)


def test_register_dense_accepts_multi_axis_weight_and_rejects_batch_dims():
    x, _, _ = _dense_data()
    w = np.ones((3, 2, 2), np.float32)
    y = tags.register_dense(np.ones((4, 2, 2), np.float32), x, w)
    assert y.shape == (4, 2, 2)
    with pytest.raises(ValueError, match=r"register_dense: .*has batch dimensions"):
        tags.register_dense(
            np.ones((4, 2), np.float32), x, w, dimension_numbers=(((1,), (0,)), ((0,), (1,)))
        )


def test_register_dense_rejects_mismatched_x():
    x, _, _ = _dense_data()
    with pytest.raises(
        ValueError,
        match=r"register_dense: cannot contract axes \(1,\) of x \(4, 3\) with axes \(0,\)",
    ):
        tags.register_dense(np.ones((4, 2), np.float32), x, np.ones((5, 2), np.float32))


def test_register_dense_rejects_wrong_y_shape():
    x, w, _ = _dense_data()
    with pytest.raises(
        ValueError, match=r"register_dense: y has shape \(4, 3\), expected \(4, 2\)"
    ):
        tags.register_dense(np.ones((4, 3), np.float32), x, w)


def test_register_dense_rejects_wrong_bias():
    x, w, _ = _dense_data()
    with pytest.raises(ValueError, match=r"register_dense: b has shape \(3,\), expected \(2,\)"):
        tags.register_dense(x @ w, x, w, np.ones((3,), np.float32))
    with pytest.raises(ValueError, match=r"register_dense: b has shape \(2, 2\)"):
        tags.register_dense(x @ w, x, w, np.ones((2, 2), np.float32))
    # Leading axes of size 1 are allowed: a [1, d_out] row is the same bias.
    assert tags.register_dense(x @ w, x, w, np.ones((1, 2), np.float32)).shape == (4, 2)


def _conv_data():
    rng = np.random.default_rng(0)
    x, w = _normal(rng, 2, 3, 6, 6), _normal(rng, 4, 3, 3, 3)
    return x, w, jax.lax.conv_general_dilated(x, w, (1, 1), "VALID")


def test_register_conv_rejects_wrong_y_shape():
    x, w, y = _conv_data()
    with pytest.raises(ValueError, match=r"register_conv: y has shape \(2, 4, 4, 4\), expected"):
        tags.register_conv(y, x, w, padding="VALID", window_strides=(2, 2))


def test_register_conv_rejects_batch_group_count():
    x, w, y = _conv_data()
    with pytest.raises(ValueError, match="batch_group_count=2 is not supported"):
        tags.register_conv(y, x, w, padding="VALID", batch_group_count=2)


@pytest.mark.parametrize("arg", ["window_strides", "lhs_dilation", "rhs_dilation"])
def test_register_conv_rejects_wrong_length_strides(arg):
    x, w, y = _conv_data()
    with pytest.raises(ValueError, match=rf"{arg}=\(1, 1, 1\) must have 2 entries"):
        tags.register_conv(y, x, w, padding="VALID", **{arg: (1, 1, 1)})


def test_register_conv_rejects_wrong_length_padding():
    x, w, y = _conv_data()
    with pytest.raises(ValueError, match=r"padding=\(\(0, 0\),\) must have 2"):
        tags.register_conv(y, x, w, padding=((0, 0),))


def test_register_conv_rejects_wrong_bias_and_rank():
    x, w, y = _conv_data()
    with pytest.raises(ValueError, match=r"register_conv: b has shape \(3,\), expected \(4,\)"):
        tags.register_conv(y, x, w, np.ones((3,), np.float32), padding="VALID")
    with pytest.raises(ValueError, match="needs both of rank n\\+2"):
        tags.register_conv(y, x, w[0], padding="VALID")


def test_register_conv2d_rejects_non_4d_kernel():
    rng = np.random.default_rng(0)
    x, w = _normal(rng, 2, 3, 9), _normal(rng, 4, 3, 3)
    y = jax.lax.conv_general_dilated(x, w, (1,), "VALID")
    with pytest.raises(ValueError, match="register_conv2d: w has shape .* a 4-D kernel"):
        tags.register_conv2d(y, x, w, padding="VALID")


def test_register_scale_and_shift_needs_scale_or_shift():
    x = np.ones((4, 5), np.float32)
    with pytest.raises(ValueError, match="give at least one of scale and shift"):
        tags.register_scale_and_shift(x, x)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(scale_offset=np.float32(1.0)), TypeError, "scale_offset must be a Python number"),
        (dict(scale_offset=True), TypeError, "scale_offset must be a Python number"),
        (dict(scale_offset=float("nan")), ValueError, "scale_offset=nan needs a finite value"),
        (dict(scale_offset=1.0, scale=None), ValueError, "needs a finite value and a scale"),
    ],
)
def test_register_scale_and_shift_rejects_bad_scale_offset(kwargs, error, match):
    x = np.ones((4, 5), np.float32)
    args = {"scale": np.ones((5,), np.float32), "shift": np.ones((5,), np.float32), **kwargs}
    with pytest.raises(error, match=match):
        tags.register_scale_and_shift(x, x, **args)


@pytest.mark.parametrize("what", ["scale", "shift"])
def test_register_scale_and_shift_rejects_batch_axis_in_param(what):
    x = np.ones((4, 5), np.float32)
    p = np.ones((4, 5), np.float32)
    with pytest.raises(ValueError, match=rf"register_scale_and_shift: {what} has shape \(4, 5\)"):
        tags.register_scale_and_shift(x, x, **{what: p})


def test_register_scale_and_shift_rejects_non_broadcasting_param():
    x = np.ones((4, 5), np.float32)
    with pytest.raises(ValueError, match=r"scale has shape \(3,\)"):
        tags.register_scale_and_shift(x, x, scale=np.ones((3,), np.float32))


def test_register_scale_and_shift_rejects_wrong_y_shape():
    x = np.ones((4, 5), np.float32)
    with pytest.raises(ValueError, match=r"y has shape \(4, 1\), expected \(4, 5\)"):
        tags.register_scale_and_shift(x[:, :1], x, scale=np.ones((5,), np.float32))


@pytest.mark.parametrize("name", ["dense_tag", "conv_tag", "scale_and_shift_tag", "generic_tag"])
def test_layer_tag_rejects_existing_name(name):
    with pytest.raises(ValueError, match=f"A layer tag named '{name}' exists already"):
        tags.LayerTag(name, num_inputs=1, num_outputs=1)


def test_layer_tag_rejects_invalid_counts_and_name():
    name = f"bad_tag_{uuid.uuid4().hex}"
    with pytest.raises(ValueError, match="num_inputs must be >= 0"):
        tags.LayerTag(name, num_inputs=-1, num_outputs=1)
    with pytest.raises(ValueError, match="must mark at least one array"):
        tags.LayerTag(name, num_inputs=1, num_outputs=0)
    with pytest.raises(TypeError, match="non-empty string name"):
        tags.LayerTag("", num_inputs=1, num_outputs=1)


def test_bind_with_too_few_operands():
    tag = tags.LayerTag(f"custom_{uuid.uuid4().hex}", num_inputs=1, num_outputs=2)
    with pytest.raises(ValueError, match="needs at least 2 operands, got 1"):
        tag.bind(np.ones(3, np.float32))
