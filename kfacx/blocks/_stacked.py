"""`StackedBlock`: ``L`` independent layers whose parameters are stacked along a leading axis.

A layer inside a `lax.scan` that scans over its parameters (``hk.layer_stack``:
iteration ``l`` uses slice ``l`` of every parameter ``[L, ...]``) is ``L``
separate layers. `StackedBlock` wraps the block of one slice (any
`CurvatureBlock` class, built from `LayerInfo.unstacked`) and `jax.vmap`s it
over the layer axis: the curvature is block-diagonal over the slices.

Axis convention (the layer axis is the leading axis of everything a slice
has, the samples axis stays first as for every block):

- parameters and vectors: ``[L, *slice_shape]`` per parameter;
- estimation data: ``inputs``, ``outputs`` and ``params`` are ``[L, *slice_shape]``;
  ``outputs_tangent`` is ``[num_samples, L, *slice_output_shape]``, i.e.
  ``[num_samples, *outputs.shape]`` as for any block (this is what
  `kfacx.tracer.LayerTagsVjp.sampled` returns for a stacked layer); the
  per-example ``mask`` ``[batch]`` is the same for every slice, a per-slice
  mask is ``[L, batch]`` (a layer in a cond branch inside the scan, which
  ran in some iterations only); other entries are the same for every slice;
- statistics (`compute_statistics`, `update_from_statistics`): the inner
  block's, with a leading ``L`` axis; the moving-average weights
  ``ema_old`` / ``ema_new`` are scalars or per slice ``[L]``;
- state: every array of the inner block's `BlockState` gets a leading ``L``
  axis (so do the moving averages' weights).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kfacx.blocks._base import BlockState, CurvatureBlock, InverseRefresh, LayerInfo, Params
from kfacx.blocks._diagonal_full import _AbstractFull
from kfacx.blocks._kronecker import TwoKroneckerFactored
from kfacx.blocks._wrapper import WrapperBlock

#: `update_cache` implementations that accept states with extra leading (stack) axes.
_STACK_AWARE_UPDATE_CACHE = (TwoKroneckerFactored.update_cache, _AbstractFull.update_cache)

#: The axis of the layer (stack) dimension in each field of the estimation data; the
#: other fields (e.g. the per-example ``"mask"``) are shared by all slices.
DATA_LAYER_AXES = {"inputs": 0, "outputs": 0, "params": 0, "outputs_tangent": 1}


class StackedBlock(WrapperBlock):
    """Block-diagonal curvature over the slices of a stacked layer.

    Args:
      layer: the stacked layer (``layer.stack_size`` is ``L``; parameter shapes
        ``[L, ...]``).
      inner_ctor: the block class (or factory taking a `LayerInfo`) of one
        slice; it is built from ``layer.unstacked()``.

    The dense matrix is over the stacked parameters flattened row-major in the
    tag's order (parameter ``p`` of shape ``[L, *s_p]`` contributes entries
    ``l * prod(s_p) + k``), like any block's; it is block-diagonal over ``l``.
    See the module docstring for the axis convention of data, vectors and state.

    Raises:
      ValueError: if the layer is not stacked.

    Example::

      block = kfacx.blocks.StackedBlock(layer, kfacx.blocks.DenseTwoKroneckerFactored)
    """

    def __init__(self, layer: LayerInfo, inner_ctor: Callable[[LayerInfo], CurvatureBlock]):
        if not layer.stack_size:
            raise ValueError(
                f"StackedBlock({layer.name}): the layer is not stacked (stack_size="
                f"{layer.stack_size}); use the inner block class directly."
            )
        super().__init__(layer)
        self.stack_size = int(layer.stack_size)
        self.inner = inner_ctor(layer.unstacked())
        self.dtype = self.inner.dtype

    @property
    def block_name(self) -> str:
        return f"StackedBlock({self.inner.block_name})"

    def __repr__(self) -> str:
        return f"StackedBlock({self.stack_size} x {self.inner!r})"

    # ---------------------------------------------------------------- state

    def factor_shapes(self):
        return tuple((self.stack_size, *s) for s in self.inner.factor_shapes())

    def statistics_shapes(self):
        return tuple((self.stack_size, *s) for s in self.inner.statistics_shapes())

    def inner_init(self, rng, exact, approx, cache_eigenvalues) -> BlockState:
        """The inner block's fresh state for each slice (one rng per slice), stacked."""
        rngs = jax.random.split(rng, self.stack_size)
        return jax.vmap(lambda r: self.inner.init(r, exact, approx, cache_eigenvalues))(rngs)

    def inner_init_cache(self, exact, approx, cache_eigenvalues):
        return jax.vmap(lambda _: self.inner.init_cache(exact, approx, cache_eigenvalues))(
            jnp.zeros((self.stack_size,))
        )

    # ---------------------------------------------------------------- statistics

    def _data_axes(self, estimation_data: Mapping[str, Any]) -> dict[str, int | None]:
        axes = {key: DATA_LAYER_AXES.get(key) for key in estimation_data}
        if "mask" in axes and jnp.ndim(estimation_data["mask"]) == 2:
            axes["mask"] = 0  # per slice: [L, batch]
        return axes

    def compute_statistics(self, estimation_data, batch_size, state=None):
        data = dict(estimation_data)
        axes = self._data_axes(data)
        if not self.statistics_need_state:
            return jax.vmap(
                lambda d: self.inner.compute_statistics(d, batch_size), in_axes=(axes,)
            )(data)
        return jax.vmap(
            lambda d, s: self.inner.compute_statistics(d, batch_size, state=s), in_axes=(axes, 0)
        )(data, state)

    def update_curvature_matrix_estimate(
        self,
        state: BlockState,
        estimation_data: Mapping[str, Sequence[jax.Array]],
        ema_old: Any,
        ema_new: Any,
        batch_size: int,
        pmap_axis_name: str | None = None,
    ) -> BlockState:
        """The inner block's update, slice by slice (see the module docstring for the axes)."""
        data = dict(estimation_data)

        def update(s, d):
            return self.inner.update_curvature_matrix_estimate(
                s, d, ema_old, ema_new, batch_size, pmap_axis_name
            )

        return jax.vmap(update, in_axes=(0, self._data_axes(data)))(state, data)

    def update_from_statistics(
        self, state: BlockState, statistics: Sequence[jax.Array], ema_old: Any, ema_new: Any
    ) -> BlockState:
        """The inner block's update from statistics, slice by slice (leading ``L`` axis;
        the moving-average weights are scalars or per slice)."""
        axes = (0, 0, *(0 if jnp.ndim(w) == 1 else None for w in (ema_old, ema_new)))
        return jax.vmap(self.inner.update_from_statistics, in_axes=axes)(
            state, tuple(statistics), ema_old, ema_new
        )

    def update_cache(self, state: BlockState, identity_weight: Any) -> BlockState:
        """The inner block's cache refresh, slice by slice (one slice after the other).

        The built-in Kronecker and full blocks refresh their caches from stacked
        factors as they are, without `jax.vmap`: the `lax.cond` of the
        `kfacx.linalg` fallbacks then skips the fallback when no slice needs it
        (under `jax.vmap` both branches would run).
        """
        if type(self.inner).update_cache in _STACK_AWARE_UPDATE_CACHE:
            return self.inner.update_cache(state, identity_weight)
        # A loop, not `jax.vmap`: vmapped, the slices' decompositions would be one
        # batched LAPACK call each, which can hang on the CPU
        # (`kfacx.linalg._common.one_at_a_time_on_cpu`).
        return jax.lax.map(lambda s: self.inner.update_cache(s, identity_weight), state)

    def inverse_refresh(self, state: BlockState, identity_weight: Any) -> InverseRefresh | None:
        """The inner block's, when its cache refresh takes stacked factors as they are."""
        if type(self.inner).update_cache in _STACK_AWARE_UPDATE_CACHE:
            return self.inner.inverse_refresh(state, identity_weight)
        return None

    # ---------------------------------------------------------------- products

    def _multiply(self, state, vector, identity_weight) -> Params:
        return tuple(
            jax.vmap(lambda s, v: self.inner.multiply_matpower(s, v, identity_weight, 1))(
                state, vector
            )
        )

    def _multiply_matpower(self, state, vector, identity_weight, power, exact_power, use_cached):
        def one(s, v):
            return self.inner.multiply_matpower(
                s, v, identity_weight, power, exact_power, use_cached
            )

        if use_cached:
            return tuple(jax.vmap(one)(state, vector))
        # Without the cache each slice decomposes its factors: one after the other, as
        # in `update_cache` (vmapped, they would be batched LAPACK calls).
        return tuple(jax.lax.map(lambda sv: one(*sv), (state, vector)))

    # ---------------------------------------------------------------- eigenbasis

    def to_eigenbasis(self, state: BlockState, vector: Sequence[jax.Array]) -> Any:
        """The inner block's coordinates, slice by slice (a leading ``L`` axis)."""
        return jax.vmap(self.inner.to_eigenbasis)(state, self._check_vector(vector))

    def from_eigenbasis(self, state: BlockState, coordinates: Any) -> Params:
        """The inner block's, slice by slice."""
        return tuple(jax.vmap(self.inner.from_eigenbasis)(state, coordinates))

    def eigenbasis_change(self, old_state: BlockState, new_state: BlockState, diagonal: Any):
        """The inner block's, slice by slice."""
        return jax.vmap(self.inner.eigenbasis_change)(old_state, new_state, diagonal)

    # ---------------------------------------------------------------- dense matrix

    def to_dense_matrix(self, state: BlockState) -> jax.Array:
        per_slice = jax.vmap(self.inner.to_dense_matrix)(state)
        index = self.slice_positions()
        dense = jnp.zeros((self.dim, self.dim), per_slice.dtype)
        return dense.at[index[:, :, None], index[:, None, :]].set(per_slice)

    def slice_positions(self) -> np.ndarray:
        """``[L, inner_dim]``: where entry ``j`` of slice ``l``'s flattened parameters sits
        in the flattened stacked parameters."""
        sizes = [math.prod(s) for s in self.inner.parameters_shapes]
        offsets = np.cumsum([0] + [self.stack_size * n for n in sizes])
        layers = np.arange(self.stack_size)[:, None]
        return np.concatenate(
            [o + layers * n + np.arange(n)[None, :] for o, n in zip(offsets, sizes, strict=False)],
            axis=1,
        )
