"""Layer tags: `LayerTag` and the built-in dense, conv, scale-and-shift and generic tags."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from kfacx.tags._primitive import _IdentityTag

#: Computes a layer's outputs from its inputs and parameters:
#: ``compute(inputs: tuple, params: tuple, **meta) -> outputs: tuple``.
LayerCompute = Callable[..., tuple]

_LAYER_TAGS: dict[Any, LayerTag] = {}


class LayerTag(_IdentityTag):
    """A JAX primitive that marks one layer of a model inside a jaxpr.

    The primitive is bound as ``tag.bind(*outputs, *inputs, *params, **meta)``
    and returns ``outputs`` unchanged (as a list). ``meta`` is static, hashable
    metadata of the layer (e.g. convolution strides). A tagged function
    evaluates, differentiates, jits, vmaps and pmaps exactly like the untagged
    one; the tracer (`kfacx.layer_tags_vjp`) finds the tag and reads the layer's
    inputs, outputs and parameters from it.

    Args:
      name: unique name of the tag; it keys ``layer_tag_to_block_ctor``.
      num_inputs: number of layer inputs among the operands.
      num_outputs: number of layer outputs among the operands (and results).
      compute: optional ``compute(inputs, params, **meta) -> outputs`` that
        recomputes the layer; blocks that need per-example parameter gradients
        (`kfacx.blocks.Diagonal`, `kfacx.blocks.Full`) use it.

    Raises:
      ValueError: if a tag with this name exists already, or counts are invalid.

    Example::

      my_tag = kfacx.tags.LayerTag("my_dense_tag", num_inputs=1, num_outputs=1)
      y, = my_tag.bind(y, x, w)   # returns y unchanged
    """

    def __init__(
        self,
        name: str,
        num_inputs: int,
        num_outputs: int,
        compute: LayerCompute | None = None,
    ):
        if num_inputs < 0:
            raise ValueError(f"LayerTag {name!r}: num_inputs must be >= 0, got {num_inputs}.")
        if any(t.name == name for t in _LAYER_TAGS.values()):
            raise ValueError(
                f"A layer tag named {name!r} exists already; give the new tag a unique name "
                f"(names key `layer_tag_to_block_ctor`)."
            )
        super().__init__(name, num_outputs)
        self._num_inputs = num_inputs
        self._num_outputs = num_outputs
        self.compute = compute
        _LAYER_TAGS[self.primitive] = self

    @property
    def num_inputs(self) -> int:
        """The number of layer inputs among the operands."""
        return self._num_inputs

    @property
    def num_outputs(self) -> int:
        """The number of layer outputs among the operands."""
        return self._num_outputs

    def split(self, operands: Sequence[Any]) -> tuple[tuple, tuple, tuple]:
        """Splits a tag's operands into ``(outputs, inputs, params)``."""
        n_out, n_in = self._num_outputs, self._num_inputs
        operands = tuple(operands)
        return operands[:n_out], operands[n_out : n_out + n_in], operands[n_out + n_in :]


def layer_tag_for(primitive: Any) -> LayerTag | None:
    """Returns the `LayerTag` whose primitive is ``primitive``, or None."""
    return _LAYER_TAGS.get(primitive)


def _shape_error(tag: str, what: str, got: Any, want: str, fix: str) -> ValueError:
    return ValueError(f"{tag}: {what} has shape {tuple(got)}, expected {want}. {fix}")


# ----------------------------------------------------------------------------- dense


def _dense_compute(inputs, params, *, dimension_numbers):
    (x,) = inputs
    w, *b = params
    y = jax.lax.dot_general(x, w, dimension_numbers)
    if not b:
        return (y,)
    bias = b[0]
    if dense_stack_size(dimension_numbers, w.shape):
        # A stacked bias [M, *w_free] broadcasts over x's free axes: [M, 1, ..., *w_free].
        x_free = y.ndim - bias.ndim
        bias = bias.reshape(bias.shape[:1] + (1,) * x_free + bias.shape[1:])
    return (y + jnp.broadcast_to(bias, y.shape),)


dense = LayerTag("dense_tag", num_inputs=1, num_outputs=1, compute=_dense_compute)


