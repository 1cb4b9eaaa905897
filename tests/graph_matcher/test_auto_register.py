"""Automatic layer detection: `kfacx.graph_matcher.auto_register_tags` and the estimator.

For every model in `_models`: the tagged function computes the same value and
gradient as the original, the report has the expected tag and source for every
parameter, and the tagged jaxpr holds the expected layer tags (one per layer,
every parameter in exactly one tag). Then: curvature equivalence with
hand-tagged models, the ``on_unmatched`` modes and argument errors, and the
report's text.
"""

from __future__ import annotations

import collections
import functools
import re
import warnings

import jax
import jax.extend as jex
import jax.numpy as jnp
import numpy as np
import pytest

import kfacx
from kfacx.graph_matcher import DEFAULT_GRAPH_PATTERNS, RegistrationReport, auto_register_tags

from . import _models as M

TOL = dict(rtol=1e-5, atol=1e-5)
CASES = {case.name: case for case in M.haiku_cases() + M.raw_cases()}


@functools.cache
def registered(name: str) -> tuple:
    """``(tagged, report, warning messages)`` of `auto_register_tags` on a case (cached)."""
    case = CASES[name]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tagged, report = auto_register_tags(case.loss, case.args)
    return tagged, report, tuple(str(w.message) for w in caught if w.category is UserWarning)


def assert_trees_close(a, b, **tol):
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), **(tol or TOL))


# ----------------------------------------------------------------------------- jaxpr helpers


def _bodies(eqn):
    for sub in jex.core.jaxprs_in_params(eqn.params):
        yield getattr(sub, "jaxpr", sub)


def layer_tag_eqns(jaxpr, origins=None):
    """Every layer-tag equation (recursively), with the parameter leaves among its parameters.

    ``origins`` labels ``jaxpr.invars``; labels follow call bodies positionally.
    """
    env = dict(zip(jaxpr.invars, origins or [None] * len(jaxpr.invars), strict=True))
    for eqn in jaxpr.eqns:
        tag = kfacx.tags.layer_tag_for(eqn.primitive)
        ins = [None if isinstance(v, jex.core.Literal) else env.get(v) for v in eqn.invars]
        if tag is not None:
            yield eqn, list(tag.split(ins)[2])
        for body in _bodies(eqn):
            sub = ins if len(body.invars) == len(ins) else None
            yield from layer_tag_eqns(body, sub)


def tagged_layers(case: M.Case, tagged) -> list[tuple]:
    """``(eqn, parameter leaf indices)`` per layer tag of the tagged function's jaxpr."""
    closed = jax.make_jaxpr(tagged)(*case.args)
    n_params = len(jax.tree_util.tree_leaves(case.params))
    origins = list(range(n_params)) + [None] * (len(closed.jaxpr.invars) - n_params)
    return list(layer_tag_eqns(closed.jaxpr, origins))


# ----------------------------------------------------------------------------- 1. models


@pytest.mark.parametrize("name", sorted(CASES))
def test_tagged_function_has_same_value_and_gradient(name):
    case = CASES[name]
    tagged, _, _ = registered(name)
    # One compilation for both sides.
    both = jax.jit(lambda *a: (jax.value_and_grad(tagged)(*a), jax.value_and_grad(case.loss)(*a)))
    got, want = both(*case.args)
    assert_trees_close(got, want)


@pytest.mark.parametrize("name", sorted(CASES))
def test_report_has_expected_tag_and_source_per_parameter(name):
    case = CASES[name]
    _, report, messages = registered(name)
    got = {e.path: (e.tag, e.source) for e in report.entries}
    assert got == {path: (tag, source) for path, (tag, source, _) in case.expected.items()}, str(
        report
    )
    # Parameters with one expected layer label share one layer; different labels, different ones.
    layer_of = {e.path: e.layer for e in report.entries}
    groups = collections.defaultdict(set)
    for path, (_, _, label) in case.expected.items():
        groups[label].add(layer_of[path])
    assert all(len(layers) == 1 for layers in groups.values()), str(report)
    assert len({min(layers) for layers in groups.values()}) == len(groups), str(report)
    assert report.unmatched == case.unmatched
    for path in case.unmatched:
        assert any(path in m for m in messages), messages
    if not case.unmatched:
        assert messages == ()
    assert all(e.block == "" for e in report.entries)


