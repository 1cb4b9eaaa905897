"""kfac-jax's Optimizer options beyond the basic ones, each against its definition:
``precon_power``, ``use_step_rejection``, ``use_initial_damping_calibration``,
``precon_damping_mult`` / ``precon_damping_schedule``,
``regularized_parameters_path_exclusions``, the ``fisher_empirical_direct``
estimation mode, ``norm_to_scale_identity_weight_per_block`` and
``damping_adaptation_interval_start``."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.flatten_util import ravel_pytree

import kfacx
from kfacx import _calibration, _configs, blocks
from kfacx._configs import KFAC_JAX_FIXED, KFAC_JAX_ONLY

DETERMINISTIC = dict(estimation_mode="fisher_empirical", num_burnin_steps=0)
PLAIN = (((1,), (0,)), ((), ()))
TRANSPOSED = (((1,), (1,)), ((), ()))


# ----------------------------------------------------------------------------- problems


def mlp_loss(params, batch):
    x, y = batch
    h = jnp.tanh(x @ params["w1"] + params["b1"][None, :])
    logits = h @ params["w2"] + params["b2"][None, :]
    kfacx.register_softmax_cross_entropy_loss(logits, y)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y))


def mlp_params(dtype=jnp.float32):
    k1, k2 = jax.random.split(jax.random.key(0))
    return dict(
        w1=(jax.random.normal(k1, (4, 5)) * 0.5).astype(dtype),
        b1=jnp.zeros(5, dtype),
        w2=(jax.random.normal(k2, (5, 3)) * 0.5).astype(dtype),
        b2=jnp.zeros(3, dtype),
    )


def mlp_batch(n=16, dtype=jnp.float32):
    x = jax.random.normal(jax.random.key(1), (n, 4)).astype(dtype)
    y = (x[:, 0] > 0).astype(jnp.int32) + (x[:, 1] > 0).astype(jnp.int32)
    return x, y


def linear_loss(params, batch):
    x, t = batch
    pred = x @ params["w"] + params["b"][None, :]
    kfacx.register_squared_error_loss(pred, t)
    return jnp.mean(jnp.sum(jnp.square(pred - t), axis=-1))


def linear_problem():
    """Linear least squares in float64 (call inside ``jax.enable_x64``): its
    Gauss-Newton model is the loss itself."""
    kx, kt, kw = jax.random.split(jax.random.key(3), 3)
    x = jax.random.normal(kx, (24, 3), jnp.float64)
    t = x @ jax.random.normal(kw, (3, 2), jnp.float64) + 0.1 * jax.random.normal(kt, (24, 2))
    params = dict(w=jnp.full((3, 2), 0.1, jnp.float64), b=jnp.full((2,), 0.2, jnp.float64))
    return params, (x, t)


def one_step(opt, params, batch, **step_kwargs):
    state = opt.init(params, jax.random.key(7), batch)
    new_params, new_state, stats = opt.step(params, state, jax.random.key(8), batch, **step_kwargs)
    return state, new_params, new_state, stats


def flat(tree):
    return np.asarray(ravel_pytree(tree)[0], np.float64)


def dense_power(matrix, weight, power):
    vals, vecs = np.linalg.eigh(np.asarray(matrix, np.float64))
    return vecs @ np.diag(np.power(np.maximum(vals, 0) + weight, power)) @ vecs.T


# ----------------------------------------------------------------------------- the option list


def test_the_options_are_taken_and_kfac_jax_only_keeps_what_does_not_apply():
    added = dict(
        precon_power=-0.5,
        use_exact_inverses=True,
        use_step_rejection=True,
        use_adaptive_damping=True,
        initial_damping=1.0,
        use_initial_damping_calibration=True,
        precon_damping_mult=2.0,
        norm_to_scale_identity_weight_per_block="avg_diag",
        damping_adaptation_interval_start=3,
        estimation_mode="fisher_empirical_direct",
    )
    opt = kfacx.Optimizer(jax.value_and_grad(mlp_loss), **added)
    assert opt.curvature.precon_power == -0.5 and opt.damping.use_step_rejection
    assert opt.estimator.norm_to_scale_identity_weight_per_block == "avg_diag"
    for name in (*added, "precon_damping_schedule", "regularized_parameters_path_exclusions"):
        assert name not in KFAC_JAX_ONLY
    assert "fisher_empirical_direct" in kfacx.ESTIMATION_MODES


def test_kfac_jax_options_fixed_in_kfacx_are_taken_with_their_value_only():
    fixed = {name: value for name, (value, _) in KFAC_JAX_FIXED.items()}
    opt = kfacx.Optimizer(jax.value_and_grad(mlp_loss), **fixed)
    assert opt.curvature == kfacx.Optimizer(jax.value_and_grad(mlp_loss)).curvature
    for name, value in fixed.items():
        with pytest.raises(ValueError, match=f"{name}={not value} is not supported: .*leave it"):
            kfacx.Optimizer(jax.value_and_grad(mlp_loss), **{name: not value})
    with pytest.raises(TypeError, match="'batch_process_func' is not taken .* loss function"):
        kfacx.Optimizer(jax.value_and_grad(mlp_loss), batch_process_func=lambda b: b)
    assert not set(KFAC_JAX_FIXED) & set(KFAC_JAX_ONLY)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(precon_power=-0.3), ValueError, "precon_power=-0.3 needs use_exact_inverses"),
        (dict(precon_power=0.5, use_exact_inverses=True), ValueError, "negative number"),
        (dict(precon_damping_mult=0.0), ValueError, "precon_damping_mult must be a positive"),
        (
            dict(precon_damping_mult=2.0, precon_damping_schedule=0.1),
            ValueError,
            "either precon_damping_schedule or precon_damping_mult",
        ),
        (dict(precon_damping_schedule="x"), TypeError, "precon_damping_schedule must be"),
        (dict(use_initial_damping_calibration=True), ValueError, "needs use_adaptive_damping"),
        (dict(damping_adaptation_interval_start=-1), ValueError, "interval_start must be"),
        (dict(use_step_rejection="yes"), TypeError, "use_step_rejection must be True or False"),
        (dict(norm_to_scale_identity_weight_per_block="max"), ValueError, "is not a norm"),
        (dict(estimation_mode="fisher_direct"), ValueError, "fisher_empirical_direct"),
        (dict(regularized_parameters_path_exclusions="b"), TypeError, "sequence of regular"),
        (dict(regularized_parameters_path_exclusions=["("]), ValueError, "not a regular"),
    ],
)
def test_bad_values_raise_clear_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        kfacx.Optimizer(jax.value_and_grad(mlp_loss), **kwargs)


# ----------------------------------------------------------------------------- precon_power


def test_precon_power_is_the_dense_damped_curvature_to_that_power():
    """``precon_power=-0.5`` with exact powers: the step is ``-lr (D + (damping + l2) I)^-1/2
    g`` for the dense block-diagonal curvature ``D`` after the step's update; factored
    damping's ``-1/2`` power applied twice is its inverse."""
    with jax.enable_x64():
        params, batch = mlp_params(jnp.float64), mlp_batch(dtype=jnp.float64)
        # Exact in float32 (the damping, the learning rate and their sums are float32).
        lr, damping, l2 = 0.125, 2.0**-4, 2.0**-10
        opt = kfacx.Optimizer(
            jax.value_and_grad(mlp_loss),
            l2_reg=l2,
            add_l2_reg=True,
            precon_power=-0.5,
            use_exact_inverses=True,
            learning_rate_schedule=lr,
            initial_damping=damping,
            **DETERMINISTIC,
        )
        _, new_params, new_state, _ = one_step(opt, params, batch)
        precon = (flat(params) - flat(new_params)) / lr
        est = opt.estimator

        @jax.jit
        def reference(est_state):
            grads = jax.grad(mlp_loss)(params, batch)
            grads = jax.tree.map(lambda g, p: g + l2 * p, grads, params)
            half = est.multiply_matpower(est_state, grads, 0.3, -0.5)
            twice = est.multiply_matpower(est_state, half, 0.3, -0.5)
            inverse = est.multiply_matpower(est_state, grads, 0.3, -1)
            return grads, est.to_dense_matrix(est_state), twice, inverse

        grads, dense, twice, inverse = reference(new_state.estimator_state)
        expected = dense_power(dense, damping + l2, -0.5) @ flat(grads)
        np.testing.assert_allclose(precon, expected, rtol=1e-10, atol=1e-13)
        assert not np.allclose(precon, dense_power(dense, damping + l2, -1.0) @ flat(grads))
        # Factored damping: the -1/2 power applied twice is the -1 power.
        np.testing.assert_allclose(flat(twice), flat(inverse), rtol=1e-9, atol=1e-12)


