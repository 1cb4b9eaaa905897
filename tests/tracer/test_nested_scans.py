"""Layers inside nested `lax.scan`s: a scan in a scan, at most one of them running over
the parameters.

- a layer stack of RNNs (`hk.layer_stack` whose layers scan over time): stacked
  over the outer scan, the time steps folded into the batch axis;
- an RNN applied again and again (an outer loop of refinement passes closing over
  the cell): one layer, the passes and the time steps folded;
- a layer stack applied again and again (weight-tied depth recurrence): stacked
  over the inner scan, the outer passes folded.

Each equals the same model with both loops written in Python (float64, exact
Gauss-Newton statistics), detected or tagged by hand.
"""

from __future__ import annotations

import warnings

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _models import fixed_rate_run

import kfacx

B, T, I, W, O, L, K = 4, 3, 3, 5, 2, 2, 2
KEY = jax.random.PRNGKey(0)


@pytest.fixture
def x64():
    with jax.enable_x64(True):
        yield


def _loop(unrolled, body, carry, xs, length=None):
    """``jax.lax.scan(body, carry, xs, length)``, or the same as a Python loop over ``xs``
    (a list of per-iteration pytrees) or ``range(length)``."""
    if not unrolled:
        return jax.lax.scan(body, carry, xs, length=length)
    ys = []
    for x in xs if xs is not None else [None] * length:
        carry, y = body(carry, x)
        ys.append(y)
    return carry, (None if ys[0] is None else jnp.stack(ys))


def _dense(tag, x, w, b=None):
    y = x @ w if b is None else x @ w + b.reshape((1,) * (x.ndim - 1) + (-1,))
    return kfacx.register_dense(y, x, w, b) if tag else y


def _cell(tag, q, h, x):
    return jnp.tanh(_dense(tag, x, q["wx"]) + _dense(tag, h, q["wh"], q["b"]))


def _rnn(tag, unrolled, q, seq):
    """An Elman RNN over ``seq [T, B, W]``; returns the hidden states ``[T, B, W]``."""

    def step(h, x):
        h = _cell(tag, q, h, x)
        return h, h

    return _loop(unrolled, step, jnp.zeros_like(seq[0]), seq if not unrolled else list(seq))[1]


def _mlp_layer(tag, q, h):
    return jnp.tanh(_dense(tag, h, q["w"], q["b"]))


def _model(kind, tag=False, unrolled=False):
    """``loss(params, (xs, labels))``; with ``unrolled``, the per-layer parameters are a
    list (``params["stack"]``) and both loops are Python loops."""

    def stack_of_rnns(p, seq):
        def layer(seq, q):
            return _rnn(tag, unrolled, q, seq), None

        return _loop(unrolled, layer, seq, p["stack"])[0]

    def repeated_rnn(p, seq):
        def refine(seq, _):
            return _rnn(tag, unrolled, p["cell"], seq), None

        return _loop(unrolled, refine, seq, None, length=K)[0]

    def repeated_stack(p, seq):
        def apply_stack(h, _):
            layer = lambda h, q: (_mlp_layer(tag, q, h), None)  # noqa: E731
            return _loop(unrolled, layer, h, p["stack"])[0], None

        return _loop(unrolled, apply_stack, seq, None, length=K)[0]

    body = dict(
        stack_of_rnns=stack_of_rnns, repeated_rnn=repeated_rnn, repeated_stack=repeated_stack
    )[kind]

    def loss(p, batch):
        xs, labels = batch
        seq = jnp.tanh(_dense(tag, jnp.swapaxes(xs, 0, 1), p["inp"]))  # [T, B, W]
        logits = _dense(tag, body(p, seq)[-1], p["out"])
        logits = kfacx.register_softmax_cross_entropy_loss(logits, labels)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], 1))

    return loss


