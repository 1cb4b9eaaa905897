"""Scans that kfacx does not serve as stacked layers: two levels of stacking, stacked
and shared parameters mixed, tags in while loops; each raises or falls back as
documented. And constants of a tagged scan body becoming const operands.
"""

from __future__ import annotations

import re
import warnings

import _models as TM
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kfacx

from ._scan_cases import (
    BATCH,
    D_OUT,
    DENSE_KF,
    DEPTH,
    KEY,
    WIDTH,
    _both,
    assert_close,
    assert_trees_close,
    f64,
    stacked_problem,
    x64,  # noqa: F401  (autouse fixture)
)

# ----------------------------------------------------------------------------- unsupported


def warned(*patterns: str):
    """Records the warnings of a block; each pattern must match one of them."""
    return _Warned(patterns)


class _Warned(warnings.catch_warnings):
    def __init__(self, patterns):
        super().__init__(record=True)
        self.patterns = patterns

    def __enter__(self):
        self.caught = super().__enter__()
        warnings.simplefilter("always")
        return self.caught

    def __exit__(self, *exc):
        super().__exit__(*exc)
        if exc[0] is None:
            messages = [str(w.message) for w in self.caught]
            for pattern in self.patterns:
                assert any(re.search(pattern, m) for m in messages), (pattern, messages)


def _nested_loss(tag: bool):
    def loss(params, batch):
        x, t = batch

        def inner(h, w):
            y = jnp.tensordot(h, w, axes=1)
            return jnp.tanh(kfacx.register_dense(y, h, w) if tag else y), None

        h, _ = jax.lax.scan(lambda h, ws: jax.lax.scan(inner, h, ws), x, params["w"])
        return TM.loss_of_logits(lambda p, h: jnp.tensordot(h, p["out"], axes=1))(params, (h, t))

    return loss


def _nested_problem():
    rng = np.random.default_rng(0)
    params = dict(w=rng.standard_normal((2, DEPTH, WIDTH, WIDTH)) / 3)
    params["out"] = rng.standard_normal((WIDTH, D_OUT))
    return f64(params), f64((rng.standard_normal((BATCH, WIDTH)), np.ones((BATCH, D_OUT))))


def test_two_levels_of_stacking_raise_or_fall_back():
    """Nested scans that both run over a weight ``[2, DEPTH, ...]`` (layers within layers)
    are served by neither a stacked block nor folding; nested scans that close over the
    parameters at one level are (tests/tracer/test_nested_scans.py)."""
    args = _nested_problem()
    with pytest.raises(ValueError, match=r"dense_tag\[w\] sits in nested `scan`s that both run"):
        kfacx.BlockDiagonalCurvature(_nested_loss(True), auto_register_tags=False).init(KEY, args)
    loss = _nested_loss(False)
    with warned(r"two levels of stacking.*\['w'\]", r"no layer pattern matched.*\['w'\]"):
        tagged, report = kfacx.auto_register_tags(loss, args)
    assert report.unmatched == ("w",)
    assert {e.path: e.tag for e in report.entries} == {"w": "generic_tag", "out": "dense_tag"}
    assert_trees_close(*_both(jax.grad, tagged, loss, args))
    est = kfacx.BlockDiagonalCurvature(loss)
    with warned("two levels", r"no layer pattern matched.*\['w'\]"):
        est.init(KEY, args)
    assert [b.block_name for b in est.blocks] == ["Diagonal", DENSE_KF]


def _mixed_loss(tag: bool):
    """A dense layer in a scan whose weight is scanned over but whose bias is closed over."""

    def loss(params, batch):
        x, t = batch

        def body(h, w):
            y = TM.dense(h, w, params["b"])
            return jnp.tanh(kfacx.register_dense(y, h, w, params["b"]) if tag else y), None

        h, _ = jax.lax.scan(body, x, params["w"])
        return TM.loss_of_logits(lambda p, h: h)(params, (h, t))

    return loss


def test_mixed_stacked_and_shared_parameters_raise_or_are_split():
    rng = np.random.default_rng(0)
    params = f64(dict(w=rng.standard_normal((DEPTH, WIDTH, WIDTH)) / 3, b=np.ones(WIDTH)))
    args = (params, f64((rng.standard_normal((BATCH, WIDTH)), np.ones((BATCH, WIDTH)))))
    est = kfacx.BlockDiagonalCurvature(_mixed_loss(True), auto_register_tags=False)
    with pytest.raises(ValueError, match=r"\['w'\] as scanned-over.*\['b'\] as closed-over"):
        est.init(KEY, args)
    # Detection does not tag it as one layer: the weight and the bias become two layers.
    loss = _mixed_loss(False)
    with warned(r"runs over \(xs\).*closes over \(consts\).*'w'"):
        tagged, report = kfacx.auto_register_tags(loss, args)
    got = {e.path: (e.tag, e.source, e.stack_size, e.uses) for e in report.entries}
    assert got == {
        "w": ("dense_tag", "dense", DEPTH, 1),
        "b": ("scale_and_shift_tag", "shift", None, DEPTH),
    }
    assert_trees_close(*_both(jax.grad, tagged, loss, args))


