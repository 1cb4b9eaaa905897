"""Configuration of `kfacx.Optimizer`: four frozen dataclasses grouping its options.

Every field is also accepted by `kfacx.Optimizer` as a flat keyword argument
under the same (kfac-jax) name; `FLAT_NAMES` maps each name to its group.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import numpy as np

from kfacx._helpers._checks import Schedule, as_schedule, check_ema, check_int, is_number
from kfacx.blocks import check_norm_type, curvature_block_ctors
from kfacx.blocks._base import check_precon_power
from kfacx.estimator import ESTIMATION_MODES, BlockDiagonalCurvature
from kfacx.optimizer._kfac_jax_names import KFAC_JAX_FIXED, KFAC_JAX_ONLY

# With the default curvature_batch_fraction=None, the curvature is estimated on
# 1/8 of each batch but on at least this many examples.
AUTO_CURVATURE_EXAMPLES = 128
# The default floor of the adapted damping (see DampingConfig).
MIN_DAMPING = 1e-4
# A step this many times as long as the previous update is checked at once (see
# DampingConfig.long_step_ratio).
LONG_STEP_RATIO = 2.0


@dataclasses.dataclass(frozen=True)
class CurvatureConfig:
    """How the curvature is estimated and inverted.

    Attributes:
      estimation_mode: one of `kfacx.ESTIMATION_MODES`.
      curvature_ema: weight of the old moving average of the factors.
      curvature_update_period: update the factors every this many steps.
      inverse_update_period: refresh the cached damped inverses every this many steps.
      use_exact_inverses: invert the damped Kronecker products exactly (from
        eigendecompositions) instead of with factored "pi" damping.
      num_estimator_samples: sampled cotangents per example in the sampling modes.
      num_burnin_steps: curvature-only updates before the first step.
      curvature_batch_fraction: estimate the curvature factors' statistics on
        this leading fraction of each (micro-)batch only; the loss, the gradient
        and the quadratic model's exact curvature products (adaptive learning
        rate, momentum and damping) always use all of it (its examples by
        ``batch_size_extractor``; see `BatchConfig` for batches whose arrays do
        not all run over them). The factors are moving averages over many
        steps, so a part of each batch estimates them well; the quadratic model
        is solved on one batch, and its products must see the examples its
        gradient sees (docs/numerics.md). With 1 the loss, gradient and
        statistics share one forward pass. The default (None) is 1/8 of the
        batch, as in Martens & Grosse (2015), but at least
        `AUTO_CURVATURE_EXAMPLES` (128) examples, i.e. all of a batch of up to
        128.
      layer_tag_to_block_ctor: block classes per tag name (see
        `kfacx.BlockDiagonalCurvature`).
      auto_register_kwargs: arguments of `kfacx.auto_register_tags`.
      auto_register_tags: find layers automatically (False: hand-tagged only).
      precon_power: the preconditioner is the damped curvature to this power,
        ``p = (C + (damping + l2_reg) I)^precon_power g`` (kfac-jax; default -1,
        the inverse; -0.5 the inverse square root). Without
        ``use_exact_inverses`` it is -1 or -0.5 (factored damping, the cached
        factors are the damped factors to this power); with it any negative power
        (from the cached eigendecompositions).
      norm_to_scale_identity_weight_per_block: None, or a norm of
        `kfacx.blocks.NORM_TYPES` (kfac-jax's names): the preconditioner's damping
        of every block is multiplied by that norm of the block's curvature
        estimate (`kfacx.blocks.block_norm`; a block whose norm is 0 keeps the
        plain damping). The quadratic model's damping is not scaled.
      curvature_block: the blocks of the dense and convolution layers for the
        whole model, a family of `kfacx.blocks.CURVATURE_BLOCKS` (``"kfac"``, or
        ``"kfac_reduce"`` for layers over shared positions: inputs averaged and
        cotangents summed over them, ``"tnt"``, or ``"ekfac"``, which serves the
        embedding layers too); ``layer_tag_to_block_ctor`` overrides it.
    """

    estimation_mode: str = "fisher_gradients"
    curvature_ema: float = 0.95
    curvature_update_period: int = 1
    inverse_update_period: int = 5
    use_exact_inverses: bool = False
    num_estimator_samples: int = 1
    num_burnin_steps: int = 10
    curvature_batch_fraction: float | None = None
    layer_tag_to_block_ctor: Mapping[str, Callable[..., Any]] | None = None
    auto_register_kwargs: Mapping[str, Any] | None = None
    auto_register_tags: bool = True
    precon_power: float = -1.0
    norm_to_scale_identity_weight_per_block: str | None = None
    curvature_block: str = "kfac"

    def __post_init__(self):
        check_precon_power(self.precon_power, self.use_exact_inverses)
        curvature_block_ctors(self.curvature_block)
        check_norm_type(
            self.norm_to_scale_identity_weight_per_block, "norm_to_scale_identity_weight_per_block"
        )
        if self.estimation_mode not in ESTIMATION_MODES:
            raise ValueError(
                f"estimation_mode={self.estimation_mode!r}; choose one of {ESTIMATION_MODES}."
            )
        check_ema(self.curvature_ema)
        for name in ("curvature_update_period", "inverse_update_period", "num_estimator_samples"):
            check_int(getattr(self, name), name, minimum=1)
        check_int(self.num_burnin_steps, "num_burnin_steps", minimum=0)
        fraction = self.curvature_batch_fraction
        if fraction is not None and not (
            isinstance(fraction, (int, float, np.integer, np.floating)) and 0.0 < fraction <= 1.0
        ):
            raise ValueError(
                f"curvature_batch_fraction must be None (automatic) or in (0, 1], got {fraction!r}."
            )


@dataclasses.dataclass(frozen=True)
class LearningRateConfig:
    """Learning rate and momentum: fixed, scheduled, or solved on the quadratic model.

    Attributes:
      use_adaptive_learning_rate: choose the learning rate each step by
        minimising the damped quadratic model of the loss.
      learning_rate_schedule: a number or ``global_step -> learning_rate``;
        None means it is passed to `Optimizer.step` (unless adaptive).
      use_adaptive_momentum: also choose the momentum on the quadratic model
        (needs the adaptive learning rate).
      momentum_schedule: a number or ``global_step -> momentum``; None means 0
        unless passed to `Optimizer.step` or adaptive.
      norm_constraint: if given, scale the preconditioned gradient ``p`` so that
        the step's squared length in the curvature metric,
        ``learning_rate**2 * p^T (C + damping I) p`` (``= learning_rate**2 *
        p^T g`` before scaling), is at most ``norm_constraint`` (as kfac-jax;
        not with an adaptive learning rate).
      momentum_bounds: ``(low, high)``: the adaptive momentum is the minimiser of
        the quadratic model over ``low <= momentum <= high`` (with the learning
        rate solved for the clipped momentum). The unconstrained solve
        (``None``, as kfac-jax) swings to values like -1.6 or 2.8 when the
        update and the velocity are nearly parallel, which makes training stall
        or turn back up late in a run.
    """

    use_adaptive_learning_rate: bool = False
    learning_rate_schedule: float | Schedule | None = None
    use_adaptive_momentum: bool = False
    momentum_schedule: float | Schedule | None = None
    norm_constraint: float | None = None
    momentum_bounds: tuple[float, float] | None = (0.0, 1.0)

    def __post_init__(self):
        as_schedule(self.learning_rate_schedule, "learning_rate_schedule")
        as_schedule(self.momentum_schedule, "momentum_schedule")
        if self.use_adaptive_momentum and not self.use_adaptive_learning_rate:
            raise ValueError(
                "use_adaptive_momentum=True needs use_adaptive_learning_rate=True (both are "
                "solved together on the quadratic model)."
            )
        if self.use_adaptive_learning_rate and self.learning_rate_schedule is not None:
            raise ValueError(
                "Pass either use_adaptive_learning_rate=True or a learning_rate_schedule, not both."
            )
        if self.use_adaptive_momentum and self.momentum_schedule is not None:
            raise ValueError(
                "Pass either use_adaptive_momentum=True or a momentum_schedule, not both."
            )
        if self.norm_constraint is not None:
            if self.use_adaptive_learning_rate:
                raise ValueError("norm_constraint cannot be used with an adaptive learning rate.")
            if not float(self.norm_constraint) > 0:
                raise ValueError(f"norm_constraint must be positive, got {self.norm_constraint}.")
        if self.momentum_bounds is not None:
            bounds = self.momentum_bounds
            if (
                not isinstance(bounds, (tuple, list))
                or len(bounds) != 2
                or not all(isinstance(b, (int, float, np.floating, np.integer)) for b in bounds)
                or not (math.isfinite(bounds[0]) and math.isfinite(bounds[1]))
                or not bounds[0] <= bounds[1]
            ):
                raise ValueError(
                    f"momentum_bounds must be None or a pair (low, high) of finite numbers with "
                    f"low <= high, e.g. (0.0, 1.0); got {bounds!r}."
                )


@dataclasses.dataclass(frozen=True)
class DampingConfig:
    """Damping: fixed, scheduled, or adapted by the Levenberg-Marquardt rule.

    Attributes:
      use_adaptive_damping: adapt the damping from the reduction ratio
        ``rho = (actual loss change) / (quadratic-model change)``.
      initial_damping: the starting (adaptive) or constant damping.
      damping_schedule: ``global_step -> damping`` (not with adaptive damping).
      min_damping, max_damping: bounds of the adapted damping. The floor
        (`MIN_DAMPING`, 1e-4; kfac-jax: 1e-8) keeps the Levenberg-Marquardt rule
        from driving the damping towards 0 when the quadratic model fits each
        batch well: on the MNIST autoencoder with shuffled batches the damping
        then fell below 1e-6 and the loss turned back up after 130 steps.
      damping_adaptation_interval: adapt every this many steps.
      damping_adaptation_decay: per-step factor; the damping is multiplied by
        ``decay**interval`` when ``rho > damping_upper_threshold`` and divided
        by it when ``rho < damping_lower_threshold``.
      include_damping_in_quad_change: whether the model change used for
        ``rho`` includes the damping term.
      damping_adaptation_interval_start: the step (0-based) the adaptation
        intervals start from: the damping is adapted at the steps ``t >= start``
        with ``(t + 1 - start) % damping_adaptation_interval == 0``, never before
        (default 0: at the steps ``interval - 1, 2 interval - 1, ...``).
      precon_damping_mult: the preconditioner's damping is this times the damping
        (kfac-jax); the quadratic model (adaptive learning rate and momentum,
        ``rho``) and the adaptation use the damping itself.
      precon_damping_schedule: ``global_step -> damping`` of the preconditioner
        (a number or a schedule; kfac-jax): replaces ``precon_damping_mult`` times
        the damping in the preconditioner; the quadratic model still uses the
        (adapted, scheduled or given) damping.
      use_step_rejection: reject a step that makes the loss on its batch (with
        the ``l2_reg`` term) go up, i.e. whose reduction ratio ``rho`` is
        negative when the quadratic model predicts a decrease (as kfac-jax): the
        parameters and the velocities (the momentum) stay as they were; the
        curvature estimate, the step counter, the data seen and the damping move
        on as after any step (on an adaptation step a rejected step counts as a
        ratio below ``damping_lower_threshold``: the damping grows). The loss is
        evaluated at the new parameters on every step (with adaptive damping it
        is anyway on adaptation steps), ``rho`` is reported on every step when
        there is a quadratic model (adaptive learning rate or damping), and the
        stats get ``rejected`` (True for a rejected step).
      long_step_ratio: with adaptive damping (and no ``use_step_rejection``), a
        step more than this many times as long as the previous update (the
        velocity) is checked at once, whatever the adaptation interval: the loss
        at the new parameters gives its ``rho``; if the loss on its batch (with
        the ``l2_reg`` term) rose, the step is rejected (the parameters and the
        velocities stay, as with ``use_step_rejection``) and the damping grows
        by the Levenberg-Marquardt rule, as it does when ``rho`` is below
        ``damping_lower_threshold``; it never falls on such a step. The length
        is read off the quadratic model's inner products, so the check costs
        nothing on the other steps; on the steps it flags (6% of the quick
        start's) it costs one evaluation of the loss, as an adaptation step
        does. A blow-up starts with a step many times longer than the one
        before it (docs/numerics.md). None turns the check off (kfac-jax has
        none).
      use_initial_damping_calibration: before the first step (after the
        burn-in) adapt the initial damping to its first batch: starting from
        ``initial_damping``, apply the Levenberg-Marquardt rule to the first
        step's reduction ratio (computed for that damping, the step not taken)
        until ``rho`` is between ``damping_lower_threshold`` and
        ``damping_upper_threshold``, or the damping reaches ``min_damping`` /
        ``max_damping``, or `CALIBRATION_STEPS` tries; if the ratio jumps over
        that interval, the damping on its upper side (the larger one) is kept.
        Needs ``use_adaptive_damping``.
    """

    use_adaptive_damping: bool = False
    initial_damping: float | None = None
    damping_schedule: float | Schedule | None = None
    min_damping: float = MIN_DAMPING
    max_damping: float = math.inf
    damping_adaptation_interval: int = 5
    damping_adaptation_decay: float = 0.9
    damping_lower_threshold: float = 0.25
    damping_upper_threshold: float = 0.75
    include_damping_in_quad_change: bool = False
    damping_adaptation_interval_start: int = 0
    precon_damping_mult: float = 1.0
    precon_damping_schedule: float | Schedule | None = None
    use_step_rejection: bool = False
    long_step_ratio: float | None = LONG_STEP_RATIO
    use_initial_damping_calibration: bool = False

    def __post_init__(self):
        as_schedule(self.damping_schedule, "damping_schedule")
        self._check_kfac_jax_extras()
        if self.use_adaptive_damping:
            if self.initial_damping is None:
                raise ValueError("use_adaptive_damping=True needs initial_damping.")
            if self.damping_schedule is not None:
                raise ValueError("Pass either use_adaptive_damping=True or a damping_schedule.")
        if self.initial_damping is not None and not float(self.initial_damping) > 0:
            raise ValueError(f"initial_damping must be positive, got {self.initial_damping}.")
        if not 0 <= self.min_damping <= self.max_damping:
            raise ValueError(
                f"Need 0 <= min_damping <= max_damping, got {self.min_damping}, {self.max_damping}."
            )
        check_int(self.damping_adaptation_interval, "damping_adaptation_interval", minimum=1)
        if not 0 < self.damping_adaptation_decay < 1:
            raise ValueError(
                f"damping_adaptation_decay must be in (0, 1), got {self.damping_adaptation_decay}."
            )
        if not self.damping_lower_threshold < self.damping_upper_threshold:
            raise ValueError("damping_lower_threshold must be below damping_upper_threshold.")

    def _check_kfac_jax_extras(self):
        check_int(self.damping_adaptation_interval_start, "damping_adaptation_interval_start", 0)
        as_schedule(self.precon_damping_schedule, "precon_damping_schedule")
        mult = self.precon_damping_mult
        if not (is_number(mult) and math.isfinite(mult) and mult > 0):
            raise ValueError(f"precon_damping_mult must be a positive number, got {mult!r}.")
        if self.precon_damping_schedule is not None and mult != 1.0:
            raise ValueError(
                "Pass either precon_damping_schedule or precon_damping_mult, not both: the "
                "schedule gives the preconditioner's damping itself."
            )
        if self.use_initial_damping_calibration and not self.use_adaptive_damping:
            raise ValueError(
                "use_initial_damping_calibration=True needs use_adaptive_damping=True (it "
                "calibrates the initial damping of the adaptation)."
            )
        ratio = self.long_step_ratio
        if ratio is not None and not (is_number(ratio) and math.isfinite(ratio) and ratio >= 1):
            raise ValueError(
                f"long_step_ratio must be None (no check) or a number >= 1, got {ratio!r}."
            )
        for name in ("use_step_rejection", "use_initial_damping_calibration"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}.")


@dataclasses.dataclass(frozen=True)
class BatchConfig:
    """How a batch is processed.

    Attributes:
      num_microbatches: split the batch's leading axis into this many
        micro-batches and accumulate loss, gradient and statistics over them
        with `jax.lax.scan` (bounded memory for large batches; with
        ``curvature_batch_fraction=1.0`` the result equals the full batch's,
        with a fraction each micro-batch's leading part estimates the curvature).
      example_mask_extractor: ``batch -> [batch_size]`` mask, 1 for real and 0
        for padding examples (binary); they then contribute nothing to the gradient weighting, the
        curvature or the quadratic model. The loss function must mask them too
        (``register_*_loss(..., mask=m)`` and a loss normalised by ``m.sum()``).
      batch_size_extractor: ``batch -> int``, the examples per batch, read from
        shapes (e.g. ``lambda b: b["targets"].shape[0]`` for a graph batch whose
        nodes outnumber its graphs): ``data_seen``, the weights of micro-batches,
        the default curvature subset's size; default: the leading dimension of
        the first leaf. Cutting a batch (``curvature_batch_fraction`` below 1,
        ``num_microbatches``) needs every array's leading dimension to be this
        size, else it is a `ValueError` naming the array.
      curvature_subset_extractor: ``(batch, m) -> batch`` of ``m`` of its examples
        (its first ``m`` graphs, with their nodes), the subset the curvature is
        estimated on when ``curvature_batch_fraction`` (or its default) is below
        1; default: the first ``m`` rows of every array. It must return ``m``
        examples by ``batch_size_extractor``.
      use_func_gradients: take the loss and the gradient from ``value_and_grad_func``
        itself, and the curvature statistics from a pass of their own (kfac-jax's way:
        one more forward pass per step). By default one pass over the tagged function
        gives all three, the gradient by differentiating its traced computation; that
        is not the function's gradient when a custom derivative rule computes the
        function differently, e.g. FermiNet's energy, whose rule's primal output is not
        the function's (`kfacx.kfac_jax.Optimizer` sets it).
    """

    num_microbatches: int = 1
    example_mask_extractor: Callable[[Any], jax.Array] | None = None
    batch_size_extractor: Callable[[Any], int] | None = None
    curvature_subset_extractor: Callable[[Any, int], Any] | None = None
    use_func_gradients: bool = False

    def __post_init__(self):
        check_int(self.num_microbatches, "num_microbatches", minimum=1)
        if not isinstance(self.use_func_gradients, bool):
            raise TypeError(f"use_func_gradients must be a bool, got {self.use_func_gradients!r}.")
        for name in (
            "example_mask_extractor",
            "batch_size_extractor",
            "curvature_subset_extractor",
        ):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise TypeError(f"{name} must be None or a function of the batch, got {value!r}.")


#: The most damping values `DampingConfig.use_initial_damping_calibration` tries.
CALIBRATION_STEPS = 30


CONFIGS = {
    "curvature": CurvatureConfig,
    "learning_rate": LearningRateConfig,
    "damping": DampingConfig,
    "batch": BatchConfig,
}
FLAT_NAMES = {f.name: group for group, cls in CONFIGS.items() for f in dataclasses.fields(cls)}


def resolve_configs(
    curvature: CurvatureConfig | None,
    learning_rate: LearningRateConfig | None,
    damping: DampingConfig | None,
    batch: BatchConfig | None,
    flat: Mapping[str, Any],
) -> tuple[CurvatureConfig, LearningRateConfig, DampingConfig, BatchConfig]:
    """The four configs of `kfacx.Optimizer`: the given ones (defaults for None) with
    the fields in ``flat`` (keyword arguments by their kfac-jax names) replaced.

    Raises:
      TypeError: for a config of the wrong class, a kfac-jax argument kfacx does not
        take (saying why) or an unknown argument (listing the known ones).
      ValueError: for a bad field value (from the configs' own checks).
    """
    configs = {
        "curvature": curvature or CurvatureConfig(),
        "learning_rate": learning_rate or LearningRateConfig(),
        "damping": damping or DampingConfig(),
        "batch": batch or BatchConfig(),
    }
    for group, value in configs.items():
        if not isinstance(value, CONFIGS[group]):
            raise TypeError(f"{group} must be a {CONFIGS[group].__name__}, got {value!r}.")
    for name, value in flat.items():
        if name in KFAC_JAX_ONLY:
            raise TypeError(
                f"Optimizer: kfac-jax's argument {name!r} is not taken by kfacx: "
                f"{KFAC_JAX_ONLY[name]}."
            )
        if name in KFAC_JAX_FIXED and value is not KFAC_JAX_FIXED[name][0]:
            fixed, why = KFAC_JAX_FIXED[name]
            raise ValueError(
                f"Optimizer: {name}={value!r} is not supported: {why} ({name}={fixed} "
                "is accepted for ports, or leave it out)."
            )
    flat = {k: v for k, v in flat.items() if k not in KFAC_JAX_FIXED}
    unknown = sorted(set(flat) - set(FLAT_NAMES))
    if unknown:
        raise TypeError(
            f"Optimizer got unknown arguments {unknown}. Known keyword options: "
            f"{sorted(FLAT_NAMES)}."
        )
    for group in CONFIGS:
        fields = {k: v for k, v in flat.items() if FLAT_NAMES[k] == group}
        if fields:
            configs[group] = dataclasses.replace(configs[group], **fields)
    return configs["curvature"], configs["learning_rate"], configs["damping"], configs["batch"]


def make_estimator(value_func: Callable[..., Any], cfg: CurvatureConfig) -> BlockDiagonalCurvature:
    """The curvature estimator of ``value_func`` for the options ``cfg``."""
    power = (cfg.precon_power,)
    return BlockDiagonalCurvature(
        value_func,
        params_index=0,
        layer_tag_to_block_ctor=cfg.layer_tag_to_block_ctor,
        default_estimation_mode=cfg.estimation_mode,
        num_samples=cfg.num_estimator_samples,
        exact_powers_to_cache=power if cfg.use_exact_inverses else (),
        approx_powers_to_cache=() if cfg.use_exact_inverses else power,
        auto_register_tags=cfg.auto_register_tags,
        auto_register_kwargs=cfg.auto_register_kwargs,
        norm_to_scale_identity_weight_per_block=cfg.norm_to_scale_identity_weight_per_block,
        curvature_block=cfg.curvature_block,
    )


class Schedules(NamedTuple):
    """The schedules of `kfacx.Optimizer`'s step (``step -> value``; None where the
    config gives none)."""

    learning_rate: Schedule | None
    momentum: Schedule | None
    damping: Schedule | None
    precon_damping: Schedule | None


def schedules(learning_rate: LearningRateConfig, damping: DampingConfig) -> Schedules:
    """The learning rate, momentum, damping and preconditioner damping schedules."""
    return Schedules(
        learning_rate=as_schedule(learning_rate.learning_rate_schedule, "learning_rate_schedule"),
        momentum=as_schedule(learning_rate.momentum_schedule, "momentum_schedule"),
        damping=as_schedule(damping.damping_schedule, "damping_schedule"),
        precon_damping=as_schedule(damping.precon_damping_schedule, "precon_damping_schedule"),
    )
