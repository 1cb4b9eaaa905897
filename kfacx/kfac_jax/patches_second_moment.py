"""``kfac_jax.patches_second_moment``: the second moment of a convolution's input
patches, as a standalone function.

kfacx's convolution blocks (`kfacx.ConvTwoKroneckerFactored`) compute this statistic
themselves; these functions serve code that calls kfac-jax's helpers directly. Both
`patches_moments` and `patches_moments_explicit` extract the patches with
`jax.lax.conv_general_dilated_patches` and contract them in one matrix product, so they
return the same numbers; neither loops over channels.

Layouts follow kfac-jax: for ``kernel_spatial_shape = (kh, kw)`` and ``c`` input
channels the matrix is ``[kh, kw, c, kh, kw, c]`` and the vector ``[kh, kw, c]``; with
``feature_group_count == c`` (a per-channel, depthwise convolution) the matrix is
``[kh, kw, kh, kw, c]``, one patch moment per channel. Sums run over the batch and the
output positions, each position weighted by ``weighting_array`` when it is given.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

_USE_4D_CONVOLUTION = True


def set_use_4d_convolution_in_psm_loop(value: bool) -> None:
    """Kept for kfac-jax's API: kfacx has no per-channel loop, so the flag changes
    nothing."""
    global _USE_4D_CONVOLUTION
    _USE_4D_CONVOLUTION = bool(value)


def get_use_4d_convolution_in_psm_loop() -> bool:
    """The value given to `set_use_4d_convolution_in_psm_loop` (it changes nothing)."""
    return _USE_4D_CONVOLUTION


def _spatial_tuple(value: int | Sequence[int], n: int, name: str) -> tuple[int, ...]:
    if isinstance(value, int):
        return (value,) * n
    value = tuple(int(v) for v in value)
    if len(value) != n:
        raise ValueError(
            f"{name}={value} has {len(value)} entries; the inputs have {n} spatial axes."
        )
    return value


def _padding(padding: Any, n: int) -> str | tuple[tuple[int, int], ...]:
    if isinstance(padding, str):
        if padding.upper() not in ("VALID", "SAME", "SAME_LOWER"):
            raise ValueError(f"padding={padding!r}: use 'VALID', 'SAME' or (low, high) pairs.")
        return padding.upper()
    if isinstance(padding, int):
        return ((padding, padding),) * n
    pairs = tuple((int(lo), int(hi)) for lo, hi in padding)
    if len(pairs) != n:
        raise ValueError(
            f"padding={padding} has {len(pairs)} pairs; the inputs have {n} spatial axes."
        )
    return pairs


def num_conv_locations(
    inputs_spatial_shape: Sequence[int],
    kernel_spatial_shape: int | Sequence[int],
    spatial_strides: int | Sequence[int],
    spatial_padding: str | int | Sequence[tuple[int, int]],
) -> int:
    """The number of output positions of a convolution (per example and channel)."""
    shape = tuple(int(d) for d in inputs_spatial_shape)
    n = len(shape)
    kernel = _spatial_tuple(kernel_spatial_shape, n, "kernel_spatial_shape")
    strides = _spatial_tuple(spatial_strides, n, "spatial_strides")
    padding = _padding(spatial_padding, n)
    if isinstance(padding, str):
        padding = tuple(lax.padtype_to_pads(shape, kernel, strides, padding))
    out = [
        max(0, (d + lo + hi - k) // s + 1)
        for d, k, s, (lo, hi) in zip(shape, kernel, strides, padding, strict=True)
    ]
    return math.prod(out)


def _dimension_numbers(
    ndim: int, data_format: str | None, dim_numbers: Any, shape
) -> lax.ConvDimensionNumbers:
    if dim_numbers is None:
        if data_format is None:
            raise ValueError("Give data_format (e.g. 'NHWC') or dim_numbers.")
        if len(data_format) != ndim or "N" not in data_format or "C" not in data_format:
            raise ValueError(
                f"data_format={data_format!r} does not describe {ndim}-dimensional inputs."
            )
        kernel = data_format.replace("N", "O").replace("C", "I")
        dim_numbers = (data_format, kernel, data_format)
    if isinstance(dim_numbers, lax.ConvDimensionNumbers):
        return dim_numbers
    rhs_shape = (1,) * ndim
    return lax.conv_dimension_numbers(shape, rhs_shape, tuple(dim_numbers))


def _to_rows(x: jax.Array, spec: Sequence[int]) -> jax.Array:
    """``x`` laid out by ``spec`` (batch, feature, *spatial) as ``[positions, feature]``
    (batch-major positions)."""
    x = jnp.transpose(x, (spec[0], *spec[2:], spec[1]))
    return x.reshape(-1, x.shape[-1])


def _weights_as_rows(weights, out_shape, dnums, c: int, per_channel: bool) -> jax.Array:
    """``weights`` (``[n]``, or the output's shape without or with its channel axis) as
    ``[positions, 1 or c, 1]``, in the order of `_to_rows`."""
    w = jnp.asarray(weights)
    batch, feature = dnums.out_spec[:2]
    if w.ndim == 1:
        w = jnp.expand_dims(w, tuple(range(1, len(out_shape))))
        w = jnp.moveaxis(w, 0, batch)
    elif w.ndim == len(out_shape) - 1:
        w = jnp.expand_dims(w, feature)
    elif w.ndim != len(out_shape):
        raise ValueError(
            f"weighting_array of shape {w.shape} does not fit the convolution's output "
            f"({len(out_shape)} axes): give [n], or the output's shape without or with its "
            "channel axis."
        )
    channels = w.shape[feature]
    if channels != 1 and not (per_channel and channels == c):
        raise ValueError(
            f"weighting_array of shape {w.shape}: its channel axis must be 1 (or the {c} "
            f"input channels when feature_group_count == {c})."
        )
    target = list(out_shape)
    target[feature] = channels
    w = jnp.broadcast_to(w, tuple(target))
    return _to_rows(w, dnums.out_spec)[:, :, None]


def patches_moments_explicit(
    inputs: jax.Array,
    kernel_spatial_shape: int | Sequence[int],
    strides: int | Sequence[int] = 1,
    padding: Any = "VALID",
    data_format: str | None = "NHWC",
    dim_numbers: Any = None,
    inputs_dilation: Sequence[int] | None = None,
    kernel_dilation: Sequence[int] | None = None,
    feature_group_count: int = 1,
    batch_group_count: int = 1,
    unroll_loop: bool = False,
    precision: lax.Precision | None = None,
    weighting_array: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Sum over the batch and the output positions of each input patch's outer product
    with itself (the matrix) and of the patch (the vector), weighted per position by
    ``weighting_array`` (broadcast from ``[n]``, the output's shape without its channel
    axis, or the output's shape with a channel axis of 1, or of ``c`` when
    ``feature_group_count == c``). ``unroll_loop`` is accepted and changes nothing."""
    del unroll_loop
    n_spatial = inputs.ndim - 2
    if n_spatial < 1:
        raise ValueError(f"inputs of shape {inputs.shape} have no spatial axis.")
    kernel = _spatial_tuple(kernel_spatial_shape, n_spatial, "kernel_spatial_shape")
    strides = _spatial_tuple(strides, n_spatial, "strides")
    padding = _padding(padding, n_spatial)
    dnums = _dimension_numbers(inputs.ndim, data_format, dim_numbers, inputs.shape)
    c = inputs.shape[dnums.lhs_spec[1]]
    if batch_group_count != 1:
        raise ValueError(f"batch_group_count={batch_group_count}: only 1 is supported.")
    if feature_group_count not in (1, c):
        raise ValueError(
            f"feature_group_count={feature_group_count}: only 1 or the number of input "
            f"channels ({c}) is supported."
        )
    per_channel = feature_group_count != 1
    patches = lax.conv_general_dilated_patches(
        inputs,
        kernel,
        strides,
        padding,
        lhs_dilation=inputs_dilation,
        rhs_dilation=kernel_dilation,
        dimension_numbers=dnums,
        precision=precision,
    )
    # [positions, c, prod(kernel)]: the patch features come channel-major.
    rows = _to_rows(patches, dnums.out_spec).reshape(-1, c, math.prod(kernel))
    weighted = rows
    if weighting_array is not None:
        weighted = rows * _weights_as_rows(weighting_array, patches.shape, dnums, c, per_channel)
    if per_channel:
        matrix = jnp.einsum("mci,mcj->ijc", weighted, rows, precision=precision)
        vector = jnp.sum(weighted, axis=0).T
        return matrix.reshape(kernel + kernel + (c,)), vector.reshape(kernel + (c,))
    # [positions, *kernel, c], flattened: the kfac-jax layout.
    rows = jnp.swapaxes(rows, 1, 2).reshape(rows.shape[0], -1)
    weighted = jnp.swapaxes(weighted, 1, 2).reshape(rows.shape)
    matrix = jnp.einsum("mi,mj->ij", weighted, rows, precision=precision)
    vector = jnp.sum(weighted, axis=0)
    return matrix.reshape(kernel + (c,) + kernel + (c,)), vector.reshape(kernel + (c,))


@functools.partial(
    jax.jit,
    static_argnames=(
        "kernel_spatial_shape",
        "strides",
        "padding",
        "data_format",
        "dim_numbers",
        "inputs_dilation",
        "kernel_dilation",
        "feature_group_count",
        "batch_group_count",
        "unroll_loop",
        "precision",
    ),
)
def _patches_moments_jit(inputs, weighting_array, **kwargs):
    return patches_moments_explicit(inputs, weighting_array=weighting_array, **kwargs)


def _hashable(value: Any) -> Any:
    if isinstance(value, list | tuple) and not isinstance(value, lax.ConvDimensionNumbers):
        return tuple(_hashable(v) for v in value)
    return value


def patches_moments(
    inputs: jax.Array,
    kernel_spatial_shape: int | Sequence[int],
    strides: int | Sequence[int] = 1,
    padding: Any = "VALID",
    data_format: str | None = "NHWC",
    dim_numbers: Any = None,
    inputs_dilation: Sequence[int] | None = None,
    kernel_dilation: Sequence[int] | None = None,
    feature_group_count: int = 1,
    batch_group_count: int = 1,
    unroll_loop: bool = False,
    precision: lax.Precision | None = None,
    weighting_array: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """`patches_moments_explicit`, compiled (the configuration is static)."""
    return _patches_moments_jit(
        inputs,
        weighting_array,
        kernel_spatial_shape=_hashable(kernel_spatial_shape),
        strides=_hashable(strides),
        padding=_hashable(padding),
        data_format=data_format,
        dim_numbers=_hashable(dim_numbers),
        inputs_dilation=_hashable(inputs_dilation),
        kernel_dilation=_hashable(kernel_dilation),
        feature_group_count=feature_group_count,
        batch_group_count=batch_group_count,
        unroll_loop=unroll_loop,
        precision=precision,
    )