def _params(kind, seed=0):
    rng = np.random.default_rng(seed)

    def w(*shape):
        return rng.normal(size=shape) / np.sqrt(shape[-2])

    params = dict(inp=w(I, W), out=w(W, O))
    if kind == "stack_of_rnns":
        params["stack"] = dict(wx=w(L, W, W), wh=w(L, W, W), b=0.3 * rng.normal(size=(L, W)))
    elif kind == "repeated_rnn":
        params["cell"] = dict(wx=w(W, W), wh=w(W, W), b=0.3 * rng.normal(size=(W,)))
    else:
        params["stack"] = dict(w=w(L, W, W), b=0.3 * rng.normal(size=(L, W)))
    return jax.tree.map(jnp.asarray, params)


def _batch(seed=1):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.normal(size=(B, T, I))), jnp.asarray(rng.integers(0, O, (B,)))


def _unstacked(params):
    if "stack" not in params:
        return params
    layers = [jax.tree.map(lambda a, i=i: np.asarray(a)[i], params["stack"]) for i in range(L)]
    return dict(params, stack=layers)


def _stats(loss, args, **kwargs):
    est = kfacx.BlockDiagonalCurvature(loss, default_estimation_mode="ggn_exact", **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every parameter matched, no note
        est.init(KEY, args)
    # one compilation instead of one per operation run eagerly
    stats = jax.jit(est.compute_curvature_stats)(KEY, args).blocks
    return est, jax.tree.map(np.asarray, stats)


def _close(got, want):
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-13)


KINDS = ["stack_of_rnns", "repeated_rnn", "repeated_stack"]


@pytest.mark.parametrize("kind", KINDS)
def test_nested_scans_equal_the_unrolled_model(x64, kind):
    params, batch = _params(kind), _batch()
    est, auto = _stats(_model(kind), (params, batch))
    report = est.report
    assert report.notes == () and report.unmatched == (), str(report)
    _, manual = _stats(_model(kind, tag=True), (params, batch), auto_register_tags=False)
    for got, want in zip(auto, manual, strict=True):
        _close(got, want)
    _, unrolled = _stats(_model(kind, unrolled=True), (_unstacked(params), batch))
    inp, *middle, out = auto
    _close(inp, unrolled[0])
    _close(out, unrolled[-1])
    entries = {e.path: (e.uses, e.stack_size) for e in report.entries}
    if kind == "repeated_rnn":
        # One cell: its (x-side, h-side) layers applied K passes x T steps.
        assert entries["cell/wx"] == (K * T, None) and entries["cell/wh"] == (K * T, None)
        for got, want in zip(middle, unrolled[1:-1], strict=True):
            _close(got, want)
        return
    # A stacked layer per parameter group: slice l equals unrolled layer l.
    uses = T if kind == "stack_of_rnns" else K
    assert {entries[p] for p in entries if p.startswith("stack/")} == {(uses, L)}, entries
    per_layer = len(middle)
    assert all(type(b).__name__ == "StackedBlock" for b in est.blocks[1:-1])
    for layer in range(L):
        for j, stacked in enumerate(middle):
            _close([s[layer] for s in stacked], unrolled[1 + layer * per_layer + j])


@pytest.mark.parametrize("stacked", [True, False], ids=["layer_stack_of_rnns", "one_rnn"])
def test_haiku_rnns_are_detected_under_value_and_grad_and_train(stacked):
    """The issue's case, `hk.layer_stack` whose layers run an `hk.VanillaRNN` over time,
    and one RNN, trained by the `Optimizer`: it traces the forward pass of
    ``jax.value_and_grad(loss)``, where JAX hoists the broadcast of each cell's biases
    out of the time scan (detection moves it back, `kfacx._helpers._jaxpr.sink_invariants`)."""

    def forward(xs):
        seq = jnp.tanh(hk.Linear(W, name="inp")(jnp.swapaxes(xs, 0, 1)))

        def layer(seq):
            cell = hk.VanillaRNN(W)
            return hk.dynamic_unroll(cell, seq, cell.initial_state(seq.shape[1]))[0]

        seq = hk.layer_stack(L)(layer)(seq) if stacked else layer(seq)
        return hk.Linear(O, name="out")(seq[-1])

    net = hk.without_apply_rng(hk.transform(forward))
    xs, labels = _batch()
    xs = np.asarray(xs, np.float32)
    # one compilation instead of one per operation run eagerly
    params = jax.jit(net.init)(KEY, xs)

    def loss(p, batch):
        logits = kfacx.register_softmax_cross_entropy_loss(net.apply(p, batch[0]), batch[1])
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), batch[1][:, None], 1))

    opt, losses = fixed_rate_run(loss, params, (xs, labels), steps=4, learning_rate=0.05)
    report = opt.estimator.report
    assert report.notes == () and report.unmatched == (), str(report)
    assert {e.source for e in report.entries} == {"dense_with_bias"}, str(report)
    cell = {(e.uses, e.stack_size) for e in report.entries if "vanilla_rnn" in e.path}
    assert cell == {(T, L if stacked else None)}, str(report)
    assert np.isfinite(losses).all() and losses[-1] < 0.5 * losses[0], losses


