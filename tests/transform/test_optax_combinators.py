"""`kfacx.scale_by_kfac` inside optax's combinators: `optax.partition` /
`optax.multi_transform`, `optax.masked`, `optax.inject_hyperparams`,
`optax.apply_if_finite` and (rejected) `optax.MultiSteps`.

One tiny Haiku model with every kind of block that matters here: an embedding, two
dense layers and a layer norm. Each training test runs a few steps in float64, checks
the loss falls, and compares the trajectory with an equivalent path: plain
`scale_by_kfac`, or K-FAC on the whole model with the other optimizer's updates put
in by hand. The jitted steps take the transformation as a static argument, so a
transformation used by several tests compiles once.
"""

from __future__ import annotations

import functools
import math
import types

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfacx

LR, MOMENTUM, DAMPING, LATER_DAMPING = 0.25, 0.5, 2.0**-5, 2.0**-2
STEPS = 4


def damping_schedule(count):
    """The damping of every K-FAC run here: it changes after two updates (for the
    `inject_hyperparams` test, which changes it by hand)."""
    return jnp.where(count < 2, DAMPING, LATER_DAMPING)


@pytest.fixture(autouse=True)
def _without_xla_optimizations():
    """As in tests/transform/test_optax.py: the comparisons do not need XLA's optimisations."""
    before = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", True)
    yield
    jax.config.update("jax_disable_most_optimizations", before)


def _model(batch):
    tokens, x = batch
    h = hk.Embed(6, 4, name="embed")(tokens).mean(axis=1) + x
    h = jnp.tanh(hk.Linear(5, name="hidden")(h))
    h = hk.LayerNorm(-1, create_scale=True, create_offset=True, name="norm")(h)
    return hk.Linear(3, name="out")(h)


NET = hk.without_apply_rng(hk.transform(_model))


def loss_fn(params, batch):
    (tokens, x), labels = batch
    logits = kfacx.register_softmax_cross_entropy_loss(NET.apply(params, (tokens, x)), labels)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))


def _batches(n=16, seed=0):
    """The same batch for every step (a loss that falls within a few steps):
    ``((tokens, x), labels)`` with labels from the first token and the sign of ``x[:, 0]``."""
    rng = np.random.default_rng(seed)
    tokens, x = rng.integers(0, 6, (n, 3)).astype(np.int32), rng.standard_normal((n, 4))
    labels = ((tokens[:, 0] % 3 + (x[:, 0] > 0)) % 3).astype(np.int32)
    return [((tokens, x), labels)] * STEPS


@functools.cache
def _kit():
    """The float64 problem, the estimator and the transformations several tests share.
    Call under ``jax.enable_x64(True)``."""
    batches = _batches()
    shapes = jax.eval_shape(NET.init, jax.random.key(0), batches[0][0])
    rng = np.random.default_rng(1)
    params = jax.tree.map(lambda s: jnp.asarray(0.5 * rng.standard_normal(s.shape)), shapes)
    est = kfacx.BlockDiagonalCurvature(loss_fn, auto_register_kwargs={"on_unmatched": "error"})

    def kfac(**kwargs):
        kwargs = {"damping": damping_schedule, "inverse_update_period": 1, **kwargs}
        return kfacx.scale_by_kfac(est, (params, batches[0]), **kwargs)

    kfac_alone = kfac()
    return types.SimpleNamespace(
        batches=batches,
        params=params,
        est=est,
        kfac=kfac,
        kfac_alone=kfac_alone,
        plain=optax.chain(kfac(), optax.sgd(LR, MOMENTUM)),
        labels=kfacx.block_labels(est, {"dense_tag": "kfac"}, default="adam"),
    )


@functools.partial(jax.jit, static_argnums=0)
def _step(tx, params, opt_state, batch, nan_stats=False):
    """One step of ``tx``; ``nan_stats`` (traced, so both values share the program)
    makes the curvature statistics, not the gradient, NaN."""
    loss, grads, stats = _kit().est.value_grads_and_curvature_stats(
        jax.random.key(0), (params, batch)
    )
    stats = jax.tree.map(lambda s: jnp.where(nan_stats, math.nan, s), stats)
    updates, opt_state = tx.update(grads, opt_state, params, curvature_stats=stats)
    return optax.apply_updates(params, updates), opt_state, loss


