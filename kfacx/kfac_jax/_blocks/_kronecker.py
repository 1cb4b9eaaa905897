"""kfac-jax's Kronecker-factored blocks: `KroneckerFactored`, `DenseTwoKroneckerFactored`
and `RepeatedDenseKroneckerFactored`, as bases for blocks written against kfac-jax.

The math is kfac-jax 0.0.8's (factors of the parameters laid out as one array by
"rearrange" specs, pi-adjusted factored damping, the cache keyed ``"-1"`` ->
``"{i}_factor"``), computed with kfacx's linear algebra. `KroneckerFactored.State`
also takes the two-factor layout of earlier kfac-jax releases
(``State(cache=..., inputs_factor=..., outputs_factor=...)``, read back as
``state.inputs_factor`` / ``state.outputs_factor``), which FermiNet's blocks use.
"""

from __future__ import annotations

import math
import string
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp

from kfacx.kfac_jax._blocks._block import CurvatureBlock
from kfacx.kfac_jax.utils import _math
from kfacx.kfac_jax.utils._misc import first_dim_is_size
from kfacx.kfac_jax.utils._state import WeightedMovingAverage, register_state_class


class KroneckerFactored(CurvatureBlock):
    """kfac-jax's block approximating the curvature by a Kronecker product of one factor
    per axis of the parameters laid out as one array.

    Args:
      layer_tag_eq: the layer (`kfacx.blocks.LayerInfo`).
      parameters_specs: a "rearrange" spec per parameter (default: every axis but the
        last merged, a vector as one row: ``"abc -> (ab)c"``, ``"a -> 1a"``).
      parameters_concat_axis: the axis the rearranged parameters are concatenated on.
    """

    @register_state_class
    class State(CurvatureBlock.State):
        """The factors' moving averages (``factors``, or ``inputs_factor`` and
        ``outputs_factor`` for two) and the cache."""

        factors: tuple[WeightedMovingAverage, ...]

        def __init__(
            self,
            cache: Any = None,
            factors: Sequence[WeightedMovingAverage] | None = None,
            *,
            inputs_factor: WeightedMovingAverage | None = None,
            outputs_factor: WeightedMovingAverage | None = None,
        ):
            pair = (inputs_factor, outputs_factor)
            if factors is not None and any(f is not None for f in pair):
                raise TypeError(
                    "KroneckerFactored.State: pass factors=(...) or inputs_factor= and "
                    "outputs_factor=, not both."
                )
            self.cache = cache
            self.factors = (
                tuple(factors) if factors is not None else tuple(f for f in pair if f is not None)
            )

        @property
        def inputs_factor(self) -> WeightedMovingAverage:
            """The first factor (the layer inputs' second moment)."""
            return self.factors[0]

        @property
        def outputs_factor(self) -> WeightedMovingAverage:
            """The second factor (the output gradients' second moment)."""
            return self.factors[1]

    def __init__(
        self,
        layer_tag_eq: Any,
        parameters_specs: Sequence[str] | None = None,
        parameters_concat_axis: int = 0,
    ):
        super().__init__(layer_tag_eq)
        if parameters_specs is None:
            parameters_specs = [_default_spec(len(s)) for s in self.parameters_shapes]
        elif len(parameters_specs) != self.number_of_parameters:
            raise ValueError(
                f"{type(self).__name__}: {len(parameters_specs)} parameters_specs for "
                f"{self.number_of_parameters} parameters."
            )
        self.parameters_specs = list(parameters_specs)
        self.parameters_concat_axis = parameters_concat_axis

    # ------------------------------------------------------------------ layout

    def parameters_shaped_list_to_array(self, parameters_shaped_list: Sequence[Any]) -> Any:
        """The parameters (or a vector shaped like them) as one array."""
        values = [
            _math.rearrange(p, spec)
            for p, spec in zip(parameters_shaped_list, self.parameters_specs, strict=True)
        ]
        return jnp.concatenate(values, axis=self.parameters_concat_axis)

    def array_to_parameters_shaped_list(self, array: Any) -> tuple[Any, ...]:
        """The inverse of `parameters_shaped_list_to_array`."""
        out, start = [], 0
        index = [slice(None)] * array.ndim
        for shape, spec in zip(self.parameters_shapes, self.parameters_specs, strict=True):
            size = _math.rearrange(jnp.zeros(shape), spec).shape[self.parameters_concat_axis]
            index[self.parameters_concat_axis] = slice(start, start + size)
            out.append(array[tuple(index)].reshape(shape))
            start += size
        return tuple(out)

    @property
    def array_shape(self) -> tuple[int, ...]:
        """The shape of the parameters laid out as one array."""
        zeros = [jnp.zeros(s) for s in self.parameters_shapes]
        return tuple(self.parameters_shaped_list_to_array(zeros).shape)

    @property
    def array_ndim(self) -> int:
        return len(self.array_shape)

    # ------------------------------------------------------------------ state

    def _init(self, rng, exact_powers_to_cache, approx_powers_to_cache, cache_eigenvalues):
        del rng
        cache: dict[str, Any] = {}
        factors = []
        for i, d in enumerate(self.array_shape):
            factors.append(WeightedMovingAverage.zeros_array((d, d), self.dtype))
            if cache_eigenvalues or exact_powers_to_cache:
                cache[f"{i}_factor_eigenvalues"] = jnp.zeros((d,), self.dtype)
            if exact_powers_to_cache:
                cache[f"{i}_factor_eigen_vectors"] = jnp.zeros((d, d), self.dtype)
            for power in approx_powers_to_cache:
                _check_approx_power(power, (-1,))
                cache.setdefault(str(power), {})[f"{i}_factor"] = jnp.zeros((d, d), self.dtype)
        return KroneckerFactored.State(cache=cache, factors=tuple(factors))

    def _update_cache(self, state, identity_weight, exact_powers, approx_powers, eigenvalues):
        state = state.copy()
        n = len(state.factors)
        factor_scale = jnp.power(self.state_dependent_scale(state), 1.0 / n)
        if eigenvalues or exact_powers:
            for i, factor in enumerate(state.factors):
                s, q = _math.safe_psd_eigh(factor.value)
                state.cache[f"{i}_factor_eigenvalues"] = factor_scale * s
                if exact_powers:
                    state.cache[f"{i}_factor_eigen_vectors"] = q
        for power in approx_powers:
            _check_approx_power(power, (-1,))
            inverses = _math.pi_adjusted_kronecker_inverse(
                *[f.value for f in state.factors], damping=identity_weight
            )
            for i, inv in enumerate(inverses):
                state.cache[str(power)][f"{i}_factor"] = inv / factor_scale
        return state

    # ------------------------------------------------------------------ products

    def _multiply_matpower_unscaled(
        self, state, vector, identity_weight, power, exact_power, use_cached
    ):
        v = self.parameters_shaped_list_to_array(vector)
        values = [f.value for f in state.factors]
        if power == 1:
            scale = self.state_dependent_scale(state) if use_cached else 1.0
            if exact_power:
                result = scale * _math.kronecker_product_axis_mul_v(values, v)
                result = result + identity_weight * v
            else:
                damped = _math.pi_adjusted_kronecker_factors(
                    *values, damping=identity_weight / scale
                )
                result = scale * _math.kronecker_product_axis_mul_v(damped, v)
        elif exact_power:
            if use_cached:
                s = [state.cache[f"{i}_factor_eigenvalues"] for i in range(len(values))]
                q = [state.cache[f"{i}_factor_eigen_vectors"] for i in range(len(values))]
            else:
                s, q = zip(*[_math.safe_psd_eigh(m) for m in values], strict=True)
            eigen = jnp.power(_math.outer_product(*s) + identity_weight, power)
            result = _math.kronecker_eigen_basis_axis_mul_v(q, eigen, v)
        else:
            _check_approx_power(power, (-1, -0.5))
            if use_cached:
                factors = [state.cache[str(power)][f"{i}_factor"] for i in range(len(values))]
            else:
                damped = _math.pi_adjusted_kronecker_factors(*values, damping=identity_weight)
                if power == -1:
                    factors = _math.invert_psd_matrices(damped)
                else:
                    factors = _math.inverse_sqrt_psd_matrices(damped)
            result = _math.kronecker_product_axis_mul_v(factors, v)
        return self.array_to_parameters_shaped_list(result)

    def _eigenvalues_unscaled(self, state, use_cached):
        if use_cached:
            s = [state.cache[f"{i}_factor_eigenvalues"] for i in range(len(state.factors))]
        else:
            s = [_math.safe_psd_eigh(f.value)[0] for f in state.factors]
        return _math.outer_product(*s)

    def _norm_unscaled(self, state, norm_type):
        return _math.product(_math.psd_matrix_norm(f.value, norm_type) for f in state.factors)

    def _to_dense_unscaled(self, state):
        """The Kronecker product of the factors, over the parameters laid out as one array
        (the parameters' own order when each spec keeps its axes in order)."""
        dense = state.factors[0].value
        for f in state.factors[1:]:
            dense = jnp.kron(dense, f.value)
        return dense


