"""The `Case` record of the layer-detection tests' models, the tag names, random
parameters and the registered losses (see tests/graph_matcher/_models.py).

Model code broadcasts explicitly: the test suite runs with
``jax_numpy_rank_promotion="raise"``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import kfacx

DENSE, CONV, SAS, GENERIC = "dense_tag", "conv_tag", "scale_and_shift_tag", "generic_tag"
EMBED = "embedding_tag"
NHWC = ("NHWC", "HWIO", "NHWC")


@dataclasses.dataclass(frozen=True)
class Case:
    """A loss, example arguments and the registration detection should produce.

    Attributes:
      name: test id.
      loss: the untagged loss ``loss(params, batch)``.
      params: the parameters (the first argument of ``loss``).
      batch: the second argument of ``loss``.
      expected: path -> ``(tag, source, layer)``; ``layer`` is any label, the
        parameters with equal labels must share one layer tag.
      tag_counts: layer-tag primitive name -> number of equations in the
        tagged jaxpr.
      tag_meta: layer-tag primitive name -> one dict per equation (evaluation
        order) of params the equation must have.
      unmatched: the paths detection cannot match.
    """

    name: str
    loss: Callable[..., jax.Array]
    params: Any
    batch: tuple
    expected: Mapping[str, tuple[str, str, str]]
    tag_counts: Mapping[str, int]
    tag_meta: Mapping[str, Sequence[Mapping[str, Any]]] = dataclasses.field(default_factory=dict)
    unmatched: tuple[str, ...] = ()
    uses: Mapping[str, int] = dataclasses.field(default_factory=dict)

    @property
    def args(self) -> tuple:
        return (self.params, self.batch)


def normal(rng: np.random.Generator, *shape: int, scale: float = 1.0) -> jax.Array:
    # Cast on the host: jnp.asarray's cast would compile a conversion per shape.
    return jnp.asarray(np.asarray(scale * rng.standard_normal(shape), np.float32), jnp.float32)


def layer(module: str, tag: str, source: str, leaves: Sequence[str] = ("b", "w")) -> dict:
    """Expected entries of one module's parameters ``module/leaf``."""
    return {f"{module}/{leaf}": (tag, source, module) for leaf in leaves}


# ----------------------------------------------------------------------------- losses


def softmax_loss(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Registers the softmax cross-entropy on ``logits`` and returns its value."""
    logits = kfacx.register_softmax_cross_entropy_loss(logits, labels)
    log_p = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(log_p, labels[:, None], axis=1))


def squared_loss(prediction: jax.Array, targets: jax.Array) -> jax.Array:
    """Registers the squared error on ``prediction`` and returns its value."""
    prediction = kfacx.register_squared_error_loss(prediction, targets)
    return jnp.mean(jnp.sum(jnp.square(prediction - targets), axis=-1))


def _targets(kind: str, rng: np.random.Generator, batch: int, dim: int) -> jax.Array:
    if kind == "softmax":
        return jnp.asarray(np.asarray(rng.integers(0, dim, size=batch), np.int32), jnp.int32)
    return normal(rng, batch, dim)


def _loss_on(kind: str, y: jax.Array, t: jax.Array) -> jax.Array:
    y = y.reshape(y.shape[0], -1)
    return softmax_loss(y, t) if kind == "softmax" else squared_loss(y, t)
