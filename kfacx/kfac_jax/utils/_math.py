"""kfac-jax's math helpers (``kfac_jax.utils.psd_inv``, ...) on `kfacx.linalg`.

Inverses and powers of PSD matrices go through kfacx's robust routines
(`kfacx.linalg.psd_inverse`: Cholesky, an eigendecomposition fallback, a damping floor
of one rounding of the trace), so a hosted kfac-jax block gets kfacx's numerics.
"""

from __future__ import annotations

import functools
import math
import string
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from kfacx import linalg

_ALPHABET = string.ascii_lowercase
_SETTINGS = {"use_cholesky_inversion": True, "special_case_zero_inv": True}


def set_use_cholesky_inversion(value: bool) -> None:
    """Taken for kfac-jax's API: kfacx always tries Cholesky first, then falls back."""
    _SETTINGS["use_cholesky_inversion"] = bool(value)


def get_use_cholesky_inversion() -> bool:
    return _SETTINGS["use_cholesky_inversion"]


def set_special_case_zero_inv(value: bool) -> None:
    """Whether `pi_adjusted_kronecker_factors` treats a zero factor specially."""
    _SETTINGS["special_case_zero_inv"] = bool(value)


def get_special_case_zero_inv() -> bool:
    return _SETTINGS["special_case_zero_inv"]


def product(iterable_object: Iterable[Any]) -> Any:
    """The product of the elements (1 for none)."""
    return functools.reduce(lambda a, b: a * b, iterable_object, 1)


def outer_product(*arrays: jax.Array) -> jax.Array:
    """The outer product of vectors.

    Raises:
      ValueError: if an array is not a vector.
    """
    if not all(a.ndim == 1 for a in arrays):
        raise ValueError("outer_product: all arrays must be vectors.")
    letters = _ALPHABET[: len(arrays)]
    return jnp.einsum(f"{','.join(letters)}->{letters}", *arrays)


def scalar_mul(obj: Any, scalar: Any) -> Any:
    """Every leaf times ``scalar``."""
    if isinstance(scalar, (int, float)) and scalar == 1:
        return obj
    return jax.tree_util.tree_map(lambda x: x * scalar, obj)


def scalar_div(obj: Any, scalar: Any) -> Any:
    """Every leaf divided by ``scalar``."""
    return jax.tree_util.tree_map(lambda x: x / scalar, obj)


def weighted_sum_of_objects(objects: Sequence[Any], coefficients: Sequence[Any]) -> Any:
    """``sum_i coefficients[i] * objects[i]`` over pytrees of one structure."""
    terms = [scalar_mul(o, c) for o, c in zip(objects, coefficients, strict=True)]
    return functools.reduce(lambda a, b: jax.tree_util.tree_map(jnp.add, a, b), terms)


def sum_of_objects(objects: Sequence[Any]) -> Any:
    """The sum of pytrees of one structure."""
    return functools.reduce(lambda a, b: jax.tree_util.tree_map(jnp.add, a, b), objects)


def inner_product(obj1: Any, obj2: Any, in_float64: bool = False) -> jax.Array:
    """``<vec(obj1), vec(obj2)>`` over all leaves."""
    dtype = jnp.float64 if in_float64 else None
    terms = jax.tree_util.tree_map(
        lambda x, y: jnp.sum(x.astype(dtype) * y.astype(dtype)) if dtype else jnp.sum(x * y),
        obj1,
        obj2,
    )
    return sum(jax.tree_util.tree_leaves(terms))


def squared_norm(obj: Any) -> jax.Array:
    """The squared Euclidean norm over all leaves."""
    return sum(jnp.sum(jnp.square(x)) for x in jax.tree_util.tree_leaves(obj))


def norm(obj: Any) -> jax.Array:
    """The Euclidean norm over all leaves."""
    return jnp.sqrt(squared_norm(obj))


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _sqrt_bounded_derivative(x: jax.Array, max_gradient: float) -> jax.Array:
    return jnp.sqrt(x)


@_sqrt_bounded_derivative.defjvp
def _sqrt_bounded_jvp(max_gradient, primals, tangents):
    (x,), (dx,) = primals, tangents
    floor = jnp.maximum(x, 1.0 / (4.0 * max_gradient**2))  # where 1 / (2 sqrt) hits the bound
    return jnp.sqrt(x), dx / (2.0 * jnp.sqrt(floor))


