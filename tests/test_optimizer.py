"""kfacx.Optimizer: equivalences (optax chain, micro-batches, padding, pmap), the
quadratic model, damping adaptation, skipping non-finite steps, options."""

import dataclasses
import warnings

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfacx
from kfacx import _loss_passes, _tree

# ----------------------------------------------------------------------------- fixtures


def mlp_loss(params, batch):
    x, y = batch
    h = jnp.tanh(x @ params["w1"] + params["b1"][None, :])
    logits = h @ params["w2"] + params["b2"][None, :]
    kfacx.register_softmax_cross_entropy_loss(logits, y)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y))


def masked_mlp_loss(params, batch):
    x, y, mask = batch
    h = jnp.tanh(x @ params["w1"] + params["b1"][None, :])
    logits = h @ params["w2"] + params["b2"][None, :]
    kfacx.register_softmax_cross_entropy_loss(logits, y, mask=mask)
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, y)
    return jnp.sum(mask * nll) / jnp.sum(mask)


def make_params(seed=0, din=5, dh=8, dout=3):
    k = jax.random.split(jax.random.key(seed), 2)
    return dict(
        w1=jax.random.normal(k[0], (din, dh)) * 0.5,
        b1=jnp.zeros(dh),
        w2=jax.random.normal(k[1], (dh, dout)) * 0.5,
        b2=jnp.zeros(dout),
    )


def make_batch(n=32, din=5, seed=1):
    x = jax.random.normal(jax.random.key(seed), (n, din))
    y = (x[:, 0] > 0).astype(jnp.int32) + (x[:, 1] > 0).astype(jnp.int32)
    return x, y


def run(opt, params, batch, steps, func_state=None, **step_kwargs):
    state = opt.init(params, jax.random.key(7), batch, func_state)
    history = []
    for i in range(steps):
        out = opt.step(params, state, jax.random.key(100 + i), batch, func_state, **step_kwargs)
        if func_state is not None:
            params, state, func_state, stats = out
        else:
            params, state, stats = out
        history.append(stats)
    return params, state, history


def assert_trees_close(a, b, rtol=1e-5, atol=1e-6):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=rtol, atol=atol), a, b)


DETERMINISTIC = dict(estimation_mode="fisher_empirical", num_burnin_steps=0)


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


ADAPTIVE = dict(
    use_adaptive_learning_rate=True,
    use_adaptive_momentum=True,
    use_adaptive_damping=True,
    initial_damping=1.0,
    damping_adaptation_interval=2,
)


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


# ----------------------------------------------------------------------------- options


def test_burnin_updates_the_curvature_before_the_first_step():
    params, batch = make_params(), make_batch()
    opt = kfacx.Optimizer(
        jax.value_and_grad(mlp_loss),
        learning_rate_schedule=0.1,
        initial_damping=1e-2,
        estimation_mode="fisher_empirical",
        num_burnin_steps=3,
        curvature_ema=0.5,
    )
    state = opt.init(params, jax.random.key(0), batch)
    _, state, _ = opt.step(params, state, jax.random.key(1), batch)
    # 3 burn-in updates and 1 step: the bias-correction weight is 1 - 0.5**4.
    weight = state.estimator_state.blocks[0].factors[0].weight
    np.testing.assert_allclose(weight, 1 - 0.5**4, rtol=1e-6)
    # The second step does not burn in again.
    _, state, _ = opt.step(params, state, jax.random.key(2), batch)
    np.testing.assert_allclose(
        state.estimator_state.blocks[0].factors[0].weight, 1 - 0.5**5, rtol=1e-6
    )


def test_curvature_update_period_skips_factor_updates():
    params, batch = make_params(), make_batch()
    opt = kfacx.Optimizer(
        jax.value_and_grad(mlp_loss),
        learning_rate_schedule=0.1,
        initial_damping=1e-2,
        curvature_update_period=2,
        curvature_ema=0.5,
        **DETERMINISTIC,
    )
    _, state, _ = run(opt, params, batch, 3)  # updates at steps 0 and 2
    np.testing.assert_allclose(
        state.estimator_state.blocks[0].factors[0].weight, 1 - 0.5**2, rtol=1e-6
    )


