"""Inverses and powers of damped PSD matrices: Cholesky first, an eigendecomposition
and a scaled identity as fallbacks (the rules: `kfacx.linalg`)."""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from kfacx._helpers._checks import is_eager
from kfacx.linalg._common import (
    _retry_dtype,
    _working_dtype,
    add_to_diagonal,
    one_at_a_time_on_cpu,
    symmetrize,
)
from kfacx.linalg._damping import floored_damping


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
        vals, vecs = one_at_a_time_on_cpu(jnp.linalg.eigh, symmetrize(x))
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
    # Eagerly, one program per shape and power, not one per operation (and per branch);
    # a power given as an array is not a static argument and stays op by op.
    if is_eager() and isinstance(power, numbers.Real) and not isinstance(power, jax.Array):
        return _damped_power_program(m, damping, float(power), cholesky_first)
    return _damped_power_ops(m, damping, power, cholesky_first)


def _damped_power_ops(m: jax.Array, damping: Any, power: float, cholesky_first: bool) -> jax.Array:
    dtype = m.dtype
    m = m.astype(_working_dtype(dtype))
    d = floored_damping(m, damping, dtype)
    if cholesky_first:  # The factorisation reads one triangle; the eigh path symmetrises.
        return _floored_inverse(m, d).astype(dtype)
    return _floored_power(symmetrize(m), d, power).astype(dtype)


#: `_damped_power_ops` compiled, for eager calls.
_damped_power_program = jax.jit(_damped_power_ops, static_argnums=(2, 3))


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


def _cholesky_inverse(d: jax.Array) -> Callable[[jax.Array], jax.Array]:
    """``m -> (m + d I)^-1`` by Cholesky; see `_inverse_by_cholesky`."""
    return lambda m: _inverse_by_cholesky(add_to_diagonal(m, d))


#: Matrices up to this size are inverted by Cholesky and triangular solves; larger ones
#: by `_inverse_by_cholesky`'s 2x2 block recursion.
_BLOCK_INVERSE_BASE = 256


def _inverse_by_cholesky(a: jax.Array) -> jax.Array:
    """``a^-1`` of a symmetric positive definite ``a`` (a stack of them); NaN where ``a``
    is not numerically positive definite.

    Up to `_BLOCK_INVERSE_BASE`, and on every backend but the CPU: Cholesky (of the
    lower triangle of ``a``, which is symmetric up to rounding) and two triangular
    solves (`_unblocked_inverse`). Larger, on the CPU: `_block_inverse`. The choice is
    made when the program is lowered (`jax.lax.platform_dependent`): a CPU program holds
    only the block recursion, an accelerator's only the batched factorisation.
    """
    if a.shape[-1] <= _BLOCK_INVERSE_BASE:
        return _unblocked_inverse(a)
    return jax.lax.platform_dependent(a, cpu=_block_inverse, default=_unblocked_inverse)


def _block_inverse(a: jax.Array) -> jax.Array:
    """``a^-1`` by block elimination on the lower triangle (the CPU's path above
    `_BLOCK_INVERSE_BASE`), ``a = [[a11, a21^T], [a21, a22]]``, ``t = a11^-1 a21^T``,
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
    base 128 runs in 161 ms but adds 1.5 s. On an accelerator each level would add
    kernel launches for no gain, hence the CPU only.
    """
    n = a.shape[-1]
    if n <= _BLOCK_INVERSE_BASE:
        return _unblocked_inverse(a)
    h = n // 2
    # The lower block, as the Cholesky path reads the lower triangle only.
    a11, a21, a22 = a[..., :h, :h], a[..., h:, :h], a[..., h:, h:]
    x11 = _block_inverse(a11)
    t = x11 @ jnp.swapaxes(a21, -1, -2)
    y = _block_inverse(a22 - a21 @ t)
    b12 = -(t @ y)
    b11 = x11 - b12 @ jnp.swapaxes(t, -1, -2)
    top = jnp.concatenate([b11, b12], axis=-1)
    bottom = jnp.concatenate([jnp.swapaxes(b12, -1, -2), y], axis=-1)
    return jnp.concatenate([top, bottom], axis=-2)


def _unblocked_inverse(a: jax.Array) -> jax.Array:
    """``a^-1`` by one (batched) Cholesky of the lower triangle and two triangular
    solves; NaN where the factorisation fails. A stack is inverted one matrix at a time
    on the CPU (`one_at_a_time_on_cpu`)."""

    def invert(a):
        chol = jax.lax.linalg.cholesky(a, symmetrize_input=False)
        eye = jnp.broadcast_to(jnp.eye(a.shape[-1], dtype=a.dtype), a.shape)
        solve = jax.lax.linalg.triangular_solve
        half = solve(chol, eye, left_side=True, lower=True)
        return solve(chol, half, left_side=True, lower=True, transpose_a=True)

    return one_at_a_time_on_cpu(invert, a)


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
