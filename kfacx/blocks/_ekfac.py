"""EKFAC (eigenvalue-corrected K-FAC) blocks for dense, conv and embedding layers.

K-FAC approximates a layer's curvature by ``A (x) G``; in the eigenbasis
``Q = U_A (x) U_G`` of the two factors that is the diagonal matrix of the
products of their eigenvalues. EKFAC (George et al., NeurIPS 2018) keeps the
basis but replaces that diagonal by the best one: the second moments of the
gradients rotated into the basis,

``S[i, j] = E[(U_A^T G_n U_G)[i, j]^2]``,   curvature ``Q diag(S) Q^T``,

where ``G_n`` is example ``n``'s gradient as a matrix (rows: inputs with the bias
last, columns: outputs; one matrix per feature group). ``Q diag(S) Q^T`` is the
matrix of the form ``Q D Q^T`` nearest (Frobenius) to the Fisher ``E[g g^T]`` of those
gradients, so it is at least as close to it as K-FAC's ``Q diag(a_i g_j) Q^T``.

Statistics. The moving averages of ``A`` and ``G`` are K-FAC's (shared positions:
every example at every position a row, as in `DenseTwoKroneckerFactored` and
`ConvTwoKroneckerFactored`). The per-example gradient sums the rows of the example,
``G[s, n] = sum_p x[n, p] dy[s, n, p]^T`` (sample ``s``), so the scaling sees the
correlation between positions that K-FAC's factors ignore; the uses of a layer
applied several times with the same weights (a `lax.scan` closing over them, or
tied uses of one kind; `kfacx.blocks.LayerInfo.num_uses`) count as positions
too. With one position and one use per example the scaling is
``((x U_A)^2)^T ((dy U_G)^2)``, a matmul. As with the other blocks,
the cotangents' second moments are summed over samples and the statistics divided
by the batch size; padding examples have zero cotangents and add nothing.

The basis. The scaling is a moving average taken in the basis of the last
cache refresh (the identity before the first: the scaling is then the diagonal
Fisher), so its statistics are computed from the block's state
(``statistics_need_state``: the estimator passes it to `compute_statistics`).
A refresh takes the eigenvectors of the current ``A`` and ``G`` and re-expresses
the scaling in them: ``S' = (R_A o R_A) S (R_G o R_G)^T`` with ``R = U_new^T U_old``
is the diagonal, in the new basis, of the curvature the old basis and scaling
describe (the nearest matrix of the new form to it). Both live in the cache,
which a distributed refresh shares among the devices.

Products. ``(Q diag(S) Q^T + l I)^p v = Q diag((S + l)^p) Q^T v``: the exact
damped power at any power, for the price of four matmuls per group. EKFAC has
no cheaper approximate form, so ``exact_power`` makes no difference and
``use_cached`` only says that the (always cached) basis may be used.

References:
  T. George, C. Laurent, X. Bouthillier, N. Ballas and P. Vincent, "Fast
  Approximate Natural Gradient Descent in a Kronecker-factored Eigenbasis",
  NeurIPS 2018 (arXiv:1806.03884).
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from kfacx import linalg
from kfacx.blocks._base import (
    BlockState,
    CurvatureBlock,
    Params,
    WeightedMovingAverage,
    cast_to,
    flatten_params,
    row_mask,
    unflatten_params,
)
from kfacx.blocks._eigenbasis import change_basis, identity_stack, rotate
from kfacx.blocks._embedding import EmbeddingKroneckerFactored
from kfacx.blocks._kronecker import (
    ConvTwoKroneckerFactored,
    DenseTwoKroneckerFactored,
    TwoKroneckerFactored,
)
from kfacx.blocks._norms import Factor


class EKFACCache(NamedTuple):
    """What an EKFAC block keeps besides the factors ``A`` and ``G``.

    Attributes:
      inputs_basis: ``U_A [groups, n, n]``, the eigenvectors of ``A`` at the last
        refresh (the identity before); None for an embedding, whose input factor
        is diagonal (its basis is the identity).
      outputs_basis: ``U_G [groups, m, m]``, likewise for ``G``.
      scaling: the moving average of the scaling ``S [groups, n, m]`` in that basis.
    """

    inputs_basis: jax.Array | None
    outputs_basis: jax.Array
    scaling: WeightedMovingAverage


def _scaled_power(scaling: jax.Array, identity_weight: Any, power: float) -> jax.Array:
    """``(S + l)^p`` per group, ``l`` floored at the group's ``eps * sum(S)``
    (`kfacx.linalg.floor_damping`)."""
    scaling = linalg.clip_eigenvalues(scaling)
    trace = jnp.sum(scaling, axis=(-2, -1))
    damping = linalg.floor_damping(identity_weight, trace, scaling.dtype)[..., None, None]
    return jnp.power(scaling + damping, power)


def _bases(cache: EKFACCache) -> tuple[jax.Array | None, jax.Array]:
    return cache.inputs_basis, cache.outputs_basis


class _EKFACBlock(CurvatureBlock):
    """What the EKFAC blocks share (module docstring): the cache, the refresh and the
    products in the eigenbasis, over a layout ``[groups, n, m]`` of the parameters.

    Subclasses give the layout (``params_to_matrix`` / ``matrix_to_params`` and
    `_layout`), the factors' eigenvectors (`_new_bases`) and statistics
    (`_kfac_statistics`), and the scaling's (`_scaling_statistic`).
    """

    #: `compute_statistics` reads the basis from the block's state.
    statistics_need_state = True

    #: Whether the input factor is diagonal (its basis the identity, kept as None).
    _diagonal_inputs = False

    # -------------------------------------------------------------- subclass API

    @abc.abstractmethod
    def _layout(self) -> tuple[int, int, int]:
        """``(groups, n, m)`` of the parameters as matrices."""

    @abc.abstractmethod
    def _new_bases(self, state: BlockState) -> tuple[jax.Array | None, jax.Array]:
        """The eigenvectors of the current factors ``(U_A or None, U_G)``."""

    @abc.abstractmethod
    def _kfac_statistics(self, estimation_data, batch_size) -> tuple[jax.Array, jax.Array]:
        """This batch's statistics of the factors ``A`` and ``G`` (K-FAC's)."""

    @abc.abstractmethod
    def _scaling_statistic(self, estimation_data, batch_size, cache: EKFACCache) -> jax.Array:
        """This batch's scaling ``[groups, n, m]`` in the basis of ``cache``."""

    # -------------------------------------------------------------- state

    def statistics_shapes(self) -> tuple[tuple[int, ...], ...]:
        """K-FAC's factors and the scaling ``[groups, n, m]``."""
        return (*self.factor_shapes(), self._layout())

    def init_cache(self, exact_powers_to_cache, approx_powers_to_cache, cache_eigenvalues):
        """The identity basis and a zero scaling; every power is available (module
        docstring), so the requested powers need no cache of their own."""
        del exact_powers_to_cache, approx_powers_to_cache, cache_eigenvalues
        g, n, m = self._layout()
        inputs = None if self._diagonal_inputs else identity_stack(n, self.dtype, (g,))
        outputs = identity_stack(m, self.dtype, (g,))
        return EKFACCache(inputs, outputs, WeightedMovingAverage.zeros((g, n, m), self.dtype))

    def inverse_refresh(self, state: BlockState, identity_weight: Any) -> None:
        """None: the refresh is eigendecompositions (`update_cache`)."""
        del state, identity_weight

    def update_from_statistics(
        self, state: BlockState, statistics: Sequence[jax.Array], ema_old: Any, ema_new: Any
    ) -> BlockState:
        """Folds ``(A, G, S)`` in: the factors' moving averages and the cached scaling's."""
        a_stat, g_stat, s_stat = statistics
        factors = tuple(
            f.update(s, ema_old, ema_new)
            for f, s in zip(state.factors, (a_stat, g_stat), strict=True)
        )
        cache: EKFACCache = state.cache
        cache = cache._replace(scaling=cache.scaling.update(s_stat, ema_old, ema_new))
        return BlockState(factors, cache)

    def update_cache(self, state: BlockState, identity_weight: Any) -> BlockState:
        """The eigenbasis of the current factors, and the scaling re-expressed in it
        (module docstring)."""
        del identity_weight
        cache: EKFACCache = state.cache
        new_bases = self._new_bases(state)
        raw = change_basis(cache.scaling.raw_value, _bases(cache), new_bases)
        scaling = cache.scaling._replace(raw_value=raw)
        return state._replace(cache=EKFACCache(*new_bases, scaling))

    # -------------------------------------------------------------- statistics

    def compute_statistics(
        self,
        estimation_data: Mapping[str, Sequence[jax.Array]],
        batch_size: Any,
        state: BlockState | None = None,
    ) -> tuple[jax.Array, ...]:
        """This batch's ``(A, G, S)``: K-FAC's factors and the scaling in the basis of
        ``state``'s cache.

        Raises:
          ValueError: without ``state``.
        """
        if state is None:
            raise ValueError(
                f"{self!r}: EKFAC's statistics are taken in the eigenbasis kept in the block's "
                "state; pass compute_statistics(..., state=block_state) (the estimator's "
                "compute_curvature_stats / value_grads_and_curvature_stats take "
                "estimator_state=...; inside optax: kfacx.estimator_state(opt_state))."
            )
        cache: EKFACCache = state.cache
        factors = self._kfac_statistics(estimation_data, batch_size)
        scaling = self._scaling_statistic(estimation_data, batch_size, cache)
        return (*factors, scaling)

    # -------------------------------------------------------------- eigenbasis

    def to_eigenbasis(self, state: BlockState, vector: Sequence[jax.Array]) -> jax.Array:
        """``U_A^T V U_G [groups, n, m]`` in the basis the scaling is kept in."""
        v = self.params_to_matrix(self._check_vector(vector)).astype(self.dtype)
        return rotate(v, *_bases(state.cache))

    def from_eigenbasis(self, state: BlockState, coordinates: jax.Array) -> Params:
        """``U_A C U_G^T`` per group, as parameters."""
        return self.matrix_to_params(rotate(coordinates, *_bases(state.cache), inverse=True))

    def eigenbasis_change(self, old_state, new_state, diagonal: jax.Array) -> jax.Array:
        """``(R_A o R_A) D (R_G o R_G)^T`` with ``R = U_new^T U_old``: as the scaling's."""
        return change_basis(diagonal, _bases(old_state.cache), _bases(new_state.cache))

    # -------------------------------------------------------------- products

    def _scaling(self, state: BlockState) -> jax.Array:
        return state.cache.scaling.value

    def _apply(self, state: BlockState, vector: Params, scale: jax.Array) -> Params:
        out = self.from_eigenbasis(state, self.to_eigenbasis(state, vector) * scale)
        return tuple(cast_to(p, x.dtype) for p, x in zip(out, vector, strict=True))

    def _multiply(self, state, vector, identity_weight):
        scale = self._scaling(state) + jnp.asarray(identity_weight, self.dtype)
        return self._apply(state, vector, scale)

    def _multiply_matpower(self, state, vector, identity_weight, power, exact_power, use_cached):
        del exact_power, use_cached
        return self._apply(
            state, vector, _scaled_power(self._scaling(state), identity_weight, power)
        )

    def to_dense_matrix(self, state: BlockState) -> jax.Array:
        """``Q diag(S) Q^T`` over the flattened parameters: the products with the
        unit vectors."""
        eye = jnp.eye(self.dim, dtype=self.dtype)

        def column(e):
            vec = unflatten_params(e, self.parameters_shapes)
            return flatten_params(self._multiply(state, vec, 0.0))

        return jax.vmap(column)(eye).T

    def norm_pieces(self, state: BlockState) -> list:
        """For `kfacx.blocks.block_norm`: ``Q diag(S) Q^T`` has the norms of ``diag(S)``."""
        g, n, m = self._layout()
        return [(Factor(self._scaling(state).reshape(g, n * m), False),)]


