"""The built-in scale-and-shift patterns: normalisation scales and offsets in the orderings
published code writes them, and parameters used as they are (tiled over the batch).

A normalisation layer computes ``x_hat * scale + shift`` on ``x_hat = (x - mean) / std``
(``mean`` = 0 for an RMSNorm, ``std = sqrt(var + eps)``). Each way of writing it is one
pattern, tagged ``scale_and_shift`` on ``x_hat`` (computed from the matched inputs where
the code never forms it). A scale stored as its offset from 1, ``x_hat * (1 + g)``
(lingvo, praxis, Gemma, flaxformer's ``center_scale_at_zero``), is the same layer: the
tag gets ``scale_offset=1`` and the parameter ``g``, whose Jacobian is that of a plain
scale (``d y / d g = x_hat``). Without a shift, each pattern has a ``_scale`` twin.

- ``x_hat * g + b`` with ``x_hat`` formed: ``scale_and_shift`` (Equinox, T5's RMSNorm,
  praxis's LayerNorm with ``(1 + g)``: ``offset_scale_and_shift``);
- ``(x - m) * (g * rsqrt(v + eps)) + b``: ``normalization`` (Flax, Haiku), and
  ``offset_normalization`` with ``(1 + g)``;
- ``(x - m) * (g / sqrt(v + eps)) + b``: ``std_normalization``, and
  ``offset_std_normalization`` with ``(1 + g)`` (lingvo's and praxis's BatchNorm);
- ``g * (x - m) / sqrt(v + eps) + b``: ``scaled_std_normalization`` (the textbook
  formula), and ``offset_scaled_std_normalization`` with ``(1 + g)``;
- ``x * inv + (-m * inv + b)`` with ``inv = rsqrt(v + eps) * g``: ``keras_normalization``
  (Keras 3).

Operand order does not matter (``add`` and ``mul`` are matched both ways, so Haiku's
RMSNorm ``x * g * rsqrt(ms + eps)`` is a ``normalization``), nor where broadcasting
happens (the matcher follows the model's broadcasts and casts, `kfacx.graph_matcher._match`).

`BROADCAST_PARAMETER`: a parameter tiled or broadcast over the batch (a learned query of
an attention-pooling head, a class token, a mask token, a learned initial state) is a
shift-only layer on zeros: every example's output is the parameter, its per-example
gradient the cotangent of its copy, and the uses over the tiled axis sum into one block.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from kfacx import tags
from kfacx.graph_matcher._pattern import GraphPattern

#: Precedences: a normalisation with a shift (before `SCALE_AND_SHIFT`, 20, which could
#: take its last product and sum); one without (before the dense layers, 10-12, and the
#: plain scales, which could take a product inside it); a plain scale.
_NORM, _NORM_SCALE, _SCALE = 25, 15, 5


def scale_and_shift_extractor(has_scale: bool, has_shift: bool, scale_offset: float = 0.0):
    """An extractor giving the ``scale_and_shift`` tag's metadata (it reads nothing)."""

    def extract(eqns: Sequence[Any]) -> dict[str, Any]:
        del eqns
        meta: dict[str, Any] = dict(has_scale=has_scale, has_shift=has_shift)
        if scale_offset:
            meta["scale_offset"] = scale_offset
        return meta

    return extract


def broadcast_parameter_extractor(eqns: Sequence[Any]) -> dict[str, Any]:
    """Checks that the chain broadcasts its parameter to the result, over a new or size-1
    leading axis (the batch), as `kfacx.register_scale_and_shift` requires of a shift.

    Raises:
      ValueError: for a parameter with a leading axis of its own, or one that does not
        broadcast to the result (reshaped to other axes).
    """
    param, out = eqns[0].invars[0].aval.shape, eqns[-1].outvars[0].aval.shape
    if not (len(param) < len(out) or (param and param[0] == 1)):
        raise ValueError("the parameter has a leading axis of its own")
    if np.broadcast_shapes(param, out) != tuple(out):
        raise ValueError("the parameter does not broadcast to the result")
    return dict(has_scale=False, has_shift=True)


def _z(*shape):
    return np.zeros(shape, np.float32)


def _one_rank(*arrays):
    """The arrays with leading size-1 axes up to the highest rank among them (the matched
    statistics of a batch norm over axis 0 may have fewer axes than its input)."""
    ndim = max(a.ndim for a in arrays)
    return [a.reshape((1,) * (ndim - a.ndim) + a.shape) for a in arrays]


