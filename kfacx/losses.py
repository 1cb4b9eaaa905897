"""Loss functions behind the loss tags: values, sampling and curvature products.

Every registered loss has the form ``weight * (1/B) * sum_b sum_terms mask * nll``,
where ``B`` is the leading (batch) dimension of the prediction and ``nll`` the
negative log-likelihood of a predictive distribution parameterised by the
prediction (its natural parameters, so the Fisher and the Gauss-Newton matrix
with respect to the prediction coincide).

Curvature products act per example and do *not* include the ``1/B``: the
curvature blocks divide their statistics by the batch size. They include
``weight`` and ``mask``: with ``H_b`` the Hessian of example ``b``'s terms,
``multiply_ggn`` computes ``weight * mask * H_b v`` and the factor ``S`` with
``S S^T = weight * mask * H_b`` is what the curvature-propagation and exact
estimation modes push backwards through the network.

`CTCLoss` is the exception to the single-distribution rule: its value is the CTC
loss of whole label sequences, its curvature the Fisher of the per-frame
categorical model those sequences marginalise (see `kfacx.register_ctc_loss`).
"""

from __future__ import annotations

import abc
import math
from collections.abc import Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import optax

from kfacx import tags


class LossFunction(abc.ABC):
    """Abstract loss: a predictive distribution over targets given a prediction.

    Subclasses implement the unmasked, unweighted per-term pieces
    (`_nll`, `_sample`, `_gradient`, `_hessian`, `_factor`, `_factor_t`); this
    class applies ``mask`` and ``weight`` and sums over terms.

    Args:
      prediction: the tagged model output, ``[batch, ...]``.
      targets: the observed targets (format as the subclass documents).
      mask: optional per-term weights (shape `term_shape`), or None.
      weight: positive constant scaling the loss.
    """

    #: Name of the loss tag this class interprets.
    tag_name: ClassVar[str]

    def __init__(
        self,
        prediction: jax.Array,
        targets: jax.Array,
        mask: jax.Array | None = None,
        weight: float = 1.0,
    ):
        self.prediction = prediction
        self.targets = targets
        self.mask = mask
        self.weight = float(weight)

    @classmethod
    def from_operands(
        cls, prediction: jax.Array, targets: jax.Array, extra: Sequence[Any], params: dict
    ) -> LossFunction:
        """The loss of one loss-tag equation (see `loss_from_tag`).

        Args:
          prediction, targets: the tag's first two operands.
          extra: its other operands: ``()`` or ``(mask,)`` for the built-in losses
            except `CTCLoss`, which overrides this.
          params: the tag's keyword parameters (``weight``, ...).

        Returns:
          ``cls(prediction, targets, mask, **params)``.
        """
        return cls(prediction, targets, extra[0] if extra else None, **params)

    @property
    def batch_size(self) -> int:
        """The leading dimension of the prediction."""
        return self.prediction.shape[0]

    @property
    def term_shape(self) -> tuple[int, ...]:
        """The shape of the per-term losses (and of ``mask``)."""
        return tuple(self.prediction.shape)

    # -- pieces implemented by subclasses (no mask, no weight) --------------

    @abc.abstractmethod
    def _nll(self, targets: jax.Array) -> jax.Array:
        """Per-term negative log-likelihood, shape `term_shape`."""

    @abc.abstractmethod
    def _sample(self, rng: jax.Array) -> jax.Array:
        """A sample of targets from the predictive distribution."""

    @abc.abstractmethod
    def _gradient(self, targets: jax.Array) -> jax.Array:
        """Gradient of the summed per-term nll with respect to the prediction."""

    @abc.abstractmethod
    def _factor(self, v: jax.Array) -> jax.Array:
        """``S v`` with ``S S^T = H``, per example; ``v`` has the prediction's shape."""

    @abc.abstractmethod
    def _factor_t(self, v: jax.Array) -> jax.Array:
        """``S^T v``, per example."""

    def _hessian(self, v: jax.Array) -> jax.Array:
        """``H v`` per example (defaults to ``S S^T v``)."""
        return self._factor(self._factor_t(v))

    # -- public API ---------------------------------------------------------

    def _mask_like_prediction(self) -> jax.Array | None:
        if self.mask is None:
            return None
        extra = self.prediction.ndim - self.mask.ndim
        return self.mask.reshape(self.mask.shape + (1,) * extra)

    def _scale(self, v: jax.Array, mask_power: float) -> jax.Array:
        mask = self._mask_like_prediction()
        scale = self.weight**mask_power
        if mask is None:
            return scale * v
        return scale * v * (mask if mask_power == 1.0 else jnp.sqrt(mask))

    def evaluate(self, targets: jax.Array | None = None) -> jax.Array:
        """The loss value ``weight * (1/B) * sum(mask * nll)`` (scalar).

        Args:
          targets: targets to evaluate at; defaults to the registered ones.
        """
        nll = self._nll(self.targets if targets is None else targets)
        if self.mask is not None:
            nll = nll * self.mask
        return self.weight * jnp.sum(nll) / self.batch_size

    def sample(self, rng: jax.Array) -> jax.Array:
        """Samples targets from the model's predictive distribution."""
        return self._sample(rng)

    def per_example_gradient(self, targets: jax.Array | None = None) -> jax.Array:
        """``B *`` the gradient of `evaluate` with respect to the prediction."""
        grad = self._gradient(self.targets if targets is None else targets)
        return self._scale(grad, 1.0)

    def empirical_fisher_cotangent(self) -> jax.Array:
        """``sqrt(weight) * mask * grad nll(observed targets)``.

        Its outer product, averaged over the batch, is the empirical Fisher of
        the loss; like the other curvature products it scales with ``weight``
        (not ``weight**2``), so all estimation modes agree on the scale.
        """
        return self._scale(self._gradient(self.targets), 1.0) / math.sqrt(self.weight)

    def sampled_fisher_cotangent(self, rng: jax.Array) -> jax.Array:
        """``sqrt(weight * mask) * grad nll(sampled targets)``: its outer product is
        an unbiased estimate of the per-example Fisher ``weight * mask * H``."""
        return self._scale(self._gradient(self._sample(rng)), 0.5)

    def multiply_ggn(self, v: jax.Array) -> jax.Array:
        """``weight * mask * H v`` per example (no ``1/B``)."""
        return self._scale(self._hessian(v), 1.0)

    def multiply_ggn_factor(self, v: jax.Array) -> jax.Array:
        """``S v`` with ``S S^T = weight * mask * H``."""
        return self._scale(self._factor(v), 0.5)

    def multiply_ggn_factor_transpose(self, v: jax.Array) -> jax.Array:
        """``S^T v`` with ``S S^T = weight * mask * H``."""
        return self._factor_t(self._scale(v, 0.5))

    # For these losses the prediction is the natural parameter of an
    # exponential-family distribution, so Fisher == GGN.
    multiply_fisher = multiply_ggn
    multiply_fisher_factor = multiply_ggn_factor
    multiply_fisher_factor_transpose = multiply_ggn_factor_transpose

    def ggn_factor_columns(self) -> jax.Array:
        """All columns of the factor, batched: shape ``[K, *prediction.shape]``.

        ``K = prod(prediction.shape[1:])``; column ``k`` holds ``S_b e_k`` for
        every example ``b`` at once, so that ``sum_k c_k c_k^T`` restricted to
        example ``b`` is ``weight * mask * H_b``.
        """
        per_example = self.prediction.shape[1:]
        k = math.prod(per_example)
        eye = jnp.eye(k, dtype=self.prediction.dtype).reshape((k, 1) + per_example)
        basis = jnp.broadcast_to(eye, (k,) + self.prediction.shape)
        return jax.vmap(self.multiply_ggn_factor)(basis)


