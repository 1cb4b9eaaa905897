"""Robust linear algebra for symmetric positive semi-definite (PSD) factors.

All functions accept a stack of matrices ``[..., n, n]`` (``damping`` broadcasts
over the stack axes) and return arrays of the input's dtype; they never return
NaN or Inf for a finite, non-negative ``damping``. The rules, shared by every
curvature block (see ``docs/numerics.md``):

- **Symmetry.** The Cholesky path reads the lower triangle of ``m`` (symmetric
  up to rounding); the eigendecomposition paths use ``(m + m^T) / 2``.
- **Damping floor.** The damping actually used for a matrix ``m`` of size ``n``
  is `floored_damping`::

      max(damping, n * eps * mean(|diag(m)|), sqrt(tiny))

  with ``eps`` and ``tiny`` of ``m``'s dtype (float32: ``eps = 1.2e-7``,
  ``sqrt(tiny) = 1.1e-19``). ``n * eps * mean(|diag(m)|) = eps * trace(m)`` is at
  least ``eps`` times the largest eigenvalue, the size of the rounding noise in
  the eigenvalues of ``m``: below it the damped system is not numerically
  positive definite. ``sqrt(tiny)`` keeps ``damping**p`` finite for ``p >= -2``
  when ``m`` is zero. A non-finite diagonal counts as zero.
- **Fallback chain** of `psd_inverse`: a Cholesky factorisation first; for the
  matrices of the stack where its result is not finite, an eigendecomposition
  with eigenvalues clipped at zero (`safe_eigh`), computed in float64 when
  ``jax_enable_x64`` is on and the input is float32 or narrower; if that is not
  finite either (e.g. ``m`` has NaN entries), ``(1 / damping) I``. The fallback
  is a `jax.lax.cond`, so it costs nothing when no matrix needs it (under
  `jax.vmap` the condition is batched and both branches run).
- **Many matrices at once.** `size_buckets`, `stack_padded` / `pad_stack`,
  `cholesky_inverse_padded` and `repair_padded` invert the factors of many
  blocks in a few loops (one per size bucket) with one shared fallback;
  `padded_diagonal_sums` (or `diagonal_sums`), `pi_damping_vector` and
  `floored_damping_vector` compute their traces, pi-split dampings and damping
  floors in one pass. XLA compiles a kernel per distinct shape and operation
  (about 20 ms each on the CPU, several times more for small matrices), so
  this is what keeps the compilation of a K-FAC step short.
- **Eigendecompositions** (`safe_eigh`) that come out non-finite are replaced by
  zero eigenvalues and identity eigenvectors, so that only the damping acts.

Inputs narrower than float32 (bfloat16, float16) are computed in float32 and
cast back.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

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


def clip_eigenvalues(values: jax.Array) -> jax.Array:
    """Eigenvalues (or diagonal entries) of a PSD matrix made usable: negative ones and
    non-finite ones become zero."""
    return jnp.where(jnp.isfinite(values), jnp.maximum(values, 0), 0)


# ----------------------------------------------------------------------------- eigh


def safe_eigh(m: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Eigendecomposition of a PSD matrix (a stack of them), eigenvalues clipped at zero.

    ``m`` is symmetrised first. If the decomposition of a matrix is not finite,
    it is recomputed in float64 when ``jax_enable_x64`` is on and ``m`` is
    float32; if it still is not (e.g. ``m`` has NaN entries), that matrix gets
    zero eigenvalues and identity eigenvectors, so that a damped power of it is
    ``damping**p I``.

    Returns:
      ``(eigenvalues [..., n], eigenvectors [..., n, n])`` in ``m``'s dtype.
    """

    def decompose(x):
        vals, vecs = jnp.linalg.eigh(symmetrize(x))
        return jnp.maximum(vals, 0), vecs

    def finite(out):
        vals, vecs = out
        return _finite(vals, 1) & _finite(vecs, 2)

    dtype = m.dtype
    vals, vecs = _with_fallback(m.astype(_working_dtype(dtype)), decompose, decompose, finite)
    ok = finite((vals, vecs))
    eye = jnp.broadcast_to(jnp.eye(m.shape[-1], dtype=vecs.dtype), vecs.shape)
    vals = jnp.where(ok[..., None], vals, 0)
    vecs = jnp.where(ok[..., None, None], vecs, eye)
    return vals.astype(dtype), vecs.astype(dtype)


