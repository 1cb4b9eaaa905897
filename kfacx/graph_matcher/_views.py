"""Pattern parameters seen through views: a layer's weight concatenated from leaves, a
slice of one, or an elementwise map of such.

A fused-gate recurrent cell multiplies by ``concatenate([w_i, w_f, w_g, w_o], -1)``
(Flax's ``OptimizedLSTMCell``), or by ``concatenate([w_x, w_h], 0)`` on
``concatenate([x, h])``; ``hk.GRU`` splits ``w_h`` between two products with
``jnp.split``. The matcher binds a pattern parameter to such a concatenation or slice
of parameter leaves (`resolve`: each piece a leaf seen through shape-only operations,
a ``slice`` / ``split`` of a leaf, or a nested concatenation; any of these through
elementwise maps with constants, `kfacx.graph_matcher._elementwise`: ``c * softplus(s)``,
``w * mask``) as a `View`; the match
then takes the leaves as its parameters and records, under `kfacx._helpers._views.VIEWS` in
the tag's metadata, the expressions that build the layer's parameters from them
(`flatten`).

Served:

* views that read every entry of their leaves exactly once (each leaf whole, in one
  place): `kfacx.blocks.ViewBlock`, the layer written with one fused weight;
* views that read slices of leaves, when the layers reading slices of the same leaves
  read disjoint slices (`can_share_slices`; their claims on a leaf are a
  `SlicedClaim`), form one group (`one_group`) and together read every entry
  (`incomplete_slices`): `kfacx.blocks.SlicedBlock`, a block per slice;
* either with elementwise maps: the layer's block wrapped in a
  `kfacx.blocks.MappedBlock`, carried through the maps' diagonal Jacobian.

Anything else stays on the fallback block with a note: a concatenation that mixes
parameters with other values before a product (`mixed_concatenation_notes`), slices
of which some are no layer's (`PARTIAL_NOTE`), a layer bridging two sliced groups
(`BRIDGE_NOTE`), overlapping slices (the matcher's note on shared parameters).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.extend as jex

from kfacx._helpers import _jaxpr, _views
from kfacx.graph_matcher import _elementwise
from kfacx.graph_matcher._graph import SHAPE_ONLY

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
      expr: the `kfacx._helpers._views` expression building ``out`` from ``leaves``.
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
        if eqn is None or eqn.primitive.name not in SHAPE_ONLY or not eqn.invars:
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
    expr = _view_expr(graph, end, leaves, eqns)
    return None if expr is None else View(leaves, expr, eqns, end)


def _view_expr(graph, var, leaves: list, eqns: list) -> tuple | None:
    """The expression of ``var`` as a concatenation (nested ones too), a slice of leaves or
    an elementwise map of such (`kfacx.graph_matcher._elementwise`), collecting its
    leaves and equations; None if it is none of these."""
    eqn = graph.producer.get(var)
    if eqn is None:
        return None
    step = _elementwise.map_step(graph, eqn)
    if step is not None:
        return _map_expr(graph, eqn, step, leaves, eqns)
    if eqn.primitive.name == "concatenate":
        pieces = [_piece(graph, operand, leaves, eqns) for operand in eqn.invars]
        if any(p is None for p in pieces):
            return None
        eqns.append(eqn)
        return ("concat", int(eqn.params["dimension"]), tuple(pieces))
    box = _slice_box(eqn, var)
    found = None if box is None else _down(graph, eqn.invars[0])
    if found is None or graph.origin.get(found[0]) is None:
        return None
    leaf, chain = found
    if tuple(leaf.aval.shape) != tuple(eqn.invars[0].aval.shape):
        return None  # (a slice of a reshaped leaf is no box of it)
    eqns.extend([*chain, eqn])
    return ("slice", *box, ("leaf", _position(leaves, leaf)))


#: The most equations a view is followed through (a long chain of elementwise maps of
#: activations is no parameter's, and is given up early).
_MAX_VIEW_EQNS = 64


def _map_expr(graph, eqn, step: tuple, leaves: list, eqns: list) -> tuple | None:
    """``("map", name, args, e)`` for a map of parameters (``step``: `map_step`'s), or None."""
    if len(eqns) >= _MAX_VIEW_EQNS:
        return None
    inner = _piece(graph, step[2], leaves, eqns)
    args = None if inner is None else _elementwise.map_args(graph, eqn, step)
    if args is None:
        return None
    eqns.append(eqn)
    return ("map", step[0], args, inner)


def _slice_box(eqn, var) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """``(starts, limits)`` of ``var``, a result of a unit-stride ``slice`` or a ``split``,
    in its operand; None for other equations."""
    name = eqn.primitive.name
    if name not in ("slice", "split"):
        return None  # (iota, a constant, ...: no operand to be a box of)
    shape = eqn.invars[0].aval.shape
    if name == "slice" and not any(s not in (None, 1) for s in eqn.params["strides"] or ()):
        return tuple(eqn.params["start_indices"]), tuple(eqn.params["limit_indices"])
    if name != "split":
        return None
    axis, sizes = int(eqn.params["axis"]), [int(n) for n in eqn.params["sizes"]]
    k = next(i for i, v in enumerate(eqn.outvars) if v is var)
    offset = sum(sizes[:k])
    starts = tuple(offset if a == axis else 0 for a in range(len(shape)))
    limits = tuple(offset + sizes[k] if a == axis else d for a, d in enumerate(shape))
    return starts, limits


def _piece(graph, operand, leaves: list, eqns: list) -> tuple | None:
    if isinstance(operand, jex.core.Literal):
        return None
    found = _down(graph, operand)
    if found is None or not _size_preserving(found[1]):
        return None
    end, chain = found
    if graph.origin.get(end) is not None:
        expr = ("leaf", _position(leaves, end))
    else:
        expr = _view_expr(graph, end, leaves, eqns)
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


def servable(pattern, meta: dict, exprs: tuple, shapes: Sequence, stacked: bool) -> bool:
    """Whether kfacx serves a match with these views: not a stacked layer (batch
    dimensions over the weight, a tag input computed from the parameters, or slices of
    a scan's ``xs`` with slices taken of them), and each leaf read whole, once
    (`kfacx.blocks.ViewBlock`), or in slices read once (`kfacx.blocks.SlicedBlock`,
    if the other slices are other layers': `incomplete_slices`)."""
    batch = _batch_dims(meta)
    if bool(batch[0] or batch[1]) or pattern.tag_inputs_from_params:
        return False
    if not any(map(_views.is_sliced, exprs)):
        return _views.is_permutation(exprs, shapes)
    boxes = _views.all_boxes(exprs)
    return not stacked and boxes is not None and _views.disjoint(boxes)


def _batch_dims(meta: dict) -> tuple:
    """The batch dimensions of a dense layer's contraction; none for a convolution, whose
    ``dimension_numbers`` are a `jax.lax.ConvDimensionNumbers` (lhs, rhs and output
    specs): unpacking those as a contraction would raise an internal ValueError for a
    convolution whose bias is a view (a case the detection fuzzer draws)."""
    dims = meta.get("dimension_numbers")
    if dims is None or isinstance(dims, jax.lax.ConvDimensionNumbers):
        return (), ()
    return dims[1]


def sliced(meta: dict) -> bool:
    """Whether a tag's metadata (or a match's) has views that read slices of leaves."""
    return any(map(_views.is_sliced, _views.views_of(meta) or ()))


def source_name(pattern_name: str, meta: dict) -> str:
    """The report's "found by" of a match: the pattern's name, marked ``(sliced)`` or
    ``(concatenated)`` when its parameters are views, and with their elementwise maps,
    e.g. ``scale (softplus, scaled)``, ``dense (masked)``."""
    views = _views.views_of(meta) or ()
    marks = ["sliced"] if sliced(meta) else []
    if not marks and any(map(_has_concat, views)):
        marks.append("concatenated")
    marks += _views.map_labels(views)
    return f"{pattern_name} ({', '.join(marks)})" if marks else pattern_name


def _has_concat(expr: tuple) -> bool:
    if expr[0] == "concat":
        return True
    return expr[0] != "leaf" and _has_concat(expr[-1])


# ----------------------------------------------------------------------------- slices


def claim_boxes(key: tuple) -> list | None:
    """The boxes of leaf entries a sliced layer reads, from its claim key
    (`kfacx.graph_matcher._claims.claim_key`: tag, leaves, sorted metadata, stacked),
    with leaf indices; None if it reads no slices."""
    meta = dict(key[2])
    if not sliced(meta):
        return None
    return _views.renumber_boxes(_views.all_boxes(meta[_views.VIEWS]), key[1])


def can_share_slices(key: tuple, others: Sequence[tuple]) -> bool:
    """Whether a sliced layer (claim ``key``) reads none of the entries the layers of
    ``others`` (claim keys) read: slices of one leaf used by different layers."""
    mine = claim_boxes(key)
    if mine is None:
        return False
    for other in others:
        theirs = claim_boxes(other)
        if theirs is None or any(_views.overlap(a, b) for a in mine for b in theirs):
            return False
    return True


def claimants(claim: Any) -> tuple:
    """The claim keys of a leaf's claim: one key, or those of a `SlicedClaim`."""
    return claim.keys if isinstance(claim, SlicedClaim) else (claim,)


@dataclasses.dataclass(frozen=True)
class SlicedClaim:
    """The claim on a leaf whose disjoint slices several layers read (their claim keys)."""

    keys: tuple


def claim(claims: dict, leaves: Sequence[int], key: tuple) -> None:
    """Records that a layer (claim ``key``) uses ``leaves``: a leaf whose slices another
    layer reads gets a `SlicedClaim` of both."""
    for leaf in leaves:
        old = claims.get(leaf)
        if old is None or old == key or claim_boxes(key) is None:
            claims[leaf] = key
        elif key not in claimants(old):
            claims[leaf] = SlicedClaim((*claimants(old), key))


#: The note of a layer reading slices of parameters of two separate sliced layers.
BRIDGE_NOTE = (
    "a `{name}` layer reads slices of parameters whose other slices belong to two separate "
    "groups of layers; kfacx serves parameters split between layers when the layers form "
    "one group, so it is not tagged"
)


def one_group(claims: dict, leaves: Sequence[int]) -> bool:
    """Whether the claimed ``leaves`` belong to one group of layers: leaves are grouped
    by the layers (claim keys in ``claims``) that use several of them."""
    parent: dict[int, int] = {}

    def root(i: int) -> int:
        while parent.get(i, i) != i:
            i = parent[i]
        return i

    for value in set(claims.values()):
        for key in claimants(value):
            if len(key) > 1 and isinstance(key[1], tuple):
                for leaf in key[1][1:]:
                    parent[root(leaf)] = root(key[1][0])
    return len({root(leaf) for leaf in leaves if leaf in claims}) <= 1


def incomplete_slices(matches: Sequence[Any], shapes: dict) -> set[int]:
    """The leaves that sliced layers (``matches``) read only in part: some of their entries
    belong to no layer (``shapes``: leaf -> shape)."""
    boxes: dict[int, set] = {}  # (a set: a layer applied twice reads its slices twice)
    for m in matches:
        if sliced(m.meta):
            meta_boxes = _views.all_boxes(m.meta[_views.VIEWS])
            for b in _views.renumber_boxes(meta_boxes, m.param_leaves):
                boxes.setdefault(b[0], set()).add(b)
    return {leaf for leaf, bs in boxes.items() if not _views.covers(list(bs), leaf, shapes[leaf])}


#: The note of a leaf whose slices are not all layers' (`incomplete_slices`).
PARTIAL_NOTE = (
    "parameters are split into slices of which only some are a layer's weight; kfacx "
    "serves a parameter split into slices when every slice belongs to a layer, so these "
    "get the fallback block"
)


# ----------------------------------------------------------------------------- notes


def mixed_concatenation_notes(graph, notes: list) -> None:
    """Appends `MIXED_NOTE` with its leaves for every concatenation of parameters with
    other values whose result is used as a weight (``dot_general``, convolution)."""
    for eqn in graph.jaxpr.eqns:
        if eqn.primitive.name != "concatenate" or not _used_as_weight(graph, eqn.outvars[0]):
            continue
        leaves = [_leaf_below(graph, v) for v in eqn.invars]
        leaves = [leaf for leaf in leaves if leaf is not None]
        if leaves and resolve(graph, eqn.outvars[0]) is None:
            notes.append((MIXED_NOTE, tuple(leaves)))


def _leaf_below(graph, var) -> Any:
    """The parameter leaf ``var`` is a shape-only function of, or None."""
    found = None if isinstance(var, jex.core.Literal) else _down(graph, var)
    origin = None if found is None else graph.origin.get(found[0])
    return None if origin is None else _jaxpr.leaf_origin(origin)


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
