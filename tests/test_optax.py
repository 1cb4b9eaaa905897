"""Tests for the optax side of kfacx: one-pass loss / gradient / curvature statistics,
`kfacx.scale_by_kfac`, micro-batch accumulation with `kfacx.accumulate_curvature_stats`,
padded batches (``example_mask``) and multi-device statistics.

Exact comparisons run in float64 (``jax.enable_x64``) with tight tolerances; every
computation is jitted, since eager evaluation of the estimator recompiles each
primitive for every new shape. The damping ``DAMPING`` is a power of two, exact in
float32 and float64 alike.
"""

from __future__ import annotations

import functools
import types

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import dense, init_mlp, mlp_logits, per_example_loss_sum
from optax.experimental import aggregating

import kfacx
from kfacx.estimator import weighted_mean_stats

SIZES = (3, 5, 3)
DAMPING = 2.0**-8
KEY = jax.random.PRNGKey(0)


# ----------------------------------------------------------------------------- helpers


@pytest.fixture(autouse=True)
def _without_xla_optimizations():
    """The tests compare computations of the same quantities; XLA's optimisation passes
    only cost compile time here (about a quarter of the module's run time)."""
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


# ----------------------------------------------------------------------------- value, grads, stats


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


def _haiku_mlp_problem():
    net = hk.without_apply_rng(hk.transform(lambda x: hk.nets.MLP([5, 3], activation=jnp.tanh)(x)))
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((6, SIZES[0])), jnp.float32)
    labels = jnp.asarray(rng.integers(0, 3, 6), jnp.int32)
    params = random_params(net.init, x, seed=1)

    def reference(params, batch, register=False):
        x, labels = batch
        logits = net.apply(params, x)
        if register:
            logits = kfacx.register_softmax_cross_entropy_loss(logits, labels)
        log_p = jax.nn.log_softmax(logits)
        loss = -jnp.mean(jnp.take_along_axis(log_p, labels[:, None], axis=1))
        return loss, {"logits": logits, "twice": 2.0 * loss}

    return params, (x, labels), reference


PROBLEMS = {"plain_jax": _plain_mlp_problem, "haiku": _haiku_mlp_problem}


@pytest.mark.parametrize("model", sorted(PROBLEMS))
def test_value_and_grads_equal_jax_value_and_grad(model):
    params, batch, reference = PROBLEMS[model]()

    def loss_fn(p, b):
        return reference(p, b, register=True)[0]

    def loss_aux_fn(p, b):
        return reference(p, b, register=True)

    est = kfacx.BlockDiagonalCurvature(loss_fn, auto_register_kwargs={"on_unmatched": "error"})
    est_aux = kfacx.BlockDiagonalCurvature(
        loss_aux_fn, auto_register_kwargs={"on_unmatched": "error"}
    )

    @jax.jit
    def run(params, batch):
        ours = est.value_grads_and_curvature_stats(KEY, (params, batch))
        ours_aux = est_aux.value_grads_and_curvature_stats(KEY, (params, batch), has_aux=True)
        ref = jax.value_and_grad(lambda p: reference(p, batch)[0])(params)
        ref_aux = jax.value_and_grad(lambda p: reference(p, batch), has_aux=True)(params)
        return ours, ours_aux, ref, ref_aux

    (value, grads, stats), (value_aux, grads_aux, stats_aux), ref, ref_aux = run(params, batch)
    # Every layer was found: two dense blocks covering all parameters.
    assert [type(b) for b in est.blocks] == [kfacx.DenseTwoKroneckerFactored] * 2
    assert est.report.unmatched == ()
    assert_trees_close((value, grads), ref, rtol=1e-6)
    assert_trees_close((value_aux, grads_aux), ref_aux, rtol=1e-6)
    assert isinstance(value_aux, tuple) and set(value_aux[1]) == {"logits", "twice"}
    # The aux output does not change the statistics.
    assert_trees_close(stats_aux, stats, rtol=1e-6)
    assert float(stats.batch_size) == batch[0].shape[0]
    assert all(np.all(np.isfinite(leaf)) for leaf in jax.tree_util.tree_leaves(stats))


