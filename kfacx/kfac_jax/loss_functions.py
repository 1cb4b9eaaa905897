"""``kfac_jax.loss_functions``: kfac-jax's loss registrations, on kfacx's loss tags.

kfac-jax lets ``targets`` be omitted (they only matter to the empirical Fisher); kfacx's
loss tags always carry targets, so an omitted target is registered as NaN: the sampled
and exact estimation modes never read it, and ``fisher_empirical`` then gives
non-finite statistics, which kfacx's step reports as ``skipped`` (kfac-jax raises).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from kfacx import losses as _losses
from kfacx import tags as _tags
from kfacx.kfac_jax._unsupported import unsupported_class

__all__ = [
    "CategoricalLogitsNegativeLogProbLoss",
    "DistributionNegativeLogProbLoss",
    "LossFunction",
    "MultiBernoulliNegativeLogProbLoss",
    "NegativeLogProbLoss",
    "NormalMeanNegativeLogProbLoss",
    "NormalMeanVarianceNegativeLogProbLoss",
    "OneHotCategoricalLogitsNegativeLogProbLoss",
    "register_categorical_predictive_distribution",
    "register_multi_bernoulli_predictive_distribution",
    "register_normal_predictive_distribution",
    "register_sigmoid_cross_entropy_loss",
    "register_softmax_cross_entropy_loss",
    "register_squared_error_loss",
]

LossFunction = _losses.LossFunction
NegativeLogProbLoss = _losses.LossFunction
DistributionNegativeLogProbLoss = _losses.LossFunction
NormalMeanNegativeLogProbLoss = _losses.NormalPredictiveLoss
MultiBernoulliNegativeLogProbLoss = _losses.SigmoidCrossEntropyLoss
CategoricalLogitsNegativeLogProbLoss = _losses.SoftmaxCrossEntropyLoss
OneHotCategoricalLogitsNegativeLogProbLoss = _losses.SoftmaxCrossEntropyLoss
NormalMeanVarianceNegativeLogProbLoss = unsupported_class(
    "NormalMeanVarianceNegativeLogProbLoss",
    "kfacx's Gaussian loss has a fixed variance (register_normal_predictive_distribution); "
    "register a learned variance's output with a loss tag of your own (kfacx.tags.LossTag)",
)


def _targets(targets: Any, like: Any, dtype: Any = None) -> Any:
    if targets is not None:
        return targets
    return jnp.full(like.shape, jnp.nan, dtype or like.dtype)


def register_normal_predictive_distribution(
    mean, targets=None, variance: float = 0.5, weight: float = 1.0, normalize_log_prob=True
):
    """A Gaussian predictive distribution of fixed ``variance`` around ``mean``."""
    del normalize_log_prob  # the constant of the log-likelihood changes no curvature
    return _tags.register_normal_predictive_distribution(
        mean, _targets(targets, mean), variance=variance, weight=weight
    )


def register_squared_error_loss(prediction, targets=None, weight: float = 1.0):
    """``weight * ||prediction - targets||^2`` (a Gaussian of variance 0.5)."""
    return _tags.register_squared_error_loss(prediction, _targets(targets, prediction), weight)


def register_sigmoid_cross_entropy_loss(logits, targets=None, weight: float = 1.0):
    """Independent Bernoulli distributions of the ``logits``."""
    return _tags.register_sigmoid_cross_entropy_loss(
        logits, _targets(targets, logits), weight=weight
    )


register_multi_bernoulli_predictive_distribution = register_sigmoid_cross_entropy_loss


def register_softmax_cross_entropy_loss(logits, targets=None, mask=None, weight: float = 1.0):
    """A categorical distribution of the ``logits`` (integer or one-hot ``targets``)."""
    return _tags.register_softmax_cross_entropy_loss(
        logits, _targets(targets, logits), mask=mask, weight=weight
    )


register_categorical_predictive_distribution = register_softmax_cross_entropy_loss


def _one(vector: Any, what: str) -> Any:
    if isinstance(vector, tuple | list):
        if len(vector) != 1:
            raise ValueError(
                f"{what}: given {len(vector)} arrays; kfacx's losses have one input (the "
                "prediction)."
            )
        return vector[0]
    return vector


class KfacJaxLoss:
    """A kfacx loss (`kfacx.losses.LossFunction`) seen through kfac-jax's loss API, as
    kfac-jax's tracer functions return them (`kfacx.kfac_jax.tracer`):

    * `evaluate` gives the loss of every example (``weight * mask * nll`` summed over
      all but the batch axis; every entry for independent Bernoullis), as kfac-jax's
      distributions do, not kfacx's batch mean;
    * the curvature products take and return a tuple with one array per loss input
      (kfacx's losses have one: the prediction);
    * every other attribute is the kfacx loss's.
    """

    def __init__(self, loss: _losses.LossFunction):
        self.kfacx_loss = loss

    def __getattr__(self, name: str) -> Any:
        if name == "kfacx_loss":  # not set yet (copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self.kfacx_loss, name)

    def __repr__(self) -> str:
        return f"KfacJaxLoss({self.kfacx_loss!r})"

    @property
    def inputs(self) -> tuple[Any, ...]:
        return (self.kfacx_loss.prediction,)

    @property
    def parameter_dependants(self) -> tuple[Any, ...]:
        return self.inputs

    def evaluate(self, targets: Any = None, coefficient_mode: str = "regular") -> Any:
        """The loss of every example (kfac-jax's ``evaluate``; ``coefficient_mode`` is
        kfac-jax's and only ``"regular"`` is served)."""
        if coefficient_mode != "regular":
            raise ValueError(
                f"evaluate(coefficient_mode={coefficient_mode!r}): kfacx serves 'regular'."
            )
        loss = self.kfacx_loss
        nll = loss._nll(loss.targets if targets is None else targets)
        if loss.mask is not None:
            nll = nll * loss.mask
        if isinstance(loss, _losses.SigmoidCrossEntropyLoss):
            return loss.weight * nll  # independent Bernoullis: one loss per entry
        return loss.weight * jnp.sum(nll, axis=tuple(range(1, nll.ndim)))

    def _product(name: str):  # noqa: N805 - a factory of methods
        def method(self, vector):
            return (getattr(self.kfacx_loss, name)(_one(vector, name)),)

        method.__name__ = name
        method.__doc__ = f"kfacx's ``{name}``, with kfac-jax's tuple per loss input."
        return method

    multiply_fisher = _product("multiply_fisher")
    multiply_ggn = _product("multiply_ggn")
    multiply_fisher_factor_transpose = _product("multiply_fisher_factor_transpose")
    multiply_ggn_factor_transpose = _product("multiply_ggn_factor_transpose")

    def multiply_fisher_factor(self, vector):
        """kfacx's ``multiply_fisher_factor``, with kfac-jax's tuple per loss input."""
        return (self.kfacx_loss.multiply_fisher_factor(_one(vector, "multiply_fisher_factor")),)

    def multiply_ggn_factor(self, vector):
        """kfacx's ``multiply_ggn_factor``, with kfac-jax's tuple per loss input."""
        return (self.kfacx_loss.multiply_ggn_factor(_one(vector, "multiply_ggn_factor")),)

    del _product


# kfac-jax's code checks isinstance(loss, NegativeLogProbLoss).
_losses.LossFunction.register(KfacJaxLoss)
