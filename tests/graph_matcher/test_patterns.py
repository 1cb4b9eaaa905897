"""User-defined `GraphPattern`s: a new layer tag found automatically, end to end.

The way kfac-jax documents custom layers: a new `kfacx.tags.LayerTag` with a
compute function, a parameters extractor, a `GraphPattern` with example
arguments, passed to the estimator through ``auto_register_kwargs`` with a
block class for the new tag.
"""

from __future__ import annotations

import uuid
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

import kfacx
from kfacx.graph_matcher import (
    DEFAULT_GRAPH_PATTERNS,
    GraphPattern,
    auto_register_tags,
    find_matches,
)

from . import _models as M

TOL = dict(rtol=1e-5, atol=1e-5)


def _f32(*shape):
    return np.zeros(shape, np.float32)


def _dot_extractor(eqns):
    """Reads the matched contraction; only plain ``x @ w`` layers are accepted."""
    (eqn,) = [e for e in eqns if e.primitive.name == "dot_general"]
    dn = eqn.params["dimension_numbers"]
    x_ndim = eqn.invars[0].aval.ndim
    if dn != (((x_ndim - 1,), (0,)), ((), ())):
        raise ValueError("not x @ w")
    return dict(dimension_numbers=dn)


# ----------------------------------------------------------------------------- a fused tanh layer

FUSED_NAME = f"my_affine_tag_{uuid.uuid4().hex[:8]}"


def fused_compute(inputs, params, *, dimension_numbers):
    (x,) = inputs
    w, b = params
    return (jnp.tanh(jax.lax.dot_general(x, w, dimension_numbers) + b[None, :]),)


FUSED_TAG = kfacx.tags.LayerTag(FUSED_NAME, num_inputs=1, num_outputs=1, compute=fused_compute)


def fused_pattern(precedence: int = 100) -> GraphPattern:
    return GraphPattern(
        name="fused_tanh_dense",
        tag_primitive=FUSED_TAG,
        compute_func=lambda x, p: jnp.tanh(x @ p[0] + p[1][None, :]),
        parameters_extractor_func=_dot_extractor,
        example_args=[_f32(2, 3), [_f32(3, 4), _f32(4)]],
        precedence=precedence,
    )


def fused_loss(p, batch):
    x, t = batch
    h = jnp.tanh(x @ p["w"] + p["b"][None, :])
    return M.squared_loss(h @ p["w2"], t)


def fused_args():
    rng = np.random.default_rng(0)
    params = dict(
        w=M.normal(rng, 4, 5, scale=0.5), b=M.normal(rng, 5, scale=0.5), w2=M.normal(rng, 5, 3)
    )
    return params, M.two_layer_batch(d_in=4, d_out=3)