def _scale_by_kfac_steps(tx, est, params, batch, steps):
    @jax.jit
    def step(params, opt_state):
        _, grads, stats = est.value_grads_and_curvature_stats(jax.random.key(0), (params, batch))
        updates, opt_state = tx.update(grads, opt_state, params, curvature_stats=stats)
        return optax.apply_updates(params, updates), opt_state

    trajectory, opt_state = [], tx.init(params)
    for _ in range(steps):
        params, opt_state = step(params, opt_state)
        trajectory.append(params)
    return trajectory


def test_scale_by_kfac_precon_power_takes_the_optimizer_steps():
    """``scale_by_kfac(precon_power=-0.5)`` then ``sgd`` takes the steps of the Optimizer
    with the same power; inside ``optax.masked`` the kept blocks get that power too."""
    with jax.enable_x64():
        params, batch = mlp_params(jnp.float64), mlp_batch(dtype=jnp.float64)
        lr, damping, steps = 0.125, 2.0**-4, 3
        common = dict(precon_power=-0.5, use_exact_inverses=True, curvature_ema=0.5)
        opt = kfacx.Optimizer(
            jax.value_and_grad(mlp_loss),
            learning_rate_schedule=lr,
            initial_damping=damping,
            inverse_update_period=1,
            **common,
            **DETERMINISTIC,
        )
        want, state = [], opt.init(params, jax.random.key(0), batch)
        current = params
        for i in range(steps):
            current, state, _ = opt.step(current, state, jax.random.key(i), batch)
            want.append(current)
        est = kfacx.BlockDiagonalCurvature(
            mlp_loss,
            default_estimation_mode="fisher_empirical",
            exact_powers_to_cache=(-0.5,),
            approx_powers_to_cache=(),
        )
        kfac = kfacx.scale_by_kfac(
            est, (params, batch), damping=damping, inverse_update_period=1, **common
        )
        got = _scale_by_kfac_steps(optax.chain(kfac, optax.sgd(lr)), est, params, batch, steps)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(flat(g), flat(w), rtol=1e-9, atol=1e-12)
        # Masked to the output layer (a block of its own): the same step there; the
        # hidden layer's gradient passes through both masks unchanged.
        keep_out = dict(w1=False, b1=False, w2=True, b2=True)
        masked = optax.chain(optax.masked(kfac, keep_out), optax.masked(optax.sgd(lr), keep_out))
        got = _scale_by_kfac_steps(masked, est, params, batch, 1)[0]
        # one compilation instead of one per operation run eagerly
        grads = jax.jit(jax.grad(mlp_loss))(params, batch)
        np.testing.assert_allclose(got["w1"], params["w1"] + grads["w1"], rtol=1e-12)
        np.testing.assert_allclose(flat(got["w2"]), flat(want[0]["w2"]), rtol=1e-9, atol=1e-12)


