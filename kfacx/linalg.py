"""Robust linear algebra for symmetric positive semi-definite (PSD) factors.

All functions accept a stack of matrices ``[..., n, n]`` (``damping`` broadcasts
over the stack axes) and return arrays of the input's dtype; they never return
NaN or Inf for a finite, non-negative ``damping``. The rules, shared by every
curvature block (see ``docs/numerics.md``):

- **Symmetrisation.** Inputs are replaced by ``(m + m^T) / 2``.
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
- **Eigendecompositions** (`safe_eigh`) that come out non-finite are replaced by
  zero eigenvalues and identity eigenvectors, so that only the damping acts.

Inputs narrower than float32 (bfloat16, float16) are computed in float32 and
cast back.
"""

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
    m = symmetrize(m.astype(_working_dtype(dtype)))
    d = floored_damping(m, damping, dtype)
    out = _floored_inverse(m, d) if cholesky_first else _floored_power(m, d, power)
    return out.astype(dtype)


def _floored_power(m: jax.Array, d: jax.Array, power: float) -> jax.Array:
    """``(m_+ + d I)^power`` of a symmetric ``m`` whose damping ``d`` is floored already."""
    vals, vecs = safe_eigh(m)
    dx = d.astype(m.dtype)[..., None]
    out = (vecs * jnp.power(vals + dx, power)[..., None, :]) @ jnp.swapaxes(vecs, -1, -2)
    return jnp.where(_finite(out, 2)[..., None, None], out, _scaled_identity(m, d, power))


def _floored_inverse(m: jax.Array, d: jax.Array) -> jax.Array:
    """`psd_inverse` of a symmetric ``m`` whose damping ``d`` is floored already:
    Cholesky, the eigh fallback where it is not finite, then ``(1 / d) I``."""
    out = _with_fallback(
        m, _cholesky_inverse(d), lambda x: _floored_power(x, d, -1.0), lambda x: _finite(x, 2)
    )
    return jnp.where(_finite(out, 2)[..., None, None], out, _scaled_identity(m, d, -1.0))


def _scaled_identity(m: jax.Array, d: jax.Array, power: float) -> jax.Array:
    identity = jnp.broadcast_to(jnp.eye(m.shape[-1], dtype=m.dtype), m.shape)
    return identity * jnp.power(d, power).astype(m.dtype)[..., None, None]


# ----------------------------------------------------------------------------- batched inverses


def size_buckets(sizes: Sequence[int], max_growth: float = 1.05) -> list[tuple[int, list[int]]]:
    """Groups matrix sizes for `psd_inverse_padded`: ``[(bucket size, indices)]``.

    Sizes are taken from the largest down; a size joins the current bucket when
    padding it to the bucket's size grows it by at most ``max_growth`` (so that
    a layer's ``n`` and ``n + 1`` (bias) factors share one bucket), else it
    starts a new bucket. Fewer buckets mean fewer distinct factorisations to
    compile; ``max_growth`` bounds the extra work (``1.05**3 = 1.16``).

    Example::

      >>> size_buckets([785, 1000, 31, 1001, 30])
      [(1001, [3, 1]), (785, [0]), (31, [2, 4])]
    """
    buckets: list[tuple[int, list[int]]] = []
    for i in sorted(range(len(sizes)), key=lambda i: (-int(sizes[i]), i)):
        if buckets and int(sizes[i]) * max_growth >= buckets[-1][0]:
            buckets[-1][1].append(i)
        else:
            buckets.append((int(sizes[i]), [i]))
    return buckets


def psd_inverse_padded(
    matrices: Sequence[jax.Array], dampings: Sequence[Any], size: int
) -> jax.Array:
    """`psd_inverse` of several stacks of matrices at once, padded to one size.

    Each ``matrices[i]`` (``[..., n_i, n_i]`` with ``n_i <= size``) is floored
    with its own ``dampings[i]`` as `psd_inverse` does, padded to ``[size, size]``
    with an identity block (which does not change the inverse of the top-left
    block), and all are inverted one after the other in a loop over the
    ``[K, size, size]`` stack: one factorisation (and one fallback) to compile
    for the whole group. Crop the results with `crop_padded`.

    Returns:
      ``[K, size, size]`` in the working dtype (float32 or wider), where ``K``
      is the total number of matrices.
    """
    padded, floors = [], []
    for m, damping in zip(matrices, dampings, strict=True):
        n, dtype = m.shape[-1], m.dtype
        damping = jnp.broadcast_to(jnp.asarray(damping), m.shape[:-2]).reshape(-1)
        m = symmetrize(m.astype(_working_dtype(dtype)).reshape(-1, n, n))
        floors.append(floored_damping(m, damping, dtype))
        if n < size:
            pad_diagonal = jnp.diag(jnp.asarray(np.arange(size) >= n, m.dtype))
            m = jnp.pad(m, ((0, 0), (0, size - n), (0, size - n))) + pad_diagonal[None]
        padded.append(m)
    stack = padded[0] if len(padded) == 1 else jnp.concatenate(padded)
    d = floors[0] if len(floors) == 1 else jnp.concatenate(floors)
    # One matrix at a time (a loop, compiled once): batched LAPACK calls on the CPU can
    # deadlock when several run at once, and the fallback then runs only where needed.
    return jax.lax.map(lambda md: _floored_inverse(*md), (stack, d))


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
    def inverse(m):
        chol = jnp.linalg.cholesky(add_to_diagonal(m, d))
        eye = jnp.broadcast_to(jnp.eye(m.shape[-1], dtype=m.dtype), m.shape)
        return jax.scipy.linalg.cho_solve((chol, True), eye)

    return inverse


# ----------------------------------------------------------------------------- helpers


def _finite(x: jax.Array, core_ndim: int) -> jax.Array:
    """Whether each entry of the stack (the last ``core_ndim`` axes) is all finite."""
    return jnp.all(jnp.isfinite(x), axis=tuple(range(x.ndim - core_ndim, x.ndim)))


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
    norm_a = jnp.trace(a, axis1=-2, axis2=-1) / a.shape[-1]
    norm_g = jnp.trace(g, axis1=-2, axis2=-1) / g.shape[-1]
    ok = (norm_a > 0) & (norm_g > 0) & jnp.isfinite(norm_a) & jnp.isfinite(norm_g)
    ratio = jnp.where(ok, norm_a / jnp.where(ok, norm_g, 1.0), 1.0)
    pi = jnp.sqrt(ratio)
    root = jnp.sqrt(jnp.asarray(damping, a.dtype))
    return pi * root, root / pi
