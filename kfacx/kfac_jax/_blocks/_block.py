"""`CurvatureBlock`: kfac-jax's abstract curvature block, as its subclasses expect it.

A kfac-jax block is built from the layer's tag equation and reads the layer's shapes
from it (``inputs_shapes``, ``parameters_shapes``, ...); here it is built from kfacx's
`kfacx.blocks.LayerInfo` (a `kfacx.kfac_jax._blocks.HostedBlock` does that) and
reads the same shapes from it. Its public methods apply the block's ``scale``
(``fixed_scale() * state_dependent_scale(state)``) around the protected hooks that
subclasses implement, as kfac-jax's do.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from kfacx.blocks import LayerInfo
from kfacx.kfac_jax.layers_and_loss_tags import variant_of_tag
from kfacx.kfac_jax.utils import _math
from kfacx.kfac_jax.utils._state import State as _State
from kfacx.kfac_jax.utils._state import register_state_class


def to_real_set(powers: Any) -> set[float]:
    """``None``, a number or a sequence of numbers as a set of floats."""
    if powers is None:
        return set()
    if isinstance(powers, (int, float)):
        return {float(powers)}
    return {float(p) for p in powers}


class CurvatureBlock(abc.ABC):
    """kfac-jax's abstract curvature block (see the module docstring).

    Args:
      layer_tag_eq: the layer, as a `kfacx.blocks.LayerInfo` (kfacx builds hosted blocks
        with it).

    Raises:
      TypeError: for anything else (kfac-jax passes a jaxpr equation; kfacx's
        estimator builds the blocks itself).
    """

    @register_state_class
    class State(_State):
        """The block's state: a ``cache`` (a dict of arrays, or None)."""

        cache: Any

    def __init__(self, layer_tag_eq: LayerInfo):
        if not isinstance(layer_tag_eq, LayerInfo):
            raise TypeError(
                f"{type(self).__name__}: kfacx.kfac_jax builds blocks from the layer's "
                f"kfacx.blocks.LayerInfo, got {type(layer_tag_eq).__name__}. Map the block "
                "to its layer tag with layer_tag_to_block_ctor (or "
                "set_default_tag_to_block_ctor) and let the optimizer build it."
            )
        self._layer = layer_tag_eq

    # ------------------------------------------------------------------ the layer

    @property
    def layer(self) -> LayerInfo:
        """kfacx's description of the layer."""
        return self._layer

    @property
    def name(self) -> str:
        return self._layer.name

    @property
    def inputs_shapes(self) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(s) for s in self._layer.input_shapes)

    @property
    def outputs_shapes(self) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(s) for s in self._layer.output_shapes)

    @property
    def parameters_shapes(self) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(s) for s in self._layer.parameter_shapes)

    @property
    def dtype(self) -> Any:
        return jnp.result_type(*self._layer.parameter_dtypes)

    @property
    def parameters_canonical_order(self) -> tuple[int, ...]:
        return tuple(range(len(self.parameters_shapes)))

    @property
    def layer_tag_extra_params(self) -> dict[str, Any]:
        """The tag's static metadata, with kfac-jax's ``variant``."""
        return {**dict(self._layer.meta), "variant": variant_of_tag(self._layer.tag_name)}

    @property
    def number_of_parameters(self) -> int:
        return len(self.parameters_shapes)

    @property
    def dim(self) -> int:
        return int(sum(np.prod(s, dtype=int) for s in self.parameters_shapes))

    def __str__(self) -> str:
        shapes = self.parameters_shapes
        return f"{type(self).__name__}, tag name: {self.name}, params shapes: {shapes!r}"

    # ------------------------------------------------------------------ scale

    def scale(self, state: Any, use_cache: bool) -> Any:
        """``fixed_scale()``, times ``state_dependent_scale(state)`` unless ``use_cache``."""
        if use_cache:
            return self.fixed_scale()
        return self.fixed_scale() * self.state_dependent_scale(state)

    def fixed_scale(self) -> Any:
        """A constant factor of the curvature."""
        return 1.0

    def state_dependent_scale(self, state: Any) -> Any:
        """A factor of the curvature computed from the state."""
        del state
        return 1.0

    # ------------------------------------------------------------------ template methods

    def init(
        self,
        rng: Any,
        exact_powers_to_cache: Any,
        approx_powers_to_cache: Any,
        cache_eigenvalues: bool,
    ) -> Any:
        """The initial state (`_init` with the powers as sets)."""
        return self._init(
            rng=rng,
            exact_powers_to_cache=to_real_set(exact_powers_to_cache),
            approx_powers_to_cache=to_real_set(approx_powers_to_cache),
            cache_eigenvalues=cache_eigenvalues,
        )

    @abc.abstractmethod
    def _init(self, rng, exact_powers_to_cache, approx_powers_to_cache, cache_eigenvalues):
        """The initial state."""

    def sync(self, state: Any, pmap_axis_name: str) -> Any:
        """kfacx reduces the statistics over devices before they reach the block, so
        there is nothing to synchronise: the state is returned as it is."""
        del pmap_axis_name
        return state

    def multiply_matpower(
        self,
        state: Any,
        vector: Sequence[Any],
        identity_weight: Any,
        power: Any,
        exact_power: bool,
        use_cached: bool,
    ) -> tuple[Any, ...]:
        """``(C + identity_weight I)^power v``, with the block's scale applied."""
        scale = self.scale(state, use_cached)
        result = self._multiply_matpower_unscaled(
            state=state,
            vector=vector,
            identity_weight=identity_weight / scale,
            power=power,
            exact_power=exact_power,
            use_cached=use_cached,
        )
        return _math.scalar_mul(result, jnp.power(scale, power))

    def _multiply_matpower_unscaled(
        self, state, vector, identity_weight, power, exact_power, use_cached
    ):
        """`multiply_matpower` without the scale."""
        raise NotImplementedError(
            f"{type(self).__name__} implements neither multiply_matpower nor "
            "_multiply_matpower_unscaled."
        )

    def multiply(self, state, vector, identity_weight, exact_power, use_cached):
        """``(C + identity_weight I) v``."""
        return self.multiply_matpower(state, vector, identity_weight, 1, exact_power, use_cached)

    def multiply_inverse(self, state, vector, identity_weight, exact_power, use_cached):
        """``(C + identity_weight I)^-1 v``."""
        return self.multiply_matpower(state, vector, identity_weight, -1, exact_power, use_cached)

    def eigenvalues(self, state: Any, use_cached: bool) -> Any:
        """The curvature's eigenvalues, with the scale."""
        return self.scale(state, use_cached) * self._eigenvalues_unscaled(state, use_cached)

    def _eigenvalues_unscaled(self, state: Any, use_cached: bool) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not compute eigenvalues.")

    @abc.abstractmethod
    def update_curvature_matrix_estimate(
        self, state, estimation_data, ema_old, ema_new, identity_weight, batch_size
    ):
        """Folds a batch's `LayerVjpData` into the state's moving averages."""

    def update_cache(self, state, identity_weight, exact_powers, approx_powers, eigenvalues):
        """Refreshes the cache (`_update_cache` with the damping divided by the scale)."""
        return self._update_cache(
            state=state,
            identity_weight=identity_weight / self.scale(state, False),
            exact_powers=to_real_set(exact_powers),
            approx_powers=to_real_set(approx_powers),
            eigenvalues=eigenvalues,
        )

    def _update_cache(self, state, identity_weight, exact_powers, approx_powers, eigenvalues):
        """The cache refresh, without the scale."""
        del identity_weight, exact_powers, approx_powers, eigenvalues
        return state

    def to_dense_matrix(self, state: Any) -> Any:
        """The curvature as a dense matrix, with the scale."""
        return self.scale(state, False) * self._to_dense_unscaled(state)

    def _to_dense_unscaled(self, state: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} has no dense form.")

    def norm(self, state: Any, norm_type: str) -> Any:
        """A norm of the curvature (``norm_to_scale_identity_weight_per_block``)."""
        return self.scale(state, False) * self._norm_unscaled(state, norm_type)

    def _norm_unscaled(self, state: Any, norm_type: str) -> Any:
        raise NotImplementedError(f"{type(self).__name__} defines no norm.")