def _run(tx, batches=None, opt_state=None, params=None):
    """Trains with ``tx``; returns the parameters after each step, the losses, the state."""
    kit = _kit()
    params = kit.params if params is None else params
    opt_state = tx.init(params) if opt_state is None else opt_state
    trajectory, losses = [], []
    for batch in kit.batches if batches is None else batches:
        # nan_stats passed (not left to its default): the program of the NaN-statistics
        # call in the apply_if_finite test, compiled once
        params, opt_state, loss = _step(tx, params, opt_state, batch, False)
        trajectory.append(params)
        losses.append(float(loss))
    return trajectory, losses, opt_state


@jax.jit
def _full_kfac(params, state, batch):
    """K-FAC on the whole model: the gradient and its preconditioned version."""
    kit = _kit()
    _, grads, stats = kit.est.value_grads_and_curvature_stats(jax.random.key(0), (params, batch))
    precon, state = kit.kfac_alone.update(grads, state, params, curvature_stats=stats)
    return grads, precon, state


def _on_kfac(params):
    return jax.tree.map(lambda label: label == "kfac", _kit().labels(params))


def _select(mask, if_true, if_false):
    return jax.tree.map(lambda m, a, b: a if m else b, mask, if_true, if_false)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _partition_by_hand(kfac_part, other_part, params, grads, precon, states):
    """``kfac_part`` on the preconditioned gradient of the dense layers, ``other_part``
    on the raw gradient of the rest."""
    kfac_updates, kfac_state = kfac_part.update(precon, states[0])
    other_updates, other_state = other_part.update(grads, states[1])
    updates = _select(_on_kfac(params), kfac_updates, other_updates)
    return optax.apply_updates(params, updates), (kfac_state, other_state)


@functools.partial(jax.jit, static_argnums=0)
def _masked_by_hand(then, params, grads, precon, state):
    """The preconditioned gradient of the dense layers and the raw gradient of the rest,
    then ``then``."""
    updates, state = then.update(_select(_on_kfac(params), precon, grads), state)
    return optax.apply_updates(params, updates), state


def _assert_trees_equal(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def _assert_trees_close(got, want, rtol=1e-11):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=rtol, atol=rtol)


def _assert_learns(losses):
    assert losses[-1] < 0.9 * losses[0], losses


# ----------------------------------------------------------------------------- partition


def test_block_labels_label_each_block_by_its_tag():
    with jax.enable_x64(True):
        kit = _kit()
        labels = kit.labels(kit.params)
    assert labels == {
        "embed": {"embeddings": "adam"},
        "hidden": {"w": "kfac", "b": "kfac"},
        "norm": {"scale": "adam", "offset": "adam"},
        "out": {"w": "kfac", "b": "kfac"},
    }
    by_block = kfacx.block_labels(kit.est, lambda block: type(block).__name__)(kit.params)
    assert by_block["norm"]["scale"] == "ScaleAndShiftDiagonal"
    with pytest.raises(ValueError, match="no label for layer tag 'embedding_tag'.*default="):
        kfacx.block_labels(kit.est, {"dense_tag": "kfac"})(kit.params)
    with pytest.raises(ValueError, match="pytree structure"):
        kit.labels({"embed": kit.params["embed"]})


def test_partition_with_every_parameter_on_kfac_equals_scale_by_kfac():
    """Bit for bit. (With a second, empty group the program differs and XLA's rounding
    may differ in the last bit.)"""
    with jax.enable_x64(True):
        kit = _kit()
        tx = optax.partition(
            {"kfac": optax.chain(kit.kfac(), optax.sgd(LR, MOMENTUM))},
            lambda params: jax.tree.map(lambda _: "kfac", params),
        )
        got, losses, _ = _run(tx)
        want, want_losses, _ = _run(kit.plain)
    _assert_trees_equal(got, want)
    assert losses == want_losses
    _assert_learns(losses)


