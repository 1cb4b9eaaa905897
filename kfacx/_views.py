"""Parameter views: a layer's parameter built from parameter leaves by concatenation.

A fused-gate LSTM multiplies once by ``concatenate([w_i, w_f, w_g, w_o], -1)``: one
dense layer whose weight is not a leaf of the parameters but a *view* of four leaves.
Its layer tag takes the leaves as parameter operands and carries, under the metadata
key `VIEWS`, one *view expression* per parameter of the layer (``(w, b)`` for a dense
layer) that builds it from the operands. An expression is a nested tuple (static,
hashable, as tag metadata must be):

* ``("leaf", i)``: the tag's ``i``-th parameter operand;
* ``("reshape", shape, e)``: ``e`` reshaped row-major (same size);
* ``("slice", starts, limits, e)``: ``e[starts:limits]`` along every axis;
* ``("concat", axis, (e, ...))``: the concatenation along ``axis``.

The layer's block is built for the parameters the expressions give (`effective`), and
carried to the leaves by the view's gather (`effective`) and its transpose (`scatter`);
see `kfacx.blocks.ViewBlock`. Nothing here imports the rest of kfacx.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

#: The tag metadata key that holds a layer's view expressions (one per parameter).
VIEWS = "param_views"

Expr = tuple


def views_of(meta: Mapping[str, Any]) -> tuple[Expr, ...] | None:
    """The view expressions in a tag's metadata, or None."""
    return meta.get(VIEWS)


def without_views(meta: Mapping[str, Any]) -> dict[str, Any]:
    """The metadata without the view expressions (the metadata of the effective layer)."""
    return {k: v for k, v in meta.items() if k != VIEWS}


def evaluate(expr: Expr, operands: Sequence[Any], xp: Any = jnp) -> Any:
    """The array ``expr`` builds from ``operands`` (``xp``: `jax.numpy` or `numpy`)."""
    kind = expr[0]
    if kind == "leaf":
        return operands[expr[1]]
    if kind == "reshape":
        return xp.reshape(evaluate(expr[2], operands, xp), expr[1])
    if kind == "slice":
        index = tuple(slice(s, e) for s, e in zip(expr[1], expr[2], strict=True))
        return evaluate(expr[3], operands, xp)[index]
    if kind == "concat":
        return xp.concatenate([evaluate(e, operands, xp) for e in expr[2]], axis=expr[1])
    raise ValueError(f"Unknown parameter view expression {expr!r}.")


def effective(operands: Sequence[Any], views: Sequence[Expr], xp: Any = jnp) -> tuple:
    """The layer's parameters, each built from the tag's operands by its expression."""
    return tuple(evaluate(e, operands, xp) for e in views)


def scatter(parameters: Sequence[Any], views: Sequence[Expr], like: Sequence[Any]) -> tuple:
    """The transpose of `effective`: arrays shaped like the layer's parameters back onto
    the operands (``like``: arrays or shape-dtype structs of the operands), each entry
    added to the operand entry it was read from."""
    specs = [jax.ShapeDtypeStruct(jnp.shape(o), jnp.result_type(o)) for o in like]
    parameters = tuple(
        jnp.asarray(p, jnp.result_type(*_leaf_dtypes(e, specs)))
        for p, e in zip(parameters, views, strict=True)
    )
    transpose = jax.linear_transpose(lambda *ops: effective(ops, views), *specs)
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
    return expr[0] == "reshape" and is_sliced(expr[2])


def is_permutation(views: Sequence[Expr], num_operands: int) -> bool:
    """Whether the views read every entry of every operand exactly once (each operand
    whole, in one place): the layer's parameters are then a rearrangement of the
    operands, and `scatter` inverts `effective`."""
    used = [i for e in views for i in leaves(e)]
    return sorted(used) == list(range(num_operands)) and not any(map(is_sliced, views))


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
    return np.concatenate([np.ravel(a) for a in effective(index, views, np)])


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
    return f"concat[{expr[1]}]({', '.join(describe(e, names) for e in expr[2])})"