def _categorical_factor(p: jax.Array, v: jax.Array) -> jax.Array:
    """``S v`` with ``S S^T = diag(p) - p p^T`` over the last axis:
    ``S = (I - p 1^T) diag(sqrt p)``."""
    sqrt_p = jnp.sqrt(p)
    return sqrt_p * v - p * jnp.sum(sqrt_p * v, axis=-1, keepdims=True)


def _categorical_factor_t(p: jax.Array, v: jax.Array) -> jax.Array:
    """``S^T v`` for the factor of `_categorical_factor`."""
    sqrt_p = jnp.sqrt(p)
    return sqrt_p * v - sqrt_p * jnp.sum(p * v, axis=-1, keepdims=True)


def _categorical_hessian(p: jax.Array, v: jax.Array) -> jax.Array:
    """``(diag(p) - p p^T) v`` over the last axis: the softmax cross-entropy's Hessian."""
    return p * v - p * jnp.sum(p * v, axis=-1, keepdims=True)


class SoftmaxCrossEntropyLoss(LossFunction):
    """Categorical distribution over the last axis of the logits.

    Targets are integer labels (shape ``logits.shape[:-1]``) or one-hot / soft
    labels (shape ``logits.shape``); terms are the positions ``logits.shape[:-1]``.
    """

    tag_name = tags.softmax_cross_entropy.name

    @property
    def term_shape(self) -> tuple[int, ...]:
        return tuple(self.prediction.shape[:-1])

    def _probs(self) -> jax.Array:
        return jax.nn.softmax(self.prediction, axis=-1)

    def _soft_targets(self, targets: jax.Array) -> jax.Array:
        if jnp.issubdtype(targets.dtype, jnp.integer):
            return jax.nn.one_hot(targets, self.prediction.shape[-1], dtype=self.prediction.dtype)
        return targets.astype(self.prediction.dtype)

    def _nll(self, targets):
        log_p = jax.nn.log_softmax(self.prediction, axis=-1)
        return -jnp.sum(self._soft_targets(targets) * log_p, axis=-1)

    def _sample(self, rng):
        return jax.random.categorical(rng, self.prediction, axis=-1)

    def _gradient(self, targets):
        return self._probs() - self._soft_targets(targets)

    def _factor(self, v):
        return _categorical_factor(self._probs(), v)

    def _factor_t(self, v):
        return _categorical_factor_t(self._probs(), v)

    def _hessian(self, v):
        return _categorical_hessian(self._probs(), v)