class _KroneckerEKFAC(_EKFACBlock, TwoKroneckerFactored):
    """EKFAC over a K-FAC block's layout: the rows of ``input_rows`` and ``cotangent_rows``
    (next in the method order), the per-example gradients summed over positions."""

    def _layout(self):
        return self.num_groups, self.input_size, self.output_size

    def _new_bases(self, state):
        a, g = self.factor_values(state)
        return linalg.safe_eigh(a)[1], linalg.safe_eigh(g)[1]

    @abc.abstractmethod
    def _num_examples(self, estimation_data) -> int:
        """The size of the inputs' batch axis: the examples times the layer's uses."""

    def _scaling_statistic(self, estimation_data, batch_size, cache: EKFACCache):
        (x,) = estimation_data["inputs"]
        (dy,) = estimation_data["outputs_tangent"]
        rows = self.input_rows(x)  # [R, groups, n]
        dy = self.cotangent_rows(dy)  # [S, R, groups, m]
        mask = row_mask(estimation_data, rows.shape[0])
        if mask is not None:  # Keeps non-finite padding inputs out.
            rows = jnp.where(mask[:, None, None] > 0, rows, 0.0)
        rows = jnp.einsum("rgi,gij->rgj", rows, cache.inputs_basis)
        dy = jnp.einsum("srgi,gij->srgj", dy, cache.outputs_basis)
        uses = self.layer.num_uses
        examples = self._num_examples(estimation_data) // uses
        positions = rows.shape[0] // (uses * examples)
        if uses * positions == 1:
            dy_sq = jnp.sum(jnp.square(dy), axis=0)  # [R, groups, m]
            return jnp.einsum("rgi,rgj->gij", jnp.square(rows), dy_sq) / batch_size
        # Rows are [uses, examples, positions] (uses folded use-major into the batch axis):
        # an example's gradient sums its uses and positions.
        rows = rows.reshape(uses, examples, positions, *rows.shape[1:])
        dy = dy.reshape(dy.shape[0], uses, examples, positions, *dy.shape[2:])
        grads = jnp.einsum("uepgi,suepgj->segij", rows, dy)
        return jnp.sum(jnp.square(grads), axis=(0, 1)) / batch_size


