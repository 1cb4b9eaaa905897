"""Robustness of `kfacx.linalg` against float64 numpy references: damping floors,
the Cholesky-to-eigh and float64 fallbacks, zero, non-finite and narrow-dtype input.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _linalg_cases import (
    _close,
    _f32,
    _indefinite,
    _jit_eigh,
    _jit_inverse,
    _jit_matpower,
    _matpower_ref,
    _psd,
)

from kfacx import linalg

# ----------------------------------------------------------------------------- robustness

EPS32 = float(np.finfo(np.float32).eps)
SQRT_TINY32 = float(np.sqrt(np.finfo(np.float32).tiny))


@jax.jit
def _jit_cholesky(m, damping):
    return jnp.linalg.cholesky(linalg.add_to_diagonal(m, damping))


def _cholesky_fails(m, damping):
    chol = _jit_cholesky(_f32(m), damping)
    return not np.all(np.isfinite(np.asarray(chol)))


def test_min_damping_rule():
    """``max(eps * trace, sqrt(tiny))``, non-finite or negative traces count as zero."""
    traces = _f32([64.0, 1.0, 0.0, -3.0, np.nan, np.inf])
    out = linalg.min_damping(traces, jnp.float32)
    expected = [64 * EPS32, EPS32] + [SQRT_TINY32] * 4
    np.testing.assert_allclose(out, expected, rtol=1e-6)
    np.testing.assert_allclose(linalg.min_damping(1.0, jnp.bfloat16), 2.0**-7, rtol=1e-6)


def test_floored_damping_rule():
    """``max(damping, n * eps * mean(|diag(m)|), sqrt(tiny))`` per matrix of a stack."""
    m = np.stack([np.diag([30.0, 10.0]), np.diag([-2.0, 2.0]), np.zeros((2, 2))])
    m = np.concatenate([m, np.full((1, 2, 2), np.nan)])
    floor = [40 * EPS32, 4 * EPS32, SQRT_TINY32, SQRT_TINY32]
    np.testing.assert_allclose(linalg.floored_damping(_f32(m), 0.0), floor, rtol=1e-6)
    np.testing.assert_allclose(
        linalg.floored_damping(_f32(m), 1e-12), floor[:2] + [1e-12, 1e-12], rtol=1e-6
    )
    # A damping above the floor is kept as it is.
    np.testing.assert_array_equal(linalg.floored_damping(_f32(m), 0.25), 0.25)
    per_matrix = _f32([1e-12, 0.5, 1e-30, 2.0])
    np.testing.assert_allclose(
        linalg.floored_damping(_f32(m), per_matrix), [floor[0], 0.5, SQRT_TINY32, 2.0], rtol=1e-6
    )


def test_psd_inverse_tiny_damping_uses_floor():
    """Damping 1e-12 on a rank-2 float32 factor of width 64: finite, and the inverse
    with the floored damping ``n * eps * mean(diag)`` (without the floor, float32
    Cholesky fails on such a matrix)."""
    x = np.random.default_rng(16).standard_normal((2, 64)).astype(np.float32)
    m = x.T @ x / 2
    m64 = np.asarray(m, np.float64)
    floor = EPS32 * np.trace(m64)
    assert _cholesky_fails(m, 1e-12)
    out = _jit_inverse(_f32(m), 1e-12)
    assert np.all(np.isfinite(np.asarray(out)))
    expected = np.linalg.inv(m64 + floor * np.eye(64))
    # The damped system is at the edge of float32's precision (condition ~ 1 / eps).
    _close(out, expected, rtol=0.25)
    power = _jit_matpower(_f32(m), -0.5, 1e-12)
    assert np.all(np.isfinite(np.asarray(power)))
    _close(power, _matpower_ref(m64, -0.5, floor), rtol=0.25)


@pytest.mark.parametrize("power", [-2.0, -1.0, -0.5])
def test_zero_matrix_zero_damping_is_finite(power):
    """A zero matrix with zero damping uses ``sqrt(tiny)``: finite up to power -2."""
    expected = SQRT_TINY32**power * np.eye(3)
    out = linalg.psd_matpower(jnp.zeros((3, 3)), power, 0.0)
    _close(out, expected, rtol=1e-5)
    if power == -1.0:
        _close(linalg.psd_inverse(jnp.zeros((3, 3)), 0.0), expected, rtol=1e-5)


def test_psd_inverse_cholesky_failure_falls_back_to_eigh():
    """An indefinite matrix: Cholesky gives NaN; the result is the eigh-based inverse with
    eigenvalues clipped at zero, ``(m_+ + d I)^-1``."""
    m, m64 = _indefinite()
    assert _cholesky_fails(m, 0.1)
    out = _jit_inverse(_f32(m), 0.1)
    _close(out, _matpower_ref(m64, -1.0, 0.1), rtol=1e-5)
    _close(out, _jit_matpower(_f32(m), -1.0, 0.1), rtol=1e-5)


def test_psd_inverse_stack_only_failing_matrix_falls_back():
    """In a stack, the matrices whose Cholesky succeeds keep the Cholesky result (equal to
    the inverse of each alone); only the failing one uses the eigh fallback."""
    rng = np.random.default_rng(17)
    good = _psd(rng, 3, k=2).astype(np.float32)
    bad, bad64 = _indefinite()
    stack = np.stack([good[0], bad, good[1]])
    damping = _f32([0.2, 0.1, 0.3])
    out = np.asarray(_jit_inverse(_f32(stack), damping))
    np.testing.assert_array_equal(out[0], _jit_inverse(_f32(good[0]), damping[0]))
    np.testing.assert_array_equal(out[2], _jit_inverse(_f32(good[1]), damping[2]))
    _close(out[1], _matpower_ref(bad64, -1.0, 0.1), rtol=1e-5)
    _close(out[0], np.linalg.inv(good[0] + 0.2 * np.eye(3)), rtol=1e-4)
    # The fallback is a lax.cond (skipped at run time when no matrix needs it).
    assert "cond" in str(jax.make_jaxpr(linalg.psd_inverse)(_f32(stack), damping))


def test_psd_inverse_fallback_under_jit_and_vmap():
    bad, bad64 = _indefinite()
    good = np.eye(3, dtype=np.float32)
    stack = _f32(np.stack([good, bad]))
    out = jax.jit(jax.vmap(linalg.psd_inverse, in_axes=(0, None)))(stack, 0.1)
    _close(out[0], np.eye(3) / 1.1, rtol=1e-6)
    _close(out[1], _matpower_ref(bad64, -1.0, 0.1), rtol=1e-5)


def _x64_case():
    """An indefinite float32 matrix with eigenvalues near zero, damping 1e-5: the
    eigendecomposition in float32 loses ~1e-3 of accuracy, in float64 none."""
    m, m64 = _indefinite(seed=0, vals=(-1.0, 1e-6, 3e-6, 1e-5, 0.5, 1.0))
    return m, _matpower_ref(m64, -1.0, 1e-5)


def test_psd_inverse_float64_retry_with_x64():
    m, expected = _x64_case()
    assert _cholesky_fails(m, 1e-5)
    with jax.enable_x64(True):
        m32 = jnp.asarray(m, jnp.float32)
        out = _jit_inverse(m32, jnp.float32(1e-5))
        jaxpr = str(jax.make_jaxpr(linalg.psd_inverse)(m32, jnp.float32(1e-5)))
    assert out.dtype == jnp.float32
    assert "eigh" in jaxpr and "f64[6,6]" in jaxpr
    _close(out, expected, rtol=1e-6)
    # Without x64 the fallback runs in float32 and is visibly less accurate (so the
    # check above does see the float64 retry).
    out32 = np.asarray(_jit_inverse(_f32(m), 1e-5), np.float64)
    assert np.abs(out32 - expected).max() > 1e-4 * np.abs(expected).max()
    assert "f64" not in str(jax.make_jaxpr(linalg.psd_inverse)(_f32(m), 1e-5))


def test_safe_eigh_float64_retry_only_when_needed():
    """x64 on, finite float32 input: the float64 eigh is only in the (skipped) fallback."""
    rng = np.random.default_rng(18)
    m = _psd(rng, 4).astype(np.float32)
    with jax.enable_x64(True):
        vals, vecs = _jit_eigh(jnp.asarray(m, jnp.float32))
    assert vals.dtype == vecs.dtype == jnp.float32
    _close(vals, np.linalg.eigvalsh(np.asarray(m, np.float64)), rtol=1e-5)


@pytest.mark.parametrize("bad", [np.nan, np.inf], ids=["nan", "inf"])
def test_non_finite_input_gives_scaled_identity(bad):
    """A NaN / Inf matrix: ``(1 / d) I`` from psd_inverse, ``d^p I`` from psd_matpower, zero
    eigenvalues and identity eigenvectors from safe_eigh; other matrices of the stack are
    unaffected."""
    rng = np.random.default_rng(19)
    good = _psd(rng, 3).astype(np.float32)
    broken = good.copy()
    broken[0, 1] = broken[1, 0] = bad
    stack = _f32(np.stack([good, broken]))
    damping = _f32([0.5, 0.25])

    def results(stack, damping):
        power = linalg.psd_matpower(stack, -0.5, damping)
        return linalg.psd_inverse(stack, damping), power, linalg.safe_eigh(stack)

    # one compilation instead of one per operation run eagerly
    inv, power, (vals, vecs) = jax.jit(results)(stack, damping)
    _close(inv[1], 4.0 * np.eye(3), rtol=1e-6)
    _close(inv[0], np.linalg.inv(good + 0.5 * np.eye(3)), rtol=1e-4)
    _close(power[1], 2.0 * np.eye(3), rtol=1e-6)
    np.testing.assert_array_equal(vals[1], 0.0)
    np.testing.assert_array_equal(vecs[1], np.eye(3))
    _close(vals[0], np.linalg.eigvalsh(good), rtol=1e-5)
    with jax.enable_x64(True):  # The float64 retry does not help; still finite.
        _close(jax.jit(linalg.psd_inverse)(stack, damping)[1], 4.0 * np.eye(3), rtol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_narrow_dtypes_computed_in_float32(dtype):
    rng = np.random.default_rng(20)
    m = _psd(rng, 4, rank=2)
    m_low = jnp.asarray(m, dtype)
    ref_m = np.asarray(jnp.asarray(m_low, jnp.float32), np.float64)
    inv = linalg.psd_inverse(m_low, 0.5)
    power = linalg.psd_matpower(m_low, -0.5, 0.5)
    vals, vecs = linalg.safe_eigh(m_low)
    assert {inv.dtype, power.dtype, vals.dtype, vecs.dtype} == {jnp.dtype(dtype)}
    _close(inv, np.linalg.inv(ref_m + 0.5 * np.eye(4)), rtol=1e-2)
    _close(power, _matpower_ref(ref_m, -0.5, 0.5), rtol=1e-2)
