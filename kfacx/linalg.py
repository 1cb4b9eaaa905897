"""Small linear-algebra helpers for symmetric positive semi-definite factors.

All functions accept a stack of matrices ``[..., n, n]`` and work in the
factor's dtype (callers keep factors in float32 or wider).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def symmetrize(m: jax.Array) -> jax.Array:
    """``(m + m^T) / 2`` over the last two axes."""
    return (m + jnp.swapaxes(m, -1, -2)) / 2


def add_to_diagonal(m: jax.Array, value: jax.Array) -> jax.Array:
    """``m + value * I``; ``value`` broadcasts over the leading (stack) axes."""
    eye = jnp.broadcast_to(jnp.eye(m.shape[-1], dtype=m.dtype), m.shape)
    value = jnp.broadcast_to(jnp.asarray(value, m.dtype)[..., None, None], m.shape)
    return m + value * eye


def safe_eigh(m: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Eigendecomposition of a PSD matrix; eigenvalues clipped at zero."""
    vals, vecs = jnp.linalg.eigh(symmetrize(m))
    return jnp.maximum(vals, 0.0), vecs


def psd_inverse(m: jax.Array, damping: jax.Array) -> jax.Array:
    """``(m + damping I)^-1`` through a Cholesky factorisation."""
    damped = add_to_diagonal(symmetrize(m), damping)
    chol = jnp.linalg.cholesky(damped)
    eye = jnp.broadcast_to(jnp.eye(m.shape[-1], dtype=m.dtype), m.shape)
    return jax.scipy.linalg.cho_solve((chol, True), eye)


def psd_matpower(m: jax.Array, power: float, damping: jax.Array) -> jax.Array:
    """``(m + damping I)^power`` through an eigendecomposition."""
    vals, vecs = safe_eigh(m)
    damping = jnp.broadcast_to(jnp.asarray(damping, m.dtype)[..., None], vals.shape)
    scaled = vecs * jnp.power(vals + damping, power)[..., None, :]
    return scaled @ jnp.swapaxes(vecs, -1, -2)


def pi_adjusted_damping(
    a: jax.Array, g: jax.Array, damping: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Splits ``damping`` between two Kronecker factors ("pi" damping).

    Returns ``(pi * sqrt(damping), sqrt(damping) / pi)`` with
    ``pi = sqrt((tr(a) / dim(a)) / (tr(g) / dim(g)))`` per stacked pair, so that
    ``(a + d_a I) (x) (g + d_g I)`` approximates ``a (x) g + damping I``. When a
    trace is zero or not finite (dead units, empty statistics) ``pi = 1``.
    """
    norm_a = jnp.trace(a, axis1=-2, axis2=-1) / a.shape[-1]
    norm_g = jnp.trace(g, axis1=-2, axis2=-1) / g.shape[-1]
    ok = (norm_a > 0) & (norm_g > 0) & jnp.isfinite(norm_a) & jnp.isfinite(norm_g)
    ratio = jnp.where(ok, norm_a / jnp.where(ok, norm_g, 1.0), 1.0)
    pi = jnp.sqrt(ratio)
    root = jnp.sqrt(jnp.asarray(damping, a.dtype))
    return pi * root, root / pi