def test_partition_with_embedding_and_norm_on_adam_equals_kfac_and_adam_by_hand():
    """K-FAC for the dense layers, Adam for the embedding and the layer norm, from the
    whole model's statistics: the K-FAC part keeps only the two dense blocks, and the
    trajectory is that of K-FAC on the whole model (block-diagonal, so the dense blocks'
    updates do not depend on the others) with Adam's updates put in by hand."""
    with jax.enable_x64(True):
        kit = _kit()
        sgd, adam = optax.sgd(LR, MOMENTUM), optax.adam(0.05)
        tx = optax.multi_transform({"kfac": optax.chain(kit.kfac(), sgd), "adam": adam}, kit.labels)
        got, losses, opt_state = _run(tx)
        kfac_state = opt_state.inner_states["kfac"].inner_state[0].estimator_state
        assert len(kfac_state.blocks) == 2  # hidden and out; no embedding or norm block

        params, state = kit.params, kit.kfac_alone.init(kit.params)
        states = (sgd.init(params), adam.init(params))
        for step, batch in enumerate(kit.batches):
            grads, precon, state = _full_kfac(params, state, batch)
            params, states = _partition_by_hand(sgd, adam, params, grads, precon, states)
            _assert_trees_close(got[step], params)
    _assert_learns(losses)


def test_partition_labels_that_split_a_block_are_an_error():
    with jax.enable_x64(True):
        kit = _kit()
        labels = jax.tree.map(lambda _: "kfac", kit.params)
        labels["hidden"]["b"] = "adam"
        tx = optax.partition({"kfac": kit.kfac(), "adam": optax.adam(0.1)}, labels)
        with pytest.raises(ValueError, match=r"keeps \['hidden/w'\] but drops \['hidden/b'\]"):
            tx.init(kit.params)


# ----------------------------------------------------------------------------- masked


def test_masked_kfac_on_dense_layers_equals_kfac_and_plain_gradient_by_hand():
    """``optax.masked`` leaves the unmasked gradient as it is: the trajectory is that
    of K-FAC on the whole model with the raw gradient of the embedding and the norm."""
    with jax.enable_x64(True):
        kit = _kit()
        sgd = optax.sgd(LR, MOMENTUM)
        tx = optax.chain(optax.masked(kit.kfac(), _on_kfac(kit.params)), sgd)
        got, losses, _ = _run(tx)

        params, state, sgd_state = kit.params, kit.kfac_alone.init(kit.params), sgd.init(kit.params)
        for step, batch in enumerate(kit.batches):
            grads, precon, state = _full_kfac(params, state, batch)
            params, sgd_state = _masked_by_hand(sgd, params, grads, precon, sgd_state)
            _assert_trees_close(got[step], params)
    _assert_learns(losses)


def test_masked_state_and_gradient_masks_must_agree():
    with jax.enable_x64(True):
        kit = _kit()
        on_kfac = _on_kfac(kit.params)
        state = optax.masked(kit.kfac(), on_kfac).init(kit.params)
        everything = optax.masked(kit.kfac(), jax.tree.map(lambda _: True, on_kfac))
        dense_only = jax.tree.map(lambda m: not m, on_kfac)  # embedding and norm
        with pytest.raises(ValueError, match="keeps 2 curvature blocks, but the state.*for 4"):
            optax.masked(kit.kfac(), dense_only).update(
                kit.params,
                everything.init(kit.params),
                curvature_stats=kit.est.zero_curvature_stats(),
            )
    assert len(state.inner_state.estimator_state.blocks) == 2


# ----------------------------------------------------------------------------- inject_hyperparams