@pytest.mark.parametrize("mode", ["fisher_empirical", "ggn_exact", "fisher_gradients"])
def test_stats_then_update_from_stats_equals_update_curvature_matrix_estimate(mode):
    params, (x, labels), reference = _plain_mlp_problem()
    est = kfacx.BlockDiagonalCurvature(
        lambda p, b: reference(p, b, register=True)[0], default_estimation_mode=mode
    )
    args = (params, (x, labels))
    rng, other_rng = jax.random.split(jax.random.PRNGKey(7))

    @jax.jit
    def run(rng, other_rng):
        state = est.init(KEY, args)
        _, _, stats = est.value_grads_and_curvature_stats(rng, args)
        from_stats = est.update_curvature_estimate_from_stats(state, stats, 0.0, 1.0)
        direct = est.update_curvature_matrix_estimate(state, 0.0, 1.0, None, rng, args, mode)
        other = est.update_curvature_matrix_estimate(state, 0.0, 1.0, None, other_rng, args, mode)
        # A second fold with a non-trivial moving average.
        again = est.update_curvature_estimate_from_stats(from_stats, stats, 0.7, 0.3)
        again_direct = est.update_curvature_matrix_estimate(direct, 0.7, 0.3, None, rng, args, mode)
        return from_stats, direct, other, again, again_direct

    from_stats, direct, other, again, again_direct = run(rng, other_rng)
    assert_trees_close(from_stats, direct, rtol=1e-6)
    assert_trees_close(again, again_direct, rtol=1e-6)
    # The factors are really estimated (non-zero, finite; weight 1 after (0, 1)).
    for block in from_stats.blocks:
        for factor in block.factors:
            value = np.asarray(factor.raw_value)
            assert float(factor.weight) == 1.0
            assert np.all(np.isfinite(value)) and np.abs(value).max() > 1e-3
    if mode == "fisher_gradients":
        # The rng matters in the sampling mode, so matching it above was meaningful.
        assert max_rel_diff(other, direct) > 1e-3
    else:
        assert_trees_close(other, direct, rtol=1e-6)


# ----------------------------------------------------------------------------- scale_by_kfac


@functools.cache
def _hand_kit():
    """A float64 problem, one estimator caching both the approximate and the exact
    inverse, and the jitted steps of a hand-run of `scale_by_kfac` (damping and moving
    average weights are arguments), shared by the tests below so that they compile once
    per worker. Call under ``jax.enable_x64(True)``."""
    params = to64(init_mlp(SIZES, seed=11))
    batches = [mlp_data(6, seed=100 + s) for s in range(7)]
    est = mlp_estimator(exact_powers_to_cache=(-1,))
    est.set_up((params, batches[0]))
    return types.SimpleNamespace(
        params=params,
        batches=batches,
        est=est,
        stats=jax.jit(lambda p, b: est.value_grads_and_curvature_stats(KEY, (p, b))[1:]),
        init=jax.jit(lambda p: est.init(KEY, (p, batches[0]))),
        fold=jax.jit(lambda s, st, e: est.update_curvature_estimate_from_stats(s, st, e, 1 - e)),
        refresh=jax.jit(est.update_cache),
        precondition=jax.jit(
            lambda s, g, d, exact: est.multiply_inverse(s, g, d, exact, use_cached=True),
            static_argnums=3,
        ),
    )


@pytest.mark.parametrize("exact", [False, True], ids=["pi_damping", "exact_inverse"])
def test_scale_by_kfac_update_and_cache_refresh_schedule(exact):
    """The update is the cached damped inverse times the gradient, after folding the
    statistics into the moving averages; the cache is refreshed on counts 0, T, 2T, ...
    and only then."""
    period, ema = 3, 0.75
    with jax.enable_x64(True):
        kit = _hand_kit()
        params = kit.params
        tx = kfacx.scale_by_kfac(
            kit.est,
            (params, kit.batches[0]),
            damping=DAMPING,
            curvature_ema=ema,
            inverse_update_period=period,
            use_exact_inverses=exact,
        )
        update = jax.jit(tx.update)
        state = jax.jit(tx.init)(params)
        assert int(state.count) == 0
        hand = always = kit.init(params)
        assert_trees_close(state.estimator_state, hand)
        for count, batch in enumerate(kit.batches):
            grads, stats = kit.stats(params, batch)
            got, state = update(grads, state, params, curvature_stats=stats)
            hand = kit.fold(hand, stats, ema)
            if count % period == 0:
                hand = kit.refresh(hand, DAMPING)
            assert_trees_close(got, kit.precondition(hand, grads, DAMPING, exact))
            assert_trees_close(state.estimator_state, hand)
            assert int(state.count) == count + 1
            # A run refreshing on every update agrees only on the refresh counts.
            always = kit.refresh(kit.fold(always, stats, ema), DAMPING)
            fresh = kit.precondition(always, grads, DAMPING, exact)
            if count % period == 0:
                assert_trees_close(got, fresh)
            else:
                assert max_rel_diff(got, fresh) > 1e-4, count


