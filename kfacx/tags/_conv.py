"""The convolution layer tag: `jax.lax.conv_general_dilated` plus a bias."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from kfacx.tags._layer_tags import LayerTag, shape_error


def _conv_compute(inputs, params, **meta):
    (x,) = inputs
    w, *b = params
    y = jax.lax.conv_general_dilated(
        x,
        w,
        window_strides=meta["window_strides"],
        padding=meta["padding"],
        lhs_dilation=meta["lhs_dilation"],
        rhs_dilation=meta["rhs_dilation"],
        dimension_numbers=meta["dimension_numbers"],
        feature_group_count=meta["feature_group_count"],
    )
    if b:
        shape = [1] * y.ndim
        shape[meta["dimension_numbers"].out_spec[1]] = -1
        y = y + b[0].reshape(shape)
    return (y,)


conv = LayerTag("conv_tag", num_inputs=1, num_outputs=1, compute=_conv_compute)


def _dilate_dim(size: int, dilation: int) -> int:
    return 0 if size == 0 else 1 + dilation * (size - 1)


def conv_meta(
    x_shape: Sequence[int],
    w_shape: Sequence[int],
    window_strides: Sequence[int] | None = None,
    padding: str | Sequence[tuple[int, int]] = "VALID",
    lhs_dilation: Sequence[int] | None = None,
    rhs_dilation: Sequence[int] | None = None,
    dimension_numbers: Any = None,
    feature_group_count: int = 1,
    batch_group_count: int = 1,
) -> dict[str, Any]:
    """Normalises `jax.lax.conv_general_dilated` arguments to static tag metadata.

    Returns a dict with explicit ``padding`` pairs, tuples for strides and
    dilations, and a `jax.lax.ConvDimensionNumbers` for ``dimension_numbers``.

    Raises:
      ValueError: for ``batch_group_count != 1`` or inconsistent lengths.
    """
    if batch_group_count != 1:
        raise ValueError(
            f"register_conv: batch_group_count={batch_group_count} is not supported "
            "(it appears in weight-gradient convolutions, not in layers)."
        )
    n = len(x_shape) - 2
    if n < 1 or len(w_shape) != n + 2:
        raise ValueError(
            f"register_conv: x has shape {tuple(x_shape)} and w {tuple(w_shape)}; a convolution "
            "needs both of rank n+2 with n >= 1 spatial dimensions."
        )
    dnums = jax.lax.conv_dimension_numbers(tuple(x_shape), tuple(w_shape), dimension_numbers)
    strides = tuple(int(s) for s in (window_strides or (1,) * n))
    lhs_dil = tuple(int(s) for s in (lhs_dilation or (1,) * n))
    rhs_dil = tuple(int(s) for s in (rhs_dilation or (1,) * n))
    for arg, val in (
        ("window_strides", strides),
        ("lhs_dilation", lhs_dil),
        ("rhs_dilation", rhs_dil),
    ):
        if len(val) != n:
            raise ValueError(
                f"register_conv: {arg}={val} must have {n} entries, one per spatial dim."
            )
    if isinstance(padding, str):
        in_spatial = [x_shape[d] for d in dnums.lhs_spec[2:]]
        window = [
            _dilate_dim(w_shape[d], r) for d, r in zip(dnums.rhs_spec[2:], rhs_dil, strict=True)
        ]
        padding = jax.lax.padtype_to_pads(in_spatial, window, strides, padding)
    pads = tuple((int(lo), int(hi)) for lo, hi in padding)
    if len(pads) != n:
        raise ValueError(f"register_conv: padding={pads} must have {n} (low, high) pairs.")
    return dict(
        window_strides=strides,
        padding=pads,
        lhs_dilation=lhs_dil,
        rhs_dilation=rhs_dil,
        dimension_numbers=dnums,
        feature_group_count=int(feature_group_count),
    )


def register_conv(
    y: jax.Array,
    x: jax.Array,
    w: jax.Array,
    b: jax.Array | None = None,
    **conv_params: Any,
) -> jax.Array:
    """Marks a convolution (any number of spatial dimensions) and returns ``y``.

    Args:
      y: the convolution output (plus bias).
      x: the convolution input.
      w: the kernel.
      b: optional bias, one entry per output feature.
      **conv_params: the arguments given to `jax.lax.conv_general_dilated`:
        ``window_strides``, ``padding`` (string or explicit pairs),
        ``lhs_dilation``, ``rhs_dilation``, ``dimension_numbers``,
        ``feature_group_count``.

    Returns:
      ``y``, tagged.

    Raises:
      ValueError: if ``y`` does not have the shape the convolution produces, or
        the parameters are inconsistent.

    Example::

      kw = dict(window_strides=(2, 2), padding="SAME",
                dimension_numbers=("NHWC", "HWIO", "NHWC"))
      y = kfacx.register_conv(jax.lax.conv_general_dilated(x, w, **kw), x, w, **kw)
    """
    meta = conv_meta(x.shape, w.shape, **conv_params)
    expected = jax.eval_shape(lambda x_, w_: _conv_compute((x_,), (w_,), **meta)[0], x, w).shape
    if tuple(y.shape) != tuple(expected):
        raise shape_error(
            "register_conv",
            "y",
            y.shape,
            f"{tuple(expected)}",
            "Pass the convolution's output and the same conv parameters.",
        )
    out_features = w.shape[meta["dimension_numbers"].rhs_spec[0]]
    if b is not None and tuple(b.shape) != (out_features,):
        raise shape_error("register_conv", "b", b.shape, f"({out_features},)", "")
    operands = (y, x, w) if b is None else (y, x, w, b)
    return conv.bind(*operands, **meta)[0]


def register_conv2d(
    y: jax.Array, x: jax.Array, w: jax.Array, b: jax.Array | None = None, **conv_params: Any
) -> jax.Array:
    """`register_conv` for 2-D convolutions (checks that the kernel is 4-D).

    Raises:
      ValueError: if ``w`` is not 4-D, or as `register_conv`.
    """
    if w.ndim != 4:
        raise shape_error(
            "register_conv2d",
            "w",
            w.shape,
            "a 4-D kernel",
            "Use register_conv for 1-D or 3-D convolutions.",
        )
    return register_conv(y, x, w, b, **conv_params)
