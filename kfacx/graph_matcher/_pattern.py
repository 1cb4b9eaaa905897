"""`GraphPattern`: a layer kind described as data (a small JAX function + example args)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.extend as jex
import numpy as np

from kfacx.tags import LayerTag

#: Reads a tag's static metadata from the matched equations (in pattern order).
#: May raise ValueError (or return None) to reject a structural match. The key
#: `OUTPUT_PERMUTATION` is not metadata: it says that the matched output is the tag's
#: output transposed by that permutation (the tag then wraps the value in its own layout).
ParametersExtractor = Callable[[Sequence[Any]], Mapping[str, Any] | None]

#: See `ParametersExtractor`.
OUTPUT_PERMUTATION = "output_permutation"


@dataclasses.dataclass(frozen=True, eq=False)
class GraphPattern:
    """A layer kind: what its computation looks like in a jaxpr, and which tag it gets.

    Args:
      name: a readable name (appears in the registration report).
      tag_primitive: the `kfacx.tags.LayerTag` to insert around each match.
      compute_func: ``compute_func(*inputs, params)`` computes the layer's
        output from its inputs and a list of parameters; it is traced with
        ``example_args`` and the resulting jaxpr is searched for in models.
      parameters_extractor_func: reads the tag's static metadata (strides,
        contraction axes...) from the matched equations; it may raise
        ValueError or return None to reject a match.
      example_args: ``[*inputs, params]`` example values to trace with. A pattern
        without inputs (``[params]``, one parameter) is a *parameter-only* layer: a
        parameter used as it is, through shape-only operations (reshapes,
        broadcasts, tiles, casts), e.g. a learned query tiled over the batch. It
        matches the end of every such chain from a parameter leaf whose result has
        the batch on its leading axis (a leading size of one of the batch's arrays),
        if no other layer claimed the parameter; ``compute_func`` only documents it
        and its extractor reads the chain's equations.
      precedence: larger numbers are matched first (a pattern that contains
        another, e.g. dense-with-bias vs dense, needs the larger number).
      tag_inputs_func: optional ``f(*inputs) -> tuple`` computing the tag's
        inputs from the matched inputs, when the layer's input is not a value
        of the graph (e.g. normalizations that fold the scale into
        ``rsqrt(var)``: inputs ``(x - mean, rsqrt(var))``, tag input their
        product). Default: the matched inputs themselves.
      tag_inputs_from_params: whether ``tag_inputs_func`` also takes the matched
        parameters, as a last argument (a list): ``f(*inputs, params)`` (e.g. an
        input shared by the slices of a stacked layer, broadcast to their number).
      tag_inputs_from_output: whether ``tag_inputs_func`` also takes the matched
        output, after everything else: ``f(*inputs, [params,] output)`` (e.g. the
        zeros a parameter-only layer adds its parameter to).

    Example::

      pattern = GraphPattern(
          name="dense_with_bias", tag_primitive=kfacx.tags.dense,
          compute_func=lambda x, p: x @ p[0] + p[1],
          parameters_extractor_func=dense_extractor,
          example_args=[np.zeros([11, 13]), [np.zeros([13, 7]), np.zeros([7])]],
          precedence=10)
    """

    name: str
    tag_primitive: LayerTag
    compute_func: Callable[..., Any]
    parameters_extractor_func: ParametersExtractor
    example_args: Sequence[Any]
    precedence: int = 0
    tag_inputs_func: Callable[..., tuple] | None = None
    tag_inputs_from_params: bool = False
    tag_inputs_from_output: bool = False

    def __post_init__(self):
        if not isinstance(self.tag_primitive, LayerTag):
            raise TypeError(
                f"GraphPattern {self.name!r}: tag_primitive must be a kfacx.tags.LayerTag, "
                f"got {self.tag_primitive!r}."
            )
        if not self.example_args or not isinstance(self.example_args[-1], (list, tuple)):
            raise ValueError(
                f"GraphPattern {self.name!r}: example_args must be [*inputs, [params...]], "
                f"got {self.example_args!r}."
            )
        if self.num_inputs == 0 and self.num_params != 1:
            raise ValueError(
                f"GraphPattern {self.name!r}: a pattern without inputs is one parameter used "
                f"through shape-only operations; example_args must be [[param]], got "
                f"{self.num_params} parameters."
            )

    @property
    def num_inputs(self) -> int:
        """Number of layer inputs (the example args before the parameter list)."""
        return len(self.example_args) - 1

    @property
    def num_params(self) -> int:
        """Number of parameters of the layer."""
        return len(self.example_args[-1])

    @functools.cached_property
    def jaxpr(self) -> jex.core.Jaxpr:
        """The traced computation (invars: inputs then parameters; one outvar).

        Raises:
          ValueError: if the computation does not have exactly one output.
        """
        args = jax.tree_util.tree_map(np.asarray, list(self.example_args))
        try:
            with jax.numpy_rank_promotion("allow"):
                closed = jax.make_jaxpr(self.compute_func)(*args)
        except Exception as e:  # noqa: BLE001 - any tracing failure is the user's pattern
            raise ValueError(
                f"GraphPattern {self.name!r}: compute_func fails on its example_args "
                f"({type(e).__name__}: {e}). Check that example_args are [*inputs, [params...]] "
                "with shapes the computation accepts."
            ) from e
        if len(closed.jaxpr.outvars) != 1:
            raise ValueError(
                f"GraphPattern {self.name!r}: compute_func must return one array, "
                f"got {len(closed.jaxpr.outvars)}."
            )
        return closed.jaxpr

    @functools.cached_property
    def output_primitive(self) -> str | None:
        """The name of the primitive that computes the output (None for a pattern
        without inputs: any shape-only operation ends its chain)."""
        if not self.num_inputs:
            return None
        out = self.jaxpr.outvars[0]
        return next((e.primitive.name for e in self.jaxpr.eqns if out in e.outvars), None)

    def tag_inputs(self, inputs: Sequence[Any], params: Sequence[Any] = (), output=None) -> tuple:
        """The tag's inputs computed from the matched pattern inputs (and parameters, and
        output: see ``tag_inputs_from_params`` and ``tag_inputs_from_output``)."""
        if self.tag_inputs_func is None:
            return tuple(inputs)
        args = list(inputs)
        if self.tag_inputs_from_params:
            args.append(list(params))
        if self.tag_inputs_from_output:
            args.append(output)
        return tuple(self.tag_inputs_func(*args))

    def __repr__(self) -> str:
        return f"GraphPattern({self.name!r}, tag={self.tag_primitive.name!r})"
