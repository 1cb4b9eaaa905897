"""The abstract curvature block and its state (`LayerInfo`, the layer it serves: `_layer`)."""

from __future__ import annotations

import abc
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kfacx._helpers import _checks
from kfacx.blocks._arrays import (  # noqa: F401  (re-exported: the blocks import them from here)
    Params,
    cast_to,
    flatten_params,
    row_mask,
    unflatten_params,
)
from kfacx.blocks._eigenbasis import missing_eigenbasis
from kfacx.blocks._layer import LayerInfo


def zeros(shape: Sequence[int], dtype: Any) -> jax.Array:
    """``jnp.zeros(shape, dtype)``; called eagerly (outside `jax.jit`, `jax.vmap`, ...),
    it copies a NumPy array to the device instead of compiling a fill kernel for each
    new shape, which keeps an eager `init` of a model's state fast."""
    if _checks.is_eager():
        return jax.device_put(np.zeros(tuple(shape), jnp.dtype(dtype)))
    return jnp.zeros(shape, dtype)


def _average(weight: jax.Array, raw_value: jax.Array) -> jax.Array:
    """`WeightedMovingAverage.value`."""
    weight = weight.reshape(weight.shape + (1,) * (raw_value.ndim - weight.ndim))
    safe = jnp.where(weight > 0, weight, 1.0)
    return jnp.where(weight > 0, raw_value / safe, 0.0).astype(raw_value.dtype)


#: `_average` as one program per shape, for eager calls (op by op, each of its five
#: operations would compile a program of its own for every new shape).
_average_program = jax.jit(_average)


#: Cache fields of the approximate (factored-damping) powers a block can cache.
APPROX_POWER_FIELDS = {-1.0: "inverse", -0.5: "inverse_sqrt"}


class WeightedMovingAverage(NamedTuple):
    """An exponential moving average with bias correction.

    ``raw_value = ema_old * raw_value + ema_new * statistic`` and
    ``weight = ema_old * weight + ema_new``; the average is ``raw_value / weight``
    (zero before the first update).
    """

    weight: jax.Array
    raw_value: jax.Array

    @classmethod
    def zeros(cls, shape: Sequence[int], dtype: Any) -> WeightedMovingAverage:
        """A moving average with no data yet."""
        return cls(zeros((), dtype), zeros(shape, dtype))

    @property
    def value(self) -> jax.Array:
        """The bias-corrected average (a stacked average, e.g. of a `StackedBlock`, has a
        weight per leading index)."""
        if _checks.is_eager():
            return _average_program(self.weight, self.raw_value)
        return _average(self.weight, self.raw_value)

    def update(self, statistic: jax.Array, ema_old: Any, ema_new: Any) -> WeightedMovingAverage:
        """Folds ``statistic`` in; returns the new average."""
        dtype = self.raw_value.dtype
        old, new = jnp.asarray(ema_old, dtype), jnp.asarray(ema_new, dtype)
        return WeightedMovingAverage(
            old * self.weight + new, old * self.raw_value + new * statistic.astype(dtype)
        )


class BlockState(NamedTuple):
    """State of a curvature block: moving-average factors and a typed cache."""

    factors: tuple[WeightedMovingAverage, ...]
    cache: Any


class InverseRefresh(NamedTuple):
    """A block's cache refresh as damped PSD inverses (see `CurvatureBlock.inverse_refresh`).

    Attributes:
      matrices: stacks of symmetric PSD matrices ``[..., n, n]``.
      dampings: for each, a damping broadcastable to its leading (stack) axes; or
        a function ``traces -> dampings`` of the matrices' traces (``[...]``
        each), which the refresh computes for all blocks in one pass (e.g.
        `kfacx.linalg.pi_damping_from_traces`); or, for a Kronecker pair
        ``(a, g)``, `kfacx.linalg.PiDamping` ``(weight)``: the factored "pi"
        damping, computed for all blocks' pairs in one vectorised pass.
      finish: ``inverses -> BlockState``: the new state from
        ``psd_inverse(matrices[i], dampings[i])`` for every ``i``.
    """

    matrices: tuple[jax.Array, ...]
    dampings: tuple[Any, ...] | Callable[[tuple[jax.Array, ...]], tuple[Any, ...]] | Any
    finish: Callable[[Sequence[jax.Array]], BlockState]