def test_tags_in_while_loop_raise_and_carried_parameters_fall_back():
    params, (x, t) = stacked_problem()
    w = params["hidden"]["w"][0]

    def while_loss(params, batch):
        def body(c):
            i, h = c
            return i + 1, jnp.tanh(kfacx.register_dense(jnp.tensordot(h, params, 1), h, params))

        h = jax.lax.while_loop(lambda c: c[0] < 2, body, (0, batch[0]))[1]
        return TM.loss_of_logits(lambda p, h: h)(params, (h, batch[1]))

    batch = (jnp.ones((BATCH, WIDTH)), jnp.ones((BATCH, WIDTH)))
    with pytest.raises(ValueError, match=r"inside a `while` primitive"):
        kfacx.BlockDiagonalCurvature(while_loss, auto_register_tags=False).init(KEY, (w, batch))

    def carry_loss(params, batch):
        def body(c, _):
            h, w = c
            return (jnp.tanh(jnp.tensordot(h, w, 1)), 0.5 * w), None

        (h, _), _ = jax.lax.scan(body, (batch[0], params["w"]), None, length=2)
        return TM.loss_of_logits(lambda p, h: h)(params, (h, batch[1]))

    with warned(r"as its carry.*\['w'\]", r"no layer pattern matched.*\['w'\]"):
        tagged, report = kfacx.auto_register_tags(carry_loss, (dict(w=w), batch))
    assert report.unmatched == ("w",)
    assert_trees_close(*_both(jax.grad, tagged, carry_loss, (dict(w=w), batch)))


def test_tagged_scan_body_constants_become_const_operands():
    """A scan body holding constants (a `ClosedJaxpr` with consts) is rebound with the
    constants as leading const operands of the scan."""
    from kfacx.graph_matcher import _auto_register as AR

    rng = np.random.default_rng(0)
    mask, w = rng.standard_normal(WIDTH), f64(rng.standard_normal((DEPTH, WIDTH, WIDTH)) / 3)
    x = f64(rng.standard_normal((BATCH, WIDTH)))

    def f(w, x):
        return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w + jnp.asarray(mask)[None]), None), x, w)

    closed = jax.make_jaxpr(f)(w, x)
    (eqn,) = [e for e in closed.jaxpr.eqns if e.primitive.name == "scan"]
    nc, body = kfacx._helpers._jaxpr.scan_counts(eqn.params)[0], eqn.params["jaxpr"]
    assert nc == 1
    # Move the const operand into the body's own consts: the body traced again with the
    # operand's value captured (a const of the traced body, on every JAX version).
    values = dict(zip(closed.jaxpr.constvars, closed.consts, strict=True))
    captured = [jnp.asarray(values[v]) for v in eqn.invars[:nc]]
    closed_body = jax.make_jaxpr(
        lambda *a: kfacx._helpers._jaxpr.eval_jaxpr(body.jaxpr, body.consts, [*captured, *a])
    )(*[jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in body.jaxpr.invars[nc:]])
    assert len(closed_body.consts) == nc
    inner = closed_body.jaxpr
    params = dict(eqn.params, jaxpr=closed_body)
    params = kfacx._helpers._jaxpr.scan_params(params, 0, len(eqn.invars) - nc, len(eqn.outvars))
    eqn = eqn.replace(invars=eqn.invars[nc:], params=params)
    want = kfacx._helpers._jaxpr.bind_eqn(eqn, [x, w])
    origins = kfacx._helpers._jaxpr.scan_body_origins(eqn, [None, 0])
    plan = AR._plan(inner, origins, list(kfacx.DEFAULT_GRAPH_PATTERNS), {}, [], True)
    assert [m.stacked for m in plan.matches] == [True]
    tagged = jax.make_jaxpr(lambda x, w: AR._rebind_scan(eqn, [x, w], plan))(x, w)
    (scan,) = [e for e in tagged.jaxpr.eqns if kfacx._helpers._jaxpr.is_scan(e)]
    assert (
        kfacx._helpers._jaxpr.scan_counts(scan.params)[0] == 1 and scan.params["jaxpr"].consts == []
    )
    assert kfacx._helpers._jaxpr.contains_tags(scan.params["jaxpr"].jaxpr)
    got = jax.extend.core.jaxpr_as_fun(tagged)(x, w)
    for g, v in zip(got, want, strict=True):
        assert_close(g, v)
