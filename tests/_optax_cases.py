"""Helpers of the optax-side tests (tests/transform/test_optax*.py): a hand-tagged float64 MLP
problem, its data and estimators, tree comparisons, and the autouse fixture that turns
XLA's optimisation passes off.

Exact comparisons run in float64 (``jax.enable_x64``) with tight tolerances; every
computation is jitted, since eager evaluation of the estimator recompiles each
primitive for every new shape. The damping ``DAMPING`` is a power of two, exact in
float32 and float64 alike.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import dense, init_mlp, mlp_logits, per_example_loss_sum

import kfacx

SIZES = (3, 5, 3)
DAMPING = 2.0**-8
KEY = jax.random.PRNGKey(0)


# ----------------------------------------------------------------------------- helpers


@pytest.fixture(autouse=True)
def _without_xla_optimizations():
    """The tests compare computations of the same quantities; XLA's optimisation passes
    only cost compile time here (about a quarter of the optax tests' run time)."""
    before = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", True)
    yield
    jax.config.update("jax_disable_most_optimizations", before)


def to64(tree):
    """Floating leaves cast to float64 (call inside ``jax.enable_x64(True)``)."""
    return jax.tree_util.tree_map(
        lambda a: jnp.asarray(a, jnp.float64) if jnp.issubdtype(a.dtype, jnp.floating) else a,
        tree,
    )


def assert_trees_close(got, want, rtol=1e-9, atol_scale=None):
    """Same pytree structure and every leaf close; the absolute tolerance is
    ``atol_scale`` (default ``rtol``) times the largest entry of the leaf."""
    got_leaves, got_def = jax.tree_util.tree_flatten(got)
    want_leaves, want_def = jax.tree_util.tree_flatten(want)
    assert got_def == want_def
    atol_scale = rtol if atol_scale is None else atol_scale
    for g, w in zip(got_leaves, want_leaves, strict=True):
        g, w = np.asarray(g), np.asarray(w)
        assert g.shape == w.shape and g.dtype == w.dtype, (g.shape, g.dtype, w.shape, w.dtype)
        if not np.issubdtype(w.dtype, np.inexact):
            np.testing.assert_array_equal(g, w)
            continue
        atol = atol_scale * float(np.abs(w).max(initial=0.0))
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol)


def max_rel_diff(a, b) -> float:
    """The largest ``max|a - b| / max|b|`` over the leaves of two pytrees."""
    diffs = jax.tree_util.tree_map(
        lambda x, y: (
            float(np.abs(np.asarray(x) - np.asarray(y)).max())
            / max(float(np.abs(np.asarray(y)).max()), 1e-300)
        ),
        a,
        b,
    )
    return max(jax.tree_util.tree_leaves(diffs))


def all_zero(tree) -> bool:
    return all(not np.any(np.asarray(leaf)) for leaf in jax.tree_util.tree_leaves(tree))


def xent(logits, labels, mask=None):
    """Registered softmax cross-entropy averaged over the real (``mask`` 1) examples."""
    logits = kfacx.register_softmax_cross_entropy_loss(logits, labels, mask=mask)
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1)[:, 0]
    if mask is None:
        return jnp.mean(nll)
    return jnp.sum(mask * nll) / jnp.maximum(jnp.sum(mask), 1.0)


def tagged_mlp_logits(params, x):
    h = x
    for i, (w, b) in enumerate(params):
        y = kfacx.register_dense(dense(h, w, b), h, w, b)
        h = jnp.tanh(y) if i < len(params) - 1 else y
    return h


def masked_mlp_loss(params, batch):
    """Hand-tagged tanh MLP; ``batch = (x, labels, mask)``."""
    x, labels, mask = batch
    return xent(tagged_mlp_logits(params, x), labels, mask)


def mlp_data(n, seed, sizes=SIZES):
    """``(x, labels, mask)`` of ``n`` real examples, as float64 numpy arrays (data is
    prepared in numpy: eager JAX ops would compile once per shape)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, sizes[0]))
    return x, rng.integers(0, sizes[-1], n).astype(np.int32), np.ones((n,))


def mlp_estimator(mode="fisher_empirical", **kwargs):
    return kfacx.BlockDiagonalCurvature(
        masked_mlp_loss, default_estimation_mode=mode, auto_register_tags=False, **kwargs
    )


def take(tree, index):
    """``leaf[index]`` of every leaf, as numpy arrays."""
    return jax.tree_util.tree_map(lambda a: np.asarray(a)[index], tree)


def random_params(init_fn, *example, seed=0, scale=0.5):
    """Parameters shaped like ``init_fn(key, *example)`` (no compilation), float32."""
    shapes = jax.eval_shape(init_fn, jax.random.PRNGKey(0), *example)
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_map(
        lambda s: jnp.asarray(scale * rng.standard_normal(s.shape), jnp.float32), shapes
    )


apply_updates = jax.jit(optax.apply_updates)


def kfac_sgd(estimator, func_args, **kwargs):
    """``scale_by_kfac`` followed by SGD with momentum (the documented chain)."""
    return optax.chain(
        kfacx.scale_by_kfac(estimator, func_args, **kwargs),
        optax.sgd(learning_rate=0.5, momentum=0.9),
    )


def _plain_mlp_problem():
    """A plain-JAX MLP (layers found by auto-detection) and an untagged reference."""
    params = init_mlp(SIZES, seed=3)
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((6, SIZES[0])), jnp.float32)
    labels = jnp.asarray(rng.integers(0, SIZES[-1], 6), jnp.int32)

    def reference(params, batch, register=False):
        x, labels = batch
        logits = mlp_logits(params, x)
        if register:
            logits = kfacx.register_softmax_cross_entropy_loss(logits, labels)
        loss = per_example_loss_sum("softmax", logits, labels, 1.0) / x.shape[0]
        return loss, {"logits": logits, "twice": 2.0 * loss}

    return params, (x, labels), reference
