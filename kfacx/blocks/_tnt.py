"""TNT (tensor-normal training) blocks for dense and conv layers, with kfac-jax's semantics.

TNT approximates the curvature of a layer whose gradient is a matrix ``G`` (rows:
inputs with the bias last, columns: outputs; one matrix per feature group) by the
covariance of a tensor-normal distribution, ``F ~ L (x) R / s``, with

``L = E[G G^T]``,  ``R = E[G^T G]``  and  ``s = sqrt(tr L * tr R)``.

Both factors have the trace ``E ||G||_F^2``, so ``s = tr L`` and
``tr(F) = E ||G||_F^2``: the trace of the empirical Fisher of the layer (with
shared positions, below: of the rows' gradients).

Statistics. As K-FAC's blocks (`DenseTwoKroneckerFactored`,
`ConvTwoKroneckerFactored`), TNT assumes that the positions an example's
rows share (sequence steps, output pixels) are independent: a *row* ``r`` is
one example at one position, with input ``x_r`` (the dense input, or the conv
patch the kernel sees, per feature group; with a 1 appended for a bias) and
output cotangent ``dy[s, r]`` of sample ``s``, and its gradient matrix is
``G[s, r] = x_r dy[s, r]^T``. The cotangents' second moments are summed over
the ``S`` samples (see `CurvatureBlock.compute_statistics`), so the batch's
statistics are, with ``B`` the batch size,

``L = sum_{s, r} ||dy[s, r]||^2 x_r x_r^T / B``,
``R = sum_{s, r} ||x_r||^2 dy[s, r] dy[s, r]^T / B``,

i.e. ``sum_{s, r} G[s, r] G[s, r]^T / B`` and ``sum_{s, r} G[s, r]^T G[s, r] / B``:
each ``x_r`` weighted by the norm of its cotangents, each ``dy[s, r]`` by the
norm of its input. With one sample and no shared positions this is the
definition above (kfac-jax's ``DenseTNT``); for convolutions it is kfac-jax's
``Conv2DTNT`` with ``weighting_per_location=True``, for any number of spatial
dimensions and feature groups. The moving averages of ``L`` and ``R`` are linear
with the same weights, so their traces stay equal; the scale ``1 / s`` is
computed from them whenever the curvature is used (``factor_values``).
Padding examples have zero cotangents, so they add nothing to either factor.

References:
  Y. Ren and D. Goldfarb, "Tensor Normal Training for Deep Learning Models",
  NeurIPS 2021 (arXiv:2106.02925); kfac-jax, ``kfac_jax.DenseTNT`` and
  ``kfac_jax.Conv2DTNT``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from kfacx.blocks._base import BlockState, row_mask
from kfacx.blocks._kronecker import (
    ConvTwoKroneckerFactored,
    DenseTwoKroneckerFactored,
    TwoKroneckerFactored,
    _second_moment,
)


def _tnt_statistics(
    rows: jax.Array, dy: jax.Array, batch_size: Any, estimation_data: Mapping[str, Any]
) -> tuple[jax.Array, jax.Array]:
    """The batch's ``(L, R)`` (module docstring) per group.

    Args:
      rows: the inputs of the rows ``[R, groups, n]`` (bias entry included).
      dy: their output cotangents ``[S, R, groups, m]`` (``S`` samples).
      batch_size: the number of real examples ``B``.
      estimation_data: for its ``"mask"``: the rows of padding examples are zeroed
        (their cotangents are zero already; this keeps non-finite padding out).

    Returns:
      ``L [groups, n, n]`` and ``R [groups, m, m]``.
    """
    mask = row_mask(estimation_data, rows.shape[0])
    if mask is not None:
        rows = jnp.where(mask[:, None, None] > 0, rows, 0.0)
    dy_sq = jnp.sum(jnp.square(dy), axis=(0, 3))  # [R, groups]: summed over samples.
    x_sq = jnp.sum(jnp.square(rows), axis=2)  # [R, groups]
    left = _second_moment(rows, batch_size, rows * dy_sq[..., None])
    dy_rows = dy.reshape((-1,) + dy.shape[2:])  # [S * R, groups, m]
    weights = jnp.broadcast_to(x_sq, dy.shape[:3]).reshape(-1, dy.shape[2])
    right = _second_moment(dy_rows, batch_size, dy_rows * weights[..., None])
    return left, right


def _tnt_scaled(left: jax.Array, right: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(L, R) / sqrt(s)`` per group, ``s = sqrt(tr L * tr R)``, so that their Kronecker
    product is ``L (x) R / s``; where ``s = 0`` (no statistics yet) the factors unscaled."""
    trace_l = jnp.trace(left, axis1=-2, axis2=-1)
    trace_r = jnp.trace(right, axis1=-2, axis2=-1)
    # sqrt(s) = (tr L)^(1/4) (tr R)^(1/4), without forming the (overflowing) product.
    root = jnp.sqrt(jnp.sqrt(trace_l) * jnp.sqrt(trace_r))
    scale = jnp.where(root > 0, 1.0 / jnp.where(root > 0, root, 1.0), 1.0)
    scale = scale.astype(left.dtype)[..., None, None]
    return left * scale, right * scale


class _TNTBlock(TwoKroneckerFactored):
    """What DenseTNT and ConvTNT share: the statistics, from the K-FAC block's
    ``input_rows`` and ``cotangent_rows`` (next in the method order), and the scaled
    factors."""

    def factor_values(self, state: BlockState) -> tuple[jax.Array, jax.Array]:
        """``(L, R) / sqrt(s)`` of the moving averages (`_tnt_scaled`)."""
        return _tnt_scaled(*(f.value for f in state.factors))

    def compute_statistics(
        self, estimation_data: Mapping[str, Sequence[jax.Array]], batch_size: int
    ) -> tuple[jax.Array, jax.Array]:
        """This batch's ``(L, R)`` per group, a row per example and position.

        Raises:
          ValueError: if the inputs' and the cotangents' rows do not pair up.
        """
        (x,) = estimation_data["inputs"]
        (dy,) = estimation_data["outputs_tangent"]
        rows = self.input_rows(x)
        dy = self.cotangent_rows(dy)
        _check_rows(self, rows, dy)
        return _tnt_statistics(rows, dy, batch_size, estimation_data)


class DenseTNT(_TNTBlock, DenseTwoKroneckerFactored):
    """TNT block of a dense layer (kfac-jax's ``DenseTNT``; the module docstring has the
    definition). Every free axis of the input (batch, sequence...) is a row, as in
    `DenseTwoKroneckerFactored`, whose layout and contractions it shares.

    Raises:
      ValueError: if the parameters do not fit the tag's contraction.
    """


class ConvTNT(_TNTBlock, ConvTwoKroneckerFactored):
    """TNT block of a convolution (kfac-jax's ``Conv2DTNT`` with
    ``weighting_per_location=True``, any number of spatial dimensions, feature groups):
    a row is one example at one output position, its input the patch of
    `ConvTwoKroneckerFactored.patches` (module docstring).

    Raises:
      ValueError: if the layer's metadata does not describe a convolution.
    """


def _check_rows(block: TwoKroneckerFactored, rows: jax.Array, dy: jax.Array) -> None:
    """Inputs and cotangents must pair up row by row.

    Raises:
      ValueError: if their numbers of rows differ.
    """
    if rows.shape[0] != dy.shape[1]:
        raise ValueError(
            f"{block!r}: {rows.shape[0]} input rows but {dy.shape[1]} cotangent rows per "
            "sample; TNT pairs every input row with its output cotangent."
        )
