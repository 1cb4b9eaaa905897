"""Sliced weights: one parameter split into slices that different layers use.

``hk.GRU`` splits ``w_h`` (and ``b``) with ``jnp.split(w_h, [2H], axis=1)`` between
``state @ w_h_z`` and ``(r * state) @ w_h_a``; kfacx serves each slice as its own layer,
one `kfacx.blocks.SlicedBlock` per split parameter, block-diagonal over the slices.
Every model is compared, in float64 under ``ggn_exact``, with the same model written
with a parameter leaf per slice.
"""

from __future__ import annotations

import functools
import warnings

import _models as TM
import _recurrent as R
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kfacx

SLICED_KF = "SlicedBlock(DenseTwoKroneckerFactored, DenseTwoKroneckerFactored)"


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


def _gru_loss():
    model = R.haiku_gru()
    return lambda p, data: R.squared_loss(model.apply(p, data[0]), data[1])


# name -> (loss, params, reference loss, params -> reference params)
MODELS = {
    "haiku_gru": (
        _gru_loss(),
        lambda: jax.jit(R.haiku_gru().init)(R.KEY, R.batch()[0]),  # one compilation
        R.gru_reference_loss,
        R.gru_to_reference,
    ),
    "jax_slices": (R.sliced_loss, R.init_sliced, R.sliced_reference, R.sliced_to_reference),
}


@functools.cache
def problem(name: str):
    loss, init, ref_loss, to_ref = MODELS[name]
    params = jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float64), init())
    params = jax.tree_util.tree_map(  # nonzero biases
        lambda a: a + 0.2 * jnp.asarray(np.random.default_rng(3).standard_normal(a.shape)), params
    )
    args = (params, R.batch())
    return loss, args, ref_loss, (to_ref(params), args[1]), to_ref


@functools.cache
def estimates(name: str):
    loss, args, ref_loss, ref_args, to_ref = problem(name)
    rng = np.random.default_rng(5)
    vector = jax.tree_util.tree_map(lambda a: jnp.asarray(rng.standard_normal(a.shape)), args[0])
    return R.estimate(loss, args, vector), R.estimate(ref_loss, ref_args, to_ref(vector))


def test_haiku_gru_report():
    loss, args, ref_loss, ref_args, _ = problem("haiku_gru")
    R.assert_close(jax.jit(loss)(*args), jax.jit(ref_loss)(*ref_args))
    report = estimates("haiku_gru")[0][0].report
    assert report.unmatched == () and report.notes == ()
    got = {e.path: (e.tag, e.source, e.uses, e.block) for e in report.entries}
    shift = "SlicedBlock(ScaleAndShiftDiagonal, ScaleAndShiftDiagonal)"
    assert got == {
        "gru/w_i": ("dense_tag", "dense", R.T, "DenseTwoKroneckerFactored"),
        "gru/w_h": ("sliced(dense_tag, dense_tag)", "dense (sliced)", 2 * R.T, SLICED_KF),
        "gru/b": (
            "sliced(scale_and_shift_tag, scale_and_shift_tag)",
            "shift (sliced)",
            2 * R.T,
            shift,
        ),
    }
    assert f"(x{2 * R.T})  sliced(dense_tag, dense_tag)" in str(report)


def test_row_slices_and_concatenated_column_slices_are_sliced_layers():
    loss, args, ref_loss, ref_args, _ = problem("jax_slices")
    R.assert_close(jax.jit(loss)(*args), jax.jit(ref_loss)(*ref_args))
    est = estimates("jax_slices")[0][0]
    report = est.report
    assert report.unmatched == () and report.notes == ()
    got = {e.path: (e.layer, e.tag, e.source, e.uses) for e in report.entries}
    tag = "sliced(dense_tag, dense_tag)"
    assert got == {
        "v": (1, tag, "dense (sliced)", 2 * R.T),
        "w": (0, tag, "dense (sliced)", 2 * R.T),
    }
    assert [b.block_name for b in est.blocks] == [SLICED_KF] * 2