def test_damping_schedule_is_called_with_the_count():
    """With exact inverses the damping enters every product (the cached
    eigendecompositions do not depend on it), so each update shows the schedule's value
    at its own count, also between cache refreshes."""
    period = 2
    seen = []

    def damping(count):
        seen.append(count)
        return 2.0**-4 * 0.5**count

    with jax.enable_x64(True):
        kit = _hand_kit()
        params = kit.params
        tx = kfacx.scale_by_kfac(
            kit.est,
            (params, kit.batches[0]),
            damping=damping,
            inverse_update_period=period,
            use_exact_inverses=True,
            curvature_ema=0.5,
        )
        update = jax.jit(tx.update)
        state, hand = jax.jit(tx.init)(params), kit.init(params)
        for count, batch in enumerate(kit.batches[:4]):
            grads, stats = kit.stats(params, batch)
            got, state = update(grads, state, params, curvature_stats=stats)
            hand = kit.fold(hand, stats, 0.5)
            d = 2.0**-4 * 0.5**count
            if count % period == 0:
                hand = kit.refresh(hand, d)
            assert_trees_close(got, kit.precondition(hand, grads, d, True))
            if count:
                # Not the damping of count 0: the schedule's value matters.
                assert max_rel_diff(got, kit.precondition(hand, grads, 2.0**-4, True)) > 1e-4
    # Traced once (jit), with the integer scalar count.
    assert len(seen) >= 1
    assert all(jnp.shape(c) == () and jnp.issubdtype(c.dtype, jnp.integer) for c in seen)


def test_float64_damping_is_not_rounded_to_float32():
    damping = 1e-3  # not representable in float32; the update is off by ~2e-8 relative
    with jax.enable_x64(True):
        kit = _hand_kit()
        params, batch = kit.params, kit.batches[0]
        tx = kfacx.scale_by_kfac(kit.est, (params, batch), damping=damping, use_exact_inverses=True)
        grads, stats = kit.stats(params, batch)
        got, _ = jax.jit(tx.update)(grads, jax.jit(tx.init)(params), params, curvature_stats=stats)
        hand = kit.refresh(kit.fold(kit.init(params), stats, 0.95), damping)
        assert_trees_close(got, kit.precondition(hand, grads, damping, True), rtol=1e-11)


def test_scale_by_kfac_errors():
    params = init_mlp(SIZES)
    x = jnp.zeros((4, SIZES[0]))
    batch = (x, jnp.zeros((4,), jnp.int32), jnp.ones((4,)))
    est = mlp_estimator()
    args = (params, batch)
    tx = kfacx.scale_by_kfac(est, args)
    grads = jax.tree_util.tree_map(jnp.zeros_like, params)
    with pytest.raises(TypeError, match="curvature_stats"):
        tx.update(grads, None, params)
    with pytest.raises(TypeError, match="curvature_stats"):
        tx.update(grads, None, params, curvature_stats=((), 4.0))
    for period in (0, -2, 1.5, True, None):
        with pytest.raises(ValueError, match="inverse_update_period"):
            kfacx.scale_by_kfac(est, args, inverse_update_period=period)
    for ema in (1.0, -0.1, 2.0, float("nan")):
        with pytest.raises(ValueError, match="curvature_ema"):
            kfacx.scale_by_kfac(est, args, curvature_ema=ema)
    with pytest.raises(TypeError, match="damping"):
        kfacx.scale_by_kfac(est, args, damping="big")
    with pytest.raises(TypeError, match="BlockDiagonalCurvature"):
        kfacx.scale_by_kfac(masked_mlp_loss, args)
    # The aggregator: a bad count, a missing statistic, an estimator never set up.
    for k in (0, 2.0):
        with pytest.raises(ValueError, match="num_microbatches"):
            kfacx.accumulate_curvature_stats(est, k)
    agg = kfacx.accumulate_curvature_stats(est, 2)
    with pytest.raises(TypeError, match="curvature_stats"):
        agg.update(grads, agg.init(params), params)
    # An aggregator may be built before the estimator is set up; init needs the set-up.
    early = kfacx.accumulate_curvature_stats(mlp_estimator(), 2)
    with pytest.raises(ValueError, match="set_up"):
        early.init(params)


