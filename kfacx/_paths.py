"""Parameter pytrees: readable paths for messages and reports, dtype checks, and where the
parameter leaves sit among the flat leaves of a function's arguments."""

from __future__ import annotations

from collections.abc import Sequence
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
    """Origin labels (`kfacx._jaxpr`) of the flat leaves of ``func_args``: the index of
    the parameter leaf, None for the other arguments' leaves."""
    start, stop = param_leaf_range(func_args, params_index)
    return [i - start if start <= i < stop else None for i in range(num_leaves)]