# ----------------------------------------------------------------------------- powers


def psd_inverse(m: jax.Array, damping: Any) -> jax.Array:
    """``(m + d I)^-1`` with ``d = floored_damping(m, damping)``, never NaN or Inf.

    A Cholesky factorisation first; matrices of the stack for which it is not
    finite (``m`` indefinite, or numerically singular) use the eigendecomposition
    of ``m`` with eigenvalues clipped at zero (in float64 when
    ``jax_enable_x64`` is on and ``m`` is float32); if that is not finite either
    (``m`` has NaN or Inf entries), the result is ``(1 / d) I``. See the module
    docstring.

    Args:
      m: a stack of symmetric PSD matrices ``[..., n, n]``.
      damping: a non-negative scalar or ``[...]`` stack.

    Returns:
      ``[..., n, n]`` in ``m``'s dtype.

    Example::

      >>> psd_inverse(jnp.array([[3.0]]), 1.0)
      Array([[0.25]], dtype=float32)
    """
    return _damped_power(m, damping, -1.0, cholesky_first=True)


def psd_matpower(m: jax.Array, power: float, damping: Any) -> jax.Array:
    """``(m_+ + d I)^power`` with ``d = floored_damping(m, damping)``, never NaN or Inf.

    ``m_+`` is ``m`` with negative eigenvalues clipped at zero (`safe_eigh`,
    including its float64 retry); a matrix whose eigendecomposition is not
    finite gives ``d**power I``. Finite for ``power >= -2`` (see the module
    docstring for the floor).

    Args:
      m: a stack of symmetric PSD matrices ``[..., n, n]``.
      power: any real power.
      damping: a non-negative scalar or ``[...]`` stack.

    Returns:
      ``[..., n, n]`` in ``m``'s dtype.
    """
    return _damped_power(m, damping, power, cholesky_first=False)


def _damped_power(m: jax.Array, damping: Any, power: float, cholesky_first: bool) -> jax.Array:
    dtype = m.dtype
    m = m.astype(_working_dtype(dtype))
    d = floored_damping(m, damping, dtype)
    if cholesky_first:  # The factorisation reads one triangle; the eigh path symmetrises.
        return _floored_inverse(m, d).astype(dtype)
    return _floored_power(symmetrize(m), d, power).astype(dtype)


def _floored_power(m: jax.Array, d: jax.Array, power: float) -> jax.Array:
    """``(m_+ + d I)^power`` of a symmetric ``m`` whose damping ``d`` is floored already."""
    vals, vecs = safe_eigh(m)
    dx = d.astype(m.dtype)[..., None]
    out = (vecs * jnp.power(vals + dx, power)[..., None, :]) @ jnp.swapaxes(vecs, -1, -2)
    return jnp.where(_finite(out, 2)[..., None, None], out, _scaled_identity(m, d, power))


def _floored_inverse(m: jax.Array, d: jax.Array) -> jax.Array:
    """`psd_inverse` of ``m`` (its lower triangle; symmetric up to rounding) whose damping
    ``d`` is floored already: Cholesky, and where it is not finite the eigh path of
    ``symmetrize(m)`` (`_floored_power`, itself finite: it falls back to ``(1 / d) I``)."""
    out = _cholesky_inverse(d)(m)
    ok = _finite(out, 2)
    retry = _retry_dtype(m.dtype)

    def replace(out):
        alt = _floored_power(symmetrize(m.astype(retry)), d.astype(retry), -1.0)
        alt = alt.astype(m.dtype)
        return jnp.where(_expand(ok, out), out, alt)

    return jax.lax.cond(jnp.all(ok), lambda o: o, replace, out)


def _scaled_identity(m: jax.Array, d: jax.Array, power: float) -> jax.Array:
    identity = jnp.broadcast_to(jnp.eye(m.shape[-1], dtype=m.dtype), m.shape)
    return identity * jnp.power(d, power).astype(m.dtype)[..., None, None]


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


# ----------------------------------------------------------------------------- batched inverses