def test_masked_scale_by_kfac_scales_each_kept_blocks_damping_by_its_norm():
    """``norm_to_scale_identity_weight_per_block`` inside ``optax.masked``: the kept
    block is damped as in the whole model (its own norm times the damping)."""
    with jax.enable_x64():
        params, batch = mlp_params(jnp.float64), mlp_batch(dtype=jnp.float64)
        est = kfacx.BlockDiagonalCurvature(
            mlp_loss,
            default_estimation_mode="fisher_empirical",
            norm_to_scale_identity_weight_per_block="avg_diag",
        )
        kfac = kfacx.scale_by_kfac(est, (params, batch), damping=0.5, curvature_ema=0.0)
        keep_out = dict(w1=False, b1=False, w2=True, b2=True)
        whole = _scale_by_kfac_steps(kfac, est, params, batch, 1)[0]
        masked = _scale_by_kfac_steps(optax.masked(kfac, keep_out), est, params, batch, 1)[0]
        np.testing.assert_allclose(flat(masked["w2"]), flat(whole["w2"]), rtol=1e-12)
        unscaled = kfacx.BlockDiagonalCurvature(
            mlp_loss, default_estimation_mode="fisher_empirical"
        )
        plain = kfacx.scale_by_kfac(unscaled, (params, batch), damping=0.5, curvature_ema=0.0)
        other = _scale_by_kfac_steps(plain, unscaled, params, batch, 1)[0]
        assert not np.allclose(flat(other["w2"]), flat(whole["w2"]), rtol=1e-6)


def test_scale_by_kfac_precon_power_bad_values_and_inject_hyperparams():
    est = kfacx.BlockDiagonalCurvature(mlp_loss)
    args = (mlp_params(), mlp_batch())
    with pytest.raises(ValueError, match="precon_power=-0.3 needs use_exact_inverses"):
        kfacx.scale_by_kfac(est, args, precon_power=-0.3)
    with pytest.raises(ValueError, match="precon_power must be a negative number"):
        kfacx.scale_by_kfac(est, args, precon_power="-1")
    # The default (None) is not a hyperparameter; a number is, and must be made static.
    injected = optax.inject_hyperparams(kfacx.scale_by_kfac)
    assert "precon_power" not in injected(est, args).init(args[0]).hyperparams
    tx = injected(est, args, precon_power=-0.5)
    grads, state = jax.tree.map(jnp.zeros_like, args[0]), tx.init(args[0])
    # one compilation instead of one per operation run eagerly
    _, _, stats = jax.jit(est.value_grads_and_curvature_stats)(jax.random.key(0), args)
    with pytest.raises(ValueError, match=r"static_args=\('precon_power',\)"):
        jax.jit(lambda s: tx.update(grads, s, curvature_stats=stats))(state)
    static = optax.inject_hyperparams(kfacx.scale_by_kfac, static_args=("precon_power",))
    assert "precon_power" not in static(est, args, precon_power=-1).init(args[0]).hyperparams