def test_scale_by_kfac_with_params_not_first():
    """``func_args`` with the parameters at ``params_index``: init and update work."""
    with jax.enable_x64(True):
        params = to64(init_mlp(SIZES, seed=2))
        batch = mlp_data(5, seed=3)
        est = kfacx.BlockDiagonalCurvature(
            lambda b, p: masked_mlp_loss(p, b), params_index=1, auto_register_tags=False
        )
        tx = kfacx.scale_by_kfac(est, (batch, params), damping=DAMPING)

        @jax.jit
        def run(params):
            _, grads, stats = est.value_grads_and_curvature_stats(
                KEY, (batch, params), estimation_mode="fisher_empirical"
            )
            got, _ = tx.update(grads, tx.init(params), params, curvature_stats=stats)
            state = est.update_curvature_estimate_from_stats(
                est.init(KEY, (batch, params)), stats, 0.95, 0.05
            )
            state = est.update_cache(state, DAMPING)
            return got, est.multiply_inverse(state, grads, DAMPING, use_cached=True)

        got, want = run(params)
        assert_trees_close(got, want)


# ----------------------------------------------------------------------------- training


def test_chain_with_sgd_momentum_reduces_loss_under_jit():
    rng = np.random.default_rng(0)
    centers = np.array([[2.0, 0.0], [-1.0, 1.7], [-1.0, -1.7]])
    labels = np.arange(60) % 3
    x = centers[labels] + 0.8 * rng.standard_normal((60, 2))
    batch = (jnp.asarray(x, jnp.float32), jnp.asarray(labels, jnp.int32))
    params = init_mlp((2, 8, 3), seed=1)

    def loss_fn(params, batch):
        x, labels = batch
        return xent(mlp_logits(params, x), labels)

    est = kfacx.BlockDiagonalCurvature(loss_fn)  # fisher_gradients, layers detected
    tx = optax.chain(
        kfacx.scale_by_kfac(est, (params, batch), damping=1e-2, inverse_update_period=2),
        optax.sgd(learning_rate=0.1, momentum=0.9),
    )

    @jax.jit
    def step(params, opt_state, rng):
        loss, grads, stats = est.value_grads_and_curvature_stats(rng, (params, batch))
        updates, opt_state = tx.update(grads, opt_state, params, curvature_stats=stats)
        return optax.apply_updates(params, updates), opt_state, loss

    opt_state = jax.jit(tx.init)(params)
    losses = []
    for rng in jax.random.split(jax.random.PRNGKey(3), 25):
        params, opt_state, loss = step(params, opt_state, rng)
        losses.append(float(loss))
    final = float(jax.jit(loss_fn)(params, batch))
    assert np.all(np.isfinite(losses)) and np.isfinite(final)
    assert all(np.all(np.isfinite(p)) for p in jax.tree_util.tree_leaves((params, opt_state)))
    assert int(opt_state[0].count) == 25
    assert final < 0.3 * losses[0], (losses[0], final)
    accuracy = np.mean(np.argmax(jax.jit(mlp_logits)(params, batch[0]), -1) == labels)
    assert accuracy > 0.9


# ----------------------------------------------------------------------------- micro-batches


PIPELINE_KWARGS = dict(damping=DAMPING, curvature_ema=0.6, inverse_update_period=2)


def _step_fn(est, tx):
    """A jitted step: statistics of ``batch`` (optionally masked) and ``tx.update``."""

    def step(params, opt_state, batch, mask):
        _, grads, stats = est.value_grads_and_curvature_stats(
            KEY, (params, batch), example_mask=mask
        )
        return tx.update(grads, opt_state, params, curvature_stats=stats)

    return jax.jit(step)


def _plain_run(params, full_batches):
    """The plain chain on each full batch: ``[(updates, params, scale_by_kfac state)]``."""
    est = mlp_estimator()
    tx = kfac_sgd(est, (params, full_batches[0]), **PIPELINE_KWARGS)
    step, opt_state, out = _step_fn(est, tx), jax.jit(tx.init)(params), []
    for batch in full_batches:
        updates, opt_state = step(params, opt_state, batch, None)
        params = apply_updates(params, updates)
        out.append((updates, params, opt_state[0]))
    return out