def test_schedules_get_the_global_step():
    seen = []

    def lr_schedule(step):
        seen.append(step)
        return 0.1 / (1.0 + step)

    params, batch = make_params(), make_batch()
    opt = kfacx.Optimizer(
        jax.value_and_grad(mlp_loss),
        learning_rate_schedule=lr_schedule,
        momentum_schedule=lambda step: 0.5,
        damping_schedule=lambda step: 1e-2 * (step + 1),
        **DETERMINISTIC,
    )
    _, _, history = run(opt, params, batch, 3)
    np.testing.assert_allclose(
        [h["learning_rate"] for h in history], [0.1, 0.05, 0.1 / 3], rtol=1e-6
    )
    np.testing.assert_allclose([h["damping"] for h in history], [0.01, 0.02, 0.03], rtol=1e-6)
    np.testing.assert_allclose([h["momentum"] for h in history], [0.5] * 3)
    assert seen  # traced once by jit


def test_step_arguments_override_schedules():
    params, batch = make_params(), make_batch()
    opt = kfacx.Optimizer(jax.value_and_grad(mlp_loss), **DETERMINISTIC)
    state = opt.init(params, jax.random.key(0), batch)
    _, _, stats = opt.step(
        params, state, jax.random.key(1), batch, learning_rate=0.3, momentum=0.2, damping=0.1
    )
    np.testing.assert_allclose(
        [stats["learning_rate"], stats["momentum"], stats["damping"]], [0.3, 0.2, 0.1], rtol=1e-6
    )


def test_flat_kwargs_fill_the_configs():
    opt = kfacx.Optimizer(
        jax.value_and_grad(mlp_loss),
        l2_reg=1e-5,
        use_adaptive_damping=True,
        initial_damping=2.0,
        learning_rate_schedule=0.1,
        inverse_update_period=7,
        num_microbatches=2,
        curvature=kfacx.CurvatureConfig(curvature_ema=0.9),
    )
    assert opt.damping == kfacx.DampingConfig(use_adaptive_damping=True, initial_damping=2.0)
    assert opt.curvature.inverse_update_period == 7 and opt.curvature.curvature_ema == 0.9
    assert opt.batch.num_microbatches == 2
    assert opt.learning_rate.learning_rate_schedule == 0.1
    # Every config field has a distinct flat name.
    names = [
        f.name
        for cls in (
            kfacx.CurvatureConfig,
            kfacx.LearningRateConfig,
            kfacx.DampingConfig,
            kfacx.BatchConfig,
        )
        for f in dataclasses.fields(cls)
    ]
    assert len(names) == len(set(names))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(use_adaptive_dampening=True), TypeError, "unknown arguments"),
        (dict(distributed_precon_apply=True), TypeError, "every device applies"),
        (dict(mesh="data"), TypeError, "jax.sharding.Mesh"),
        (dict(use_shard_map=True), ValueError, "needs a mesh"),
        (dict(data_axis_name="data"), ValueError, "only used with mesh"),
        (dict(register_only_generic=True), TypeError, "auto_register_tags=False"),
        (dict(use_adaptive_momentum=True), ValueError, "use_adaptive_learning_rate"),
        (dict(use_adaptive_damping=True), ValueError, "initial_damping"),
        (
            dict(use_adaptive_learning_rate=True, norm_constraint=1.0),
            ValueError,
            "norm_constraint",
        ),
        (dict(curvature_ema=1.0), ValueError, "curvature_ema"),
        (dict(inverse_update_period=0), ValueError, "inverse_update_period"),
        (dict(num_microbatches=0), ValueError, "num_microbatches"),
        (dict(estimation_mode="fisher"), ValueError, "estimation_mode"),
        (dict(min_damping=2.0, max_damping=1.0), ValueError, "min_damping"),
        (dict(learning_rate_schedule="0.1x"), TypeError, "learning_rate_schedule must be a"),
        (dict(momentum_schedule=[0.9]), TypeError, "momentum_schedule must be a number"),
        (dict(damping_schedule="high"), TypeError, "damping_schedule must be a number"),
        (dict(curvature=dict(curvature_ema=0.9)), TypeError, "CurvatureConfig"),
        (dict(compiler_options="fast"), TypeError, "compiler_options must be a dict"),
        (
            dict(compiler_options={"xla_backend_optimization_level": 1}, multi_device=True),
            ValueError,
            "cannot take them",
        ),
    ],
)
def test_bad_options_raise_clear_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        kfacx.Optimizer(jax.value_and_grad(mlp_loss), **kwargs)


def test_options_are_read_only_after_construction():
    """The step, the estimator and the batch passes are built from the options once:
    changing them afterwards raises instead of being silently ignored."""
    opt = kfacx.Optimizer(jax.value_and_grad(mlp_loss), l2_reg=1e-3, initial_damping=1e-2)
    assert opt.l2_reg == 1e-3 and opt.damping.initial_damping == 1e-2
    for name in ("l2_reg", "curvature", "learning_rate", "damping", "batch"):
        with pytest.raises(AttributeError):
            setattr(opt, name, getattr(opt, name))