# ----------------------------------------------------------------------------- step rejection


def test_step_rejection_keeps_parameters_and_momentum_when_rho_is_negative():
    """A step that raises the batch loss (``rho < 0``) keeps the parameters and the
    velocities; the curvature estimate, counters and the (adapted) damping move on."""
    params, batch = mlp_params(), mlp_batch()
    opt = kfacx.Optimizer(
        jax.value_and_grad(mlp_loss),
        use_step_rejection=True,
        use_adaptive_damping=True,
        initial_damping=0.01,
        min_damping=1e-8,
        damping_adaptation_interval=1,
        momentum_schedule=0.5,
        **DETERMINISTIC,
    )
    state = opt.init(params, jax.random.key(0), batch)
    good, state1, stats1 = opt.step(params, state, jax.random.key(1), batch, learning_rate=0.05)
    assert not bool(stats1["rejected"]) and float(stats1["rho"]) > 0
    loss = jax.jit(mlp_loss)  # one compilation instead of one per operation run eagerly
    assert float(loss(good, batch)) < float(loss(params, batch))
    np.testing.assert_allclose(flat(good) - flat(params), flat(state1.velocities), atol=1e-7)

    big_batch = (batch[0] * 3.0, batch[1])  # another batch, for a fresh curvature update
    kept, state2, stats2 = opt.step(good, state1, jax.random.key(2), big_batch, learning_rate=1e3)
    assert bool(stats2["rejected"])
    # rho * quad_model_change is the actual change of the loss: it went up.
    assert float(stats2["rho"]) * float(stats2["quad_model_change"]) > 0
    np.testing.assert_array_equal(flat(kept), flat(good))
    np.testing.assert_array_equal(flat(state2.velocities), flat(state1.velocities))
    assert int(state2.step_counter) == 2 and int(state2.data_seen) == 32
    old_factors = jax.tree.leaves(state1.estimator_state)
    new_factors = jax.tree.leaves(state2.estimator_state)
    assert any(not np.array_equal(a, b) for a, b in zip(old_factors, new_factors, strict=True))
    decay = 0.9  # a rejected step at an adaptation step: the damping grows by 1 / decay**1
    np.testing.assert_allclose(state2.damping, state1.damping / decay, rtol=1e-6)


# ----------------------------------------------------------------------------- calibration


def test_initial_damping_calibration_applies_the_rule_to_the_first_step():
    """The calibrated damping is what `kfacx._calibration.calibrate` gives for the ratio
    ``rho(d)`` of the first step with damping ``d`` (measured with a plain optimizer):
    from a large initial damping (rho near 1) it shrinks by ``decay**interval`` until
    ``rho <= damping_upper_threshold``, and the first step's ``rho`` is then in the
    thresholds (or the ratio jumped below them at half the damping, which is kept)."""
    params, batch = mlp_params(), mlp_batch()
    kwargs = dict(
        learning_rate_schedule=4.0,
        use_adaptive_damping=True,
        damping_adaptation_interval=1,
        damping_adaptation_decay=0.5,
        **DETERMINISTIC,
    )
    calibrated = kfacx.Optimizer(
        jax.value_and_grad(mlp_loss),
        initial_damping=30.0,
        use_initial_damping_calibration=True,
        **kwargs,
    )
    _, _, _, stats = one_step(calibrated, params, batch)
    plain = kfacx.Optimizer(jax.value_and_grad(mlp_loss), initial_damping=30.0, **kwargs)
    state = plain.init(params, jax.random.key(7), batch)

    def rho_at(d):
        trial = state._replace(damping=jnp.float32(d))
        return float(plain.step(params, trial, jax.random.key(8), batch)[-1]["rho"])

    damping = float(stats["damping"])
    np.testing.assert_allclose(damping, _calibration.calibrate(rho_at, plain.damping, 30.0))
    k = np.log(30.0 / damping) / np.log(2.0)
    assert k > 0.5 and abs(k - round(k)) < 1e-4, k
    assert rho_at(30.0) > 0.75 and rho_at(2 * damping) > 0.75
    rho = float(stats["rho"])
    np.testing.assert_allclose(rho, rho_at(damping), rtol=1e-5)
    assert 0.25 <= rho <= 0.75 or (rho > 0.75 and rho_at(damping / 2) < 0.25)