def dense_meta(
    x_shape: Sequence[int], w_shape: Sequence[int], dimension_numbers: Any = None
) -> dict[str, Any]:
    """Normalises the contraction of a dense layer to static tag metadata.

    ``dimension_numbers`` is `jax.lax.dot_general`'s
    ``((x_contracting, w_contracting), (x_batch, w_batch))``; the default
    contracts the last axis of ``x`` with the first axis of ``w``. One batch
    dimension, the weight's leading axis (``w_batch == (0,)``), makes a
    *stacked* dense layer: ``M`` weights ``w[m]``, each applied to its slice
    ``x[..., m, ...]`` of the input (ensemble members under `jax.vmap`,
    experts in ``einsum('ebd,edf->ebf')``); the output's leading axis is ``M``.

    Raises:
      ValueError: for other batch dimensions or mismatched contracting axes.
    """
    if dimension_numbers is None:
        dimension_numbers = (((len(x_shape) - 1,), (0,)), ((), ()))
    (lc, rc), (lb, rb) = dimension_numbers
    lc, rc = tuple(int(d) % len(x_shape) for d in lc), tuple(int(d) % len(w_shape) for d in rc)
    lb, rb = tuple(int(d) % len(x_shape) for d in lb), tuple(int(d) % len(w_shape) for d in rb)
    if (lb or rb) and (rb != (0,) or len(lb) != 1 or x_shape[lb[0]] != w_shape[0]):
        raise ValueError(
            f"register_dense: dimension_numbers={dimension_numbers} has batch dimensions other "
            "than one that runs over the weight's leading axis (a stacked dense layer: "
            "(x_batch, w_batch) = ((i,), (0,))). Use a custom tag for other batched weights."
        )
    sizes_x, sizes_w = [x_shape[a] for a in lc], [w_shape[b] for b in rc]
    if not lc or sizes_x != sizes_w:
        raise ValueError(
            f"register_dense: cannot contract axes {lc} of x {tuple(x_shape)} with axes {rc} of "
            f"w {tuple(w_shape)}. The contracted sizes must be equal (default: last axis of x "
            "with first axis of w)."
        )
    if len(rc) + len(rb) == len(w_shape):
        raise ValueError(f"register_dense: w {tuple(w_shape)} has no output axis left.")
    return dict(dimension_numbers=((lc, rc), (lb, rb)))


def dense_stack_size(dimension_numbers: Any, w_shape: Sequence[int]) -> int | None:
    """``M`` for a stacked dense layer (`dense_meta`'s batch dimension over the weight's
    leading axis), else None."""
    (_, _), (_, rb) = dimension_numbers
    return int(w_shape[0]) if tuple(rb) == (0,) else None


def stacked_input_axis(
    tag_name: str, meta: Mapping[str, Any], param_shapes: Sequence[Sequence[int]]
) -> int | None:
    """For a stacked dense layer (`dense_meta`: a batch dimension over the weight's
    leading axis), the axis of its input that runs over the slices; else None."""
    if tag_name != dense.name or not param_shapes:
        return None
    dnums = meta["dimension_numbers"]
    if dense_stack_size(dnums, param_shapes[0]) is None:
        return None
    (_, _), ((axis,), _) = dnums
    return int(axis)


def dense_slice_meta(dimension_numbers: Any) -> dict[str, Any]:
    """The metadata of one slice of a stacked dense layer (the contraction without the
    batch dimension, on ``x`` with its batch axis moved to the front and removed)."""
    (lc, rc), (lb, _) = dimension_numbers
    (bx,) = lb
    lc = tuple(a - (a > bx) for a in lc)
    return dict(dimension_numbers=((lc, tuple(a - 1 for a in rc)), ((), ())))


def _without_leading_ones(shape: Sequence[int]) -> tuple[int, ...]:
    shape = tuple(shape)
    return shape[next((i for i, d in enumerate(shape) if d != 1), len(shape)) :]