class SigmoidCrossEntropyLoss(LossFunction):
    """Independent Bernoulli distributions, one per logit; targets are probabilities."""

    tag_name = tags.sigmoid_cross_entropy.name

    def _nll(self, targets):
        z = self.prediction
        return jnp.maximum(z, 0) - z * targets + jnp.log1p(jnp.exp(-jnp.abs(z)))

    def _sample(self, rng):
        p = jax.nn.sigmoid(self.prediction)
        return jax.random.bernoulli(rng, p).astype(self.prediction.dtype)

    def _gradient(self, targets):
        return jax.nn.sigmoid(self.prediction) - targets

    def _curvature(self):
        p = jax.nn.sigmoid(self.prediction)
        return p * (1 - p)

    def _factor(self, v):
        return jnp.sqrt(self._curvature()) * v

    _factor_t = _factor

    def _hessian(self, v):
        return self._curvature() * v


class NormalPredictiveLoss(LossFunction):
    """Gaussian with the prediction as mean and a fixed ``variance``.

    The value omits the constant ``0.5 * log(2 pi variance)`` per term, so with
    ``variance=0.5`` it is the plain squared error ``sum((prediction - t)^2)``.
    """

    tag_name = tags.normal_predictive.name

    def __init__(self, prediction, targets, mask=None, weight=1.0, variance=0.5):
        super().__init__(prediction, targets, mask, weight)
        self.variance = float(variance)

    def _nll(self, targets):
        return jnp.square(targets - self.prediction) / (2 * self.variance)

    def _sample(self, rng):
        noise = jax.random.normal(rng, self.prediction.shape, self.prediction.dtype)
        return self.prediction + math.sqrt(self.variance) * noise

    def _gradient(self, targets):
        return (self.prediction - targets) / self.variance

    def _factor(self, v):
        return v / math.sqrt(self.variance)

    _factor_t = _factor

    def _hessian(self, v):
        return v / self.variance


