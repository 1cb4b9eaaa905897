"""kfacx.Optimizer: equivalences (optax chain, micro-batches, padding, pmap), the
quadratic model, damping adaptation, skipping non-finite steps.

Options are tested in tests/optimizer/test_optimizer_options.py, model kinds and the step's
interfaces in tests/optimizer/test_optimizer_models.py; the helpers live in
tests/_optimizer_cases.py (re-exported here: other test files import them from
test_optimizer).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _optimizer_cases import (
    ADAPTIVE,
    DETERMINISTIC,
    assert_trees_close,
    make_batch,
    make_params,
    masked_mlp_loss,
    mlp_loss,
    run,
)

import kfacx
from kfacx._helpers import _tree

# ----------------------------------------------------------------------------- equivalences


def test_optax_chain_equals_optimizer_with_fixed_lr_and_momentum():
    params, batch = make_params(), make_batch()
    lr, mom, damping, l2, period = 0.2, 0.8, 1e-2, 1e-3, 3
    opt = kfacx.Optimizer(
        jax.value_and_grad(mlp_loss),
        l2_reg=l2,
        add_l2_reg=True,
        learning_rate_schedule=lr,
        momentum_schedule=mom,
        initial_damping=damping,
        inverse_update_period=period,
        **DETERMINISTIC,
    )
    opt_params, _, _ = run(opt, params, batch, 6)

    estimator = kfacx.BlockDiagonalCurvature(mlp_loss, default_estimation_mode="fisher_empirical")
    tx = optax.chain(
        optax.add_decayed_weights(l2),
        kfacx.scale_by_kfac(
            estimator, (params, batch), damping=damping + l2, inverse_update_period=period
        ),
        optax.sgd(lr, momentum=mom),
    )
    state = tx.init(params)

    @jax.jit
    def step(p, s):
        _, grads, stats = estimator.value_grads_and_curvature_stats(jax.random.key(0), (p, batch))
        updates, s = tx.update(grads, s, p, curvature_stats=stats)
        return optax.apply_updates(p, updates), s

    p = params
    for _ in range(6):
        p, state = step(p, state)
    assert_trees_close(opt_params, p, rtol=2e-5, atol=2e-6)
    # And the trajectory really moved.
    assert float(jnp.max(jnp.abs(p["w1"] - params["w1"]))) > 1e-2


@pytest.mark.parametrize("num_microbatches", [2, 4])
def test_microbatches_equal_full_batch(num_microbatches):
    params, batch = make_params(), make_batch(n=32)
    full = kfacx.Optimizer(jax.value_and_grad(mlp_loss), l2_reg=1e-3, **ADAPTIVE, **DETERMINISTIC)
    micro = kfacx.Optimizer(
        jax.value_and_grad(mlp_loss),
        l2_reg=1e-3,
        num_microbatches=num_microbatches,
        **ADAPTIVE,
        **DETERMINISTIC,
    )
    p_full, s_full, h_full = run(full, params, batch, 4)
    p_micro, s_micro, h_micro = run(micro, params, batch, 4)
    assert_trees_close(p_full, p_micro, rtol=1e-4, atol=1e-5)
    assert_trees_close(s_full.estimator_state, s_micro.estimator_state, rtol=1e-4, atol=1e-5)
    for a, b in zip(h_full, h_micro, strict=True):
        for key in ("loss", "learning_rate", "momentum", "damping", "quad_model_change"):
            np.testing.assert_allclose(a[key], b[key], rtol=1e-4, atol=1e-6)
    assert np.isfinite(float(h_micro[1]["rho"]))


def test_padding_examples_masked_out_change_nothing():
    params, (x, y) = make_params(), make_batch(n=24)
    real = (x, y, jnp.ones(24))
    pad_x = jax.random.normal(jax.random.key(9), (8, 5)) * 3.0
    padded = (
        jnp.concatenate([x, pad_x]),
        jnp.concatenate([y, jnp.full((8,), 2, jnp.int32)]),
        jnp.concatenate([jnp.ones(24), jnp.zeros(8)]),
    )
    kwargs = dict(l2_reg=1e-3, example_mask_extractor=lambda b: b[2], **ADAPTIVE, **DETERMINISTIC)
    opt = kfacx.Optimizer(jax.value_and_grad(masked_mlp_loss), **kwargs)
    p_real, s_real, h_real = run(opt, params, real, 3)
    opt_pad = kfacx.Optimizer(jax.value_and_grad(masked_mlp_loss), num_microbatches=4, **kwargs)
    p_pad, s_pad, h_pad = run(opt_pad, params, padded, 3)
    assert_trees_close(p_real, p_pad, rtol=1e-4, atol=1e-5)
    assert_trees_close(s_real.estimator_state, s_pad.estimator_state, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(h_real[-1]["loss"], h_pad[-1]["loss"], rtol=1e-5)


def test_without_mask_padding_would_change_the_update():
    """Guards the test above: the padding examples do matter when not masked."""
    params, (x, y) = make_params(), make_batch(n=24)
    padded = (
        jnp.concatenate([x, jax.random.normal(jax.random.key(9), (8, 5)) * 3.0]),
        jnp.concatenate([y, jnp.full((8,), 2, jnp.int32)]),
        jnp.concatenate([jnp.ones(24), jnp.zeros(8)]),
    )
    real = (x, y, jnp.ones(24))
    opt = kfacx.Optimizer(
        jax.value_and_grad(masked_mlp_loss), l2_reg=1e-3, **ADAPTIVE, **DETERMINISTIC
    )
    p_real, _, _ = run(opt, params, real, 2)
    p_pad, _, _ = run(opt, params, padded, 2)
    assert float(jnp.max(jnp.abs(p_real["w1"] - p_pad["w1"]))) > 1e-4


def test_pmap_equals_single_device_and_devices_agree():
    n = jax.local_device_count()
    assert n == 4
    params, batch = make_params(), make_batch(n=32)
    kwargs = dict(l2_reg=1e-3, **ADAPTIVE, **DETERMINISTIC)
    single = kfacx.Optimizer(jax.value_and_grad(mlp_loss), **kwargs)
    p_single, s_single, h_single = run(single, params, batch, 4)

    multi = kfacx.Optimizer(jax.value_and_grad(mlp_loss), multi_device=True, **kwargs)
    rep = kfacx.parallel.replicate_all_local_devices
    shard = kfacx.parallel.shard_batch
    p = rep(params)
    state = multi.init(p, rep(jax.random.key(7)), shard(batch))
    for i in range(4):
        p, state, stats = multi.step(p, state, rep(jax.random.key(100 + i)), shard(batch))
    for leaf in map(np.asarray, jax.tree.leaves((p, state))):
        np.testing.assert_array_equal(leaf[0], leaf[-1])
    assert_trees_close(p_single, jax.tree.map(lambda a: np.asarray(a)[0], p), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(stats["loss"][0], h_single[-1]["loss"], rtol=1e-5)
    np.testing.assert_allclose(stats["damping"][0], h_single[-1]["damping"], rtol=1e-5)
    assert int(state.data_seen[0]) == 4 * 32


def test_pmap_with_different_inverse_and_curvature_periods_keeps_devices_identical():
    n = 4
    params, batch = make_params(), make_batch(n=32)
    opt = kfacx.Optimizer(
        jax.value_and_grad(mlp_loss),
        multi_device=True,
        learning_rate_schedule=0.1,
        initial_damping=1e-2,
        curvature_update_period=2,
        inverse_update_period=3,
        num_burnin_steps=0,
    )
    rep = kfacx.parallel.replicate_all_local_devices
    sharded = kfacx.parallel.shard_batch(batch)
    p = rep(params)
    state = opt.init(p, rep(jax.random.key(0)), sharded)
    # Different rngs per device: the sampled statistics differ before the reduction.
    rngs = jax.random.split(jax.random.key(1), n)
    for i in range(5):
        step_rngs = jax.vmap(jax.random.fold_in, in_axes=(0, None))(rngs, i)
        p, state, _ = opt.step(p, state, step_rngs, sharded)
    for leaf in map(np.asarray, jax.tree.leaves((p, state))):
        np.testing.assert_array_equal(leaf[0], leaf[1])
        np.testing.assert_array_equal(leaf[0], leaf[-1])


# ----------------------------------------------------------------------------- quadratic model


def linear_regression_loss(params, batch):
    x, t = batch
    pred = x @ params["w"] + params["b"][None, :]
    kfacx.register_squared_error_loss(pred, t)
    # register_squared_error_loss is the mean over examples of ||pred - t||^2.
    return jnp.mean(jnp.sum(jnp.square(pred - t), axis=-1))


def regression_problem():
    kx, kt, kw = jax.random.split(jax.random.key(3), 3)
    x = jax.random.normal(kx, (40, 4))
    t = x @ jax.random.normal(kw, (4, 2)) + 0.1 * jax.random.normal(kt, (40, 2))
    params = dict(w=jnp.zeros((4, 2)), b=jnp.zeros(2))
    return params, (x, t)


def test_adaptive_coefficients_minimise_the_exact_quadratic_and_rho_is_one():
    """On a linear least-squares problem the Gauss-Newton model is the loss itself: the
    solved learning rate and momentum minimise it along both directions, and the
    reduction ratio is exactly 1."""
    with jax.enable_x64():
        params, batch = regression_problem()
        params = jax.tree.map(lambda a: a.astype(jnp.float64), params)
        batch = jax.tree.map(lambda a: a.astype(jnp.float64), batch)
        l2 = 1e-2
        opt = kfacx.Optimizer(
            jax.value_and_grad(linear_regression_loss),
            l2_reg=l2,
            add_l2_reg=True,
            **dict(ADAPTIVE, damping_adaptation_interval=1),
            **DETERMINISTIC,
        )
        state = opt.init(params, jax.random.key(0), batch)
        p = params
        for i in range(3):
            prev_p, prev_state = p, state
            p, state, stats = opt.step(p, state, jax.random.key(i), batch)
            np.testing.assert_allclose(stats["rho"], 1.0, rtol=1e-6)

        # The last step's coefficients minimise f(prev + a * precon + m * velocity).
        def objective(theta):
            return linear_regression_loss(theta, batch) + 0.5 * l2 * sum(
                jnp.vdot(v, v) for v in jax.tree.leaves(theta)
            )

        # Recover the preconditioned direction from delta = -lr * p + m * v.
        lr, mom = float(stats["learning_rate"]), float(stats["momentum"])
        c = np.array([-lr, mom])

        @jax.jit  # one compilation instead of one per operation run eagerly
        def model_check(delta, velocity, prev_p, p):
            precon = jax.tree.map(lambda d, v: (mom * v - d) / lr, delta, velocity)

            def along(c):
                return objective(
                    jax.tree.map(lambda t, u, v: t + c[0] * u + c[1] * v, prev_p, precon, velocity)
                )

            norms = jnp.array(
                [
                    [
                        _tree.tree_dot(precon, precon),
                        _tree.tree_dot(precon, velocity),
                    ],
                    [
                        _tree.tree_dot(precon, velocity),
                        _tree.tree_dot(velocity, velocity),
                    ],
                ]
            )
            return jax.grad(along)(jnp.asarray(c)), norms, objective(p) - objective(prev_p)

        grad_c, norms, change = model_check(state.velocities, prev_state.velocities, prev_p, p)
        # Minimiser of the damped model, so the undamped gradient is damping * (norms @ c).
        damping = float(stats["damping"])
        np.testing.assert_allclose(grad_c, -damping * np.asarray(norms) @ c, rtol=1e-6, atol=1e-10)
        # And the quadratic-model change is the actual change of the objective.
        np.testing.assert_allclose(stats["quad_model_change"], change, rtol=1e-6)


def test_damping_follows_the_levenberg_marquardt_rule():
    params, batch = regression_problem()
    opt = kfacx.Optimizer(
        jax.value_and_grad(linear_regression_loss),
        l2_reg=0.0,
        use_adaptive_learning_rate=True,
        use_adaptive_damping=True,
        initial_damping=1.0,
        damping_adaptation_interval=3,
        damping_adaptation_decay=0.5,
        min_damping=0.01,
        **DETERMINISTIC,
    )
    _, _, history = run(opt, params, batch, 9)
    dampings = [float(h["damping"]) for h in history]
    rhos = [float(h["rho"]) for h in history]
    # rho is only measured on adaptation steps (3rd, 6th, 9th) and is ~1 (> 0.75).
    for i, rho in enumerate(rhos):
        assert np.isfinite(rho) == ((i + 1) % 3 == 0)
    # Damping shrinks by decay**interval = 1/8 after each adaptation, clipped at 0.01.
    np.testing.assert_allclose(dampings, [1.0] * 3 + [0.125] * 3 + [0.015625] * 3, rtol=1e-6)
    _, state, _ = run(opt, params, batch, 12)
    np.testing.assert_allclose(state.damping, 0.01, rtol=1e-6)


def test_norm_constraint_bounds_the_step():
    params, batch = make_params(), make_batch()
    lr, c = 1.0, 1e-4
    kwargs = dict(learning_rate_schedule=lr, initial_damping=1e-3, **DETERMINISTIC)
    free = kfacx.Optimizer(jax.value_and_grad(mlp_loss), **kwargs)
    bounded = kfacx.Optimizer(jax.value_and_grad(mlp_loss), norm_constraint=c, **kwargs)
    free_params, _, _ = run(free, params, batch, 1)
    bounded_params, _, _ = run(bounded, params, batch, 1)

    @jax.jit  # one compilation instead of one per operation run eagerly
    def steps(free_params, bounded_params):
        grads = jax.grad(mlp_loss)(params, batch)
        delta0 = jax.tree.map(lambda a, b: a - b, free_params, params)
        delta = jax.tree.map(lambda a, b: a - b, bounded_params, params)
        coeff = jnp.sqrt(_tree.tree_dot(delta, delta) / _tree.tree_dot(delta0, delta0))
        p_dot_g = -_tree.tree_dot(delta0, grads) / lr
        return coeff, delta, jax.tree.map(lambda d: coeff * d, delta0), p_dot_g

    # The bounded step is the free step scaled by coeff with lr^2 coeff^2 p.g = c.
    coeff, delta, scaled_delta0, p_dot_g = steps(free_params, bounded_params)
    coeff, p_dot_g = np.asarray(coeff), np.asarray(p_dot_g)
    assert float(coeff) < 0.5
    assert_trees_close(delta, scaled_delta0, rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(lr**2 * coeff**2 * p_dot_g, c, rtol=1e-4)
    # A loose constraint changes nothing.
    loose = kfacx.Optimizer(jax.value_and_grad(mlp_loss), norm_constraint=1e3, **kwargs)
    loose_params, _, _ = run(loose, params, batch, 1)
    assert_trees_close(loose_params, free_params)


# ----------------------------------------------------------------------------- robustness


def test_non_finite_batch_skips_the_step():
    params, (x, y) = make_params(), make_batch()
    opt = kfacx.Optimizer(jax.value_and_grad(mlp_loss), l2_reg=1e-3, **ADAPTIVE, **DETERMINISTIC)
    state = opt.init(params, jax.random.key(0), (x, y))
    p1, s1, stats = opt.step(params, state, jax.random.key(1), (x, y))
    assert not bool(stats["skipped"])
    bad = (x.at[3, 2].set(jnp.nan), y)
    p2, s2, stats = opt.step(p1, s1, jax.random.key(2), bad)
    assert bool(stats["skipped"])
    jax.tree.map(np.testing.assert_array_equal, (p2, s2), (p1, s1))
    p3, s3, stats = opt.step(p2, s2, jax.random.key(3), (x, y))
    assert not bool(stats["skipped"]) and int(s3.step_counter) == 2
