"""The scale-and-shift tag (the affine part of normalization layers) and the embedding tag."""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from kfacx.tags._layer_tags import LayerTag, shape_error


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
            raise shape_error(
                "register_scale_and_shift",
                what,
                p.shape,
                f"a shape that broadcasts to the trailing axes of x {tuple(x.shape)}",
                "The leading (batch) axis of x must not be in the parameter.",
            )
    if tuple(y.shape) != tuple(x.shape):
        raise shape_error("register_scale_and_shift", "y", y.shape, f"{tuple(x.shape)}", "")
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
        raise shape_error("register_embedding", "table", table.shape, "[vocab, dim]", "")
    if tuple(y.shape) != tuple(ids.shape) + (table.shape[1],):
        raise shape_error(
            "register_embedding", "y", y.shape, f"{tuple(ids.shape) + (table.shape[1],)}", ""
        )
    return embedding.bind(y, ids, table)[0]
