"""``kfac_jax.tracer``: `LayerVjpData`, and kfacx's tracer functions under kfac-jax's names.

`layer_tags_vjp`, `loss_tags_vjp` and `loss_tags_jvp` are kfacx's (`kfacx.tracer`),
which take the function and its arguments as kfac-jax's do; what they return is kfacx's
(docs/migrating.md compares them).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Generic, TypeVar

import jax

from kfacx.kfac_jax._unsupported import unsupported, unsupported_class
from kfacx.kfac_jax.layers_and_loss_tags import LayerData
from kfacx.tracer import layer_tags_vjp, loss_tags_jvp, loss_tags_vjp

T = TypeVar("T")

__all__ = [
    "LayerVjpData",
    "ProcessedJaxpr",
    "layer_tags_vjp",
    "loss_tags_hvp",
    "loss_tags_jvp",
    "loss_tags_vjp",
]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerVjpData(Generic[T]):
    """A layer's primal values (``primals.inputs``, ``.outputs``, ``.params``) and the
    gradients of its outputs (``tangents.outputs``), as a kfac-jax block receives them.

    ``example_mask`` (kfacx's addition; None without padding) weighs the examples, 0 for
    padding: the inputs of padded examples are zero already, and kfac-jax's dense blocks
    here also weigh the bias's column of ones by it."""

    primals: LayerData[T]
    tangents: LayerData[T]
    example_mask: Any = None


ProcessedJaxpr = unsupported_class(
    "tracer.ProcessedJaxpr", "kfacx.tracer.trace gives kfacx's traced function"
)
loss_tags_hvp = unsupported(
    "loss_tags_hvp",
    "use jax.jvp of jax.grad of the loss, or kfacx.BlockDiagonalCurvature's products",
)
