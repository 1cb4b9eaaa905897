"""Layer tags: `LayerTag`, the registry of layer tags and the built-in generic tag.

The built-in layer kinds live in their own modules: `_dense`, `_conv` and
`_norm_embedding` (scale-and-shift and embedding).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax

from kfacx.tags._primitive import _IdentityTag

#: Computes a layer's outputs from its inputs and parameters:
#: ``compute(inputs: tuple, params: tuple, **meta) -> outputs: tuple``.
LayerCompute = Callable[..., tuple]

_LAYER_TAGS: dict[Any, LayerTag] = {}


class LayerTag(_IdentityTag):
    """A JAX primitive that marks one layer of a model inside a jaxpr.

    The primitive is bound as ``tag.bind(*outputs, *inputs, *params, **meta)``
    and returns ``outputs`` unchanged (as a list). ``meta`` is static, hashable
    metadata of the layer (e.g. convolution strides). A tagged function
    evaluates, differentiates, jits, vmaps and pmaps exactly like the untagged
    one; the tracer (`kfacx.layer_tags_vjp`) finds the tag and reads the layer's
    inputs, outputs and parameters from it.

    Args:
      name: unique name of the tag; it keys ``layer_tag_to_block_ctor``.
      num_inputs: number of layer inputs among the operands.
      num_outputs: number of layer outputs among the operands (and results).
      compute: optional ``compute(inputs, params, **meta) -> outputs`` that
        recomputes the layer; blocks that need per-example parameter gradients
        (`kfacx.blocks.Diagonal`, `kfacx.blocks.Full`) use it.

    Raises:
      ValueError: if a tag with this name exists already, or counts are invalid.

    Example::

      my_tag = kfacx.tags.LayerTag("my_dense_tag", num_inputs=1, num_outputs=1)
      y, = my_tag.bind(y, x, w)   # returns y unchanged
    """

    def __init__(
        self,
        name: str,
        num_inputs: int,
        num_outputs: int,
        compute: LayerCompute | None = None,
    ):
        if num_inputs < 0:
            raise ValueError(f"LayerTag {name!r}: num_inputs must be >= 0, got {num_inputs}.")
        if any(t.name == name for t in _LAYER_TAGS.values()):
            raise ValueError(
                f"A layer tag named {name!r} exists already; give the new tag a unique name "
                f"(names key `layer_tag_to_block_ctor`)."
            )
        super().__init__(name, num_outputs)
        self._num_inputs = num_inputs
        self._num_outputs = num_outputs
        self.compute = compute
        _LAYER_TAGS[self.primitive] = self

    @property
    def num_inputs(self) -> int:
        """The number of layer inputs among the operands."""
        return self._num_inputs

    @property
    def num_outputs(self) -> int:
        """The number of layer outputs among the operands."""
        return self._num_outputs

    def split(self, operands: Sequence[Any]) -> tuple[tuple, tuple, tuple]:
        """Splits a tag's operands into ``(outputs, inputs, params)``."""
        n_out, n_in = self._num_outputs, self._num_inputs
        operands = tuple(operands)
        return operands[:n_out], operands[n_out : n_out + n_in], operands[n_out + n_in :]


def layer_tag_for(primitive: Any) -> LayerTag | None:
    """Returns the `LayerTag` whose primitive is ``primitive``, or None."""
    return _LAYER_TAGS.get(primitive)


def shape_error(tag: str, what: str, got: Any, want: str, fix: str) -> ValueError:
    """The error of a register_* call (``tag``) for an operand of the wrong shape."""
    return ValueError(f"{tag}: {what} has shape {tuple(got)}, expected {want}. {fix}")


# ----------------------------------------------------------------------------- generic


generic = LayerTag("generic_tag", num_inputs=0, num_outputs=1)


def register_generic(parameter: jax.Array) -> jax.Array:
    """Marks a parameter that belongs to no known layer kind; returns it unchanged.

    Its block (`kfacx.blocks.Diagonal` by default) is estimated from the
    gradient of the loss with respect to the parameter itself.

    Example::

      w = kfacx.register_generic(w)
    """
    return generic.bind(parameter, parameter)[0]
