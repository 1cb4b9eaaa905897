"""The dense layer tag: ``y = dot_general(x, w) + b``, stacked dense layers included."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from kfacx.tags._layer_tags import LayerTag, shape_error


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
    _check_dense_shapes(y, x, w, b, meta["dimension_numbers"])
    operands = (y, x, w) if b is None else (y, x, w, b)
    return dense.bind(*operands, **meta)[0]


def _check_dense_shapes(y, x, w, b, dimension_numbers) -> None:
    """Raises unless ``y`` (and ``b``) have the shapes of the layer's output (and bias)."""
    (lc, rc), (lb, rb) = dimension_numbers
    w_free = tuple(d for i, d in enumerate(w.shape) if i not in rc + rb)
    x_free = tuple(d for i, d in enumerate(x.shape) if i not in lc + lb)
    stack = tuple(w.shape[i] for i in rb)
    want_y = stack + x_free + w_free
    if tuple(y.shape) != want_y:
        fix = "Pass the layer output as y."
        raise shape_error("register_dense", "y", y.shape, f"{want_y}", fix)
    if b is None:
        return
    if stack and tuple(b.shape) != stack + w_free:
        fix = "A stacked layer's bias has the stack axis and the weight's output axes."
        raise shape_error("register_dense", "b", b.shape, f"{stack + w_free}", fix)
    if not stack and _without_leading_ones(b.shape) != _without_leading_ones(w_free):
        fix = "The bias has the weight's output axes."
        raise shape_error("register_dense", "b", b.shape, f"{w_free}", fix)