class DenseEKFAC(_KroneckerEKFAC, DenseTwoKroneckerFactored):
    """EKFAC block of a dense layer (module docstring). Its layout, contractions and
    factor statistics are `DenseTwoKroneckerFactored`'s; every free axis of the input
    after the first (the example axis) is a position of the example.

    Raises:
      ValueError: if the parameters do not fit the tag's contraction.
    """

    def _kfac_statistics(self, estimation_data, batch_size):
        return DenseTwoKroneckerFactored.compute_statistics(self, estimation_data, batch_size)

    def _num_examples(self, estimation_data):
        return estimation_data["inputs"][0].shape[0]


class ConvEKFAC(_KroneckerEKFAC, ConvTwoKroneckerFactored):
    """EKFAC block of a convolution (module docstring): its layout, patches and factor
    statistics are `ConvTwoKroneckerFactored`'s, the output pixels the positions of
    an example.

    Raises:
      ValueError: if the layer's metadata does not describe a convolution.
    """

    def _kfac_statistics(self, estimation_data, batch_size):
        return ConvTwoKroneckerFactored.compute_statistics(self, estimation_data, batch_size)

    def _num_examples(self, estimation_data):
        return estimation_data["inputs"][0].shape[self.dnums.lhs_spec[0]]


class EmbeddingEKFAC(_EKFACBlock, EmbeddingKroneckerFactored):
    """EKFAC block of an embedding table ``[vocab, dim]`` (module docstring). The input
    factor is diagonal (`EmbeddingKroneckerFactored`), so the input basis is the
    identity and the scaling ``S[v, j]`` is the second moment of each example's
    gradient of row ``v`` rotated by ``U_G``: the rotated cotangents summed over the
    positions of the example that look up ``v``.

    Raises:
      ValueError: if the layer's parameter is not a 2-D table.
    """

    _diagonal_inputs = True

    def _layout(self):
        return 1, self.vocab, self.width

    def params_to_matrix(self, params):
        (table,) = params
        return table[None]

    def matrix_to_params(self, matrix):
        return (matrix[0],)

    def _new_bases(self, state):
        return None, linalg.safe_eigh(state.factors[1].value)[1][None]

    def _kfac_statistics(self, estimation_data, batch_size):
        return EmbeddingKroneckerFactored.compute_statistics(self, estimation_data, batch_size)

    def _scaling_statistic(self, estimation_data, batch_size, cache: EKFACCache):
        (ids,) = estimation_data["inputs"]
        (dy,) = estimation_data["outputs_tangent"]
        examples = ids.shape[0] // self.layer.num_uses  # uses folded use-major
        ids = ids.reshape(-1)
        dy = dy.reshape(dy.shape[0], -1, self.width).astype(self.dtype) @ cache.outputs_basis[0]
        rows = ids.shape[0]
        if rows == examples:
            scaling = jnp.zeros((self.vocab, self.width), self.dtype)
            scaling = scaling.at[ids].add(jnp.sum(jnp.square(dy), axis=0), mode="drop")
            return scaling[None] / batch_size
        # An example's gradient of row v sums its positions that look up v: group the rows
        # by (example, id), sum each group, square, then add each group to its id.
        per_use = rows // self.layer.num_uses
        example = jnp.repeat(jnp.arange(examples), per_use // examples, total_repeat_length=per_use)
        example = jnp.tile(example, self.layer.num_uses)
        order = jnp.lexsort((ids, example))
        ids_sorted, example_sorted = ids[order], example[order]
        starts = jnp.concatenate(
            [
                jnp.ones((1,), bool),
                (ids_sorted[1:] != ids_sorted[:-1]) | (example_sorted[1:] != example_sorted[:-1]),
            ]
        )
        group = jnp.cumsum(starts) - 1  # [rows]: the group of each sorted row
        sums = jax.ops.segment_sum(
            jnp.moveaxis(dy[:, order], 1, 0), group, num_segments=rows
        )  # [rows (groups), samples, width]
        group_sq = jnp.sum(jnp.square(sums), axis=1)
        group_ids = jnp.zeros((rows,), ids.dtype).at[group].set(ids_sorted)
        # Unused groups (beyond the last) have zero sums; their id 0 adds nothing.
        scaling = jnp.zeros((self.vocab, self.width), self.dtype)
        scaling = scaling.at[group_ids].add(group_sq, mode="drop")
        return scaling[None] / batch_size
