"""Tests of `kfacx.optimizer._quadratic_model`: the learning rate and momentum of the step."""

import jax.numpy as jnp
import numpy as np
import pytest

from kfacx.optimizer import _quadratic_model
from kfacx.optimizer._quadratic_model import QuadraticModel


@pytest.mark.parametrize("bounds", [None, (0.0, 1.0), (0.2, 0.5), (-1.0, -0.5)])
def test_adaptive_momentum_is_the_quadratic_minimiser_within_its_bounds(bounds):
    """The solved (-learning rate, momentum) satisfy the optimality (KKT) conditions of the
    2x2 quadratic model with the momentum constrained to ``bounds``."""
    rng = np.random.default_rng(0)
    for _ in range(200):
        a = rng.normal(size=(2, 2))
        m = a @ a.T + 1e-3 * np.eye(2)
        b = rng.normal(size=2) * rng.choice([0.1, 1.0, 10.0])
        c = np.asarray(_quadratic_model.solve_2x2(jnp.asarray(m), jnp.asarray(b), bounds))
        grad = m @ c + b
        np.testing.assert_allclose(grad[0], 0.0, atol=1e-4 * (1 + np.abs(b).max()))
        if bounds is None:
            np.testing.assert_allclose(grad[1], 0.0, atol=1e-4 * (1 + np.abs(b).max()))
            continue
        low, high = bounds
        assert low - 1e-6 <= c[1] <= high + 1e-6
        if c[1] > high - 1e-6:  # at the upper bound the model still falls towards larger values
            assert grad[1] <= 1e-4
        elif c[1] < low + 1e-6:
            assert grad[1] >= -1e-4
        else:
            np.testing.assert_allclose(grad[1], 0.0, atol=1e-4 * (1 + np.abs(b).max()))


def test_first_step_momentum_is_the_bound_nearest_zero():
    """With no velocity yet the momentum multiplies zero; it is reported as the value of
    ``momentum_bounds`` nearest 0 and the learning rate is the line minimiser."""
    m, b = jnp.array([[2.0, 0.0], [0.0, 0.0]]), jnp.array([-1.0, 0.0])
    np.testing.assert_allclose(_quadratic_model.solve_2x2(m, b, (0.0, 1.0)), [0.5, 0.0])
    np.testing.assert_allclose(_quadratic_model.solve_2x2(m, b, (0.3, 1.0)), [0.5, 0.3])


def test_fixed_coefficients_and_model_change_match_the_formula():
    precon, velocity, grads = [jnp.array([1.0, 2.0])], [jnp.array([0.5, -1.0])], [jnp.ones(2)]
    gram = jnp.array([[2.0, 0.5], [0.5, 1.0]])
    coeffs, model = _quadratic_model.fixed_coefficients(
        jnp.float32(0.1), jnp.float32(0.9), gram, grads, precon, velocity
    )
    np.testing.assert_allclose(coeffs, [-0.1, 0.9])
    np.testing.assert_allclose(model.norms, [[5.0, -1.5], [-1.5, 1.25]])
    np.testing.assert_allclose(model.linear, [3.0, -0.5])
    c = np.asarray(coeffs)
    want = 0.5 * c @ (gram + 0.25 * model.norms) @ c + c @ model.linear
    np.testing.assert_allclose(_quadratic_model.quadratic_model_change(model, coeffs, 0.25), want)


def test_adaptive_learning_rate_with_fixed_momentum_minimises_along_the_gradient_step():
    """With the momentum given, the learning rate is the minimiser of the damped model
    along ``precon`` with the momentum's share of ``velocity`` held fixed."""
    precon, velocity, grads = [jnp.array([1.0, 2.0])], [jnp.array([0.5, -1.0])], [jnp.ones(2)]
    gram = jnp.array([[2.0, 0.5], [0.5, 1.0]])
    coeffs, model = _quadratic_model.adaptive_coefficients(
        gram, grads, precon, velocity, jnp.float32(0.1), lambda: jnp.float32(0.5), None
    )
    assert isinstance(model, QuadraticModel)
    damped = np.asarray(gram + 0.1 * model.norms)
    assert float(coeffs[1]) == 0.5
    np.testing.assert_allclose(damped[0] @ np.asarray(coeffs) + model.linear[0], 0.0, atol=1e-6)


def test_norm_constraint_caps_the_step_length_in_the_curvature_metric():
    precon, grads = [jnp.array([3.0, 4.0])], [jnp.array([3.0, 4.0])]
    lr = jnp.float32(0.5)
    out = _quadratic_model.constrain_norm(precon, grads, lr, 1.0)
    # The length lr**2 p^T (C + damping I) p = lr**2 p^T g scales with the square.
    scale = float(out[0][0] / precon[0][0])
    np.testing.assert_allclose(float(lr**2 * scale**2 * (precon[0] @ grads[0])), 1.0, rtol=1e-6)
    kept = _quadratic_model.constrain_norm(precon, grads, lr, 100.0)
    np.testing.assert_array_equal(kept[0], precon[0])


def test_values_given_scheduled_or_missing():
    assert float(_quadratic_model.learning_rate_value(0.1, None, 0)) == np.float32(0.1)
    assert float(_quadratic_model.learning_rate_value(None, lambda s: s * 2.0, 3)) == 6.0
    with pytest.raises(ValueError, match="No learning rate"):
        _quadratic_model.learning_rate_value(None, None, 0)
    assert float(_quadratic_model.momentum_value(None, None, 0)) == 0.0
    assert float(_quadratic_model.momentum_value(None, lambda s: 0.9, 0)) == np.float32(0.9)
