"""The one phase before `kfacx.Optimizer`'s first step: the burn-in and the initial
damping's calibration.

kfac-jax runs both in its first `step`, on the step's data (``data_iterator``, or the
step's batch): they cannot move to `init`, which is given one batch and no learning
rate. Everything else (detection, placement, checks) is set up in `init`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from kfacx.optimizer import _calibration, _keys
from kfacx.optimizer._configs import CurvatureConfig, DampingConfig


class FirstStep:
    """The phase and its staged programs (the burn-in step, the calibration's ratio),
    each compiled on first use."""

    def __init__(
        self,
        kfac_step: Any,
        placement: Any,
        curvature: CurvatureConfig,
        damping: DampingConfig,
        state_shardings: Callable[..., Any],
        debug: bool,
    ):
        self.kfac_step, self.placement = kfac_step, placement
        self.curvature, self.damping = curvature, damping
        self.state_shardings, self.debug = state_shardings, debug
        self.past = False  # set by the first step; reset by `init`
        self._staged_burnin = None
        self._staged_ratio = None

    def due(self, state: Any, global_step_int: int | None) -> bool:
        """Whether this step is the first and has a phase before it; reads the step
        counter only until the first step is past."""
        if not (self.curvature.num_burnin_steps or self.damping.use_initial_damping_calibration):
            return False
        if global_step_int is not None:
            return int(global_step_int) == 0
        if self.past:
            return False
        return int(np.asarray(state.step_counter).reshape(-1)[0]) == 0

    def run(self, params, state, rng, batch, data_iterator, func_state, values):
        """The burn-in (``num_burnin_steps`` batches from ``data_iterator``, else
        ``batch`` repeated), then the calibration on the step's batch. Returns ``(rng,
        state, batch, func_state)``: ``rng`` split off the burn-in's key, ``batch``
        drawn from ``data_iterator`` when the step was given none."""
        if self.curvature.num_burnin_steps:
            source = data_iterator if data_iterator is not None else _keys.repeat(batch)
            rng, burnin_rng = _keys.split_key(rng, self.placement.kind == "pmap")
            state, func_state = self.burnin(
                self.curvature.num_burnin_steps, params, state, burnin_rng, source, func_state
            )
        if self.damping.use_initial_damping_calibration:
            if batch is None:
                batch = next(data_iterator)
            if self._staged_ratio is None:
                ratio = self.kfac_step.calibration_ratio
                self._staged_ratio = self.placement.stage(ratio, self.debug)
            batch, *args = self.placement.put(batch, params, state, rng, func_state)
            args.insert(3, batch)  # (params, state, rng, batch, func_state)
            state = _calibration.calibrated_state(self._staged_ratio, args, values, self.damping)
        return rng, state, batch, func_state

    def burnin(
        self,
        num_steps: int,
        params: Any,
        state: Any,
        rng: jax.Array,
        data_iterator: Iterator[Any],
        func_state: Any = None,
    ):
        """`kfacx.Optimizer.burnin`."""
        if self._staged_burnin is None:
            outs = lambda p, r: (self.state_shardings(p, r), r)  # noqa: E731
            staged = self.placement.stage(self.kfac_step.burnin_step, self.debug, False, outs)
            self._staged_burnin = staged
        multi_device = self.placement.kind == "pmap"
        for i in range(num_steps):
            batch = next(data_iterator)
            step_rng = _keys.fold_in(rng, i, multi_device)
            batch, params, state, step_rng, func_state = self.placement.put(
                batch, params, state, step_rng, func_state
            )
            state, func_state = self._staged_burnin(params, state, step_rng, batch, func_state)
        return state, func_state