def size_buckets(
    sizes: Sequence[int], max_growth: float = 1.05, min_size: int = 64
) -> list[tuple[int, list[int]]]:
    """Groups matrix sizes for `psd_inverse_padded`: ``[(bucket size, indices)]``.

    Sizes are taken from the largest down; a size joins the current bucket when
    padding it to the bucket's size grows it by at most ``max_growth`` (so that
    a layer's ``n`` and ``n + 1`` (bias) factors share one bucket), else it
    starts a new bucket. Sizes up to ``min_size`` share one bucket of that size:
    XLA on the CPU compiles kernels for small matrices several times slower than
    for large ones, and their factorisations cost next to nothing. Fewer buckets
    mean fewer distinct factorisations to compile; ``max_growth`` bounds the
    extra work (``1.05**3 = 1.16``).

    Example::

      >>> size_buckets([785, 1000, 31, 1001, 30])
      [(1001, [3, 1]), (785, [0]), (64, [2, 4])]
    """
    buckets: list[tuple[int, list[int]]] = []
    for i in sorted(range(len(sizes)), key=lambda i: (-int(sizes[i]), i)):
        size = max(int(sizes[i]), min_size)
        if buckets and size * max_growth >= buckets[-1][0]:
            buckets[-1][1].append(i)
        else:
            buckets.append((size, [i]))
    return buckets


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


class PaddedStack(NamedTuple):
    """Matrices of several sizes in one stack (see `pad_stack`).

    Attributes:
      matrices: ``[K, size, size]``, each zero-padded below and right.
      floors: ``[K]`` floored dampings.
      sizes: ``[K]`` int32 unpadded sizes.
    """

    matrices: jax.Array
    floors: jax.Array
    sizes: jax.Array


def pad_stack(
    matrices: Sequence[jax.Array], floors: Sequence[jax.Array] | jax.Array, size: int
) -> PaddedStack:
    """Stacks ``matrices`` (``[..., n_i, n_i]``, ``n_i <= size``, one dtype) and their floored
    dampings (`floored_dampings`, or one flat ``[K]`` vector) into one `PaddedStack` in
    the working dtype."""
    if not matrices:
        raise ValueError("pad_stack: no matrices to stack.")
    _check_stacks(matrices, "pad_stack", size)
    count = sum(math.prod(np.shape(m)[:-2]) for m in matrices)
    if isinstance(floors, jax.Array):
        if floors.shape != (count,):
            raise ValueError(
                f"pad_stack: floors has shape {floors.shape}; a flat vector must have one "
                f"entry per matrix, shape ({count},)."
            )
    else:
        _check_dampings(matrices, floors, "pad_stack")
    work = _working_dtype(jnp.result_type(*matrices))
    if isinstance(floors, jax.Array):
        flat_floors = floors.astype(work)
    else:
        flat_floors = jnp.concatenate(
            [
                jnp.broadcast_to(jnp.asarray(f, work), m.shape[:-2]).reshape(-1)
                for f, m in zip(floors, matrices, strict=True)
            ]
        )
    return PaddedStack(stack_padded(matrices, size), flat_floors, stack_sizes(matrices))


def stack_padded(matrices: Sequence[jax.Array], size: int) -> jax.Array:
    """``matrices`` (``[..., n_i, n_i]``, ``n_i <= size``) zero-padded below and right and
    stacked: ``[K, size, size]`` in the working dtype (one fused kernel)."""
    _check_stacks(matrices, "stack_padded", size)
    work = _working_dtype(jnp.result_type(*matrices))
    padded = []
    for m in matrices:
        n = m.shape[-1]
        m = m.astype(work).reshape((-1, n, n))
        padded.append(jnp.pad(m, ((0, 0), (0, size - n), (0, size - n))))
    return padded[0] if len(padded) == 1 else jnp.concatenate(padded)


def stack_sizes(matrices: Sequence[jax.Array]) -> jax.Array:
    """``[K]`` int32: the size of each matrix of `stack_padded` ``(matrices)``."""
    counts = [math.prod(m.shape[:-2]) for m in matrices]
    return jnp.asarray(np.repeat([m.shape[-1] for m in matrices], counts).astype(np.int32))


