"""What every part of `kfacx.linalg` shares: symmetrising, adding to the diagonal,
the checks of stacks of matrices, and the dtypes computations run in."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def symmetrize(m: jax.Array) -> jax.Array:
    """``(m + m^T) / 2`` over the last two axes."""
    return (m + jnp.swapaxes(m, -1, -2)) / 2


def add_to_diagonal(m: jax.Array, value: jax.Array) -> jax.Array:
    """``m + value * I``; ``value`` broadcasts over the leading (stack) axes."""
    eye = jnp.broadcast_to(jnp.eye(m.shape[-1], dtype=m.dtype), m.shape)
    value = jnp.broadcast_to(jnp.asarray(value, m.dtype)[..., None, None], m.shape)
    return m + value * eye


def one_at_a_time_on_cpu(decompose: Callable[[jax.Array], Any], m: jax.Array) -> Any:
    """``decompose(m)`` of a stack ``[..., n, n]`` (a LAPACK call: a factorisation, an
    eigendecomposition, triangular solves), on the CPU one matrix after the other.

    jaxlib's batched LAPACK calls on the CPU split their matrices over XLA's intra-op
    thread pool and block a thread of that pool until the pieces are done; when every
    thread is blocked so (two such calls at once on two cores: e.g. the eigenbases of
    two stacked layers' EKFAC blocks, refreshed side by side), the pieces never run and
    the program hangs (``benchmarks/cpu_lapack_hang.py``). A single matrix is decomposed
    inline, so a loop over the stack (`jax.lax.map`, compiled once) never blocks. Other
    backends get the batched call. The choice is made when the program is lowered
    (`jax.lax.platform_dependent`).
    """
    lead = m.shape[:-2]
    if math.prod(lead) <= 1:
        return decompose(m)

    def looped(m):
        out = jax.lax.map(decompose, m.reshape((-1, *m.shape[-2:])))
        return jax.tree.map(lambda x: x.reshape(lead + x.shape[1:]), out)

    return jax.lax.platform_dependent(m, cpu=looped, default=decompose)


def _check_stacks(matrices: Sequence[jax.Array], where: str, size: int | None = None) -> None:
    """Raises a ValueError naming ``where`` unless ``matrices`` are stacks of square
    matrices (no larger than ``size``)."""
    for i, m in enumerate(matrices):
        shape = tuple(np.shape(m))
        if len(shape) < 2 or shape[-1] != shape[-2]:
            raise ValueError(
                f"{where}: matrices[{i}] has shape {shape}; expected a stack of square "
                "matrices [..., n, n]."
            )
        if size is not None and shape[-1] > size:
            raise ValueError(
                f"{where}: matrices[{i}] is {shape[-1]} x {shape[-1]}, larger than the "
                f"padded size {size}; pass size >= {shape[-1]} (see size_buckets)."
            )


def _check_dampings(matrices: Sequence[jax.Array], dampings: Sequence[Any], where: str) -> None:
    if len(dampings) != len(matrices):
        raise ValueError(
            f"{where}: got {len(dampings)} dampings for {len(matrices)} matrices; pass one "
            "damping (broadcastable to its stack shape) per stack of matrices."
        )


def _working_dtype(dtype: Any) -> Any:
    return jnp.promote_types(dtype, jnp.float32)


def _retry_dtype(dtype: Any) -> Any:
    """float64 when ``jax_enable_x64`` is on and ``dtype`` is narrower, else ``dtype``."""
    if jax.config.jax_enable_x64 and jnp.finfo(dtype).bits < 64:
        return jnp.float64
    return dtype
