"""Tests for the layer tags in `kfacx.tags`: identity semantics (values and derivatives
under every transformation), jaxpr form, splitting and lookup, custom tags.

Bad input is tested in tests/tags/test_layer_tag_errors.py; the cases live in
tests/tags/_layer_tag_cases.py.
"""

from __future__ import annotations

import uuid

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kfacx import tags

from ._layer_tag_cases import (
    _PARAM_ORDER,
    ALL_CASES,
    _assert_tree_close,
    _case,
    _fns,
    _normal,
    _stack,
    _tag_eqns,
    _value_and_grads,
    case_params,
    transform_case_params,
)

# ----------------------------------------------------------------------------- identity semantics


@case_params
def test_tagged_value_matches_untagged(case):
    params, x = case.data()
    (f, f_tag), _ = _fns(case)
    y, y_tag = f(params, x), f_tag(params, x)
    assert y_tag.shape == y.shape and y_tag.dtype == y.dtype
    np.testing.assert_array_equal(np.asarray(y_tag), np.asarray(y))


#: One case per tag for the (slow, op-by-op) eager gradient check; all cases are
#: differentiated under jit below.
EAGER_GRAD_CASES = [
    "dense_x3d_bias",
    "conv2d_nhwc_grouped_same_rhs_dilation",
    "scale_and_shift_haiku_bn",
    "generic",
]


@pytest.mark.parametrize("name", EAGER_GRAD_CASES)
def test_tagged_grads_match_untagged(name):
    case = _case(name)
    params, x = case.data()
    _, (loss, loss_tag) = _fns(case)
    grad = jax.grad(loss, argnums=(0, 1))
    _assert_tree_close(jax.grad(loss_tag, argnums=(0, 1))(params, x), grad(params, x))


# The transformed tests evaluate the untagged and the tagged function in one
# compiled program (one compilation per test keeps the suite fast); the tag is
# still traced, batched, differentiated and lowered through its own rules.


def _both(fn, fn_tag):
    return lambda p, x: (fn(p, x), fn_tag(p, x))


@case_params
def test_tagged_matches_untagged_under_jit(case):
    params, x = case.data()
    expected, got = jax.jit(_both(*_value_and_grads(case)))(params, x)
    _assert_tree_close(got, expected)


@transform_case_params
def test_tagged_matches_untagged_under_vmap(case):
    params, xs = _stack(case, 3)
    batched = jax.vmap(_both(*_value_and_grads(case)), in_axes=(None, 0))
    expected, got = jax.jit(batched)(params, xs)
    _assert_tree_close(got, expected)


@transform_case_params
def test_tagged_matches_untagged_under_pmap(case):
    assert jax.local_device_count() == 4
    params, xs = _stack(case, 4)
    expected, got = jax.pmap(_both(*_value_and_grads(case)), in_axes=(None, 0))(params, xs)
    _assert_tree_close(got, expected)


@transform_case_params
def test_tagged_matches_untagged_under_hessian(case):
    """Forward-over-reverse: ``jax.hessian`` is ``jacfwd(jacrev(loss))``."""
    params, x = case.data()
    _, (loss, loss_tag) = _fns(case)
    expected, got = jax.jit(_both(jax.hessian(loss), jax.hessian(loss_tag)))(params, x)
    _assert_tree_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "case",
    [_case("dense_x3d_bias"), _case("conv1d_default_same_stride"), _case("generic")],
    ids=lambda c: c.name,
)
def test_tagged_matches_untagged_under_jacfwd(case):
    """Forward mode: Jacobian of the layer output w.r.t. parameters and inputs."""
    params, x = case.data()
    (f, f_tag), _ = _fns(case)
    jac, jac_tag = (jax.jacfwd(fn, argnums=(0, 1)) for fn in (f, f_tag))
    expected, got = jax.jit(_both(jac, jac_tag))(params, x)
    _assert_tree_close(got, expected)


def test_tagged_matches_untagged_under_eager_vmap():
    """One case with vmap outside of jit (op-by-op evaluation of the batched tag)."""
    case = _case("dense_x3d_bias")
    params, xs = _stack(case, 3)
    fn, fn_tag = _value_and_grads(case)
    expected = jax.vmap(fn, in_axes=(None, 0))(params, xs)
    _assert_tree_close(jax.vmap(fn_tag, in_axes=(None, 0))(params, xs), expected)