def padded_diagonal_sums(stacks: Sequence[jax.Array]) -> jax.Array:
    """``[2, K]``: the traces and the sums of ``|diag|`` of the matrices of zero-padded
    ``[K_i, n_i, n_i]`` stacks (`stack_padded`; the padding adds nothing), in order."""
    return _diagonal_sums_flat(stacks)


def _unpadded(m: jax.Array, d: jax.Array, n: jax.Array) -> jax.Array:
    """``m + diag(d on the first n entries, 1 on the padding)``: the damped matrix with an
    identity block on the padding (which leaves the inverse of the top-left block alone).
    Works on one matrix or on a stack (``d`` and ``n`` then ``[K]``)."""
    size, lead = m.shape[-1], (1,) * (m.ndim - 2)
    d, n = jnp.asarray(d, m.dtype)[..., None], jnp.asarray(n)[..., None]
    index = jnp.arange(size).reshape(lead + (size,))
    diagonal = jnp.where(index < n, d, jnp.ones((), m.dtype))  # [..., size]
    eye = (jnp.arange(size)[:, None] == jnp.arange(size)[None, :]).reshape(lead + (size, size))
    return m + jnp.where(eye, diagonal[..., None, :], jnp.zeros((), m.dtype))


def cholesky_inverse_padded(stack: PaddedStack) -> tuple[jax.Array, jax.Array]:
    """The fast path of `psd_inverse` for a `PaddedStack`: Cholesky inverses, no fallback.

    Returns:
      ``(inverses [K, size, size], ok [K])``: ``ok`` (0 or 1, in the working
      dtype) says where the factorisation succeeded; elsewhere the inverse is NaN.
      Repair those with `repair_padded`, crop the rest with `crop_padded`.
    """
    if not isinstance(stack, PaddedStack):
        raise TypeError(
            f"cholesky_inverse_padded takes a PaddedStack (from pad_stack), got {type(stack)}."
        )

    # The damping is added to the whole stack at once (one fused kernel); then one matrix
    # at a time (a loop, compiled once): batched LAPACK calls on the CPU can deadlock
    # when several run at once. Success is read from the diagonals of the inverses
    # (`_finite_inverse`), after the loop.
    inverses = jax.lax.map(_inverse_by_cholesky, _unpadded(*stack))
    return inverses, _finite_inverse(inverses).astype(inverses.dtype)


def repair_padded(
    stacks: Callable[[], Sequence[PaddedStack]],
    inverses: Sequence[jax.Array],
    oks: Sequence[jax.Array],
) -> list[jax.Array]:
    """The fallback of `psd_inverse` for the matrices whose Cholesky inverse failed.

    All stacks share one fallback, compiled once: if any ``ok`` is 0, the stacks
    (built by calling ``stacks``) are padded to the largest size and the failed
    matrices go through the eigendecomposition path of `psd_inverse` one after
    the other (in float64 under ``jax_enable_x64``); when all are ok (the usual
    case) this costs one branch.

    Args:
      stacks: builds the `PaddedStack` of each group (only when needed).
      inverses: per group, the ``[K, n, n]`` result of `cholesky_inverse_padded`.
      oks: per group, its ``[K]`` success flags.

    Returns:
      The inverses with the failed ones replaced.
    """
    size = max(x.shape[-1] for x in inverses)
    good = [ok > 0 for ok in oks]

    def repair(inverses):
        built = stacks()
        padded = [
            jnp.pad(b.matrices, ((0, 0), (0, size - n), (0, size - n)))
            for b, n in ((b, b.matrices.shape[-1]) for b in built)
        ]
        all_good = jnp.concatenate(good)
        stack = jnp.concatenate(padded)
        floors = jnp.concatenate([b.floors for b in built])
        sizes = jnp.concatenate([b.sizes for b in built])
        retry = _retry_dtype(stack.dtype)

        def one(args):
            m, d, n, ok = args

            def fallback(m):
                m = symmetrize(_unpadded(m, jnp.zeros((), m.dtype), n).astype(retry))
                return _floored_power(m, d.astype(retry), -1.0).astype(stack.dtype)

            return jax.lax.cond(ok, lambda m: m, fallback, m)

        fixed = jax.lax.map(one, (stack, floors, sizes, all_good))
        out, start = [], 0
        for inverse, keep in zip(inverses, good, strict=True):
            k, n = inverse.shape[0], inverse.shape[-1]
            alt = fixed[start : start + k, :n, :n].astype(inverse.dtype)
            out.append(jnp.where(keep[:, None, None], inverse, alt))
            start += k
        return out

    return jax.lax.cond(jnp.all(jnp.concatenate(good)), list, repair, list(inverses))