def register_dense(
    y: jax.Array,
    x: jax.Array,
    w: jax.Array,
    b: jax.Array | None = None,
    dimension_numbers: Any = None,
) -> jax.Array:
    """Marks a dense layer ``y = dot_general(x, w) + b`` and returns ``y`` unchanged.

    The common case is ``y = x @ w + b`` with ``x: [..., d_in]``, ``w: [d_in, d_out]``
    and ``b: [d_out]``. Multi-axis contractions (e.g. attention projections
    ``einsum('btd,dhk->bthk', x, w)``, or ``x @ w.T``) are described by
    ``dimension_numbers``.

    Args:
      y: the layer output, shape ``x``'s free axes followed by ``w``'s free axes
        (for a stacked layer: the stack axis first).
      x: the layer input (leading axes: batch, and e.g. sequence positions).
      w: the weight.
      b: optional bias, shaped like ``w``'s free (output) axes (leading axes
        of size 1 are allowed, e.g. ``[1, d_out]``; for a stacked layer
        ``[M, *output_axes]``).
      dimension_numbers: `jax.lax.dot_general` dimension numbers
        ``((x_axes, w_axes), (x_batch, w_batch))``; default
        ``(((x.ndim - 1,), (0,)), ((), ()))``. A batch dimension over the
        weight's leading axis, ``((i,), (0,))``, makes a stacked layer of
        ``M = w.shape[0]`` dense layers (ensemble members, experts), served
        by one Kronecker-factored block per slice.

    Returns:
      ``y``, tagged.

    Raises:
      ValueError: if the shapes do not describe a dense layer.

    Example::

      y = kfacx.register_dense(x @ w + b, x, w, b)
      y = kfacx.register_dense(x @ v.T, x, v, dimension_numbers=(((1,), (1,)), ((), ())))
    """
    meta = dense_meta(x.shape, w.shape, dimension_numbers)
    (lc, rc), (lb, rb) = meta["dimension_numbers"]
    w_free = tuple(d for i, d in enumerate(w.shape) if i not in rc + rb)
    x_free = tuple(d for i, d in enumerate(x.shape) if i not in lc + lb)
    stack = tuple(w.shape[i] for i in rb)
    if tuple(y.shape) != stack + x_free + w_free:
        raise _shape_error(
            "register_dense",
            "y",
            y.shape,
            f"{stack + x_free + w_free}",
            "Pass the layer output as y.",
        )
    if stack and b is not None and tuple(b.shape) != stack + w_free:
        raise _shape_error(
            "register_dense",
            "b",
            b.shape,
            f"{stack + w_free}",
            "A stacked layer's bias has the stack axis and the weight's output axes.",
        )
    if (
        not stack
        and b is not None
        and _without_leading_ones(b.shape) != _without_leading_ones(w_free)
    ):
        raise _shape_error(
            "register_dense", "b", b.shape, f"{w_free}", "The bias has the weight's output axes."
        )
    operands = (y, x, w) if b is None else (y, x, w, b)
    return dense.bind(*operands, **meta)[0]


# ----------------------------------------------------------------------------- conv


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
        raise _shape_error(
            "register_conv",
            "y",
            y.shape,
            f"{tuple(expected)}",
            "Pass the convolution's output and the same conv parameters.",
        )
    out_features = w.shape[meta["dimension_numbers"].rhs_spec[0]]
    if b is not None and tuple(b.shape) != (out_features,):
        raise _shape_error("register_conv", "b", b.shape, f"({out_features},)", "")
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
        raise _shape_error(
            "register_conv2d",
            "w",
            w.shape,
            "a 4-D kernel",
            "Use register_conv for 1-D or 3-D convolutions.",
        )
    return register_conv(y, x, w, b, **conv_params)


# ----------------------------------------------------------------------------- scale and shift


def _scale_and_shift_compute(inputs, params, *, has_scale, has_shift, scale_offset=0.0):
    (x,) = inputs
    params = list(params)
    y = x
    if has_scale:
        scale = params.pop(0)
        if scale_offset:
            scale = scale_offset + scale
        y = y * jnp.broadcast_to(scale, x.shape)
    if has_shift:
        y = y + jnp.broadcast_to(params.pop(0), x.shape)
    return (y,)


scale_and_shift = LayerTag(
    "scale_and_shift_tag", num_inputs=1, num_outputs=1, compute=_scale_and_shift_compute
)


def _broadcasts_to(shape: Sequence[int], target: Sequence[int]) -> bool:
    try:
        return jnp.broadcast_shapes(tuple(shape), tuple(target)) == tuple(target)
    except ValueError:
        return False


