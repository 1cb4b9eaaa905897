"""Layers inside `lax.scan`: detection, tracing and curvature blocks.

Two kinds of layers live in scans. A scan over the parameters (stacked ``[L, ...]``,
e.g. `hk.layer_stack`) holds ``L`` separate layers, served by a
`kfacx.blocks.StackedBlock`; a scan that closes over its parameters (an RNN cell)
applies one layer at every step, whose steps are folded into the batch axis like tied
weights. Every model is compared, in float64, with the same model unrolled by a Python
loop (separate layers, or tied uses), which kfacx serves without any scan: the tagged
function, the report, the dense curvature and its inverse products must agree.

Unsupported scans (nested stacking, mixed parameters, while loops) are tested in
tests/graph_matcher/test_scan_unsupported.py; the models and cached estimates live in
tests/graph_matcher/_scan_cases.py.
"""

from __future__ import annotations

import functools
import re
import warnings

import _models as TM
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

import kfacx

from ._scan_cases import (
    BATCH,
    D_IN,
    D_OUT,
    DAMPING,
    DENSE_KF,
    DEPTH,
    FULL_DENSE,
    KEY,
    MODELS,
    TIME,
    WIDTH,
    _both,
    assert_close,
    assert_trees_close,
    estimate,
    f64,
    fast_jit,
    haiku_problem,
    losses,
    model_estimates,
    random_like,
    stacked_problem,
    unrolled_positions,
    x64,  # noqa: F401  (autouse fixture)
)

# ----------------------------------------------------------------------------- detection


@pytest.mark.parametrize("variant", TM.SCAN_VARIANTS)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_tagged_function_has_same_value_and_gradient(name, variant):
    loss, _, _, args = losses(name, variant)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tagged, report = kfacx.auto_register_tags(loss, args)
    assert report.unmatched == () and report.notes == ()
    assert_trees_close(*_both(jax.value_and_grad, tagged, loss, args))
    # The tags sit inside the scan's body.
    (scan,) = [e for e in jax.make_jaxpr(tagged)(*args).jaxpr.eqns if e.primitive.name == "scan"]
    assert kfacx._helpers._jaxpr.contains_tags(scan.params["jaxpr"].jaxpr)


@functools.cache
def layer_stack_estimates():
    """``(layer stack estimate, unrolled estimate, params, vector)`` of the Haiku model."""
    model, params, batch = haiku_problem()
    loss = TM.loss_of_logits(model.apply)
    loop_loss = TM.loss_of_logits(TM.unrolled_mlp_logits)
    unrolled = TM.haiku_stack_to_unrolled(params)
    assert_close(loop_loss(unrolled, batch), loss(params, batch))
    v = random_like(params)
    scan = estimate(loss, (params, batch), vector=v)
    loop = estimate(loop_loss, (unrolled, batch), vector=TM.haiku_stack_to_unrolled(v))
    return scan, loop, params, v


def test_layer_stack_report():
    est = layer_stack_estimates()[0]["estimator"]
    report = est.report
    assert report.unmatched == () and report.notes == ()
    stacked = "__layer_stack_no_per_layer/hidden"
    got = {e.path: (e.tag, e.source, e.uses, e.stack_size, e.block) for e in report.entries}
    edge = ("dense_tag", "dense_with_bias", 1, None, DENSE_KF)
    inner = ("dense_tag", "dense_with_bias", 1, DEPTH, f"StackedBlock({DENSE_KF})")
    assert got == {
        **{f"{m}/{p}": edge for m in ("inp", "out") for p in ("b", "w")},
        **{f"{stacked}/{p}": inner for p in ("b", "w")},
    }
    layers = {e.path: e.layer for e in report.entries}
    assert layers[f"{stacked}/w"] == layers[f"{stacked}/b"] == 1
    assert [repr(b).split("(")[0] for b in est.blocks] == [DENSE_KF, "StackedBlock", DENSE_KF]
    text = str(report)
    assert re.search(rf"^{stacked}/w\s+1 \({DEPTH} stacked\)\s+dense_tag", text, re.M), text
    assert "6/6 parameters matched" in text


def test_rnn_report_counts_one_use_per_step():
    est = model_estimates("rnn", "plain")[0]["estimator"]
    got = {e.path: (e.tag, e.uses, e.stack_size, e.block) for e in est.report.entries}
    dense = ("dense_tag", TIME, None, DENSE_KF)
    assert got == {
        "wx": dense,
        "wh": dense,
        "b": ("dense_tag", TIME, None, DENSE_KF),
        "wo": ("dense_tag", 1, None, DENSE_KF),
        "bo": ("dense_tag", 1, None, DENSE_KF),
    }
    layers = {e.path: e.layer for e in est.report.entries}
    assert layers["wh"] == layers["b"] != layers["wx"]
    assert [layer.num_uses for layer in est._traced.layers] == [TIME, TIME, 1]
    assert re.search(rf"^wh\s+\d \(x{TIME}\)\s+dense_tag", str(est.report), re.M)


