"""`kfacx.Optimizer`'s step as one pure function, composed of named pieces.

`KfacStep` is what `kfacx.Optimizer.unstaged_step` runs. In order, it:

1. evaluates the loss, the gradient and the curvature statistics over the batch
   (`kfacx.optimizer._loss_passes.BatchPasses`), averaged over the devices;
2. chooses the damping (`kfacx.optimizer._damping.choose_damping`);
3. runs `kfacx.transform.precondition`, shared with `kfacx.scale_by_kfac`: the
   curvature update, the refresh and ``p = (C + (damping + l2_reg) I)^-1 g``;
4. chooses the learning rate and momentum (`kfacx.optimizer._quadratic_model`);
5. adapts the damping (`kfacx.optimizer._damping.adapt_damping`, Levenberg-Marquardt);
6. keeps the parameters and the state, bit for bit, if anything came out
   non-finite (`kfacx.optimizer._outcome.guard`), and returns the step's stats
   (`kfacx.optimizer._outcome.step_stats`).

The pieces emit the step's operations in the order it has always had them
(``benchmarks/step_fingerprint.py``)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from kfacx._helpers import _checks, _tree
from kfacx.estimator import weighted_mean_stats
from kfacx.optimizer import _damping, _outcome, _quadratic_model
from kfacx.optimizer._configs import CurvatureConfig, DampingConfig, LearningRateConfig, Schedules
from kfacx.optimizer._l2 import Regularization
from kfacx.optimizer._loss_passes import BatchPasses
from kfacx.parallel._distributed import placed_refresh
from kfacx.parallel._placement import Placement
from kfacx.transform import precondition


class _Update(NamedTuple):
    """A step's proposed update, before the damping adaptation and the guard."""

    precon: Any  # the preconditioned gradient (norm-constrained with a fixed learning rate)
    estimator_state: Any  # the curvature estimate after this step's update and refresh
    coeffs: Any  # (learning rate, momentum) coefficients of precon and the velocity
    learning_rate: Any
    momentum: Any
    model: Any  # the quadratic model (`kfacx.optimizer._quadratic_model`)
    delta: Any  # the step
    new_params: Any  # params + delta


