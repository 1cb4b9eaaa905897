"""Kronecker-factored block of an embedding lookup, with a diagonal input factor.

An embedding ``y = table[ids]`` is a dense layer on one-hot inputs, so its
input factor ``E[onehot onehot^T]`` is diagonal: the frequency of each id.
The block keeps that diagonal (``vocab`` numbers, never a ``vocab x vocab``
matrix) and the output factor ``G = sum dy dy^T / batch_size``, and acts on
``V[vocab, dim]`` as ``V -> diag(a) V G``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from kfacx import linalg
from kfacx.blocks._base import (
    BlockState,
    CurvatureBlock,
    InverseRefresh,
    LayerInfo,
    cast_to,
    row_mask,
    zeros,
)
from kfacx.blocks._eigenbasis import (
    change_basis,
    identity_stack,
    missing_cached_eigenbasis,
    rotate,
)


def id_frequencies(estimation_data, vocab: int, dtype) -> jax.Array:
    """The input factor of a lookup: how often each id occurs among the real (unmasked)
    rows, ``[vocab]`` (the diagonal of ``E[onehot onehot^T]``)."""
    (ids,) = estimation_data["inputs"]
    ids = ids.reshape(-1)
    mask = row_mask(estimation_data, ids.shape[0])
    weights = jnp.ones(ids.shape, dtype) if mask is None else mask.astype(dtype)
    counts = jnp.zeros((vocab,), dtype).at[ids].add(weights, mode="drop")
    return counts / jnp.maximum(jnp.sum(weights), 1.0)


class EmbeddingEigen(NamedTuple):
    """Eigendecomposition of the output factor (the input factor is diagonal)."""

    outputs_eigenvalues: jax.Array
    outputs_eigenvectors: jax.Array


class EmbeddingPair(NamedTuple):
    """A damped power of both factors: the diagonal of ``(diag(a) + d_a)^p`` and ``(G + d_g)^p``."""

    inputs_diagonal: jax.Array
    outputs: jax.Array


class EmbeddingCache(NamedTuple):
    """What `EmbeddingKroneckerFactored.update_cache` keeps; absent entries are None."""

    eigen: EmbeddingEigen | None
    inverse: EmbeddingPair | None
    inverse_sqrt: EmbeddingPair | None


class EmbeddingKroneckerFactored(CurvatureBlock):
    """K-FAC block of an embedding table ``[vocab, dim]`` with a diagonal input factor.

    Raises:
      ValueError: if the layer's parameter is not a 2-D table.
    """

    def __init__(self, layer: LayerInfo):
        super().__init__(layer)
        shapes = layer.parameter_shapes
        if len(shapes) != 1 or len(shapes[0]) != 2:
            raise ValueError(
                f"EmbeddingKroneckerFactored({layer.name}): expected one [vocab, dim] table, "
                f"got shapes {shapes}."
            )
        self.vocab, self.width = shapes[0]

    def factor_shapes(self):
        return ((self.vocab,), (self.width, self.width))

    def compute_statistics(self, estimation_data, batch_size):
        (dy,) = estimation_data["outputs_tangent"]
        dy = dy.reshape(-1, self.width).astype(self.dtype)
        return id_frequencies(estimation_data, self.vocab, self.dtype), dy.T @ dy / batch_size

    # ---------------------------------------------------------------- cache

    def init_cache(self, exact_powers_to_cache, approx_powers_to_cache, cache_eigenvalues):
        v, d = self.vocab, self.width
        pairs = self._approx_cache_fields(
            approx_powers_to_cache,
            lambda: EmbeddingPair(zeros((v,), self.dtype), zeros((d, d), self.dtype)),
        )
        eigen = None
        if exact_powers_to_cache or cache_eigenvalues:
            eigen = EmbeddingEigen(zeros((d,), self.dtype), identity_stack(d, self.dtype))
        return EmbeddingCache(eigen=eigen, **pairs)

    def update_cache(self, state: BlockState, identity_weight: Any) -> BlockState:
        a, g = (f.value for f in state.factors)
        cache: EmbeddingCache = state.cache
        if cache.eigen is not None:
            cache = cache._replace(eigen=EmbeddingEigen(*linalg.safe_eigh(g)))
        cache = self._refresh_approx_cache(
            cache, lambda power: self._approx_pair_now(a, g, identity_weight, power)
        )
        return state._replace(cache=cache)

    def inverse_refresh(self, state: BlockState, identity_weight: Any) -> InverseRefresh | None:
        cache: EmbeddingCache = state.cache
        if not self._inverse_only(cache):
            return None
        a, g = (f.value for f in state.factors)

        def dampings(traces):
            return self._split_damping(a, traces[0], g.shape[-1], identity_weight)[1:]

        def finish(inverses):
            d_a = self._split_damping(a, jnp.trace(g), g.shape[-1], identity_weight)[0]
            pair = EmbeddingPair(1.0 / (linalg.clip_eigenvalues(a) + d_a), inverses[0])
            return state._replace(cache=cache._replace(inverse=pair))

        return InverseRefresh((g,), dampings, finish)

    def _split_damping(self, a, trace_g, dim_g, identity_weight):
        """Factored damping ``(d_a, d_g)``; ``d_a`` floored for the diagonal factor."""
        a = linalg.clip_eigenvalues(a)
        d_a, d_g = linalg.pi_damping_from_traces(
            jnp.sum(a), trace_g, a.shape[-1], dim_g, identity_weight, a.dtype
        )
        return linalg.floor_damping(d_a, jnp.sum(a), self.dtype), d_g

    def _approx_pair_now(self, a, g, identity_weight, power) -> EmbeddingPair:
        d_a, d_g = self._split_damping(a, jnp.trace(g), g.shape[-1], identity_weight)
        a = linalg.clip_eigenvalues(a)
        if power == -1.0:
            return EmbeddingPair(1.0 / (a + d_a), linalg.psd_inverse(g, d_g))
        return EmbeddingPair(jnp.power(a + d_a, power), linalg.psd_matpower(g, power, d_g))

    # ---------------------------------------------------------------- products

    def _multiply(self, state, vector, identity_weight):
        a, g = (f.value for f in state.factors)
        (v,) = vector
        w = v.astype(self.dtype)
        out = a[:, None] * (w @ g) + jnp.asarray(identity_weight, self.dtype) * w
        return (cast_to(out, v.dtype),)

    def _multiply_matpower(self, state, vector, identity_weight, power, exact_power, use_cached):
        (v,) = vector
        w = v.astype(self.dtype)
        if exact_power:
            out = self._exact(state, w, identity_weight, power, use_cached)
        else:
            pair = self._approx_pair(state, identity_weight, power, use_cached)
            out = pair.inputs_diagonal[:, None] * (w @ pair.outputs)
        return (cast_to(out, v.dtype),)

    def _exact(self, state, w, identity_weight, power, use_cached):
        a = state.factors[0].value
        if use_cached:
            if state.cache.eigen is None:
                raise self._missing_cache("an eigendecomposition", "exact_powers_to_cache=(power,)")
            vals, vecs = state.cache.eigen
        else:
            vals, vecs = linalg.safe_eigh(state.factors[1].value)
        a, vals = linalg.clip_eigenvalues(a), linalg.clip_eigenvalues(vals)
        weight = linalg.floor_damping(identity_weight, jnp.sum(a) * jnp.sum(vals), w.dtype)
        scale = jnp.power(a[:, None] * vals[None, :] + weight, power)
        return ((w @ vecs) * scale) @ vecs.T

    # ---------------------------------------------------------------- eigenbasis

    def to_eigenbasis(self, state: BlockState, vector) -> jax.Array:
        """``V U_G [vocab, dim]`` with ``G``'s eigenvectors of the last refresh (the input
        factor is diagonal: its basis is the identity)."""
        (v,) = self._check_vector(vector)
        return rotate(v.astype(self.dtype), None, self._outputs_basis(state))

    def from_eigenbasis(self, state: BlockState, coordinates: jax.Array) -> tuple[jax.Array]:
        """``C U_G^T``, as the table."""
        return (rotate(coordinates, None, self._outputs_basis(state), inverse=True),)

    def eigenbasis_change(self, old_state, new_state, diagonal: jax.Array) -> jax.Array:
        """``D (R_G o R_G)^T`` with ``R_G = U_new^T U_old``."""
        bases = [(None, self._outputs_basis(s)) for s in (old_state, new_state)]
        return change_basis(diagonal, *bases)

    def _outputs_basis(self, state: BlockState) -> jax.Array:
        if state.cache.eigen is None:
            raise missing_cached_eigenbasis(self)
        return state.cache.eigen.outputs_eigenvectors

    def _approx_pair(self, state, identity_weight, power, use_cached) -> EmbeddingPair:
        a, g = (f.value for f in state.factors)
        return self._approx_cached_or_now(
            state, power, use_cached, lambda: self._approx_pair_now(a, g, identity_weight, power)
        )

    def to_dense_matrix(self, state):
        a, g = (f.value for f in state.factors)
        return jnp.kron(jnp.diag(a), g)