# ----------------------------------------------------------------------------- curvature


@pytest.mark.parametrize("variant", TM.SCAN_VARIANTS)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_detected_curvature_equals_unrolled(name, variant):
    scan, loop, perm, _ = model_estimates(name, variant)
    assert len(scan["estimator"].blocks) == 3
    assert len(loop["estimator"].blocks) == 3 + (DEPTH - 1) * (name == "stacked")
    assert_close(scan["dense"][np.ix_(perm, perm)], loop["dense"])


@pytest.mark.parametrize("name", sorted(MODELS))
def test_hand_tagged_curvature_equals_unrolled(name):
    scan, loop, perm, _ = model_estimates(name, "reverse", tag=True, mode="fisher_empirical")
    assert scan["estimator"].report is None
    names = [b.block_name for b in scan["estimator"].blocks]
    assert names == ["Full", "StackedBlock(Full)", "Full"] if name == "stacked" else ["Full"] * 3
    assert_close(scan["dense"][np.ix_(perm, perm)], loop["dense"])


@pytest.mark.parametrize("name", sorted(MODELS))
def test_hand_tags_in_scan_are_kept_by_detection(name):
    loss, _, _, args = losses(name, tag=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tagged, report = kfacx.auto_register_tags(loss, args)
    assert {e.source for e in report.entries} == {"manual"}
    (scan,) = [e for e in jax.make_jaxpr(tagged)(*args).jaxpr.eqns if e.primitive.name == "scan"]
    body_tags = [e for e in scan.params["jaxpr"].jaxpr.eqns if e.primitive.name == "dense_tag"]
    assert len(body_tags) == (1 if name == "stacked" else 2)  # not tagged twice


def _check_products(scan, loop, vector, to_unrolled):
    # Exact power: the inverse of the damped dense matrix (vector layout == dense layout).
    flat_v = np.asarray(ravel_pytree(vector)[0])
    want = np.linalg.solve(scan["dense"] + DAMPING * np.eye(len(flat_v)), flat_v)
    assert_close(ravel_pytree(scan["exact"])[0], want)
    # Factored damping (per layer, i.e. per slice of a stack): as in the unrolled model.
    assert_trees_close(to_unrolled(scan["approx"]), loop["approx"])
    assert_trees_close(to_unrolled(scan["approx_fresh"]), loop["approx"])


@pytest.mark.parametrize("name", sorted(MODELS))
def test_inverse_products_equal_unrolled_and_dense(name):
    scan, loop, _, v = model_estimates(name, "plain")
    _check_products(scan, loop, v, MODELS[name][2])


def test_layer_stack_curvature_equals_unrolled():
    scan, loop, params, v = layer_stack_estimates()
    model, _, batch = haiku_problem()
    loss, est = TM.loss_of_logits(model.apply), scan["estimator"]
    tagged = est.tagged_func((params, batch))
    want = jax.value_and_grad(loss)(params, batch)
    assert_trees_close(fast_jit(jax.value_and_grad(tagged))(params, batch), want)
    perm = unrolled_positions(params, TM.haiku_stack_to_unrolled)
    assert_close(scan["dense"][np.ix_(perm, perm)], loop["dense"])
    _check_products(scan, loop, v, TM.haiku_stack_to_unrolled)


def test_layer_stack_end_to_end_under_jit():
    model, params, batch = haiku_problem()
    loss = TM.loss_of_logits(model.apply)
    est = kfacx.BlockDiagonalCurvature(loss)  # fisher_gradients: sampled cotangents

    @fast_jit
    def step(params, batch, rng):
        state = est.init(rng, (params, batch))
        state = est.update_curvature_matrix_estimate(state, 0.0, 1.0, None, rng, (params, batch))
        state = est.update_cache(state, DAMPING)
        grads = jax.grad(loss)(params, batch)
        return state, est.multiply_inverse(state, grads, DAMPING, use_cached=True), grads

    state, precond, grads = step(params, batch, KEY)
    assert all(np.all(np.isfinite(leaf)) for leaf in jax.tree_util.tree_leaves(precond))
    # A positive-definite preconditioner: a descent direction.
    assert float(ravel_pytree(precond)[0] @ ravel_pytree(grads)[0]) > 0
    eager = est.multiply_inverse(state, grads, DAMPING, use_cached=True)
    assert_trees_close(eager, precond, rtol=1e-8)


def _twice(logits):
    """The model applied to the batch and to twice its first two examples (tied uses with
    different batch sizes)."""

    def twice(params, x):
        return logits(params, x)[:2] + logits(params, 2.0 * x[:2])

    return twice


def test_stack_applied_twice_is_one_stacked_layer_with_two_uses():
    params, (x, t) = stacked_problem()
    args, loop_args = (params, (x, t[:2])), (TM.unstack_mlp(params), (x, t[:2]))
    mode = "fisher_empirical"
    scan = estimate(TM.loss_of_logits(_twice(TM.stacked_mlp_logits)), args, mode, ctors=FULL_DENSE)
    loop_loss = TM.loss_of_logits(_twice(TM.unrolled_mlp_logits))
    loop = estimate(loop_loss, loop_args, mode, ctors=FULL_DENSE)
    est = scan["estimator"]
    assert [b.block_name for b in est.blocks] == ["Full", "StackedBlock(Full)", "Full"]
    assert [layer.num_uses for layer in est._traced.layers] == [2, 2, 2]
    assert {(e.uses, e.stack_size) for e in est.report.entries if "hidden" in e.path} == {
        (2, DEPTH)
    }
    assert re.search(rf"^hidden/w\s+1 \(x2\) \({DEPTH} stacked\)", str(est.report), re.M)
    perm = unrolled_positions(params, TM.unstack_mlp)
    assert_close(scan["dense"][np.ix_(perm, perm)], loop["dense"])


# ----------------------------------------------------------------------------- generic tags


def _gain_logits(params, x, stacked: bool, scan: bool):
    """``DEPTH`` steps of ``h = tanh(h @ w) * g``, w a dense layer and g a generic
    parameter (tagged by hand); stacked (w [L, W, W], g [L, W]) or shared by all steps."""

    def step(h, p):
        w, g = p
        y = kfacx.register_dense(jnp.tensordot(h, w, axes=1), h, w)
        return jnp.tanh(y) * kfacx.register_generic(g)[None], None

    if scan and stacked:
        return jax.lax.scan(step, x, (params["w"], params["g"]))[0]
    if scan:
        return jax.lax.scan(lambda h, _: step(h, (params["w"], params["g"])), x, length=DEPTH)[0]
    h = x
    for i in range(DEPTH):
        layer = params["layers"][i] if stacked else params
        h = step(h, (layer["w"], layer["g"]))[0]
    return h


def _unstack_gain(params):
    return dict(layers=[dict(w=params["w"][i], g=params["g"][i]) for i in range(DEPTH)])


@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "shared"])
def test_generic_tag_inside_scan(stacked):
    rng = np.random.default_rng(0)
    lead = (DEPTH,) if stacked else ()
    params = f64(
        dict(
            w=rng.standard_normal(lead + (WIDTH, WIDTH)) / 2, g=rng.standard_normal(lead + (WIDTH,))
        )
    )
    batch = f64((rng.standard_normal((BATCH, WIDTH)), rng.standard_normal((BATCH, WIDTH))))
    to_unrolled = _unstack_gain if stacked else (lambda p: p)
    scan_loss = TM.loss_of_logits(_gain_logits, stacked=stacked, scan=True)
    loop_loss = TM.loss_of_logits(_gain_logits, stacked=stacked, scan=False)
    scan = estimate(scan_loss, (params, batch), auto=False)
    est, dense = scan["estimator"], scan["dense"]
    loop_dense = estimate(loop_loss, (to_unrolled(params), batch), auto=False)["dense"]
    want_blocks = ["StackedBlock(DenseTwoKroneckerFactored)", "StackedBlock(Diagonal)"]
    assert [b.block_name for b in est.blocks] == (
        want_blocks if stacked else [DENSE_KF, "Diagonal"]
    )
    perm = unrolled_positions(params, to_unrolled)
    assert_close(dense[np.ix_(perm, perm)], loop_dense)