def test_parameters_stacked_by_different_scans_raise_or_fall_back(x64):
    """A weight sliced by the outer scan and a bias by the inner one are no one layer."""

    def model(tag):
        def loss(p, batch):
            xs, labels = batch
            h0 = jnp.tanh(xs[:, 0] @ p["inp"])

            def outer(h, w):
                def inner(h, b):
                    y = h @ w + b[None, :]
                    return jnp.tanh(kfacx.register_dense(y, h, w, b) if tag else y), None

                return jax.lax.scan(inner, h, p["b"])[0], None

            logits = jax.lax.scan(outer, h0, p["w"])[0] @ p["out"]
            logits = kfacx.register_softmax_cross_entropy_loss(logits, labels)
            return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], 1))

        return loss

    rng = np.random.default_rng(0)
    params = dict(
        inp=rng.normal(size=(I, W)),
        w=rng.normal(size=(L, W, W)) / W,
        b=rng.normal(size=(K + 1, W)),
        out=rng.normal(size=(W, O)),
    )
    args = (jax.tree.map(jnp.asarray, params), _batch())
    est = kfacx.BlockDiagonalCurvature(model(True), auto_register_tags=False)
    with pytest.raises(ValueError, match=r"\['w', 'b'\].*or slices of different scans"):
        est.init(KEY, args)
    with pytest.warns(UserWarning, match=r"slices of different scans.*\['w', 'b'\]"):
        _, report = kfacx.auto_register_tags(model(False), args)
    # As for a weight stacked and a bias shared: the two become two layers.
    found = {e.path: (e.tag, e.uses, e.stack_size) for e in report.entries}
    assert found["w"] == ("dense_tag", K + 1, L) and found["b"] == ("scale_and_shift_tag", L, K + 1)


def test_static_fori_loops_are_scans(x64):
    """``fori_loop`` with static bounds is a scan: an RNN cell run by a fori_loop over
    time inside a fori_loop of refinement passes is one layer applied K x T times."""
    params, batch = _params("repeated_rnn"), _batch()

    def model(unrolled):
        def loss(p, batch):
            xs, labels = batch
            seq = jnp.tanh(_dense(False, jnp.swapaxes(xs, 0, 1), p["inp"]))

            def refine(_, h):
                def step(t, h):
                    return _cell(False, p["cell"], h, seq[t])

                if unrolled:
                    for t in range(T):
                        h = step(t, h)
                    return h
                return jax.lax.fori_loop(0, T, step, h)

            h = jnp.zeros_like(seq[0])
            if unrolled:
                for k in range(K):
                    h = refine(k, h)
            else:
                h = jax.lax.fori_loop(0, K, refine, h)
            logits = kfacx.register_softmax_cross_entropy_loss(h @ p["out"], labels)
            return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], 1))

        return loss

    est, looped = _stats(model(False), (params, batch))
    assert est.report.notes == () and est.report.unmatched == ()
    assert {e.path: e.uses for e in est.report.entries if "cell" in e.path} == {
        "cell/wx": K * T,
        "cell/wh": K * T,
        "cell/b": K * T,
    }
    _, unrolled = _stats(model(True), (params, batch))
    for got, want in zip(looped, unrolled, strict=True):
        _close(got, want)
