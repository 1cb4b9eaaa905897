"""Helpers of the `kfacx.scale_by_kfac_eigen_adam` tests (tests/transform/test_eigen_adam*.py):
the run's constants, the autouse float64 fixture, a relative closeness check, the
NumPy reference of the second moment (eigenbases, rotations, change of basis, one
block's steps), and a small registered MLP with its (cached) estimator.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kfacx

B, STEPS, PERIOD, B2, EPS, LR = 24, 3, 2, 0.9, 1e-4, 0.05
TOL = 1e-8
COMPILER = {"xla_backend_optimization_level": 0}


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


def close(actual, expected, what: str, tol: float = TOL) -> None:
    """For every leaf of two pytrees of the same structure: float64, the same shape, and
    ``||actual - expected||_F <= tol ||expected||_F``."""

    def leaf(path, a, e):
        a, e, name = np.asarray(a), np.asarray(e), f"{what}{jax.tree_util.keystr(path)}"
        assert (a.dtype, a.shape) == (e.dtype, e.shape) and a.dtype == np.float64, name
        error, scale = np.linalg.norm(a - e), max(np.linalg.norm(e), 1e-300)
        assert error <= tol * scale, f"{name}: relative error {error / scale:.3g} > {tol:.3g}"

    jax.tree_util.tree_map_with_path(leaf, actual, expected)


def _eigenvectors(m: np.ndarray) -> np.ndarray:
    return np.linalg.eigh(m)[1]


def _bases(kind: str, factors: list[np.ndarray]):
    """``(U_A or None, U_G or None)`` of the block's factors (None: the identity)."""
    if kind == "ScaleAndShiftDiagonal":
        return None, None
    if kind == "EmbeddingKroneckerFactored":
        return None, _eigenvectors(factors[1])
    return _eigenvectors(factors[0]), _eigenvectors(factors[1])


def _t(x):
    return np.swapaxes(x, -1, -2)


def _rotate(v, bases, back=False):
    u_a, u_g = bases
    if u_g is not None:
        v = v @ (_t(u_g) if back else u_g)
    if u_a is not None:
        v = (u_a if back else _t(u_a)) @ v
    return v


def _change(nu, old, new):
    """``(R_A o R_A) nu (R_G o R_G)^T`` with ``R = U_new^T U_old`` (None: identity)."""
    for side in (1, 0):
        if new[side] is None:
            continue
        r = _t(new[side]) if old[side] is None else _t(new[side]) @ old[side]
        nu = nu @ _t(r**2) if side == 1 else r**2 @ nu
    return nu


def reference(layout, bases_of, steps: list[dict], index: int, rotate: bool):
    """Per step ``(nu, update)`` of the block ``index``, by hand: ``layout(grads)`` is its
    gradient in its layout, ``bases_of(factors)`` its eigenbases (None: identity)."""
    bases, nu, out = (None, None), None, []
    for t, step in enumerate(steps):
        v = layout(step["grads"])
        nu = np.zeros_like(v) if nu is None else nu
        if t % PERIOD == 0:
            new = bases_of(step["factors"][index])
            nu = _change(nu, bases, new) if rotate else nu
            bases = new
        c = _rotate(v, bases)
        nu = B2 * nu + (1 - B2) * c**2
        nu_hat = nu / (1 - B2 ** (t + 1))
        out.append((nu, _rotate(c / (np.sqrt(nu_hat) + EPS), bases, back=True)))
    return out


def _mlp_loss(p, batch):
    x, y = batch
    h = jnp.tanh(x @ p["w1"] + p["b1"][None])
    out = h @ p["w2"] + p["b2"][None]
    kfacx.register_squared_error_loss(out, y)
    return 0.5 * jnp.mean(jnp.sum((out - y) ** 2, axis=-1))


def _mlp(seed: int = 0):
    rng = np.random.default_rng(seed)
    params = dict(
        w1=rng.normal(size=(3, 4)),
        b1=0.1 * rng.normal(size=(4,)),
        w2=rng.normal(size=(4, 2)),
        b2=0.1 * rng.normal(size=(2,)),
    )
    batch = (rng.normal(size=(16, 3)), rng.normal(size=(16, 2)))
    return params, batch


@functools.cache
def _mlp_estimator(curvature_block: str = "kfac"):
    return kfacx.BlockDiagonalCurvature(_mlp_loss, curvature_block=curvature_block)