@pytest.mark.parametrize("name", sorted(MODELS))
def test_curvature_equals_a_leaf_per_slice(name):
    (_, dense, exact, approx), (_, ref_dense, ref_exact, ref_approx) = estimates(name)
    _, args, _, _, to_ref = problem(name)
    perm = R.positions(args[0], to_ref)
    assert sorted(perm) == list(range(len(perm)))  # the slices cover the parameters
    R.assert_close(dense[np.ix_(perm, perm)], ref_dense)
    for got, want in ((exact, ref_exact), (approx, ref_approx)):
        got = jax.tree_util.tree_leaves(to_ref(got))
        for a, b in zip(got, jax.tree_util.tree_leaves(want), strict=True):
            R.assert_close(a, b)


def test_optimizer_steps_lower_the_loss():
    loss, (params, data), *_ = problem("haiku_gru")
    _, losses = TM.fixed_rate_run(loss, params, data, steps=3, learning_rate=0.2)
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0], losses


# ----------------------------------------------------------------------------- not served


def _detect(logits, params):
    data = (jnp.ones((R.B, R.D)), jnp.zeros((R.B, R.H)))

    def loss(p, data):
        return R.squared_loss(logits(p, data[0]), data[1])

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, report = kfacx.auto_register_tags(loss, (params, data))
    return report, [str(w.message) for w in caught]


def _w(rows, cols):
    return {"w": jnp.asarray(np.random.default_rng(0).standard_normal((rows, cols)))}


def test_slices_that_no_layer_reads_leave_the_parameter_on_the_fallback():
    def logits(p, x):  # w[:, H:] is used elementwise, by no layer
        return jnp.tanh(x @ p["w"][:, : R.H]) * jnp.sum(p["w"][:, R.H :])

    report, caught = _detect(logits, _w(R.D, 2 * R.H))
    assert report.unmatched == ("w",)
    (note,) = report.notes
    assert "only some are a layer's weight" in note and "['w']" in note
    assert any("no layer pattern matched parameters ['w']" in c for c in caught)


def test_overlapping_slices_are_not_served():
    def logits(p, x):
        return x @ p["w"][:, : R.H] + x @ p["w"][:, 1 : R.H + 1]

    report, _ = _detect(logits, _w(R.D, R.H + 1))
    assert report.unmatched == ("w",)
    assert any("reuses parameters of a different kind of layer" in n for n in report.notes)
    assert any("only some are a layer's weight" in n for n in report.notes)


def test_a_layer_bridging_two_sliced_groups_is_not_served():
    def logits(p, x):
        u, v = jnp.split(p["u"], 2, axis=1), jnp.split(p["v"], 2, axis=1)
        h = jnp.tanh(x @ u[0]) + jnp.tanh(x @ v[0])  # two groups, then a layer on both:
        return h + jnp.concatenate([x, x], -1) @ jnp.concatenate([u[1], v[1]], 0)

    params = {"u": _w(R.D, 2 * R.H)["w"], "v": _w(R.D, 2 * R.H)["w"]}
    report, _ = _detect(logits, params)
    assert any("two separate groups of layers" in n for n in report.notes)
    assert set(report.unmatched) == {"u", "v"}


def test_a_slice_used_twice_does_not_make_up_for_a_missing_one():
    def logits(p, x):  # w[:, :H] twice (two steps), w[:, H:] by no layer
        h = jnp.tanh(x @ p["w"][:, : R.H])
        return jnp.tanh(h[:, : R.D] @ p["w"][:, : R.H]) + jnp.sum(p["w"][:, R.H :])

    report, _ = _detect(logits, _w(R.D, 2 * R.H))
    assert report.unmatched == ("w",)
    assert any("only some are a layer's weight" in n for n in report.notes)
