"""Tests of `kfacx.optimizer._damping`: choosing the damping and the Levenberg-Marquardt rule."""

import jax.numpy as jnp
import numpy as np
import pytest

from kfacx.optimizer import _damping
from kfacx.optimizer._configs import DampingConfig

ADAPTIVE = DampingConfig(use_adaptive_damping=True, initial_damping=1.0)


def test_choose_damping_prefers_adaptive_then_given_then_schedule_then_constant():
    current = jnp.float32(0.5)
    assert float(_damping.choose_damping(ADAPTIVE, current, 2.0, None, 0)) == 0.5
    fixed = DampingConfig(initial_damping=0.5)
    assert float(_damping.choose_damping(fixed, current, 2.0, lambda s: 3.0, 0)) == 2.0
    assert float(_damping.choose_damping(fixed, current, None, lambda s: s + 3.0, 1)) == 4.0
    assert float(_damping.choose_damping(fixed, current, None, None, 0)) == 0.5
    with pytest.raises(ValueError, match="No damping"):
        _damping.choose_damping(DampingConfig(), current, None, None, 0)


@pytest.mark.parametrize(
    ("ratio", "factor"),
    [(0.1, 1 / 0.9**5), (0.5, 1.0), (0.9, 0.9**5), (float("nan"), 1.0), (float("inf"), 1.0)],
)
def test_levenberg_marquardt_rule(ratio, factor):
    """Below the lower threshold the damping grows by decay**-interval, above the upper
    one it shrinks by decay**interval; a non-finite ratio leaves it alone."""
    out = _damping.levenberg_marquardt(ADAPTIVE, jnp.float32(1.0), jnp.float32(ratio))
    np.testing.assert_allclose(float(out), factor, rtol=1e-6)


def test_levenberg_marquardt_clips_to_the_bounds():
    config = DampingConfig(
        use_adaptive_damping=True, initial_damping=1.0, min_damping=0.9, max_damping=1.1
    )
    for ratio, want in ((0.0, 1.1), (1.0, 0.9)):
        out = _damping.levenberg_marquardt(config, jnp.float32(1.0), jnp.float32(ratio))
        np.testing.assert_allclose(float(out), want, rtol=1e-6)


def test_adapt_damping_only_every_interval():
    calls = []

    def ratio():
        calls.append(1)
        return jnp.float32(0.0)

    kept, rho = _damping.adapt_damping(ADAPTIVE, jnp.float32(1.0), jnp.int32(0), ratio)
    assert float(kept) == 1.0 and np.isnan(float(rho))
    adapted, rho = _damping.adapt_damping(ADAPTIVE, jnp.float32(1.0), jnp.int32(4), ratio)
    np.testing.assert_allclose(float(adapted), 1 / 0.9**5, rtol=1e-6)
    assert float(rho) == 0.0 and calls  # traced inside the cond


def test_positive_or_nan():
    assert float(_damping.positive_or_nan(jnp.float32(1e-3))) == 0.0
    assert np.isnan(float(_damping.positive_or_nan(jnp.float32(0.0))))
