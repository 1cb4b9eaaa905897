"""Fused-gate recurrent cells: a layer whose weight is concatenated from parameter leaves.

Flax's ``OptimizedLSTMCell``, a Haiku module and plain JAX cells multiply once by
``concatenate([w_i, w_f, w_g, w_o], -1)`` (or ``concatenate([x, h]) @
concatenate([w_x, w_h], 0)``); kfacx serves the concatenation as one dense layer
(`kfacx.blocks.ViewBlock`). Every form is compared, in float64 under ``ggn_exact``,
with the same cell written with one fused weight leaf: the dense curvature, permuted
onto the per-gate leaves, and the damped inverse products must agree.
"""

from __future__ import annotations

import functools
import re
import warnings

import _models as TM
import _recurrent as R
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kfacx

KEY = jax.random.PRNGKey(0)
VIEW_KF = "ViewBlock(DenseTwoKroneckerFactored)"


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


def _haiku_loss():
    model = R.haiku_model()
    return lambda p, data: R.squared_loss(model.apply(p, data[0]), data[1])


def _haiku_params():
    return R.haiku_model().init(KEY, R.batch()[0])


_FLAX = R.flax_model()
_FLAX_BI = R.flax_model(bidirectional=True)

#: The cells written with one fused weight leaf: name -> (loss, parameters, outputs).
REFERENCES = {
    "lstm": (R.fused_loss, R.init_fused, R.H),
    "bidirectional": (R.fused_loss, lambda: dict(R.init_fused(0), back=R.init_fused(1)), 2 * R.H),
    "concat_inputs": (R.concat_inputs_reference, R.init_concat_inputs_fused, R.H),
}

#: name -> (loss, parameters (their structure), parameters -> reference's, reference)
FORMS = {
    "jax_concat_in_scan": (R.concat_gates_loss("inside"), R.init_gates, R.gates_to_fused, "lstm"),
    "jax_concat_outside_scan": (
        R.concat_gates_loss("outside"),
        R.init_gates,
        R.gates_to_fused,
        "lstm",
    ),
    "jax_concat_unrolled": (
        R.concat_gates_loss("unrolled"),
        R.init_gates,
        R.gates_to_fused,
        "lstm",
    ),
    "jax_concat_inputs": (
        R.concat_inputs_loss,
        R.init_concat_inputs,
        R.concat_inputs_to_fused,
        "concat_inputs",
    ),
    "haiku": (_haiku_loss(), _haiku_params, R.haiku_to_fused, "lstm"),
    "flax_optimized_lstm": (
        R.flax_loss(_FLAX),
        lambda: R.flax_params(_FLAX),
        R.flax_to_fused,
        "lstm",
    ),
    "flax_bidirectional": (
        R.flax_loss(_FLAX_BI),
        lambda: R.flax_params(_FLAX_BI),
        R.flax_bidirectional_to_fused,
        "bidirectional",
    ),
}


def _f64(tree):
    return jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float64), tree)


@functools.cache
def reference(ref: str):
    """``(loss, args, vector, estimate)`` of a reference cell, shared by its forms."""
    loss, init, out = REFERENCES[ref]
    params = _f64(init())
    rng = np.random.default_rng(5)
    vector = jax.tree_util.tree_map(lambda a: jnp.asarray(rng.standard_normal(a.shape)), params)
    args = (params, R.batch(out=out))
    return loss, args, vector, R.estimate(loss, args, vector)


@functools.cache
def problem(name: str):
    """``(loss, args, vector, to_fused, reference name)`` of a form, in float64: its
    parameters and vector are the reference's, split onto its leaves."""
    loss, init, to_fused, ref = FORMS[name]
    _, (ref_params, data), ref_vector, _ = reference(ref)
    # Only the shapes of the form's own parameters matter: traced, not run (no compilation).
    like = jax.tree_util.tree_map(lambda s: np.zeros(s.shape), jax.eval_shape(init))
    perm = R.positions(like, to_fused)
    params, vector = (R.unpermuted(like, perm, tree) for tree in (ref_params, ref_vector))
    return loss, (params, data), vector, to_fused, ref


@functools.cache
def estimates(name: str):
    loss, args, vector, _, ref = problem(name)
    return R.estimate(loss, args, vector), reference(ref)[3]


# ----------------------------------------------------------------------------- detection


