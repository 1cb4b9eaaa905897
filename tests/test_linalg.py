"""Tests of `kfacx.linalg` against float64 numpy references."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kfacx import linalg
from kfacx.linalg import _inverse


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
# functions compiles on its own. The cheap tests above the robustness section call the
# functions eagerly.
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


# ----------------------------------------------------------------------------- symmetrize


def test_symmetrize():
    rng = np.random.default_rng(0)
    m = rng.standard_normal((3, 4, 4))
    out = linalg.symmetrize(_f32(m))
    assert out.shape == (3, 4, 4)
    _close(out, (m + np.swapaxes(m, -1, -2)) / 2)
    np.testing.assert_array_equal(out, np.swapaxes(np.asarray(out), -1, -2))
    # Idempotent; the identity on symmetric matrices.
    np.testing.assert_array_equal(linalg.symmetrize(out), out)
    _close(linalg.symmetrize(_f32(m[0])), (m[0] + m[0].T) / 2)


# ----------------------------------------------------------------------------- add_to_diagonal


def test_add_to_diagonal_single():
    m = np.arange(9.0).reshape(3, 3)
    out = linalg.add_to_diagonal(_f32(m), 2.5)
    assert out.dtype == jnp.float32
    _close(out, m + 2.5 * np.eye(3))


def test_add_to_diagonal_stack_per_matrix_values():
    m = np.arange(18.0).reshape(2, 3, 3)
    out = linalg.add_to_diagonal(_f32(m), _f32([1.0, -2.0]))
    _close(out, m + np.array([1.0, -2.0])[:, None, None] * np.eye(3))


def test_add_to_diagonal_stack_scalar_value():
    m = np.arange(18.0).reshape(2, 3, 3)
    _close(linalg.add_to_diagonal(_f32(m), 0.5), m + 0.5 * np.eye(3))


# ----------------------------------------------------------------------------- safe_eigh


def test_safe_eigh_psd_reconstructs():
    rng = np.random.default_rng(1)
    m = _psd(rng, 5, k=3)
    vals, vecs = _jit_eigh(_f32(m))
    assert vals.shape == (3, 5) and vecs.shape == (3, 5, 5)
    _close((vecs * vals[:, None, :]) @ np.swapaxes(vecs, -1, -2), m, rtol=1e-5)
    _close(vals, np.linalg.eigvalsh(m), rtol=1e-5)
    _close(np.swapaxes(vecs, -1, -2) @ vecs, np.broadcast_to(np.eye(5), (3, 5, 5)), rtol=1e-5)


def test_safe_eigh_clips_negative_eigenvalues():
    rng = np.random.default_rng(2)
    q, _ = np.linalg.qr(rng.standard_normal((4, 4)))
    true_vals = np.array([-1.0, -1e-3, 0.5, 2.0])
    m = (q * true_vals) @ q.T
    vals, vecs = linalg.safe_eigh(_f32(m))
    np.testing.assert_array_equal(np.asarray(vals)[:2], 0.0)
    _close(vals, np.maximum(true_vals, 0.0), rtol=1e-5)
    assert np.all(np.asarray(vals) >= 0.0)
    # The eigenvectors are still those of m.
    _close(np.asarray(vecs).T @ m @ np.asarray(vecs), np.diag(true_vals), rtol=1e-5)


def test_safe_eigh_symmetrizes_input():
    rng = np.random.default_rng(3)
    s = _psd(rng, 4)
    skew = rng.standard_normal((4, 4))
    skew = skew - skew.T
    vals, _ = linalg.safe_eigh(_f32(s + skew))
    _close(vals, np.linalg.eigvalsh(s), rtol=1e-5)


# ----------------------------------------------------------------------------- psd_inverse


@pytest.mark.parametrize("rank", [5, 2, 0], ids=["full_rank", "rank_deficient", "zero"])
def test_psd_inverse_single(rank):
    rng = np.random.default_rng(4)
    m = _psd(rng, 5, rank) if rank else np.zeros((5, 5))
    out = linalg.psd_inverse(_f32(m), 0.3)
    assert out.dtype == jnp.float32
    _close(out, np.linalg.inv(m + 0.3 * np.eye(5)), rtol=1e-4)


def test_psd_inverse_1x1():
    _close(_jit_inverse(_f32([[2.0]]), 0.5), [[0.4]])


def test_psd_inverse_uses_symmetric_part():
    rng = np.random.default_rng(5)
    s = _psd(rng, 4)
    skew = np.triu(rng.standard_normal((4, 4)), 1)
    skew = skew - skew.T
    _close(_jit_inverse(_f32(s + skew), 0.2), np.linalg.inv(s + 0.2 * np.eye(4)), 1e-4)


def test_psd_inverse_stack():
    rng = np.random.default_rng(6)
    m = _psd(rng, 4, k=3)
    damping = np.array([0.1, 0.5, 1.0])
    out = _jit_inverse(_f32(m), _f32(damping))
    _close(
        out,
        np.stack([np.linalg.inv(a + d * np.eye(4)) for a, d in zip(m, damping, strict=True)]),
        1e-4,
    )


# ----------------------------------------------------------------------------- psd_matpower


@pytest.mark.parametrize("power", [-1.0, -0.5, -0.25, 0.5, 1.0, 2.0])
def test_psd_matpower_single(power):
    rng = np.random.default_rng(7)
    m = _psd(rng, 5, rank=3)
    out = linalg.psd_matpower(_f32(m), power, 0.2)
    assert out.shape == (5, 5) and out.dtype == jnp.float32
    _close(out, _matpower_ref(m, power, 0.2), rtol=1e-4)


def test_psd_matpower_matches_psd_inverse():
    rng = np.random.default_rng(8)
    m = _f32(_psd(rng, 4))
    _close(_jit_matpower(m, -1.0, 0.3), _jit_inverse(m, 0.3), rtol=1e-4)


def test_psd_matpower_clips_negative_eigenvalues():
    """Negative eigenvalues count as zero: ``(0 + damping)^power``."""
    q, _ = np.linalg.qr(np.random.default_rng(9).standard_normal((3, 3)))
    m = (q * np.array([-0.5, 1.0, 3.0])) @ q.T
    out = _jit_matpower(_f32(m), -0.5, 0.25)
    _close(out, (q * np.array([0.25, 1.25, 3.25]) ** -0.5) @ q.T, rtol=1e-5)
    assert np.all(np.isfinite(np.asarray(out)))


def test_psd_matpower_stack_per_matrix_damping():
    rng = np.random.default_rng(10)
    m = _psd(rng, 4, rank=2, k=3)
    damping = np.array([0.1, 0.5, 1.0])
    out = _jit_matpower(_f32(m), -0.5, _f32(damping))
    _close(
        out,
        np.stack([_matpower_ref(a, -0.5, d) for a, d in zip(m, damping, strict=True)]),
        rtol=1e-4,
    )


def test_psd_matpower_stack_scalar_damping():
    rng = np.random.default_rng(11)
    m = _psd(rng, 4, k=2)
    out = _jit_matpower(_f32(m), -1.0, 0.5)
    _close(out, np.stack([_matpower_ref(a, -1.0, 0.5) for a in m]), rtol=1e-4)


# ----------------------------------------------------------------------------- pi damping


def _pi_ref(a, g, damping):
    ta, tg = np.trace(a) / a.shape[0], np.trace(g) / g.shape[0]
    pi = np.sqrt(ta / tg)
    return pi * np.sqrt(damping), np.sqrt(damping) / pi


def test_pi_adjusted_damping_formula():
    rng = np.random.default_rng(12)
    a, g = _psd(rng, 4) * 3.0, _psd(rng, 2)
    d_a, d_g = linalg.pi_adjusted_damping(_f32(a), _f32(g), 0.3)
    assert d_a.shape == () and d_g.shape == ()
    ref_a, ref_g = _pi_ref(a, g, 0.3)
    _close(d_a, ref_a)
    _close(d_g, ref_g)
    _close(d_a * d_g, 0.3)  # The product of the two dampings is the damping.


def test_pi_adjusted_damping_stack():
    rng = np.random.default_rng(13)
    a, g = _psd(rng, 3, k=2), _psd(rng, 5, k=2)
    a[1] *= 10.0
    d_a, d_g = linalg.pi_adjusted_damping(_f32(a), _f32(g), 0.5)
    assert d_a.shape == (2,) and d_g.shape == (2,)
    refs = [_pi_ref(ai, gi, 0.5) for ai, gi in zip(a, g, strict=True)]
    _close(d_a, [r[0] for r in refs])
    _close(d_g, [r[1] for r in refs])


@pytest.mark.parametrize(
    ("a_scale", "g_scale"),
    [(0.0, 1.0), (1.0, 0.0), (0.0, 0.0), (np.inf, 1.0), (1.0, np.inf), (np.nan, 1.0)],
    ids=["zero_a", "zero_g", "both_zero", "inf_a", "inf_g", "nan_a"],
)
def test_pi_adjusted_damping_degenerate_traces(a_scale, g_scale):
    """A zero or non-finite trace gives ``pi = 1``: both dampings ``sqrt(damping)``, finite."""
    a, g = np.diag(np.full(3, a_scale)), np.diag(np.full(2, g_scale))
    d_a, d_g = linalg.pi_adjusted_damping(_f32(a), _f32(g), 0.25)
    np.testing.assert_allclose(d_a, 0.5, rtol=1e-6)
    np.testing.assert_allclose(d_g, 0.5, rtol=1e-6)


def test_pi_adjusted_damping_mixed_stack():
    """Degenerate pairs in a stack do not affect the others."""
    a = np.stack([np.zeros((2, 2)), 4.0 * np.eye(2)])
    g = np.stack([np.eye(2), np.eye(2)])
    d_a, d_g = linalg.pi_adjusted_damping(_f32(a), _f32(g), 1.0)
    _close(d_a, [1.0, 2.0])
    _close(d_g, [1.0, 0.5])


def test_pi_adjusted_damping_zero_damping():
    rng = np.random.default_rng(14)
    d_a, d_g = linalg.pi_adjusted_damping(_f32(_psd(rng, 3)), _f32(_psd(rng, 3)), 0.0)
    np.testing.assert_array_equal(d_a, 0.0)
    np.testing.assert_array_equal(d_g, 0.0)


def test_pi_adjusted_damping_jit_and_grad():
    """Jits, and is differentiable with finite gradients even at a zero trace."""
    a, g = jnp.zeros((3, 3)), jnp.eye(2)
    fn = jax.jit(lambda a_, g_, d: sum(linalg.pi_adjusted_damping(a_, g_, d)))
    _close(fn(a, g, 0.25), 1.0)
    grads = jax.jit(jax.grad(lambda a_: sum(linalg.pi_adjusted_damping(a_, g, 0.25))))(a)
    assert np.all(np.isfinite(np.asarray(grads)))


# ----------------------------------------------------------------------------- robustness

EPS32 = float(np.finfo(np.float32).eps)
SQRT_TINY32 = float(np.sqrt(np.finfo(np.float32).tiny))


def _indefinite(seed=15, vals=(-1.0, 0.5, 2.0)):
    """A float32 symmetric matrix with the given eigenvalues (one negative), and the
    float64 copy of its rounded entries."""
    q, _ = np.linalg.qr(np.random.default_rng(seed).standard_normal((len(vals), len(vals))))
    m = ((q * np.array(vals)) @ q.T).astype(np.float32)
    m = (m + m.T) / 2
    return m, np.asarray(m, np.float64)


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


# ----------------------------------------------------------------------------- batched inverses


def test_size_buckets_group_sizes_within_the_growth_bound():
    assert linalg.size_buckets([785, 1000, 31, 1001, 30]) == [
        (1001, [3, 1]),
        (785, [0]),
        (64, [2, 4]),  # Small sizes share one bucket of min_size.
    ]
    # 8 * 1.05 < 9: no bucket; equal sizes always share one; ties keep the input order.
    assert linalg.size_buckets([8, 9, 9, 3], min_size=1) == [(9, [1, 2]), (8, [0]), (3, [3])]
    assert linalg.size_buckets([8, 9], max_growth=1.2, min_size=1) == [(9, [1, 0])]
    assert linalg.size_buckets([8, 9, 70], min_size=16) == [(70, [2]), (16, [1, 0])]
    assert linalg.size_buckets([]) == []


def test_diagonal_sums_and_floored_damping_vector_match_each_matrix():
    """One pass over all diagonals gives each stack's traces and ``|diag|`` sums, and the
    flat vector of floored dampings equals `floored_damping` of each stack."""
    rng = np.random.default_rng(5)
    matrices = [_f32(_psd(rng, 5, k=2)), _f32(-np.eye(3)), _f32(_psd(rng, 4) * 1e-30)]
    traces, absolute = linalg.diagonal_sums(matrices)
    for m, t, a in zip(matrices, traces, absolute, strict=True):
        assert t.shape == m.shape[:-2]
        np.testing.assert_allclose(t, np.trace(m, axis1=-2, axis2=-1), rtol=1e-6)
        np.testing.assert_allclose(a, np.abs(np.diagonal(m, axis1=-2, axis2=-1)).sum(-1), rtol=1e-6)
    dampings = [_f32([0.5, 1e-12]), 0.0, 0.0]
    flat = linalg.floored_damping_vector(matrices, dampings)
    each = [
        np.broadcast_to(linalg.floored_damping(m, d), m.shape[:-2]).reshape(-1)
        for m, d in zip(matrices, dampings, strict=True)
    ]
    np.testing.assert_allclose(flat, np.concatenate(each), rtol=1e-6)
    # The dampings may be a function of the flat vector of traces.
    by_trace = linalg.floored_damping_vector(matrices, lambda tr: tr * 0 + 0.25)
    np.testing.assert_allclose(by_trace, 0.25)
    traces_seen = []
    linalg.floored_damping_vector(matrices, lambda tr: traces_seen.append(tr) or 1.0)
    np.testing.assert_allclose(traces_seen[0], np.concatenate([np.ravel(t) for t in traces]))
    assert linalg.floored_damping_vector([], []).shape == (0,)


def test_block_inverse_above_the_base_matches_float64(monkeypatch):
    """Matrices larger than the block base (here 16: sizes 37 and 70 recurse two and three
    levels, with odd halves) are inverted by block elimination to float32 accuracy,
    for a single matrix and a stack, ill-conditioned included; an indefinite matrix
    gives NaN everywhere (so that `psd_inverse` takes its eigh fallback)."""
    monkeypatch.setattr(_inverse, "_BLOCK_INVERSE_BASE", 16)
    # One program per shape, as in use; a new function, so that no trace made with
    # another base is reused.
    inverse = jax.jit(lambda m: _inverse._inverse_by_cholesky(m))
    rng = np.random.default_rng(8)
    for n in (37, 70):
        x = rng.standard_normal((3 * n, n)) * np.logspace(0, -2, n)
        a = x.T @ x / (3 * n) + 1e-3 * np.eye(n)
        stack = np.stack([a, _psd(rng, n) + 0.1 * np.eye(n)])
        out = inverse(_f32(stack))
        for o, m in zip(np.asarray(out, np.float64), stack, strict=True):
            expected = np.linalg.inv(np.asarray(_f32(m), np.float64))
            assert np.abs(o - expected).max() <= 2e-4 * np.abs(expected).max()
            assert np.abs(o - o.T).max() <= 1e-5 * np.abs(expected).max()
        plain = jax.jit(jnp.linalg.inv)(_f32(a))  # an independent float32 inverse, for scale
        assert np.abs(np.asarray(out[0]) - np.asarray(plain)).max() < 1e-2 * np.abs(plain).max()
        # Like the Cholesky path, only the lower triangle is read.
        skewed = np.tril(a) + np.triu(rng.standard_normal((n, n)), 1)
        np.testing.assert_array_equal(inverse(_f32(skewed)), inverse(_f32(a)))
    q, _ = np.linalg.qr(rng.standard_normal((40, 40)))
    indefinite = (q * np.linspace(-1.0, 2.0, 40)) @ q.T
    assert np.all(np.isnan(np.asarray(inverse(_f32(indefinite)))))
    # A new function: no trace made with another base is reused.
    out = jax.jit(lambda m, d: linalg.psd_inverse(m, d))(_f32(indefinite), 0.1)
    _close(out, _matpower_ref(np.asarray(_f32(indefinite), np.float64), -1.0, 0.1), rtol=1e-4)


def test_failed_block_inverse_is_caught_from_its_diagonal(monkeypatch):
    """`_finite_inverse` reads only the diagonal of each inverse: a matrix whose leading
    block is indefinite, one whose Schur complement is (the leading block positive
    definite), and one that is singular to float32 are all flagged, like a check of
    every entry; the good matrix of the stack is not."""
    monkeypatch.setattr(_inverse, "_BLOCK_INVERSE_BASE", 16)
    rng = np.random.default_rng(9)
    n = 37
    good = _psd(rng, n) + 0.1 * np.eye(n)
    lead_bad = good.copy()
    lead_bad[:5, :5] -= 50.0 * np.eye(5)  # inside the leading 18 x 18 block
    schur_bad = good.copy()
    schur_bad[-5:, -5:] -= 50.0 * np.eye(5)  # in the trailing block only
    assert np.linalg.eigvalsh(schur_bad[:18, :18]).min() > 0
    v = rng.standard_normal((n, 3))
    singular = v @ v.T  # rank 3
    stack = _f32(np.stack([good, lead_bad, schur_bad, singular]))

    @jax.jit  # a new function (no trace made with another base); one compilation
    def run(stack):
        out = _inverse._inverse_by_cholesky(stack)
        padded = linalg.pad_stack([stack], jnp.full((4,), 1e-30), 40)
        return out, _inverse._finite_inverse(out), linalg.cholesky_inverse_padded(padded)[1]

    out, finite, ok = run(stack)
    every_entry = np.isfinite(np.asarray(out)).all(axis=(-2, -1))
    np.testing.assert_array_equal(every_entry, [True, False, False, False])
    np.testing.assert_array_equal(finite, every_entry)
    np.testing.assert_array_equal(ok, [1.0, 0.0, 0.0, 0.0])


def test_psd_inverse_padded_equals_psd_inverse_of_each_matrix():
    """Stacks of several sizes and dampings padded to one size and inverted together equal
    `psd_inverse` of each; an indefinite matrix in the group still takes the eigh
    fallback (with its own damping floor, not the padded matrix's)."""
    rng = np.random.default_rng(3)
    bad, bad64 = _indefinite()  # 3 x 3
    matrices = [
        _f32(_psd(rng, 5, rank=2, k=2)),
        _f32(_psd(rng, 4)),
        _f32(np.stack([bad, _psd(rng, 3)])[None]),  # [1, 2, 3, 3]
    ]
    dampings = [_f32([0.5, 0.25]), 1e-3, _f32([[0.1, 0.2]])]

    @jax.jit  # one compilation instead of one per operation run eagerly
    def inverses(matrices):
        out = linalg.crop_padded(linalg.psd_inverse_padded(matrices, dampings, 5), matrices)
        each = [
            linalg.psd_inverse(m, jnp.broadcast_to(jnp.asarray(d, jnp.float32), m.shape[:-2]))
            for m, d in zip(matrices, dampings, strict=True)
        ]
        return out, each

    out, each = inverses(matrices)
    for m, o, want in zip(matrices, out, each, strict=True):
        assert o.shape == m.shape and o.dtype == m.dtype
        _close(o, want, rtol=1e-5)
    _close(out[2][0, 0], _matpower_ref(bad64, -1.0, 0.1), rtol=1e-5)
    # One factorisation per group, in a loop: no batched LAPACK call.
    jaxpr = str(jax.make_jaxpr(lambda *m: linalg.psd_inverse_padded(m, dampings, 5))(*matrices))
    single = str(jax.make_jaxpr(linalg.psd_inverse)(matrices[1], 1e-3))
    assert jaxpr.count("cholesky") == single.count("cholesky") and "scan" in jaxpr


def test_padded_stack_functions_reject_bad_shapes_and_counts():
    square = jnp.eye(3)
    with pytest.raises(ValueError, match=r"pad_stack: matrices\[1\] is 5 x 5, larger than"):
        linalg.pad_stack([square, jnp.eye(5)], [1.0, 1.0], 4)
    with pytest.raises(ValueError, match=r"matrices\[0\] has shape \(3, 2\); expected a stack"):
        linalg.pad_stack([jnp.ones((3, 2))], [1.0], 4)
    with pytest.raises(ValueError, match="got 1 dampings for 2 matrices"):
        linalg.pad_stack([square, square], [1.0], 4)
    with pytest.raises(ValueError, match=r"floors has shape \(3,\); .* shape \(2,\)"):
        linalg.pad_stack([square, square], jnp.ones(3), 4)
    with pytest.raises(ValueError, match="no matrices"):
        linalg.pad_stack([], [], 4)
    with pytest.raises(TypeError, match="takes a PaddedStack"):
        linalg.cholesky_inverse_padded(jnp.ones((1, 3, 3)))
    with pytest.raises(ValueError, match="psd_inverse_padded: .* larger than the padded size 2"):
        linalg.psd_inverse_padded([square], [1.0], 2)
    with pytest.raises(ValueError, match="floored_damping_vector: got 2 dampings for 1"):
        linalg.floored_damping_vector([square], [1.0, 2.0])
    with pytest.raises(ValueError, match=r"dampings function returned shape \(2,\); .* \(1,\)"):
        linalg.floored_damping_vector([square], lambda traces: jnp.ones(2))
    with pytest.raises(ValueError, match="floored_dampings: got 0 dampings for 1"):
        linalg.floored_dampings([square], [])


def test_pi_damping_vector_equals_the_split_of_each_pair():
    """The vectorised pi split over a flat vector of traces equals
    `pi_damping_from_traces` pair by pair, including the pi = 1 cases (a zero, negative
    or non-finite trace)."""
    traces_a = _f32([4.0, 0.0, 3.0, np.inf])
    traces_g = _f32([0.5, 2.0, -1.0, 1.0])
    dims_a, dims_g = 5, 3
    # Flat layout: the four a-traces, then the four g-traces.
    traces = jnp.concatenate([traces_a, traces_g])
    a, g = np.arange(4), np.arange(4, 8)
    first = np.concatenate([a, a])
    second = np.concatenate([g, g])
    dims = np.array([dims_a] * 4 + [dims_g] * 4)
    got = linalg.pi_damping_vector(traces, dims, first, second, 0.3)
    d_a, d_g = linalg.pi_damping_from_traces(traces_a, traces_g, dims_a, dims_g, 0.3, jnp.float32)
    np.testing.assert_array_equal(got, np.concatenate([d_a, d_g]))
    np.testing.assert_allclose(got[0] * got[4], 0.3, rtol=1e-6)
    np.testing.assert_allclose(got[1:4], np.sqrt(0.3), rtol=1e-6)  # pi = 1


def test_stack_padded_and_pi_damping_reject_bad_input():
    from kfacx import _refresh
    from kfacx.blocks import InverseRefresh

    with pytest.raises(ValueError, match=r"stack_padded: matrices\[0\] is 3 x 3, larger than"):
        linalg.stack_padded([jnp.eye(3)], 2)
    lone = InverseRefresh((jnp.eye(3),), linalg.PiDamping(1.0), lambda inverses: None)
    with pytest.raises(ValueError, match="PiDamping needs exactly two matrices"):
        _refresh._floors([lone], [jnp.eye(3)], None)
    # Sums and padded stacks agree with the unpadded diagonals.
    stacks = [linalg.stack_padded([_f32(np.diag([1.0, -2.0]))], 4)]
    np.testing.assert_allclose(linalg.padded_diagonal_sums(stacks), [[-1.0], [3.0]])