def _check_pipeline(params, plain, micro_batches, masked=False):
    """Runs ``process(identity, accumulate_curvature_stats, scale_by_kfac + sgd)`` on
    the micro-batches (``micro_batches[t]``: those of full batch ``t``) and checks it
    against the plain run: equal full updates, parameters and curvature state, and
    zero updates on the micro-steps that do not complete a full batch."""
    k = len(micro_batches[0])
    est = mlp_estimator()
    post = kfac_sgd(est, (params, micro_batches[0][0]), **PIPELINE_KWARGS)  # sets est up
    tx = aggregating.process(
        optax.with_extra_args_support(optax.identity()),
        kfacx.accumulate_curvature_stats(est, k),
        post,
        aggregator_has_aux=True,
    )
    step, opt_state = _step_fn(est, tx), jax.jit(tx.init)(params)
    for t, (micro, (want, want_params, want_state)) in enumerate(
        zip(micro_batches, plain, strict=True)
    ):
        for j, batch in enumerate(micro):
            got, opt_state = step(params, opt_state, batch, batch[2] if masked else None)
            assert bool(opt_state[1].ready) == (j == k - 1), (k, t, j)
            if j < k - 1:
                assert all_zero(got), (k, t, j)
            params = apply_updates(params, got)
        assert_trees_close(got, want)
        assert_trees_close(params, want_params)
        kfac_state = opt_state[2][0]
        assert int(kfac_state.count) == t + 1  # the postprocessor ran once per full batch
        assert_trees_close(kfac_state.estimator_state, want_state.estimator_state)
        assert int(opt_state[1].micro_step) == 0 and all_zero(opt_state[1].grads)


def test_microbatch_accumulation_equals_full_batch_step():
    """k = 4 micro-batches per update, over three updates (moving averages and the
    every-other-update cache refresh included). (k = 2 ran the same accumulation code
    with one micro-step fewer; k = 4 has several non-final micro-steps per update.)"""
    with jax.enable_x64(True):
        params = to64(init_mlp(SIZES, seed=21))
        full = [mlp_data(8, seed=30 + t) for t in range(3)]
        plain = _plain_run(params, full)
        k, size = 4, 2  # four micro-batches of two examples
        micro = [[take(b, slice(j * size, (j + 1) * size)) for j in range(k)] for b in full]
        _check_pipeline(params, plain, micro)


# ----------------------------------------------------------------------------- padding

# Real examples (1) and padding (0), interleaved so that a mask applied to the wrong rows
# cannot pass: 5 real examples, 3 padding examples.
PATTERN = np.array([1, 0, 1, 1, 0, 1, 0, 1], bool)


def _pad(real, padding, pattern=PATTERN):
    """Scatters ``real`` and ``padding`` arrays into the slots of ``pattern``."""
    out = np.zeros((len(pattern),) + real.shape[1:], real.dtype)
    out[pattern], out[~pattern] = real, padding
    return out


def _conv_case(rng):
    def logits_fn(x):
        h = jnp.tanh(hk.Conv2D(3, kernel_shape=2, padding="VALID")(x))  # with bias
        return hk.Linear(3)(h.reshape(h.shape[0], -1))

    net = hk.without_apply_rng(hk.transform(logits_fn))
    inputs = rng.standard_normal((8, 4, 4, 2))
    params = random_params(net.init, inputs[:1].astype(np.float32), seed=2)

    def loss_fn(params, batch):
        x, labels, mask = batch
        return xent(net.apply(params, x), labels, mask)

    blocks = {kfacx.ConvTwoKroneckerFactored, kfacx.DenseTwoKroneckerFactored}
    return loss_fn, params, inputs, True, "ggn_exact", blocks


def _embed_inputs(rng):
    ids = rng.integers(0, 6, (8, 3)).astype(np.int32)
    ids[~PATTERN] = 6  # id 6 occurs only in padding examples
    return ids


def _hk_embed_case(rng):
    def logits_fn(ids):
        e = hk.Embed(7, 4)(ids)
        return hk.Linear(3)(jnp.tanh(e.reshape(e.shape[0], -1)))

    net = hk.without_apply_rng(hk.transform(logits_fn))
    inputs = _embed_inputs(rng)
    params = random_params(net.init, inputs[:1], seed=3)

    def loss_fn(params, batch):
        ids, labels, mask = batch
        return xent(net.apply(params, ids), labels, mask)

    blocks = {kfacx.EmbeddingKroneckerFactored, kfacx.DenseTwoKroneckerFactored}
    return loss_fn, params, inputs, True, "fisher_empirical", blocks