@pytest.mark.parametrize("name", sorted(FORMS))
def test_every_gate_leaf_is_one_concatenated_dense_layer(name):
    loss, args, _, _, ref = problem(name)
    ref_loss, ref_args, *_ = reference(ref)
    # The reference is the same function (jitted: one compilation, not one per operation).
    R.assert_close(jax.jit(loss)(*args), jax.jit(ref_loss)(*ref_args))
    est = estimates(name)[0][0]
    report = est.report
    assert report.unmatched == () and report.notes == ()
    layers = {}
    for e in report.entries:
        assert (e.tag, e.block, e.uses) == ("dense_tag", VIEW_KF, R.T), e
        assert e.source.endswith("(concatenated)"), e
        layers.setdefault(e.layer, []).append(e.path)
    # x @ w_x and h @ w_h + b (or one product on [x, h]), per direction.
    directions = 2 if name == "flax_bidirectional" else 1
    assert len(layers) == directions * (1 if name == "jax_concat_inputs" else 2)
    assert len(est.blocks) == len(layers)
    assert re.search(rf"\d \(x{R.T}\)\s+dense_tag\s+dense_with_bias \(concatenated\)", str(report))


def test_tagged_function_has_the_same_value_and_gradient():
    # As the optimizer traces it: the value of value_and_grad, whose scan JAX rewrites
    # with the concatenations hoisted out of its body (kfacx moves them back in).
    loss, args, *_ = problem("jax_concat_outside_scan")

    def value(*args):
        return jax.value_and_grad(loss)(*args)[0]

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tagged, report = kfacx.auto_register_tags(value, args)
    assert report.unmatched == () and report.notes == ()
    # One compilation for both sides (not one per operation of the untagged one run eagerly).
    got, want = jax.jit(lambda *a: (jax.value_and_grad(tagged)(*a), jax.value_and_grad(loss)(*a)))(
        *args
    )
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        R.assert_close(a, b)


# ----------------------------------------------------------------------------- curvature


@pytest.mark.parametrize("name", sorted(FORMS))
def test_curvature_equals_the_fused_weight_layer(name):
    (_, dense, exact, approx), (_, ref_dense, ref_exact, ref_approx) = estimates(name)
    _, args, _, to_fused, _ = problem(name)
    perm = R.positions(args[0], to_fused)
    R.assert_close(dense[np.ix_(perm, perm)], ref_dense)
    for got, want in ((exact, ref_exact), (approx, ref_approx)):
        got = jax.tree_util.tree_leaves(to_fused(got))
        for a, b in zip(got, jax.tree_util.tree_leaves(want), strict=True):
            R.assert_close(a, b)


# ----------------------------------------------------------------------------- training


# One form of each source: plain JAX, Haiku, Flax (the concatenation in a scan trains in
# the language model below).
@pytest.mark.parametrize("name", ["jax_concat_inputs", "haiku", "flax_optimized_lstm"])
def test_optimizer_steps_lower_the_loss(name):
    loss, (params, data), *_ = problem(name)
    _, losses = TM.fixed_rate_run(loss, params, data, steps=3, learning_rate=0.2)
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0], losses


@pytest.mark.parametrize("name", sorted(R.FLAX_CELLS))
def test_flax_cells_under_scan_are_fully_matched(name):
    make, out = R.FLAX_CELLS[name]
    model = make()
    xs = R.batch()[0].astype(jnp.float32)  # (the cells' carry is float32)
    # Detection needs the parameters' shapes only: traced, not run (no compilation).
    params = jax.tree_util.tree_map(
        lambda s: np.zeros(s.shape, s.dtype), jax.eval_shape(model.init, KEY, xs)
    )
    data = (xs, jnp.zeros((R.B, R.T, out), xs.dtype))

    def value(p, data):  # as the optimizer traces it
        return jax.value_and_grad(R.flax_loss(model))(p, data)[0]

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, report = kfacx.auto_register_tags(value, (params, data))
    assert report.unmatched == () and report.notes == ()
    assert {e.tag for e in report.entries} == {"dense_tag"}
    assert {e.uses for e in report.entries} == {R.T}
    fused = name == "optimized_lstm_scan"
    assert all(e.source.endswith("(concatenated)") == fused for e in report.entries)


def test_character_language_model_learns_faster_than_the_diagonal_fallback():
    # The fused block against the diagonal blocks every parameter gets without patterns,
    # each with the learning rate the quadratic model picks (kfac-jax's adaptive rule).
    data, losses = R.lm_text(), {}
    for name, kwargs in (("fused", {}), ("diagonal", dict(graph_patterns=()))):
        opt = kfacx.Optimizer(
            jax.value_and_grad(R.lm_loss),
            use_adaptive_learning_rate=True,
            momentum_schedule=0.0,
            initial_damping=1e-3,
            num_burnin_steps=0,
            auto_register_kwargs=dict(kwargs, on_unmatched="warn"),
        )
        with warnings.catch_warnings():
            warnings.simplefilter("error" if name == "fused" else "ignore")
            params = R.lm_params()
            state = opt.init(params, KEY, data)
        for i in range(12):
            params, state, stats = opt.step(params, state, jax.random.PRNGKey(i), batch=data)
        losses[name] = float(stats["loss"])
        if name == "fused":
            assert {e.block for e in opt.estimator.report.entries} == {
                VIEW_KF,
                "DenseTwoKroneckerFactored",
            }
    assert losses["fused"] < losses["diagonal"] - 0.1, losses
