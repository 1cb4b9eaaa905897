"""kfac-jax's Optimizer options beyond the basic ones, each against its definition: the
option list itself, ``use_step_rejection``, ``use_initial_damping_calibration``,
``regularized_parameters_path_exclusions``, the ``fisher_empirical_direct`` estimation
mode and ``damping_adaptation_interval_start``.

The preconditioner's options (``precon_power``, ``precon_damping_mult`` /
``precon_damping_schedule``, ``norm_to_scale_identity_weight_per_block``) are in
tests/transform/test_kfac_jax_preconditioner.py; shared problems in
tests/_kfac_jax_options_cases.py.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _kfac_jax_options_cases import (
    DETERMINISTIC,
    flat,
    linear_loss,
    linear_problem,
    mlp_batch,
    mlp_loss,
    mlp_params,
    one_step,
)

import kfacx
from kfacx.optimizer import _calibration, _configs
from kfacx.optimizer._kfac_jax_names import KFAC_JAX_FIXED, KFAC_JAX_ONLY

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
    """The calibrated damping is what `kfacx.optimizer._calibration.calibrate` gives for the ratio
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
    """`kfacx.optimizer._calibration.calibrate` with ``rho(d)`` given: the first damping inside the
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
    from kfacx.optimizer._damping import is_adaptation_step

    assert [t for t in range(12) if is_adaptation_step(base, t)] == [2, 5, 8, 11]
    assert [t for t in range(12) if is_adaptation_step(shifted, t)] == [7, 10]
