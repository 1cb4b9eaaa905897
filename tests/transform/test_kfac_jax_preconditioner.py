"""kfac-jax's preconditioner options, each against its definition: ``precon_power``
(in the Optimizer and in `kfacx.scale_by_kfac`), ``precon_damping_mult`` /
``precon_damping_schedule`` and ``norm_to_scale_identity_weight_per_block`` (the block
norms and the norm-scaled damping).
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
    PLAIN,
    TRANSPOSED,
    dense_power,
    flat,
    linear_loss,
    linear_problem,
    mlp_batch,
    mlp_loss,
    mlp_params,
    one_step,
)

import kfacx
from kfacx import blocks

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