def _default_spec(ndim: int) -> str:
    if ndim == 1:
        return "a -> 1a"
    letters = string.ascii_lowercase[:ndim]
    return f"{letters} -> ({letters[:-1]}){letters[-1]}"


def _check_approx_power(power: float, allowed: Sequence[float]) -> None:
    if power not in allowed:
        raise NotImplementedError(
            f"KroneckerFactored: approximate power {power} is not implemented (kfac-jax "
            f"serves {tuple(allowed)}); use exact_power=True for others."
        )


def _with_ones_column(x: Any, estimation_data: Any) -> Any:
    """``x`` with a column of ones (the bias's input), weighted by the example mask when
    there is one (its examples' rows repeated as ``x`` has rows per example)."""
    ones = jnp.ones_like(x[:, :1])
    mask = getattr(estimation_data, "example_mask", None)
    if mask is not None and x.shape[0] % mask.shape[0] == 0:
        ones = jnp.repeat(mask, x.shape[0] // mask.shape[0]).astype(x.dtype)[:, None]
    return jnp.concatenate([x, ones], axis=1)


class DenseTwoKroneckerFactored(KroneckerFactored):
    """kfac-jax's K-FAC block of a dense layer ``x [batch, d_in] @ w + b``: factors
    ``x^T x / batch`` (``x`` with a column of ones for the bias) and ``dy^T dy / batch``."""

    def update_curvature_matrix_estimate(
        self, state, estimation_data, ema_old, ema_new, identity_weight, batch_size
    ):
        del identity_weight
        if not 1 <= self.number_of_parameters <= 2:
            raise ValueError(f"{self.name}: a dense layer has a weight and at most a bias.")
        state = state.copy()
        [x] = estimation_data.primals.inputs
        [dy] = estimation_data.tangents.outputs
        if not first_dim_is_size(batch_size, x, dy):
            raise ValueError(
                f"{self.name}: the inputs {x.shape} and output gradients {dy.shape} must "
                f"lead with the batch size {batch_size}."
            )
        if self.number_of_parameters == 2:
            x = _with_ones_column(x, estimation_data)
        state.factors[0].update(jnp.einsum("ay,az->yz", x, x) / batch_size, ema_old, ema_new)
        state.factors[1].update(jnp.einsum("ay,az->yz", dy, dy) / batch_size, ema_old, ema_new)
        return state


class RepeatedDenseKroneckerFactored(DenseTwoKroneckerFactored):
    """kfac-jax's block of a dense layer applied at several positions of each example
    (``x [batch, ..., d_in]``): the statistics over all positions, and the curvature
    scaled by the inverse of the average number of positions that are not masked (a
    position whose output gradient is all zero is masked)."""

    @register_state_class
    class State(KroneckerFactored.State):
        """Adds the moving average of the number of unmasked positions per example."""

        average_repeats: WeightedMovingAverage

        def __init__(self, cache=None, factors=None, average_repeats=None, **pair):
            super().__init__(cache, factors, **pair)
            self.average_repeats = average_repeats

    def __init__(
        self,
        layer_tag_eq,
        use_masking: bool = True,
        parameters_specs=None,
        parameters_concat_axis: int = 0,
    ):
        self._use_masking = use_masking
        super().__init__(layer_tag_eq, parameters_specs, parameters_concat_axis)

    def _init(self, rng, exact_powers_to_cache, approx_powers_to_cache, cache_eigenvalues):
        base = super()._init(rng, exact_powers_to_cache, approx_powers_to_cache, cache_eigenvalues)
        return RepeatedDenseKroneckerFactored.State(
            cache=base.cache,
            factors=base.factors,
            average_repeats=WeightedMovingAverage.zeros_array((), self.dtype),
        )

    def state_dependent_scale(self, state):
        return 1.0 / state.average_repeats.value

    def update_curvature_matrix_estimate(
        self, state, estimation_data, ema_old, ema_new, identity_weight, batch_size
    ):
        del identity_weight
        state = state.copy()
        [x] = estimation_data.primals.inputs
        [dy] = estimation_data.tangents.outputs
        if self._use_masking:
            mask = 1.0 - jnp.all(dy == 0.0, axis=-1, keepdims=True)
            x = x * mask
            total = jnp.sum(mask)
        else:
            total = math.prod(dy.shape[:-1])
        x = x.reshape([-1, x.shape[-1]])
        dy = dy.reshape([-1, dy.shape[-1]])
        if self.number_of_parameters == 2:
            x = _with_ones_column(x, estimation_data)
        state.factors[0].update(jnp.einsum("ay,az->yz", x, x) / batch_size, ema_old, ema_new)
        state.factors[1].update(jnp.einsum("ay,az->yz", dy, dy) / batch_size, ema_old, ema_new)
        state.average_repeats.update(total / batch_size, ema_old, ema_new)
        return state
