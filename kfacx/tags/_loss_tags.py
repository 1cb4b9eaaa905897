"""Loss tags: primitives that mark a model output as the input of a registered loss."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

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
ctc = LossTag("ctc_loss_tag")


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


def _check_ctc_logits(name: str, logits: jax.Array) -> None:
    if logits.ndim != 3:
        raise ValueError(
            f"{name}: logits must have shape [batch, frames, classes], got shape "
            f"{tuple(logits.shape)}; pass optax.ctc_loss's logits (reshape or add axes first)."
        )
    if not jnp.issubdtype(logits.dtype, jnp.floating):
        raise TypeError(f"{name}: logits must be floating point, got {logits.dtype}.")


def _check_ctc_labels(name: str, labels: jax.Array, batch: int) -> None:
    if labels.ndim != 2 or labels.shape[0] != batch:
        raise ValueError(
            f"{name}: labels must have shape [batch, max_labels] = [{batch}, N] (the logits' "
            f"batch size first), got shape {tuple(labels.shape)}."
        )
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise TypeError(
            f"{name}: labels must be integer class ids, got {labels.dtype}; pass "
            "labels.astype(jnp.int32)."
        )


def _check_paddings(name: str, what: str, paddings: Any, shape: tuple[int, ...]) -> jax.Array:
    paddings = jnp.asarray(paddings)
    if tuple(paddings.shape) != shape:
        raise ValueError(
            f"{name}: {what} has shape {tuple(paddings.shape)}, expected {shape} "
            "(1.0 for a padded position, 0.0 for a real one)."
        )
    return paddings.astype(jnp.result_type(float))


def _check_blank_id(name: str, blank_id: Any, num_classes: int) -> int:
    if not isinstance(blank_id, (int, np.integer)) or isinstance(blank_id, bool):
        raise TypeError(f"{name}: blank_id must be a Python int, got {blank_id!r}.")
    if not 0 <= blank_id < num_classes:
        raise ValueError(
            f"{name}: blank_id={blank_id} is not a class of logits with {num_classes} "
            f"classes; choose 0 <= blank_id < {num_classes}."
        )
    return int(blank_id)


def _check_log_epsilon(name: str, log_epsilon: Any) -> float:
    try:
        value = float(log_epsilon)
    except (TypeError, jax.errors.ConcretizationTypeError) as e:
        raise TypeError(
            f"{name}: log_epsilon must be a Python float known at trace time, got "
            f"{log_epsilon!r}; pass a constant such as -1e5."
        ) from e
    if not math.isfinite(value) or value >= 0:
        raise ValueError(
            f"{name}: log_epsilon stands for log(0) and must be finite and negative, got "
            f"{value}; optax's default is -1e5."
        )
    return value


def register_ctc_loss(
    logits: jax.Array,
    logit_paddings: jax.Array,
    labels: jax.Array,
    label_paddings: jax.Array,
    *,
    blank_id: int = 0,
    log_epsilon: float = -1e5,
    weight: float = 1.0,
) -> jax.Array:
    """Registers the CTC loss ``weight * mean_batch(optax.ctc_loss(...))`` of a speech model.

    Call it on the logits you give `optax.ctc_loss`, with the same arguments: with
    ``weight=1`` it registers ``jnp.mean(optax.ctc_loss(logits, logit_paddings, labels,
    label_paddings))``, the mean over the batch of each sequence's negative
    log-likelihood. For a loss scaled by a constant ``c`` (say ``1 / max_frames``)
    pass ``weight=c``.

    **Curvature.** CTC's likelihood of an example's labels ``y`` is a sum over its
    alignments ``pi`` (one symbol per real frame, blank included, collapsing to ``y``)
    of the per-frame model ``q(pi) = prod_t p_t[pi_t]``, with ``p_t =
    softmax(logits[b, t])``. kfacx's curvature is ``weight`` times the Fisher of that
    per-frame model: per example, with respect to its logits, the block-diagonal
    matrix::

      F = blockdiag_t((1 - logit_paddings[b, t]) * (diag(p_t) - p_t p_t^T))

    Padded frames contribute nothing. ``F`` is also exactly the Gauss-Newton matrix
    of ``sum_t CE(softmax(logits[b, t]), s_t)`` for any frame targets ``s_t``, among
    them the alignment posteriors ``gamma_t`` in CTC's gradient ``p_t - gamma_t``.

    **What it approximates.** Let ``Sigma_y`` be the covariance of the alignment's
    one-hot frame labels under its posterior ``q(pi | y)``. The CTC loss is ``sum_t
    logsumexp(z_t) - log sum_{pi -> y} exp(sum_t z_t[pi_t])`` (two log-partition
    functions), so its Hessian with respect to the logits is ``F - Sigma_y``, in
    general indefinite; the Fisher of CTC's distribution over label sequences is the
    expectation of that Hessian over ``y``, ``F_ctc = F - E_y[Sigma_y]`` (the law of
    total covariance: the missing-information principle of EM). So ``F`` is positive
    semi-definite and bounds both from above: the exact curvature is ``F`` less the
    uncertainty of the alignment, which is zero when the posterior puts all its mass
    on one alignment. The damped inverse is at most the exact Fisher's, ``(F + lambda
    I)^-1 <= (F_ctc + lambda I)^-1``. K-FAC's blocks then approximate the
    parameter-space ``J^T F J`` as for any other loss.

    **Estimation modes.** ``ggn_exact``, ``fisher_exact`` and the curvature
    propagation modes use ``F`` (the ``ggn`` modes too, since CTC's own Hessian can be
    indefinite), and so does the quadratic model of `kfacx.Optimizer`'s adaptive
    learning rate, momentum and damping. ``fisher_gradients`` (the default) samples a
    label for every real frame from ``p_t``, independently, and uses the per-frame
    cross-entropy's gradient ``p_t - onehot(label)``: an unbiased estimate of ``F``
    (not of ``F_ctc``, which would need label sequences sampled from CTC's
    distribution). ``fisher_empirical`` and ``fisher_empirical_direct`` use CTC's own
    gradient at the observed labels: the empirical Fisher of the CTC loss itself.
    The exact modes cost ``frames * classes`` backward passes: use them on small
    models.

    Args:
      logits: ``[batch, frames, classes]``, the classes including the blank.
      logit_paddings: ``[batch, frames]``, 1.0 for a padded frame, 0.0 for a real one.
      labels: ``[batch, max_labels]`` integer labels, right-padded.
      label_paddings: ``[batch, max_labels]``, 1.0 for a padded label.
      blank_id: the blank's class (as `optax.ctc_loss`).
      log_epsilon: the stand-in for ``log(0)`` (as `optax.ctc_loss`).
      weight: a positive constant that scales the loss.

    Returns:
      ``logits``, tagged.

    Raises:
      ValueError: if a shape does not fit (the argument is named), ``blank_id`` is not
        a class, or ``weight`` / ``log_epsilon`` is not finite with the right sign.
      TypeError: if logits are not floating point, labels not integer, or
        ``weight`` / ``log_epsilon`` / ``blank_id`` are traced or of the wrong type.

    Example::

      logits = kfacx.register_ctc_loss(logits, logit_paddings, labels, label_paddings)
      loss = jnp.mean(optax.ctc_loss(logits, logit_paddings, labels, label_paddings))
    """
    name = "register_ctc_loss"
    _check_ctc_logits(name, logits)
    batch, frames, num_classes = logits.shape
    frame_paddings = _check_paddings(name, "logit_paddings", logit_paddings, (batch, frames))
    labels = jnp.asarray(labels)
    _check_ctc_labels(name, labels, batch)
    label_paddings = _check_paddings(name, "label_paddings", label_paddings, labels.shape)
    params = dict(
        weight=_static_float(name, weight, "weight"),
        blank_id=_check_blank_id(name, blank_id, num_classes),
        log_epsilon=_check_log_epsilon(name, log_epsilon),
    )
    frame_mask = 1.0 - frame_paddings
    return ctc.bind(logits, labels, frame_mask, label_paddings, **params)[0]
