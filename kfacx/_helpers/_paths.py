"""Parameter pytrees: readable paths for messages and reports, dtype checks, where the
parameter leaves sit among the flat leaves of a function's arguments, and structures
compared without their boxes (NNX's ``nnx.Param`` around an array)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp


def path_to_str(path: Sequence[Any]) -> str:
    """Formats a pytree key path as ``"mlp/~/linear_0/w"``."""
    parts = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
        else:
            parts.append(str(key))
    return "/".join(parts)


def check_float_params(paths: Sequence[str], leaves: Sequence[Any]) -> None:
    """Rejects parameters that are not floating-point arrays.

    Raises:
      TypeError: naming the first such parameter.
    """
    for path, leaf in zip(paths, leaves, strict=True):
        dtype = jnp.result_type(leaf)
        if not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(
                f"Parameter {path!r} has dtype {dtype}; K-FAC preconditions floating-point "
                "parameters only. Keep integer or boolean values (step counters, masks) out of "
                "the parameters, e.g. in Haiku state or the batch."
            )


def checked_param_paths(params: Any) -> tuple[str, ...]:
    """The path of every leaf of ``params`` (`path_to_str`), after `check_float_params`.

    Raises:
      TypeError: for a leaf that is not a floating-point array.
    """
    path_leaves, _ = jax.tree_util.tree_flatten_with_path(params)
    paths = tuple(path_to_str(p) for p, _ in path_leaves)
    check_float_params(paths, [leaf for _, leaf in path_leaves])
    return paths


def param_leaf_range(func_args: Sequence[Any], params_index: int) -> tuple[int, int]:
    """``(start, stop)``: the parameters' leaves among the flat leaves of ``func_args``."""
    before = sum(len(jax.tree_util.tree_leaves(a)) for a in func_args[:params_index])
    return before, before + len(jax.tree_util.tree_leaves(func_args[params_index]))


def param_origins(func_args: Sequence[Any], params_index: int, num_leaves: int) -> list:
    """Origin labels (`kfacx._helpers._jaxpr`) of the flat leaves of ``func_args``: the index of
    the parameter leaf, None for the other arguments' leaves."""
    start, stop = param_leaf_range(func_args, params_index)
    return [i - start if start <= i < stop else None for i in range(num_leaves)]


def check_params_structure(tree: jax.tree_util.PyTreeDef, params_tree: Any) -> None:
    """Accepts a vector's structure ``tree`` if it is the parameters' ``params_tree``
    with or without boxes (`unboxed_structure`): Flax's ``nnx.Optimizer`` hands
    ``tx.update`` plain arrays for ``nnx.Param``-boxed parameters, and the reverse.

    Raises:
      ValueError: if the structures differ otherwise.
    """
    if tree == params_tree or unboxed_structure(tree) == unboxed_structure(params_tree):
        return
    raise ValueError(
        f"The vector's pytree structure {tree} does not match the parameters' "
        f"{params_tree} (boxes such as nnx.Param aside). Pass a pytree with the structure "
        "of the parameters the estimator was set up with."
    )


def unboxed_structure(treedef: jax.tree_util.PyTreeDef) -> Any:
    """``treedef`` as nested ``(node type, node data, children)`` tuples in which a box,
    a custom node (not a dict, list, tuple or None) holding one leaf, is that leaf: NNX's
    ``nnx.Param(array)`` (any `nnx.Variable`) and linen's ``nn.Partitioned`` count as
    the array. A box adds no leaf, so both structures flatten to the same leaves."""
    if treedef.num_nodes == 1 and treedef.num_leaves == 1:
        return "*"
    node_type, data = treedef.node_data()
    children = jax.tree_util.treedef_children(treedef)
    one_leaf = len(children) == 1 and children[0].num_nodes == children[0].num_leaves == 1
    if one_leaf and not issubclass(node_type, (dict, list, tuple, type(None))):
        return "*"
    return (node_type, data, tuple(unboxed_structure(c) for c in children))


def unbox(tree: Any, is_leaf: Callable[[Any], bool] | None = None) -> Any:
    """``tree`` with every box (see `unboxed_structure`; ``is_leaf`` as in
    `jax.tree_util.tree_map`) replaced by the leaf it holds."""

    def is_box(x: Any) -> bool:
        if is_leaf is not None and is_leaf(x):
            return False
        treedef = jax.tree_util.tree_structure(x, is_leaf=is_leaf)
        return treedef.num_nodes == 2 and unboxed_structure(treedef) == "*"

    def stop(x: Any) -> bool:
        return is_box(x) or (is_leaf is not None and is_leaf(x))

    def open_box(x: Any) -> Any:
        return jax.tree_util.tree_leaves(x, is_leaf=is_leaf)[0] if is_box(x) else x

    return jax.tree_util.tree_map(open_box, tree, is_leaf=stop)
