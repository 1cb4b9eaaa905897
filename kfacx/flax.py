"""K-FAC in Flax's own training loops: linen's ``TrainState`` and NNX's ``nnx.Optimizer``.

Import it as ``kfacx.flax`` (``import kfacx`` does not import Flax). With
`kfacx.scale_by_kfac` in the optax transformation, both loops need the curvature
statistics of the batch next to the gradients:

- **linen.** `TrainState` is ``flax.training.train_state.TrainState`` whose
  ``apply_gradients`` also takes ``curvature_stats=`` and hands it to ``tx.update``::

      state = kfacx.flax.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
      loss, grads, stats = estimator.value_grads_and_curvature_stats(rng, (state.params, batch))
      state = state.apply_gradients(grads=grads, curvature_stats=stats)

- **NNX.** `NNXLoss` turns ``loss_fn(model, batch)`` into the function of the
  parameters that the estimator needs, and `nnx_value_grads_and_curvature_stats`
  is the counterpart of ``nnx.value_and_grad``, with the statistics::

      loss = kfacx.flax.NNXLoss(loss_fn, model)
      estimator = kfacx.BlockDiagonalCurvature(loss)
      tx = optax.chain(kfacx.scale_by_kfac(estimator, loss.func_args(model, batch)), ...)
      optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
      value, grads, stats = kfacx.flax.nnx_value_grads_and_curvature_stats(
          estimator, rng, model, batch)
      optimizer.update(model, grads, curvature_stats=stats)

This module is named after the package it serves; its imports are absolute, so
``import flax`` here is Flax itself.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import optax
from flax import nnx
from flax.training import train_state

from kfacx.estimator import BlockDiagonalCurvature, CurvatureStats
from kfacx.transform import AccumulateCurvatureStatsState, ScaleByKfacState
from kfacx.transform._eigen_adam import ScaleByKfacEigenAdamState

__all__ = ["NNXLoss", "TrainState", "nnx_value_grads_and_curvature_stats"]

_KFAC_STATES = (ScaleByKfacState, ScaleByKfacEigenAdamState, AccumulateCurvatureStatsState)

_HOW_TO_GET_STATS = (
    "loss, grads, stats = estimator.value_grads_and_curvature_stats(rng, func_args); "
    "state = state.apply_gradients(grads=grads, curvature_stats=stats)"
)


# ----------------------------------------------------------------------------- linen


def _uses_kfac(opt_state: Any) -> bool:
    """Whether an optax state holds the state of `scale_by_kfac` (or its aggregator)."""
    leaves = jax.tree_util.tree_leaves(opt_state, is_leaf=lambda s: isinstance(s, _KFAC_STATES))
    return any(isinstance(s, _KFAC_STATES) for s in leaves)


def _check_curvature_stats(opt_state: Any, curvature_stats: Any) -> None:
    kfac = _uses_kfac(opt_state)
    if kfac and curvature_stats is None:
        raise TypeError(
            "TrainState.apply_gradients: tx contains kfacx.scale_by_kfac, which needs this "
            f"batch's curvature statistics. Pass them: {_HOW_TO_GET_STATS}."
        )
    if curvature_stats is None:
        return
    if not kfac:
        raise TypeError(
            "TrainState.apply_gradients: curvature_stats was given, but tx contains no "
            "kfacx.scale_by_kfac to use it. Put kfacx.scale_by_kfac(estimator, func_args) "
            "in tx, or leave curvature_stats out."
        )
    if not isinstance(curvature_stats, CurvatureStats):
        raise TypeError(
            "TrainState.apply_gradients: curvature_stats must be the kfacx.CurvatureStats "
            f"from estimator.value_grads_and_curvature_stats, got {type(curvature_stats).__name__}."
        )


def _tx_extra_args(curvature_stats: Any, extra_args: Mapping[str, Any] | None) -> dict:
    if extra_args is None:
        extra_args = {}
    if not isinstance(extra_args, Mapping):
        raise TypeError(
            "TrainState.apply_gradients: extra_args must be a mapping of keyword arguments "
            f"for tx.update, got {type(extra_args).__name__}."
        )
    extra = dict(extra_args)
    if "curvature_stats" in extra:
        raise TypeError(
            "TrainState.apply_gradients: pass curvature_stats=stats directly, not in extra_args."
        )
    if curvature_stats is not None:
        extra["curvature_stats"] = curvature_stats
    return extra


def _bind_extra_args(tx: optax.GradientTransformation, extra: dict) -> optax.GradientTransformation:
    """``tx`` whose ``update(updates, state, params)`` passes ``extra`` on."""

    def update(updates, state, params=None):
        return tx.update(updates, state, params, **extra)

    return optax.GradientTransformation(tx.init, update)


class TrainState(train_state.TrainState):
    """Flax's ``TrainState`` whose `apply_gradients` passes K-FAC's statistics to ``tx``.

    A drop-in replacement for ``flax.training.train_state.TrainState``
    (``create``, the fields, subclassing with e.g. ``batch_stats`` are Flax's):
    ``apply_gradients`` also takes the ``curvature_stats`` that
    `kfacx.scale_by_kfac` needs, and any other keyword arguments of
    ``tx.update`` as ``extra_args``. With a ``tx`` without K-FAC and neither
    argument it behaves exactly as Flax's.

    Example::

      class State(kfacx.flax.TrainState):
          batch_stats: Any

      def loss_fn(params, batch_stats, batch):  # -> (loss, new batch_stats)
          ...

      estimator = kfacx.BlockDiagonalCurvature(loss_fn)
      tx = optax.chain(
          kfacx.scale_by_kfac(estimator, (params, batch_stats, batch)),
          optax.sgd(0.1, momentum=0.9),
      )
      state = State.create(apply_fn=model.apply, params=params, tx=tx,
                           batch_stats=batch_stats)

      @jax.jit
      def train_step(state, rng, batch):
          (loss, batch_stats), grads, stats = estimator.value_grads_and_curvature_stats(
              rng, (state.params, state.batch_stats, batch), has_aux=True)
          state = state.apply_gradients(
              grads=grads, curvature_stats=stats, batch_stats=batch_stats)
          return state, loss
    """

    def apply_gradients(
        self,
        *,
        grads: Any,
        curvature_stats: CurvatureStats | None = None,
        extra_args: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> TrainState:
        """Updates ``step``, ``params`` and ``opt_state``, and replaces the fields in ``kwargs``.

        Args:
          grads: gradients shaped like ``params``.
          curvature_stats: this batch's `kfacx.CurvatureStats` (from
            `kfacx.BlockDiagonalCurvature.value_grads_and_curvature_stats`);
            required when ``tx`` contains `kfacx.scale_by_kfac`.
          extra_args: other keyword arguments of ``tx.update`` (e.g.
            ``{"value": loss}`` for optax's line searches).
          **kwargs: fields of the state to replace, as in Flax (e.g.
            ``batch_stats=...``); an unknown name is a TypeError.

        Returns:
          The updated state.

        Raises:
          TypeError: if ``tx`` contains `kfacx.scale_by_kfac` and no statistics
            are given, if statistics are given to a ``tx`` without it, or if they
            are not a `kfacx.CurvatureStats`.
        """
        extra = _tx_extra_args(curvature_stats, extra_args)
        _check_curvature_stats(self.opt_state, curvature_stats)
        if not extra:
            return super().apply_gradients(grads=grads, **kwargs)
        # Flax's apply_gradients calls tx.update(grads, opt_state, params): run it with a
        # tx that passes the extra arguments on, then put the original (or a new) tx back.
        bound = self.replace(tx=_bind_extra_args(self.tx, extra))
        new = super(TrainState, bound).apply_gradients(grads=grads, **kwargs)
        return new.replace(tx=kwargs.get("tx", self.tx))


# ----------------------------------------------------------------------------- NNX


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


class NNXLoss:
    """The loss of an NNX model as a function of its parameters, for the K-FAC estimator.

    ``loss_fn(model, *args)`` is what you would give ``nnx.value_and_grad``;
    it calls the model and registers its loss on the model output
    (``kfacx.register_*_loss``). The estimator needs a pure function of a
    parameter pytree instead: calling this object,
    ``loss(params, rest, *args)``, merges ``params`` (the ``wrt`` variables)
    and ``rest`` (every other variable: batch statistics, RNG counts) into the
    model, calls ``loss_fn`` and returns ``(loss, new_rest)``, or
    ``(loss, (new_rest, aux))`` with ``has_aux``: the convention of
    `kfacx.Optimizer`'s ``value_func_has_state``. Both are pure `nnx.State`
    pytrees of arrays (`split`).

    Args:
      loss_fn: ``loss_fn(model, *args)`` returning the loss (or ``(loss, aux)``).
      model: the `nnx.Module`; only its structure (graph definition) is kept.
      wrt: the filter of the variables to optimize, as ``nnx.Optimizer``'s.
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``.

    Raises:
      TypeError: if ``loss_fn`` is not callable or ``model`` is not an `nnx.Module`.

    Example::

      loss = kfacx.flax.NNXLoss(loss_fn, model)
      estimator = kfacx.BlockDiagonalCurvature(loss)
      tx = optax.chain(kfacx.scale_by_kfac(estimator, loss.func_args(model, batch)),
                       optax.sgd(0.1, momentum=0.9))
      optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    """

    def __init__(
        self,
        loss_fn: Callable[..., Any],
        model: nnx.Module,
        *,
        wrt: Any = nnx.Param,
        has_aux: bool = False,
    ):
        if not callable(loss_fn):
            raise TypeError(f"NNXLoss: loss_fn must be callable, got {loss_fn!r}.")
        _check_module(model, "NNXLoss")
        self.loss_fn = loss_fn
        self.wrt = wrt
        self.has_aux = has_aux
        self.graphdef = nnx.split(model, wrt, ...)[0]

    def split(self, model: nnx.Module) -> tuple[nnx.State, nnx.State]:
        """``(params, rest)``: the model's ``wrt`` variables and all others, as arrays.

        Raises:
          ValueError: if ``model``'s structure differs from the one this loss was
            made from.
        """
        _check_module(model, "NNXLoss.split")
        graphdef, params, rest = nnx.split(model, self.wrt, ...)
        if graphdef != self.graphdef:
            raise ValueError(
                "NNXLoss: the model's structure differs from the model this NNXLoss (and "
                "its estimator) was made from; make a new NNXLoss and estimator for it."
            )
        return nnx.as_pure(params), nnx.as_pure(rest)

    def func_args(self, model: nnx.Module, *args: Any) -> tuple:
        """``(params, rest, *args)``: the estimator's arguments for ``loss_fn(model, *args)``."""
        return (*self.split(model), *args)

    def __call__(self, params: nnx.State, rest: nnx.State, *args: Any) -> tuple[Any, Any]:
        """``loss_fn(model, *args)`` of the model with ``params`` and ``rest`` merged in.

        Returns:
          ``(loss, new_rest)``, or ``(loss, (new_rest, aux))`` with ``has_aux``.
        """
        model = nnx.merge(self.graphdef, params, rest)
        out = self.loss_fn(model, *args)
        if isinstance(out, tuple) != self.has_aux:
            raise TypeError(
                f"NNXLoss: loss_fn returned a {type(out).__name__}, but has_aux={self.has_aux}: "
                "return the loss alone, or (loss, aux) with NNXLoss(..., has_aux=True)."
            )
        new_rest = nnx.as_pure(nnx.split(model, self.wrt, ...)[2])
        if self.has_aux:
            return out[0], (new_rest, out[1])
        return out, new_rest


def _check_module(model: Any, where: str) -> None:
    if not isinstance(model, nnx.Module):
        raise TypeError(f"{where}: model must be an nnx.Module, got {type(model).__name__}.")


def nnx_value_grads_and_curvature_stats(
    estimator: BlockDiagonalCurvature, rng: jax.Array, model: nnx.Module, *args: Any, **kwargs: Any
) -> tuple[Any, nnx.State, CurvatureStats]:
    """``nnx.value_and_grad`` of an `NNXLoss`, with the curvature statistics.

    One forward pass gives the loss, the gradient and the statistics. As with
    ``nnx.value_and_grad``, the model's other variables (batch statistics, RNG
    counts) are updated in place, and the gradient is an `nnx.State` of the
    ``wrt`` variables, ready for ``nnx.Optimizer.update(model, grads,
    curvature_stats=stats)``.

    Args:
      estimator: a `kfacx.BlockDiagonalCurvature` of an `NNXLoss`.
      rng: randomness for the sampling estimation modes.
      model: the model (as the `NNXLoss` was made from).
      *args: the other arguments of ``loss_fn`` (e.g. the batch).
      **kwargs: keyword arguments of
        `kfacx.BlockDiagonalCurvature.value_grads_and_curvature_stats`
        (``estimation_mode``, ``example_mask``).

    Returns:
      ``(value, grads, stats)``: ``loss_fn``'s output (``loss`` or ``(loss, aux)``),
      the gradient, and the `kfacx.CurvatureStats` of the batch.

    Raises:
      TypeError: if the estimator's function is not an `NNXLoss`.
    """
    loss = getattr(estimator, "func", None)
    if not isinstance(loss, NNXLoss):
        raise TypeError(
            "nnx_value_grads_and_curvature_stats: estimator must be a "
            "kfacx.BlockDiagonalCurvature of a kfacx.flax.NNXLoss, e.g. "
            "BlockDiagonalCurvature(kfacx.flax.NNXLoss(loss_fn, model)); got one of "
            f"{loss!r}."
        )
    (value, out), grads, stats = estimator.value_grads_and_curvature_stats(
        rng, loss.func_args(model, *args), has_aux=True, **kwargs
    )
    rest, aux = out if loss.has_aux else (out, None)
    nnx.update(model, rest)
    variables = nnx.state(model, loss.wrt)
    grads = jax.tree_util.tree_map(
        lambda v, g: v.replace(g), variables, grads, is_leaf=_is_variable
    )
    return ((value, aux) if loss.has_aux else value), grads, stats