@pytest.mark.parametrize("name", sorted(CASES))
def test_tagged_jaxpr_has_one_layer_tag_per_layer(name):
    case = CASES[name]
    tagged, _, _ = registered(name)
    layers = tagged_layers(case, tagged)
    counts = collections.Counter(eqn.primitive.name for eqn, _ in layers)
    assert dict(counts) == dict(case.tag_counts)
    # Every parameter leaf is a parameter of exactly one layer tag (manual tags are not
    # doubled), or of one tag per use for a layer applied several times.
    paths = [e.path for e in registered(name)[1].entries]
    leaves = collections.Counter(paths[leaf] for _, ps in layers for leaf in ps)
    assert dict(leaves) == {p: case.uses.get(p, 1) for p in paths}
    for prim, metas in case.tag_meta.items():
        eqns = [eqn for eqn, _ in layers if eqn.primitive.name == prim]
        assert len(eqns) == len(metas)
        for eqn, meta in zip(eqns, metas, strict=True):
            for key, value in meta.items():
                assert eqn.params[key] == value, (key, eqn.params)


def test_tagged_function_jits_and_checks_shapes():
    case = CASES["mlp"]
    tagged, _, _ = registered("mlp")
    # one compilation each instead of one per operation run eagerly
    np.testing.assert_allclose(jax.jit(tagged)(*case.args), jax.jit(case.loss)(*case.args), **TOL)
    params, (x, t) = case.args
    with pytest.raises(ValueError, match="auto_register_tags again"):
        tagged(params, (x[:1], t[:1]))


def test_params_index_other_than_zero():
    case = CASES["mlp"]

    def loss(batch, params):
        return case.loss(params, batch)

    tagged, report = auto_register_tags(loss, (case.batch, case.params), params_index=1)
    _, want, _ = registered("mlp")
    assert report.entries == want.entries
    # one compilation instead of one per operation run eagerly
    got, want = jax.jit(lambda b, p: (tagged(b, p), case.loss(p, b)))(case.batch, case.params)
    np.testing.assert_allclose(got, want, **TOL)


def test_parameters_inside_a_while_loop_fall_back_with_a_note():
    # Layers inside lax.scan and lax.cond are detected (tests/graph_matcher/test_scan.py,
    # tests/tracer/test_control_flow.py); a while loop (unknown trip count) is not looked into.
    rng = np.random.default_rng(0)
    params = dict(w0=M.normal(rng, 4, 3), ws=M.normal(rng, 3, 3, scale=0.3))
    batch = M.two_layer_batch()

    def loss(p, batch):
        x, t = batch
        h = x @ p["w0"]
        _, h = jax.lax.while_loop(
            lambda c: jnp.sum(c[1]) > 1e3 * c[0],
            lambda c: (c[0] + 1, jnp.tanh(c[1] @ p["ws"])),
            (1.0, h),
        )
        return M.squared_loss(h, t)

    with pytest.warns(UserWarning, match="ws"):
        tagged, report = auto_register_tags(loss, (params, batch))
    assert report.unmatched == ("ws",)
    assert {e.path: e.tag for e in report.entries} == {"w0": M.DENSE, "ws": M.GENERIC}
    assert any("`while`" in n for n in report.notes)
    # (Reverse-mode differentiation does not go through while loops.)
    got, want = jax.jit(lambda *a: (tagged(*a), loss(*a)))(params, batch)  # (one compilation)
    np.testing.assert_allclose(got, want, rtol=1e-6)


# ----------------------------------------------------------------------------- known gaps


def test_transposed_weight_is_a_dense_layer():
    params, batch = M.transposed_weight_params(), M.two_layer_batch()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # today: "no layer pattern matched parameters ['w']"
        tagged, report = auto_register_tags(M.transposed_weight_loss, (params, batch))
    assert report.unmatched == ()
    assert {e.path: e.tag for e in report.entries} == {"b": M.DENSE, "w": M.DENSE}
    case = M.Case("t", M.transposed_weight_loss, params, batch, {}, {M.DENSE: 1})
    ((eqn, leaves),) = tagged_layers(case, tagged)
    assert eqn.params["dimension_numbers"] == (((1,), (1,)), ((), ()))