# ----------------------------------------------------------------------------- tracer data


def test_layer_data_layout():
    """Stacked layers keep the layer axis first (samples before it in ``sampled``);
    layers shared by the steps have the steps folded into the batch axis, step-major."""
    cts = [jnp.ones((2, BATCH, D_OUT), jnp.float64)]

    @functools.partial(fast_jit, static_argnums=0)
    def data(loss, args):
        return kfacx.layer_tags_vjp(loss, args)[1].sampled(cts)

    loss, _, _, (params, batch) = losses("stacked", tag=True)
    _, hidden, _ = data(loss, (params, batch))
    assert hidden["inputs"][0].shape == (DEPTH, BATCH, WIDTH)
    assert [p.shape for p in hidden["params"]] == [(DEPTH, WIDTH, WIDTH), (DEPTH, WIDTH)]
    assert hidden["outputs_tangent"][0].shape == (2, DEPTH, BATCH, WIDTH)
    h = jnp.tanh(TM.dense(batch[0], params["inp"]["w"], params["inp"]["b"]))
    for i in range(DEPTH):
        assert_close(hidden["inputs"][0][i], h)
        h = jnp.tanh(TM.dense(h, params["hidden"]["w"][i], params["hidden"]["b"][i]))

    loss, _, _, (params, batch) = losses("rnn", variant="reverse", tag=True)
    wx, _, _ = data(loss, (params, batch))
    assert wx["inputs"][0].shape == (TIME * BATCH, D_IN)
    assert wx["outputs_tangent"][0].shape == (2, TIME * BATCH, WIDTH)
    # Row block t of the folded inputs is step t's input (slice t of xs, also in reverse).
    assert_close(wx["inputs"][0].reshape(TIME, BATCH, D_IN), jnp.swapaxes(batch[0], 0, 1))


