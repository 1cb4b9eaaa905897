"""Matrix norms of curvature blocks, for scaling the damping per block.

kfac-jax's ``norm_to_scale_identity_weight_per_block`` multiplies the damping of
every block by a norm of that block's (undamped) curvature matrix. `block_norm`
computes these norms without forming the matrix: a block is described by its
*Kronecker pieces* (`kronecker_pieces`), the block being the block-diagonal
matrix of the pieces, each piece a (possibly stacked) Kronecker product of one or
two PSD factors, a factor being a matrix ``[..., n, n]`` or the diagonal
``[..., n]`` of one. The norms of a Kronecker product are the products of its
factors' norms (trace, Frobenius, 1- and 2-norm) and its diagonal and eigenvalues
the outer products of the factors', so every norm is exact and costs no more than
the factors.

The norm types are kfac-jax's (`kfac_jax.utils.psd_matrix_norm`), ``2_norm`` and
``median_eig`` computed exactly from eigendecompositions.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from kfacx import linalg
from kfacx.blocks._base import BlockState, CurvatureBlock
from kfacx.blocks._diagonal_full import _AbstractDiagonal, _AbstractFull
from kfacx.blocks._embedding import EmbeddingKroneckerFactored
from kfacx.blocks._kronecker import TwoKroneckerFactored
from kfacx.blocks._stacked import StackedBlock
from kfacx.blocks._tied import TiedKroneckerFactored

#: The norms `block_norm` computes (kfac-jax's names); ``"none"`` means no scaling.
NORM_TYPES = (
    "avg_diag",
    "median_diag",
    "trace",
    "median_eig",
    "one_over_dim",
    "1_norm",
    "avg_fro",
    "fro",
    "2_norm",
)


class Factor(NamedTuple):
    """A Kronecker factor of a block: a PSD matrix ``[..., n, n]`` (``is_matrix``) or the
    diagonal ``[..., n]`` of one; leading axes stack independent blocks."""

    value: jax.Array
    is_matrix: bool


#: A Kronecker piece: the Kronecker product of one or two factors.
Piece = tuple[Factor, ...]


def check_norm_type(norm_type: str | None, name: str) -> str | None:
    """``norm_type`` (None for ``"none"``), checked against `NORM_TYPES`.

    Raises:
      ValueError: naming the option ``name`` and the choices.
    """
    if norm_type is None or norm_type == "none":
        return None
    if norm_type not in NORM_TYPES:
        raise ValueError(
            f"{name}={norm_type!r} is not a norm; choose None (no scaling) or one of {NORM_TYPES}."
        )
    return norm_type


def kronecker_pieces(block: CurvatureBlock, state: BlockState) -> list[Piece]:
    """The block's curvature as Kronecker pieces (see the module docstring).

    A block class can describe itself with a ``norm_pieces(state)`` method returning
    such a list; blocks this module does not know are one piece, their dense matrix.
    """
    own = getattr(block, "norm_pieces", None)
    if own is not None:
        return list(own(state))
    if isinstance(block, TwoKroneckerFactored):
        a, g = block.factor_values(state)
        return [(Factor(a, True), Factor(g, True))]
    values = [f.value for f in state.factors]
    if isinstance(block, EmbeddingKroneckerFactored):
        return [(Factor(values[0], False), Factor(values[1], True))]
    if isinstance(block, _AbstractDiagonal):
        return [(Factor(v.reshape(-1), False),) for v in values]
    if isinstance(block, _AbstractFull):
        return [(Factor(values[0], True),)]
    if isinstance(block, TiedKroneckerFactored):
        rows, cols = block.fitted_factors(state)
        pieces = [(Factor(rows, rows.ndim == 2), Factor(cols, cols.ndim == 2))]
        return pieces + [(Factor(b, b.ndim == 2),) for b in block._bias_factors(state)]
    if isinstance(block, StackedBlock):
        return _stacked_pieces(block, state)
    return [(Factor(block.to_dense_matrix(state), True),)]


def _stacked_pieces(block: StackedBlock, state: BlockState) -> list[Piece]:
    """The inner block's pieces of every slice, stacked along a leading axis."""
    flags: list[tuple[bool, ...]] = []

    def arrays(s):
        pieces = kronecker_pieces(block.inner, s)
        flags[:] = [tuple(f.is_matrix for f in p) for p in pieces]
        return [tuple(f.value for f in p) for p in pieces]

    values = jax.vmap(arrays)(state)
    return [
        tuple(Factor(v, m) for v, m in zip(vs, ms, strict=True))
        for vs, ms in zip(values, flags, strict=True)
    ]


