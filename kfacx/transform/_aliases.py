"""Ready-made K-FAC optimizers in the style of optax's aliases (`optax.adamw`).

`kfac_adamw` and `kfac_soap` are the two recipes measured in docs/recipes.md on a
Transformer language model and a ResNet with batch norm (benchmarks/modern.py): each
is an `optax.chain` of a K-FAC direction, AdamW's decoupled weight decay and the
learning rate (a number or an optax schedule, e.g. warmup and cosine decay). Like
`kfacx.scale_by_kfac` they take the curvature statistics as the extra argument
``curvature_stats`` of ``update``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import optax

from kfacx.estimator import BlockDiagonalCurvature
from kfacx.transform import scale_by_kfac
from kfacx.transform._eigen_adam import scale_by_kfac_eigen_adam
from kfacx.transform._graft import graft


def _matrices(params: Any) -> Any:
    """The default decay mask: weight matrices and kernels (not norms, biases, scalars)."""
    return jax.tree.map(lambda p: getattr(p, "ndim", 0) >= 2, params)


def _check(learning_rate, weight_decay, momentum, other_learning_rate, other_mask) -> None:
    """Raises a clear error for a bad argument common to the aliases."""
    if not (isinstance(momentum, (int, float)) and 0 <= momentum < 1):
        raise ValueError(f"momentum must be a number in [0, 1), got {momentum!r}.")
    if not (isinstance(weight_decay, (int, float)) and weight_decay >= 0):
        raise ValueError(f"weight_decay must be a number >= 0, got {weight_decay!r}.")
    for name, rate in (
        ("learning_rate", learning_rate),
        ("other_learning_rate", other_learning_rate),
    ):
        if rate is not None and not (callable(rate) or isinstance(rate, (int, float))):
            raise TypeError(
                f"{name} must be a number or an optax schedule (step -> rate), e.g. "
                f"optax.warmup_cosine_decay_schedule(0.0, 1e-2, 30, 300); got {rate!r}."
            )
    if (other_learning_rate is None) != (other_mask is None):
        raise ValueError(
            "Pass other_learning_rate and other_mask together: other_mask says which "
            "parameters (e.g. embeddings, output layer, norms, biases) take "
            "other_learning_rate instead of learning_rate."
        )


def _finish(
    direction, learning_rate, weight_decay, mask, other_learning_rate, other_mask
) -> optax.GradientTransformationExtraArgs:
    """``direction``, then the decoupled weight decay and the learning rate(s)."""
    rate = optax.scale_by_learning_rate(learning_rate)
    if other_learning_rate is not None:

        def labels(params):
            chosen = other_mask(params) if callable(other_mask) else other_mask
            return jax.tree.map(lambda m: "other" if m else "main", chosen)

        other = optax.scale_by_learning_rate(other_learning_rate)
        rate = optax.partition({"main": rate, "other": other}, labels)
    return optax.chain(
        direction,
        optax.add_decayed_weights(weight_decay, mask=_matrices if mask is None else mask),
        rate,
    )


def kfac_adamw(
    estimator: BlockDiagonalCurvature,
    func_args: Sequence[Any],
    learning_rate: float | Callable[[Any], Any],
    weight_decay: float = 1e-4,
    momentum: float = 0.9,
    damping: float = 1e-3,
    inverse_update_period: int = 10,
    curvature_ema: float = 0.95,
    mask: Any = None,
    other_learning_rate: float | Callable[[Any], Any] | None = None,
    other_mask: Any = None,
) -> optax.GradientTransformationExtraArgs:
    """K-FAC's direction with AdamW's per-layer step size, weight decay and schedule.

    The gradient's momentum (``optax.trace(momentum)``) is preconditioned by K-FAC
    (`kfacx.scale_by_kfac` with ``damping``), and each parameter's update is rescaled to
    the norm of Adam's update of the same gradient (`kfacx.graft`): K-FAC decides where
    each layer moves, Adam how far, so AdamW's learning rates, warmup and decay carry
    over. Then AdamW's decoupled weight decay and the learning rate::

        optax.chain(
            kfacx.graft(optax.scale_by_adam(),
                        optax.chain(optax.trace(momentum), kfacx.scale_by_kfac(...))),
            optax.add_decayed_weights(weight_decay, mask),
            optax.scale_by_learning_rate(learning_rate),
        )

    Use it with the curvature statistics of (a part of) each batch::

        estimator = kfacx.BlockDiagonalCurvature(loss_fn)
        schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 30, 300)
        tx = kfacx.kfac_adamw(estimator, (params, batch), schedule)
        opt_state = tx.init(params)
        ...
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        stats = estimator.compute_curvature_stats(rng, (params, batch[:32]))
        updates, opt_state = tx.update(grads, opt_state, params, curvature_stats=stats)

    Args:
      estimator, func_args: as for `kfacx.scale_by_kfac`.
      learning_rate: a number or an optax schedule (``count -> rate``).
      weight_decay: AdamW's decoupled weight decay (times the learning rate).
      momentum: the decay of the gradient's momentum, in [0, 1).
      damping, inverse_update_period, curvature_ema: `kfacx.scale_by_kfac`'s.
      mask: which parameters decay (a pytree of bools or a function of the
        parameters); None: the parameters with two or more axes.
      other_learning_rate, other_mask: a second rate (number or schedule) for the
        parameters where ``other_mask`` (a pytree of bools or a function of the
        parameters) is True, as Muon gives its Adam part its own rate: on the
        Transformer of docs/recipes.md the embeddings, output layer, norms and biases
        at 3x the hidden matrices' rate reach 1.91 instead of 2.00 in 300 steps.

    Raises:
      ValueError: on a bad weight decay or momentum, ``other_learning_rate`` without
        ``other_mask`` or the reverse (and `kfacx.scale_by_kfac`'s).
      TypeError: on a learning rate that is neither a number nor a schedule.
    """
    _check(learning_rate, weight_decay, momentum, other_learning_rate, other_mask)
    kfac = scale_by_kfac(
        estimator,
        func_args,
        damping=damping,
        curvature_ema=curvature_ema,
        inverse_update_period=inverse_update_period,
    )
    direction = graft(optax.scale_by_adam(), optax.chain(optax.trace(momentum), kfac))
    return _finish(direction, learning_rate, weight_decay, mask, other_learning_rate, other_mask)


def kfac_soap(
    estimator: BlockDiagonalCurvature,
    func_args: Sequence[Any],
    learning_rate: float | Callable[[Any], Any],
    weight_decay: float = 1e-4,
    momentum: float = 0.9,
    b2: float = 0.95,
    eps: float = 1e-8,
    inverse_update_period: int = 10,
    curvature_ema: float = 0.95,
    mask: Any = None,
    other_learning_rate: float | Callable[[Any], Any] | None = None,
    other_mask: Any = None,
) -> optax.GradientTransformationExtraArgs:
    """Adam's second moment in the K-FAC eigenbasis (SOAP), with momentum, AdamW's
    weight decay and a schedule::

        optax.chain(
            kfacx.scale_by_kfac_eigen_adam(estimator, func_args, b2, eps, ...),
            optax.trace(momentum),
            optax.add_decayed_weights(weight_decay, mask),
            optax.scale_by_learning_rate(learning_rate),
        )

    The momentum is a sum (``optax.trace``), so its rates are about ``1 - momentum``
    times AdamW's (0.1x for the default 0.9). It is used as `kfac_adamw` is, with the
    curvature statistics of each batch as ``curvature_stats``.

    Args:
      estimator, func_args: as for `kfacx.scale_by_kfac_eigen_adam`.
      learning_rate: a number or an optax schedule (``count -> rate``).
      weight_decay, mask, other_learning_rate, other_mask: as for `kfac_adamw`.
      momentum: the decay of the momentum of the scaled directions, in [0, 1).
      b2: the decay of the second moment; 0.95 (SOAP's choice for language models) was
        measured better than Adam's 0.999 on the Transformer of docs/recipes.md.
      eps, inverse_update_period, curvature_ema: `kfacx.scale_by_kfac_eigen_adam`'s.

    Raises:
      ValueError: on a bad weight decay or momentum, ``other_learning_rate`` without
        ``other_mask`` or the reverse (and the transformation's own).
      TypeError: on a learning rate that is neither a number nor a schedule.
    """
    _check(learning_rate, weight_decay, momentum, other_learning_rate, other_mask)
    soap = scale_by_kfac_eigen_adam(
        estimator,
        func_args,
        b2=b2,
        eps=eps,
        curvature_ema=curvature_ema,
        inverse_update_period=inverse_update_period,
    )
    direction = optax.chain(soap, optax.trace(momentum))
    return _finish(direction, learning_rate, weight_decay, mask, other_learning_rate, other_mask)