def _register_embedding_case(rng):
    table = jnp.asarray(rng.standard_normal((7, 4)), jnp.float32)
    params = {"table": table, "out": init_mlp((12, 3), seed=4)[0]}

    def loss_fn(params, batch):
        ids, labels, mask = batch
        table, (w, b) = params["table"], params["out"]
        e = kfacx.register_embedding(table[ids], ids, table)
        h = jnp.tanh(e.reshape(e.shape[0], -1))
        return xent(kfacx.register_dense(dense(h, w, b), h, w, b), labels, mask)

    inputs = _embed_inputs(rng)
    blocks = {kfacx.EmbeddingKroneckerFactored, kfacx.DenseTwoKroneckerFactored}
    return loss_fn, params, inputs, False, "ggn_exact", blocks


# Every block class, estimation mode and way of registering is covered: a plain dense
# (hand-tagged, fisher_empirical) case ran no path that the cases below do not run (their
# dense layers, hk_embed's fisher_empirical, register_embedding's hand-tagging).
PADDING_CASES = {
    "conv": _conv_case,
    "hk_embed": _hk_embed_case,
    "register_embedding": _register_embedding_case,
}


@pytest.mark.parametrize("case", list(PADDING_CASES))
def test_padding_with_example_mask_equals_real_examples_only(case):
    rng = np.random.default_rng(40)
    loss_fn, params, inputs, auto, mode, block_types = PADDING_CASES[case](rng)
    labels = rng.integers(0, 3, 8).astype(np.int32)
    with jax.enable_x64(True):
        params = to64(params)
        inputs = np.asarray(inputs, np.float64) if inputs.dtype.kind == "f" else inputs
        # The padded batch: real examples where PATTERN is set, garbage elsewhere.
        padded = (inputs, labels, PATTERN.astype(np.float64))
        real = take(padded, np.flatnonzero(PATTERN))
        est_pad, est_real = (
            kfacx.BlockDiagonalCurvature(
                loss_fn, default_estimation_mode=mode, auto_register_tags=auto
            )
            for _ in range(2)
        )
        tx_pad = kfacx.scale_by_kfac(est_pad, (params, padded), damping=DAMPING)
        tx_real = kfacx.scale_by_kfac(est_real, (params, real), damping=DAMPING)

        @jax.jit
        def run(params, padded, real):
            v_pad, g_pad, s_pad = est_pad.value_grads_and_curvature_stats(
                KEY, (params, padded), example_mask=padded[2]
            )
            v_real, g_real, s_real = est_real.value_grads_and_curvature_stats(KEY, (params, real))
            _, _, s_unmasked = est_pad.value_grads_and_curvature_stats(KEY, (params, padded))
            _, _, s_bool = est_pad.value_grads_and_curvature_stats(
                KEY, (params, padded), example_mask=padded[2] > 0
            )
            u_pad, _ = tx_pad.update(g_pad, tx_pad.init(params), params, curvature_stats=s_pad)
            u_real, _ = tx_real.update(g_real, tx_real.init(params), params, curvature_stats=s_real)
            return (
                (v_pad, g_pad, s_pad, u_pad),
                (v_real, g_real, s_real, u_real),
                s_unmasked,
                s_bool,
            )

        (v_pad, g_pad, s_pad, u_pad), (v_real, g_real, s_real, u_real), s_unmasked, s_bool = run(
            params, padded, real
        )
        assert {type(b) for b in est_pad.blocks} == block_types
        assert all(b.has_bias for b in est_pad.blocks if hasattr(b, "has_bias"))
        assert float(s_pad.batch_size) == float(s_real.batch_size) == PATTERN.sum()
        assert_trees_close(v_pad, v_real)
        assert_trees_close(g_pad, g_real)
        assert_trees_close(s_pad.blocks, s_real.blocks)
        assert_trees_close(u_pad, u_real)
        # A boolean mask works the same.
        assert_trees_close(s_bool, s_pad)
        # Without example_mask the padding enters the statistics: the check has teeth.
        assert float(s_unmasked.batch_size) == len(PATTERN)
        assert max_rel_diff(s_unmasked.blocks, s_real.blocks) > 1e-2


