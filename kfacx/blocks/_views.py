"""`ViewBlock`: the block of a layer whose parameters are views of parameter leaves.

A fused-gate recurrent cell multiplies once by ``concatenate([w_i, w_f, w_g, w_o], -1)``
(Flax's ``OptimizedLSTMCell``) or by ``concatenate([w_x, w_h], 0)`` on
``concatenate([x, h])``: one dense layer, whose weight is a *view* of several leaves
(`kfacx._helpers._views`: the tag's metadata holds the expressions that build the layer's
parameters from its leaves). `ViewBlock` builds the layer's own block (any block
class) for the parameters the view gives, its *effective* parameters, and carries it
to the leaves: a vector of leaves is gathered into the effective parameters
(concatenated), multiplied by the inner block, and the product scattered back
(split) onto the leaves. The view reads every leaf entry exactly once, so it is a
permutation ``P`` of the flattened parameters, and the block is ``P^T C P`` with ``C``
the inner block's matrix: its powers are ``P^T (C + l I)^p P``, exactly the inner
block's, and the curvature is that of the layer written with one fused weight leaf.

A view with elementwise maps (``x * (c * softplus(s))``, ``h @ (w * mask)``) computes
``w = f(P theta)``: the inner block is then a `kfacx.blocks.MappedBlock` of the layer's
block, which carries it through the map's diagonal Jacobian (``P^T D C D P``); the
statistics get the effective parameters ``f(P theta)`` and ``f'`` (one `jax.jvp`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from kfacx._helpers import _views
from kfacx.blocks._base import (
    BlockState,
    CurvatureBlock,
    InverseRefresh,
    LayerInfo,
    Params,
    statistics_of,
)
from kfacx.blocks._mapped import MAP_SCALES, MappedBlock
from kfacx.blocks._norms import kronecker_pieces
from kfacx.blocks._wrapper import WrapperBlock


def effective_layer(layer: LayerInfo) -> LayerInfo:
    """The `LayerInfo` of a layer whose parameters are views (`kfacx._helpers._views.VIEWS` in its
    metadata) as if its effective parameters were leaves: their shapes, dtypes and
    readable names (``"concat[1](w_i, w_f)"``), and the metadata without the views."""
    views = _views.views_of(layer.meta)
    shapes = layer.parameter_shapes
    return dataclasses.replace(
        layer,
        parameter_paths=tuple(_views.describe(e, layer.parameter_paths) for e in views),
        parameter_shapes=tuple(_views.shape(e, shapes) for e in views),
        parameter_dtypes=tuple(
            jnp.result_type(*(layer.parameter_dtypes[i] for i in _views.leaves(e))) for e in views
        ),
        meta=_views.without_views(layer.meta),
    )


class ViewBlock(WrapperBlock):
    """The curvature block of a layer whose parameters are built from parameter leaves
    by concatenation (see the module docstring).

    Args:
      layer: the layer, with one view expression per parameter under
        `kfacx._helpers._views.VIEWS` in its metadata and the leaves as its parameters.
      inner_ctor: the block class (or factory taking a `LayerInfo`) of the layer
        written with its effective parameters (`effective_layer`); for views with
        elementwise maps it is wrapped in a `kfacx.blocks.MappedBlock`.
      partial: whether the views may read slices of the leaves (each entry at most
        once): the block of one slice of a `kfacx.blocks.SlicedBlock`, whose products
        are zero on the entries it does not read.

    Vectors, the dense matrix and the parameter shapes are over the leaves (in the
    tag's order); the state, statistics and estimation data are the inner block's.

    Raises:
      ValueError: if the metadata holds no views, or the views do not read every entry
        of every leaf exactly once (with ``partial``: read an entry twice).

    Example::

      block = kfacx.blocks.ViewBlock(layer, kfacx.blocks.DenseTwoKroneckerFactored)
    """

    def __init__(
        self,
        layer: LayerInfo,
        inner_ctor: Callable[[LayerInfo], CurvatureBlock],
        partial: bool = False,
    ):
        views = _views.views_of(layer.meta)
        if not views:
            raise ValueError(
                f"ViewBlock({layer.name}): the layer's metadata has no {_views.VIEWS!r}; use "
                "the inner block class directly."
            )
        if not _reads_once(views, layer.parameter_shapes, partial):
            raise ValueError(
                f"ViewBlock({layer.name}): the views {views} do not read every entry of the "
                "parameters exactly once; a ViewBlock serves parameters concatenated (whole, "
                "or in slices that leave nothing out; with partial=True, slices read once)."
            )
        super().__init__(layer)
        self.views = tuple(views)
        self.mapped = _views.has_maps(self.views)
        info = effective_layer(layer)
        self.inner = MappedBlock(info, inner_ctor) if self.mapped else inner_ctor(info)
        self.dtype = self.inner.dtype

    @property
    def block_name(self) -> str:
        return f"ViewBlock({self.inner.block_name})"

    def __repr__(self) -> str:
        return f"ViewBlock({self.inner!r} over {', '.join(self.layer.parameter_paths)})"

    # ---------------------------------------------------------------- conversions

    def gather(self, vector: Sequence[jax.Array]) -> Params:
        """Arrays shaped like the leaves -> arrays shaped like the effective parameters
        (the entries they read: the views without their elementwise maps, linear)."""
        return _views.gather(tuple(vector), self.views)

    def parameters_and_scales(self, leaves: Sequence[jax.Array]) -> tuple[Params, Params]:
        """The effective parameters ``f(P theta)`` of the leaves ``theta``, and ``f'`` at
        them (ones without maps), shaped like the effective parameters."""
        leaves = tuple(leaves)
        if not self.mapped:
            values = _views.effective(leaves, self.views)
            return values, tuple(jnp.ones_like(v) for v in values)
        ones = tuple(jnp.ones_like(x) for x in leaves)
        return jax.jvp(lambda *ops: _views.effective(ops, self.views), leaves, ones)

    def scatter(self, parameters: Sequence[jax.Array]) -> Params:
        """The transpose of `gather` (its inverse when the view is a permutation; zeros on
        the entries a partial view does not read)."""
        specs = [
            jax.ShapeDtypeStruct(s, d)
            for s, d in zip(self.parameters_shapes, self.layer.parameter_dtypes, strict=True)
        ]
        return _views.scatter(parameters, self.views, specs)

    def _scatter_like(self, parameters: Sequence[jax.Array], like: Sequence[jax.Array]) -> Params:
        return tuple(p.astype(v.dtype) for p, v in zip(self.scatter(parameters), like, strict=True))

    # ---------------------------------------------------------------- statistics

    def compute_statistics(
        self, estimation_data: Mapping[str, Any], batch_size: Any, state: Any = None
    ) -> tuple[jax.Array, ...]:
        """The inner block's statistics, its ``"params"`` the effective parameters (and,
        with maps, ``MAP_SCALES`` their derivatives, `parameters_and_scales`)."""
        data = dict(estimation_data)
        if "params" in data:
            data["params"], scales = self.parameters_and_scales(data["params"])
            if self.mapped:
                data[MAP_SCALES] = scales
        return statistics_of(self.inner, data, batch_size, state)

    def update_from_statistics(
        self, state: BlockState, statistics: Sequence[jax.Array], ema_old: Any, ema_new: Any
    ) -> BlockState:
        """The inner block's."""
        return self.inner.update_from_statistics(state, statistics, ema_old, ema_new)

    def update_cache(self, state: BlockState, identity_weight: Any) -> BlockState:
        """The inner block's."""
        return self.inner.update_cache(state, identity_weight)

    def inverse_refresh(self, state: BlockState, identity_weight: Any) -> InverseRefresh | None:
        """The inner block's."""
        return self.inner.inverse_refresh(state, identity_weight)

    # ---------------------------------------------------------------- products

    def _multiply(self, state, vector, identity_weight) -> Params:
        out = self.inner.multiply_matpower(state, self.gather(vector), identity_weight, 1)
        return self._scatter_like(out, vector)

    def _multiply_matpower(self, state, vector, identity_weight, power, exact_power, use_cached):
        out = self.inner.multiply_matpower(
            state, self.gather(vector), identity_weight, power, exact_power, use_cached
        )
        return self._scatter_like(out, vector)

    # ---------------------------------------------------------------- eigenbasis

    def to_eigenbasis(self, state: BlockState, vector: Sequence[jax.Array]) -> Any:
        """The inner block's coordinates of the gathered vector."""
        return self.inner.to_eigenbasis(state, self.gather(self._check_vector(vector)))

    def from_eigenbasis(self, state: BlockState, coordinates: Any) -> Params:
        """The inner block's, scattered onto the leaves."""
        return self.scatter(self.inner.from_eigenbasis(state, coordinates))

    def eigenbasis_change(self, old_state: BlockState, new_state: BlockState, diagonal: Any):
        """The inner block's."""
        return self.inner.eigenbasis_change(old_state, new_state, diagonal)

    def norm_pieces(self, state: BlockState) -> list:
        """The inner block's Kronecker pieces (a permutation changes no norm)."""
        return kronecker_pieces(self.inner, state)

    # ---------------------------------------------------------------- dense matrix

    def to_dense_matrix(self, state: BlockState) -> jax.Array:
        """``P^T C P``: the inner block's matrix over the leaves (``C = D C_w D`` with maps)."""
        inner = self.inner.to_dense_matrix(state)
        index = _views.positions(self.views, self.parameters_shapes)
        dense = jnp.zeros((self.dim, self.dim), inner.dtype)
        return dense.at[index[:, None], index[None, :]].set(inner)


def _reads_once(views, shapes, partial: bool) -> bool:
    if not partial:
        return _views.is_permutation(views, shapes)
    boxes = _views.all_boxes(views)
    return boxes is not None and _views.disjoint(boxes)


def view_ctor(
    layer: LayerInfo, ctor: Callable[[LayerInfo], CurvatureBlock]
) -> Callable[[LayerInfo], CurvatureBlock]:
    """``ctor``, or for a layer whose parameters are views, a factory of `ViewBlock`s of
    ``ctor`` (a stacked layer's slices are views alike)."""
    if not _views.views_of(layer.meta):
        return ctor

    def make(info: LayerInfo) -> CurvatureBlock:
        return ViewBlock(info, ctor)

    return make
