"""kfac-jax's `OptaxPreconditioner`: the curvature estimator driven step by step from an
optax training loop, on kfacx's estimator (`kfacx.kfac_jax.BlockDiagonalCurvature`).

kfacx's own optax transformation, `kfacx.scale_by_kfac`, does all of this in one
transformation; this class serves code written against kfac-jax's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from kfacx.kfac_jax.utils import default_batch_size_extractor, in_pmap


class OptaxPreconditionState(NamedTuple):
    """The step count and the estimator's state."""

    count: jax.Array
    estimator_state: Any


class OptaxPreconditioner:
    """An optax-compatible K-FAC preconditioner (kfac-jax's class and arguments).

    ``pmap_axis_name`` is used when the methods run inside a `jax.pmap` binding it, and
    ignored otherwise. ``distributed_inverses``, ``distributed_precon_apply`` and
    ``should_vmap_samples`` are taken for kfac-jax's signature (kfacx distributes its
    refresh inside a pmap by itself).
    """

    def __init__(
        self,
        value_func: Callable[..., Any],
        l2_reg: Any = 0.0,
        damping: float | None = None,
        damping_schedule: Callable[[Any], Any] | None = None,
        norm_constraint: Any = None,
        estimation_mode: str = "fisher_gradients",
        curvature_ema: Any = 0.95,
        curvature_update_period: int = 1,
        inverse_update_period: int = 5,
        use_exact_inverses: bool = False,
        use_sqrt_inv: bool = False,
        register_only_generic: bool = False,
        patterns_to_skip: Sequence[str] = (),
        auto_register_kwargs: dict[str, Any] | None = None,
        layer_tag_to_block_ctor: dict[str, Any] | None = None,
        pmap_axis_name: str = "kfac_axis",
        batch_size_extractor: Callable[[Any], Any] = default_batch_size_extractor,
        distributed_inverses: bool = True,
        distributed_precon_apply: bool = True,
        num_samples: int = 1,
        should_vmap_samples: bool = False,
        norm_to_scale_identity_weight_per_block: str | None = None,
    ):
        from kfacx.kfac_jax._block_diagonal import BlockDiagonalCurvature

        del distributed_inverses, distributed_precon_apply, should_vmap_samples
        if curvature_update_period != 1:
            raise ValueError(
                f"curvature_update_period={curvature_update_period}: only 1 is served (as in "
                "kfac-jax); kfacx.Optimizer's curvature_update_period updates less often."
            )
        if (damping is None) == (damping_schedule is None):
            raise ValueError(
                "OptaxPreconditioner: give exactly one of damping and damping_schedule."
            )
        self._l2_reg = l2_reg
        self._damping = damping
        self._damping_schedule = damping_schedule
        self._norm_constraint = norm_constraint
        self._curvature_ema = curvature_ema
        self._inverse_update_period = inverse_update_period
        self._pmap_axis_name = pmap_axis_name
        self._batch_size_extractor = batch_size_extractor
        self._use_cached_inverses = inverse_update_period != 1
        self._use_exact_inverses = use_exact_inverses
        self._use_sqrt_inv = use_sqrt_inv
        self._norm = norm_to_scale_identity_weight_per_block
        kwargs = dict(auto_register_kwargs or {})
        kwargs.update(
            register_only_generic=register_only_generic, patterns_to_skip=patterns_to_skip
        )
        self._estimator = BlockDiagonalCurvature(
            value_func,
            default_estimation_mode=estimation_mode,
            params_index=0,
            layer_tag_to_block_ctor=layer_tag_to_block_ctor,
            num_samples=num_samples,
            **kwargs,
        )

    # ------------------------------------------------------------------ properties

    @property
    def estimator(self) -> Any:
        """The curvature estimator (`kfacx.kfac_jax.BlockDiagonalCurvature`)."""
        return self._estimator

    @property
    def pmap_axis_name(self) -> str:
        return self._pmap_axis_name

    def _axis(self) -> str | None:
        return self._pmap_axis_name if in_pmap(self._pmap_axis_name) else None

    @property
    def _exact_powers_to_cache(self) -> int | None:
        return -1 if self._use_exact_inverses and self._use_cached_inverses else None

    @property
    def _approx_powers_to_cache(self) -> int | None:
        return -1 if not self._use_exact_inverses and self._use_cached_inverses else None

    def get_identity_weight(self, state: OptaxPreconditionState) -> Any:
        """The damping (or the schedule's value at ``state.count``) plus ``l2_reg``."""
        damping = self._damping
        if damping is None:
            damping = self._damping_schedule(state.count)
        return damping + self._l2_reg

    # ------------------------------------------------------------------ state

    def init(self, func_args: Sequence[Any], rng: Any) -> OptaxPreconditionState:
        return OptaxPreconditionState(
            count=jnp.array(0, dtype=jnp.int32),
            estimator_state=self.estimator.init(
                rng=rng,
                func_args=func_args,
                exact_powers_to_cache=self._exact_powers_to_cache,
                approx_powers_to_cache=self._approx_powers_to_cache,
                cache_eigenvalues=False,
            ),
        )

    def sync_estimator_state(self, state: OptaxPreconditionState) -> OptaxPreconditionState:
        return state._replace(
            estimator_state=self.estimator.sync(state.estimator_state, self._axis())
        )

    def should_update_estimator_curvature(self, state: OptaxPreconditionState) -> Any:
        del state
        return True

    def should_sync_estimate_curvature(self, state: OptaxPreconditionState) -> Any:
        if not self._use_cached_inverses:
            return True
        return self.should_update_inverse_cache(state)

    def should_update_inverse_cache(self, state: OptaxPreconditionState) -> Any:
        if not self._use_cached_inverses:
            return False
        return state.count % self._inverse_update_period == 0

    def maybe_update(
        self, state: OptaxPreconditionState, func_args: Sequence[Any], rng: Any
    ) -> OptaxPreconditionState:
        """The curvature update, then the inverse refresh when it is due."""
        state = self.maybe_update_estimator_curvature(
            state, func_args, rng, sync=self.should_sync_estimate_curvature(state)
        )
        return self.maybe_update_inverse_cache(state)

    def maybe_update_estimator_curvature(
        self,
        state: OptaxPreconditionState,
        func_args: Sequence[Any],
        rng: Any,
        decay_old_ema: Any = True,
        sync: Any = True,
    ) -> OptaxPreconditionState:
        """Folds this batch's statistics into the moving averages (``decay_old_ema=False``
        adds them without decaying the old ones). kfacx averages the statistics over the
        devices as it folds them, so ``sync`` has nothing left to do."""
        del sync
        ema_old = decay_old_ema * self._curvature_ema + (1.0 - decay_old_ema) * 1.0
        estimator_state = self.estimator.update_curvature_matrix_estimate(
            state=state.estimator_state,
            ema_old=ema_old,
            ema_new=1.0,
            identity_weight=self.get_identity_weight(state),
            batch_size=self._batch_size_extractor(func_args[-1]),
            rng=rng,
            func_args=func_args,
            pmap_axis_name=self._axis(),
        )
        return state._replace(estimator_state=estimator_state)

    def maybe_update_inverse_cache(self, state: OptaxPreconditionState) -> OptaxPreconditionState:
        """Refreshes the cached inverses when ``count`` is a multiple of
        ``inverse_update_period``."""
        if not self._use_cached_inverses:
            return state

        def refresh(estimator_state):
            return self.estimator.update_cache(
                estimator_state,
                identity_weight=self.get_identity_weight(state),
                exact_powers=self._exact_powers_to_cache,
                approx_powers=self._approx_powers_to_cache,
                pmap_axis_name=self._axis(),
                norm_to_scale_identity_weight_per_block=self._norm,
            )

        estimator_state = jax.lax.cond(
            self.should_update_inverse_cache(state), refresh, lambda s: s, state.estimator_state
        )
        return state._replace(estimator_state=estimator_state)

    def increment_count(self, state: OptaxPreconditionState) -> OptaxPreconditionState:
        return state._replace(count=optax.safe_int32_increment(state.count))

    # ------------------------------------------------------------------ products

    def apply(self, updates: Any, state: OptaxPreconditionState) -> Any:
        """``(C + damping I)^-1 updates`` (``^-1/2`` with ``use_sqrt_inv``), rescaled to
        ``norm_constraint`` when given."""
        new_updates = self.estimator.multiply_matpower(
            state.estimator_state,
            updates,
            self.get_identity_weight(state),
            -0.5 if self._use_sqrt_inv else -1,
            self._use_exact_inverses,
            self._use_cached_inverses,
        )
        if self._norm_constraint is None:
            return new_updates
        sq_norm = sum(
            jnp.vdot(a, b)
            for a, b in zip(
                jax.tree_util.tree_leaves(new_updates),
                jax.tree_util.tree_leaves(updates),
                strict=True,
            )
        )
        coeff = jnp.minimum(jnp.sqrt(self._norm_constraint / sq_norm), 1.0)
        return jax.tree_util.tree_map(lambda x: coeff * x, new_updates)

    def multiply_curvature(self, updates: Any, state: OptaxPreconditionState) -> Any:
        """``(C + damping I) updates``."""
        return self.estimator.multiply(
            state.estimator_state,
            updates,
            self.get_identity_weight(state),
            self._use_exact_inverses,
            self._use_cached_inverses,
        )

    def as_gradient_transform(
        self, use_inverse: bool = True
    ) -> optax.GradientTransformationExtraArgs:
        """An optax transformation applying `apply` (or `multiply_curvature`) with the
        ``precond_state`` extra argument."""
        multiply = self.apply if use_inverse else self.multiply_curvature

        def init_fn(params):
            del params
            return optax.EmptyState()

        def update_fn(updates, state, params=None, *, precond_state, **extra_args):
            del params, extra_args
            return multiply(updates, precond_state), state

        return optax.GradientTransformationExtraArgs(init_fn, update_fn)