class CTCLoss(LossFunction):
    """The CTC loss (`optax.ctc_loss`), with the curvature of its per-frame model.

    The value and its gradient are CTC's: ``weight * (1/B) * sum_b ctc_b`` (`evaluate`,
    `per_example_gradient`, `empirical_fisher_cotangent`). Everything else, the
    curvature products, their factor and the sampled targets, belongs to the
    per-frame categorical model the CTC distribution marginalises: independent
    ``softmax(logits[b, t])`` over the frames ``t``, a real frame (``mask`` 1)
    contributing ``diag(p) - p p^T`` and a padded one (``mask`` 0) nothing. Terms
    are the frames (`term_shape` ``[B, T]``); samples are frame labels ``[B, T]``.
    `kfacx.register_ctc_loss` says what this approximates.

    Args:
      prediction: logits ``[B, T, K]``.
      targets: integer labels ``[B, N]``.
      mask: ``[B, T]``: ``1 - logit_paddings`` (None: no padded frame).
      weight: positive constant scaling the loss.
      label_paddings: ``[B, N]``, 1.0 marks a padded label (None: none).
      blank_id, log_epsilon: as `optax.ctc_loss`.
    """

    tag_name = tags.ctc.name

    def __init__(
        self,
        prediction: jax.Array,
        targets: jax.Array,
        mask: jax.Array | None = None,
        weight: float = 1.0,
        label_paddings: jax.Array | None = None,
        blank_id: int = 0,
        log_epsilon: float = -1e5,
    ):
        super().__init__(prediction, targets, mask, weight)
        if label_paddings is None:
            label_paddings = jnp.zeros(jnp.shape(targets), prediction.dtype)
        self.label_paddings = label_paddings
        self.blank_id = int(blank_id)
        self.log_epsilon = float(log_epsilon)

    @classmethod
    def from_operands(cls, prediction, targets, extra, params):
        """The tag's operands are ``(logits, labels, 1 - logit_paddings, label_paddings)``."""
        mask, label_paddings = extra
        return cls(prediction, targets, mask, label_paddings=label_paddings, **params)

    @property
    def term_shape(self) -> tuple[int, ...]:
        return tuple(self.prediction.shape[:-1])

    def _ctc(self, logits: jax.Array, labels: jax.Array) -> jax.Array:
        """`optax.ctc_loss` per sequence, ``[B]``."""
        ones = jnp.ones(self.term_shape, logits.dtype)
        paddings = ones - (ones if self.mask is None else self.mask.astype(logits.dtype))
        return optax.ctc_loss(
            logits,
            paddings,
            labels,
            self.label_paddings.astype(logits.dtype),
            blank_id=self.blank_id,
            log_epsilon=self.log_epsilon,
        )

    def _ctc_gradient(self, labels: jax.Array) -> jax.Array:
        """The gradient of ``sum_b ctc_b`` w.r.t. the logits (each row its own example's:
        ``p - gamma`` per frame, ``gamma`` the alignment posterior; 0 on padded frames)."""
        return jax.grad(lambda z: jnp.sum(self._ctc(z, labels)))(self.prediction)

    def _nll(self, targets):
        # Per sequence ([B]), not per term: the frames' terms do not add up to CTC.
        return self._ctc(self.prediction, targets)

    def evaluate(self, targets: jax.Array | None = None) -> jax.Array:
        """The loss value ``weight * (1/B) * sum_b ctc_b`` (scalar).

        Args:
          targets: label sequences ``[B, N]`` to evaluate at (with the registered
            label paddings); defaults to the registered labels.
        """
        labels = self.targets if targets is None else targets
        return self.weight * jnp.sum(self._nll(labels)) / self.batch_size

    def per_example_gradient(self, targets: jax.Array | None = None) -> jax.Array:
        """``B *`` the gradient of `evaluate` w.r.t. the logits (CTC's own gradient).

        Args:
          targets: label sequences ``[B, N]``; defaults to the registered labels.
        """
        grad = self._ctc_gradient(self.targets if targets is None else targets)
        return self._scale(grad, 1.0)

    def empirical_fisher_cotangent(self) -> jax.Array:
        """``sqrt(weight) *`` CTC's gradient at the observed labels: its outer product is
        the empirical Fisher of the CTC loss itself (not of the per-frame model)."""
        return self._scale(self._ctc_gradient(self.targets), 1.0) / math.sqrt(self.weight)

    def _probs(self) -> jax.Array:
        return jax.nn.softmax(self.prediction, axis=-1)

    def _sample(self, rng):
        return jax.random.categorical(rng, self.prediction, axis=-1)

    def _gradient(self, targets):
        # ``targets`` are frame labels [B, T] (`sample`): the per-frame cross-entropy's gradient.
        return self._probs() - jax.nn.one_hot(
            targets, self.prediction.shape[-1], dtype=self.prediction.dtype
        )

    def _factor(self, v):
        return _categorical_factor(self._probs(), v)

    def _factor_t(self, v):
        return _categorical_factor_t(self._probs(), v)

    def _hessian(self, v):
        return _categorical_hessian(self._probs(), v)


_LOSS_CLASSES: dict[str, type[LossFunction]] = {
    cls.tag_name: cls
    for cls in (SoftmaxCrossEntropyLoss, SigmoidCrossEntropyLoss, NormalPredictiveLoss, CTCLoss)
}


def register_loss_class(tag: tags.LossTag, cls: type[LossFunction]) -> None:
    """Maps a user-defined `kfacx.tags.LossTag` to the `LossFunction` that interprets it.

    Raises:
      TypeError: if ``cls`` is not a `LossFunction` subclass.
    """
    if not (isinstance(cls, type) and issubclass(cls, LossFunction)):
        raise TypeError(f"register_loss_class: {cls!r} is not a LossFunction subclass.")
    _LOSS_CLASSES[tag.name] = cls


def loss_from_tag(tag: tags.LossTag, operands: Sequence[Any], params: dict) -> LossFunction:
    """Builds the `LossFunction` for one loss-tag equation's operands and params.

    Raises:
      ValueError: if no loss class is registered for the tag.
    """
    cls = _LOSS_CLASSES.get(tag.name)
    if cls is None:
        raise ValueError(
            f"Loss tag {tag.name!r} has no LossFunction; register one with "
            "kfacx.losses.register_loss_class(tag, cls)."
        )
    prediction, targets, *extra = operands
    return cls.from_operands(prediction, targets, tuple(extra), dict(params))
