"""The adaptive optimizer's defaults on the smallest problem that once diverged under them.

The quick start's problem (scikit-learn's digits, a 64-64-10 MLP, batches of 256 drawn
afresh each step, adaptive learning rate, momentum and damping from
``initial_damping=1.0``): with the default curvature subset (128 of the 256 examples),
the quadratic model's curvature products came from the subset and its gradient from the
whole batch. Once the loss was small, the step it chose along directions the subset
barely curves was far too long: the loss went from 2e-3 to 1e20 or NaN on every seed
tried, first between steps 60 and 80. The products are now the whole batch's.
"""

from __future__ import annotations

import math

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from sklearn.datasets import load_digits

import kfacx

net = hk.without_apply_rng(hk.transform(lambda x: hk.nets.MLP([64, 64, 10])(x)))


def loss_fn(params, batch):
    images, labels = batch
    logits = kfacx.register_softmax_cross_entropy_loss(net.apply(params, images), labels)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))


@pytest.mark.parametrize("seed", [0, 3])
def test_quick_start_defaults_do_not_diverge(seed):
    digits = load_digits()
    x, y = (digits.data / 16.0).astype(np.float32), digits.target.astype(np.int32)
    params = net.init(jax.random.key(seed), x[:1])
    sampler = np.random.default_rng(1000 + seed)

    def batch():
        idx = sampler.choice(len(x), 256, replace=False)
        return x[idx], y[idx]

    optimizer = kfacx.Optimizer(
        jax.value_and_grad(loss_fn),
        l2_reg=1e-5,
        add_l2_reg=True,
        use_adaptive_learning_rate=True,
        use_adaptive_momentum=True,
        use_adaptive_damping=True,
        initial_damping=1.0,
    )
    rng = jax.random.key(seed)
    state = optimizer.init(params, rng, batch())
    losses = []
    for _ in range(120):
        rng, key = jax.random.split(rng)
        params, state, stats = optimizer.step(params, state, key, batch())
        losses.append(float(stats["loss"]))
    assert all(math.isfinite(v) for v in losses), losses
    # Before the fix: above 10x the run's minimum from step 60 (seed 0) or 79 (seed 3).
    assert max(losses[40:]) < 10 * min(losses[:40]), losses
    assert losses[-1] < 10 * min(losses) and losses[-1] < 0.05, losses


def _digits_batches(seed):
    digits = load_digits()
    x, y = (digits.data / 16.0).astype(np.float32), digits.target.astype(np.int32)
    sampler = np.random.default_rng(seed)

    def batch():
        idx = sampler.choice(len(x), 256, replace=False)
        return x[idx], y[idx]

    return x, batch


def _long_step_run(long_step_ratio):
    """Three steps with a fixed learning rate and adaptive damping; before the third (not
    an adaptation step), the damping is set to 1e-9, so that its step is thousands of
    times longer than the second and raises the loss."""
    x, batch = _digits_batches(0)
    params = net.init(jax.random.key(0), x[:1])
    optimizer = kfacx.Optimizer(
        jax.value_and_grad(loss_fn),
        learning_rate_schedule=0.5,
        momentum_schedule=0.0,
        use_adaptive_damping=True,
        initial_damping=1.0,
        min_damping=1e-12,
        inverse_update_period=1,  # the inverses see the damping set before step 2
        num_burnin_steps=0,
        long_step_ratio=long_step_ratio,
    )
    state = optimizer.init(params, jax.random.key(0), batch())
    batches = [batch() for _ in range(4)]
    out = []
    for step, b in enumerate(batches):
        if step == 2:
            state = state._replace(damping=jnp.asarray(1e-9, jnp.float32))
        new_params, state, stats = optimizer.step(params, state, jax.random.key(step), b)
        out.append((params, new_params, stats))
        params = new_params
    return out


def test_a_long_step_that_raises_the_loss_is_rejected_and_the_damping_grows_at_once():
    steps = _long_step_run(long_step_ratio=2.0)
    for _, _, stats in steps[:2]:  # ordinary steps: neither adapted nor checked
        assert math.isnan(float(stats["rho"])) and not bool(stats["rejected"])
    before, after, stats = steps[2]
    # The check ran on this step, though the damping adapts only every 5 steps.
    assert float(stats["update_norm"]) > 100 * float(steps[1][2]["update_norm"])
    # rho is reported (the model, with the given learning rate, predicted a rise too).
    assert math.isfinite(float(stats["rho"])) and bool(stats["rejected"])
    for p, q in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
        np.testing.assert_array_equal(p, q)  # the parameters stay, bit for bit
    # The next step runs with the damping the check raised by the Levenberg-Marquardt
    # rule (1e-9 / 0.9**5).
    np.testing.assert_allclose(float(steps[3][2]["damping"]), 1e-9 / 0.9**5, rtol=1e-5)


def test_without_the_check_the_same_long_step_is_taken():
    steps = _long_step_run(long_step_ratio=None)
    before, after, stats = steps[2]
    assert math.isnan(float(stats["rho"])) and "rejected" not in stats
    assert not np.array_equal(jax.tree.leaves(before)[0], jax.tree.leaves(after)[0])
    assert float(steps[3][2]["loss"]) > 2 * float(steps[1][2]["loss"])
    np.testing.assert_allclose(float(steps[3][2]["damping"]), 1e-9, rtol=1e-6)


def test_long_step_ratio_must_be_a_number_of_at_least_one():
    for bad in (0.5, float("nan"), "2"):
        with pytest.raises(ValueError, match="long_step_ratio must be None"):
            kfacx.DampingConfig(long_step_ratio=bad)
