"""`MappedBlock`: the block of a layer whose parameter is an elementwise map of leaves.

A learned per-feature query scaler ``x * (c * softplus(s))``, a log-scale
``x * exp(log_scale)``, a masked weight ``h @ (w * mask)``, a weight scaled by a
constant: the layer computes with ``w = f(theta)``, ``f`` elementwise (a ``"map"`` step
of a parameter view, `kfacx._helpers._views`). Its curvature in ``theta`` is that of the layer in
``w`` carried through the map's diagonal Jacobian ``D = diag(f'(theta))``:
``F_theta = D F_w D`` (exact for the Gauss-Newton and Fisher matrices, which are
``J^T H J`` with ``J_theta = J_w D``).

`MappedBlock` builds the layer's own block ``C`` for ``w`` (any block class) and keeps
``d = f'(theta)`` at the parameters of the last curvature update in its cache (the
estimation data's ``MAP_SCALES``, which `kfacx.blocks.ViewBlock` computes with
`jax.jvp`). Vectors are shaped like ``w`` (a `ViewBlock` gathers them from the leaves).

* Power 1: ``(D C D + l I) v``, exact.
* Diagonal ``C`` (``eigenbasis_is_identity``: `kfacx.Diagonal`,
  `kfacx.ScaleAndShiftDiagonal`): ``D C D`` is diagonal, every power is exact,
  ``(d^2 c + l)^p v``.
* Other blocks (Kronecker-factored, `kfacx.Full`): ``(D C D + l I)^p`` has no cheap
  form for a general ``D``; it is taken as ``S (C + (l / m) I)^p S + Z`` with
  ``S = diag(sign(d) |d|^p)`` (zero where ``d = 0``), ``m`` the mean of ``d^2`` over the
  entries where ``d != 0`` (1 if none) and ``Z = diag(l^p [d = 0])``. It is exact when
  ``d`` is one constant ``c != 0`` (a weight scaled by a constant, negated or divided by
  one: ``(c^2 C + l I)^p = |c|^{2p} (C + l c^{-2} I)^p``, the inner block's power at the
  damping ``l / c^2``, exact or factored as it computes it), and exact on the entries
  where ``d = 0`` (masked entries: their rows of ``D C D`` are zero, so the damped
  matrix is ``l I`` there). Elsewhere (a mask, ``exp`` or ``softplus`` of a weight
  matrix) it is an approximation that damps every entry by ``l / m`` in ``w``: the
  preconditioned step in ``w`` is the inner block's step, ``D^{-1}`` carries it back.

The damping the inner block's cached powers are refreshed with is ``l / m`` at the
last refresh (`update_cache`, `inverse_refresh`). Any inner block works (EKFAC too: its
basis stays its own business); the block's eigenbasis (`to_eigenbasis`) is the identity
for a diagonal inner block, and there is none otherwise (an eigenbasis of ``D C D`` is
not ``C``'s), so Adam in the eigenbasis (`kfacx.scale_by_kfac_eigen_adam`) does not
serve a mapped Kronecker-factored layer.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from kfacx import linalg
from kfacx.blocks._base import (
    BlockState,
    CurvatureBlock,
    InverseRefresh,
    LayerInfo,
    Params,
    cast_to,
    flatten_params,
    statistics_of,
    unflatten_params,
    zeros,
)
from kfacx.blocks._norms import Factor, kronecker_pieces
from kfacx.blocks._wrapper import WrapperBlock

#: The estimation-data key of ``f'(theta)``, shaped like the layer's parameters.
MAP_SCALES = "params_scales"


class MappedCache(NamedTuple):
    """The cache of a `MappedBlock`.

    Attributes:
      inner: the inner block's cache.
      scales: ``d = f'(theta)`` at the last curvature update, flattened like the
        parameters (zeros before the first).
    """

    inner: Any
    scales: jax.Array


class MappedBlock(WrapperBlock):
    """The curvature ``D C D`` of a layer computing with ``w = f(theta)``, ``f`` elementwise
    with Jacobian ``D = diag(f'(theta))`` (see the module docstring for the powers).

    Args:
      layer: the layer, with the shapes of ``w``.
      inner_ctor: the block class (or factory taking a `LayerInfo`) of the layer in ``w``.

    The state's factors are the inner block's; its cache a `MappedCache`. The statistics
    are the inner block's, then ``d`` and a 1 (so that ``d`` comes out of averages over
    devices and micro-batches, and a coverage's rescaling, unchanged).

    Example::

      block = kfacx.blocks.MappedBlock(layer, kfacx.ScaleAndShiftDiagonal)
    """

    def __init__(self, layer: LayerInfo, inner_ctor: Callable[[LayerInfo], CurvatureBlock]):
        super().__init__(layer)
        self.inner = inner_ctor(layer)
        self.dtype = self.inner.dtype
        self.eigenbasis_is_identity = self.inner.eigenbasis_is_identity

    @property
    def block_name(self) -> str:
        return f"MappedBlock({self.inner.block_name})"

    def __repr__(self) -> str:
        return f"MappedBlock({self.inner!r})"

    # ---------------------------------------------------------------- state

    @staticmethod
    def _inner_state(state: BlockState) -> BlockState:
        return BlockState(state.factors, state.cache.inner)

    @staticmethod
    def _wrap(inner_state: BlockState, scales: jax.Array) -> BlockState:
        return BlockState(inner_state.factors, MappedCache(inner_state.cache, scales))

    def statistics_shapes(self):
        """The inner block's, ``d`` ``[dim]`` and a scalar 1."""
        return (*self.inner.statistics_shapes(), (self.dim,), ())

    def inner_init(self, rng, exact, approx, cache_eigenvalues) -> BlockState:
        """The inner block's fresh state, and ``d = 0``."""
        inner = self.inner.init(rng, exact, approx, cache_eigenvalues)
        return self._wrap(inner, zeros((self.dim,), self.dtype))

    def inner_init_cache(self, exact, approx, cache_eigenvalues):
        inner = self.inner.init_cache(exact, approx, cache_eigenvalues)
        return MappedCache(inner, zeros((self.dim,), self.dtype))

    # ---------------------------------------------------------------- statistics

    def compute_statistics(
        self, estimation_data: Mapping[str, Any], batch_size: Any, state: Any = None
    ) -> tuple[jax.Array, ...]:
        """The inner block's statistics, then ``d`` (from ``MAP_SCALES``) and 1.

        Raises:
          ValueError: if the estimation data has no ``MAP_SCALES``.
        """
        data = dict(estimation_data)
        scales = data.pop(MAP_SCALES, None)
        if scales is None:
            raise ValueError(
                f"{self!r}: the estimation data has no {MAP_SCALES!r} (f'(theta) of the layer's "
                "elementwise map, shaped like its parameters); serve the layer with a "
                "kfacx.blocks.ViewBlock, which computes it from the parameter views."
            )
        inner_state = None if state is None else self._inner_state(state)
        stats = statistics_of(self.inner, data, batch_size, inner_state)
        d = flatten_params(scales).astype(self.dtype)
        return (*stats, d, jnp.ones((), self.dtype))

    def update_from_statistics(
        self, state: BlockState, statistics: Sequence[jax.Array], ema_old: Any, ema_new: Any
    ) -> BlockState:
        """The inner block's update; ``d`` replaced by the new one (kept when ``ema_new``
        is 0: a layer in a branch that did not run)."""
        *inner_stats, d, one = statistics
        inner = self.inner.update_from_statistics(
            self._inner_state(state), tuple(inner_stats), ema_old, ema_new
        )
        fresh = (jnp.asarray(ema_new) > 0) & (one > 0)
        scales = jnp.where(fresh, d / jnp.where(one > 0, one, 1), state.cache.scales)
        return self._wrap(inner, scales.astype(self.dtype))

    def update_cache(self, state: BlockState, identity_weight: Any) -> BlockState:
        """The inner block's refresh at the damping ``identity_weight / m``."""
        scales = state.cache.scales
        weight = self._inner_weight(identity_weight, scales)
        return self._wrap(self.inner.update_cache(self._inner_state(state), weight), scales)

    def inverse_refresh(self, state: BlockState, identity_weight: Any) -> InverseRefresh | None:
        """The inner block's, at the damping ``identity_weight / m``."""
        scales = state.cache.scales
        weight = self._inner_weight(identity_weight, scales)
        refresh = self.inner.inverse_refresh(self._inner_state(state), weight)
        if refresh is None:
            return None

        def finish(inverses: Sequence[jax.Array]) -> BlockState:
            return self._wrap(refresh.finish(inverses), scales)

        return InverseRefresh(refresh.matrices, refresh.dampings, finish)

    def _inner_weight(self, identity_weight: Any, scales: jax.Array) -> jax.Array:
        """``identity_weight / m``, ``m`` the mean of ``d^2`` where ``d != 0`` (1 if none)."""
        nonzero = scales != 0
        count = jnp.sum(nonzero)
        m = jnp.sum(jnp.square(scales)) / jnp.maximum(count, 1)
        m = jnp.where((count > 0) & (m > 0), m, 1)
        return jnp.asarray(identity_weight, self.dtype) / m.astype(self.dtype)

    # ---------------------------------------------------------------- products

    def _multiply(self, state, vector, identity_weight) -> Params:
        if self.eigenbasis_is_identity:
            return self._diagonal_power(state, vector, identity_weight, 1.0)
        d = state.cache.scales
        u = flatten_params(vector).astype(self.dtype)
        inner = self.inner.multiply(self._inner_state(state), self._shaped(d * u), 0.0)
        out = d * flatten_params(inner).astype(self.dtype) + identity_weight * u
        return self._cast_like(out, vector)

    def _multiply_matpower(self, state, vector, identity_weight, power, exact_power, use_cached):
        if self.eigenbasis_is_identity:
            return self._diagonal_power(state, vector, identity_weight, power)
        d = state.cache.scales
        s = jnp.where(d != 0, jnp.sign(d) * jnp.power(jnp.abs(jnp.where(d != 0, d, 1)), power), 0)
        u = flatten_params(vector).astype(self.dtype)
        weight = self._inner_weight(identity_weight, d)
        inner = self.inner.multiply_matpower(
            self._inner_state(state), self._shaped(s * u), weight, power, exact_power, use_cached
        )
        damping = jnp.maximum(jnp.asarray(identity_weight, self.dtype), jnp.finfo(self.dtype).tiny)
        masked = jnp.where(d == 0, jnp.power(damping, power), 0)
        out = s * flatten_params(inner).astype(self.dtype) + masked * u
        return self._cast_like(out, vector)

    def _diagonal_power(self, state, vector, identity_weight, power) -> Params:
        """``(d^2 c + l)^p v`` for a diagonal inner block ``c`` (non-finite entries count
        as zero, the damping is floored at ``eps * trace`` as the diagonal blocks do)."""
        x = self._diagonal(state)
        weight = linalg.floor_damping(identity_weight, jnp.sum(x), self.dtype)
        out = jnp.power(x + weight, power) * flatten_params(vector).astype(self.dtype)
        return self._cast_like(out, vector)

    def _diagonal(self, state: BlockState) -> jax.Array:
        """``d^2 c``: the diagonal of ``D C D`` for a diagonal inner block."""
        pieces = kronecker_pieces(self.inner, self._inner_state(state))
        c = jnp.concatenate([_piece_diagonal(p) for p in pieces]).astype(self.dtype)
        return linalg.clip_eigenvalues(jnp.square(state.cache.scales) * c)

    def _shaped(self, flat: jax.Array) -> Params:
        return unflatten_params(flat, self.parameters_shapes)

    def _cast_like(self, flat: jax.Array, like: Sequence[jax.Array]) -> Params:
        return tuple(cast_to(p, v.dtype) for p, v in zip(self._shaped(flat), like, strict=True))

    # ---------------------------------------------------------------- norms, dense

    def norm_pieces(self, state: BlockState) -> list:
        """``d^2 c`` for a diagonal inner block, else the dense matrix (one piece)."""
        if self.eigenbasis_is_identity:
            return [(Factor(self._diagonal(state), False),)]
        return [(Factor(self.to_dense_matrix(state), True),)]

    def to_dense_matrix(self, state: BlockState) -> jax.Array:
        """``D C D``."""
        d = state.cache.scales
        inner = self.inner.to_dense_matrix(self._inner_state(state)).astype(self.dtype)
        return d[:, None] * inner * d[None, :]


def _piece_diagonal(piece: Sequence[Factor]) -> jax.Array:
    """The diagonal of a Kronecker piece (`kfacx.blocks.kronecker_pieces`), flattened."""
    out = None
    for f in piece:
        v = jnp.diagonal(f.value, axis1=-2, axis2=-1) if f.is_matrix else f.value
        out = v if out is None else (out[..., :, None] * v[..., None, :]).reshape(-1)
    return out.reshape(-1)