def test_calibration_rule_on_a_known_ratio():
    """`kfacx._calibration.calibrate` with ``rho(d)`` given: the first damping inside the
    thresholds, the larger one when the ratio jumps over them, the bounds."""
    cfg = kfacx.DampingConfig(
        use_adaptive_damping=True,
        initial_damping=1.0,
        damping_adaptation_interval=1,
        damping_adaptation_decay=0.5,
        min_damping=1e-3,
        max_damping=64.0,
    )

    def smooth(d):  # grows with the damping
        return d / (d + 1.0)

    assert _calibration.calibrate(smooth, cfg, 1 / 64) == 0.5  # rho 1/3
    assert _calibration.calibrate(smooth, cfg, 16.0) == 2.0  # rho 2/3

    def jump(d):
        return 0.1 if d < 4.0 else 0.9

    assert _calibration.calibrate(jump, cfg, 1.0) == 4.0
    assert _calibration.calibrate(jump, cfg, 32.0) == 4.0
    assert _calibration.calibrate(lambda d: float("nan"), cfg, 1.0) == 64.0
    assert _calibration.calibrate(lambda d: 1.0, cfg, 1.0) == 1e-3


# ----------------------------------------------------------------------------- precon damping


def test_precon_damping_mult_scales_only_the_preconditioner_damping():
    """With ``precon_damping_mult=m`` the preconditioner is the factored inverse with
    ``m * damping + l2``, while the adaptive learning rate minimises the quadratic model
    damped with ``damping`` itself."""
    with jax.enable_x64():
        params, batch = linear_problem()
        damping, mult = 2.0**-4, 4.0  # exact in float32
        opt = kfacx.Optimizer(
            jax.value_and_grad(linear_loss),
            precon_damping_mult=mult,
            use_adaptive_learning_rate=True,
            **DETERMINISTIC,
        )
        state, new_params, new_state, stats = one_step(opt, params, batch, damping=damping)
        np.testing.assert_allclose(stats["damping"], damping)
        est = opt.estimator
        # one compilation instead of one per operation run eagerly
        grads = jax.jit(jax.grad(linear_loss))(params, batch)
        precon = jax.jit(est.multiply_matpower, static_argnums=3)(
            new_state.estimator_state, grads, mult * damping, -1
        )
        delta = flat(new_params) - flat(params)
        lr = -(delta @ flat(precon)) / (flat(precon) @ flat(precon))  # delta = -lr * precon
        np.testing.assert_allclose(delta, -lr * flat(precon), rtol=1e-9)
        np.testing.assert_allclose(lr, stats["learning_rate"], rtol=1e-6)

        def along(c):
            moved = jax.tree.map(lambda t, p: t + c * p, params, precon)
            return linear_loss(moved, batch)

        # The minimiser of loss(c) + 0.5 * damping * c^2 |p|^2 (the exact model) is -lr.
        slope = jax.jit(jax.grad(along))(-lr)  # one compilation, not one per operation
        pp = float(flat(precon) @ flat(precon))
        np.testing.assert_allclose(slope, damping * pp * lr, rtol=1e-6)
        assert not np.isclose(float(slope), mult * damping * pp * lr, rtol=1e-3)


def test_precon_damping_schedule_gives_the_preconditioner_damping():
    """With ``precon_damping_schedule`` the preconditioner does not depend on the damping
    (with a fixed learning rate: the parameters are equal bit for bit)."""
    params, batch = mlp_params(), mlp_batch()
    opt = kfacx.Optimizer(
        jax.value_and_grad(mlp_loss),
        precon_damping_schedule=lambda step: 0.2 + 0.0 * step,
        learning_rate_schedule=0.1,
        **DETERMINISTIC,
    )
    state, p1, state1, _ = one_step(opt, params, batch, damping=0.01)
    p2, _, _ = opt.step(params, state, jax.random.key(8), batch, damping=5.0)
    np.testing.assert_array_equal(flat(p1), flat(p2))
    grads = jax.jit(jax.grad(mlp_loss))(params, batch)  # one compilation, not one per operation
    expected = jax.jit(opt.estimator.multiply_matpower, static_argnums=3)(
        state1.estimator_state, grads, 0.2, -1
    )
    np.testing.assert_allclose(
        (flat(params) - flat(p1)) / 0.1, flat(expected), rtol=2e-4, atol=1e-6
    )


# ----------------------------------------------------------------------------- l2 exclusions


def test_path_exclusions_leave_parameters_out_of_the_regularized_objective():
    """On linear least squares with ``l2_reg`` on ``w`` only, the quadratic model is the
    objective ``loss + 0.5 l2 |w|^2``: rho is 1 and the model change is its change (a
    decay of ``b`` in the gradient, the model or rho would break both)."""
    with jax.enable_x64():
        params, batch = linear_problem()
        l2 = 0.3
        opt = kfacx.Optimizer(
            jax.value_and_grad(linear_loss),
            l2_reg=l2,
            add_l2_reg=True,
            regularized_parameters_path_exclusions=(r"^b$",),
            use_adaptive_learning_rate=True,
            use_adaptive_momentum=True,
            use_adaptive_damping=True,
            initial_damping=1.0,
            damping_adaptation_interval=1,
            **DETERMINISTIC,
        )

        @jax.jit  # one compilation instead of one per operation run eagerly
        def objective(p):
            return linear_loss(p, batch) + 0.5 * l2 * jnp.vdot(p["w"], p["w"])

        state = opt.init(params, jax.random.key(0), batch)
        p = params
        for i in range(2):
            new_p, state, stats = opt.step(p, state, jax.random.key(i), batch)
            np.testing.assert_allclose(stats["rho"], 1.0, rtol=1e-6)  # float32 stats
            change = objective(new_p) - objective(p)
            np.testing.assert_allclose(stats["quad_model_change"], change, rtol=1e-6)
            p = new_p


