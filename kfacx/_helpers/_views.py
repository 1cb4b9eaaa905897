"""Parameter views: a layer's parameter built from parameter leaves by concatenation,
slicing and elementwise maps.

A fused-gate LSTM multiplies once by ``concatenate([w_i, w_f, w_g, w_o], -1)``: one
dense layer whose weight is not a leaf of the parameters but a *view* of four leaves;
``hk.GRU`` splits one leaf ``w_h`` into column slices used by two dense layers, each
a view of part of it.
Its layer tag takes the leaves as parameter operands and carries, under the metadata
key `VIEWS`, one *view expression* per parameter of the layer (``(w, b)`` for a dense
layer) that builds it from the operands. An expression is a nested tuple (static,
hashable, as tag metadata must be):

* ``("leaf", i)``: the tag's ``i``-th parameter operand;
* ``("reshape", shape, e)``: ``e`` reshaped row-major (same size);
* ``("slice", starts, limits, e)``: ``e[starts:limits]`` along every axis;
* ``("concat", axis, (e, ...))``: the concatenation along ``axis``;
* ``("map", name, args, e)``: an elementwise map of ``e`` with constant ``args``
  (`kfacx._helpers._elementwise`: ``c * softplus(s)``, ``exp(log_scale)``, ``w * mask``).

The layer's block is built for the parameters the expressions give (`effective`), and
carried to the leaves by the view's gather (`gather`: the expressions without their
maps) and its transpose (`scatter`); see `kfacx.blocks.ViewBlock` and
`kfacx.blocks.SlicedBlock`. A view with maps is ``w = f(P theta)`` for that gather ``P``
and an elementwise ``f``: its Jacobian ``diag(f') P`` is carried by
`kfacx.blocks.MappedBlock`. Which entries of the leaves a view reads is a list of
*boxes* (`read_boxes`), which tells whether layers reading slices of one leaf read
disjoint parts of it and together all of it. Nothing here imports the rest of kfacx
but `kfacx._helpers._elementwise`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kfacx._helpers import _elementwise

#: The tag metadata key that holds a layer's view expressions (one per parameter).
VIEWS = "param_views"

Expr = tuple


def views_of(meta: Mapping[str, Any]) -> tuple[Expr, ...] | None:
    """The view expressions in a tag's metadata, or None."""
    return meta.get(VIEWS)


def without_views(meta: Mapping[str, Any]) -> dict[str, Any]:
    """The metadata without the view expressions (the metadata of the effective layer)."""
    return {k: v for k, v in meta.items() if k != VIEWS}


def evaluate(expr: Expr, operands: Sequence[Any], xp: Any = jnp, maps: bool = True) -> Any:
    """The array ``expr`` builds from ``operands`` (``xp``: `jax.numpy` or `numpy`; without
    ``maps``, its elementwise maps are left out: the gather of leaf entries it reads)."""
    kind = expr[0]
    if kind == "leaf":
        return operands[expr[1]]
    if kind == "reshape":
        return xp.reshape(evaluate(expr[2], operands, xp, maps), expr[1])
    if kind == "slice":
        index = tuple(slice(s, e) for s, e in zip(expr[1], expr[2], strict=True))
        return evaluate(expr[3], operands, xp, maps)[index]
    if kind == "concat":
        parts = [evaluate(e, operands, xp, maps) for e in expr[2]]
        return xp.concatenate(parts, axis=expr[1])
    if kind == "map":
        inner = evaluate(expr[3], operands, xp, maps)
        return _elementwise.apply(expr[1], expr[2], inner) if maps else inner
    raise ValueError(f"Unknown parameter view expression {expr!r}.")


def effective(operands: Sequence[Any], views: Sequence[Expr], xp: Any = jnp) -> tuple:
    """The layer's parameters, each built from the tag's operands by its expression."""
    return tuple(evaluate(e, operands, xp) for e in views)


def gather(operands: Sequence[Any], views: Sequence[Expr], xp: Any = jnp) -> tuple:
    """`effective` without the elementwise maps: the leaf entries each parameter entry
    reads (linear; the views' Jacobian is ``diag(f') P`` of this gather ``P``)."""
    return tuple(evaluate(e, operands, xp, maps=False) for e in views)


def has_maps(views: Sequence[Expr]) -> bool:
    """Whether any expression holds an elementwise map."""
    return any(map_labels(views))


def map_labels(views: Sequence[Expr]) -> list[str]:
    """The report's words for the views' elementwise maps (`kfacx._helpers._elementwise.label`), in
    the order they are applied (``c * softplus(s)``: softplus, scaled), without repeats."""
    out: list[str] = []

    def visit(expr: Expr) -> None:
        if expr[0] == "concat":
            for e in expr[2]:
                visit(e)
        elif expr[0] != "leaf":
            visit(expr[-1])
        if expr[0] == "map":
            out.append(_elementwise.label(expr[1], expr[2]))

    for e in views:
        visit(e)
    return list(dict.fromkeys(out))


def scatter(parameters: Sequence[Any], views: Sequence[Expr], like: Sequence[Any]) -> tuple:
    """The transpose of `gather`: arrays shaped like the layer's parameters back onto
    the operands (``like``: arrays or shape-dtype structs of the operands), each entry
    added to the operand entry it was read from."""
    specs = [jax.ShapeDtypeStruct(jnp.shape(o), jnp.result_type(o)) for o in like]
    parameters = tuple(
        jnp.asarray(p, jnp.result_type(*_leaf_dtypes(e, specs)))
        for p, e in zip(parameters, views, strict=True)
    )
    transpose = jax.linear_transpose(lambda *ops: gather(ops, views), *specs)
    return tuple(transpose(parameters))


