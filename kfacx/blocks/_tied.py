"""One block for a weight used by layers of different kinds (tied weights in two roles).

A GPT-style language model looks its tokens up in a table ``E[vocab, d]`` and
computes its logits as ``h @ E.T``; a tied autoencoder decodes with the
transpose of its encoder's weight. Each use ("role") of such a 2-D weight
``W[m, n]`` has a Kronecker-factored curvature over the same two index spaces,
``R_r (m x m) kron C_r (n x n)``:

* an embedding lookup: ``R`` = the id frequencies (diagonal), ``C`` = the
  second moment of the output cotangents;
* a dense layer ``x @ W`` (or ``x @ W.T``): the input second moment on the
  contracted axis and the output-cotangent second moment on the free one.

The curvature of ``W`` is taken as the sum over roles (cross terms between
roles are dropped, as K-FAC drops those between layers), and the block
approximates that sum by the one Kronecker product nearest in Frobenius norm,
``R* kron C*`` (Van Loan and Pitsianis: the best rank-1 fit of the rearranged
sum, found here from the roles' small Gram matrices). A side longer than
``max_full_size`` (default 1024, e.g. a vocabulary) is kept diagonal for every
role, so a 50k vocabulary costs 50k numbers, never a 50k x 50k matrix. Damped powers
of ``R* kron C*`` are exact, through the eigendecompositions of the two
factors. A dense role's own bias gets that role's output factor (its
weight-bias cross terms are dropped).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from kfacx import linalg
from kfacx.blocks._base import BlockState, CurvatureBlock, LayerInfo, cast_to, row_mask, zeros
from kfacx.blocks._eigenbasis import (
    change_basis,
    identity_stack,
    missing_cached_eigenbasis,
    rotate,
)
from kfacx.blocks._embedding import id_frequencies

#: The pseudo tag name of a layer whose parameters several kinds of layer use.
TIED_TAG = "tied"

_ROLE_TAGS = ("dense_tag", "embedding_tag")


class TiedFactor(NamedTuple):
    """A damped-power-ready factor: eigenvalues and eigenvectors (None: diagonal factor,
    whose eigenvalues are its entries)."""

    values: jax.Array
    vectors: jax.Array | None


class TiedEigen(NamedTuple):
    """Eigendecompositions of the fitted factors and of every bias factor."""

    rows: TiedFactor
    cols: TiedFactor
    biases: tuple[TiedFactor, ...]


class TiedCache(NamedTuple):
    """What `TiedKroneckerFactored.update_cache` keeps (None when nothing is cached)."""

    eigen: TiedEigen | None


@dataclasses.dataclass(frozen=True)
class _Role:
    kind: str  # "dense" or "embedding"
    rows_is_input: bool  # dense: whether W's first axis is the contracted (input) one
    x_axes: tuple[int, ...] = ()
    bias_index: int | None = None  # position of the role's bias among the block's params


class TiedKroneckerFactored(CurvatureBlock):
    """Block of a 2-D weight shared by dense and embedding layers (see the module doc).

    The `LayerInfo` has ``roles`` (one `LayerInfo` per kind of use) and
    ``role_params`` (where each role's parameters sit among the block's);
    `kfacx.tracer` builds it when layer tags of different kinds share a
    parameter. The estimation data is ``{"roles": (data_0, data_1, ...)}``.

    Args:
      layer: the tied layer.
      max_full_size: a side (axis of the weight) longer than this (an int >= 0) keeps only the
        diagonal of its factors (``functools.partial(TiedKroneckerFactored,
        max_full_size=...)`` in ``layer_tag_to_block_ctor`` changes it).

    Raises:
      ValueError: if the roles do not share exactly one 2-D weight, a role is
        not a dense or embedding layer, or ``max_full_size`` is negative.
      TypeError: if ``max_full_size`` is not an int.
    """

    def __init__(self, layer: LayerInfo, max_full_size: int = 1024):
        if isinstance(max_full_size, bool) or not isinstance(max_full_size, int):
            raise TypeError(
                f"TiedKroneckerFactored({layer.name}): max_full_size must be an int, got "
                f"{max_full_size!r}."
            )
        if max_full_size < 0:
            raise ValueError(
                f"TiedKroneckerFactored({layer.name}): max_full_size must be >= 0 (0 keeps "
                f"only diagonals), got {max_full_size}."
            )
        super().__init__(layer)
        kinds = [role.tag_name for role in layer.roles]
        if len(kinds) < 2 or not set(kinds) <= set(_ROLE_TAGS):
            raise _unserved(layer, f"its uses are {kinds} layers")
        self._roles = tuple(self._check_role(layer, r) for r in range(len(layer.roles)))
        self.rows, self.cols = layer.parameter_shapes[0]
        self.diagonal = (self.rows > max_full_size, self.cols > max_full_size)
        self.biases = tuple(r.bias_index for r in self._roles if r.bias_index is not None)

    def _check_role(self, layer: LayerInfo, r: int) -> _Role:
        role, positions = layer.roles[r], layer.role_params[r]

        def fail(why: str) -> ValueError:
            return _unserved(layer, why)

        if len(layer.role_params) != len(layer.roles):
            raise fail("role_params does not give the parameters of every role")
        if role.stack_size is not None:
            raise fail("a use is a stacked layer (lax.scan over the parameters)")
        if not positions or positions[0] != 0 or len(layer.parameter_shapes[0]) != 2:
            raise fail(f"the uses do not share one 2-D weight (shapes {layer.parameter_shapes})")
        if role.tag_name == "embedding_tag":
            return _Role("embedding", rows_is_input=True)
        (x_axes, w_axes), _ = role.meta["dimension_numbers"]
        if len(positions) > 2 or tuple(w_axes) not in ((0,), (1,)):
            raise fail(f"a dense use contracts axes {w_axes} of the weight")
        bias = positions[1] if len(positions) == 2 else None
        if bias is not None and sum(bias in p for p in layer.role_params) != 1:
            raise fail("a bias is shared by two uses")
        return _Role("dense", tuple(w_axes) == (0,), tuple(x_axes), bias)

    # ---------------------------------------------------------------- statistics

    def _side_shape(self, rows: bool) -> tuple[int, ...]:
        n, diagonal = (self.rows, self.diagonal[0]) if rows else (self.cols, self.diagonal[1])
        return (n,) if diagonal else (n, n)

    def factor_shapes(self):
        return tuple(self._side_shape(rows) for _ in self._roles for rows in (True, False))

    def compute_statistics(self, estimation_data, batch_size):
        out = []
        for role, data in zip(self._roles, estimation_data["roles"], strict=True):
            if role.kind == "embedding":
                out += self._embedding_statistics(data, batch_size)
            else:
                out += self._dense_statistics(role, data, batch_size)
        return tuple(out)

    def _embedding_statistics(self, data, batch_size):
        (dy,) = data["outputs_tangent"]
        counts = id_frequencies(data, self.rows, self.dtype)
        dy = dy.reshape(-1, self.cols).astype(self.dtype)
        rows = counts if self.diagonal[0] else jnp.diag(counts)
        return [rows, self._moment(dy, batch_size, diagonal=self.diagonal[1])]

    def _dense_statistics(self, role: _Role, data, batch_size):
        (x,) = data["inputs"]
        (dy,) = data["outputs_tangent"]
        n_in, n_out = (self.rows, self.cols) if role.rows_is_input else (self.cols, self.rows)
        x_axes = tuple(a % x.ndim for a in role.x_axes)
        x = jnp.moveaxis(x, x_axes, tuple(range(x.ndim - len(x_axes), x.ndim)))
        x = x.reshape(-1, n_in).astype(self.dtype)
        dy = dy.reshape(-1, n_out).astype(self.dtype)
        in_diagonal, out_diagonal = self.diagonal if role.rows_is_input else self.diagonal[::-1]
        mask = row_mask(data, x.shape[0])
        if mask is None:
            a_stat = self._moment(x, x.shape[0], diagonal=in_diagonal)
        else:
            mask = mask.astype(self.dtype)
            a_stat = self._moment(
                x, jnp.maximum(jnp.sum(mask), 1.0), diagonal=in_diagonal, weights=mask
            )
        g_stat = self._moment(dy, batch_size, diagonal=out_diagonal)
        return [a_stat, g_stat] if role.rows_is_input else [g_stat, a_stat]

    @staticmethod
    def _moment(rows, normalizer, diagonal: bool, weights=None):
        weighted = rows if weights is None else rows * weights[:, None]
        if diagonal:
            return jnp.sum(weighted * rows, axis=0) / normalizer
        return weighted.T @ rows / normalizer

    # ---------------------------------------------------------------- the fit

    def fitted_factors(self, state: BlockState) -> tuple[jax.Array, jax.Array]:
        """``(R*, C*)``: the Kronecker product nearest (Frobenius) to the sum of the roles'
        ``R_r kron C_r`` (``R*`` a vector when the rows side is diagonal)."""
        values = [f.value for f in state.factors]
        rows, cols = values[0::2], values[1::2]
        gram_r = _gram(rows)
        gram_c = _gram(cols)
        # The top eigenvector of gram_r @ gram_c (entrywise non-negative: Perron vector).
        m = gram_r @ gram_c
        scale = jnp.maximum(jnp.max(m), jnp.finfo(m.dtype).tiny)
        m = m / scale

        def step(_, beta):
            beta = m @ beta
            return beta / jnp.maximum(jnp.linalg.norm(beta), jnp.finfo(m.dtype).tiny)

        beta = jax.lax.fori_loop(0, 64, step, jnp.ones((len(rows),), m.dtype))
        cols_fit = sum(b * c for b, c in zip(beta, cols, strict=True))
        norm = beta @ gram_c @ beta
        weights = jnp.where(norm > 0, (gram_c @ beta) / jnp.where(norm > 0, norm, 1.0), 0.0)
        rows_fit = sum(w * r for w, r in zip(weights, rows, strict=True))
        return rows_fit, cols_fit

    def _bias_factors(self, state: BlockState) -> tuple[jax.Array, ...]:
        """Each bias's factor: its role's output (cotangent) factor."""
        values = [f.value for f in state.factors]
        out = []
        for r, role in enumerate(self._roles):
            if role.bias_index is not None:
                out.append(values[2 * r + (1 if role.rows_is_input else 0)])
        return tuple(out)

    # ---------------------------------------------------------------- cache

    def init_cache(self, exact_powers_to_cache, approx_powers_to_cache, cache_eigenvalues):
        for p in approx_powers_to_cache:
            if float(p) not in (-1.0, -0.5):
                raise self._unsupported_power(p, "in approx_powers_to_cache")
        if not (exact_powers_to_cache or approx_powers_to_cache or cache_eigenvalues):
            return TiedCache(None)

        def side(shape):
            n = shape[0]
            return TiedFactor(
                zeros((n,), self.dtype), None if len(shape) == 1 else identity_stack(n, self.dtype)
            )

        biases = tuple(side(self._bias_shape(i)) for i in self.biases)
        return TiedCache(
            TiedEigen(side(self._side_shape(True)), side(self._side_shape(False)), biases)
        )

    def _bias_shape(self, index: int) -> tuple[int, ...]:
        (role,) = (r for r in self._roles if r.bias_index == index)
        return self._side_shape(rows=not role.rows_is_input)

    def update_cache(self, state: BlockState, identity_weight: Any) -> BlockState:
        if state.cache.eigen is None:
            return state
        return state._replace(cache=TiedCache(self._eigen_now(state)))

    def _eigen_now(self, state: BlockState) -> TiedEigen:
        rows, cols = self.fitted_factors(state)
        return TiedEigen(
            _side(rows), _side(cols), tuple(_side(b) for b in self._bias_factors(state))
        )

    def _eigen(self, state: BlockState, use_cached: bool) -> TiedEigen:
        if not use_cached:
            return self._eigen_now(state)
        if state.cache.eigen is None:
            raise self._missing_cache("an eigendecomposition", "exact_powers_to_cache=(power,)")
        return state.cache.eigen

    # ---------------------------------------------------------------- products

    def _multiply(self, state, vector, identity_weight):
        rows, cols = self.fitted_factors(state)
        damping = jnp.asarray(identity_weight, self.dtype)
        w = vector[0].astype(self.dtype)
        left = rows[:, None] * w if rows.ndim == 1 else rows @ w
        out = [(left * cols[None, :] if cols.ndim == 1 else left @ cols) + damping * w]
        biases = dict(zip(self.biases, self._bias_factors(state), strict=True))
        for i, v in enumerate(vector[1:], start=1):
            b = v.astype(self.dtype).reshape(-1)
            g = biases[i]
            gb = g * b if g.ndim == 1 else g @ b
            out.append((gb + damping * b).reshape(v.shape))
        return tuple(cast_to(o, v.dtype) for o, v in zip(out, vector, strict=True))

    def _multiply_matpower(self, state, vector, identity_weight, power, exact_power, use_cached):
        if not exact_power and power not in (-1.0, -0.5):
            raise self._unsupported_power(power, "with exact_power=False")
        # Damped powers of R* kron C* are exact through the factors' eigenbases (the
        # approximate powers are the exact ones).
        eigen = self._eigen(state, use_cached)
        w = vector[0].astype(self.dtype)
        out = [_kron_power(eigen.rows, eigen.cols, w, identity_weight, power)]
        biases = dict(zip(self.biases, eigen.biases, strict=True))
        for i, v in enumerate(vector[1:], start=1):
            b = v.astype(self.dtype).reshape(-1)
            out.append(_power(biases[i], b, identity_weight, power).reshape(v.shape))
        return tuple(cast_to(o, v.dtype) for o, v in zip(out, vector, strict=True))

    # ---------------------------------------------------------------- eigenbasis

    def to_eigenbasis(self, state: BlockState, vector) -> tuple[jax.Array, ...]:
        """``(U_R^T W U_C, U_b^T b, ...)``: the weight in the eigenbases of the fitted
        factors of the last refresh (a diagonal side's is the identity), each bias in its
        factor's."""
        vector = self._check_vector(vector)
        sides = self._sides(state)
        return tuple(
            rotate(v.astype(self.dtype).reshape(-1) if i else v.astype(self.dtype), *side)
            for i, (v, side) in enumerate(zip(vector, sides, strict=True))
        )

    def from_eigenbasis(self, state: BlockState, coordinates) -> tuple[jax.Array, ...]:
        """The inverse of `to_eigenbasis`, as parameters."""
        sides = self._sides(state)
        return tuple(
            rotate(c, *side, inverse=True).reshape(shape)
            for c, side, shape in zip(coordinates, sides, self.parameters_shapes, strict=True)
        )

    def eigenbasis_change(self, old_state, new_state, diagonal) -> tuple[jax.Array, ...]:
        """Per parameter, ``(R_R o R_R) D (R_C o R_C)^T`` with ``R = U_new^T U_old``."""
        old, new = self._sides(old_state), self._sides(new_state)
        return tuple(change_basis(*x) for x in zip(diagonal, old, new, strict=True))

    def _sides(self, state: BlockState) -> list[tuple[jax.Array | None, jax.Array | None]]:
        """Per parameter, its ``(input, output)`` eigenvectors in the cache (None: identity)."""
        eigen: TiedEigen | None = state.cache.eigen
        if eigen is None:
            raise missing_cached_eigenbasis(self)
        biases = dict(zip(self.biases, eigen.biases, strict=True))
        sides = [(eigen.rows.vectors, eigen.cols.vectors)]
        return sides + [(biases[i].vectors, None) for i in range(1, len(self.parameters_shapes))]

    def to_dense_matrix(self, state):
        rows, cols = self.fitted_factors(state)
        blocks = [jnp.kron(_as_matrix(rows), _as_matrix(cols))]
        biases = dict(zip(self.biases, self._bias_factors(state), strict=True))
        blocks += [_as_matrix(biases[i]) for i in range(1, len(self.parameters_shapes))]
        return jax.scipy.linalg.block_diag(*blocks)


def _unserved(layer: LayerInfo, why: str) -> ValueError:
    return ValueError(
        f"TiedKroneckerFactored({layer.name}): {why}. It serves one 2-D weight used by dense "
        "and embedding layers (e.g. tied input/output embeddings, or w and w.T); tag other "
        "shared parameters once, or with kfacx.register_generic."
    )


def _gram(factors: Sequence[jax.Array]) -> jax.Array:
    """Frobenius inner products of the factors (vectors: of their diagonal matrices)."""
    flat = jnp.stack([f.reshape(-1) for f in factors])
    return flat @ flat.T


def _as_matrix(f: jax.Array) -> jax.Array:
    return jnp.diag(f) if f.ndim == 1 else f


def _side(f: jax.Array) -> TiedFactor:
    if f.ndim == 1:
        return TiedFactor(linalg.clip_eigenvalues(f), None)
    vals, vecs = linalg.safe_eigh(f)
    return TiedFactor(linalg.clip_eigenvalues(vals), vecs)


def _kron_power(rows: TiedFactor, cols: TiedFactor, w, identity_weight, power):
    """``(R kron C + d I)^power vec(w)`` from the eigendecompositions of ``R`` and ``C``."""
    scale = rows.values[:, None] * cols.values[None, :]
    d = linalg.floor_damping(identity_weight, jnp.sum(rows.values) * jnp.sum(cols.values), w.dtype)
    z = rotate(w, rows.vectors, cols.vectors) * jnp.power(scale + d, power)
    return rotate(z, rows.vectors, cols.vectors, inverse=True)


def _power(side: TiedFactor, b, identity_weight, power):
    d = linalg.floor_damping(identity_weight, jnp.sum(side.values), b.dtype)
    z = rotate(b, side.vectors, None) * jnp.power(side.values + d, power)
    return rotate(z, side.vectors, None, inverse=True)