def test_pipeline_with_padded_microbatches_equals_real_examples():
    """Ten real examples in four micro-batches of four: real, all padding, real, and a
    last one half padding. The accumulation weighs every micro-batch by its number of
    real examples (an empty one counts for nothing)."""
    half = np.array([0, 1, 0, 1], bool)
    with jax.enable_x64(True):
        params = to64(init_mlp(SIZES, seed=21))
        full = [mlp_data(10, seed=50 + t) for t in range(2)]
        garbage = mlp_data(4, seed=99)
        micro = []
        for x, labels, ones in full:
            real = (x, labels, ones)
            pad_x, pad_labels = garbage[0], garbage[1]
            half_padded = (_pad(x[8:], pad_x[:2], half), _pad(labels[8:], pad_labels[:2], half))
            micro.append(
                [
                    take(real, slice(0, 4)),
                    (pad_x, pad_labels, np.zeros((4,))),
                    take(real, slice(4, 8)),
                    (*half_padded, half * 1.0),
                ]
            )
        _check_pipeline(params, _plain_run(params, full), micro, masked=True)


# ----------------------------------------------------------------------------- multi-device

NUM_DEVICES = 4


def _sharded(batch, masks):
    """Splits a batch into ``[devices, slots, ...]`` shards with the given masks."""
    x, labels, _ = batch
    shape = masks.shape
    return (
        x.reshape(shape + x.shape[1:]),
        labels.reshape(shape),
        masks.astype(x.dtype),
    )


def _real_examples(sharded):
    x, labels, mask = sharded
    keep = np.flatnonzero(mask.reshape(-1))
    x, labels = x.reshape((-1,) + x.shape[2:])[keep], labels.reshape(-1)[keep]
    return x, labels, np.ones((len(keep),))


def test_pmap_weighted_mean_stats_equal_stats_of_concatenated_batch():
    """Per-device statistics averaged with ``weighted_mean_stats`` (directly, and through
    ``update_curvature_estimate_from_stats(..., pmap_axis_name)``) are the statistics of
    all the devices' real examples, whether or not the devices hold as many."""
    assert jax.local_device_count() >= NUM_DEVICES
    equal = np.ones((NUM_DEVICES, 3), bool)
    uneven = np.array([[1, 1, 1], [1, 0, 1], [0, 1, 0], [0, 0, 0]], bool)  # 3, 2, 1, 0 real
    with jax.enable_x64(True):
        params = to64(init_mlp(SIZES, seed=60))
        est = mlp_estimator()
        est.set_up((params, take(_sharded(mlp_data(12, seed=0), equal), 0)))

        def per_device(x, labels, mask):
            args = (params, (x, labels, mask))
            _, _, stats = est.value_grads_and_curvature_stats(KEY, args, example_mask=mask)
            state = est.init(KEY, args)
            folded = est.update_curvature_estimate_from_stats(state, stats, 0.0, 1.0, "i")
            return weighted_mean_stats(stats, "i"), jax.lax.pmean(stats.blocks, "i"), folded

        pooled_stats = jax.pmap(per_device, axis_name="i")
        for masks in (equal, uneven):
            shards = _sharded(mlp_data(12, seed=61), masks)
            real = _real_examples(shards)
            pooled, naive, folded = jax.device_get(pooled_stats(*shards))
            est_single = mlp_estimator()

            @jax.jit
            def single(real=real, est_single=est_single):
                _, _, stats = est_single.value_grads_and_curvature_stats(KEY, (params, real))
                state = est_single.init(KEY, (params, real))
                return stats, est_single.update_curvature_estimate_from_stats(
                    state, stats, 0.0, 1.0
                )

            want, single_state = single()
            for d in range(NUM_DEVICES):
                assert float(pooled.batch_size[d]) == masks.sum()
                assert_trees_close(take(pooled.blocks, d), want.blocks)
                assert_trees_close(take(folded, d), single_state)
            if masks is uneven:
                # The unweighted device mean is wrong here: weighting matters.
                assert max_rel_diff(take(naive, 0), want.blocks) > 1e-2


