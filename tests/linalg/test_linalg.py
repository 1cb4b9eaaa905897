"""Tests of `kfacx.linalg` against float64 numpy references: symmetrize,
add_to_diagonal, safe_eigh, psd_inverse, psd_matpower and pi-adjusted damping.

Robustness (damping floors, fallbacks, non-finite and narrow input) is tested in
tests/linalg/test_linalg_robustness.py, the batched (padded, bucketed) inverses in
tests/linalg/test_linalg_batched.py; shared helpers in tests/_linalg_cases.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _linalg_cases import _close, _f32, _jit_eigh, _jit_inverse, _jit_matpower, _matpower_ref, _psd

from kfacx import linalg

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


def test_eager_psd_powers_equal_the_jitted_ones_for_any_kind_of_power():
    """Eagerly, `psd_matpower` and `psd_inverse` run as one compiled program per shape and
    power; a power given as an array (not hashable) still works, and every form gives the
    jitted function's result."""
    rng = np.random.default_rng(9)
    m = _f32(_psd(rng, 4, rank=2))
    want = jax.jit(linalg.psd_matpower, static_argnums=1)(m, -0.5, 0.3)
    for power in (-0.5, np.float32(-0.5), jnp.float32(-0.5), np.asarray(-0.5)):
        np.testing.assert_allclose(linalg.psd_matpower(m, power, 0.3), want, rtol=1e-6)
    np.testing.assert_allclose(
        linalg.psd_inverse(m, 0.3), jax.jit(linalg.psd_inverse)(m, 0.3), rtol=1e-6
    )


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