def stable_sqrt(x: jax.Array) -> jax.Array:
    """``sqrt(x)`` whose derivative is capped at 1000 (finite at 0), as kfac-jax's."""
    return _sqrt_bounded_derivative(x, 1000.0)


def cosine_similarity(v1: Any, v2: Any) -> jax.Array:
    """The cosine of the angle between two pytrees seen as vectors."""
    return inner_product(v1, v2) / (norm(v1) * norm(v2))


def psd_inv(matrix: jax.Array) -> jax.Array:
    """The inverse of a PSD matrix (`kfacx.linalg.psd_inverse` without damping: only its
    floor of one rounding of the trace keeps a singular matrix invertible).

    Raises:
      ValueError: if the matrix is not square.
    """
    if matrix.ndim != 2 or matrix.shape[0] != matrix.shape[1]:
        raise ValueError(f"psd_inv: expected a square matrix, got shape {matrix.shape}.")
    return linalg.psd_inverse(matrix, jnp.zeros((), matrix.dtype))


def psd_solve(matrix: jax.Array, vector: jax.Array) -> jax.Array:
    """``matrix^-1 vector`` for a PSD matrix."""
    return psd_inv(matrix) @ vector


def safe_psd_eigh(x: jax.Array, force_on_host: bool = False) -> tuple[jax.Array, jax.Array]:
    """Eigenvalues (clipped at zero) and eigenvectors of a PSD matrix."""
    del force_on_host
    return linalg.safe_eigh(x)


def psd_matrix_norm(
    matrix: jax.Array, norm_type: str = "avg_diag", method_2norm: str = "lobpcg", rng_key=None
) -> jax.Array:
    """A norm of a PSD matrix, a vector (a diagonal) or a scalar: ``avg_diag`` (trace over
    size), ``avg_fro`` (Frobenius over size) or ``fro``.

    Raises:
      ValueError: for another ``norm_type``.
    """
    del method_2norm, rng_key
    if matrix.ndim <= 1:
        diag = jnp.abs(matrix.reshape(-1))
        if norm_type == "avg_diag":
            return jnp.mean(diag)
        sq = jnp.sqrt(jnp.sum(diag**2))
        return sq / diag.size if norm_type == "avg_fro" else sq
    if norm_type == "avg_diag":
        return jnp.trace(matrix) / matrix.shape[0]
    if norm_type == "avg_fro":
        return jnp.linalg.norm(matrix) / matrix.shape[0]
    if norm_type == "fro":
        return jnp.linalg.norm(matrix)
    raise ValueError(
        f"psd_matrix_norm: norm_type {norm_type!r} is not served by kfacx.kfac_jax; use "
        "'avg_diag', 'avg_fro' or 'fro' (kfacx.blocks.block_norm serves kfacx's blocks)."
    )


def _identity_like(f: jax.Array) -> jax.Array:
    return jnp.eye(f.shape[0], dtype=f.dtype) if f.ndim == 2 else jnp.ones_like(f)


def pi_adjusted_kronecker_factors(*factors: jax.Array, damping: Any) -> tuple[jax.Array, ...]:
    """Factors whose Kronecker product approximates ``kron(*factors) + damping I``: each
    factor normalised to unit average diagonal, the damping split equally between the
    non-scalar ones and the norms' geometric mean distributed back (Martens & Grosse's
    "pi" damping, generalised to any number of factors, as kfac-jax's). Factors are
    2-D matrices, vectors (diagonals) or scalars."""
    k = len(factors)
    damping = jnp.asarray(damping, jnp.result_type(*factors))
    norms = jnp.stack([psd_matrix_norm(f) for f in factors])
    num_non_scalars = sum(f.size != 1 for f in factors)

    def regular() -> tuple[jax.Array, ...]:
        if num_non_scalars == 0:
            c_k = jnp.power(jnp.prod(norms) + damping, 1.0 / k)
            return tuple(jnp.ones_like(f) * c_k for f in factors)
        c_k = jnp.exp(jnp.mean(jnp.log(norms)))
        c_non_scalar = c_k ** (float(k) / num_non_scalars)
        d_hat = jnp.power(damping, 1.0 / num_non_scalars) / c_non_scalar
        out = []
        for f, n in zip(factors, norms, strict=True):
            u = f / n
            if u.size == 1:
                out.append(jnp.ones_like(u) * c_k)
            else:
                out.append((u + d_hat * _identity_like(u)) * c_k)
        return tuple(out)

    def zero() -> tuple[jax.Array, ...]:
        c_k = jnp.power(damping, 1.0 / k)
        return tuple(c_k * _identity_like(f) for f in factors)

    if get_special_case_zero_inv():
        return jax.lax.cond(jnp.min(norms) > 0, regular, zero)
    return regular()


