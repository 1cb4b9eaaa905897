"""Micro-batch accumulation with `kfacx.accumulate_curvature_stats` and padded batches
(``example_mask``): both equal the plain `kfacx.scale_by_kfac` step on the full batch
of real examples.
"""

from __future__ import annotations

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import dense, init_mlp
from _optax_cases import (
    DAMPING,
    KEY,
    SIZES,
    _without_xla_optimizations,  # noqa: F401  (autouse fixture)
    all_zero,
    apply_updates,
    assert_trees_close,
    kfac_sgd,
    max_rel_diff,
    mlp_data,
    mlp_estimator,
    random_params,
    take,
    to64,
    xent,
)
from optax.experimental import aggregating

import kfacx

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