def test_missing_learning_rate_and_damping_raise():
    params, batch = make_params(), make_batch()
    opt = kfacx.Optimizer(jax.value_and_grad(mlp_loss), initial_damping=1e-3, **DETERMINISTIC)
    state = opt.init(params, jax.random.key(0), batch)
    with pytest.raises(ValueError, match="No learning rate"):
        opt.step(params, state, jax.random.key(1), batch)
    opt = kfacx.Optimizer(jax.value_and_grad(mlp_loss), learning_rate_schedule=0.1, **DETERMINISTIC)
    state = opt.init(params, jax.random.key(0), batch)
    with pytest.raises(ValueError, match="No damping"):
        opt.step(params, state, jax.random.key(1), batch)


def test_microbatches_must_divide_the_batch():
    params, batch = make_params(), make_batch(n=30)
    opt = kfacx.Optimizer(
        jax.value_and_grad(mlp_loss),
        num_microbatches=4,
        learning_rate_schedule=0.1,
        initial_damping=1e-2,
    )
    with pytest.raises(ValueError, match="num_microbatches=4 does not divide"):
        opt.init(params, jax.random.key(0), batch)


# ----------------------------------------------------------------------------- model kinds


def test_haiku_batchnorm_state_aux_and_rng():
    """value_func_has_state / has_aux / has_rng: BatchNorm statistics are threaded
    through the step and dropout gets a key."""

    def forward(x, is_training):
        x = hk.Linear(16)(x)
        x = hk.BatchNorm(True, True, 0.9)(x, is_training)
        x = jax.nn.relu(x)
        x = hk.dropout(hk.next_rng_key(), 0.1, x) if is_training else x
        return hk.Linear(3)(x)

    model = hk.transform_with_state(forward)

    def loss_fn(params, state, rng, batch):
        x, y = batch
        logits, new_state = model.apply(params, state, rng, x, True)
        kfacx.register_softmax_cross_entropy_loss(logits, y)
        loss = jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y))
        return loss, (new_state, dict(accuracy=jnp.mean(jnp.argmax(logits, -1) == y)))

    batch = make_batch(n=32)
    # one compilation instead of one per operation run eagerly
    params, func_state = jax.jit(model.init, static_argnums=2)(jax.random.key(0), batch[0], True)
    opt = kfacx.Optimizer(
        jax.value_and_grad(loss_fn, has_aux=True),
        l2_reg=1e-4,
        value_func_has_aux=True,
        value_func_has_state=True,
        value_func_has_rng=True,
        **ADAPTIVE,
        **DETERMINISTIC,
    )
    state = opt.init(params, jax.random.key(1), batch, func_state)
    report = opt.estimator.report
    assert report is not None and not report.unmatched
    losses = []
    for i in range(4):
        params, state, new_func_state, stats = opt.step(
            params, state, jax.random.key(i), batch, func_state
        )
        assert not jax.tree.all(
            jax.tree.map(
                lambda a, b: bool(np.all(np.asarray(a) == np.asarray(b))),
                new_func_state,
                func_state,
            )
        )
        func_state = new_func_state
        losses.append(float(stats["loss"]))
        assert 0.0 <= float(stats["aux"]["accuracy"]) <= 1.0
    assert losses[-1] < losses[0]
    with pytest.raises(ValueError, match="func_state"):
        opt.step(params, state, jax.random.key(0), batch)


def test_fisher_gradients_training_reduces_the_loss():
    params, batch = make_params(), make_batch(n=64)
    opt = kfacx.Optimizer(jax.value_and_grad(mlp_loss), l2_reg=1e-4, **ADAPTIVE, num_burnin_steps=2)
    _, _, history = run(opt, params, batch, 15)
    losses = [float(h["loss"]) for h in history]
    assert losses[-1] < 0.5 * losses[0]
    assert all(np.isfinite(losses))


