"""Random keys and batches for the optimizer's loops, per device under ``pmap``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jax


def repeat(batch: Any) -> Iterator[Any]:
    """``batch``, forever (the burn-in's batches when no iterator is given)."""
    while True:
        yield batch


def split_key(rng: jax.Array, multi_device: bool) -> tuple[jax.Array, jax.Array]:
    """Two keys from ``rng`` (one per device each, with a leading device axis
    under ``multi_device``)."""
    if multi_device:
        keys = jax.vmap(jax.random.split)(rng)
        return keys[:, 0], keys[:, 1]
    a, b = jax.random.split(rng)
    return a, b


def fold_in(rng: jax.Array, i: int, multi_device: bool) -> jax.Array:
    """``jax.random.fold_in(rng, i)``, per device under ``multi_device``."""
    if multi_device:
        return jax.vmap(lambda k: jax.random.fold_in(k, i))(rng)
    return jax.random.fold_in(rng, i)
