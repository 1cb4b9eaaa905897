"""Dampings: the floor under which a damped matrix is not numerically positive
definite, the traces of many matrices in one pass, and the pi split of a Kronecker
pair's damping (the rules: `kfacx.linalg`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kfacx.linalg._common import _check_dampings, _check_stacks, _working_dtype

# ----------------------------------------------------------------------------- damping floor


def min_damping(trace: jax.Array, dtype: Any) -> jax.Array:
    """The damping floor of a PSD matrix with trace ``trace``: ``max(eps * trace, sqrt(tiny))``.

    ``eps * trace = n * eps * mean(diag)``; ``eps`` and ``tiny`` are those of
    ``dtype``. A non-finite or negative trace counts as zero.

    Args:
      trace: the trace (a stack of traces) of the matrix (matrices).
      dtype: the dtype the matrix is stored in.

    Returns:
      The floor, of the trace's shape and dtype.

    Example::

      >>> float(min_damping(jnp.float32(64.0), jnp.float32))  # 64 * 1.19e-7
      7.62939453125e-06
    """
    info = jnp.finfo(dtype)
    trace = jnp.asarray(trace)
    trace = jnp.where(jnp.isfinite(trace), jnp.maximum(trace, 0), 0)
    floor = jnp.sqrt(jnp.asarray(info.tiny, trace.dtype))
    return jnp.maximum(jnp.asarray(info.eps, trace.dtype) * trace, floor)


def floor_damping(damping: Any, trace: jax.Array, dtype: Any) -> jax.Array:
    """``max(damping, min_damping(trace, dtype))``: the damping of a PSD matrix (or of a
    stack of them) whose trace is ``trace``, e.g. a Kronecker product (``tr(A) tr(G)``)
    or a diagonal block (the sum of its entries).

    Returns:
      An array of the broadcast shape of ``damping`` and ``trace``, in ``dtype``.
    """
    trace = jnp.asarray(trace, dtype)
    return jnp.maximum(jnp.asarray(damping, dtype), min_damping(trace, dtype))


def floored_damping(m: jax.Array, damping: Any, dtype: Any = None) -> jax.Array:
    """``max(damping, n * eps * mean(|diag(m)|), sqrt(tiny))`` per matrix of the stack.

    Args:
      m: a stack of matrices ``[..., n, n]``.
      damping: a scalar or a ``[...]`` stack of dampings.
      dtype: the dtype whose ``eps`` and ``tiny`` are used (default: ``m``'s).

    Returns:
      The damping to use, shape ``m.shape[:-2]``, dtype of ``m``.
    """
    trace = jnp.sum(jnp.abs(jnp.diagonal(m, axis1=-2, axis2=-1)), axis=-1)
    damping = jnp.broadcast_to(jnp.asarray(damping, m.dtype), m.shape[:-2])
    floor = min_damping(trace, m.dtype if dtype is None else dtype).astype(m.dtype)
    return jnp.maximum(damping, floor)


def diagonal_sums(matrices: Sequence[jax.Array]) -> tuple[list[jax.Array], list[jax.Array]]:
    """``(traces, sums of |diagonal|)`` of several stacks of square matrices in one pass.

    The diagonals are gathered into one padded ``[K, max n]`` array and summed
    together: one small kernel for all, where a trace per matrix would compile
    one (slow, on the CPU) small reduction each.

    Returns:
      Two lists with, per ``matrices[i]`` (``[..., n, n]``), an array of shape
      ``[...]`` in its working dtype (float32 or wider).
    """
    sums = _diagonal_sums_flat(matrices)
    return split_flat(sums[0], matrices), split_flat(sums[1], matrices)


def _diagonal_sums_flat(matrices: Sequence[jax.Array]) -> jax.Array:
    """``[2, K]``: traces and sums of ``|diag|`` of all matrices of all stacks, flattened."""
    if not matrices:
        return jnp.zeros((2, 0), jnp.float32)
    work = _working_dtype(jnp.result_type(*matrices))
    width = max(m.shape[-1] for m in matrices)
    rows = []
    for m in matrices:
        n = m.shape[-1]
        diagonal = _diagonal(m).reshape(-1, n).astype(work)
        rows.append(jnp.pad(diagonal, ((0, 0), (0, width - n))))
    stacked = jnp.concatenate(rows)
    return jnp.sum(jnp.stack([stacked, jnp.abs(stacked)]), axis=-1)


def _diagonal(m: jax.Array) -> jax.Array:
    """The diagonals ``[..., n]`` of a stack ``[..., n, n]``, as a strided slice of the
    flattened matrices (a slice fuses into its consumer; `jnp.diagonal` is a gather with
    an index computation of its own)."""
    n = m.shape[-1]
    return m.reshape((*m.shape[:-2], n * n))[..., :: n + 1]


def split_flat(flat: jax.Array, matrices: Sequence[jax.Array]) -> list[jax.Array]:
    """A ``[K]`` vector over all matrices of all stacks, split into per-stack ``[...]`` arrays
    (each in its stack's working dtype)."""
    out, start = [], 0
    for m in matrices:
        count = math.prod(m.shape[:-2])
        piece = flat[start : start + count].reshape(m.shape[:-2])
        out.append(piece.astype(_working_dtype(m.dtype)))
        start += count
    return out


def floored_damping_vector(
    matrices: Sequence[jax.Array],
    dampings: Callable[[jax.Array], Any] | Sequence[Any],
    sums: jax.Array | None = None,
) -> jax.Array:
    """The floored dampings of all matrices of all stacks as one ``[K]`` vector.

    Like `floored_dampings`, computed in one pass for all. ``dampings`` is a
    sequence (one per stack, broadcastable to its stack shape), or a function
    of the ``[K]`` vector of all the matrices' traces returning a ``[K]``
    vector (or a scalar): e.g. `pi_damping_vector` (`split_flat` splits a flat
    vector into the stacks' shapes). ``sums``: the ``[2, K]`` traces and sums of
    ``|diag|`` of the matrices if already known (e.g. `padded_diagonal_sums`).
    """
    _check_stacks(matrices, "floored_damping_vector")
    if not callable(dampings):
        _check_dampings(matrices, dampings, "floored_damping_vector")
    if not matrices:
        return jnp.zeros((0,), jnp.float32)
    work = _working_dtype(jnp.result_type(*matrices))
    if sums is None:
        sums = _diagonal_sums_flat(matrices)
    count = sum(math.prod(m.shape[:-2]) for m in matrices)
    if sums.shape != (2, count):
        raise ValueError(
            f"floored_damping_vector: sums has shape {sums.shape}; expected (2, {count}) "
            "(traces and sums of |diag| of every matrix)."
        )
    sums = sums.astype(work)
    if callable(dampings):
        flat = jnp.asarray(dampings(sums[0]), work)
        if flat.shape not in ((), sums.shape[1:]):
            raise ValueError(
                f"floored_damping_vector: the dampings function returned shape {flat.shape}; "
                f"it must return one damping per matrix, shape {sums.shape[1:]}, or a scalar."
            )
    else:
        flat = jnp.concatenate(
            [
                jnp.broadcast_to(jnp.asarray(d, work), m.shape[:-2]).reshape(-1)
                for m, d in zip(matrices, dampings, strict=True)
            ]
        )
    # min_damping's floor, with the eps and tiny of each matrix's own dtype.
    eps = np.concatenate(
        [np.full(math.prod(m.shape[:-2]), jnp.finfo(m.dtype).eps) for m in matrices]
    )
    tiny = np.concatenate(
        [np.full(math.prod(m.shape[:-2]), np.sqrt(jnp.finfo(m.dtype).tiny)) for m in matrices]
    )
    trace = jnp.where(jnp.isfinite(sums[1]), jnp.maximum(sums[1], 0), 0)
    floor = jnp.maximum(jnp.asarray(eps, work) * trace, jnp.asarray(tiny, work))
    return jnp.maximum(flat, floor)


def floored_dampings(
    matrices: Sequence[jax.Array],
    dampings: Sequence[Any],
    abs_traces: Sequence[jax.Array] | None = None,
) -> list[jax.Array]:
    """`floored_damping` of several stacks of matrices, computed together.

    Args:
      matrices: stacks ``[..., n_i, n_i]``.
      dampings: for each, a damping broadcastable to its stack shape.
      abs_traces: the sums of ``|diag|`` if known (`diagonal_sums`), else computed.

    Returns:
      Per stack, its floored dampings ``[...]`` in its working dtype.
    """
    _check_stacks(matrices, "floored_dampings")
    _check_dampings(matrices, dampings, "floored_dampings")
    if abs_traces is None:
        abs_traces = diagonal_sums(matrices)[1]
    return [
        floor_damping(jnp.broadcast_to(jnp.asarray(d), m.shape[:-2]), t, m.dtype).astype(t.dtype)
        for m, d, t in zip(matrices, dampings, abs_traces, strict=True)
    ]


def pi_adjusted_damping(
    a: jax.Array, g: jax.Array, damping: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Splits ``damping`` between two Kronecker factors ("pi" damping).

    Returns ``(pi * sqrt(damping), sqrt(damping) / pi)`` with
    ``pi = sqrt((tr(a) / dim(a)) / (tr(g) / dim(g)))`` per stacked pair, so that
    ``(a + d_a I) (x) (g + d_g I)`` approximates ``a (x) g + damping I``. When a
    trace is zero or not finite (dead units, empty statistics) ``pi = 1``. The
    dampings are not floored here: `psd_inverse` and `psd_matpower` floor them.
    """
    return pi_damping_from_traces(
        jnp.trace(a, axis1=-2, axis2=-1),
        jnp.trace(g, axis1=-2, axis2=-1),
        a.shape[-1],
        g.shape[-1],
        damping,
        a.dtype,
    )


class PiDamping(NamedTuple):
    """The dampings of a Kronecker pair of factors ``(a, g)``: ``weight`` split between
    them as `pi_adjusted_damping` splits it. A block's `kfacx.blocks.InverseRefresh`
    can give this instead of the dampings, so that the refresh computes the split for
    all blocks in one vectorised pass (`pi_damping_vector`)."""

    weight: Any


def pi_damping_vector(
    traces: jax.Array, dims: np.ndarray, first: np.ndarray, second: np.ndarray, weight: Any
) -> jax.Array:
    """`pi_damping_from_traces` of many Kronecker pairs at once, over a flat vector.

    Entry ``k`` belongs to the pair ``(first[k], second[k])`` (indices into the
    same vector; ``k`` is one of them) and gets ``pi * sqrt(weight)`` if it is
    the first factor and ``sqrt(weight) / pi`` if it is the second, with
    ``pi = sqrt((traces[first] / dims[first]) / (traces[second] / dims[second]))``
    (1 when a trace is zero or not finite).

    Args:
      traces: ``[K]`` traces of the factors.
      dims: ``[K]`` their sizes (static).
      first, second: ``[K]`` static indices of each entry's pair.
      weight: the damping to split (a scalar or ``[K]``).
    """
    dims = np.asarray(dims)
    norms = traces / jnp.asarray(dims, traces.dtype)
    norm_a, norm_g = norms[np.asarray(first)], norms[np.asarray(second)]
    ok = (norm_a > 0) & (norm_g > 0) & jnp.isfinite(norm_a) & jnp.isfinite(norm_g)
    pi = jnp.sqrt(jnp.where(ok, norm_a / jnp.where(ok, norm_g, 1.0), 1.0))
    root = jnp.sqrt(jnp.asarray(weight, traces.dtype))
    is_first = jnp.asarray(np.asarray(first) == np.arange(len(dims)))
    return jnp.where(is_first, pi * root, root / pi)


def pi_damping_from_traces(
    trace_a: jax.Array, trace_g: jax.Array, dim_a: int, dim_g: int, damping: Any, dtype: Any
) -> tuple[jax.Array, jax.Array]:
    """`pi_adjusted_damping` from the factors' traces and sizes (e.g. from `diagonal_sums`)."""
    norm_a = jnp.asarray(trace_a, dtype) / dim_a
    norm_g = jnp.asarray(trace_g, dtype) / dim_g
    ok = (norm_a > 0) & (norm_g > 0) & jnp.isfinite(norm_a) & jnp.isfinite(norm_g)
    ratio = jnp.where(ok, norm_a / jnp.where(ok, norm_g, 1.0), 1.0)
    pi = jnp.sqrt(ratio)
    root = jnp.sqrt(jnp.asarray(damping, dtype))
    return pi * root, root / pi
