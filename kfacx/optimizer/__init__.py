"""The K-FAC optimizer: curvature, damping, learning rate and momentum in one step.

`Optimizer` takes ``jax.value_and_grad(loss_fn)`` (as kfac-jax does), finds
the layers of ``loss_fn``, and each `Optimizer.step`:

1. computes the loss, the gradient and the curvature statistics in one
   forward pass (accumulated over micro-batches with `jax.lax.scan` if asked);
2. folds the statistics into the curvature blocks' moving averages and, every
   ``inverse_update_period`` steps, refreshes their damped inverses;
3. preconditions the gradient, ``p = (C + (damping + l2_reg) I)^-1 g``, and
   takes the step ``delta = -learning_rate * p + momentum * previous_delta``
   with the learning rate and momentum fixed, scheduled, or chosen to
   minimise the exact quadratic model of the loss along ``p`` and
   ``previous_delta``;
4. every ``damping_adaptation_interval`` steps adapts the damping with the
   Levenberg-Marquardt rule from the ratio of the actual to the predicted
   change of the loss (and, with ``use_step_rejection``, keeps the parameters
   when the loss went up).

Options are grouped in frozen config dataclasses (`CurvatureConfig`,
`LearningRateConfig`, `DampingConfig`, `BatchConfig`); each field can also be
passed as a flat keyword argument with kfac-jax's name.

Its wing: ``_configs`` (the config dataclasses, kfac-jax's flat options),
``_step`` (one step as a pipeline) and ``_outcome`` (its non-finite guard and the
stats it returns), ``_loss_passes`` and ``_batch_layout`` (the
passes over a batch and its micro-batches), ``_quadratic_model`` (the learning rate
and momentum it solves for), ``_damping`` and ``_calibration``, ``_first_step`` (the
burn-in and the calibration before the first step), ``_l2``, ``_keys``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kfacx._helpers import _checks
from kfacx.blocks._base import zeros
from kfacx.estimator import EstimatorState
from kfacx.estimator._sharded_curvature import sharded_curvature
from kfacx.optimizer._configs import (
    BatchConfig,
    CurvatureConfig,
    DampingConfig,
    LearningRateConfig,
    make_estimator,
    resolve_configs,
    schedules,
)
from kfacx.optimizer._first_step import FirstStep
from kfacx.optimizer._l2 import Regularization
from kfacx.optimizer._loss_passes import BatchPasses, LossCall
from kfacx.optimizer._step import KfacStep
from kfacx.parallel._placement import Placement

# ----------------------------------------------------------------------------- state


class OptimizerState(NamedTuple):
    """State of `Optimizer`.

    Attributes:
      velocities: the previous update ``delta`` (the momentum direction).
      estimator_state: the curvature blocks' state.
      damping: the current damping.
      data_seen: examples processed so far.
      step_counter: steps taken so far (skipped non-finite steps not counted).
    """

    velocities: Any
    estimator_state: EstimatorState
    damping: jax.Array
    data_seen: jax.Array
    step_counter: jax.Array


class Optimizer:
    """The K-FAC optimizer (kfac-jax compatible arguments).

    Args:
      value_and_grad_func: ``jax.value_and_grad(loss_fn, has_aux=...)``. The
        optimizer evaluates ``loss_fn`` itself (one pass for the loss, the
        gradient and the curvature statistics), so this is only used to get
        at ``loss_fn``: its value output must not depend on anything the
        gradient computation does.
      l2_reg: as in kfac-jax, the coefficient of the regularizer
        ``0.5 * l2_reg * |params|^2`` that ``loss_fn`` already contains: ``l2_reg``
        is added to the curvature (the preconditioner's damping, the quadratic model).
      value_func_has_aux: ``loss_fn`` returns ``(loss, aux)``.
      value_func_has_state: ``loss_fn`` takes a state after the parameters
        and returns ``(loss, new_state)`` (or ``(loss, (new_state, aux))``
        with aux), e.g. batch-norm statistics.
      value_func_has_rng: ``loss_fn`` takes an rng key before the batch.
      curvature, learning_rate, damping, batch: config dataclasses.
      multi_device: pmap `step` over the local devices (batches then have a
        leading device axis, parameters and state are replicated; see
        `kfacx.parallel`), or over the devices of all processes after
        `jax.distributed.initialize`; otherwise `step` is jit-compiled.
      pmap_axis_name: the device axis name used by `step` when
        ``multi_device`` (and by `unstaged_step` if you pmap it yourself).
      distributed_inverses: with several devices, refresh each block's cached
        inverse on one owner device (chosen by cost) and share it, instead of
        on every device; the result is identical.
      mesh: a `jax.sharding.Mesh`: `step` is jit-compiled with the batch
        split over the mesh's data axis and the state replicated on the mesh;
        parameters too, unless they come sharded over the mesh (as in
        fully-sharded data parallelism): then they and their velocities keep
        their shardings. Inputs are global arrays (one batch, one rng).
      data_axis_name: the mesh axis the batch is split over (default: the
        mesh's only axis).
      use_shard_map: with ``mesh``, run the step as a `jax.shard_map` over
        the data axis (each device sees its shard and the step averages over
        the axis, as under pmap) instead of letting the compiler partition it.
      shard_curvature_state: with ``mesh`` (or ``multi_device``), keep each curvature
        block's factors and cached inverses on one owner device of the data axis (a
        `kfacx.parallel.ShardedEstimatorState`, owners balanced by bytes): its
        statistics are reduce-scattered to it, it preconditions its blocks and the
        update is all-gathered once per step. Same results as the replicated state;
        `kfacx.gather_estimator_state` reads it back per block. Not with EKFAC
        blocks.
      debug: do not compile `step` (for debugging with Python prints).
      compiler_options: XLA options for the compiled `step` (all placements
        but ``multi_device``), e.g. `kfacx.fast_compile_options` ``()`` (on the CPU:
        about 40 % less compile time, 2-3 % slower steps). Default: XLA's own.
      regularized_parameters_path_exclusions: regular expressions (`re.search`) on
        parameter paths as in kfacx's messages, e.g. ``(r"/b$", "norm")``: the
        parameters the ``l2_reg`` term leaves out (no curvature of theirs in the
        quadratic model, nor in the damping of blocks made of them only). A pattern
        that matches no parameter is a ``ValueError`` at `init`.
      add_l2_reg: the optimizer adds the ``l2_reg`` term to the loss itself (to the
        gradient and to the loss change behind ``rho``), as kfacx's ``l2_reg`` did in
        0.1.0.dev0 before it took kfac-jax's meaning.
      donate_params_and_state: `step` donates the buffers of the ``params``, ``state``
        and ``func_state`` it is given to its outputs, as kfac-jax's step always does:
        the new state reuses the memory of the old (no copy of the curvature factors
        and cached inverses a step leaves alone), and the arrays passed in are deleted.
        Use only the returned values after a step. It saves memory, and on a GPU
        time (the deep autoencoder's step on an H200: 3.2 ms against 4.6 ms); on the
        CPU the donated step is about 6% slower (docs/benchmarks.md, "On an NVIDIA
        H200" and "Kernels of the step"). Default False: the inputs stay valid.
      **kwargs: any config field by its (kfac-jax) name, e.g.
        ``use_adaptive_damping=True, initial_damping=1.0``; overrides the configs.
        Each field is documented on its config class (kfac-jax's less common
        options too: ``precon_power``, ``use_step_rejection``,
        ``precon_damping_mult``...); docs/quickstart.md tables them.

    Raises:
      TypeError: for an unknown keyword argument or a non-callable function.
      ValueError: for inconsistent options.

    Example::

      optimizer = kfacx.Optimizer(
          jax.value_and_grad(loss_fn), l2_reg=1e-5,
          use_adaptive_learning_rate=True, use_adaptive_momentum=True,
          use_adaptive_damping=True, initial_damping=1.0)
      state = optimizer.init(params, rng, batch)
      params, state, stats = optimizer.step(params, state, rng, batch)
    """

    State = OptimizerState

    def __init__(
        self,
        value_and_grad_func: Callable[..., Any],
        l2_reg: float = 0.0,
        value_func_has_aux: bool = False,
        value_func_has_state: bool = False,
        value_func_has_rng: bool = False,
        curvature: CurvatureConfig | None = None,
        learning_rate: LearningRateConfig | None = None,
        damping: DampingConfig | None = None,
        batch: BatchConfig | None = None,
        multi_device: bool = False,
        pmap_axis_name: str = "kfac_axis",
        distributed_inverses: bool = True,
        mesh: jax.sharding.Mesh | None = None,
        data_axis_name: str | None = None,
        use_shard_map: bool = False,
        debug: bool = False,
        compiler_options: Mapping[str, Any] | None = None,
        regularized_parameters_path_exclusions: Sequence[str] = (),
        add_l2_reg: bool = False,
        shard_curvature_state: bool = False,
        donate_params_and_state: bool = False,
        **kwargs: Any,
    ):
        if not callable(value_and_grad_func):
            raise TypeError(f"value_and_grad_func must be callable, got {value_and_grad_func!r}.")
        curvature, learning_rate, damping, batch = resolve_configs(
            curvature, learning_rate, damping, batch, kwargs
        )
        self.value_and_grad_func = value_and_grad_func
        self.value_func_has_aux = value_func_has_aux
        self.value_func_has_state = value_func_has_state
        self.value_func_has_rng = value_func_has_rng
        self.multi_device = multi_device
        self.pmap_axis_name = pmap_axis_name
        self.placement = Placement(
            multi_device,
            pmap_axis_name,
            mesh,
            data_axis_name,
            use_shard_map,
            distributed_inverses,
            compiler_options,
            shard_curvature_state,
        )
        self.debug = debug
        if not isinstance(donate_params_and_state, (bool, np.bool_)):
            raise TypeError(
                f"donate_params_and_state must be True or False, got {donate_params_and_state!r}."
            )
        self.donate_params_and_state = bool(donate_params_and_state)
        call = LossCall(
            value_and_grad_func, value_func_has_aux, value_func_has_state, value_func_has_rng
        )
        self.estimator = make_estimator(call.value, curvature)
        self._passes = BatchPasses(call, self.estimator, batch, curvature.curvature_batch_fraction)
        self._kfac_step = KfacStep(
            curvature,
            learning_rate,
            damping,
            Regularization(l2_reg, regularized_parameters_path_exclusions, add_l2_reg),
            schedules(learning_rate, damping),
            self._passes,
            self.placement,
            self.unstaged_init,
            sharded_curvature(self.placement, self.estimator),
        )
        self._staged_step = None
        self._is_set_up = False
        self._first = FirstStep(
            self._kfac_step, self.placement, curvature, damping, self._state_shardings, debug
        )

    # The options the step was built with (read-only: the step, the estimator and the
    # passes over the batch are made from them once).

    @property
    def curvature(self) -> CurvatureConfig:
        """How the curvature is estimated and inverted."""
        return self._kfac_step.curvature

    @property
    def learning_rate(self) -> LearningRateConfig:
        """Learning rate and momentum options."""
        return self._kfac_step.learning_rate

    @property
    def damping(self) -> DampingConfig:
        """Damping options."""
        return self._kfac_step.damping

    @property
    def batch(self) -> BatchConfig:
        """How a batch is processed."""
        return self._passes.config

    @property
    def l2_reg(self) -> float:
        """The weight decay."""
        return self._kfac_step.l2_reg

    def _check_func_state(self, func_state):
        if self.value_func_has_state and func_state is None:
            raise ValueError("value_func_has_state=True: pass func_state to init and step.")
        if not self.value_func_has_state and func_state is not None:
            raise ValueError("func_state was given but value_func_has_state=False.")

    # ---------------------------------------------------------------- init

    def init(self, params: Any, rng: jax.Array, batch: Any, func_state: Any = None):
        """The initial `OptimizerState` (replicated over devices if ``multi_device``).

        Traces the loss function on ``batch`` to find its layers.

        Warns (`UserWarning`) about parameters the loss does not use: they
        get a zero gradient and are left unchanged (except for ``l2_reg``).

        Raises:
          TypeError: if a parameter is not floating-point (naming its path).
          ValueError: if no loss is registered, a parameter is not covered,
            the batch is empty, or ``func_state`` does not match
            ``value_func_has_state``.
        """
        self._check_func_state(func_state)
        params, rng, batch, func_state = self.placement.adopt(params, rng, batch, func_state)
        _checks.check_init_args(params, batch, example_axis=int(self.multi_device))
        self._first.past = False
        init = self.placement.stage_init(self.unstaged_init, self.debug, self._state_shardings)
        self._set_up(params, rng, batch, func_state)
        if not self.multi_device:
            batch = self.placement.local_batch(batch)
        return init(params, rng, batch, func_state)

    def _set_up(self, params, rng, batch, func_state):
        """Traces the loss function on one step function's shapes (a device's).

        Only shapes matter here: a device's slice and a micro-batch are taken by
        `jax.eval_shape`, not computed (each eager slice would compile a program per
        leaf shape)."""
        if self.multi_device:
            params, rng, batch, func_state = jax.eval_shape(
                lambda tree: jax.tree.map(lambda x: x[0], tree), (params, rng, batch, func_state)
            )
        else:
            self.placement.check_batch(batch)
            batch = self.placement.local_batch(batch)
        call = self._passes.call
        args = call.args(params, func_state, rng, jax.eval_shape(self._passes.microbatch, batch))
        _checks.warn_unused_params(lambda *a: call.split_output(call.value(*a))[0], args)
        self._kfac_step.regularization.leaf_mask(params)  # a pattern matching nothing raises
        self.estimator.set_up(args)
        self._is_set_up = True

    def unstaged_init(self, params: Any, rng: jax.Array, batch: Any, func_state: Any = None):
        """`init` without staging (pure; for users who jit or pmap it themselves)."""
        args = self._passes.call.args(params, func_state, rng, self._passes.microbatch(batch))
        est = self.estimator.init(rng, args)
        sharded = self._kfac_step.sharded
        if sharded is not None:
            est = sharded.shard(est)
            if self.multi_device:  # Under pmap each device keeps its own rows.
                est = sharded.own_rows(est)
        initial = self.damping.initial_damping
        return OptimizerState(
            velocities=jax.tree.map(lambda p: zeros(jnp.shape(p), jnp.result_type(p)), params),
            estimator_state=est,
            damping=jnp.asarray(0.0 if initial is None else initial, jnp.float32),
            data_seen=zeros((), jnp.int32),
            step_counter=zeros((), jnp.int32),
        )

    def _state_shardings(self, params_shardings, replicated):
        """`OptimizerState`'s shardings for sharded parameters (see `Placement.stage`):
        the velocities' are the parameters'; a sharded curvature state lays itself out."""
        est = None if self.placement.shard_state else replicated
        return OptimizerState(params_shardings, est, *[replicated] * 3)

    # ---------------------------------------------------------------- the step

    def unstaged_step(
        self,
        params: Any,
        state: OptimizerState,
        rng: jax.Array,
        batch: Any,
        func_state: Any = None,
        learning_rate: Any = None,
        momentum: Any = None,
        damping: Any = None,
        global_step_int: Any = None,
    ):
        """One K-FAC step without staging (pure; see `step` for the arguments).

        Under `jax.pmap` with ``axis_name=pmap_axis_name`` (``multi_device``),
        every reduction is averaged over that axis.

        Returns:
          ``(params, state, stats)``, or ``(params, state, func_state, stats)``
          with ``value_func_has_state``.
        """
        return self._kfac_step(
            params, state, rng, batch, func_state, learning_rate, momentum, damping, global_step_int
        )

    # ---------------------------------------------------------------- staged entry points

    def _stage(self):
        if self._staged_step is None:
            rest = 2 if self.value_func_has_state else 1  # (func_state,) stats
            outs = lambda p, r: (p, self._state_shardings(p, r), *[r] * rest)  # noqa: E731

            donate = ()
            if self.donate_params_and_state:  # (params, state, rng, batch, func_state, ...)
                donate = (0, 1, 4) if self.value_func_has_state else (0, 1)
            self._staged_step = self.placement.stage(
                self.unstaged_step, self.debug, self.value_func_has_aux, outs, donate
            )
        return self._staged_step

    def step(
        self,
        params: Any,
        state: OptimizerState,
        rng: jax.Array,
        batch: Any = None,
        func_state: Any = None,
        learning_rate: Any = None,
        momentum: Any = None,
        damping: Any = None,
        global_step_int: int | None = None,
        data_iterator: Iterator[Any] | None = None,
    ):
        """One K-FAC step, jit-compiled (or pmapped with ``multi_device``).

        Args:
          params: the parameters.
          state: the `OptimizerState`.
          rng: a random key (per device with ``multi_device``).
          batch: the batch (with a leading device axis with ``multi_device``).
          func_state: the loss function's state, with ``value_func_has_state``.
          learning_rate, momentum, damping: values for this step, when they
            are neither adaptive nor scheduled.
          global_step_int: the step passed to schedules (default: the state's counter).
          data_iterator: alternatively to ``batch``, an iterator of batches
            (also used for the burn-in before the first step).

        Returns:
          ``(params, state, stats)``, or ``(params, state, func_state, stats)`` with
          ``value_func_has_state``. ``stats`` holds scalars (NaN where not computed;
          docs/logging.md gives their dtypes and compares them with kfac-jax's):

          - ``loss``: at the parameters before the step (mean over the batch).
          - ``learning_rate``, ``momentum``: this step's (given, scheduled or solved).
          - ``damping``: the damping this step used (an adapted one shows next step).
          - ``rho``: the reduction ratio; NaN unless the step adapts the damping or
            is a long step checked by ``long_step_ratio``.
          - ``quad_model_change``: the quadratic model's change; NaN unless the
            learning rate or the damping is adaptive.
          - ``grad_norm``, ``precon_grad_norm``, ``update_norm``: of the gradient
            (with ``l2_reg``), the preconditioned gradient, the update.
          - ``step``: the step counter before the step (0 first; kfac-jax's: after).
          - ``data_seen``: the examples seen, this step's included.
          - ``skipped``: True when the loss, the gradient, a curvature statistic or
            the new state is not finite (e.g. NaN in the batch), or the damping is
            not positive: params, state (and func_state) are returned unchanged,
            bit for bit, and the step counter does not advance.
          - ``rejected``: with ``use_step_rejection``, or adaptive damping with
            ``long_step_ratio`` (the default): True when the step raised the batch
            loss and was not applied (params and momentum kept).
          - ``aux``: the loss function's aux output (with ``value_func_has_aux``).

        Raises:
          ValueError: for a Python or NumPy ``damping`` that is not finite and
            positive, or a non-finite ``learning_rate`` / ``momentum``
            (checked before dispatch; a `jax.Array` is not read, a bad one
            skips the step). When the step is traced (not per step): for an
            empty batch; a ``state`` that does not belong to this model (made
            by `init` for other layers, widths or params: the message names
            the first mismatching state leaf); no learning rate or damping.
        """
        self._check_func_state(func_state)
        _checks.check_step_values(learning_rate=learning_rate, momentum=momentum, damping=damping)
        if (batch is None) == (data_iterator is None):
            raise ValueError("Pass exactly one of batch and data_iterator.")
        batch, func_state = self.placement.adopt(batch, func_state)
        if not self._is_set_up and batch is not None:
            # A state made by another Optimizer (resumed from a checkpoint): `init`'s
            # set-up, which this one never ran.
            self._set_up(params, rng, batch, func_state)
        if self._first.due(state, global_step_int):  # the burn-in and the calibration
            values = (learning_rate, momentum, global_step_int)
            rng, state, batch, func_state = self._first.run(
                params, state, rng, batch, data_iterator, func_state, values
            )
        self._first.past = True
        if batch is None:
            batch = next(data_iterator)
        batch, params, state, rng, func_state = self.placement.put(
            batch, params, state, rng, func_state
        )
        return self._stage()(
            params, state, rng, batch, func_state, learning_rate, momentum, damping, global_step_int
        )

    def burnin(
        self,
        num_steps: int,
        params: Any,
        state: OptimizerState,
        rng: jax.Array,
        data_iterator: Iterator[Any],
        func_state: Any = None,
    ):
        """Updates the curvature estimate on ``num_steps`` batches without moving the
        parameters (done automatically before the first `step` when
        ``num_burnin_steps > 0``). Returns ``(state, func_state)``."""
        return self._first.burnin(num_steps, params, state, rng, data_iterator, func_state)