def register_scale_and_shift(
    y: jax.Array,
    x: jax.Array,
    scale: jax.Array | None = None,
    shift: jax.Array | None = None,
    *,
    scale_offset: float = 0.0,
) -> jax.Array:
    """Marks ``y = x * (scale_offset + scale) + shift`` (e.g. the affine part of a
    normalization layer; ``scale_offset=1`` for a learned scale stored as its offset
    from 1, ``x * (1 + scale)``, as in Gemma's RMSNorm).

    ``scale`` and ``shift`` broadcast against the trailing axes of ``x``. The
    curvature block is the same for any offset: ``dy / dscale = x``.

    Returns:
      ``y``, tagged.

    Raises:
      ValueError: if neither ``scale`` nor ``shift`` is given, shapes do not
        broadcast, or ``scale_offset`` is not finite (or is given without ``scale``).
      TypeError: if ``scale_offset`` is not a Python number.

    Example::

      y = kfacx.register_scale_and_shift(x_hat * gamma + beta, x_hat, gamma, beta)
      y = kfacx.register_scale_and_shift(x_hat * (1 + gamma), x_hat, gamma, scale_offset=1.0)
    """
    if scale is None and shift is None:
        raise ValueError("register_scale_and_shift: give at least one of scale and shift.")
    if isinstance(scale_offset, bool) or not isinstance(scale_offset, (int, float)):
        raise TypeError(
            "register_scale_and_shift: scale_offset must be a Python number (static), got "
            f"{type(scale_offset).__name__}."
        )
    if not math.isfinite(scale_offset) or (scale_offset and scale is None):
        raise ValueError(
            f"register_scale_and_shift: scale_offset={scale_offset!r} needs a finite value "
            "and a scale parameter."
        )
    for what, p in (("scale", scale), ("shift", shift)):
        if p is None:
            continue
        batch_free = p.ndim < x.ndim or p.shape[0] == 1
        if not batch_free or not _broadcasts_to(p.shape, x.shape):
            raise _shape_error(
                "register_scale_and_shift",
                what,
                p.shape,
                f"a shape that broadcasts to the trailing axes of x {tuple(x.shape)}",
                "The leading (batch) axis of x must not be in the parameter.",
            )
    if tuple(y.shape) != tuple(x.shape):
        raise _shape_error("register_scale_and_shift", "y", y.shape, f"{tuple(x.shape)}", "")
    params = tuple(p for p in (scale, shift) if p is not None)
    meta = dict(has_scale=scale is not None, has_shift=shift is not None)
    if scale_offset:  # only when set: the tag of a plain scale keeps its usual metadata
        meta["scale_offset"] = float(scale_offset)
    return scale_and_shift.bind(y, x, *params, **meta)[0]


# ----------------------------------------------------------------------------- embedding


def _embedding_compute(inputs, params, **meta):
    del meta
    (ids,) = inputs
    (table,) = params
    return (jnp.take(table, ids, axis=0),)


embedding = LayerTag("embedding_tag", num_inputs=1, num_outputs=1, compute=_embedding_compute)


def register_embedding(y: jax.Array, ids: jax.Array, table: jax.Array) -> jax.Array:
    """Marks an embedding lookup ``y = table[ids]`` and returns ``y`` unchanged.

    Args:
      y: the looked-up vectors, shape ``ids.shape + (dim,)``.
      ids: integer ids, any shape (leading axis: batch).
      table: the embedding table, shape ``[vocab, dim]``.

    Returns:
      ``y``, tagged.

    Raises:
      ValueError: if the shapes do not describe a lookup, or ids are not integers.

    Example::

      y = kfacx.register_embedding(table[ids], ids, table)
    """
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise TypeError(f"register_embedding: ids must be integers, got {ids.dtype}.")
    if table.ndim != 2:
        raise _shape_error("register_embedding", "table", table.shape, "[vocab, dim]", "")
    if tuple(y.shape) != tuple(ids.shape) + (table.shape[1],):
        raise _shape_error(
            "register_embedding", "y", y.shape, f"{tuple(ids.shape) + (table.shape[1],)}", ""
        )
    return embedding.bind(y, ids, table)[0]


# ----------------------------------------------------------------------------- generic


generic = LayerTag("generic_tag", num_inputs=0, num_outputs=1)


def register_generic(parameter: jax.Array) -> jax.Array:
    """Marks a parameter that belongs to no known layer kind; returns it unchanged.

    Its block (`kfacx.blocks.Diagonal` by default) is estimated from the
    gradient of the loss with respect to the parameter itself.

    Example::

      w = kfacx.register_generic(w)
    """
    return generic.bind(parameter, parameter)[0]