def test_pmap_scale_by_kfac_update_equals_single_device_update():
    """Each device has its own shard (all real and no example_mask, or padded); the
    gradients are averaged over the devices by the test (weighted by the real examples),
    the statistics by ``scale_by_kfac(..., pmap_axis_name=...)``."""
    assert jax.local_device_count() >= NUM_DEVICES
    kwargs = dict(damping=DAMPING, curvature_ema=0.6, inverse_update_period=1)
    equal = np.ones((NUM_DEVICES, 2), bool)
    uneven = np.array([[1, 1], [1, 0], [0, 1], [1, 1]], bool)
    with jax.enable_x64(True):
        params = to64(init_mlp(SIZES, seed=70))
        est = mlp_estimator()
        shard = take(_sharded(mlp_data(8, seed=0), equal), 0)
        tx = kfacx.scale_by_kfac(est, (params, shard), pmap_axis_name="i", **kwargs)

        def device_step(state, x, labels, mask, example_mask):
            args = (params, (x, labels, mask))
            _, grads, stats = est.value_grads_and_curvature_stats(
                KEY, args, example_mask=example_mask
            )
            n = stats.batch_size
            grads = jax.tree_util.tree_map(
                lambda g: jax.lax.psum(n * g, "i") / jax.lax.psum(n, "i"), grads
            )
            return tx.update(grads, state, params, curvature_stats=stats)

        step = jax.pmap(device_step, axis_name="i")
        for masks in (equal, uneven):
            batches = [_sharded(mlp_data(8, seed=71 + t), masks) for t in range(2)]
            reals = [_real_examples(b) for b in batches]
            est_single = mlp_estimator()
            tx_single = kfacx.scale_by_kfac(est_single, (params, reals[0]), **kwargs)

            @jax.jit
            def single_step(state, batch, est_single=est_single, tx_single=tx_single):
                _, grads, stats = est_single.value_grads_and_curvature_stats(KEY, (params, batch))
                return tx_single.update(grads, state, params, curvature_stats=stats)

            state = jax.device_get(jax.jit(tx.init)(params))
            state = jax.tree_util.tree_map(lambda a: np.stack([a] * NUM_DEVICES), state)
            single_state = jax.jit(tx_single.init)(params)
            for batch, real in zip(batches, reals, strict=True):
                example_mask = None if masks is equal else batch[2]
                got, state = jax.device_get(step(state, *batch, example_mask))
                want, single_state = single_step(single_state, real)
                for d in range(NUM_DEVICES):
                    assert_trees_close(take(got, d), want)
                    assert_trees_close(take(state, d), single_state)


# ----------------------------------------------------------------------------- shared core


def test_optimizer_and_optax_chain_take_identical_steps():
    """`kfacx.Optimizer` with a fixed learning rate, momentum, damping and ``l2_reg``
    and ``add_decayed_weights(l2) -> scale_by_kfac(damping + l2) -> scale(-lr) ->
    trace(momentum)`` go through the same preconditioning core
    (`kfacx.transform.precondition`): the same parameters, velocities and curvature
    state step after step, refreshes included."""
    lr, momentum, damping, l2 = 0.25, 0.5, DAMPING, 2.0**-6
    params, batch, reference = _plain_mlp_problem()

    def loss_fn(params, batch):
        return reference(params, batch, register=True)[0]

    kwargs = dict(curvature_ema=0.75, inverse_update_period=2, estimation_mode="ggn_exact")
    opt = kfacx.Optimizer(
        jax.value_and_grad(loss_fn), l2_reg=l2, add_l2_reg=True, num_burnin_steps=0, **kwargs
    )
    est = kfacx.BlockDiagonalCurvature(loss_fn, default_estimation_mode="ggn_exact")
    tx = optax.chain(
        optax.add_decayed_weights(l2),
        kfacx.scale_by_kfac(
            est,
            (params, batch),
            damping=damping + l2,
            curvature_ema=kwargs["curvature_ema"],
            inverse_update_period=kwargs["inverse_update_period"],
        ),
        optax.scale(-lr),
        optax.trace(decay=momentum),
    )

    @jax.jit
    def chain_step(params, opt_state):
        _, grads, stats = est.value_grads_and_curvature_stats(KEY, (params, batch))
        updates, opt_state = tx.update(grads, opt_state, params, curvature_stats=stats)
        return optax.apply_updates(params, updates), opt_state

    opt_params, opt_state = params, opt.init(params, KEY, batch)
    chain_params, chain_state = params, jax.jit(tx.init)(params)
    for i in range(5):
        opt_params, opt_state, stats = opt.step(
            opt_params,
            opt_state,
            jax.random.fold_in(KEY, i),
            batch,
            learning_rate=lr,
            momentum=momentum,
            damping=damping,
        )
        chain_params, chain_state = chain_step(chain_params, chain_state)
        assert not bool(stats["skipped"])
        assert_trees_close(opt_params, chain_params, rtol=1e-5)
        assert_trees_close(opt_state.velocities, chain_state[3].trace, rtol=1e-5)
        assert_trees_close(opt_state.estimator_state, chain_state[1].estimator_state, rtol=1e-5)
    assert int(chain_state[1].count) == 5 == int(opt_state.step_counter)