def psd_inverse_padded(
    matrices: Sequence[jax.Array], dampings: Sequence[Any], size: int
) -> jax.Array:
    """`psd_inverse` of several stacks of matrices at once, padded to one size.

    Each ``matrices[i]`` (``[..., n_i, n_i]`` with ``n_i <= size``, all of one
    dtype) is padded to ``[size, size]`` with an identity block (which does not
    change the inverse of the top-left block) and all are inverted one after the
    other in a loop over the ``[K, size, size]`` stack, each with its own
    ``dampings[i]`` floored as `psd_inverse` floors it (from the unpadded
    diagonal): one factorisation (and one fallback) to compile for the whole
    group. Crop the results with `crop_padded`.

    Returns:
      ``[K, size, size]`` in the working dtype (float32 or wider), where ``K``
      is the total number of matrices.
    """
    _check_stacks(matrices, "psd_inverse_padded", size)
    floors = floored_dampings(matrices, dampings)
    stack = pad_stack(matrices, floors, size)
    inverses, ok = cholesky_inverse_padded(stack)
    return repair_padded(lambda: [stack], [inverses], [ok])[0]


def crop_padded(inverses: jax.Array, like: Sequence[jax.Array]) -> list[jax.Array]:
    """Splits the result of `psd_inverse_padded` into arrays shaped and typed like ``like``."""
    out, start = [], 0
    for m in like:
        n, count = m.shape[-1], math.prod(m.shape[:-2])
        block = inverses[start : start + count, :n, :n]
        out.append(block.reshape(m.shape).astype(m.dtype))
        start += count
    return out


def _cholesky_inverse(d: jax.Array) -> Callable[[jax.Array], jax.Array]:
    """``m -> (m + d I)^-1`` by Cholesky; see `_inverse_by_cholesky`."""
    return lambda m: _inverse_by_cholesky(add_to_diagonal(m, d))


#: Matrices up to this size are inverted by Cholesky and triangular solves; larger ones
#: by `_inverse_by_cholesky`'s 2x2 block recursion.
_BLOCK_INVERSE_BASE = 256


def _inverse_by_cholesky(a: jax.Array) -> jax.Array:
    """``a^-1`` of a symmetric positive definite ``a`` (a stack of them); NaN where ``a``
    is not numerically positive definite.

    Up to `_BLOCK_INVERSE_BASE`: Cholesky (of the lower triangle of ``a``, which is
    symmetric up to rounding) and two triangular solves. Larger: block elimination on
    the lower triangle, ``a = [[a11, a21^T], [a21, a22]]``, ``t = a11^-1 a21^T``,
    ``s = a22 - a21 t`` (the Schur complement, positive definite when ``a`` is), and

        ``a^-1 = [[a11^-1 + t s^-1 t^T, -t s^-1], [-(t s^-1)^T, s^-1]]``,

    with ``a11^-1`` and ``s^-1`` recursively: about ``4 n^3 / 3`` flops in matrix
    products in place of ``7 n^3 / 3`` in a factorisation and triangular solves, which
    run several times slower than products on the CPU. It is block Cholesky without
    the triangular factors, as stable for positive definite ``a``; a failed Cholesky at
    the base makes every entry NaN, as the plain path does.

    Measured on the deep autoencoder's refresh (2-core CPU, float32, same accuracy
    against a float64 inverse): base 256 runs in 174 ms instead of 210 ms and adds
    0.7 s to the step's XLA compilation (each level of recursion adds kernels);
    base 128 runs in 161 ms but adds 1.5 s.
    """
    n = a.shape[-1]
    if n > _BLOCK_INVERSE_BASE:
        h = n // 2
        # The lower block, as the Cholesky path reads the lower triangle only.
        a11, a21, a22 = a[..., :h, :h], a[..., h:, :h], a[..., h:, h:]
        x11 = _inverse_by_cholesky(a11)
        t = x11 @ jnp.swapaxes(a21, -1, -2)
        y = _inverse_by_cholesky(a22 - a21 @ t)
        b12 = -(t @ y)
        b11 = x11 - b12 @ jnp.swapaxes(t, -1, -2)
        top = jnp.concatenate([b11, b12], axis=-1)
        bottom = jnp.concatenate([jnp.swapaxes(b12, -1, -2), y], axis=-1)
        return jnp.concatenate([top, bottom], axis=-2)
    chol = jax.lax.linalg.cholesky(a, symmetrize_input=False)
    eye = jnp.broadcast_to(jnp.eye(a.shape[-1], dtype=a.dtype), a.shape)
    solve = jax.lax.linalg.triangular_solve
    half = solve(chol, eye, left_side=True, lower=True)
    return solve(chol, half, left_side=True, lower=True, transpose_a=True)


