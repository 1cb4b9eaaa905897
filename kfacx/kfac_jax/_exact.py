"""kfac-jax's exact-curvature estimators, on kfacx's tracer: `ImplicitExactCurvature`
(products with the exact Hessian, Gauss-Newton and Fisher matrices of the registered
losses, never formed) and `ExplicitExactCurvature` (the exact Gauss-Newton / Fisher
matrix over all parameters, formed as a dense matrix from those products).

Both divide by the batch size, as kfac-jax does: the curvature is that of the mean loss
over the batch (``batch_size_extractor(func_args[-1])``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kfacx import linalg as _linalg
from kfacx.kfac_jax import tracer as _tracer
from kfacx.kfac_jax._products import PowerProducts
from kfacx.kfac_jax.utils import WeightedMovingAverage, default_batch_size_extractor


def _scale(tree: Any, factor: Any) -> Any:
    return jax.tree_util.tree_map(lambda x: x * factor, tree)


class ImplicitExactCurvature:
    """Products with the exact curvature matrices of ``func``'s registered losses (kfac-jax's
    class): ``H v`` (`multiply_hessian`, the Hessian of the summed losses), ``G v``
    (`multiply_ggn`, ``J^T H_L J``), ``F v`` (`multiply_fisher`; kfacx's losses are
    exponential-family negative log-likelihoods in their natural parameters, so ``F = G``),
    ``J v`` / ``J^T u``, and the factors ``B`` with ``G = B B^T``."""

    def __init__(
        self,
        func: Callable[..., Any],
        params_index: int = 0,
        batch_size_extractor: Callable[[Any], int] = default_batch_size_extractor,
    ):
        self.func = func
        self.params_index = params_index
        self._batch_size_extractor = batch_size_extractor
        self.compute_losses, _ = _tracer.compute_all_losses(func, params_index)
        self._loss_tags_vjp, _ = _tracer.loss_tags_vjp(func, params_index)
        self._loss_tags_jvp, _ = _tracer.loss_tags_jvp(func, params_index)
        self._loss_tags_hvp, _ = _tracer.loss_tags_hvp(func, params_index)

    def batch_size(self, func_args: Sequence[Any]) -> int:
        """``batch_size_extractor(func_args[-1])``."""
        return self._batch_size_extractor(func_args[-1])

    # ------------------------------------------------------------------ per loss

    @staticmethod
    def multiply_loss_fisher(losses, loss_vectors):
        return tuple(loss.multiply_fisher(v) for loss, v in zip(losses, loss_vectors, strict=True))

    @staticmethod
    def multiply_loss_ggn(losses, loss_vectors):
        return tuple(loss.multiply_ggn(v) for loss, v in zip(losses, loss_vectors, strict=True))

    @staticmethod
    def multiply_loss_fisher_factor(losses, loss_inner_vectors):
        return tuple(
            loss.multiply_fisher_factor(v)
            for loss, v in zip(losses, loss_inner_vectors, strict=True)
        )

    @staticmethod
    def multiply_loss_ggn_factor(losses, loss_inner_vectors):
        return tuple(
            loss.multiply_ggn_factor(v) for loss, v in zip(losses, loss_inner_vectors, strict=True)
        )

    @staticmethod
    def multiply_loss_fisher_factor_transpose(losses, loss_vectors):
        return tuple(
            loss.multiply_fisher_factor_transpose(v)
            for loss, v in zip(losses, loss_vectors, strict=True)
        )

    @staticmethod
    def multiply_loss_ggn_factor_transpose(losses, loss_vectors):
        return tuple(
            loss.multiply_ggn_factor_transpose(v)
            for loss, v in zip(losses, loss_vectors, strict=True)
        )

    # ------------------------------------------------------------------ parameter space

    def multiply_hessian(self, func_args: Sequence[Any], parameter_structured_vector: Any) -> Any:
        """``H v / batch_size``, ``H`` the Hessian of the summed losses."""
        hvp, _ = self._loss_tags_hvp(func_args, parameter_structured_vector)
        return _scale(hvp, 1.0 / self.batch_size(func_args))

    def multiply_jacobian(
        self, func_args, parameter_structured_vector, return_loss_objects: bool = False
    ):
        """``J v``: one tuple per loss."""
        losses, tangents = self._loss_tags_jvp(func_args, parameter_structured_vector)
        return (tangents, losses) if return_loss_objects else tangents

    def multiply_jacobian_transpose(
        self, func_args, loss_input_vectors, return_loss_objects: bool = False
    ):
        """``J^T u`` for one tuple per loss."""
        losses, vjp = self._loss_tags_vjp(func_args)
        vector = vjp(loss_input_vectors)
        return (vector, losses) if return_loss_objects else vector

    def _sandwich(self, func_args, vector, multiply):
        tangents, losses = self.multiply_jacobian(func_args, vector, True)
        products = multiply(losses, tangents)
        result = self.multiply_jacobian_transpose(func_args, products)
        return _scale(result, 1.0 / self.batch_size(func_args))

    def multiply_fisher(self, func_args: Sequence[Any], parameter_structured_vector: Any) -> Any:
        """``F v / batch_size`` (``J^T F_L J v``)."""
        return self._sandwich(func_args, parameter_structured_vector, self.multiply_loss_fisher)

    def multiply_ggn(self, func_args: Sequence[Any], parameter_structured_vector: Any) -> Any:
        """``G v / batch_size`` (``J^T H_L J v``)."""
        return self._sandwich(func_args, parameter_structured_vector, self.multiply_loss_ggn)

    def multiply_fisher_factor_transpose(self, func_args, parameter_structured_vector):
        """``B^T v / sqrt(batch_size)`` per loss, ``B B^T`` the Fisher."""
        tangents, losses = self.multiply_jacobian(func_args, parameter_structured_vector, True)
        vectors = self.multiply_loss_fisher_factor_transpose(losses, tangents)
        return _scale(vectors, 1.0 / np.sqrt(self.batch_size(func_args)))

    def multiply_ggn_factor_transpose(self, func_args, parameter_structured_vector):
        """``B^T v / sqrt(batch_size)`` per loss, ``B B^T`` the Gauss-Newton matrix."""
        tangents, losses = self.multiply_jacobian(func_args, parameter_structured_vector, True)
        vectors = self.multiply_loss_ggn_factor_transpose(losses, tangents)
        return _scale(vectors, 1.0 / np.sqrt(self.batch_size(func_args)))

    def multiply_fisher_factor(self, func_args, loss_inner_vectors):
        """``B u / sqrt(batch_size)``, ``u`` one tuple per loss."""
        losses, vjp = self._loss_tags_vjp(func_args)
        vectors = vjp(self.multiply_loss_fisher_factor(losses, loss_inner_vectors))
        return _scale(vectors, 1.0 / np.sqrt(self.batch_size(func_args)))

    def multiply_ggn_factor(self, func_args, loss_inner_vectors):
        """``B u / sqrt(batch_size)``, ``u`` one tuple per loss."""
        losses, vjp = self._loss_tags_vjp(func_args)
        vectors = vjp(self.multiply_loss_ggn_factor(losses, loss_inner_vectors))
        return _scale(vectors, 1.0 / np.sqrt(self.batch_size(func_args)))


class ExplicitExactState(NamedTuple):
    """`ExplicitExactCurvature`'s state: the moving average of the dense matrix, and the
    cached inverse powers (``{power: matrix}``)."""

    matrix: WeightedMovingAverage
    cache: dict


_EXACT_MODES = ("fisher_exact", "ggn_exact")
#: kfac-jax's estimator arguments that only sampled estimates use.
_SAMPLING_KWARGS = {
    "num_samples",
    "should_vmap_samples",
    "norm_to_scale_identity_weight_per_block",
    "distributed_multiplies",
    "distributed_cache_updates",
}


class ExplicitExactCurvature(PowerProducts):
    """The exact Gauss-Newton / Fisher matrix over all parameters, as one dense matrix
    (kfac-jax's class): each update forms it from ``dim`` exact matrix-vector products
    (`ImplicitExactCurvature`) and folds it into a moving average. Only the exact
    estimation modes are served (``"fisher_exact"``, ``"ggn_exact"``; they agree for
    kfacx's losses); for sampled estimates over all parameters give a
    `kfacx.BlockDiagonalCurvature` `kfacx.Full` blocks.

    The rows and columns follow the parameters' pytree-leaf order, as kfac-jax's dense
    matrices do (its "canonical order": kfac-jax's ``param_order`` chooses which leaf
    carries its one generic tag, and the matrix is in canonical order whatever it is).
    ``param_order`` is taken for kfac-jax's signature and checked to be a permutation of
    the leaves."""

    def __init__(
        self,
        func: Callable[..., Any] | None = None,
        func_and_grad: Callable[..., Any] | None = None,
        default_estimation_mode: str | None = None,
        layer_tag_to_block_ctor: Any = None,
        auto_register_tags: bool = False,
        param_order: Sequence[int] | None = None,
        params_index: int = 0,
        batch_size_extractor: Callable[[Any], int] = default_batch_size_extractor,
        **kwargs: Any,
    ):
        del layer_tag_to_block_ctor, auto_register_tags
        unknown = set(kwargs) - _SAMPLING_KWARGS
        if unknown:
            raise TypeError(
                f"ExplicitExactCurvature got unexpected arguments {sorted(unknown)} (it takes "
                f"kfac-jax's, and ignores {sorted(_SAMPLING_KWARGS)}, which only matter to "
                "sampled estimates)."
            )
        if (func is None) == (func_and_grad is None):
            raise ValueError("Exactly one of `func` and `func_and_grad` must be provided.")
        if func is None:

            def func(*args):
                return func_and_grad(*args)[0]

        self.default_estimation_mode = _check_mode(default_estimation_mode or "ggn_exact")
        self.params_index = params_index
        self._implicit = ImplicitExactCurvature(func, params_index, batch_size_extractor)
        self._param_order = None if param_order is None else tuple(int(i) for i in param_order)
        self._shapes: tuple[tuple[int, ...], ...] | None = None
        self._treedef = None

    # ------------------------------------------------------------------ layout

    def _set_up(self, params: Any) -> None:
        leaves, self._treedef = jax.tree_util.tree_flatten(params)
        self._shapes = tuple(tuple(x.shape) for x in leaves)
        order = self._param_order or tuple(range(len(leaves)))
        if sorted(order) != list(range(len(leaves))):
            raise ValueError(
                f"param_order={order} is not a permutation of the {len(leaves)} parameter leaves."
            )

    @property
    def dim(self) -> int:
        if self._shapes is None:
            raise ValueError("ExplicitExactCurvature is not set up yet: call init first.")
        return sum(int(np.prod(s)) for s in self._shapes)

    @property
    def param_order(self) -> tuple[int, ...]:
        """The order given to the constructor (pytree-leaf order when none was)."""
        if self._shapes is None:
            raise ValueError("ExplicitExactCurvature is not set up yet: call init first.")
        return self._param_order or tuple(range(len(self._shapes)))

    def _to_vector(self, params: Any) -> jax.Array:
        return jnp.concatenate([x.reshape(-1) for x in jax.tree_util.tree_leaves(params)])

    def _from_vector(self, vector: jax.Array) -> Any:
        sizes = [int(np.prod(shape)) for shape in self._shapes]
        pieces = jnp.split(vector, np.cumsum(sizes)[:-1])
        leaves = [p.reshape(shape) for p, shape in zip(pieces, self._shapes, strict=True)]
        return jax.tree_util.tree_unflatten(self._treedef, leaves)

    # ------------------------------------------------------------------ estimator API

    def init(
        self,
        rng: Any,
        func_args: Sequence[Any],
        exact_powers_to_cache: Any = None,
        approx_powers_to_cache: Any = None,
        cache_eigenvalues: bool = False,
    ) -> ExplicitExactState:
        """A zero matrix (its powers are cached by `update_cache` when asked for)."""
        del rng, exact_powers_to_cache, approx_powers_to_cache, cache_eigenvalues
        params = func_args[self.params_index]
        self._set_up(params)
        dtype = jnp.result_type(*jax.tree_util.tree_leaves(params))
        zeros = WeightedMovingAverage(
            weight=jnp.zeros([], dtype), value=jnp.zeros((self.dim, self.dim), dtype)
        )
        return ExplicitExactState(zeros, {})

    def exact_matrix(self, func_args: Sequence[Any], estimation_mode: str | None = None):
        """The exact curvature at ``func_args``, dense, in pytree-leaf order."""
        mode = _check_mode(estimation_mode or self.default_estimation_mode)
        multiply = (
            self._implicit.multiply_fisher
            if mode == "fisher_exact"
            else self._implicit.multiply_ggn
        )

        def column(e):
            return self._to_vector(multiply(func_args, self._from_vector(e)))

        eye = jnp.eye(self.dim, dtype=self._dtype(func_args))
        return jax.lax.map(column, eye).T

    def _dtype(self, func_args):
        return jnp.result_type(*jax.tree_util.tree_leaves(func_args[self.params_index]))

    def update_curvature_matrix_estimate(
        self,
        state: ExplicitExactState,
        ema_old: Any,
        ema_new: Any,
        identity_weight: Any,
        batch_size: Any,
        rng: Any,
        func_args: Sequence[Any],
        estimation_mode: str | None = None,
        pmap_axis_name: str | None = None,
    ) -> ExplicitExactState:
        """``ema_old * average + ema_new * exact matrix`` (the matrix averaged over
        ``pmap_axis_name`` when given)."""
        del identity_weight, batch_size, rng
        matrix = self.exact_matrix(func_args, estimation_mode)
        if pmap_axis_name is not None:
            matrix = jax.lax.pmean(matrix, pmap_axis_name)
        average = WeightedMovingAverage(weight=state.matrix.weight, value=state.matrix.value)
        average.update(matrix, ema_old, ema_new)  # in place, as kfac-jax's
        return state._replace(matrix=average)

    def sync(self, state: ExplicitExactState, pmap_axis_name: str | None) -> ExplicitExactState:
        """The state (the matrix is averaged over devices when it is updated)."""
        del pmap_axis_name
        return state

    def to_dense_matrix(self, state: ExplicitExactState) -> jax.Array:
        return state.matrix.value

    def to_diagonal_block_dense_matrix(self, state: ExplicitExactState) -> tuple[jax.Array]:
        return (state.matrix.value,)

    def update_cache(
        self,
        state: ExplicitExactState,
        identity_weight: Any,
        exact_powers: Any = None,
        approx_powers: Any = None,
        eigenvalues: bool = False,
        pmap_axis_name: str | None = None,
        norm_to_scale_identity_weight_per_block: str | None = None,
    ) -> ExplicitExactState:
        """Caches ``(C + identity_weight I)^p`` for the powers asked for."""
        from kfacx.kfac_jax._blocks._block import to_real_set

        del eigenvalues, pmap_axis_name, norm_to_scale_identity_weight_per_block
        powers = to_real_set(exact_powers) | to_real_set(approx_powers)
        cache = {p: self._matpower(state, identity_weight, p) for p in sorted(powers)}
        return state._replace(cache=cache)

    def _matpower(self, state, identity_weight, power):
        matrix = state.matrix.value
        damped = matrix + identity_weight * jnp.eye(matrix.shape[0], dtype=matrix.dtype)
        if power == -1:
            return _linalg.psd_inverse(matrix, identity_weight)
        vals, vecs = jnp.linalg.eigh(damped)
        return (vecs * jnp.power(jnp.maximum(vals, 0.0), power)) @ vecs.T

    def multiply_matpower(
        self,
        state: ExplicitExactState,
        parameter_structured_vector: Any,
        identity_weight: Any,
        power: Any,
        exact_power: bool = False,
        use_cached: bool = False,
        pmap_axis_name: str | None = None,
        norm_to_scale_identity_weight_per_block: str | None = None,
    ) -> Any:
        """``(C + identity_weight I)^power v``."""
        del exact_power, pmap_axis_name, norm_to_scale_identity_weight_per_block
        if use_cached and power in state.cache:
            m = state.cache[power]
        elif power == 1:
            m = state.matrix.value + identity_weight * jnp.eye(
                self.dim, dtype=state.matrix.value.dtype
            )
        else:
            m = self._matpower(state, identity_weight, power)
        return self._from_vector(m @ self._to_vector(parameter_structured_vector))


def _check_mode(mode: str) -> str:
    if mode not in _EXACT_MODES:
        raise ValueError(
            f"ExplicitExactCurvature serves estimation_mode in {_EXACT_MODES}, got {mode!r}; for "
            "a sampled estimate give kfacx.BlockDiagonalCurvature kfacx.Full blocks "
            "(layer_tag_to_block_ctor)."
        )
    return mode
