"""Pattern parameters seen through views: a layer's weight concatenated from leaves.

A fused-gate recurrent cell multiplies by ``concatenate([w_i, w_f, w_g, w_o], -1)``
(Flax's ``OptimizedLSTMCell``), or by ``concatenate([w_x, w_h], 0)`` on
``concatenate([x, h])``. The matcher binds a pattern parameter to such a
concatenation of parameter leaves (`resolve`: each piece a leaf seen through
shape-only operations, or a nested concatenation) as a `View`; the match then takes
the leaves as its parameters and records, under `kfacx._views.VIEWS` in the tag's
metadata, the expressions that build the layer's parameters from them (`flatten`).
The layer's block is `kfacx.blocks.ViewBlock`, served as the layer written with one
fused weight.

Served: views that read every entry of their leaves exactly once (each leaf whole, in
one place). A concatenation that mixes parameters with other values, and is used as a
weight, is reported in a note (`mixed_concatenation_notes`); its leaves get the
fallback block.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax.extend as jex

from kfacx import _jaxpr, _views
from kfacx.graph_matcher._verify import SHAPE_ONLY

#: The note of a concatenation that mixes parameters with other values (its leaves are
#: dropped from it when a layer serves them elsewhere, see `unserved_leaves`).
MIXED_NOTE = (
    "parameters are concatenated with values that are not parameters before a matrix "
    "product or convolution; kfacx serves a layer whose weight is concatenated from "
    "parameters only, so these get the fallback block"
)

#: Primitives a concatenated weight is an operand of.
_WEIGHT_USERS = ("dot_general", "conv_general_dilated")


@dataclasses.dataclass(eq=False)
class View:
    """A pattern parameter bound to a concatenation of parameter leaves.

    Attributes:
      leaves: the leaf variables, in order of first use.
      expr: the `kfacx._views` expression building ``out`` from ``leaves``.
      eqns: the equations from the leaves to ``out``.
      out: the concatenation's variable.
    """

    leaves: list[Any]
    expr: tuple
    eqns: list[Any]
    out: Any


def _down(graph, var) -> tuple[Any, list[Any]] | None:
    """Follows shape-only producers from ``var`` down to a parameter leaf or to the first
    other producer: ``(var there, chain)``; None at a literal."""
    chain = []
    while graph.origin.get(var) is None:
        eqn = graph.producer.get(var)
        if eqn is None or eqn.primitive.name not in SHAPE_ONLY:
            break
        chain.append(eqn)
        var = eqn.invars[0]
        if isinstance(var, jex.core.Literal):
            return None
    return var, chain


def _size_preserving(chain: Sequence[Any]) -> bool:
    return all(
        math.prod(e.invars[0].aval.shape) == math.prod(e.outvars[0].aval.shape) for e in chain
    )


def resolve(graph, var) -> Any:
    """What ``var`` is as a parameter: the parameter leaf it is a shape-only function of
    (its variable), a `View` of leaves it is a shape-only function of, or None."""
    found = _down(graph, var)
    if found is None:
        return None
    end, _ = found
    if graph.origin.get(end) is not None:
        return end
    leaves: list[Any] = []
    eqns: list[Any] = []
    expr = _concatenation(graph, end, leaves, eqns)
    return None if expr is None else View(leaves, expr, eqns, end)


def _concatenation(graph, var, leaves: list, eqns: list) -> tuple | None:
    """The expression of a concatenation of leaves (nested ones too) computing ``var``,
    collecting its leaves and equations; None if ``var`` is not one."""
    eqn = graph.producer.get(var)
    if eqn is None or eqn.primitive.name != "concatenate":
        return None
    pieces = []
    for operand in eqn.invars:
        piece = _piece(graph, operand, leaves, eqns)
        if piece is None:
            return None
        pieces.append(piece)
    eqns.append(eqn)
    return ("concat", int(eqn.params["dimension"]), tuple(pieces))


def _piece(graph, operand, leaves: list, eqns: list) -> tuple | None:
    if isinstance(operand, jex.core.Literal):
        return None
    found = _down(graph, operand)
    if found is None or not _size_preserving(found[1]):
        return None
    end, chain = found
    if graph.origin.get(end) is not None:
        if not any(v is end for v in leaves):
            leaves.append(end)
        expr = ("leaf", next(i for i, v in enumerate(leaves) if v is end))
    else:
        expr = _concatenation(graph, end, leaves, eqns)
        if expr is None:
            return None
    eqns.extend(chain)
    shape = tuple(operand.aval.shape)
    return expr if tuple(end.aval.shape) == shape else ("reshape", shape, expr)


def same_source(a: Any, b: Any) -> bool:
    """Whether two `resolve` results are the same parameter (leaf or concatenation)."""
    if isinstance(a, View) and isinstance(b, View):
        return a.out is b.out
    return a is b


def flatten(params: Sequence[Any]) -> tuple[list[Any], tuple, list[Any]] | None:
    """For a match whose parameters hold `View`s: ``(leaf variables, one view expression per
    parameter over positions among them, the views' equations)``; None without views."""
    if not any(isinstance(p, View) for p in params):
        return None
    operands: list[Any] = []
    exprs, eqns = [], []
    for p in params:
        if isinstance(p, View):
            index = [_position(operands, v) for v in p.leaves]
            exprs.append(_renumber(p.expr, index))
            eqns.extend(p.eqns)
        else:
            exprs.append(("leaf", _position(operands, p)))
    return operands, tuple(exprs), eqns


def _position(operands: list, var) -> int:
    for i, v in enumerate(operands):
        if v is var:
            return i
    operands.append(var)
    return len(operands) - 1


def _renumber(expr: tuple, index: Sequence[int]) -> tuple:
    kind = expr[0]
    if kind == "leaf":
        return ("leaf", index[expr[1]])
    if kind == "concat":
        return ("concat", expr[1], tuple(_renumber(e, index) for e in expr[2]))
    return (*expr[:-1], _renumber(expr[-1], index))


def servable(pattern, meta: dict, exprs: tuple, num_operands: int) -> bool:
    """Whether kfacx serves a match with these views (`kfacx.blocks.ViewBlock`): every
    leaf read whole, once; not a stacked layer (batch dimensions over the weight, or a
    tag input computed from the parameters)."""
    (_, _), batch = meta.get("dimension_numbers", ((), ((), ())))
    stacked = bool(batch[0] or batch[1]) or pattern.tag_inputs_from_params
    return not stacked and _views.is_permutation(exprs, num_operands)


def source_name(pattern_name: str, meta: dict) -> str:
    """The report's "found by" of a match: the pattern's name, marked ``(concatenated)``
    when its parameters are views."""
    return f"{pattern_name} (concatenated)" if _views.VIEWS in meta else pattern_name


def mixed_concatenation_notes(graph, notes: list) -> None:
    """Appends `MIXED_NOTE` with its leaves for every concatenation of parameters with
    other values whose result is used as a weight (``dot_general``, convolution)."""
    for eqn in graph.jaxpr.eqns:
        if eqn.primitive.name != "concatenate" or not _used_as_weight(graph, eqn.outvars[0]):
            continue
        found = [None if isinstance(v, jex.core.Literal) else _down(graph, v) for v in eqn.invars]
        ends = [f[0] if f else None for f in found]
        leaves = [
            graph.origin[e] for e in ends if e is not None and graph.origin.get(e) is not None
        ]
        if leaves and resolve(graph, eqn.outvars[0]) is None:
            notes.append((MIXED_NOTE, tuple(_jaxpr.leaf_origin(o) for o in leaves)))


def _used_as_weight(graph, var) -> bool:
    frontier = [var]
    while frontier:
        v = frontier.pop()
        for user in graph.users.get(v, []):
            if user.primitive.name in _WEIGHT_USERS:
                return True
            if user.primitive.name in SHAPE_ONLY:
                frontier.extend(user.outvars)
    return False


def unserved_leaves(notes: list, served: set) -> list:
    """``notes`` with the leaves of `MIXED_NOTE` notes that a layer serves anyway dropped
    (and such notes left empty dropped)."""
    out = []
    for text, leaves in notes:
        if text == MIXED_NOTE:
            leaves = tuple(i for i in leaves if i not in served)
            if not leaves:
                continue
        out.append((text, leaves))
    return out