# ----------------------------------------------------------------------------- helpers


def _finite(x: jax.Array, core_ndim: int) -> jax.Array:
    """Whether each entry of the stack (the last ``core_ndim`` axes) is all finite.

    ``sum(x * 0)`` is NaN exactly when an entry is NaN or infinite; XLA compiles
    this float sum much faster than a boolean ``all(isfinite(x))`` reduction.
    """
    axes = tuple(range(x.ndim - core_ndim, x.ndim))
    return jnp.isfinite(jnp.sum(x * jnp.zeros((), x.dtype), axis=axes))


def _finite_inverse(x: jax.Array) -> jax.Array:
    """Whether each inverse of the stack that `_inverse_by_cholesky` returned is finite,
    read from its diagonal: ``n`` entries of ``n^2``.

    A failed Cholesky factorisation makes the whole inverse NaN. Otherwise, a
    non-finite entry reaches the diagonal: at the base ``x = L^-T L^-1`` and
    ``x_ii`` is the squared norm of column ``i`` of ``L^-1``, so a non-finite
    entry of that column makes it non-finite; and the block step's diagonal blocks,
    ``s^-1`` and ``a11^-1 + t s^-1 t^T``, carry every entry of ``s^-1``, ``a11^-1`` and
    ``t`` into their diagonals (``s^-1`` is positive definite). By Cauchy-Schwarz,
    ``|x_ij| <= sqrt(x_ii x_jj)``, so the off-diagonal entries can only overflow where
    the diagonal is within a square root of overflowing itself. Reading the whole
    stack instead cost about 15 ms of the autoencoder's 176 ms refresh; the
    optimizer's non-finite guard still checks every entry of the update.
    """
    return _finite(jnp.diagonal(x, axis1=-2, axis2=-1), 1)


def _working_dtype(dtype: Any) -> Any:
    return jnp.promote_types(dtype, jnp.float32)


def _retry_dtype(dtype: Any) -> Any:
    """float64 when ``jax_enable_x64`` is on and ``dtype`` is narrower, else ``dtype``."""
    if jax.config.jax_enable_x64 and jnp.finfo(dtype).bits < 64:
        return jnp.float64
    return dtype


def _with_fallback(m: jax.Array, first: Callable, fallback: Callable, finite: Callable) -> Any:
    """``first(m)``, with the matrices of the stack where it is not ``finite`` replaced by
    ``fallback`` computed in `_retry_dtype` (a `jax.lax.cond`: free when all are finite)."""
    out = first(m)
    retry = _retry_dtype(m.dtype)
    if fallback is first and retry == m.dtype:  # The retry would compute the same thing.
        return out
    ok = finite(out)

    def replace(out):
        alt = jax.tree.map(lambda a: a.astype(m.dtype), fallback(m.astype(retry)))
        return jax.tree.map(lambda o, a: jnp.where(_expand(ok, o), o, a), out, alt)

    return jax.lax.cond(jnp.all(ok), lambda o: o, replace, out)


def _expand(ok: jax.Array, like: jax.Array) -> jax.Array:
    return ok.reshape(ok.shape + (1,) * (like.ndim - ok.ndim))


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
