"""kfacx.Optimizer options: burn-in, update periods, schedules and step arguments, flat
keyword arguments, bad values, the curvature subset (``curvature_batch_fraction``).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _optimizer_cases import DETERMINISTIC, make_batch, make_params, mlp_loss, run

import kfacx
from kfacx._helpers import _tree
from kfacx.optimizer import _loss_passes

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


@pytest.mark.parametrize(
    "bounds", [(1.0, 0.0), (0.0,), "0,1", (0.0, float("nan")), (0.0, float("inf"))]
)
def test_bad_momentum_bounds_raise(bounds):
    with pytest.raises(ValueError, match="momentum_bounds"):
        kfacx.LearningRateConfig(
            use_adaptive_learning_rate=True, use_adaptive_momentum=True, momentum_bounds=bounds
        )