def test_custom_pattern_end_to_end_with_full_block():
    params, batch = fused_args()
    args = (params, batch)
    est = kfacx.BlockDiagonalCurvature(
        fused_loss,
        auto_register_kwargs=dict(graph_patterns=(fused_pattern(), *DEFAULT_GRAPH_PATTERNS)),
        layer_tag_to_block_ctor={FUSED_NAME: kfacx.blocks.Full},
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state = est.init(jax.random.PRNGKey(0), args)
    state = jax.jit(
        lambda state, args: est.update_curvature_matrix_estimate(
            state, 0.0, 1.0, None, jax.random.PRNGKey(1), args, estimation_mode="ggn_exact"
        )
    )(state, args)
    report = est.report
    got = {e.path: (e.tag, e.source, e.block) for e in report.entries}
    assert got == {
        "b": (FUSED_NAME, "fused_tanh_dense", "Full"),
        "w": (FUSED_NAME, "fused_tanh_dense", "Full"),
        "w2": ("dense_tag", "dense", "DenseTwoKroneckerFactored"),
    }
    assert FUSED_NAME in str(report) and "Full" in str(report)
    assert report.unmatched == ()

    # The Full block of the fused layer is its exact GGN block: J^T (2/B) J.
    (flat, unravel) = ravel_pytree(dict(b=params["b"], w=params["w"]))

    def outputs(flat):
        p = dict(params, **unravel(flat))
        x, _ = batch
        return (jnp.tanh(x @ p["w"] + p["b"][None, :]) @ p["w2"]).reshape(-1)

    jac = np.asarray(jax.jit(jax.jacfwd(outputs))(flat), np.float64)
    exact = jac.T @ jac * 2.0 / batch[0].shape[0]
    dense = np.asarray(est.to_dense_matrix(state))
    n = flat.size
    np.testing.assert_allclose(dense[:n, :n], exact, rtol=1e-4, atol=1e-5)

    grads = jax.grad(fused_loss)(*args)

    @jax.jit
    def precondition(state, grads):
        state = est.update_cache(state, 1e-3)
        return est.multiply_inverse(state, grads, 1e-3, use_cached=True)

    step = precondition(state, grads)
    for leaf in jax.tree_util.tree_leaves(step):
        assert np.all(np.isfinite(np.asarray(leaf)))
    assert jax.tree_util.tree_structure(step) == jax.tree_util.tree_structure(grads)


def test_custom_pattern_tagged_function_is_unchanged():
    args = fused_args()
    tagged, report = auto_register_tags(
        fused_loss, args, graph_patterns=(fused_pattern(), *DEFAULT_GRAPH_PATTERNS)
    )
    got = jax.jit(jax.value_and_grad(tagged))(*args)
    want = jax.jit(jax.value_and_grad(fused_loss))(*args)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        np.testing.assert_allclose(a, b, **TOL)
    eqns = jax.make_jaxpr(tagged)(*args).jaxpr.eqns
    (eqn,) = [e for e in eqns if e.primitive.name == FUSED_NAME]
    assert eqn.params == dict(dimension_numbers=(((1,), (0,)), ((), ())))


def test_precedence_decides_between_overlapping_patterns():
    """At precedence 0 the fused pattern loses the dot + add to dense_with_bias."""
    args = fused_args()
    _, report = auto_register_tags(
        fused_loss, args, graph_patterns=(fused_pattern(precedence=0), *DEFAULT_GRAPH_PATTERNS)
    )
    assert {e.path: e.source for e in report.entries} == {
        "b": "dense_with_bias",
        "w": "dense_with_bias",
        "w2": "dense",
    }


def test_custom_patterns_can_replace_the_defaults():
    args = fused_args()
    with pytest.warns(UserWarning, match=r"\['w2'\]"):
        _, report = auto_register_tags(fused_loss, args, graph_patterns=(fused_pattern(),))
    assert report.unmatched == ("w2",)
    assert {e.path: e.tag for e in report.entries} == {
        "b": FUSED_NAME,
        "w": FUSED_NAME,
        "w2": "generic_tag",
    }


# ----------------------------------------------------------------------------- y = x @ w * 2 + b

SCALED_NAME = f"my_scaled_affine_tag_{uuid.uuid4().hex[:8]}"


def scaled_compute(inputs, params, *, dimension_numbers):
    (x,) = inputs
    w, b = params
    return (jax.lax.dot_general(x, w, dimension_numbers) * 2.0 + b[None, :],)


SCALED_TAG = kfacx.tags.LayerTag(SCALED_NAME, num_inputs=1, num_outputs=1, compute=scaled_compute)
SCALED = GraphPattern(
    name="scaled_dense",
    tag_primitive=SCALED_TAG,
    compute_func=lambda x, p: x @ p[0] * 2.0 + p[1][None, :],
    parameters_extractor_func=_dot_extractor,
    example_args=[_f32(2, 3), [_f32(3, 4), _f32(4)]],
    precedence=100,
)


def _scaled_loss(factor):
    def loss(p, batch):
        x, t = batch
        return M.squared_loss(x @ p["w"] * factor + p["b"][None, :], t)

    return loss


def _scaled_args():
    rng = np.random.default_rng(1)
    return dict(w=M.normal(rng, 4, 3), b=M.normal(rng, 3)), M.two_layer_batch()


def test_scaled_dense_pattern_matches_and_gets_its_block():
    args = _scaled_args()
    est = kfacx.BlockDiagonalCurvature(
        _scaled_loss(2.0),
        auto_register_kwargs=dict(graph_patterns=(SCALED, *DEFAULT_GRAPH_PATTERNS)),
        layer_tag_to_block_ctor={SCALED_NAME: kfacx.blocks.Full},
    )
    state = est.init(jax.random.PRNGKey(0), args)
    state = est.update_curvature_matrix_estimate(
        state, 0.0, 1.0, None, jax.random.PRNGKey(1), args, estimation_mode="ggn_exact"
    )
    assert {(e.tag, e.source, e.block) for e in est.report.entries} == {
        (SCALED_NAME, "scaled_dense", "Full")
    }
    assert np.all(np.isfinite(np.asarray(est.to_dense_matrix(state))))


def test_structural_match_with_other_constant_is_rejected_numerically():
    """``x @ w * 3 + b`` has the pattern's structure (literals are not compared), but the
    tag's compute (factor 2) disagrees, so the match is rejected and the defaults apply."""
    args = _scaled_args()
    _, report = auto_register_tags(
        _scaled_loss(3.0), args, graph_patterns=(SCALED, *DEFAULT_GRAPH_PATTERNS)
    )
    assert all(e.tag != SCALED_NAME for e in report.entries)
    assert report.unmatched == ()


def test_numerical_check_tells_apart_layers_that_differ_only_in_a_constant():
    """Each distinct layer is checked once and the answer reused for its repeats; two
    layers of equal shapes whose constants differ (2 vs 3) are not the same layer."""
    rng = np.random.default_rng(1)
    params = {k: dict(w=M.normal(rng, 4, 3), b=M.normal(rng, 3)) for k in ("a", "b", "c")}

    def loss(p, batch):
        x, t = batch
        factors = {"a": 2.0, "b": 3.0, "c": 2.0}
        out = sum(x @ p[k]["w"] * f + p[k]["b"][None, :] for k, f in factors.items())
        return M.squared_loss(out, t)

    _, report = auto_register_tags(
        loss, (params, M.two_layer_batch()), graph_patterns=(SCALED, *DEFAULT_GRAPH_PATTERNS)
    )
    tags = {e.path: e.tag for e in report.entries}
    assert tags["a/w"] == tags["c/w"] == SCALED_NAME
    assert tags["b/w"] != SCALED_NAME
    assert report.unmatched == ()


def test_extractor_can_reject_a_match():
    """The extractor only accepts ``x @ w``; ``einsum('bi,oi->bo')`` (x @ w.T) is rejected."""
    pattern = GraphPattern(
        name="plain_dense_only",
        tag_primitive=kfacx.tags.dense,
        compute_func=lambda x, p: jax.lax.dot_general(x, p[0], (((1,), (1,)), ((), ()))),
        parameters_extractor_func=_dot_extractor,
        example_args=[_f32(2, 3), [_f32(4, 3)]],
    )

    def loss(p, batch):
        x, t = batch
        return M.squared_loss(jax.lax.dot_general(x, p["w"], (((1,), (1,)), ((), ()))), t)

    params = dict(w=M.normal(np.random.default_rng(2), 3, 4))
    with pytest.warns(UserWarning, match=r"\['w'\]"):
        _, report = auto_register_tags(
            loss, (params, M.two_layer_batch()), graph_patterns=(pattern,)
        )
    assert report.unmatched == ("w",)


def test_find_matches_on_a_jaxpr():
    args = fused_args()
    closed = jax.make_jaxpr(fused_loss)(*args)
    n = len(jax.tree_util.tree_leaves(args[0]))
    origins = list(range(n)) + [None] * (len(closed.jaxpr.invars) - n)
    claims: dict = {}
    patterns = (fused_pattern(), *DEFAULT_GRAPH_PATTERNS)
    matches = find_matches(closed.jaxpr, origins, patterns, claims)
    # Leaves: b=0, w=1, w2=2; a match lists them in pattern order (w, b); by precedence.
    assert [(m.pattern.name, m.param_leaves) for m in matches] == [
        ("fused_tanh_dense", [1, 0]),
        ("dense", [2]),
    ]
    assert matches[0].meta == dict(dimension_numbers=(((1,), (0,)), ((), ())))
    assert set(claims) == {0, 1, 2}


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "example_args",
    [
        [],
        [_f32(2, 3)],
        [_f32(2, 3), _f32(3, 4)],
        [_f32(2, 3), {"w": _f32(3, 4)}],
    ],
    ids=["empty", "no_params", "params_not_a_list", "params_a_dict"],
)
def test_bad_example_args_raise_value_error(example_args):
    with pytest.raises(ValueError, match="example_args"):
        GraphPattern(
            name="bad",
            tag_primitive=kfacx.tags.dense,
            compute_func=lambda x, p: x @ p[0],
            parameters_extractor_func=_dot_extractor,
            example_args=example_args,
        )


@pytest.mark.parametrize(
    "tag",
    [kfacx.tags.softmax_cross_entropy, "dense_tag", kfacx.tags.dense.primitive],
    ids=["loss_tag", "string", "raw_primitive"],
)
def test_non_layer_tag_primitive_raises_type_error(tag):
    with pytest.raises(TypeError, match="LayerTag"):
        GraphPattern(
            name="bad",
            tag_primitive=tag,
            compute_func=lambda x, p: x @ p[0],
            parameters_extractor_func=_dot_extractor,
            example_args=[_f32(2, 3), [_f32(3, 4)]],
        )


def test_compute_func_with_two_outputs_raises_value_error():
    pattern = GraphPattern(
        name="two_outputs",
        tag_primitive=kfacx.tags.dense,
        compute_func=lambda x, p: (x @ p[0], x),
        parameters_extractor_func=_dot_extractor,
        example_args=[_f32(2, 3), [_f32(3, 4)]],
    )
    with pytest.raises(ValueError, match="one array"):
        _ = pattern.jaxpr
    assert pattern.num_inputs == 1 and pattern.num_params == 1
    assert "two_outputs" in repr(pattern) and "dense_tag" in repr(pattern)
