"""Problems and cached estimates of the scan tests (tests/graph_matcher/test_scan*.py):
the scanned models and their unrolled twins, float64 comparisons, the curvature of
each model (cached: built once per worker process), and the autouse ``x64`` fixture.
"""

from __future__ import annotations

import functools
import warnings

import _models as TM
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kfacx

D_IN, WIDTH, DEPTH, D_OUT, BATCH, TIME = 3, 5, 3, 2, 4, 4
KEY = jax.random.PRNGKey(0)
DAMPING = 0.1
DENSE_KF = "DenseTwoKroneckerFactored"


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


def f64(tree):
    return jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float64), tree)


def assert_close(got, want, rtol=1e-9):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape
    assert np.abs(want).max() > 0
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * np.abs(want).max())


def assert_trees_close(a, b, rtol=1e-9):
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        assert_close(x, y, rtol)


# ----------------------------------------------------------------------------- problems


def stacked_problem(seed: int = 0):
    params = f64(TM.init_stacked_mlp(D_IN, WIDTH, DEPTH, D_OUT, seed))
    rng = np.random.default_rng(seed + 1)
    batch = (rng.standard_normal((BATCH, D_IN)), rng.standard_normal((BATCH, D_OUT)))
    return params, f64(batch)


def rnn_problem(seed: int = 0):
    params = f64(TM.init_rnn(D_IN, WIDTH, D_OUT, seed))
    rng = np.random.default_rng(seed + 1)
    batch = (rng.standard_normal((BATCH, TIME, D_IN)), rng.standard_normal((BATCH, D_OUT)))
    return params, f64(batch)


def haiku_problem(seed: int = 0):
    model = TM.haiku_layer_stack_mlp(WIDTH, DEPTH, D_OUT)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((BATCH, D_IN))
    shapes = jax.eval_shape(model.init, KEY, x)
    params = jax.tree_util.tree_map(lambda s: 0.5 * rng.standard_normal(s.shape), shapes)
    return model, f64(params), f64((x, rng.standard_normal((BATCH, D_OUT))))


# name -> (scan logits, unrolled logits, params -> unrolled params, problem)
MODELS = {
    "stacked": (TM.stacked_mlp_logits, TM.unrolled_mlp_logits, TM.unstack_mlp, stacked_problem),
    "rnn": (TM.rnn_logits, TM.unrolled_rnn_logits, lambda p: p, rnn_problem),
}


def losses(name: str, variant: str = "plain", tag: bool = False):
    """``(scan loss, unrolled loss, to_unrolled, args)`` of a model."""
    scan_logits, loop_logits, to_unrolled, problem = MODELS[name]
    scan = _loss(scan_logits, variant, tag)
    loop = _loss(loop_logits, _loop_variant(variant), tag)
    return scan, loop, to_unrolled, problem()


def _loop_variant(variant: str) -> str:
    # Unrolled, a jitted or checkpointed body is the plain loop.
    return "reverse" if variant == "reverse" else "plain"


@functools.cache
def _loss(logits, variant, tag):
    # Cached: the estimator's trace cache is keyed on the function.
    return TM.loss_of_logits(logits, variant=variant, tag=tag)


def fast_jit(fun, **kwargs):
    """`jax.jit` with cheap XLA optimisation: compile time dominates these small programs."""
    return jax.jit(fun, compiler_options={"xla_backend_optimization_level": 0}, **kwargs)


def _both(transform, tagged, loss, args):
    """``transform`` of ``tagged`` and of ``loss`` at ``args``: one compilation for both."""
    return fast_jit(lambda *a: (transform(tagged)(*a), transform(loss)(*a)))(*args)


def unrolled_positions(params, to_unrolled) -> np.ndarray:
    """``perm`` with ``unrolled_flat = scan_flat[perm]`` (pytree-leaf order, row-major)."""
    leaves, tree = jax.tree_util.tree_flatten(params)
    offsets = np.cumsum([0] + [np.size(leaf) for leaf in leaves])
    index = [
        np.arange(o, o + np.size(leaf)).reshape(np.shape(leaf))
        for o, leaf in zip(offsets, leaves, strict=False)
    ]
    unrolled = to_unrolled(jax.tree_util.tree_unflatten(tree, index))
    return np.concatenate([np.ravel(a) for a in jax.tree_util.tree_leaves(unrolled)])


def estimate(loss, args, mode="ggn_exact", auto=True, vector=None, ctors=None) -> dict:
    """One jitted program: init, one update (ema 0, 1), the dense matrix and, given a
    ``vector``, the cache and inverse products (exact cached; approximate cached and
    fresh). No detection warning is allowed."""
    est = kfacx.BlockDiagonalCurvature(
        loss,
        layer_tag_to_block_ctor=ctors,
        default_estimation_mode=mode,
        auto_register_tags=auto,
        exact_powers_to_cache=(-1.0,),
        approx_powers_to_cache=(-1.0,),
    )

    def run(args, vector):
        state = est.init(KEY, args)
        state = est.update_curvature_matrix_estimate(state, 0.0, 1.0, None, KEY, args)
        products = {}
        if vector is not None:
            state = est.update_cache(state, DAMPING)
            inverse = functools.partial(est.multiply_inverse, state, vector, DAMPING)
            products = dict(
                exact=inverse(exact_power=True, use_cached=True),
                approx=inverse(use_cached=True),
                approx_fresh=inverse(use_cached=False),
            )
        return est.to_dense_matrix(state), products

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dense, products = fast_jit(run)(args, vector)
    return dict(estimator=est, dense=np.asarray(dense), **products)


# Hand-tagged models get full blocks for their dense layers: per-example gradients pair
# every input row with its cotangent row (Kronecker factors do not see the pairing).
FULL_DENSE = {"dense_tag": kfacx.blocks.Full}


@functools.cache
def model_estimates(name: str, variant: str, tag: bool = False, mode: str = "ggn_exact"):
    """``(scan model's estimate, unrolled model's estimate, perm, vector)`` (cached)."""
    scan_loss, loop_loss, to_unrolled, (params, batch) = losses(name, variant, tag)
    products = variant == "plain" and not tag
    v = random_like(params) if products else None
    ctors = FULL_DENSE if tag else None
    scan = estimate(scan_loss, (params, batch), mode, auto=not tag, vector=v, ctors=ctors)
    loop = _loop_estimate(name, _loop_variant(variant), tag, mode, products)
    return scan, loop, unrolled_positions(params, to_unrolled), v


@functools.cache
def _loop_estimate(name: str, variant: str, tag: bool, mode: str, products: bool):
    _, loop_loss, to_unrolled, (params, batch) = losses(name, variant, tag)
    v = to_unrolled(random_like(params)) if products else None
    args = (to_unrolled(params), batch)
    return estimate(loop_loss, args, mode, not tag, v, FULL_DENSE if tag else None)


def random_like(tree, seed: int = 3):
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_map(lambda a: jnp.asarray(rng.standard_normal(np.shape(a))), tree)