def invert_psd_matrices(matrices: Any) -> Any:
    """The inverse of every PSD matrix (2-D), diagonal (vector) or scalar of a pytree."""
    return jax.tree_util.tree_map(lambda m: psd_inv(m) if m.ndim == 2 else 1.0 / m, matrices)


def inverse_sqrt_psd_matrices(matrices: Any) -> Any:
    """The inverse square root of every PSD matrix, diagonal or scalar of a pytree."""

    def one(m):
        if m.ndim == 2:
            return linalg.psd_matpower(m, -0.5, jnp.zeros((), m.dtype))
        return 1.0 / jnp.sqrt(m)

    return jax.tree_util.tree_map(one, matrices)


def pi_adjusted_kronecker_inverse(*factors: jax.Array, damping: Any) -> tuple[jax.Array, ...]:
    """The inverses of `pi_adjusted_kronecker_factors`: their Kronecker product
    approximates ``(kron(*factors) + damping I)^-1``."""
    return invert_psd_matrices(pi_adjusted_kronecker_factors(*factors, damping=damping))


def kronecker_product_axis_mul_v(
    factors: Sequence[jax.Array | None],
    v: jax.Array,
    axis_groups: Sequence[Sequence[int]] | None = None,
    transpose: bool | Sequence[bool] = False,
) -> jax.Array:
    """``kron(*factors) rvec(v)`` with factor ``i`` acting on axis ``i`` of ``v`` (None:
    the identity; a vector: a diagonal). ``axis_groups`` is not served.

    Raises:
      NotImplementedError: with ``axis_groups``.
    """
    if axis_groups is not None:
        raise NotImplementedError(
            "kronecker_product_axis_mul_v: axis_groups is not served by kfacx.kfac_jax; "
            "reshape v so that each factor acts on one axis."
        )
    transposes = [transpose] * len(factors) if isinstance(transpose, bool) else list(transpose)
    for axis, (f, t) in enumerate(zip(factors, transposes, strict=True)):
        if f is None:
            continue
        if f.ndim <= 1:
            shape = [1] * v.ndim
            shape[axis] = -1
            v = v * f.reshape(shape)
            continue
        f = f.T if t else f
        v = jnp.moveaxis(jnp.tensordot(f, v, axes=[[1], [axis]]), 0, axis)
    return v


def kronecker_eigen_basis_axis_mul_v(
    q_factors: Sequence[jax.Array], eigenvalues: jax.Array, v: jax.Array
) -> jax.Array:
    """``Q diag(eigenvalues) Q^T rvec(v)`` with ``Q = kron(*q_factors)`` acting per axis."""
    v = kronecker_product_axis_mul_v(q_factors, v, transpose=True)
    return kronecker_product_axis_mul_v(q_factors, v * eigenvalues)


def rearrange(x: jax.Array, spec: str) -> jax.Array:
    """The subset of ``einops.rearrange`` kfac-jax's blocks use: a permutation and
    grouping of named axes (``"abc -> (ab)c"``), and ``1`` for a new unit axis
    (``"a -> 1a"``)."""
    left, right = (s.replace(" ", "") for s in spec.split("->"))
    if len(left) != x.ndim:
        raise ValueError(f"rearrange: spec {spec!r} names {len(left)} axes, x has {x.ndim}.")
    sizes = dict(zip(left, x.shape, strict=True))
    order = [c for c in right if c in sizes]
    y = jnp.transpose(x, [left.index(c) for c in order])
    shape, i = [], 0
    while i < len(right):
        if right[i] == "(":
            j = right.index(")", i)
            shape.append(math.prod(sizes[c] for c in right[i + 1 : j]))
            i = j + 1
        else:
            shape.append(1 if right[i] == "1" else sizes[right[i]])
            i += 1
    return y.reshape(shape)