def test_data_iterator_and_unstaged_step():
    params, batch = make_params(), make_batch()
    opt = kfacx.Optimizer(
        jax.value_and_grad(mlp_loss),
        learning_rate_schedule=0.1,
        initial_damping=1e-2,
        num_burnin_steps=2,
        estimation_mode="fisher_empirical",
    )
    state = opt.init(params, jax.random.key(0), batch)
    iterator = iter([batch] * 3)
    p_iter, s_iter, _ = opt.step(params, state, jax.random.key(1), data_iterator=iterator)
    with pytest.raises(StopIteration):
        next(iterator)  # 2 burn-in batches and 1 step batch were consumed
    with pytest.raises(ValueError, match="exactly one"):
        opt.step(params, state, jax.random.key(1))
    # The unstaged step is pure and can be staged by the user.
    p_u, s_u, _ = jax.jit(opt.unstaged_step)(params, s_iter, jax.random.key(2), batch)
    p_s, s_s, _ = opt.step(params, s_iter, jax.random.key(2), batch)
    assert_trees_close(p_u, p_s)
    del p_iter


@pytest.mark.parametrize("wrap", ["value_and_grad", "jit(value_and_grad)"])
def test_backward_pass_of_value_and_grad_is_not_mistaken_for_layers(wrap):
    """The optimizer traces the value output of value_and_grad_func; the backward pass
    (dy @ w.T ...) is dropped before detection, also inside jit."""
    value_and_grad = jax.value_and_grad(mlp_loss)
    if wrap == "jit(value_and_grad)":
        value_and_grad = jax.jit(value_and_grad)
    params, batch = make_params(), make_batch()
    opt = kfacx.Optimizer(
        value_and_grad, learning_rate_schedule=0.1, initial_damping=1e-2, **DETERMINISTIC
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.init(params, jax.random.key(0), batch)
    report = opt.estimator.report
    assert not report.unmatched and not report.notes
    assert {e.source for e in report.entries} == {"dense_with_bias"}
    assert [type(b).__name__ for b in opt.estimator.blocks] == ["DenseTwoKroneckerFactored"] * 2
    reference = kfacx.Optimizer(
        jax.value_and_grad(mlp_loss),
        learning_rate_schedule=0.1,
        initial_damping=1e-2,
        **DETERMINISTIC,
    )
    assert_trees_close(run(opt, params, batch, 2)[0], run(reference, params, batch, 2)[0])


def assert_factors_are_the_statistics_of(state, params, subset):
    """After one step (no burn-in), every factor is the statistic of ``subset``."""
    estimator = kfacx.BlockDiagonalCurvature(mlp_loss, default_estimation_mode="fisher_empirical")
    estimator.init(jax.random.key(0), (params, subset))
    # one compilation instead of one per operation run eagerly
    stats = jax.jit(estimator.compute_curvature_stats)(jax.random.key(0), (params, subset))
    for block_state, block_stats in zip(state.estimator_state.blocks, stats.blocks, strict=True):
        for factor, stat in zip(block_state.factors, block_stats, strict=True):
            np.testing.assert_allclose(factor.value, stat, rtol=1e-5, atol=1e-6)


def test_curvature_batch_fraction_estimates_on_the_leading_examples_only():
    params, batch = make_params(), make_batch(n=32)
    opt = kfacx.Optimizer(
        jax.value_and_grad(mlp_loss),
        learning_rate_schedule=0.1,
        initial_damping=1e-2,
        curvature_batch_fraction=0.25,
        **DETERMINISTIC,
    )
    _, state, history = run(opt, params, batch, 1)
    assert_factors_are_the_statistics_of(state, params, jax.tree.map(lambda a: a[:8], batch))

    @jax.jit  # one compilation instead of one per operation run eagerly
    def grad_norm(params, batch):
        grads = jax.grad(mlp_loss)(params, batch)
        return jnp.sqrt(_tree.tree_dot(grads, grads))

    # The gradient is still the full batch's.
    np.testing.assert_allclose(history[0]["grad_norm"], grad_norm(params, batch), rtol=1e-5)
    for bad in (0.0, 1.5, "1/8"):
        with pytest.raises(ValueError, match="curvature_batch_fraction"):
            kfacx.CurvatureConfig(curvature_batch_fraction=bad)


def test_default_curvature_subset_is_an_eighth_but_at_least_128_examples():
    """The subset's size for each rule (all of a small batch, at least 128, 1/8 rounded
    up), and end to end at batch 200: the factors are the first 128 examples' statistics
    (the same code path serves every size)."""
    params, batch = make_params(), make_batch(n=200)
    opt = kfacx.Optimizer(
        jax.value_and_grad(mlp_loss),
        learning_rate_schedule=0.1,
        initial_damping=1e-2,
        **DETERMINISTIC,
    )
    assert opt.curvature.curvature_batch_fraction is None
    for n, used in [(32, 32), (200, 128), (1040, 130)]:
        x = np.zeros((n, 1))
        assert _loss_passes._subset_size(x, opt._passes.curvature_fraction(x)) == used, n
    _, state, _ = run(opt, params, batch, 1)
    assert_factors_are_the_statistics_of(state, params, jax.tree.map(lambda a: a[:128], batch))


def test_replicate_accepts_pmap_outputs_and_keys():
    step = jax.pmap(lambda x, k: (2 * x, jax.random.normal(k, ())), axis_name="i")
    x = kfacx.parallel.replicate_all_local_devices(jnp.ones(3))
    keys = kfacx.parallel.replicate_all_local_devices(jax.random.key(0))
    y, r = step(x, keys)
    np.testing.assert_array_equal(r, r[0])  # the same key on every device
    again = kfacx.parallel.replicate_all_local_devices(kfacx.parallel.get_first(y))
    np.testing.assert_array_equal(step(again, keys)[0], 4 * np.ones((jax.local_device_count(), 3)))
    different = kfacx.parallel.make_different_rng_key_on_all_devices(jax.random.key(0))
    r = step(x, different)[1]
    assert len(set(np.asarray(r).tolist())) == jax.local_device_count()


def test_non_scalar_loss_is_a_clear_error():
    def vector_loss(params, batch):
        x, y = batch
        logits = x @ params["w1"] @ params["w2"]
        kfacx.register_softmax_cross_entropy_loss(logits, y)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y)  # per example

    params, batch = make_params(), make_batch()
    params = {k: params[k] for k in ("w1", "w2")}
    estimator = kfacx.BlockDiagonalCurvature(vector_loss)
    estimator.init(jax.random.key(0), (params, batch))
    with pytest.raises(ValueError, match="scalar float loss"):
        # raised while tracing (jitted: no operation is compiled on the way there)
        jax.jit(estimator.value_grads_and_curvature_stats)(jax.random.key(0), (params, batch))


