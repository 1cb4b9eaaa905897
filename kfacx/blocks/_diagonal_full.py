"""Diagonal and full blocks estimated from per-example parameter gradients.

``Diagonal`` keeps ``sum_rows g^2 / batch_size`` per parameter entry; ``Full``
keeps ``sum_rows vec(g) vec(g)^T / batch_size`` over all the layer's parameters.
``Diagonal`` and ``Full`` work for any tag (through the tag's ``compute``
function, or the parameter gradient itself for the generic tag); the
``ScaleAndShift`` variants use the closed-form gradients of ``x * scale + shift``.
"""

from __future__ import annotations

import abc
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from kfacx import linalg
from kfacx.blocks import _per_example
from kfacx.blocks._base import (
    CurvatureBlock,
    LayerInfo,
    cast_to,
    flatten_params,
    unflatten_params,
    zeros,
)
from kfacx.blocks._eigenbasis import (
    change_basis,
    identity_stack,
    missing_cached_eigenbasis,
    rotate,
)


class _AbstractDiagonal(CurvatureBlock):
    """A diagonal block; subclasses say how per-example gradients are computed."""

    #: Its eigenbasis is the identity: Adam in the eigenbasis is plain Adam here.
    eigenbasis_is_identity = True

    @abc.abstractmethod
    def per_example_gradients(self, estimation_data) -> tuple[jax.Array, ...]:
        """``[rows, *param_shape]`` per parameter."""

    def factor_shapes(self):
        return self.parameters_shapes

    def compute_statistics(self, estimation_data, batch_size):
        grads = self.per_example_gradients(estimation_data)
        return tuple(jnp.sum(jnp.square(g.astype(self.dtype)), axis=0) / batch_size for g in grads)

    def init_cache(self, exact_powers_to_cache, approx_powers_to_cache, cache_eigenvalues):
        return None  # Powers of a diagonal are computed on the fly.

    def update_cache(self, state, identity_weight):
        return state

    def _multiply(self, state, vector, identity_weight):
        return self._multiply_matpower(state, vector, identity_weight, 1.0, True, False)

    def _multiply_matpower(self, state, vector, identity_weight, power, exact_power, use_cached):
        del exact_power, use_cached  # Exact and cheap.
        # Non-finite entries count as zero; the damping is floored at eps * trace.
        values = [linalg.clip_eigenvalues(f.value) for f in state.factors]
        trace = sum(jnp.sum(x) for x in values)
        weight = linalg.floor_damping(identity_weight, trace, self.dtype)
        return tuple(
            cast_to(jnp.power(x + weight, power) * v.astype(self.dtype), v.dtype)
            for x, v in zip(values, vector, strict=True)
        )

    def to_dense_matrix(self, state):
        return jnp.diag(flatten_params([f.value for f in state.factors]))


class Diagonal(_AbstractDiagonal):
    """Diagonal block for any layer tag (or any single parameter)."""

    def per_example_gradients(self, estimation_data):
        return _per_example.generic_per_example_gradients(self.layer, estimation_data)


class ScaleAndShiftDiagonal(_AbstractDiagonal):
    """Diagonal block of a scale-and-shift layer (closed-form per-example gradients)."""

    def __init__(self, layer: LayerInfo):
        super().__init__(layer)
        _check_scale_and_shift(self)

    def per_example_gradients(self, estimation_data):
        return _per_example.scale_and_shift_per_example_gradients(self.layer, estimation_data)


class FullEigen(NamedTuple):
    """Eigendecomposition of a full block (eigenvalues clipped at zero)."""

    eigenvalues: jax.Array
    eigenvectors: jax.Array