def _leaf_dtypes(expr: Expr, specs: Sequence[Any]) -> list[Any]:
    return [specs[i].dtype for i in leaves(expr)]


def shape(expr: Expr, operand_shapes: Sequence[Sequence[int]]) -> tuple[int, ...]:
    """The shape of the array ``expr`` builds from operands of ``operand_shapes``."""
    kind = expr[0]
    if kind == "leaf":
        return tuple(operand_shapes[expr[1]])
    if kind == "reshape":
        return tuple(expr[1])
    if kind == "slice":
        return tuple(e - s for s, e in zip(expr[1], expr[2], strict=True))
    if kind == "map":
        return shape(expr[3], operand_shapes)
    parts = [shape(e, operand_shapes) for e in expr[2]]
    axis = expr[1]
    return (*parts[0][:axis], sum(p[axis] for p in parts), *parts[0][axis + 1 :])


def leaves(expr: Expr) -> list[int]:
    """The operand positions ``expr`` reads, in order (with repeats)."""
    if expr[0] == "leaf":
        return [expr[1]]
    if expr[0] == "concat":
        return [i for e in expr[2] for i in leaves(e)]
    return leaves(expr[-1])


def is_sliced(expr: Expr) -> bool:
    """Whether ``expr`` reads part of an operand only (it holds a ``"slice"``)."""
    if expr[0] == "slice":
        return True
    if expr[0] == "concat":
        return any(is_sliced(e) for e in expr[2])
    return expr[0] in ("reshape", "map") and is_sliced(expr[-1])


def is_permutation(views: Sequence[Expr], operand_shapes: Sequence[Sequence[int]]) -> bool:
    """Whether the views read every entry of every operand exactly once (whole operands,
    or slices of them that do not overlap and leave nothing out): the layer's parameters
    are then a rearrangement of the operands, and `scatter` inverts `effective`."""
    boxes = all_boxes(views)
    return (
        boxes is not None
        and disjoint(boxes)
        and all(covers(boxes, i, s) for i, s in enumerate(operand_shapes))
    )


def positions(views: Sequence[Expr], operand_shapes: Sequence[Sequence[int]]) -> np.ndarray:
    """For every entry of the layer's parameters (flattened row-major and concatenated, in
    order), the position of the operand entry it reads among the operands flattened and
    concatenated the same way."""
    sizes = [math.prod(s) for s in operand_shapes]
    offsets = np.cumsum([0, *sizes])
    index = [
        np.arange(o, o + n).reshape(s)
        for o, n, s in zip(offsets, sizes, operand_shapes, strict=False)
    ]
    return np.concatenate([np.ravel(a) for a in gather(index, views, np)])


def describe(expr: Expr, names: Sequence[str]) -> str:
    """A readable form of ``expr`` over operands called ``names``, e.g.
    ``"concat[1](w_i, w_f)"``."""
    kind = expr[0]
    if kind == "leaf":
        return names[expr[1]]
    if kind == "reshape":
        return describe(expr[2], names)
    if kind == "slice":
        cut = ", ".join(f"{s}:{e}" for s, e in zip(expr[1], expr[2], strict=True))
        return f"{describe(expr[3], names)}[{cut}]"
    if kind == "map":
        return _elementwise.describe(expr[1], expr[2], describe(expr[3], names))
    return f"concat[{expr[1]}]({', '.join(describe(e, names) for e in expr[2])})"


#: A box of operand entries: ``(operand, starts, limits)``; ``starts`` and ``limits`` are
#: None for the whole operand.
Box = tuple


def read_boxes(expr: Expr) -> list[Box] | None:
    """The boxes of operand entries ``expr`` reads, one per piece; None when a slice is
    taken of something else than an operand (a reshaped or concatenated one)."""
    kind = expr[0]
    if kind == "leaf":
        return [(expr[1], None, None)]
    if kind in ("reshape", "map"):
        return read_boxes(expr[-1])
    if kind == "slice":
        inner = _without_maps(expr[3])
        return [(inner[1], tuple(expr[1]), tuple(expr[2]))] if inner[0] == "leaf" else None
    parts = [read_boxes(e) for e in expr[2]]
    return None if any(p is None for p in parts) else [b for p in parts for b in p]


def _without_maps(expr: Expr) -> Expr:
    while expr[0] == "map":
        expr = expr[3]
    return expr


def all_boxes(views: Sequence[Expr]) -> list[Box] | None:
    """The boxes all ``views`` read (`read_boxes`), or None."""
    parts = [read_boxes(e) for e in views]
    return None if any(p is None for p in parts) else [b for p in parts for b in p]


def overlap(a: Box, b: Box) -> bool:
    """Whether two boxes share an entry."""
    if a[0] != b[0]:
        return False
    if a[1] is None or b[1] is None:
        return True
    return all(max(s, t) < min(e, f) for s, e, t, f in zip(a[1], a[2], b[1], b[2], strict=True))


def disjoint(boxes: Sequence[Box]) -> bool:
    """Whether no two of ``boxes`` share an entry."""
    return not any(overlap(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1 :])


def covers(boxes: Sequence[Box], operand: Any, operand_shape: Sequence[int]) -> bool:
    """Whether disjoint ``boxes`` read every entry of ``operand`` (of ``operand_shape``)."""
    size = 0
    for b in boxes:
        if b[0] != operand:
            continue
        if b[1] is None:
            return True
        size += math.prod(e - s for s, e in zip(b[1], b[2], strict=True))
    return size == math.prod(operand_shape)


def renumber_boxes(boxes: Sequence[Box], operands: Sequence[Any]) -> list[Box]:
    """``boxes`` with operand positions replaced by ``operands[position]``."""
    return [(operands[b[0]], *b[1:]) for b in boxes]
