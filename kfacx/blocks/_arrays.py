"""Array helpers of the blocks: parameter vectors flattened and back, the padding mask per
row, and casts back to the parameters' dtype."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Params = tuple[jax.Array, ...]


def cast_to(x: jax.Array, dtype: Any) -> jax.Array:
    """``x`` cast to ``dtype`` (a product cast back to the parameters' dtype).

    Casting to a floating dtype of smaller range (float16: largest value 65504)
    saturates at its largest finite value instead of overflowing to Inf, so that
    a finite product (e.g. ``v / damping`` with a tiny damping) stays finite.
    """
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.floating) and jnp.issubdtype(x.dtype, jnp.floating):
        big = jnp.finfo(dtype).max
        if big < jnp.finfo(x.dtype).max:
            x = jnp.clip(x, -jnp.asarray(big, x.dtype), jnp.asarray(big, x.dtype))
    return x.astype(dtype)


def row_mask(estimation_data: Mapping[str, Any], num_rows: int) -> jax.Array | None:
    """The per-example ``"mask"`` of the estimation data repeated for each of an
    example's ``num_rows // batch`` rows (positions), or None without a mask."""
    mask = estimation_data.get("mask")
    if mask is None:
        return None
    return jnp.repeat(mask, num_rows // mask.shape[0], total_repeat_length=num_rows)


def flatten_params(vector: Sequence[jax.Array]) -> jax.Array:
    """Concatenates arrays flattened row-major (the order of `to_dense_matrix`)."""
    return jnp.concatenate([jnp.ravel(v) for v in vector])


def unflatten_params(flat: jax.Array, shapes: Sequence[Sequence[int]]) -> Params:
    """Inverse of `flatten_params`."""
    sizes = [math.prod(s) for s in shapes]
    splits = np.cumsum(sizes)[:-1].tolist()
    return tuple(p.reshape(s) for p, s in zip(jnp.split(flat, splits), shapes, strict=True))
