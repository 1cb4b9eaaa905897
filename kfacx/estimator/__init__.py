"""The block-diagonal curvature estimator: one curvature block per layer tag.

Its wing: ``_statistics`` (a batch's per-layer statistics, per estimation mode),
``_refresh`` (the inverse refresh, batched per size bucket, spread over devices),
``_identity_weights`` (each block's damping), ``_sharded_*`` (the state packed per
owner device, its units and checkpoints).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax

from kfacx import blocks as blocks_lib
from kfacx import graph_matcher, tracer
from kfacx._helpers import _checks, _paths
from kfacx._helpers._user_warnings import said_once
from kfacx.blocks._families import DEFAULT_LAYER_TAG_TO_BLOCK_CTOR
from kfacx.estimator import _identity_weights, _refresh, _statistics
from kfacx.estimator._statistics import ESTIMATION_MODES, CurvatureStats, weighted_mean_stats
from kfacx.losses import LossFunction

__all__ = [
    "DEFAULT_LAYER_TAG_TO_BLOCK_CTOR",
    "ESTIMATION_MODES",
    "BlockDiagonalCurvature",
    "CurvatureStats",
    "EstimatorState",
    "weighted_mean_stats",
]


class EstimatorState(NamedTuple):
    """State of `BlockDiagonalCurvature`: one `kfacx.blocks.BlockState` per block."""

    blocks: tuple[blocks_lib.BlockState, ...]


class BlockDiagonalCurvature:
    """Block-diagonal approximation of the Fisher / Gauss-Newton matrix of a tagged loss.

    The estimator traces ``func`` (on the first call that gets ``func_args``),
    builds one curvature block per layer tag, and from then on estimates each
    block from the layer statistics that `kfacx.layer_tags_vjp` returns.

    Args:
      func: the loss function, with registered losses and layer tags.
      params_index: the position of the parameters among ``func``'s arguments.
      layer_tag_to_block_ctor: maps tag names to block classes (or factories
        taking a `kfacx.blocks.LayerInfo`); overrides
        `DEFAULT_LAYER_TAG_TO_BLOCK_CTOR` and ``curvature_block`` for the given
        names. A stacked layer (inside a `lax.scan` over its parameters, e.g.
        `hk.layer_stack`) is served by a `kfacx.blocks.StackedBlock` of its tag's block.
      default_estimation_mode: one of `ESTIMATION_MODES`.
      num_samples: number of sampled cotangents per example in the sampling
        modes (their second moments are averaged).
      exact_powers_to_cache, approx_powers_to_cache, cache_eigenvalues: what
        `update_cache` keeps (see `kfacx.blocks.CurvatureBlock.init`).
      auto_register_tags: find the layers automatically
        (`kfacx.graph_matcher.auto_register_tags`); layers tagged by hand are
        kept. With False, every parameter must be tagged by hand.
      auto_register_kwargs: keyword arguments of `auto_register_tags`
        (``graph_patterns``, ``on_unmatched``).
      norm_to_scale_identity_weight_per_block: None, or a norm of
        `kfacx.blocks.NORM_TYPES` (as kfac-jax): the identity weight of every
        block (in `update_cache` and the products) is multiplied by that norm of
        the block's curvature (`kfacx.blocks.block_norm`), so that the damping
        follows each block's scale.
      curvature_block: the blocks of the dense and convolution layers, a family of
        `kfacx.blocks.CURVATURE_BLOCKS`: ``"kfac"`` (default), ``"kfac_reduce"``,
        ``"tnt"`` or ``"ekfac"`` (which serves the embedding layers too).

    Raises:
      ValueError: on an unknown estimation mode, norm or block family, or a bad
        ``num_samples``.
      TypeError: if a block constructor is not callable.

    Example::

      estimator = kfacx.BlockDiagonalCurvature(loss_fn)
      state = estimator.init(rng, (params, batch))
      state = estimator.update_curvature_matrix_estimate(
          state, 0.95, 0.05, batch_size, rng, (params, batch))
      state = estimator.update_cache(state, identity_weight=1e-3)
      step = estimator.multiply_inverse(state, grads, 1e-3, use_cached=True)
    """

    def __init__(
        self,
        func: Callable[..., Any],
        params_index: int = 0,
        layer_tag_to_block_ctor: Mapping[str, Callable[..., Any]] | None = None,
        default_estimation_mode: str = "fisher_gradients",
        num_samples: int = 1,
        exact_powers_to_cache: Sequence[float] = (),
        approx_powers_to_cache: Sequence[float] = (-1,),
        cache_eigenvalues: bool = False,
        auto_register_tags: bool = True,
        auto_register_kwargs: Mapping[str, Any] | None = None,
        norm_to_scale_identity_weight_per_block: str | None = None,
        curvature_block: str = "kfac",
    ):
        if not callable(func):
            raise TypeError(f"BlockDiagonalCurvature: func must be callable, got {func!r}.")
        _checks.check_int(num_samples, "BlockDiagonalCurvature: num_samples", minimum=1)
        family = blocks_lib.curvature_block_ctors(curvature_block)
        ctors = {**DEFAULT_LAYER_TAG_TO_BLOCK_CTOR, **family}
        ctors.update(_checks.block_ctors(layer_tag_to_block_ctor))
        self.curvature_block = curvature_block
        self.func = func
        self.params_index = params_index
        self.layer_tag_to_block_ctor = ctors
        self.default_estimation_mode = _statistics.check_mode(default_estimation_mode)
        self.num_samples = num_samples
        self.norm_to_scale_identity_weight_per_block = blocks_lib.check_norm_type(
            norm_to_scale_identity_weight_per_block, "norm_to_scale_identity_weight_per_block"
        )
        self._cache_spec = (tuple(exact_powers_to_cache), tuple(approx_powers_to_cache))
        self._cache_spec += (cache_eigenvalues,)
        self.auto_register_tags = auto_register_tags
        self.auto_register_kwargs = _checks.auto_register_kwargs(
            auto_register_kwargs, graph_matcher.ON_UNMATCHED
        )
        on_unmatched = self.auto_register_kwargs.get("on_unmatched", "warn")
        if on_unmatched == "full" and "generic_tag" not in (layer_tag_to_block_ctor or {}):
            self.layer_tag_to_block_ctor["generic_tag"] = blocks_lib.Full
        self._traced: tracer.TracedFunction | None = None
        self._blocks: tuple[blocks_lib.CurvatureBlock, ...] = ()
        self._coverage_shapes: tuple[tuple[int, ...] | None, ...] = ()
        self._tagged: dict[Any, tuple[Callable[..., Any], Any]] = {}
        self._warned: set[str] = set()  # detection's warnings, said once per estimator
        self._report: graph_matcher.RegistrationReport | None = None

    # ---------------------------------------------------------------- set-up

    def tagged_func(self, func_args: Sequence[Any]) -> Callable[..., Any]:
        """The function with layer tags (auto-registered for these argument shapes)."""
        if not self.auto_register_tags:
            return self.func
        key = tracer.shape_key(func_args)
        if key not in self._tagged:
            kwargs = dict(params_index=self.params_index, **self.auto_register_kwargs)
            with said_once(self._warned):
                self._tagged[key] = graph_matcher.auto_register_tags(self.func, func_args, **kwargs)
        tagged, self._report = self._tagged[key]
        return tagged

    @property
    def report(self) -> graph_matcher.RegistrationReport | None:
        """The registration report of the last set-up (None without auto-registration)."""
        if self._report is None or not self._blocks:
            return self._report
        names = [b.block_name for b in self._blocks]
        return self._report.with_blocks(lambda e: names[e.layer])

    def set_up(self, func_args: Sequence[Any]) -> None:
        """Traces ``func`` on ``func_args`` and builds the blocks (`init` does it too).

        Raises:
          ValueError: if no loss is registered, or a parameter has no layer tag.
        """
        self._set_up(tuple(func_args))

    def zero_curvature_stats(self) -> CurvatureStats:
        """Statistics of zero batches (zeros shaped like every block's factors)."""
        self._require_set_up()
        return _statistics.zero_stats(self._blocks, self._coverage_shapes)

    def _set_up(self, func_args: Sequence[Any]) -> tracer.TracedFunction:
        traced = tracer.trace_cached(self.tagged_func(func_args), func_args, self.params_index)
        if traced is self._traced:
            return traced
        covered = {leaf for leaves in traced.layer_param_leaves for leaf in leaves}
        missing = [p for i, p in enumerate(traced.param_paths) if i not in covered]
        if missing:
            raise ValueError(
                f"Parameters {missing} are used by no layer tag. Register their layers (e.g. "
                "kfacx.register_dense(y, x, w, b)) or tag them with kfacx.register_generic(p)."
            )
        self._blocks = tuple(
            self._make_block(layer, leaves)
            for layer, leaves in zip(traced.layers, traced.layer_param_leaves, strict=True)
        )
        # Per block: the shape of its coverage (a layer used only in cond branches), or None.
        self._coverage_shapes = tuple(
            (() if layer.stack_size is None else (layer.stack_size,)) if conditional else None
            for layer, conditional in zip(traced.layers, traced.conditional_layers, strict=True)
        )
        self._traced = traced
        return traced

    def _make_block(
        self, layer: blocks_lib.LayerInfo, param_leaves: Sequence[int]
    ) -> blocks_lib.CurvatureBlock:
        """The block of ``layer``, whose parameters are the leaves ``param_leaves`` of the
        parameter pytree (in the tag's order)."""
        del param_leaves
        return blocks_lib.layer_block(layer, self.layer_tag_to_block_ctor)

    @property
    def blocks(self) -> tuple[blocks_lib.CurvatureBlock, ...]:
        """The curvature blocks, one per layer tag (after `init`)."""
        self._require_set_up()
        return self._blocks

    def _require_set_up(self) -> tracer.TracedFunction:
        if self._traced is None:
            raise ValueError(
                "BlockDiagonalCurvature is not set up yet: call init(rng, func_args) or "
                "set_up(func_args) first (creating kfacx.scale_by_kfac also sets it up)."
            )
        return self._traced

    # ---------------------------------------------------------------- vectors

    def params_to_blocks(self, params: Any) -> tuple[tuple[jax.Array, ...], ...]:
        """Splits a parameter pytree into one tuple of arrays per block.

        Raises:
          ValueError: if the pytree does not have the parameters' structure (with or
            without boxes around its arrays, e.g. ``nnx.Param``).
        """
        traced = self._require_set_up()
        leaves, tree = jax.tree_util.tree_flatten(params)
        _paths.check_params_structure(tree, traced.params_tree)
        return tuple(tuple(leaves[i] for i in ids) for ids in traced.layer_param_leaves)

    def blocks_to_params(self, vectors: Sequence[Sequence[jax.Array]], like: Any = None) -> Any:
        """Inverse of `params_to_blocks`: the parameters' structure, or ``like``'s (a
        vector it accepted: with or without ``nnx.Param`` boxes)."""
        traced = self._require_set_up()
        leaves: list[Any] = [None] * traced.num_param_leaves
        for ids, vec in zip(traced.layer_param_leaves, vectors, strict=True):
            for i, v in zip(ids, vec, strict=True):
                leaves[i] = v
        tree = traced.params_tree if like is None else jax.tree_util.tree_structure(like)
        return jax.tree_util.tree_unflatten(tree, leaves)

    # ---------------------------------------------------------------- state

    def init(self, rng: jax.Array, func_args: Sequence[Any]) -> EstimatorState:
        """Traces ``func`` on ``func_args``, builds the blocks and their initial state.

        Raises:
          ValueError: if no loss is registered, or a parameter has no layer tag.
        """
        self._set_up(func_args)
        # The built-in `CurvatureBlock.init` ignores its key: split it only for blocks
        # with an `init` of their own (an eager split compiles threefry, about 0.15 s).
        rngs = [rng] * len(self._blocks)
        if any(type(b).init is not blocks_lib.CurvatureBlock.init for b in self._blocks):
            rngs = list(jax.random.split(rng, max(len(self._blocks), 1)))
        return EstimatorState(
            tuple(b.init(r, *self._cache_spec) for b, r in zip(self._blocks, rngs, strict=False))
        )

    def update_curvature_matrix_estimate(
        self,
        state: EstimatorState,
        ema_old: Any,
        ema_new: Any,
        batch_size: int | None,
        rng: jax.Array,
        func_args: Sequence[Any],
        estimation_mode: str | None = None,
        pmap_axis_name: str | None = None,
    ) -> EstimatorState:
        """Folds the statistics of ``func_args``'s batch into every block:
        `compute_curvature_stats` (given ``state``), then
        `update_curvature_estimate_from_stats`.

        Args:
          state: the estimator state.
          ema_old, ema_new: moving-average weights (``new = old * ema_old + stat * ema_new``).
          batch_size: the statistics' normaliser (None: the first loss's batch size).
          rng: randomness for the sampling modes.
          func_args: the arguments of ``func`` (parameters and batch).
          estimation_mode: one of `ESTIMATION_MODES` (default: the constructor's).
          pmap_axis_name: average statistics over this device axis.

        Raises:
          ValueError: on an unknown estimation mode.
        """
        spec = dict(estimation_mode=estimation_mode, batch_size=batch_size)
        stats = self.compute_curvature_stats(rng, func_args, **spec, estimator_state=state)
        return self.update_curvature_estimate_from_stats(
            state, stats, ema_old, ema_new, pmap_axis_name
        )

    def compute_curvature_stats(
        self,
        rng: jax.Array,
        func_args: Sequence[Any],
        estimation_mode: str | None = None,
        batch_size: Any = None,
        example_mask: jax.Array | None = None,
        has_aux: bool = False,
        estimator_state: EstimatorState | None = None,
    ) -> CurvatureStats:
        """This batch's curvature statistics (see `value_grads_and_curvature_stats`;
        ``has_aux`` matters only to ``fisher_empirical_direct``)."""
        mode = _statistics.check_mode(estimation_mode or self.default_estimation_mode)
        self._set_up(func_args)
        func = self.tagged_func(func_args)
        if mode == _statistics.DIRECT_MODE:
            _, _, losses, vjp = tracer.value_and_grad_and_layer_tags_vjp(
                func, func_args, self.params_index, has_aux
            )
        else:
            losses, vjp = tracer.layer_tags_vjp(func, func_args, self.params_index)
        return self._stats(losses, vjp, mode, rng, batch_size, example_mask, estimator_state)

    def value_grads_and_curvature_stats(
        self,
        rng: jax.Array,
        func_args: Sequence[Any],
        has_aux: bool = False,
        estimation_mode: str | None = None,
        example_mask: jax.Array | None = None,
        estimator_state: EstimatorState | None = None,
    ) -> tuple[Any, Any, CurvatureStats]:
        """The loss, its gradient and the curvature statistics, from one forward pass.

        Args:
          rng: randomness for the sampling estimation modes.
          func_args: the arguments of ``func`` (parameters and batch).
          has_aux: whether ``func`` returns ``(loss, aux)`` rather than the loss.
          estimation_mode: one of `ESTIMATION_MODES` (default: the constructor's).
          example_mask: optional ``[batch]`` array, 1 for real examples and 0
            for padding (binary: the cotangents are multiplied by it, and a
            loss registered with the same mask already is). Padding examples then contribute nothing
            to the statistics, which average over the real examples only. The
            loss itself must mask them too (e.g. ``register_*_loss(..., mask=m)``
            and a loss normalised by ``m.sum()``).
          estimator_state: the `EstimatorState`, for blocks whose statistics need it
            (``statistics_need_state``: EKFAC's scaling is taken in the eigenbasis of the
            last refresh); `kfacx.estimator_state` finds it in an optax state.

        Returns:
          ``(value, grads, stats)``: ``func``'s output, the gradient of the
          loss with respect to the parameters, and a `CurvatureStats` to pass to
          `update_curvature_estimate_from_stats` (or to `kfacx.scale_by_kfac`).
        """
        mode = _statistics.check_mode(estimation_mode or self.default_estimation_mode)
        self._set_up(func_args)
        func = self.tagged_func(func_args)
        value, grads, losses, vjp = tracer.value_and_grad_and_layer_tags_vjp(
            func, func_args, self.params_index, has_aux
        )
        stats = self._stats(losses, vjp, mode, rng, None, example_mask, estimator_state)
        return value, grads, stats

    def _stats(self, losses, vjp, mode, rng, batch_size, mask, estimator_state) -> CurvatureStats:
        states = _statistics.block_states(self._blocks, estimator_state)
        spec = (mode, rng, self.num_samples, batch_size, mask, states)
        return _statistics.curvature_stats(self._blocks, self._coverage_shapes, losses, vjp, *spec)

    def update_curvature_estimate_from_stats(
        self,
        state: EstimatorState,
        stats: CurvatureStats,
        ema_old: Any,
        ema_new: Any,
        pmap_axis_name: str | None = None,
    ) -> EstimatorState:
        """Folds precomputed statistics into every block's moving averages.

        The second half of `update_curvature_matrix_estimate` (per block:
        `kfacx.blocks.CurvatureBlock.update_from_statistics`); used by
        `kfacx.transform.precondition`, the core of `kfacx.scale_by_kfac`.

        With ``pmap_axis_name`` the statistics are first averaged over that
        device axis (weighted by each device's batch size), so all devices
        end with the same state.
        """
        self._require_set_up()
        if pmap_axis_name is not None:
            stats = weighted_mean_stats(stats, pmap_axis_name)
        return EstimatorState(
            tuple(
                _statistics.update_block(b, s, st, ema_old, ema_new, c is not None)
                for b, s, st, c in zip(
                    self._blocks, state.blocks, stats.blocks, self._coverage_shapes, strict=True
                )
            )
        )

    def linearized_losses(
        self, func_args: Sequence[Any]
    ) -> tuple[tuple[LossFunction, ...], Callable[[Any], tuple[jax.Array, ...]]]:
        """The registered losses at ``func_args``, and their predictions' Jacobian.

        For exact curvature products: ``jvp(v)`` maps a parameter-shaped ``v`` to
        the tangents ``J v`` of the losses' predictions and ``loss.multiply_ggn``
        multiplies by each loss's Gauss-Newton matrix ``H``, so ``(J u)^T H (J v)`` is
        ``u^T C v`` for the exact Gauss-Newton matrix ``C``
        (`kfacx.estimator._statistics.ggn_gram_upper`; `kfacx.Optimizer`'s quadratic model).

        Returns:
          ``(losses, jvp)`` at ``func_args`` (parameters and batch).
        """
        func = self.tagged_func(func_args)
        return tracer.loss_tags_linearize(func, func_args, self.params_index)

    def update_cache(
        self, state: EstimatorState, identity_weight: Any, pmap_axis_name: str | None = None
    ) -> EstimatorState:
        """Refreshes every block's cached inverses / eigendecompositions.

        The refresh is split into units (`kfacx.estimator._refresh`): one per size bucket
        of the factors of all blocks that describe their refresh as damped
        inverses (`kfacx.blocks.CurvatureBlock.inverse_refresh`), inverted
        together as a padded stack (`kfacx.linalg.cholesky_inverse_padded`, with
        one shared fallback, `kfacx.linalg.repair_padded`), and one per other block.
        With ``pmap_axis_name`` (inside `jax.pmap` or `jax.shard_map`) the work
        is distributed: each unit of the refresh (a size bucket, or a block that
        refreshes itself) runs on one owner device, chosen by cost
        (`block_owners`), and a ``psum`` shares the results. The result is
        bit-identical to the serial refresh.

        ``identity_weight`` is one number or one per block (in `blocks` order),
        scaled per block with ``norm_to_scale_identity_weight_per_block``.

        Raises:
          ValueError: if ``identity_weight`` is concrete and not positive.
        """
        self._require_set_up()
        _identity_weights.check(identity_weight, "update_cache", allow_zero=False)
        weights = self._block_weights(state, identity_weight)
        return EstimatorState(_refresh.refresh(self._blocks, state.blocks, weights, pmap_axis_name))

    def _block_weights(self, state: EstimatorState, identity_weight: Any) -> Any:
        norm = self.norm_to_scale_identity_weight_per_block
        return _identity_weights.scaled(self._blocks, state.blocks, identity_weight, norm)

    def block_owners(self, num_devices: int) -> tuple[int, ...]:
        """The device (of ``num_devices``) that refreshes each block's cache in a
        distributed `update_cache`. The refresh is split into units (a bucket of
        equal-sized factors of several blocks, or one block; see
        `kfacx.estimator._refresh`) whose owners are balanced by cost (``K n^3`` per
        bucket of ``K`` ``n x n`` factors); a block spread over several units is
        shown with the owner of its most expensive one."""
        self._require_set_up()
        return _refresh.planned_block_owners(self._blocks, self._cache_spec, num_devices)

    # ---------------------------------------------------------------- products

    def multiply_matpower(
        self,
        state: EstimatorState,
        vector: Any,
        identity_weight: Any,
        power: float,
        exact_power: bool = False,
        use_cached: bool = False,
    ) -> Any:
        """``(C + identity_weight I)^power v`` for a parameter-shaped pytree ``v``.

        See `kfacx.blocks.CurvatureBlock.multiply_matpower` for the arguments;
        ``identity_weight`` is one number or one per block (as in `update_cache`).

        Raises:
          ValueError: for a bad vector, damping, or an unsupported / uncached power.
        """
        if power != 1:
            _identity_weights.check(identity_weight, "multiply_matpower", allow_zero=False)
        vectors = self.params_to_blocks(vector)
        weights = self._block_weights(state, identity_weight)
        weights = _identity_weights.per_block(weights, len(self._blocks))
        out = tuple(
            b.multiply_matpower(s, v, w, power, exact_power, use_cached)
            for b, s, v, w in zip(self._blocks, state.blocks, vectors, weights, strict=True)
        )
        return self.blocks_to_params(out, like=vector)

    def multiply(self, state: EstimatorState, vector: Any, identity_weight: Any = 0.0) -> Any:
        """``(C + identity_weight I) v`` from the current factors (no cache needed)."""
        return self.multiply_matpower(state, vector, identity_weight, 1)

    def multiply_inverse(
        self,
        state: EstimatorState,
        vector: Any,
        identity_weight: Any,
        exact_power: bool = False,
        use_cached: bool = False,
    ) -> Any:
        """``(C + identity_weight I)^-1 v``."""
        return self.multiply_matpower(state, vector, identity_weight, -1, exact_power, use_cached)

    def to_dense_matrix(self, state: EstimatorState) -> jax.Array:
        """The block-diagonal estimate over all parameters, flattened in pytree-leaf order."""
        traced = self._require_set_up()
        return _identity_weights.dense_block_diagonal(
            self._blocks, state.blocks, traced.layer_param_leaves, traced.num_param_leaves
        )
