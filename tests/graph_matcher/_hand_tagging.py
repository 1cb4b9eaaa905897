"""Auto-tagged against hand-tagged curvature, for the detection tests.

`assert_curvature_equals_hand_tagging` compares, factor by factor, the ``ggn_exact``
curvature of a model whose layers are detected with that of the same model whose layers
of interest are registered by hand (the others detected in both). Run it under the
``x64`` fixture (``conftest.py``): float64 makes the comparison exact to rounding.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np

import kfacx


def ggn_state(loss, args, jit):
    """``(estimator, state)`` after one ``ggn_exact`` update; nothing may warn."""
    est = kfacx.BlockDiagonalCurvature(loss)

    def update(state, args):
        return est.update_curvature_matrix_estimate(
            state, 0.0, 1.0, None, jax.random.PRNGKey(1), args, estimation_mode="ggn_exact"
        )

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state = est.init(jax.random.PRNGKey(0), args)
        return est, (jax.jit(update) if jit else update)(state, args)


def assert_curvature_equals_hand_tagging(loss, hand_loss, args, jit=True):
    """The detected model's blocks, factor by factor, equal those of the model whose
    layers of interest are tagged by hand (the others detected in both); returns both
    reports. ``jit=False`` updates eagerly: faster for a model that repeats small
    operations of one shape, whose compilations are reused."""
    est, got = ggn_state(loss, args, jit)
    hand, want = ggn_state(hand_loss, args, jit)
    assert [type(b) for b in est.blocks] == [type(b) for b in hand.blocks], str(est.report)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-14)
    assert max(float(np.abs(a).max()) for a in jax.tree.leaves(got)) > 1e-3
    assert est.report.notes == () and hand.report.notes == (), str(est.report)
    return est.report, hand.report


def random_params(init, x, dtype):
    """Random parameters shaped like ``init(key, x)``'s, of ``dtype`` (no initializer runs:
    eager initialisation compiles every operation)."""
    rng = np.random.default_rng(0)
    shapes = jax.eval_shape(init, jax.random.PRNGKey(0), x)
    return jax.tree.map(lambda s: jnp.asarray(0.5 * rng.standard_normal(s.shape), dtype), shapes)
