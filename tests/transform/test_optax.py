"""Tests for the optax side of kfacx: one-pass loss / gradient / curvature statistics,
`kfacx.scale_by_kfac` (update, cache refresh schedule, damping, errors), training with
an optax chain, and the preconditioning core shared with `kfacx.Optimizer`.

Micro-batch accumulation and padded batches are in tests/transform/test_optax_microbatches.py,
multi-device statistics in tests/transform/test_optax_multidevice.py; the shared helpers in
tests/_optax_cases.py.
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
from _models import init_mlp, mlp_logits
from _optax_cases import (
    DAMPING,
    KEY,
    SIZES,
    _plain_mlp_problem,
    _without_xla_optimizations,  # noqa: F401  (autouse fixture)
    assert_trees_close,
    masked_mlp_loss,
    max_rel_diff,
    mlp_data,
    mlp_estimator,
    random_params,
    to64,
    xent,
)

import kfacx

# ----------------------------------------------------------------------------- value, grads, stats


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
