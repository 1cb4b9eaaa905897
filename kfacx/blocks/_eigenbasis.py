"""A block's eigenbasis: rotating into it and back, and re-expressing a diagonal when it changes.

A Kronecker-factored curvature ``A (x) G`` (per feature group) is diagonal in the basis
``Q = U_A (x) U_G`` of its factors' eigenvectors; a parameter matrix ``V [n, m]`` has the
coordinates ``U_A^T V U_G`` there (`rotate`). A diagonal ``D`` in those coordinates
stands for the matrix ``Q diag(D) Q^T``; when the basis is refreshed to ``Q'``, the
diagonal of ``Q'^T Q diag(D) Q^T Q'`` is ``(R_A o R_A) D (R_G o R_G)^T`` with
``R = U_new^T U_old`` (`change_basis`): the nearest diagonal in the new basis to what
the old one described (EKFAC's scaling and SOAP's second moment are re-expressed so).
A basis None stands for the identity (a diagonal factor).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def _t(x: jax.Array) -> jax.Array:
    return jnp.swapaxes(x, -1, -2)


def identity_stack(size: int, dtype: Any, leading: tuple[int, ...] = ()) -> jax.Array:
    """Identity matrices ``[*leading, size, size]`` (a constant: no kernel to compile).

    The dtype is passed on: JAX 0.10's ``jnp.asarray`` of a NumPy array without one
    compiles a small program per shape when called eagerly (``jit(stage)``)."""
    eye = np.broadcast_to(np.eye(size, dtype=jnp.dtype(dtype)), (*leading, size, size))
    return jnp.asarray(eye, dtype=eye.dtype)


def rotate(
    v: jax.Array,
    inputs_basis: jax.Array | None,
    outputs_basis: jax.Array | None,
    inverse: bool = False,
) -> jax.Array:
    """``U_A^T v U_G`` (``inverse``: ``U_A v U_G^T``), batched over leading axes; ``v`` may
    be a vector ``[n]`` when ``outputs_basis`` is None."""
    out = v
    if outputs_basis is not None:
        out = out @ (_t(outputs_basis) if inverse else outputs_basis)
    if inputs_basis is not None:
        out = (inputs_basis if inverse else _t(inputs_basis)) @ out
    return out


def change_basis(diagonal: jax.Array, old_bases: tuple, new_bases: tuple) -> jax.Array:
    """``(R_A o R_A) D (R_G o R_G)^T`` with ``R = U_new^T U_old`` for the bases
    ``(U_A, U_G)`` (module docstring); ``D`` may be a vector when ``U_G`` is None."""
    (old_in, old_out), (new_in, new_out) = old_bases, new_bases
    out = diagonal
    if new_out is not None:
        out = out @ _t(jnp.square(_t(new_out) @ old_out))
    if new_in is not None:
        out = jnp.square(_t(new_in) @ old_in) @ out
    return out


def missing_eigenbasis(block: Any) -> NotImplementedError:
    """The error of a block that defines no eigenbasis."""
    return NotImplementedError(
        f"{block!r} does not define the eigenbasis of its curvature (to_eigenbasis, "
        "from_eigenbasis and eigenbasis_change). Implement them (see "
        "kfacx.TwoKroneckerFactored), set eigenbasis_is_identity = True on the class if its "
        "curvature is diagonal in the flattened parameters, or serve the layer with a block "
        f"that has one: layer_tag_to_block_ctor={{{block.layer.tag_name!r}: kfacx.Diagonal}}."
    )


def missing_cached_eigenbasis(block: Any) -> ValueError:
    """The error of a block whose cache holds no eigenbasis."""
    return ValueError(
        f"{block!r}: the cache holds no eigenbasis; create the state with init(..., "
        "cache_eigenvalues=True) (kfacx.scale_by_kfac_eigen_adam does) and refresh it with "
        "update_cache."
    )