def _times(centered, inv_std):
    centered, inv_std = _one_rank(centered, inv_std)
    return (centered * inv_std,)


def _over(centered, std):
    centered, std = _one_rank(centered, std)
    return (centered / std,)


def _keras_x_hat(x, mean, inv_std):
    x, mean, inv_std = _one_rank(x, mean, inv_std)
    return ((x - mean) * inv_std,)


def _keras(x, mean, inv_std, scale, shift=None):
    inv = inv_std * scale
    res = -mean * inv
    return x * inv + (res if shift is None else res + shift)


#: Example arguments: ``[x - mean, inv_std or std, [scale(, shift)]]``, all of one rank.
_NORM_ARGS, _NORM_SCALE_ARGS = (
    [_z(2, 3), _z(2, 1), [_z(1, 3), _z(1, 3)]],
    [_z(2, 3), _z(2, 1), [_z(1, 3)]],
)
_KERAS_ARGS = [_z(2, 3), _z(2, 1), _z(2, 1), [_z(1, 3), _z(1, 3)]]
_KERAS_SCALE_ARGS = [_z(2, 3), _z(2, 1), _z(2, 1), [_z(1, 3)]]


def _normalization(name, compute, x_hat, *, offset: bool, shift: bool, args=None) -> GraphPattern:
    """A normalisation pattern: ``compute(*inputs, params)``, tag input ``x_hat(*inputs)``."""
    default_args = _NORM_ARGS if shift else _NORM_SCALE_ARGS
    return GraphPattern(
        name=name,
        tag_primitive=tags.scale_and_shift,
        compute_func=compute,
        parameters_extractor_func=scale_and_shift_extractor(True, shift, 1.0 if offset else 0.0),
        example_args=args or default_args,
        precedence=_NORM if shift else _NORM_SCALE,
        tag_inputs_func=x_hat,
    )


SCALE_AND_SHIFT = GraphPattern(
    name="scale_and_shift",
    tag_primitive=tags.scale_and_shift,
    compute_func=lambda x, p: x * p[0] + p[1],
    parameters_extractor_func=scale_and_shift_extractor(True, True),
    example_args=[_z(2, 3), [_z(3), _z(3)]],
    precedence=20,
)
#: ``x * (1 + scale) + shift``: a learned scale stored as its offset from 1 (Gemma-style
#: RMSNorm, a learned feature-wise modulation). The literal is checked by the numerical
#: verification of each match (the tag computes with ``scale_offset=1``).
OFFSET_SCALE_AND_SHIFT = GraphPattern(
    name="offset_scale_and_shift",
    tag_primitive=tags.scale_and_shift,
    compute_func=lambda x, p: x * (1.0 + p[0]) + p[1],
    parameters_extractor_func=scale_and_shift_extractor(True, True, 1.0),
    example_args=[_z(2, 3), [_z(1, 3), _z(1, 3)]],
    precedence=21,
)
#: ``x * (1 + scale)``: Gemma's RMSNorm, whether the scale is broadcast to ``x``'s rank
#: before the offset is added (``jnp.expand_dims(scale, range(x.ndim - 1))``) or after.
OFFSET_SCALE = GraphPattern(
    name="offset_scale",
    tag_primitive=tags.scale_and_shift,
    compute_func=lambda x, p: x * (1.0 + p[0]),
    parameters_extractor_func=scale_and_shift_extractor(True, False, 1.0),
    example_args=[_z(2, 3), [_z(1, 3)]],
    precedence=_SCALE + 1,
)
SCALE = GraphPattern(
    name="scale",
    tag_primitive=tags.scale_and_shift,
    compute_func=lambda x, p: x * p[0],
    parameters_extractor_func=scale_and_shift_extractor(True, False),
    example_args=[_z(2, 3), [_z(3)]],
    precedence=_SCALE,
)
SHIFT = GraphPattern(
    name="shift",
    tag_primitive=tags.scale_and_shift,
    compute_func=lambda x, p: x + p[0],
    parameters_extractor_func=scale_and_shift_extractor(False, True),
    example_args=[_z(2, 3), [_z(3)]],
    precedence=0,
)

