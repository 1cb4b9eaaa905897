"""Helpers of the `kfacx.linalg` tests (tests/linalg/test_linalg*.py): random PSD matrices,
float64 numpy references, jitted entry points, a relative closeness check, the batch sizes
of a compiled program's LAPACK calls.
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np

from kfacx import linalg


def _psd(rng, n, rank=None, k=None):
    """A random PSD matrix ``[n, n]`` (or a stack ``[k, n, n]``) of the given rank."""
    shape = (n, rank or n) if k is None else (k, n, rank or n)
    f = rng.standard_normal(shape)
    return f @ np.swapaxes(f, -1, -2) / n


def _matpower_ref(m, power, damping):
    vals, vecs = np.linalg.eigh((m + m.T) / 2)
    vals = np.maximum(vals, 0.0) + damping
    return (vecs * vals**power) @ vecs.T


def _f32(x):
    # Cast on the host: jnp.asarray's cast would compile a conversion per shape.
    return jnp.asarray(np.asarray(x, np.float32), jnp.float32)


# Jitted once per shape (and x64 setting): run eagerly, every operation of these
# functions compiles on its own. The cheap tests of tests/linalg/test_linalg.py (those before
# its robustness tests) call the functions eagerly.
_jit_inverse = jax.jit(linalg.psd_inverse)
_jit_matpower = jax.jit(linalg.psd_matpower, static_argnums=1)
_jit_eigh = jax.jit(linalg.safe_eigh)


def _close(actual, expected, rtol=1e-5):
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    assert actual.shape == expected.shape
    assert np.all(np.isfinite(actual))
    err = np.abs(actual - expected).max()
    assert err <= rtol * max(np.abs(expected).max(), 1e-30), err


def _indefinite(seed=15, vals=(-1.0, 0.5, 2.0)):
    """A float32 symmetric matrix with the given eigenvalues (one negative), and the
    float64 copy of its rounded entries."""
    q, _ = np.linalg.qr(np.random.default_rng(seed).standard_normal((len(vals), len(vals))))
    m = ((q * np.array(vals)) @ q.T).astype(np.float32)
    m = (m + m.T) / 2
    return m, np.asarray(m, np.float64)


def lapack_batches(hlo: str) -> list[int]:
    """How many matrices each LAPACK call of an optimized CPU module takes (read from the
    first array of its result)."""
    batches = []
    for line in hlo.splitlines():
        if 'custom_call_target="lapack_' in line:
            dims = re.search(r"= \(?[a-z0-9]+\[([\d,]*)\]", line).group(1)
            batches.append(math.prod(int(d) for d in dims.split(",")[:-2]))
    return batches
