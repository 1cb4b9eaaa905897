"""What matching works on: the model's jaxpr as a graph (`Graph`: producers, users,
parameter origins), one pattern occurrence (`Match`), and the shape-only operations
followed between a parameter leaf and its uses (`SHAPE_ONLY`). The matcher
(`_match`), its numerical check (`_verify`), the claims on parameters (`_claims`) and
the parameter views (`_views`) all read these; this module imports none of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax.extend as jex

from kfacx.graph_matcher import _elementwise
from kfacx.graph_matcher._pattern import GraphPattern

#: Operations that only change an array's shape or dtype: followed from a
#: parameter leaf to its uses (a broadcast bias is still the bias; a tile repeats it,
#: and the numerical check rejects a match whose tag reads it otherwise).
SHAPE_ONLY = {
    "broadcast_in_dim",
    "tile",
    "reshape",
    "convert_element_type",
    "squeeze",
    "expand_dims",
    "copy",
    "copy_p",
}


@dataclasses.dataclass
class Match:
    """One occurrence of a pattern in a jaxpr.

    Attributes:
      pattern: the matched `GraphPattern`.
      eqns: the matched equations (images of the pattern's equations, and the
        elementwise maps of its parameters), in jaxpr order.
      input_vars: the values bound to the pattern's inputs.
      param_vars: the parameter-leaf values bound to the pattern's parameters.
      param_leaves: the parameter-leaf indices of ``param_vars``.
      output_var: the value the tag wraps.
      meta: the tag's static metadata from the extractor.
      stacked: whether the parameters are slices of a scan's ``xs`` (a stacked
        layer, e.g. `hk.layer_stack`) rather than whole parameter leaves.
      output_permutation: None, or the permutation that takes the tag's output
        layout to the matched output's (`kfacx.graph_matcher._pattern.OUTPUT_PERMUTATION`).
      view_eqns: the equations that concatenate parameter leaves into the layer's
        parameters, when they are views (`kfacx.graph_matcher._views`: ``meta`` then
        holds the view expressions, and ``param_vars`` the leaves).
    """

    pattern: GraphPattern
    eqns: list[Any]
    input_vars: list[Any]
    param_vars: list[Any]
    param_leaves: list[int]
    output_var: Any
    meta: dict[str, Any]
    stacked: bool = False
    output_permutation: tuple[int, ...] | None = None
    view_eqns: list[Any] = dataclasses.field(default_factory=list)


class Graph:
    """Producers, users and parameter origins of one (open) jaxpr; its equations by
    primitive name; the leading sizes the batch's arrays have (None: unknown); the match
    that owns each claimed equation (by id); its constants (`_elementwise.Constants`)."""

    def __init__(
        self, jaxpr: jex.core.Jaxpr, origins: Sequence[Any], batch_sizes=None, consts=None
    ):
        self.jaxpr = jaxpr
        self.constants = consts or _elementwise.Constants(jaxpr)
        self.batch_sizes = None if batch_sizes is None else frozenset(batch_sizes)
        self.origin = dict(zip(jaxpr.invars, origins, strict=True))
        self.order = {id(e): i for i, e in enumerate(jaxpr.eqns)}
        self.producer: dict[Any, Any] = {}
        self.users: dict[Any, list[Any]] = {}
        self.by_primitive: dict[str, list[Any]] = {}
        self.owner: dict[int, Match] = {}
        for eqn in jaxpr.eqns:
            self.by_primitive.setdefault(eqn.primitive.name, []).append(eqn)
            for v in eqn.outvars:
                self.producer[v] = eqn
            for v in eqn.invars:
                if not isinstance(v, jex.core.Literal):
                    self.users.setdefault(v, []).append(eqn)
        self.outvars = {v for v in jaxpr.outvars if not isinstance(v, jex.core.Literal)}

    def param_leaf(self, var) -> tuple[Any, list[Any]] | None:
        """Follows shape-only producers back to a parameter leaf: ``(leaf_var, chain)``."""
        chain = []
        while self.origin.get(var) is None:
            eqn = self.producer.get(var)
            if eqn is None or eqn.primitive.name not in SHAPE_ONLY:
                return None
            chain.append(eqn)
            var = eqn.invars[0]
            if isinstance(var, jex.core.Literal):
                return None
        return var, chain

    def candidates(self, pattern: GraphPattern) -> list[Any]:
        """The equations that can compute the pattern's output, in order (the end of a
        shape-only chain for a pattern without inputs)."""
        if pattern.num_inputs:
            return self.by_primitive.get(pattern.output_primitive, [])
        eqns = [e for name in SHAPE_ONLY for e in self.by_primitive.get(name, [])]
        return sorted(eqns, key=lambda e: self.order[id(e)])

    def chain_end(self, var) -> bool:
        """Whether ``var`` is used by something other than a shape-only operation."""
        if var in self.outvars:
            return True
        return any(u.primitive.name not in SHAPE_ONLY for u in self.users.get(var, []))

    def used_as_parameter(self, var, leaf) -> bool:
        """Whether a match reads ``var`` as its parameter ``leaf`` (a broadcast bias)."""
        owners = (self.owner.get(id(u)) for u in self.users.get(var, []))
        return any(m is not None and leaf in m.param_vars for m in owners)
