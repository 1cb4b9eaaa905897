"""`SlicedBlock`: parameters split into slices, each a parameter of its own layer.

``hk.GRU`` splits its recurrent weight ``w_h [H, 3H]`` (and its bias) with
``jnp.split(w_h, [2H], axis=1)``: ``state @ w_h[:, :2H]`` computes the update and reset
gates, ``(r * state) @ w_h[:, 2H:]`` the candidate, two dense layers on two inputs.
Each slice is served as its own layer: the *sliced* layer (pseudo tag `SLICED_TAG`)
has one role per layer, whose parameters are views (`kfacx._helpers._views`) of slices of the
shared leaves, and `SlicedBlock` holds a partial `kfacx.blocks.ViewBlock` per role
(the role's own block, e.g. Kronecker-factored, over its slices). The roles' slices
are disjoint and cover the leaves, so the block is block-diagonal over them: a vector
is cut into the roles' slices, each multiplied by its role's block, and the products
put back in place; every power is the roles' powers, exactly.

State: the roles' factors, concatenated, and a tuple of the roles' caches. Estimation
data: ``{"roles": (data_0, data_1, ...)}``, one per role, as for a tied layer.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kfacx._helpers import _views
from kfacx.blocks._base import BlockState, CurvatureBlock, LayerInfo, Params, statistics_of
from kfacx.blocks._norms import kronecker_pieces
from kfacx.blocks._views import ViewBlock

#: The pseudo tag name of a layer whose parameters are split into slices between layers.
SLICED_TAG = "sliced"


class SlicedBlock(CurvatureBlock):
    """Block-diagonal curvature over the slices of parameters split between layers.

    Args:
      layer: the sliced layer (pseudo tag `SLICED_TAG`): ``roles``, one `LayerInfo` per
        layer reading slices of the parameters (views under `kfacx._helpers._views.VIEWS`), and
        ``role_params``, the positions of each role's parameters among the layer's.
      role_ctor: ``role -> block class`` (or factory taking a `LayerInfo`) of a role's
        layer written with its effective parameters.

    Raises:
      ValueError: if the roles do not read disjoint slices that together cover every
        parameter.

    Example::

      block = kfacx.blocks.SlicedBlock(layer, lambda role: kfacx.DenseTwoKroneckerFactored)
    """

    def __init__(self, layer: LayerInfo, role_ctor: Callable[[LayerInfo], Any]):
        super().__init__(layer)
        _check_partition(layer)
        self.parts = tuple(ViewBlock(r, role_ctor(r), partial=True) for r in layer.roles)
        self.role_params = tuple(tuple(p) for p in layer.role_params)
        self.dtype = jnp.result_type(*(p.dtype for p in self.parts))
        counts = [len(p.factor_shapes()) for p in self.parts]
        self._factor_slices = _consecutive(counts)
        self._stat_slices = _consecutive([len(p.statistics_shapes()) for p in self.parts])

    @property
    def block_name(self) -> str:
        return f"SlicedBlock({', '.join(p.inner.block_name for p in self.parts)})"

    def __repr__(self) -> str:
        return f"SlicedBlock({', '.join(map(repr, self.parts))})"

    # ---------------------------------------------------------------- state

    def _part_state(self, state: BlockState, r: int) -> BlockState:
        return BlockState(state.factors[self._factor_slices[r]], state.cache[r])

    @staticmethod
    def _joined(states: Sequence[BlockState]) -> BlockState:
        return BlockState(
            tuple(f for s in states for f in s.factors), tuple(s.cache for s in states)
        )

    def factor_shapes(self):
        return tuple(s for p in self.parts for s in p.factor_shapes())

    def statistics_shapes(self):
        return tuple(s for p in self.parts for s in p.statistics_shapes())

    @property
    def statistics_need_state(self) -> bool:  # type: ignore[override]
        """Whether any role's block needs it."""
        return any(p.statistics_need_state for p in self.parts)

    def init(
        self,
        rng: jax.Array,
        exact_powers_to_cache: Sequence[float] = (),
        approx_powers_to_cache: Sequence[float] = (),
        cache_eigenvalues: bool = False,
    ) -> BlockState:
        """The roles' fresh states, joined."""
        exact, approx = exact_powers_to_cache, approx_powers_to_cache
        return self._joined([p.init(rng, exact, approx, cache_eigenvalues) for p in self.parts])

    def init_cache(self, exact_powers_to_cache, approx_powers_to_cache, cache_eigenvalues):
        return tuple(
            p.init_cache(exact_powers_to_cache, approx_powers_to_cache, cache_eigenvalues)
            for p in self.parts
        )

    # ---------------------------------------------------------------- statistics

    def compute_statistics(
        self, estimation_data: Mapping[str, Any], batch_size: Any, state: Any = None
    ) -> tuple[jax.Array, ...]:
        """The roles' statistics, concatenated (each from its role's data)."""
        shared = {k: v for k, v in estimation_data.items() if k != "roles"}
        out: list[jax.Array] = []
        for r, (part, data) in enumerate(zip(self.parts, estimation_data["roles"], strict=True)):
            part_state = None if state is None else self._part_state(state, r)
            out.extend(statistics_of(part, {**shared, **data}, batch_size, part_state))
        return tuple(out)

    def update_from_statistics(
        self, state: BlockState, statistics: Sequence[jax.Array], ema_old: Any, ema_new: Any
    ) -> BlockState:
        """Each role's update from its statistics."""
        statistics = tuple(statistics)
        return self._joined(
            [
                p.update_from_statistics(
                    self._part_state(state, r), statistics[self._stat_slices[r]], ema_old, ema_new
                )
                for r, p in enumerate(self.parts)
            ]
        )

    def update_cache(self, state: BlockState, identity_weight: Any) -> BlockState:
        """Each role's cache refresh."""
        return self._joined(
            [
                p.update_cache(self._part_state(state, r), identity_weight)
                for r, p in enumerate(self.parts)
            ]
        )

    # ---------------------------------------------------------------- products

    def _sum_of_parts(self, vector: Params, product: Callable[..., Params]) -> Params:
        """``sum_r`` of the role products, each on its role's parameters, put back in place."""
        out = [jnp.zeros(v.shape, v.dtype) for v in vector]
        for r, part in enumerate(self.parts):
            positions = self.role_params[r]
            products = product(r, part, tuple(vector[i] for i in positions))
            for i, p in zip(positions, products, strict=True):
                out[i] = out[i] + p.astype(out[i].dtype)
        return tuple(out)

    def _multiply(self, state, vector, identity_weight) -> Params:
        def product(r, part, v):
            return part.multiply_matpower(self._part_state(state, r), v, identity_weight, 1)

        return self._sum_of_parts(vector, product)

    def _multiply_matpower(self, state, vector, identity_weight, power, exact_power, use_cached):
        def product(r, part, v):
            s = self._part_state(state, r)
            return part.multiply_matpower(s, v, identity_weight, power, exact_power, use_cached)

        return self._sum_of_parts(vector, product)

    # ---------------------------------------------------------------- eigenbasis

    def to_eigenbasis(self, state: BlockState, vector: Sequence[jax.Array]) -> Any:
        """The roles' coordinates, a tuple."""
        vector = self._check_vector(vector)
        return tuple(
            part.to_eigenbasis(self._part_state(state, r), tuple(vector[i] for i in pos))
            for (r, part), pos in zip(enumerate(self.parts), self.role_params, strict=True)
        )

    def from_eigenbasis(self, state: BlockState, coordinates: Any) -> Params:
        """The roles' vectors, put back in place."""
        like = [jax.ShapeDtypeStruct(s, self.dtype) for s in self.parameters_shapes]

        def product(r, part, v):
            del v
            return part.from_eigenbasis(self._part_state(state, r), coordinates[r])

        return self._sum_of_parts(like, product)

    def eigenbasis_change(self, old_state: BlockState, new_state: BlockState, diagonal: Any):
        """Each role's."""
        return tuple(
            p.eigenbasis_change(self._part_state(old_state, r), self._part_state(new_state, r), d)
            for (r, p), d in zip(enumerate(self.parts), diagonal, strict=True)
        )

    def norm_pieces(self, state: BlockState) -> list:
        """The roles' Kronecker pieces (the block is block-diagonal over the roles)."""
        return [
            piece
            for r, p in enumerate(self.parts)
            for piece in kronecker_pieces(p.inner, self._part_state(state, r))
        ]

    # ---------------------------------------------------------------- dense matrix

    def to_dense_matrix(self, state: BlockState) -> jax.Array:
        """The roles' dense matrices over their parameters, summed in place."""
        sizes = [math.prod(s) for s in self.parameters_shapes]
        offsets = np.cumsum([0, *sizes])
        dense = jnp.zeros((self.dim, self.dim), self.dtype)
        for r, part in enumerate(self.parts):
            index = np.concatenate(
                [np.arange(offsets[i], offsets[i + 1]) for i in self.role_params[r]]
            )
            block = part.to_dense_matrix(self._part_state(state, r)).astype(self.dtype)
            dense = dense.at[index[:, None], index[None, :]].add(block)
        return dense


