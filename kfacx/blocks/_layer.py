"""`LayerInfo`: the static description of a tagged layer that a curvature block is built from."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any


@dataclasses.dataclass(frozen=True)
class LayerInfo:
    """Static description of one tagged layer, everything a block is built from.

    Attributes:
      tag_name: the layer tag's name (e.g. ``"dense_tag"``).
      parameter_paths: pytree paths of the layer's parameters (for messages).
      parameter_shapes: shapes of the parameters, in the tag's order.
      parameter_dtypes: dtypes of the parameters.
      input_shapes: shapes of the layer inputs (leading axis: batch).
      output_shapes: shapes of the layer outputs (leading axis: batch).
      meta: the tag's static metadata (e.g. conv strides).
      compute: ``compute(inputs, params, **meta) -> outputs`` or None.
      num_uses: how many times the layer is applied with these parameters
        (tied weights, or parameters closed over by a `lax.scan` body); the
        estimation data of all uses is folded into the batch axis.
      stack_size: None for an ordinary layer. For a *stacked* layer, ``L``: the
        layer sits in a `lax.scan` (e.g. `hk.layer_stack`) that scans over its
        parameters, so it is ``L`` independent layers whose parameters are
        stacked along a leading axis; every shape above then starts with
        ``L`` (`unstacked` describes one slice). The estimator serves it with
        a `kfacx.blocks.StackedBlock`.
      roles: for a *tied* layer (pseudo tag ``"tied"``: parameters that layer tags
        of different kinds use, e.g. a table used for the embedding lookup and,
        transposed, for the output projection), the `LayerInfo` of each kind of
        use; empty otherwise. Its estimation data is ``{"roles": (data, ...)}``,
        one per role, each as for an ordinary layer.
      role_params: for each role, the positions of its parameters among this
        layer's parameters.
    """

    tag_name: str
    parameter_paths: tuple[str, ...]
    parameter_shapes: tuple[tuple[int, ...], ...]
    parameter_dtypes: tuple[Any, ...]
    input_shapes: tuple[tuple[int, ...], ...] = ()
    output_shapes: tuple[tuple[int, ...], ...] = ()
    meta: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    compute: Callable[..., tuple] | None = None
    num_uses: int = 1
    stack_size: int | None = None
    roles: tuple[LayerInfo, ...] = ()
    role_params: tuple[tuple[int, ...], ...] = ()

    @property
    def name(self) -> str:
        """A readable name: the tag and the parameter paths."""
        return f"{self.tag_name}[{', '.join(self.parameter_paths)}]"

    def unstacked(self) -> LayerInfo:
        """The `LayerInfo` of one slice of a stacked layer (shapes without the layer axis).

        Raises:
          ValueError: if the layer is not stacked.
        """
        if self.stack_size is None:
            raise ValueError(f"Layer {self.name} is not stacked (stack_size is None).")

        def drop(shapes):
            return tuple(tuple(s)[1:] for s in shapes)

        return dataclasses.replace(
            self,
            parameter_shapes=drop(self.parameter_shapes),
            input_shapes=drop(self.input_shapes),
            output_shapes=drop(self.output_shapes),
            stack_size=None,
        )

    @classmethod
    def from_params(cls, tag_name: str, params: Sequence[Any], **kwargs: Any) -> LayerInfo:
        """Builds a `LayerInfo` from example parameters (paths default to p0, p1, ...)."""
        paths = kwargs.pop("parameter_paths", tuple(f"p{i}" for i in range(len(params))))
        return cls(
            tag_name=tag_name,
            parameter_paths=tuple(paths),
            parameter_shapes=tuple(tuple(p.shape) for p in params),
            parameter_dtypes=tuple(p.dtype for p in params),
            **kwargs,
        )