class _AbstractFull(CurvatureBlock):
    """A full (dense) block; subclasses say how per-example gradients are computed."""

    @abc.abstractmethod
    def per_example_gradients(self, estimation_data) -> tuple[jax.Array, ...]:
        """``[rows, *param_shape]`` per parameter."""

    def factor_shapes(self):
        return ((self.dim, self.dim),)

    def compute_statistics(self, estimation_data, batch_size):
        grads = self.per_example_gradients(estimation_data)
        rows = jnp.concatenate([g.reshape(g.shape[0], -1) for g in grads], axis=1)
        rows = rows.astype(self.dtype)
        return (rows.T @ rows / batch_size,)

    def init_cache(self, exact_powers_to_cache, approx_powers_to_cache, cache_eigenvalues):
        if not (exact_powers_to_cache or approx_powers_to_cache or cache_eigenvalues):
            return None
        return FullEigen(zeros((self.dim,), self.dtype), identity_stack(self.dim, self.dtype))

    def update_cache(self, state, identity_weight):
        if state.cache is None:
            return state
        return state._replace(cache=FullEigen(*linalg.safe_eigh(state.factors[0].value)))

    def _multiply(self, state, vector, identity_weight):
        v = flatten_params(vector).astype(self.dtype)
        out = state.factors[0].value @ v + jnp.asarray(identity_weight, self.dtype) * v
        return self._unflatten(out, vector)

    def _multiply_matpower(self, state, vector, identity_weight, power, exact_power, use_cached):
        del exact_power  # A full block's powers are always exact.
        if use_cached:
            if state.cache is None:
                raise self._missing_cache("an eigendecomposition", "exact_powers_to_cache=(power,)")
            vals, vecs = state.cache
        else:
            vals, vecs = linalg.safe_eigh(state.factors[0].value)
        v = flatten_params(vector).astype(self.dtype)
        vals = linalg.clip_eigenvalues(vals)
        weight = linalg.floor_damping(identity_weight, jnp.sum(vals), self.dtype)
        scale = jnp.power(vals + weight, power)
        return self._unflatten(vecs @ (scale * (vecs.T @ v)), vector)

    def to_eigenbasis(self, state, vector) -> jax.Array:
        """``U^T v [dim]`` with the eigenvectors of the last refresh (the cache must hold
        them: ``cache_eigenvalues=True``)."""
        v = flatten_params(self._check_vector(vector)).astype(self.dtype)
        return rotate(v, self._basis(state), None)

    def from_eigenbasis(self, state, coordinates: jax.Array):
        """``U c``, as parameters."""
        flat = rotate(coordinates, self._basis(state), None, inverse=True)
        return unflatten_params(flat, self.parameters_shapes)

    def eigenbasis_change(self, old_state, new_state, diagonal: jax.Array) -> jax.Array:
        """``(R o R) d`` with ``R = U_new^T U_old``."""
        bases = [(self._basis(s), None) for s in (old_state, new_state)]
        return change_basis(diagonal, *bases)

    def _basis(self, state) -> jax.Array:
        if state.cache is None:
            raise missing_cached_eigenbasis(self)
        return state.cache.eigenvectors

    def _unflatten(self, flat, like):
        return tuple(
            cast_to(p, v.dtype)
            for p, v in zip(unflatten_params(flat, self.parameters_shapes), like, strict=True)
        )

    def to_dense_matrix(self, state):
        return state.factors[0].value


class Full(_AbstractFull):
    """Full block over all parameters of any layer tag (or any parameter)."""

    def per_example_gradients(self, estimation_data):
        return _per_example.generic_per_example_gradients(self.layer, estimation_data)


class ScaleAndShiftFull(_AbstractFull):
    """Full block of a scale-and-shift layer (closed-form per-example gradients)."""

    def __init__(self, layer: LayerInfo):
        super().__init__(layer)
        _check_scale_and_shift(self)

    def per_example_gradients(self, estimation_data):
        return _per_example.scale_and_shift_per_example_gradients(self.layer, estimation_data)


def _check_scale_and_shift(block: Any) -> None:
    meta = block.layer.meta
    if "has_scale" not in meta or "has_shift" not in meta:
        raise ValueError(
            f"{type(block).__name__}({block.layer.name}): the tag has no has_scale/has_shift "
            "metadata; register the layer with kfacx.register_scale_and_shift."
        )
    if len(block.parameters_shapes) != int(meta["has_scale"]) + int(meta["has_shift"]):
        raise ValueError(f"{block!r}: parameter count does not match has_scale/has_shift.")