def scaled_mlp_loss(params, batch):
    """The MLP with its logits scaled by a parameter ``s`` of its own (a generic tag)."""
    x, y = batch
    s = kfacx.register_generic(params["s"])
    h = jnp.tanh(x @ params["w1"] + params["b1"][None, :])
    logits = (h @ params["w2"] + params["b2"][None, :]) * s[None, :]
    kfacx.register_softmax_cross_entropy_loss(logits, y)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y))


def test_path_exclusions_drop_weight_decay_and_the_l2_damping_of_excluded_blocks():
    """A block all of whose parameters are excluded gets no ``l2_reg`` in its damping and
    no weight decay: ``p_s = g_s / (D_s + damping)``; a dense block whose bias only is
    excluded keeps ``l2_reg`` in its damping (one damping per block) and decays ``w``."""
    params = dict(mlp_params(), s=jnp.array([0.6, 0.5, 0.8]))
    batch = mlp_batch()
    lr, damping, l2 = 0.1, 0.02, 0.5
    opt = kfacx.Optimizer(
        jax.value_and_grad(scaled_mlp_loss),
        l2_reg=l2,
        add_l2_reg=True,
        regularized_parameters_path_exclusions=("^s$", "^b"),
        learning_rate_schedule=lr,
        initial_damping=damping,
        **DETERMINISTIC,
    )
    _, new_params, new_state, _ = one_step(opt, params, batch)
    precon = jax.tree.map(lambda a, b: (a - b) / lr, params, new_params)
    grads = jax.jit(jax.grad(scaled_mlp_loss))(params, batch)  # one compilation
    est, est_state = opt.estimator, new_state.estimator_state
    names = est.params_to_blocks({k: k for k in params})
    (s_block,) = [i for i, n in enumerate(names) if n == ("s",)]
    diag = est_state.blocks[s_block].factors[0].value
    np.testing.assert_allclose(precon["s"], grads["s"] / (diag + damping), rtol=1e-5)
    assert not np.allclose(precon["s"], grads["s"] / (diag + damping + l2), rtol=1e-3)
    decayed = dict(grads, w1=grads["w1"] + l2 * params["w1"], w2=grads["w2"] + l2 * params["w2"])
    weights = tuple(damping if i == s_block else damping + l2 for i in range(len(names)))
    expected = jax.jit(est.multiply_matpower, static_argnums=3)(est_state, decayed, weights, -1)
    np.testing.assert_allclose(flat(precon), flat(expected), rtol=2e-4, atol=1e-6)


def test_a_pattern_matching_no_parameter_is_an_error_at_init():
    opt = kfacx.Optimizer(
        jax.value_and_grad(mlp_loss),
        l2_reg=1e-3,
        regularized_parameters_path_exclusions=("bias",),
        learning_rate_schedule=0.1,
    )
    with pytest.raises(ValueError, match=r"'bias' matches no parameter .*'b1', 'b2'"):
        opt.init(mlp_params(), jax.random.key(0), mlp_batch())


# ----------------------------------------------------------------------------- direct mode


def extra_term_loss(params, batch):
    """The registered cross-entropy plus an unregistered penalty on the logits."""
    x, y = batch
    h = jnp.tanh(x @ params["w1"] + params["b1"][None, :])
    logits = h @ params["w2"] + params["b2"][None, :]
    kfacx.register_softmax_cross_entropy_loss(logits, y)
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, y)
    return jnp.mean(nll + 0.3 * jnp.sum(jnp.square(logits), axis=-1))