def test_inject_hyperparams_damping_change_takes_effect_and_equals_a_schedule():
    """``inject_hyperparams(scale_by_kfac)``: the estimator and the example arguments
    stay static, damping, curvature_ema and inverse_update_period become
    hyperparameters. A constant damping equals the plain transformation, and changing
    ``hyperparams["damping"]`` after two steps equals the plain transformation with a
    damping schedule that changes at count 2 (and differs from not changing it)."""
    with jax.enable_x64(True):
        kit = _kit()
        injected = optax.inject_hyperparams(kfacx.scale_by_kfac)(
            estimator=kit.est,
            func_args=(kit.params, kit.batches[0]),
            damping=DAMPING,
            inverse_update_period=1,
        )
        tx = optax.chain(injected, optax.sgd(LR, MOMENTUM))
        opt_state = tx.init(kit.params)
        assert set(opt_state[0].hyperparams) == {
            "damping",
            "curvature_ema",
            "inverse_update_period",
        }
        first, losses, opt_state = _run(tx, kit.batches[:2], opt_state)
        unchanged, _, _ = _run(tx, kit.batches[2:], opt_state, first[-1])
        opt_state[0].hyperparams["damping"] = jnp.asarray(LATER_DAMPING)
        second, more_losses, _ = _run(tx, kit.batches[2:], opt_state, first[-1])
        want, _, _ = _run(kit.plain)  # damping_schedule: DAMPING, then LATER_DAMPING
    _assert_trees_close(first + second, want, rtol=1e-13)
    assert not np.allclose(second[-1]["out"]["w"], unchanged[-1]["out"]["w"], rtol=1e-6)
    _assert_learns(losses + more_losses)


def test_inject_hyperparams_rejects_a_bad_concrete_value():
    with jax.enable_x64(True):
        kit = _kit()
        factory = optax.inject_hyperparams(kfacx.scale_by_kfac)
        args = (kit.params, kit.batches[0])
        with pytest.raises(ValueError, match="inverse_update_period must be an int >= 1"):
            factory(estimator=kit.est, func_args=args, inverse_update_period=0).init(kit.params)
        with pytest.raises(ValueError, match="curvature_ema must be in"):
            factory(estimator=kit.est, func_args=args, curvature_ema=1.5).init(kit.params)


# ----------------------------------------------------------------------------- apply_if_finite


def test_apply_if_finite_skips_nan_gradients_and_with_flag_nan_statistics():
    """A NaN batch (NaN gradient and statistics) and, with `flag_non_finite_stats` in
    front, NaN statistics alone skip the step: parameters and K-FAC state stay
    bit-identical, and the run goes on as if the batch had not been there."""
    with jax.enable_x64(True):
        kit = _kit()
        tx = optax.chain(
            kfacx.flag_non_finite_stats(),
            optax.apply_if_finite(optax.chain(kit.kfac(), optax.sgd(LR, MOMENTUM)), 3),
        )
        nan_batch = jax.tree.map(np.copy, kit.batches[1])
        nan_batch[0][1][0, 0] = np.nan
        (params,), _, opt_state = _run(tx, kit.batches[:1])
        skipped, _, skipped_state = _run(tx, [nan_batch], opt_state, params)
        _assert_trees_equal(skipped[-1], params)
        _assert_trees_equal(skipped_state[1].inner_state, opt_state[1].inner_state)
        assert int(skipped_state[1].notfinite_count) == 1

        params, flagged_state, _ = _step(tx, params, skipped_state, kit.batches[1], True)
        _assert_trees_equal(params, skipped[-1])
        _assert_trees_equal(flagged_state[1].inner_state, opt_state[1].inner_state)
        assert int(flagged_state[1].notfinite_count) == 2

        rest, losses, _ = _run(tx, kit.batches[1:], flagged_state, params)
        want, want_losses, _ = _run(kit.plain)
    # A different program from the plain one (apply_if_finite's cond): equal to rounding.
    _assert_trees_close(rest, want[1:], rtol=1e-13)
    np.testing.assert_allclose(losses, want_losses[1:], rtol=1e-13)
    _assert_learns(want_losses)


# ----------------------------------------------------------------------------- MultiSteps


def test_multi_steps_is_rejected_with_the_accumulation_recipe():
    with jax.enable_x64(True):
        kit = _kit()
        tx = optax.MultiSteps(optax.chain(kit.kfac(), optax.sgd(LR)), every_k_schedule=2)
        with pytest.raises(ValueError, match="inside optax.MultiSteps.*accumulate_curvature_stats"):
            tx.init(kit.params)