def factor_dtype(dtypes: Sequence[Any]) -> Any:
    """Statistics are kept in float32 or wider, whatever the parameters' dtype."""
    return jnp.promote_types(jnp.result_type(*dtypes), jnp.float32)


class CurvatureBlock(abc.ABC):
    """Abstract curvature block: one diagonal block of the curvature matrix.

    A block is a stateless description; all methods are pure and take and
    return a `BlockState` pytree. Subclasses implement `factor_shapes`,
    `compute_statistics`, `init_cache`, `update_cache`, `_multiply`,
    `_multiply_matpower` and `to_dense_matrix`.

    Vectors are tuples of arrays shaped like the layer's parameters (in the
    tag's order, e.g. ``(w, b)``).

    Args:
      layer: the `LayerInfo` of the tagged layer.
    """

    #: Whether `compute_statistics` reads the block's state (e.g. EKFAC: the eigenbasis
    #: its scaling is taken in). The estimator then passes it as the keyword ``state``.
    statistics_need_state: bool = False

    #: Whether the curvature is diagonal in the flattened parameters, so that its eigenbasis
    #: is the identity: the default `to_eigenbasis`, `from_eigenbasis` and
    #: `eigenbasis_change` then serve the block (otherwise they raise NotImplementedError).
    eigenbasis_is_identity: bool = False

    def __init__(self, layer: LayerInfo):
        self.layer = layer
        self.dtype = factor_dtype(layer.parameter_dtypes)

    # ---------------------------------------------------------------- metadata

    @property
    def parameters_shapes(self) -> tuple[tuple[int, ...], ...]:
        """Shapes of the parameters this block covers."""
        return self.layer.parameter_shapes

    @property
    def dim(self) -> int:
        """Total number of parameters covered by the block."""
        return sum(math.prod(s) for s in self.parameters_shapes)

    @property
    def block_name(self) -> str:
        """The name of the block kind (shown in the registration report)."""
        return type(self).__name__

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.layer.name})"

    # ---------------------------------------------------------------- abstract

    @abc.abstractmethod
    def factor_shapes(self) -> tuple[tuple[int, ...], ...]:
        """Shapes of the moving-average factors."""

    def statistics_shapes(self) -> tuple[tuple[int, ...], ...]:
        """Shapes of what `compute_statistics` returns: the factors' (a block that keeps
        a moving average outside its factors, e.g. in its cache, has more)."""
        return self.factor_shapes()

    @abc.abstractmethod
    def compute_statistics(
        self, estimation_data: Mapping[str, Sequence[jax.Array]], batch_size: int
    ) -> tuple[jax.Array, ...]:
        """This batch's statistics, one per factor.

        ``estimation_data`` has ``"inputs"``, ``"outputs"`` and ``"params"`` of
        the layer and ``"outputs_tangent"``: for every output an array of shape
        ``[num_samples, *output_shape]`` of cotangents whose second moments are
        *summed* over samples (the estimator scales them for averaging).
        Statistics are normalised by ``batch_size``. A block with
        ``statistics_need_state`` takes its `BlockState` as the keyword ``state``.

        With padded batches it also has ``"mask"``, per-example weights
        ``[batch]`` (0 for padding). The cotangents of padding examples are
        already zero, and ``batch_size`` counts only real examples; blocks
        whose statistics use the inputs must weight them by the mask (the
        built-in blocks do).
        """

    @abc.abstractmethod
    def init_cache(
        self,
        exact_powers_to_cache: Sequence[float],
        approx_powers_to_cache: Sequence[float],
        cache_eigenvalues: bool,
    ) -> Any:
        """An empty cache with the requested (static) structure."""

    @abc.abstractmethod
    def update_cache(self, state: BlockState, identity_weight: Any) -> BlockState:
        """Recomputes the cached quantities present in ``state.cache``; ``state.factors``
        (the moving averages) are passed on unchanged (the sharded curvature state
        writes only the cache at a refresh)."""

    @abc.abstractmethod
    def _multiply(self, state: BlockState, vector: Params, identity_weight: Any) -> Params:
        """``(C + identity_weight I) v``."""

    @abc.abstractmethod
    def _multiply_matpower(
        self,
        state: BlockState,
        vector: Params,
        identity_weight: Any,
        power: float,
        exact_power: bool,
        use_cached: bool,
    ) -> Params:
        """``(C + identity_weight I)^power v`` for ``power != 1``."""

    @abc.abstractmethod
    def to_dense_matrix(self, state: BlockState) -> jax.Array:
        """The block as an explicit ``[dim, dim]`` matrix over the flattened parameters
        (concatenated in the tag's order, each flattened row-major)."""

    # ---------------------------------------------------------------- batched refresh

    def inverse_refresh(self, state: BlockState, identity_weight: Any) -> InverseRefresh | None:
        """`update_cache` as damped inverses, so that they can be batched across blocks.

        `kfacx.BlockDiagonalCurvature.update_cache` inverts the (nearly)
        equal-sized matrices of all blocks together, as padded stacks
        (`kfacx.linalg.cholesky_inverse_padded`, with one shared fallback,
        `kfacx.linalg.repair_padded`): one factorisation to compile and run per
        size bucket instead of one per block.
        A block whose whole cache refresh is ``psd_inverse(m_i, d_i)`` of some
        matrices returns them here; the default, None, means the estimator calls
        `update_cache` instead. Both must give the same cache (to rounding).

        Returns:
          An `InverseRefresh`, or None.
        """
        del state, identity_weight
        return None

    # ---------------------------------------------------------------- template

    def init(
        self,
        rng: jax.Array,
        exact_powers_to_cache: Sequence[float] = (),
        approx_powers_to_cache: Sequence[float] = (),
        cache_eigenvalues: bool = False,
    ) -> BlockState:
        """A fresh state with zero factors and the requested cache structure.

        Args:
          rng: unused by the built-in blocks (kept for blocks with random state).
          exact_powers_to_cache: powers that `multiply_matpower` will use with
            ``exact_power=True, use_cached=True``.
          approx_powers_to_cache: powers used with ``exact_power=False, use_cached=True``.
          cache_eigenvalues: whether to keep an eigendecomposition in the cache.
        """
        del rng
        factors = tuple(WeightedMovingAverage.zeros(s, self.dtype) for s in self.factor_shapes())
        cache = self.init_cache(
            tuple(exact_powers_to_cache or ()),
            tuple(approx_powers_to_cache or ()),
            cache_eigenvalues,
        )
        return BlockState(factors, cache)

    def update_curvature_matrix_estimate(
        self,
        state: BlockState,
        estimation_data: Mapping[str, Sequence[jax.Array]],
        ema_old: Any,
        ema_new: Any,
        batch_size: int,
        pmap_axis_name: str | None = None,
    ) -> BlockState:
        """Folds this batch's statistics into the moving averages: `compute_statistics`,
        a mean over ``pmap_axis_name`` if given, `update_from_statistics` (all blocks:
        `kfacx.BlockDiagonalCurvature.update_curvature_matrix_estimate`)."""
        stats = statistics_of(self, estimation_data, batch_size, state)
        if pmap_axis_name is not None:
            stats = jax.lax.pmean(stats, pmap_axis_name)
        return self.update_from_statistics(state, stats, ema_old, ema_new)

    def update_from_statistics(
        self, state: BlockState, statistics: Sequence[jax.Array], ema_old: Any, ema_new: Any
    ) -> BlockState:
        """Folds statistics computed by `compute_statistics` into the moving averages
        (all blocks: `kfacx.BlockDiagonalCurvature.update_curvature_estimate_from_stats`)."""
        factors = tuple(
            f.update(s, ema_old, ema_new) for f, s in zip(state.factors, statistics, strict=True)
        )
        return state._replace(factors=factors)

    def multiply_matpower(
        self,
        state: BlockState,
        vector: Sequence[jax.Array],
        identity_weight: Any,
        power: float,
        exact_power: bool = False,
        use_cached: bool = False,
    ) -> Params:
        """``(C + identity_weight I)^power v``.

        Args:
          state: the block state.
          vector: a tuple of arrays shaped like the block's parameters.
          identity_weight: damping added to the block before the power.
          power: 1 (exact, no cache needed), -1, -0.5, or any power with
            ``exact_power=True``.
          exact_power: use the exact power of the damped block; otherwise
            blocks may use a cheaper approximation (factored damping for
            Kronecker-factored blocks).
          use_cached: use the quantities computed by the last `update_cache`.

        Returns:
          A tuple of arrays shaped like the parameters.

        Raises:
          ValueError: if the vector does not match the parameters, or the
            power is not supported / not cached.
        """
        vector = self._check_vector(vector)
        if power == 1:
            return self._multiply(state, vector, identity_weight)
        return self._multiply_matpower(
            state, vector, identity_weight, float(power), exact_power, use_cached
        )

    def multiply(self, state: BlockState, vector: Sequence[jax.Array], identity_weight: Any = 0.0):
        """``(C + identity_weight I) v``."""
        return self.multiply_matpower(state, vector, identity_weight, 1)

    def multiply_inverse(
        self, state, vector, identity_weight, exact_power=False, use_cached=False
    ) -> Params:
        """``(C + identity_weight I)^-1 v``."""
        return self.multiply_matpower(state, vector, identity_weight, -1, exact_power, use_cached)

    # ---------------------------------------------------------------- eigenbasis

    def to_eigenbasis(self, state: BlockState, vector: Sequence[jax.Array]) -> Any:
        """``Q^T v``: ``vector`` in the eigenbasis ``Q`` of the curvature cached at the last
        `update_cache` (the identity before it), in the block's dtype. A Kronecker block
        gives ``U_A^T V U_G [groups, n, m]``; the default, for blocks whose eigenbasis is
        the identity, the flattened vector. Cheap (matmuls): no eigendecomposition.

        Raises:
          NotImplementedError: if the block defines no eigenbasis.
          ValueError: if the cache holds no eigenbasis (create the state with
            ``cache_eigenvalues=True``).
        """
        vector = self._check_vector(vector)
        self._require_identity_eigenbasis()
        return flatten_params(vector).astype(self.dtype)

    def from_eigenbasis(self, state: BlockState, coordinates: Any) -> Params:
        """``Q c``: coordinates shaped as `to_eigenbasis` returns them, back to arrays shaped
        like the parameters (in the block's dtype)."""
        self._require_identity_eigenbasis()
        return unflatten_params(coordinates, self.parameters_shapes)

    def eigenbasis_change(self, old_state: BlockState, new_state: BlockState, diagonal: Any) -> Any:
        """A diagonal ``D`` in `to_eigenbasis`'s coordinates at ``old_state``, re-expressed
        at ``new_state``: the diagonal of ``Q_new^T Q_old diag(D) Q_old^T Q_new`` (per
        Kronecker factor ``R o R`` with ``R = U_new^T U_old``, as EKFAC's refresh)."""
        self._require_identity_eigenbasis()
        return diagonal

    def _require_identity_eigenbasis(self) -> None:
        if not self.eigenbasis_is_identity:
            raise missing_eigenbasis(self)

    def _check_vector(self, vector: Sequence[jax.Array]) -> Params:
        vector = tuple(vector)
        shapes = tuple(tuple(v.shape) for v in vector)
        if shapes != self.parameters_shapes:
            raise ValueError(
                f"{self!r}: vector has shapes {shapes}, expected the parameter shapes "
                f"{self.parameters_shapes}."
            )
        return vector

    def _approx_cached_or_now(
        self, state: BlockState, power: float, use_cached: bool, compute_now: Callable[[], Any]
    ) -> Any:
        """The cached approximate power ``power`` (fields ``inverse`` / ``inverse_sqrt``
        of the cache), or ``compute_now()`` when ``use_cached`` is False."""
        field = APPROX_POWER_FIELDS.get(power)
        if field is None:
            raise self._unsupported_power(power, "with exact_power=False")
        if not use_cached:
            return compute_now()
        value = getattr(state.cache, field)
        if value is None:
            raise self._missing_cache(f"the power {power}", f"approx_powers_to_cache=({power},)")
        return value

    def _approx_cache_fields(
        self, powers: Sequence[float], empty: Callable[[], Any]
    ) -> dict[str, Any]:
        """The approximate-power cache fields: ``empty()`` for each requested power,
        None for the others.

        Raises:
          ValueError: for a power that has no approximate form.
        """
        for p in powers:
            if float(p) not in APPROX_POWER_FIELDS:
                raise self._unsupported_power(p, "in approx_powers_to_cache")
        wanted = {float(p) for p in powers}
        return {f: empty() if p in wanted else None for p, f in APPROX_POWER_FIELDS.items()}

    @staticmethod
    def _refresh_approx_cache(cache: Any, compute: Callable[[float], Any]) -> Any:
        """Recomputes, with ``compute(power)``, every approximate power present in ``cache``."""
        for power, field in APPROX_POWER_FIELDS.items():
            if getattr(cache, field) is not None:
                cache = cache._replace(**{field: compute(power)})
        return cache

    @staticmethod
    def _inverse_only(cache: Any) -> bool:
        """Whether ``cache`` holds the approximate inverse and nothing else to refresh
        (no eigendecomposition, no inverse square root): the case `inverse_refresh`
        can batch."""
        return cache.inverse is not None and cache.eigen is None and cache.inverse_sqrt is None

    def _unsupported_power(self, power: float, how: str) -> ValueError:
        return ValueError(
            f"{self!r}: power {power} is not supported {how}. Use power 1, -1 or -0.5, or "
            "exact_power=True for other powers."
        )

    def _missing_cache(self, what: str, init_arg: str) -> ValueError:
        return ValueError(
            f"{self!r}: use_cached=True needs {what} in the cache; create the state with "
            f"init(..., {init_arg}) and call update_cache first."
        )


def statistics_of(block: Any, estimation_data: Any, batch_size: Any, state: Any) -> tuple:
    """``block.compute_statistics(estimation_data, batch_size)``, with ``state=state`` for a
    block whose statistics need it (``statistics_need_state``)."""
    if getattr(block, "statistics_need_state", False):
        return tuple(block.compute_statistics(estimation_data, batch_size, state=state))
    return tuple(block.compute_statistics(estimation_data, batch_size))


def check_precon_power(power: Any, use_exact_inverses: bool) -> float:
    """``precon_power`` as a float: negative, and -1 or -0.5 without exact inverses.

    Raises:
      ValueError: naming the value and what to use instead.
    """
    if not (_checks.is_number(power) and math.isfinite(power) and power < 0):
        raise ValueError(
            f"precon_power must be a negative number (e.g. -1 or -0.5), got {power!r}."
        )
    if not use_exact_inverses and float(power) not in APPROX_POWER_FIELDS:
        raise ValueError(
            f"precon_power={power} needs use_exact_inverses=True: the factored (pi) "
            f"damping serves the powers {sorted(APPROX_POWER_FIELDS)} only."
        )
    return float(power)