def test_fisher_empirical_direct_takes_the_per_example_gradients_of_the_value():
    """``fisher_empirical_direct``: each example's row is ``B`` times the gradient of the
    function's value (its own term of the mean) with respect to a layer's outputs; on a
    loss that is the registered one it is ``fisher_empirical``."""
    params, batch = mlp_params(), mlp_batch(8)
    args, key, mode = (params, batch), jax.random.key(0), "fisher_empirical_direct"
    est = kfacx.BlockDiagonalCurvature(mlp_loss)
    extra = kfacx.BlockDiagonalCurvature(extra_term_loss)
    est.set_up(args)
    extra.set_up(args)
    x, y = batch

    def value_of_logits(z):
        nll = optax.softmax_cross_entropy_with_integer_labels(z, y)
        return jnp.mean(nll + 0.3 * jnp.sum(jnp.square(z), axis=-1))

    @jax.jit
    def statistics(args):
        _, _, direct = est.value_grads_and_curvature_stats(key, args, estimation_mode=mode)
        empirical = est.compute_curvature_stats(key, args, estimation_mode="fisher_empirical")
        _, _, with_extra = extra.value_grads_and_curvature_stats(key, args, estimation_mode=mode)
        subset = extra.compute_curvature_stats(key, args, estimation_mode=mode)
        params, _ = args
        h = jnp.tanh(x @ params["w1"] + params["b1"][None, :])
        rows = 8 * jax.grad(value_of_logits)(h @ params["w2"] + params["b2"][None, :])
        return direct, empirical, with_extra, subset, rows.T @ rows / 8

    direct, empirical, with_extra, subset, expected = statistics(args)
    for a, b in zip(jax.tree.leaves(direct), jax.tree.leaves(empirical), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    last = [i for i, b in enumerate(extra.blocks) if b.parameters_shapes[0] == (5, 3)][0]
    np.testing.assert_allclose(with_extra.blocks[last][1][0], expected, rtol=1e-5, atol=1e-6)
    assert not np.allclose(with_extra.blocks[last][1], empirical.blocks[last][1], rtol=1e-2)
    for a, b in zip(jax.tree.leaves(subset), jax.tree.leaves(with_extra), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-8)


# ----------------------------------------------------------------------------- block norms


def _random_state(block, seed):
    """A state whose factors are random PSD matrices / positive diagonals."""
    rng = np.random.default_rng(seed)
    stats = []
    for shape in block.factor_shapes():
        if len(shape) >= 2 and shape[-1] == shape[-2]:
            x = rng.standard_normal(shape[:-1] + (shape[-1] + 2,))
            stats.append(x @ np.swapaxes(x, -1, -2))
        else:
            stats.append(rng.uniform(0.1, 2.0, shape))
    state = block.init(jax.random.key(0))
    stats = tuple(jnp.asarray(s, block.dtype) for s in stats)
    return block.update_from_statistics(state, stats, 0.0, 1.0)


def _layer(tag, shapes, x_shape=None, y_shape=None, meta=None, **extra):
    return blocks.LayerInfo(
        tag_name=tag,
        parameter_paths=tuple(f"p{i}" for i in range(len(shapes))),
        parameter_shapes=tuple(shapes),
        parameter_dtypes=(jnp.float64,) * len(shapes),
        input_shapes=() if x_shape is None else (x_shape,),
        output_shapes=() if y_shape is None else (y_shape,),
        meta=meta or {},
        **extra,
    )


def _norm_blocks():
    dense = _layer("dense_tag", [(4, 3), (3,)], (5, 4), (5, 3), {"dimension_numbers": PLAIN})
    conv_meta = kfacx.tags.conv_meta((2, 4, 5, 5), (6, 2, 2, 2), feature_group_count=2)
    conv = _layer("conv_tag", [(6, 2, 2, 2)], (2, 4, 5, 5), (2, 6, 4, 4), conv_meta)
    stacked = dataclasses.replace(
        _layer("dense_tag", [(2, 4, 3)], (2, 5, 4), (2, 5, 3), {"dimension_numbers": PLAIN}),
        stack_size=2,
    )
    enc = _layer("dense_tag", [(4, 3), (3,)], (2, 4), (2, 3), {"dimension_numbers": PLAIN})
    dec = _layer("dense_tag", [(4, 3), (4,)], (2, 3), (2, 4), {"dimension_numbers": TRANSPOSED})
    tied = _layer(blocks.TIED_TAG, [(4, 3), (3,), (4,)], roles=(enc, dec))
    tied = dataclasses.replace(tied, role_params=((0, 1), (0, 2)))
    return {
        "kronecker": blocks.DenseTwoKroneckerFactored(dense),
        "conv_groups": blocks.ConvTwoKroneckerFactored(conv),
        "diagonal": blocks.Diagonal(dense),
        "full": blocks.Full(dense),
        "embedding": blocks.EmbeddingKroneckerFactored(_layer("embedding_tag", [(6, 3)])),
        "stacked": blocks.StackedBlock(stacked, blocks.DenseTwoKroneckerFactored),
        "tied": blocks.TiedKroneckerFactored(tied),
    }


def _dense_norm(m, norm_type):
    n = m.shape[0]
    eig = np.maximum(np.linalg.eigvalsh(m), 0)
    fro = np.linalg.norm(m)
    return {
        "avg_diag": np.trace(m) / n,
        "median_diag": np.median(np.diag(m)),
        "trace": np.trace(m),
        "median_eig": np.median(eig),
        "one_over_dim": 1.0 / n,
        "1_norm": np.max(np.sum(np.abs(m), axis=0)),
        "avg_fro": fro / np.sqrt(n),
        "fro": fro,
        "2_norm": np.max(eig),
    }[norm_type]


def test_block_norms_equal_the_norms_of_the_dense_matrix():
    with jax.enable_x64():
        kinds = _norm_blocks()
        states = {
            name: _random_state(block, seed) for seed, (name, block) in enumerate(kinds.items())
        }

        @jax.jit
        def norms_and_dense(states):
            return {
                name: (
                    [blocks.block_norm(block, states[name], t) for t in blocks.NORM_TYPES],
                    block.to_dense_matrix(states[name]),
                )
                for name, block in kinds.items()
            }

        for name, (norms, dense) in norms_and_dense(states).items():
            dense = np.asarray(dense, np.float64)
            for norm_type, value in zip(blocks.NORM_TYPES, norms, strict=True):
                expected = _dense_norm(dense, norm_type)
                np.testing.assert_allclose(value, expected, rtol=1e-9, err_msg=(name, norm_type))


def test_norm_scaled_damping_of_every_block():
    """``norm_to_scale_identity_weight_per_block``: block ``b``'s products use the damping
    ``w * norm(D_b)``, in the exact powers, the factored powers and the cached refresh."""
    with jax.enable_x64():
        params, batch = mlp_params(jnp.float64), mlp_batch(dtype=jnp.float64)
        args = (params, batch)
        est = kfacx.BlockDiagonalCurvature(
            mlp_loss,
            norm_to_scale_identity_weight_per_block="trace",
            approx_powers_to_cache=(-1,),
            exact_powers_to_cache=(-1,),
        )
        state = est.init(jax.random.key(0), args)
        unscaled = kfacx.BlockDiagonalCurvature(mlp_loss)
        unscaled.set_up(args)
        vector = jax.tree.map(jnp.ones_like, params)
        w = 0.01

        @jax.jit
        def products(state):
            state = est.update_curvature_matrix_estimate(
                state, 0.0, 1.0, None, jax.random.key(1), args, estimation_mode="fisher_empirical"
            )
            exact = est.multiply_matpower(state, vector, w, -1, exact_power=True)
            cached = est.multiply_matpower(
                est.update_cache(state, w), vector, w, -1, use_cached=True
            )
            fresh = est.multiply_matpower(state, vector, w, -1)
            plain = unscaled.multiply_matpower(state, vector, w, -1)
            dense = [b.to_dense_matrix(s) for b, s in zip(est.blocks, state.blocks, strict=True)]
            return exact, cached, fresh, plain, dense

        exact, cached, fresh, plain, dense = products(state)
        for d, v, out in zip(
            dense, est.params_to_blocks(vector), est.params_to_blocks(exact), strict=True
        ):
            d = np.asarray(d, np.float64)
            expected = dense_power(d, w * np.trace(d), -1.0) @ flat(v)
            np.testing.assert_allclose(flat(out), expected, rtol=1e-9)
        np.testing.assert_allclose(flat(cached), flat(fresh), rtol=1e-9)
        assert not np.allclose(flat(fresh), flat(plain), rtol=1e-3)


# ----------------------------------------------------------------------------- interval start


def test_no_damping_adaptation_before_the_interval_start():
    """With ``damping_adaptation_interval=2`` and ``damping_adaptation_interval_start=3``
    the damping is adapted at steps 4 and 6 only (rho is 1 on least squares, so it
    shrinks by ``decay**2`` each time)."""
    with jax.enable_x64():
        params, batch = linear_problem()
        opt = kfacx.Optimizer(
            jax.value_and_grad(linear_loss),
            use_adaptive_learning_rate=True,
            use_adaptive_damping=True,
            initial_damping=1.0,
            damping_adaptation_interval=2,
            damping_adaptation_decay=0.5,
            damping_adaptation_interval_start=3,
            **DETERMINISTIC,
        )
        state = opt.init(params, jax.random.key(0), batch)
        dampings, adapted = [], []
        for i in range(8):
            params, state, stats = opt.step(params, state, jax.random.key(i), batch)
            dampings.append(float(stats["damping"]))
            adapted.append(bool(np.isfinite(stats["rho"])))
        assert adapted == [i in (4, 6) for i in range(8)]
        np.testing.assert_allclose(dampings, [1.0] * 5 + [0.25] * 2 + [0.0625], rtol=1e-6)


def test_adaptation_steps_follow_the_interval_start():
    base = _configs.DampingConfig(damping_adaptation_interval=3)
    shifted = dataclasses.replace(base, damping_adaptation_interval_start=5)
    from kfacx._damping import is_adaptation_step

    assert [t for t in range(12) if is_adaptation_step(base, t)] == [2, 5, 8, 11]
    assert [t for t in range(12) if is_adaptation_step(shifted, t)] == [7, 10]
