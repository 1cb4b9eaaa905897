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