def _consecutive(counts: Sequence[int]) -> list[slice]:
    starts = np.cumsum([0, *counts])
    return [slice(int(a), int(b)) for a, b in zip(starts[:-1], starts[1:], strict=True)]


def _check_partition(layer: LayerInfo) -> None:
    """Raises unless the roles read disjoint slices covering every parameter."""
    if not layer.roles or len(layer.role_params) != len(layer.roles):
        raise ValueError(
            f"SlicedBlock({layer.name}): the layer has no roles (one per layer reading "
            "slices of its parameters) with their parameter positions."
        )
    boxes = []
    for role, positions in zip(layer.roles, layer.role_params, strict=True):
        role_boxes = _views.all_boxes(_views.views_of(role.meta) or (("leaf", 0),))
        if role_boxes is None:
            raise ValueError(f"SlicedBlock({layer.name}): role {role.name} reads no slices.")
        boxes += _views.renumber_boxes(role_boxes, positions)
    covered = _views.disjoint(boxes) and all(
        _views.covers(boxes, i, s) for i, s in enumerate(layer.parameter_shapes)
    )
    if not covered:
        raise ValueError(
            f"SlicedBlock({layer.name}): the roles' slices {boxes} do not cover the parameters "
            f"{layer.parameter_shapes} exactly once; each entry must belong to one layer."
        )