# ----------------------------------------------------------------------------- jaxpr form


@case_params
def test_tag_appears_in_jaxpr(case):
    params, x = case.data()
    (_, f_tag), _ = _fns(case)
    closed = jax.make_jaxpr(f_tag)(params, x)
    (eqn,) = _tag_eqns(closed.jaxpr, case.tag)
    assert eqn.primitive.name == case.tag.name
    assert len(eqn.invars) == case.num_operands
    assert len(eqn.outvars) == case.tag.num_outputs == 1
    assert eqn.params == case.meta
    assert tags.layer_tag_for(eqn.primitive) is case.tag

    outputs, inputs, tag_params = case.tag.split(eqn.invars)
    assert len(outputs) == 1 and outputs[0].aval.shape == eqn.outvars[0].aval.shape
    # The tagged inputs and parameters are the function's own input variables
    # (make_jaxpr flattens the params dict in sorted-key order, x comes last).
    var_of = dict(zip([*sorted(params), "x"], closed.jaxpr.invars, strict=True))
    expected_params = tuple(var_of[k] for k in _PARAM_ORDER[case.tag.name] if k in params)
    assert tag_params == expected_params
    assert inputs == (() if case.tag is tags.generic else (var_of["x"],))


@pytest.mark.parametrize(
    "case", [c for c in ALL_CASES if c.tag.compute is not None], ids=lambda c: c.name
)
def test_tag_params_reproduce_layer_with_compute(case):
    params, x = case.data()
    (f, f_tag), _ = _fns(case)
    (eqn,) = _tag_eqns(jax.make_jaxpr(f_tag)(params, x).jaxpr, case.tag)
    ordered = _PARAM_ORDER[case.tag.name]
    tag_params = tuple(jnp.asarray(params[k]) for k in ordered if k in params)
    (y,) = case.tag.compute((jnp.asarray(x),), tag_params, **eqn.params)
    np.testing.assert_allclose(np.asarray(y), np.asarray(f(params, x)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("transform", ["vmap", "grad", "jit"])
def test_tag_survives_transformations_in_jaxpr(transform):
    case = _case("dense_x2d_bias")
    params, xs = _stack(case, 2)
    (_, f_tag), (_, loss_tag) = _fns(case)
    if transform == "vmap":
        fn, args = jax.vmap(f_tag, in_axes=(None, 0)), (params, xs)
    elif transform == "grad":
        fn, args = jax.grad(loss_tag), (params, xs[0])
    else:
        fn, args = jax.jit(f_tag), (params, xs[0])
    assert len(_tag_eqns(jax.make_jaxpr(fn)(*args).jaxpr, tags.dense)) == 1


def test_conv_padding_in_jaxpr_is_explicit_pairs():
    case = _case("conv2d_nhwc_depthwise_same_stride")
    params, x = case.data()
    (_, f_tag), _ = _fns(case)
    (eqn,) = _tag_eqns(jax.make_jaxpr(f_tag)(params, x).jaxpr, tags.conv)
    padding = eqn.params["padding"]
    assert isinstance(padding, tuple)
    assert all(isinstance(p, tuple) and len(p) == 2 for p in padding)
    assert all(isinstance(v, int) for p in padding for v in p)
    assert isinstance(eqn.params["dimension_numbers"], jax.lax.ConvDimensionNumbers)


def test_register_conv2d_matches_register_conv():
    case = _case("conv2d_nhwc_depthwise_same_stride")
    params, x = case.data()
    kw = dict(
        window_strides=(2, 2),
        padding="SAME",
        feature_group_count=3,
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
    )
    y = jax.lax.conv_general_dilated(x, params["w"], **kw)

    def tagged(w):
        return tags.register_conv2d(y, x, w, **kw)

    (eqn,) = _tag_eqns(jax.make_jaxpr(tagged)(params["w"]).jaxpr, tags.conv)
    assert eqn.params == {**case.meta}
    np.testing.assert_array_equal(np.asarray(tagged(params["w"])), np.asarray(y))


# ----------------------------------------------------------------------------- split / lookup


@pytest.mark.parametrize(
    "tag, operands, expected",
    [
        (tags.dense, ("y", "x", "w", "b"), (("y",), ("x",), ("w", "b"))),
        (tags.dense, ("y", "x", "w"), (("y",), ("x",), ("w",))),
        (tags.conv, ("y", "x", "w", "b"), (("y",), ("x",), ("w", "b"))),
        (tags.scale_and_shift, ("y", "x", "s"), (("y",), ("x",), ("s",))),
        (tags.generic, ("p", "p"), (("p",), (), ("p",))),
    ],
    ids=["dense_bias", "dense", "conv", "scale_and_shift", "generic"],
)
def test_split(tag, operands, expected):
    assert tag.split(operands) == expected
    assert tag.split(list(operands)) == expected


@pytest.mark.parametrize(
    "tag",
    [tags.dense, tags.conv, tags.scale_and_shift, tags.generic],
    ids=lambda t: t.name,
)
def test_layer_tag_for(tag):
    assert tags.layer_tag_for(tag.primitive) is tag
    assert isinstance(tag, tags.LayerTag)


def test_layer_tag_for_unknown_primitive_is_none():
    assert tags.layer_tag_for(jax.lax.add_p) is None
    assert tags.layer_tag_for(tags.softmax_cross_entropy.primitive) is None


def test_builtin_tag_names_and_counts():
    assert (tags.dense.name, tags.dense.num_inputs, tags.dense.num_outputs) == ("dense_tag", 1, 1)
    assert (tags.conv.name, tags.conv.num_inputs) == ("conv_tag", 1)
    assert tags.scale_and_shift.name == "scale_and_shift_tag"
    assert (tags.generic.name, tags.generic.num_inputs) == ("generic_tag", 0)
    assert tags.generic.compute is None


# ----------------------------------------------------------------------------- custom tags


def _custom_tag(**kw) -> tags.LayerTag:
    return tags.LayerTag(f"custom_{uuid.uuid4().hex}", **kw)


def test_custom_layer_tag_binds_and_returns_outputs():
    tag = _custom_tag(num_inputs=2, num_outputs=2)
    rng = np.random.default_rng(0)
    y1, y2, x1, x2, p = (_normal(rng, 3, 2) for _ in range(5))
    out = tag.bind(y1, y2, x1, x2, p, scale=2)
    assert isinstance(out, list) and len(out) == 2
    np.testing.assert_array_equal(np.asarray(out[0]), y1)
    np.testing.assert_array_equal(np.asarray(out[1]), y2)
    assert tags.layer_tag_for(tag.primitive) is tag
    assert tag.split((y1, y2, x1, x2, p)) == ((y1, y2), (x1, x2), (p,))
    assert (tag.num_inputs, tag.num_outputs) == (2, 2)


def test_custom_layer_tag_in_jaxpr_and_differentiable():
    tag = _custom_tag(num_inputs=1, num_outputs=1)
    rng = np.random.default_rng(0)
    w, x = _normal(rng, 3, 2), _normal(rng, 4, 3)

    def f(w, x):
        (y,) = tag.bind(x @ w, x, w, kind="mine")
        return jnp.sum(jnp.sin(y))

    def g(w, x):
        return jnp.sum(jnp.sin(x @ w))

    (eqn,) = _tag_eqns(jax.make_jaxpr(f)(w, x).jaxpr, tag)
    assert eqn.params == {"kind": "mine"} and len(eqn.invars) == 3
    _assert_tree_close(jax.grad(f, argnums=(0, 1))(w, x), jax.grad(g, argnums=(0, 1))(w, x))
    hessians = jax.jit(lambda w, x: (jax.hessian(f)(w, x), jax.hessian(g)(w, x)))
    _assert_tree_close(*hessians(w, x), rtol=1e-5, atol=1e-5)


def test_custom_layer_tag_name_must_be_unique():
    tag = _custom_tag(num_inputs=1, num_outputs=1)
    with pytest.raises(ValueError, match="exists already"):
        tags.LayerTag(tag.name, num_inputs=1, num_outputs=1)
    assert repr(tag) == f"LayerTag({tag.name!r})"