@dataclasses.dataclass(frozen=True, eq=False)
class KfacStep:
    """The options and parts the step is made of (built by `kfacx.Optimizer`).

    Attributes:
      curvature, learning_rate, damping: the optimizer's configs.
      regularization: ``l2_reg`` and the parameters it leaves out (`kfacx.optimizer._l2`).
      schedules: the learning rate, momentum, damping and preconditioner damping
        schedules (`kfacx.optimizer._configs.Schedules`).

      passes: the passes over the batch (they hold the estimator).
      placement: where the step runs (its device axis, the inverses' refresh).
      init: ``(params, rng, batch, func_state) -> state``, for checking the state.
      sharded: the plan of the sharded curvature state (`kfacx.estimator._sharded_curvature`),
        or None (the state is replicated).
    """

    curvature: CurvatureConfig
    learning_rate: LearningRateConfig
    damping: DampingConfig
    regularization: Regularization
    schedules: Schedules
    passes: BatchPasses
    placement: Placement
    init: Callable[..., Any]
    sharded: Any = None

    @property
    def l2_reg(self) -> float:
        """The weight decay."""
        return self.regularization.l2_reg

    def __call__(
        self,
        params,
        state,
        rng,
        batch,
        func_state=None,
        learning_rate=None,
        momentum=None,
        damping=None,
        global_step_int=None,
    ):
        """One step; see `kfacx.Optimizer.unstaged_step`."""
        return self._run(
            params, state, rng, batch, func_state, learning_rate, momentum, damping, global_step_int
        )

    def calibration_ratio(
        self,
        params,
        state,
        rng,
        batch,
        func_state=None,
        damping_value=None,
        learning_rate=None,
        momentum=None,
        global_step_int=None,
    ):
        """The reduction ratio of the step with the damping ``damping_value`` (the step
        itself is not taken; for ``use_initial_damping_calibration``)."""
        state = state._replace(damping=jnp.asarray(damping_value, jnp.float32))
        out = self._run(
            params,
            state,
            rng,
            batch,
            func_state,
            learning_rate,
            momentum,
            None,
            global_step_int,
            True,
        )
        return out[-1]["rho"]

    def _run(
        self,
        params,
        state,
        rng,
        batch,
        func_state,
        learning_rate,
        momentum,
        damping,
        global_step_int,
        force_adapt=False,
    ):
        self._check_inputs(params, state, rng, batch, func_state)
        step = state.step_counter
        global_step = step if global_step_int is None else global_step_int
        update_curvature = step % self.curvature.curvature_update_period == 0
        mask = self.regularization.leaf_mask(params)
        loss, grads, stats, new_func_state, aux = self._value_grads_stats(
            params, func_state, rng, batch, update_curvature, mask, state.estimator_state
        )
        lam, precon_lam = self._dampings(state, damping, global_step)
        update = self._update(
            params, state, rng, batch, func_state, grads, stats, lam, precon_lam, mask,
            learning_rate, momentum, global_step, update_curvature,
        )  # fmt: skip
        loss_at_new_params = functools.partial(
            self.passes.loss_at, update.new_params, func_state, rng, batch
        )
        quad_change, new_damping, rho, rejected = self._adapt_damping(
            state, update.model, update.coeffs, lam, loss, params, update.new_params,
            loss_at_new_params, mask, force_adapt,
        )  # fmt: skip
        new_params, velocities = update.new_params, update.delta
        one_device = self.placement.kind == "single"  # see _tree.keep_unless's select_small
        if rejected is not None:
            new_params, velocities = _tree.keep_unless(
                ~rejected, (new_params, velocities), (params, state.velocities), one_device
            )
        new_state = state._replace(
            velocities=velocities,
            estimator_state=update.estimator_state,
            damping=jnp.asarray(new_damping, jnp.float32),
            data_seen=state.data_seen + self.passes.examples_seen(batch, self.placement.axis_name),
            step_counter=step + 1,
        )
        sq_norms = update.model.step_sq_norms(update.delta)
        finite, (new_params, new_state, new_func_state) = _outcome.guard(
            loss,
            sq_norms,
            lam if precon_lam is lam else (lam, precon_lam),
            stats.blocks if self.sharded is None else stats.check,
            new=(new_params, new_state, new_func_state),
            old=(params, state, func_state),
            select_small=one_device,
        )
        stats_out = _outcome.step_stats(
            loss, update.learning_rate, update.momentum, lam, rho, quad_change, sq_norms, step,
            new_state, finite,
        )  # fmt: skip
        if rejected is not None:
            stats_out["rejected"] = rejected & finite
        if self.passes.call.has_aux:
            stats_out["aux"] = aux
        if self.passes.call.has_state:
            return new_params, new_state, new_func_state, stats_out
        return new_params, new_state, stats_out

    def burnin_step(self, params, state, rng, batch, func_state):
        """One burn-in step (`kfacx.Optimizer.burnin`): the curvature update alone;
        returns ``(state, func_state)``."""
        _, _, stats, new_func_state, _ = self.passes.value_grads_stats(
            params, func_state, rng, batch, True, state.estimator_state
        )
        axis = self.placement.axis_name
        ema = self.curvature.curvature_ema
        if self.sharded is not None:
            stats = self.sharded.reduce_stats(stats, axis)
            est_state = self.sharded.fold(
                state.estimator_state, stats, ema, 1.0 - ema, bound=axis is not None
            )
        else:
            est_state = self.passes.estimator.update_curvature_estimate_from_stats(
                state.estimator_state, stats, ema, 1.0 - ema, axis
            )
        if new_func_state is not None and axis is not None:
            new_func_state = jax.lax.pmean(new_func_state, axis)
        return state._replace(estimator_state=est_state), new_func_state

    def _dampings(self, state, damping, global_step):
        """``(damping, preconditioner damping)`` of this step (the same object when the
        preconditioner has no damping of its own)."""
        lam = _damping.choose_damping(
            self.damping, state.damping, damping, self.schedules.damping, global_step
        )
        precon_lam = _damping.precon_damping(
            self.damping, lam, self.schedules.precon_damping, global_step
        )
        return lam, precon_lam

    def _update(
        self, params, state, rng, batch, func_state, grads, stats, lam, precon_lam, mask,
        learning_rate, momentum, global_step, update_curvature,
    ):  # fmt: skip
        """The proposed update (`_Update`): the curvature update and preconditioning, the
        learning rate and momentum, the step ``delta`` and ``params + delta``."""
        identity_weight = lam + self.l2_reg
        precon, est_state = self._precondition(
            state,
            grads,
            stats,
            self._precon_weight(identity_weight, precon_lam, lam, params, mask),
            update_curvature,
        )
        coeffs, lr, mom, model, precon = self._coefficients(
            grads,
            precon,
            state.velocities,
            identity_weight if mask is None else lam,
            self._gram_of(params, func_state, rng, batch),
            learning_rate,
            momentum,
            global_step,
            mask,
        )
        delta = _quadratic_model.update_direction(coeffs, precon, state.velocities)
        new_params = jax.tree.map(lambda p, d: p + d, params, delta)
        return _Update(precon, est_state, coeffs, lr, mom, model, delta, new_params)

    def _precon_weight(self, identity_weight, precon_lam, lam, params, mask):
        """The preconditioner's identity weight: its damping plus ``l2_reg``, without
        ``l2_reg`` for the blocks none of whose parameters is regularized."""
        if mask is None:
            return identity_weight if precon_lam is lam else precon_lam + self.l2_reg
        flags = self.regularization.block_flags(self.passes.estimator, params, mask)
        with_l2 = precon_lam + self.l2_reg
        if all(flags):
            return with_l2
        return tuple(with_l2 if f else precon_lam for f in flags)

    def _gram_of(self, params, func_state, rng, batch):
        """``vectors -> [k, k]`` exact curvature products, averaged over the devices."""

        def gram_of(vectors):
            gram = self.passes.curvature_gram(params, func_state, rng, batch, vectors)
            return gram if self.placement.axis_name is None else self._pmean(gram)

        return gram_of

    def _check_inputs(self, params, state, rng, batch, func_state) -> None:
        """At trace time only: an empty batch, or a state made for another model."""
        _checks.check_batch(batch)
        expected = jax.eval_shape(self.init, params, rng, batch, func_state)
        blocks = self.passes.estimator.blocks
        if self.sharded is not None and self.placement.kind == "shard_map":
            expected = self.sharded.local_shapes(expected)
        _checks.check_state(state, expected, [repr(b) for b in blocks])

    def _pmean(self, tree):
        return jax.lax.pmean(tree, self.placement.axis_name)

    def _value_grads_stats(
        self, params, func_state, rng, batch, update_curvature, mask, estimator_state
    ):
        """Loss, gradient (with ``l2_reg`` on the parameters ``mask`` selects),
        curvature statistics, the function's new state and aux, averaged over the
        devices (statistics only when ``update_curvature``, every
        ``curvature_update_period`` steps; ``estimator_state`` for the blocks whose
        statistics need it)."""
        passes, axis, sharded = self.passes, self.placement.axis_name, self.sharded
        args = (params, func_state, rng, batch)

        def reduce(stats):
            if axis is None:
                return stats if sharded is None else sharded.reduce_stats(stats, None)
            if sharded is None:
                return weighted_mean_stats(stats, axis)
            return sharded.reduce_stats(stats, axis)

        def run(with_stats):
            loss, grads, stats, new_func_state, aux = passes.value_grads_stats(
                *args, with_stats, estimator_state
            )
            if with_stats:
                stats = reduce(stats)
            else:  # Zero statistics, reduced by nothing: no collective on these steps.
                stats = jax.tree.map(
                    lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(reduce, stats)
                )
            return loss, grads, stats, new_func_state, aux

        if self.curvature.curvature_update_period == 1:
            out = run(True)
        else:
            out = jax.lax.cond(update_curvature, lambda: run(True), lambda: run(False))
        loss, grads, stats, new_func_state, aux = out
        if axis is not None and sharded is not None:  # To the owners (a reduce-scatter).
            grads = self.regularization.add_to_gradient(grads, params, mask)
            loss, grads = self._pmean(loss), sharded.scatter_grads(grads, axis)
        else:
            if axis is not None:
                loss, grads = self._pmean((loss, grads))
            grads = self.regularization.add_to_gradient(grads, params, mask)
        if axis is not None and new_func_state is not None:
            new_func_state = self._pmean(new_func_state)
        return loss, grads, stats, new_func_state, aux

    def _precondition(self, state, grads, stats, identity_weight, update_curvature):
        """The curvature update and ``(C + identity_weight I)^-1 grads``: the core shared
        with `kfacx.scale_by_kfac`, its refresh placed by
        `kfacx.parallel._distributed.placed_refresh`."""
        cfg, est = self.curvature, self.passes.estimator
        options = dict(
            curvature_ema=cfg.curvature_ema,
            inverse_update_period=cfg.inverse_update_period,
            use_exact_inverses=cfg.use_exact_inverses,
            update_curvature=True if cfg.curvature_update_period == 1 else update_curvature,
            power=cfg.precon_power,
        )
        args = (state.step_counter, grads, stats, identity_weight)
        if self.sharded is not None:
            bound = self.placement.axis_name is not None
            return self.sharded.precondition(state.estimator_state, *args, **options, bound=bound)
        refresh = lambda e, w: placed_refresh(self.placement, est.update_cache, e, w)  # noqa: E731
        return precondition(est, state.estimator_state, *args, **options, refresh=refresh)

    def _coefficients(
        self, grads, precon, velocity, identity_weight, gram_of, learning_rate, momentum, step, mask
    ):
        """``(coefficients, learning_rate, momentum, quadratic model, precon)`` of the
        update ``coefficients[0] * precon + coefficients[1] * velocity``: solved on the
        quadratic model, or given (``precon`` then scaled by the norm constraint). With
        ``mask`` (some parameters not regularized) ``identity_weight`` is the damping
        alone and the model's regularizer is ``l2_reg`` on the regularized leaves."""
        lr_cfg, qm = self.learning_rate, _quadratic_model
        lr_schedule, momentum_schedule = self.schedules.learning_rate, self.schedules.momentum

        def regularizer(p):
            return None if mask is None else self.regularization.masked_norms(p, velocity, mask)

        if lr_cfg.use_adaptive_learning_rate:
            fixed_momentum = None
            if not lr_cfg.use_adaptive_momentum:
                fixed_momentum = lambda: qm.momentum_value(momentum, momentum_schedule, step)  # noqa: E731
            coeffs, model = qm.adaptive_coefficients(
                gram_of([precon, velocity]),
                grads,
                precon,
                velocity,
                identity_weight,
                fixed_momentum,
                lr_cfg.momentum_bounds,
                regularizer(precon),
            )
            return coeffs, -coeffs[0], coeffs[1], model, precon
        lr = qm.learning_rate_value(learning_rate, lr_schedule, step)
        mom = jnp.asarray(qm.momentum_value(momentum, momentum_schedule, step), jnp.float32)
        if lr_cfg.norm_constraint is not None:
            precon = qm.constrain_norm(precon, grads, lr, lr_cfg.norm_constraint)
        gram = None
        if self.damping.use_adaptive_damping:
            gram = gram_of([precon, velocity])
        reg = None if gram is None else regularizer(precon)
        coeffs, model = qm.fixed_coefficients(lr, mom, gram, grads, precon, velocity, reg)
        return coeffs, lr, mom, model, precon

    def _adapt_damping(
        self, state, model, coeffs, lam, loss, params, new_params, loss_at, mask, force
    ):
        """``(quadratic model change, new damping, reduction ratio rho, rejected)``: NaN
        for what is not computed (no quadratic model: neither adaptive learning rate nor
        damping; no ratio: not adaptive, or not an adaptation step, unless the steps are
        checked for rejection); ``rejected`` None unless ``use_step_rejection``."""
        damp_cfg = self.damping
        quad_change = jnp.nan
        if model.gram is not None:
            quad_weight = 0.0 if mask is not None else self.l2_reg
            quad_weight = quad_weight + (lam if damp_cfg.include_damping_in_quad_change else 0.0)
            quad_change = _quadratic_model.quadratic_model_change(model, coeffs, quad_weight)
        if damp_cfg.use_step_rejection:
            return self._check_step(state, quad_change, loss, params, new_params, loss_at, mask)
        if model.gram is None:
            return jnp.nan, state.damping, jnp.nan, None
        if not damp_cfg.use_adaptive_damping:
            return quad_change, state.damping, jnp.nan, None
        long_step = None if force else _long_step(damp_cfg.long_step_ratio, model, coeffs)
        if long_step is not None:
            return self._check_long_step(
                state, quad_change, long_step, loss, params, new_params, loss_at, mask
            )

        def reduction_ratio():
            return self._actual_change(loss_at, loss, params, new_params, mask) / quad_change

        new_damping, rho = _damping.adapt_damping(
            damp_cfg, state.damping, state.step_counter, reduction_ratio, force
        )
        return quad_change, new_damping, rho, None

    def _check_long_step(
        self, state, quad_change, long_step, loss, params, new_params, loss_at, mask
    ):
        """`_adapt_damping` with ``long_step_ratio``: the loss at the new parameters is
        evaluated on the adaptation steps and on the long steps (one `jax.lax.cond`). On
        an adaptation step the damping follows the Levenberg-Marquardt rule; on a long
        step it may only grow, and a long step that raised the objective is rejected
        (and counts as a ratio below ``damping_lower_threshold``: the damping grows)."""
        cfg, damping = self.damping, state.damping
        adapt = _damping.is_adaptation_step(cfg, state.step_counter)

        def measured(_):
            change = self._actual_change(loss_at, loss, params, new_params, mask)
            rho = jnp.asarray(change / quad_change, jnp.float32)
            rejected = long_step & ~(change <= 0)
            # A rejected step counts as a ratio below the lower threshold (as with
            # use_step_rejection): with a given learning rate the model may predict the
            # rise itself, and a positive ratio would then lower the damping.
            ratio = jnp.where(rejected, cfg.damping_lower_threshold - 1.0, rho)
            adapted = _damping.levenberg_marquardt(cfg, damping, ratio)
            new_damping = jnp.where(adapt, adapted, jnp.maximum(adapted, damping))
            return new_damping.astype(damping.dtype), rho, rejected

        def skipped(_):
            return damping, jnp.asarray(jnp.nan, jnp.float32), jnp.zeros((), bool)

        new_damping, rho, rejected = jax.lax.cond(adapt | long_step, measured, skipped, None)
        return quad_change, new_damping, rho, rejected

    def _check_step(self, state, quad_change, loss, params, new_params, loss_at, mask):
        """`_adapt_damping` with ``use_step_rejection``: the actual change of the objective
        on every step; the step is rejected unless it is <= 0 (``rho < 0`` when the model
        predicts a decrease), and a rejected step counts as a ratio below
        ``damping_lower_threshold`` in the adaptation (the damping grows)."""
        change = self._actual_change(loss_at, loss, params, new_params, mask)
        rho = change / quad_change
        rejected = ~(change <= 0)
        new_damping = state.damping
        if self.damping.use_adaptive_damping:
            below = self.damping.damping_lower_threshold - 1.0
            ratio = jnp.where(rejected, below, rho)
            new_damping, _ = _damping.adapt_damping(
                self.damping, state.damping, state.step_counter, lambda: ratio
            )
        return quad_change, new_damping, rho, rejected

    def _actual_change(self, loss_at, loss, params, new_params, mask):
        """The change of the loss plus ``0.5 l2_reg |theta_R|^2`` over the step (on the
        step's batch, averaged over the devices)."""
        new_loss = loss_at()
        if self.placement.axis_name is not None:
            new_loss = self._pmean(new_loss)
        reg = self.regularization.penalty_change(new_params, params, mask)
        return new_loss - loss + reg


def _long_step(ratio, model, coeffs):
    """Whether the step ``coeffs[0] p + coeffs[1] v`` is more than ``ratio`` times as
    long as the previous update ``v`` (a traced bool; False on the first step, with no
    velocity yet), from the quadratic model's inner products ``[[p.p, p.v], [p.v,
    v.v]]``, which every device has alike; None when ``ratio`` is None."""
    if ratio is None:
        return None
    norms = model.norms
    step_sq = coeffs @ norms @ coeffs
    previous_sq = norms[1, 1]
    return (previous_sq > 0) & (step_sq > ratio**2 * previous_sq)