# ----------------------------------------------------------------------------- masks


def _masked_loss(logits_fn):
    """Softmax cross-entropy averaged over the real (mask 1) examples."""

    def loss(params, batch):
        x, labels, mask = batch
        logits = kfacx.register_softmax_cross_entropy_loss(logits_fn(params, x), labels, mask=mask)
        nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1)[:, 0]
        return jnp.sum(mask * nll) / jnp.maximum(jnp.sum(mask), 1.0)

    return loss


@pytest.mark.parametrize("name", sorted(MODELS))
def test_padding_mask_with_one_pass_statistics(name):
    """A padded batch with ``example_mask`` gives the statistics of its real examples
    only: the mask is shared by the slices of a stacked layer and repeated for every
    step of a layer applied at every step. Folding the statistics in equals an update."""
    params, (x, _) = MODELS[name][3]()
    real = np.array([1, 0, 1, 1], bool)
    labels = np.arange(BATCH) % D_OUT
    padded = (x, labels, f64(real.astype(float)))
    only_real = jax.tree_util.tree_map(lambda a: a[real], padded)
    loss = _masked_loss(functools.partial(MODELS[name][0], tag=True))
    est = kfacx.BlockDiagonalCurvature(
        loss, default_estimation_mode="ggn_exact", auto_register_tags=False
    )

    @fast_jit
    def run(padded, only_real):
        (v_pad, g_pad, s_pad), (v_real, g_real, s_real) = (
            est.value_grads_and_curvature_stats(KEY, (params, padded), example_mask=padded[2]),
            est.value_grads_and_curvature_stats(KEY, (params, only_real)),
        )
        state = est.init(KEY, (params, only_real))
        from_stats = est.update_curvature_estimate_from_stats(state, s_pad, 0.0, 1.0)
        updated = est.update_curvature_matrix_estimate(
            state, 0.0, 1.0, None, KEY, (params, only_real)
        )
        dense = (est.to_dense_matrix(from_stats), est.to_dense_matrix(updated))
        return (v_pad, g_pad, s_pad.blocks), (v_real, g_real, s_real.blocks), dense

    got, want, (from_stats, updated) = run(padded, only_real)
    if name == "stacked":
        assert [b.block_name for b in est.blocks][1] == f"StackedBlock({DENSE_KF})"
        assert got[2][1][0].shape[0] == DEPTH  # statistics with the layer axis
    assert_trees_close(got, want)
    assert_close(from_stats, updated)


def test_optimizer_trains_a_layer_stack():
    """`kfacx.Optimizer` (detection from ``jax.value_and_grad(loss)``) on the Haiku layer
    stack: stacked blocks, and the loss goes down."""
    model, params, (x, _) = haiku_problem()
    labels = np.arange(BATCH) % D_OUT
    loss = _masked_loss(model.apply)
    batch = (x, labels, jnp.ones(BATCH))
    opt = kfacx.Optimizer(
        jax.value_and_grad(loss),
        use_adaptive_learning_rate=True,
        use_adaptive_momentum=True,
        use_adaptive_damping=True,
        initial_damping=1.0,
    )
    state = opt.init(params, KEY, batch)
    assert opt.estimator.report.unmatched == ()
    assert f"StackedBlock({DENSE_KF})" in [b.block_name for b in opt.estimator.blocks]
    value = fast_jit(loss)  # one compilation instead of one per operation run eagerly
    start = value(params, batch)
    for i in range(5):
        params, state, _ = opt.step(params, state, jax.random.PRNGKey(i), batch=batch)
    assert float(value(params, batch)) < 0.7 * float(start)