#: ``(x - mean) * (scale * inv_std) + shift``: Flax's LayerNorm / BatchNorm / RMSNorm,
#: Haiku's LayerNorm / BatchNorm (and RMSNorm, ``x * scale * inv_std``).
NORMALIZATION = _normalization(
    "normalization", lambda c, r, p: c * (p[0] * r) + p[1], _times, offset=False, shift=True
)
NORMALIZATION_SCALE = _normalization(
    "normalization_scale", lambda c, r, p: c * (p[0] * r), _times, offset=False, shift=False
)
#: ``(x - mean) * ((1 + scale) * inv_std) + shift``.
OFFSET_NORMALIZATION = _normalization(
    "offset_normalization",
    lambda c, r, p: c * ((1.0 + p[0]) * r) + p[1],
    _times,
    offset=True,
    shift=True,
)
OFFSET_NORMALIZATION_SCALE = _normalization(
    "offset_normalization_scale",
    lambda c, r, p: c * ((1.0 + p[0]) * r),
    _times,
    offset=True,
    shift=False,
)
#: ``(x - mean) * (scale / std) + shift``, ``std = sqrt(var + eps)``.
STD_NORMALIZATION = _normalization(
    "std_normalization", lambda c, s, p: c * (p[0] / s) + p[1], _over, offset=False, shift=True
)
STD_NORMALIZATION_SCALE = _normalization(
    "std_normalization_scale", lambda c, s, p: c * (p[0] / s), _over, offset=False, shift=False
)
#: ``(x - mean) * ((1 + scale) / std) + shift``: lingvo's and praxis's BatchNorm.
OFFSET_STD_NORMALIZATION = _normalization(
    "offset_std_normalization",
    lambda c, s, p: c * ((1.0 + p[0]) / s) + p[1],
    _over,
    offset=True,
    shift=True,
)
OFFSET_STD_NORMALIZATION_SCALE = _normalization(
    "offset_std_normalization_scale",
    lambda c, s, p: c * ((1.0 + p[0]) / s),
    _over,
    offset=True,
    shift=False,
)
#: ``scale * (x - mean) / std + shift`` (the scale applied before the division).
SCALED_STD_NORMALIZATION = _normalization(
    "scaled_std_normalization", lambda c, s, p: c * p[0] / s + p[1], _over, offset=False, shift=True
)
SCALED_STD_NORMALIZATION_SCALE = _normalization(
    "scaled_std_normalization_scale", lambda c, s, p: c * p[0] / s, _over, offset=False, shift=False
)
#: ``(1 + scale) * (x - mean) / std + shift``.
OFFSET_SCALED_STD_NORMALIZATION = _normalization(
    "offset_scaled_std_normalization",
    lambda c, s, p: c * (1.0 + p[0]) / s + p[1],
    _over,
    offset=True,
    shift=True,
)
OFFSET_SCALED_STD_NORMALIZATION_SCALE = _normalization(
    "offset_scaled_std_normalization_scale",
    lambda c, s, p: c * (1.0 + p[0]) / s,
    _over,
    offset=True,
    shift=False,
)
#: ``x * inv + (-mean * inv + shift)`` with ``inv = inv_std * scale``: Keras 3's
#: LayerNormalization, GroupNormalization and ``ops.batch_normalization``.
KERAS_NORMALIZATION = _normalization(
    "keras_normalization",
    lambda x, m, r, p: _keras(x, m, r, p[0], p[1]),
    _keras_x_hat,
    offset=False,
    shift=True,
    args=_KERAS_ARGS,
)
KERAS_NORMALIZATION_SCALE = _normalization(
    "keras_normalization_scale",
    lambda x, m, r, p: _keras(x, m, r, p[0]),
    _keras_x_hat,
    offset=False,
    shift=False,
    args=_KERAS_SCALE_ARGS,
)
#: A parameter used through shape-only operations only (``jnp.tile(probe, [B, 1, 1])``,
#: ``jnp.broadcast_to``, ``broadcast_in_dim``, reshapes, casts) whose result has the batch
#: on its leading axis: a shift-only ``scale_and_shift`` layer on zeros. The pattern of
#: last resort (lowest precedence): a parameter another layer claimed (a bias is broadcast
#: before it is added) is left to that layer.
BROADCAST_PARAMETER = GraphPattern(
    name="broadcast_parameter",
    tag_primitive=tags.scale_and_shift,
    compute_func=lambda p: jnp.broadcast_to(p[0], (2, 3)),
    parameters_extractor_func=broadcast_parameter_extractor,
    example_args=[[_z(1, 3)]],
    precedence=-10,
    tag_inputs_func=lambda out: (jnp.zeros_like(out),),
    tag_inputs_from_output=True,
)
