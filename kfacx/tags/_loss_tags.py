"""Loss tags: primitives that mark a model output as the input of a registered loss."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from kfacx.tags._primitive import _IdentityTag

_LOSS_TAGS: dict[Any, LossTag] = {}


class LossTag(_IdentityTag):
    """A JAX primitive that marks the prediction of a registered loss.

    Bound as ``tag.bind(prediction, targets, [mask], weight=..., **params)``;
    returns ``[prediction]`` unchanged. `kfacx.losses` maps each loss tag name
    to the loss function class that gives it meaning.

    Args:
      name: unique name of the loss tag.

    Raises:
      ValueError: if a loss tag with this name exists already.
    """

    def __init__(self, name: str):
        if any(t.name == name for t in _LOSS_TAGS.values()):
            raise ValueError(f"A loss tag named {name!r} exists already; choose a unique name.")
        super().__init__(name, num_marked=1)
        _LOSS_TAGS[self.primitive] = self


def loss_tag_for(primitive: Any) -> LossTag | None:
    """Returns the `LossTag` whose primitive is ``primitive``, or None."""
    return _LOSS_TAGS.get(primitive)


softmax_cross_entropy = LossTag("softmax_cross_entropy_loss_tag")
sigmoid_cross_entropy = LossTag("sigmoid_cross_entropy_loss_tag")
normal_predictive = LossTag("normal_predictive_loss_tag")


def _static_float(name: str, value: Any, what: str) -> float:
    try:
        value = float(value)
    except (TypeError, jax.errors.ConcretizationTypeError) as e:
        raise TypeError(
            f"{name}: {what} must be a Python float known at trace time, got {value!r}. "
            "Pass a constant (e.g. weight=0.5), not a traced array."
        ) from e
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}: {what} must be finite and positive, got {value}.")
    return value


def _check_batch(name: str, prediction: jax.Array, min_ndim: int) -> None:
    if prediction.ndim < min_ndim:
        raise ValueError(
            f"{name}: the prediction has shape {tuple(prediction.shape)}; it needs a leading "
            f"batch axis{' and a class axis' if min_ndim > 1 else ''} "
            f"(at least {min_ndim} dimensions)."
        )
    if not jnp.issubdtype(prediction.dtype, jnp.floating):
        raise TypeError(f"{name}: the prediction must be floating point, got {prediction.dtype}.")


def _check_mask(name: str, mask: jax.Array | None, shape: tuple[int, ...]) -> tuple:
    if mask is None:
        return ()
    mask = jnp.asarray(mask)
    if tuple(mask.shape) != shape:
        raise ValueError(
            f"{name}: mask has shape {tuple(mask.shape)}, expected {shape} "
            "(one entry per loss term)."
        )
    return (mask.astype(jnp.result_type(float)),)


def register_softmax_cross_entropy_loss(
    logits: jax.Array,
    targets: jax.Array,
    mask: jax.Array | None = None,
    weight: float = 1.0,
) -> jax.Array:
    """Registers ``weight * mean_batch(sum(-log softmax(logits)[targets]))``.

    Args:
      logits: shape ``[batch, ..., num_classes]``.
      targets: integer labels of shape ``logits.shape[:-1]``, or one-hot / soft
        labels of shape ``logits.shape``.
      mask: optional weights of shape ``logits.shape[:-1]`` (0 drops a term).
      weight: a positive constant that scales the loss.

    Returns:
      ``logits``, tagged.

    Raises:
      ValueError: if targets or mask do not fit the logits.

    Example::

      logits = kfacx.register_softmax_cross_entropy_loss(logits, labels)
    """
    name = "register_softmax_cross_entropy_loss"
    _check_batch(name, logits, 2)
    targets = jnp.asarray(targets)
    if jnp.issubdtype(targets.dtype, jnp.integer):
        if tuple(targets.shape) != tuple(logits.shape[:-1]):
            raise ValueError(
                f"{name}: integer targets have shape {tuple(targets.shape)}, expected "
                f"{tuple(logits.shape[:-1])} (the logits' shape without the class axis)."
            )
    elif tuple(targets.shape) != tuple(logits.shape):
        raise ValueError(
            f"{name}: one-hot/soft targets have shape {tuple(targets.shape)}, expected "
            f"{tuple(logits.shape)} (the logits' shape); pass integer labels of shape "
            f"{tuple(logits.shape[:-1])} otherwise."
        )
    extra = _check_mask(name, mask, tuple(logits.shape[:-1]))
    weight = _static_float(name, weight, "weight")
    return softmax_cross_entropy.bind(logits, targets, *extra, weight=weight)[0]


def register_sigmoid_cross_entropy_loss(
    logits: jax.Array,
    targets: jax.Array,
    mask: jax.Array | None = None,
    weight: float = 1.0,
) -> jax.Array:
    """Registers ``weight * mean_batch(sum(binary cross-entropy(sigmoid(logits), targets)))``.

    Args:
      logits: shape ``[batch, ...]``.
      targets: probabilities (or 0/1 labels) of the same shape.
      mask: optional weights of the same shape.
      weight: a positive constant that scales the loss.

    Returns:
      ``logits``, tagged.

    Raises:
      ValueError: if targets or mask do not fit the logits.
    """
    name = "register_sigmoid_cross_entropy_loss"
    _check_batch(name, logits, 1)
    targets = jnp.asarray(targets)
    if tuple(targets.shape) != tuple(logits.shape):
        raise ValueError(
            f"{name}: targets have shape {tuple(targets.shape)}, expected {tuple(logits.shape)} "
            "(one probability per logit)."
        )
    extra = _check_mask(name, mask, tuple(logits.shape))
    weight = _static_float(name, weight, "weight")
    return sigmoid_cross_entropy.bind(logits, targets.astype(logits.dtype), *extra, weight=weight)[
        0
    ]


def register_normal_predictive_distribution(
    mean: jax.Array,
    targets: jax.Array,
    variance: float = 0.5,
    weight: float = 1.0,
) -> jax.Array:
    """Registers a Gaussian negative log-likelihood with fixed variance.

    The loss is ``weight * mean_batch(sum((targets - mean)^2 / (2 variance)))``.

    Args:
      mean: the predicted mean, shape ``[batch, ...]``.
      targets: the observed values, same shape.
      variance: the (fixed, positive) variance of the predictive distribution.
      weight: a positive constant that scales the loss.

    Returns:
      ``mean``, tagged.

    Raises:
      ValueError: if the targets do not fit or variance is not positive.
    """
    name = "register_normal_predictive_distribution"
    _check_batch(name, mean, 1)
    targets = jnp.asarray(targets)
    if tuple(targets.shape) != tuple(mean.shape):
        raise ValueError(
            f"{name}: targets have shape {tuple(targets.shape)}, expected {tuple(mean.shape)}."
        )
    variance = _static_float(name, variance, "variance")
    weight = _static_float(name, weight, "weight")
    return normal_predictive.bind(
        mean, targets.astype(mean.dtype), weight=weight, variance=variance
    )[0]


def register_squared_error_loss(
    prediction: jax.Array, targets: jax.Array, weight: float = 1.0
) -> jax.Array:
    """Registers ``weight * mean_batch(sum((prediction - targets)^2))``.

    This is `register_normal_predictive_distribution` with variance 0.5. If your
    loss has a factor 1/2, pass ``weight=0.5``.

    Returns:
      ``prediction``, tagged.

    Raises:
      ValueError: if the targets do not fit.
    """
    return register_normal_predictive_distribution(prediction, targets, variance=0.5, weight=weight)