def test_fast_compile_options_reach_the_step_and_change_nothing_but_rounding():
    """The options are handed to XLA (an unknown one is rejected at compilation), and
    the step they compile equals the default one to float32 rounding."""
    options = kfacx.fast_compile_options()
    assert options == {"xla_cpu_use_fusion_emitters": False, "xla_backend_optimization_level": 1}
    assert kfacx.fast_compile_options("gpu") == {}
    params, batch = make_params(), make_batch()
    kwargs = dict(learning_rate_schedule=0.1, momentum_schedule=0.5, damping_schedule=1e-2)

    def make(**extra):
        return kfacx.Optimizer(jax.value_and_grad(mlp_loss), **DETERMINISTIC, **kwargs, **extra)

    # XLA's defaults spelled out: tests/conftest.py compiles everything else with the
    # fast options.
    xla_defaults = {"xla_cpu_use_fusion_emitters": True, "xla_backend_optimization_level": 2}
    default = run(make(compiler_options=xla_defaults), params, batch, 3)
    fast = run(make(compiler_options=options), params, batch, 3)
    assert_trees_close(fast[:2], default[:2], rtol=1e-5, atol=1e-6)
    with pytest.raises(jax.errors.JaxRuntimeError, match="xla_no_such_option"):
        run(make(compiler_options={"xla_no_such_option": 1}), params, batch, 1)


@pytest.mark.parametrize(
    "bounds", [(1.0, 0.0), (0.0,), "0,1", (0.0, float("nan")), (0.0, float("inf"))]
)
def test_bad_momentum_bounds_raise(bounds):
    with pytest.raises(ValueError, match="momentum_bounds"):
        kfacx.LearningRateConfig(
            use_adaptive_learning_rate=True, use_adaptive_momentum=True, momentum_bounds=bounds
        )


def test_blocks_with_their_own_init_get_distinct_keys():
    """Built-in blocks ignore their init key (the eager split is skipped for them); a block
    class that overrides `init` gets one key per block, split from the estimator's."""
    seen = []

    class KeyedBlock(kfacx.blocks.DenseTwoKroneckerFactored):
        def init(self, rng, *args, **kwargs):
            seen.append(np.asarray(jax.random.key_data(rng)))
            return super().init(rng, *args, **kwargs)

    params, batch = make_params(), make_batch()
    est = kfacx.BlockDiagonalCurvature(mlp_loss, layer_tag_to_block_ctor={"dense_tag": KeyedBlock})
    rng = jax.random.key(3)
    est.init(rng, (params, batch))
    want = [np.asarray(jax.random.key_data(k)) for k in jax.random.split(rng, 2)]
    assert len(seen) == 2
    for got, expected in zip(seen, want, strict=True):
        np.testing.assert_array_equal(got, expected)