def test_weight_used_as_w_and_w_transposed_is_one_tied_layer():
    params, batch = M.tied_params(), M.two_layer_batch(d_out=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tagged, report = auto_register_tags(M.tied_loss, (params, batch))
    assert report.notes == () and report.unmatched == ()
    ((entry),) = report.entries
    assert (entry.tag, entry.uses) == ("tied(dense_tag, dense_tag)", 2)
    assert entry.source == "transposed_weight_dense+dense"
    # one compilation each instead of one per operation run eagerly
    got, want = (jax.jit(jax.value_and_grad(f))(params, batch) for f in (tagged, M.tied_loss))
    np.testing.assert_allclose(got[0], want[0], **TOL)
    assert_trees_close(got[1], want[1])


def _rescaled_custom_jvp(f):
    g = jax.custom_jvp(f)
    g.defjvp(lambda primals, tangents: (g(*primals), 2.0 * jax.jvp(f, primals, tangents)[1]))
    return g


def _rescaled_custom_vjp(f):
    g = jax.custom_vjp(f)

    def fwd(*args):
        out, vjp = jax.vjp(f, *args)
        return out, vjp

    def bwd(vjp, ct):
        return tuple(2.0 * c for c in vjp(ct))

    g.defvjp(fwd, bwd)
    return g


@pytest.mark.parametrize("wrap", [_rescaled_custom_jvp, _rescaled_custom_vjp])
def test_custom_derivative_rules_are_kept(wrap):
    first = wrap(M.dense)

    def loss(p, batch):
        x, t = batch
        h = jnp.tanh(first(x, p["w1"], p["b1"]))
        return M.squared_loss(M.dense(h, p["w2"], p["b2"]), t)

    params, batch = M.two_layer_params(), M.two_layer_batch()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a fix may leave the wrapped layer unmatched
        tagged, _ = auto_register_tags(loss, (params, batch))
    # one compilation each instead of one per operation run eagerly
    got, want = (jax.jit(jax.grad(f))(params, batch) for f in (tagged, loss))
    assert_trees_close(got, want)


def test_row_vector_bias_does_not_break_the_estimator():
    rng = np.random.default_rng(0)
    params = dict(w=M.normal(rng, 4, 3), b=M.normal(rng, 1, 3))
    batch = M.two_layer_batch()

    def loss(p, batch):
        x, t = batch
        return M.squared_loss(x @ p["w"] + jnp.broadcast_to(p["b"], (x.shape[0], 3)), t)

    est = kfacx.BlockDiagonalCurvature(loss)
    state = est.init(jax.random.PRNGKey(0), (params, batch))

    @jax.jit  # one compilation instead of one per operation run eagerly
    def dense(state, args):
        state = est.update_curvature_matrix_estimate(
            state, 0.0, 1.0, 3, jax.random.PRNGKey(1), args, estimation_mode="ggn_exact"
        )
        return est.to_dense_matrix(state)

    assert np.all(np.isfinite(dense(state, (params, batch))))


# ----------------------------------------------------------------------------- 2. curvature

EQUIVALENCE = M.equivalence_models()


def _ggn_exact(est, args):
    """The dense ``ggn_exact`` estimate of one batch (jitted: one compile per model)."""
    state = est.init(jax.random.PRNGKey(0), args)

    def dense(state, args):
        state = est.update_curvature_matrix_estimate(
            state, 0.0, 1.0, None, jax.random.PRNGKey(1), args, estimation_mode="ggn_exact"
        )
        return est.to_dense_matrix(state)

    return np.asarray(jax.jit(dense)(state, args))


@pytest.mark.parametrize("name", sorted(EQUIVALENCE))
def test_auto_and_hand_tagged_curvature_agree(name):
    loss, hand_loss, params, batch = EQUIVALENCE[name]
    args = (params, batch)
    # one compilation for both instead of one per operation run eagerly
    np.testing.assert_allclose(*jax.jit(lambda *a: (hand_loss(*a), loss(*a)))(*args), **TOL)
    auto = kfacx.BlockDiagonalCurvature(loss)
    hand = kfacx.BlockDiagonalCurvature(hand_loss, auto_register_tags=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        want, got = _ggn_exact(hand, args), _ggn_exact(auto, args)
    assert np.abs(want).max() > 0
    np.testing.assert_allclose(got, want, **TOL)
    assert hand.report is None
    report = auto.report
    assert report.unmatched == ()
    assert [type(b).__name__ for b in auto.blocks] == [type(b).__name__ for b in hand.blocks]
    for e in report.entries:
        assert e.block == M.BLOCK_OF_TAG[e.tag], str(report)
    assert all(e.block in str(report) for e in report.entries)


# ----------------------------------------------------------------------------- 3. on_unmatched

UNMATCHED_KINDS = ("sin", "tanh")  # (exp is an elementwise map kfacx serves)


def _unmatched_args():
    return (M.unmatched_params(), M.two_layer_batch(d_out=3))


def _update(est, args):
    state = est.init(jax.random.PRNGKey(0), args)

    @jax.jit  # one compilation instead of one per operation run eagerly
    def update(state, args):
        return est.update_curvature_matrix_estimate(
            state, 0.0, 1.0, None, jax.random.PRNGKey(1), args, estimation_mode="ggn_exact"
        )

    return update(state, args)


@pytest.mark.parametrize("kind", UNMATCHED_KINDS)
def test_on_unmatched_warn_gives_generic_tag_and_diagonal_block(kind):
    args = _unmatched_args()
    est = kfacx.BlockDiagonalCurvature(M.unmatched_loss(kind))
    with pytest.warns(UserWarning, match=r"\['p'\]"):
        state = _update(est, args)
    report = est.report
    assert report.unmatched == ("p",)
    got = {e.path: (e.tag, e.source, e.block) for e in report.entries}
    assert got == {
        "p": (M.GENERIC, "unmatched", "Diagonal"),
        "w": (M.DENSE, "dense", "DenseTwoKroneckerFactored"),
    }
    dense = np.asarray(jax.jit(est.to_dense_matrix)(state))  # (one compilation)
    assert dense.shape == (15, 15) and np.all(np.isfinite(dense))
    # The fallback block of p is estimated (a non-zero diagonal).
    assert np.all(np.diag(dense)[:3] > 0)


@pytest.mark.parametrize("kind", UNMATCHED_KINDS)
def test_on_unmatched_error_names_the_parameter(kind):
    args = _unmatched_args()
    with pytest.raises(ValueError, match=r"\['p'\]"):
        auto_register_tags(M.unmatched_loss(kind), args, on_unmatched="error")
    est = kfacx.BlockDiagonalCurvature(
        M.unmatched_loss(kind), auto_register_kwargs=dict(on_unmatched="error")
    )
    with pytest.raises(ValueError, match=r"\['p'\]"):
        est.init(jax.random.PRNGKey(0), args)


@pytest.mark.parametrize("kind", UNMATCHED_KINDS)
def test_on_unmatched_full_gives_a_full_block_without_warning(kind):
    est = kfacx.BlockDiagonalCurvature(
        M.unmatched_loss(kind), auto_register_kwargs=dict(on_unmatched="full")
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state = _update(est, _unmatched_args())
    blocks = {e.path: (e.tag, e.block) for e in est.report.entries}
    assert blocks == {"p": (M.GENERIC, "Full"), "w": (M.DENSE, "DenseTwoKroneckerFactored")}
    assert np.all(np.isfinite(np.asarray(jax.jit(est.to_dense_matrix)(state))))


def test_unknown_on_unmatched_raises():
    loss, args = M.unmatched_loss("sin"), _unmatched_args()
    with pytest.raises(ValueError, match="on_unmatched"):
        auto_register_tags(loss, args, on_unmatched="ignore")
    with pytest.raises(ValueError, match="on_unmatched"):
        est = kfacx.BlockDiagonalCurvature(loss, auto_register_kwargs=dict(on_unmatched="ignore"))
        est.init(jax.random.PRNGKey(0), args)


def test_graph_patterns_must_be_graph_patterns():
    loss, args = M.unmatched_loss("sin"), _unmatched_args()
    bad = (*DEFAULT_GRAPH_PATTERNS, "dense")
    with pytest.raises(TypeError, match="GraphPattern"):
        auto_register_tags(loss, args, graph_patterns=bad)
    with pytest.raises(TypeError, match="GraphPattern"):
        est = kfacx.BlockDiagonalCurvature(loss, auto_register_kwargs=dict(graph_patterns=bad))
        est.init(jax.random.PRNGKey(0), args)


def test_unknown_auto_register_kwargs_raise():
    with pytest.raises(ValueError, match="params_index"):
        kfacx.BlockDiagonalCurvature(
            M.unmatched_loss("sin"), auto_register_kwargs=dict(params_index=1)
        )


# ----------------------------------------------------------------------------- 5. report


def test_report_text_lists_every_parameter():
    _, report, _ = registered("cnn")
    text = str(report)
    lines = text.splitlines()
    assert re.match(r"parameter\s+layer\s+tag\s+found by\s+block$", lines[0])
    assert set(lines[1]) <= {"-", " "}
    for e in report.entries:
        assert any(line.startswith(e.path) and e.source in line for line in lines), e.path
    assert "6/6 parameters matched" in text
    assert report.matched_fraction == 1.0
    assert "unmatched" not in text


def test_report_text_with_unmatched_parameters_and_blocks():
    est = kfacx.BlockDiagonalCurvature(M.unmatched_loss("tanh"))
    with pytest.warns(UserWarning):
        _update(est, _unmatched_args())
    text = str(est.report)
    assert "1/2 parameters matched" in text
    assert re.search(r"unmatched \(fallback block\): p$", text, re.M)
    assert re.search(r"^p\s+\d+\s+generic_tag\s+unmatched\s+Diagonal$", text, re.M)
    assert re.search(r"^w\s+\d+\s+dense_tag\s+dense\s+DenseTwoKroneckerFactored$", text, re.M)
    assert est.report.matched_fraction == pytest.approx(0.5)
    assert RegistrationReport(()).matched_fraction == 1.0


def test_report_of_estimator_before_init_and_without_auto_registration():
    est = kfacx.BlockDiagonalCurvature(M.unmatched_loss("sin"))
    assert est.report is None
    assert (
        kfacx.BlockDiagonalCurvature(M.unmatched_loss("sin"), auto_register_tags=False).report
        is None
    )