def block_norm(block: CurvatureBlock, state: BlockState, norm_type: str) -> jax.Array:
    """The ``norm_type`` norm of the block's undamped curvature matrix (a scalar).

    Equals ``psd_matrix_norm(block.to_dense_matrix(state), norm_type)`` in kfac-jax's
    definitions (``avg_diag``: trace / dim; ``avg_fro``: Frobenius / sqrt(dim);
    ``one_over_dim``: 1 / dim; ``median_*``: the median of the diagonal / eigenvalues).

    Raises:
      ValueError: for an unknown norm type.
    """
    check_norm_type(norm_type, "norm_type")
    pieces = kronecker_pieces(block, state)
    dim = sum(_piece_size(p) for p in pieces)
    if norm_type == "one_over_dim":
        return jnp.asarray(1.0 / dim, block.dtype)
    if norm_type in ("trace", "avg_diag"):
        total = sum(jnp.sum(_product(p, _trace)) for p in pieces)
        return total if norm_type == "trace" else total / dim
    if norm_type in ("fro", "avg_fro"):
        fro = jnp.sqrt(sum(jnp.sum(_product(p, _sq_fro)) for p in pieces))
        return fro if norm_type == "fro" else fro / jnp.sqrt(float(dim))
    if norm_type == "1_norm":
        return _max(_product(p, _one_norm) for p in pieces)
    if norm_type == "2_norm":
        return _max(_product(p, lambda f: jnp.max(_eigenvalues(f), axis=-1)) for p in pieces)
    entries = _diagonal if norm_type == "median_diag" else _eigenvalues
    return jnp.median(jnp.concatenate([_outer(p, entries) for p in pieces]))


def _piece_size(piece: Piece) -> int:
    """The number of rows of the piece's matrix (stacked entries included)."""
    first = piece[0]
    size = math.prod(first.value.shape[: first.value.ndim - 1 - int(first.is_matrix)])
    return size * math.prod(f.value.shape[-1] for f in piece)


def _product(piece: Piece, per_factor: Callable[[Factor], jax.Array]) -> jax.Array:
    """The product over the piece's factors of ``per_factor(f)`` (per stacked entry)."""
    out = per_factor(piece[0])
    for f in piece[1:]:
        out = out * per_factor(f)
    return out


def _outer(piece: Piece, per_factor: Callable[[Factor], jax.Array]) -> jax.Array:
    """Every product of one entry of ``per_factor(f)`` per factor, flattened."""
    out = per_factor(piece[0])
    for f in piece[1:]:
        value = per_factor(f)
        out = (out[..., :, None] * value[..., None, :]).reshape(value.shape[:-1] + (-1,))
    return out.reshape(-1)


def _diagonal(f: Factor) -> jax.Array:
    return jnp.diagonal(f.value, axis1=-2, axis2=-1) if f.is_matrix else f.value


def _eigenvalues(f: Factor) -> jax.Array:
    if not f.is_matrix:
        return linalg.clip_eigenvalues(f.value)
    return linalg.safe_eigh(f.value)[0]


def _trace(f: Factor) -> jax.Array:
    return jnp.sum(_diagonal(f), axis=-1)


def _sq_fro(f: Factor) -> jax.Array:
    axes = (-2, -1) if f.is_matrix else (-1,)
    return jnp.sum(jnp.square(f.value), axis=axes)


def _one_norm(f: Factor) -> jax.Array:
    if f.is_matrix:
        return jnp.max(jnp.sum(jnp.abs(f.value), axis=-2), axis=-1)
    return jnp.max(jnp.abs(f.value), axis=-1)


def _max(values: Sequence[jax.Array] | Any) -> jax.Array:
    return jnp.max(jnp.stack([jnp.max(v) for v in values]))
