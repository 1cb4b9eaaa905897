"""Parameter pytrees: readable paths for messages and reports, dtype checks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

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
