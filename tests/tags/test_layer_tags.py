"""Tests for the layer tags in `kfacx.tags`: identity semantics, jaxpr form, errors."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kfacx import tags

TOL = dict(rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------- cases


@dataclasses.dataclass(frozen=True)
class Case:
    """One tagged layer: ``apply(params, x, tagged)`` computes its output."""

    name: str
    tag: tags.LayerTag
    make: Callable[[np.random.Generator], tuple[dict, np.ndarray]]
    apply: Callable[[dict, jax.Array, bool], jax.Array]
    num_operands: int
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)

    def data(self, seed: int = 0) -> tuple[dict, np.ndarray]:
        return self.make(np.random.default_rng(seed))


def _normal(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def _trailing(v: jax.Array, ndim: int) -> jax.Array:
    """Reshapes a vector so that it broadcasts against the last axis (explicit ranks)."""
    return v.reshape((1,) * (ndim - 1) + (-1,))


# -- dense


def _dense_case(x_shape: tuple[int, ...], d_out: int, bias: bool) -> Case:
    def make(rng):
        params = {"w": _normal(rng, x_shape[-1], d_out)}
        if bias:
            params["b"] = _normal(rng, d_out)
        return params, _normal(rng, *x_shape)

    def apply(params, x, tagged):
        y = x @ params["w"]
        b = params.get("b")
        if b is not None:
            y = y + _trailing(b, y.ndim)
        return tags.register_dense(y, x, params["w"], b) if tagged else y

    name = f"dense_x{len(x_shape)}d_{'bias' if bias else 'nobias'}"
    meta = dict(dimension_numbers=(((len(x_shape) - 1,), (0,)), ((), ())))
    return Case(name, tags.dense, make, apply, num_operands=4 if bias else 3, meta=meta)


def _einsum_case(spec: str, x_shape, w_shape, dnums, bias: bool) -> Case:
    """Multi-axis contractions (attention projections) and transposed weights."""
    out_axes = tuple(d for i, d in enumerate(w_shape) if i not in dnums[0][1])

    def make(rng):
        params = {"w": _normal(rng, *w_shape)}
        if bias:
            params["b"] = _normal(rng, *out_axes)
        return params, _normal(rng, *x_shape)

    def apply(params, x, tagged):
        y = jnp.einsum(spec, x, params["w"])
        b = params.get("b")
        if b is not None:
            y = y + jnp.broadcast_to(b, y.shape)
        return tags.register_dense(y, x, params["w"], b, dimension_numbers=dnums) if tagged else y

    spec_name = spec.replace(",", "_").replace("->", "_to_")
    name = f"dense_einsum_{spec_name}_{'bias' if bias else 'nobias'}"
    return Case(
        name,
        tags.dense,
        make,
        apply,
        num_operands=4 if bias else 3,
        meta=dict(dimension_numbers=dnums),
    )


DENSE_CASES = [
    _dense_case((4, 3), 2, bias=False),
    _dense_case((4, 3), 2, bias=True),
    _dense_case((2, 3, 4), 5, bias=False),
    _dense_case((2, 3, 4), 5, bias=True),
    _einsum_case("btd,dhk->bthk", (2, 3, 4), (4, 2, 3), (((2,), (0,)), ((), ())), bias=True),
    _einsum_case(
        "bthk,hko->bto", (2, 3, 2, 3), (2, 3, 4), (((2, 3), (0, 1)), ((), ())), bias=False
    ),
    _einsum_case("bd,od->bo", (4, 3), (5, 3), (((1,), (1,)), ((), ())), bias=True),
]


# -- conv


def _conv_case(
    name: str,
    x_shape: tuple[int, ...],
    w_shape: tuple[int, ...],
    bias: bool,
    expected_padding: tuple[tuple[int, int], ...],
    **kw: Any,
) -> Case:
    kw.setdefault("window_strides", (1,) * (len(x_shape) - 2))
    dnums = jax.lax.conv_dimension_numbers(x_shape, w_shape, kw.get("dimension_numbers"))
    out_features = w_shape[dnums.rhs_spec[0]]

    def make(rng):
        params = {"w": _normal(rng, *w_shape)}
        if bias:
            params["b"] = _normal(rng, out_features)
        return params, _normal(rng, *x_shape)

    def apply(params, x, tagged):
        y = jax.lax.conv_general_dilated(x, params["w"], **kw)
        b = params.get("b")
        if b is not None:
            shape = [1] * y.ndim
            shape[dnums.out_spec[1]] = -1
            y = y + b.reshape(shape)
        return tags.register_conv(y, x, params["w"], b, **kw) if tagged else y

    n = len(x_shape) - 2
    meta = dict(
        window_strides=tuple(kw["window_strides"]),
        padding=expected_padding,
        lhs_dilation=tuple(kw.get("lhs_dilation", (1,) * n)),
        rhs_dilation=tuple(kw.get("rhs_dilation", (1,) * n)),
        dimension_numbers=dnums,
        feature_group_count=kw.get("feature_group_count", 1),
    )
    return Case(name, tags.conv, make, apply, num_operands=4 if bias else 3, meta=meta)


CONV_CASES = [
    # 1-D, default layout (NCH / OIH), stride 2, SAME: out 5, total pad (5-1)*2+3-9 = 2.
    _conv_case(
        "conv1d_default_same_stride",
        (2, 3, 9),
        (4, 3, 3),
        bias=True,
        expected_padding=((1, 1),),
        window_strides=(2,),
        padding="SAME",
    ),
    _conv_case(
        "conv1d_nwc_explicit_rhs_dilation",
        (2, 10, 3),
        (3, 3, 4),
        bias=False,
        expected_padding=((2, 1),),
        padding=((2, 1),),
        rhs_dilation=(2,),
        dimension_numbers=("NWC", "WIO", "NWC"),
    ),
    _conv_case(
        "conv2d_default_explicit_lhs_dilation",
        (2, 3, 5, 5),
        (4, 3, 3, 3),
        bias=True,
        expected_padding=((1, 0), (2, 1)),
        padding=((1, 0), (2, 1)),
        lhs_dilation=(2, 1),
    ),
    # Grouped, NHWC, SAME with a 3-wide window dilated by (2, 1): windows 5 and 3,
    # stride 1 -> total pads 4 and 2.
    _conv_case(
        "conv2d_nhwc_grouped_same_rhs_dilation",
        (2, 5, 5, 4),
        (3, 3, 2, 6),
        bias=True,
        expected_padding=((2, 2), (1, 1)),
        padding="SAME",
        rhs_dilation=(2, 1),
        feature_group_count=2,
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
    ),
    # Depthwise, NHWC, stride 2, SAME on size 6 with a 3-wide window: out 3,
    # total pad (3-1)*2+3-6 = 1 -> (0, 1).
    _conv_case(
        "conv2d_nhwc_depthwise_same_stride",
        (2, 6, 6, 3),
        (3, 3, 1, 6),
        bias=False,
        expected_padding=((0, 1), (0, 1)),
        window_strides=(2, 2),
        padding="SAME",
        feature_group_count=3,
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
    ),
    # 3-D NDHWC, strides (1, 2, 1), SAME with 2-wide windows on size 4:
    # stride 1 -> total pad 1 -> (0, 1); stride 2 -> out 2, total pad (2-1)*2+2-4 = 0.
    _conv_case(
        "conv3d_ndhwc_same",
        (2, 4, 4, 4, 2),
        (2, 2, 2, 2, 3),
        bias=True,
        expected_padding=((0, 1), (0, 0), (0, 1)),
        window_strides=(1, 2, 1),
        padding="SAME",
        dimension_numbers=("NDHWC", "DHWIO", "NDHWC"),
    ),
    _conv_case(
        "conv3d_default_valid",
        (1, 2, 4, 4, 4),
        (3, 2, 2, 2, 2),
        bias=False,
        expected_padding=((0, 0), (0, 0), (0, 0)),
        padding="VALID",
    ),
]


# -- scale and shift


def _scale_and_shift_case(
    name: str,
    x_shape: tuple[int, ...],
    p_shape: tuple[int, ...],
    scale: bool,
    shift: bool,
    offset: float = 0.0,
) -> Case:
    def make(rng):
        params = {}
        if scale:
            params["scale"] = _normal(rng, *p_shape)
        if shift:
            params["shift"] = _normal(rng, *p_shape)
        return params, _normal(rng, *x_shape)

    def apply(params, x, tagged):
        y = x
        if scale:
            y = y * jnp.broadcast_to(offset + params["scale"], x.shape)
        if shift:
            y = y + jnp.broadcast_to(params["shift"], x.shape)
        if not tagged:
            return y
        return tags.register_scale_and_shift(
            y, x, params.get("scale"), params.get("shift"), scale_offset=offset
        )

    meta = dict(has_scale=scale, has_shift=shift)
    if offset:
        meta["scale_offset"] = offset
    return Case(name, tags.scale_and_shift, make, apply, 2 + scale + shift, meta)


SCALE_AND_SHIFT_CASES = [
    _scale_and_shift_case("scale_only", (4, 5), (5,), scale=True, shift=False),
    _scale_and_shift_case("shift_only", (4, 5), (5,), scale=False, shift=True),
    _scale_and_shift_case("scale_and_shift", (4, 5), (5,), scale=True, shift=True),
    _scale_and_shift_case("scale_and_shift_nhwc_vec", (2, 3, 3, 4), (4,), True, True),
    _scale_and_shift_case("scale_and_shift_haiku_bn", (2, 3, 3, 4), (1, 1, 1, 4), True, True),
    _scale_and_shift_case("offset_scale", (4, 5), (5,), True, False, offset=1.0),
    _scale_and_shift_case("offset_scale_and_shift", (2, 3, 4), (4,), True, True, offset=1.0),
]


# -- generic


def _generic_make(rng):
    return {"w": _normal(rng, 3, 4)}, _normal(rng, 5, 3)


def _generic_apply(params, x, tagged):
    w = tags.register_generic(params["w"]) if tagged else params["w"]
    return jnp.tanh(x @ w)


GENERIC_CASES = [Case("generic", tags.generic, _generic_make, _generic_apply, num_operands=2)]

ALL_CASES = DENSE_CASES + CONV_CASES + SCALE_AND_SHIFT_CASES + GENERIC_CASES
case_params = pytest.mark.parametrize("case", ALL_CASES, ids=lambda c: c.name)


def _case(name: str) -> Case:
    (case,) = [c for c in ALL_CASES if c.name == name]
    return case


# Every register_* function, and convolutions of each dimensionality, under every
# transformation; the other convolution variants (which differ only in static
# metadata) are checked eagerly and under jit. This keeps the suite fast.
TRANSFORM_CASES = [
    c
    for c in ALL_CASES
    if c.tag is not tags.conv
    or c.name
    in ("conv1d_default_same_stride", "conv2d_nhwc_grouped_same_rhs_dilation", "conv3d_ndhwc_same")
]
transform_case_params = pytest.mark.parametrize("case", TRANSFORM_CASES, ids=lambda c: c.name)


# ----------------------------------------------------------------------------- helpers


def _fns(case: Case):
    """(untagged, tagged) output functions and scalar losses of ``(params, x)``."""

    def out(tagged):
        return lambda params, x: case.apply(params, x, tagged)

    def loss(tagged):
        return lambda params, x: jnp.sum(jnp.sin(case.apply(params, x, tagged)))

    return (out(False), out(True)), (loss(False), loss(True))


def _value_and_grads(case: Case):
    """(untagged, tagged) functions ``(params, x) -> (y, (d loss/d params, d loss/d x))``."""
    (f, f_tag), (loss, loss_tag) = _fns(case)

    def both(out_fn, loss_fn):
        return lambda p, x: (out_fn(p, x), jax.grad(loss_fn, argnums=(0, 1))(p, x))

    return both(f, loss), both(f_tag, loss_tag)


def _assert_tree_close(a, b, **tol):
    tol = tol or TOL
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert u.shape == v.shape and u.dtype == v.dtype
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), **tol)


def _tag_eqns(jaxpr: jax.extend.core.Jaxpr, tag: tags.LayerTag) -> list:
    """All equations binding ``tag``'s primitive, searching sub-jaxprs too."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive is tag.primitive:
            found.append(eqn)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found.extend(_tag_eqns(sub, tag))
    return found


#: The order in which each tag receives the case's parameters.
_PARAM_ORDER = {
    "dense_tag": ("w", "b"),
    "conv_tag": ("w", "b"),
    "scale_and_shift_tag": ("scale", "shift"),
    "generic_tag": ("w",),
}


def _stack(case: Case, n: int) -> tuple[dict, np.ndarray]:
    params, _ = case.data(0)
    xs = np.stack([case.data(seed)[1] for seed in range(1, n + 1)])
    return params, xs


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


# ----------------------------------------------------------------------------- errors


def _dense_data():
    rng = np.random.default_rng(0)
    return _normal(rng, 4, 3), _normal(rng, 3, 2), _normal(rng, 2)


def test_register_dense_accepts_multi_axis_weight_and_rejects_batch_dims():
    x, _, _ = _dense_data()
    w = np.ones((3, 2, 2), np.float32)
    y = tags.register_dense(np.ones((4, 2, 2), np.float32), x, w)
    assert y.shape == (4, 2, 2)
    with pytest.raises(ValueError, match=r"register_dense: .*has batch dimensions"):
        tags.register_dense(
            np.ones((4, 2), np.float32), x, w, dimension_numbers=(((1,), (0,)), ((0,), (1,)))
        )


def test_register_dense_rejects_mismatched_x():
    x, _, _ = _dense_data()
    with pytest.raises(
        ValueError,
        match=r"register_dense: cannot contract axes \(1,\) of x \(4, 3\) with axes \(0,\)",
    ):
        tags.register_dense(np.ones((4, 2), np.float32), x, np.ones((5, 2), np.float32))


def test_register_dense_rejects_wrong_y_shape():
    x, w, _ = _dense_data()
    with pytest.raises(
        ValueError, match=r"register_dense: y has shape \(4, 3\), expected \(4, 2\)"
    ):
        tags.register_dense(np.ones((4, 3), np.float32), x, w)


def test_register_dense_rejects_wrong_bias():
    x, w, _ = _dense_data()
    with pytest.raises(ValueError, match=r"register_dense: b has shape \(3,\), expected \(2,\)"):
        tags.register_dense(x @ w, x, w, np.ones((3,), np.float32))
    with pytest.raises(ValueError, match=r"register_dense: b has shape \(2, 2\)"):
        tags.register_dense(x @ w, x, w, np.ones((2, 2), np.float32))
    # Leading axes of size 1 are allowed: a [1, d_out] row is the same bias.
    assert tags.register_dense(x @ w, x, w, np.ones((1, 2), np.float32)).shape == (4, 2)


def _conv_data():
    rng = np.random.default_rng(0)
    x, w = _normal(rng, 2, 3, 6, 6), _normal(rng, 4, 3, 3, 3)
    return x, w, jax.lax.conv_general_dilated(x, w, (1, 1), "VALID")


def test_register_conv_rejects_wrong_y_shape():
    x, w, y = _conv_data()
    with pytest.raises(ValueError, match=r"register_conv: y has shape \(2, 4, 4, 4\), expected"):
        tags.register_conv(y, x, w, padding="VALID", window_strides=(2, 2))


def test_register_conv_rejects_batch_group_count():
    x, w, y = _conv_data()
    with pytest.raises(ValueError, match="batch_group_count=2 is not supported"):
        tags.register_conv(y, x, w, padding="VALID", batch_group_count=2)


@pytest.mark.parametrize("arg", ["window_strides", "lhs_dilation", "rhs_dilation"])
def test_register_conv_rejects_wrong_length_strides(arg):
    x, w, y = _conv_data()
    with pytest.raises(ValueError, match=rf"{arg}=\(1, 1, 1\) must have 2 entries"):
        tags.register_conv(y, x, w, padding="VALID", **{arg: (1, 1, 1)})


def test_register_conv_rejects_wrong_length_padding():
    x, w, y = _conv_data()
    with pytest.raises(ValueError, match=r"padding=\(\(0, 0\),\) must have 2"):
        tags.register_conv(y, x, w, padding=((0, 0),))


def test_register_conv_rejects_wrong_bias_and_rank():
    x, w, y = _conv_data()
    with pytest.raises(ValueError, match=r"register_conv: b has shape \(3,\), expected \(4,\)"):
        tags.register_conv(y, x, w, np.ones((3,), np.float32), padding="VALID")
    with pytest.raises(ValueError, match="needs both of rank n\\+2"):
        tags.register_conv(y, x, w[0], padding="VALID")


def test_register_conv2d_rejects_non_4d_kernel():
    rng = np.random.default_rng(0)
    x, w = _normal(rng, 2, 3, 9), _normal(rng, 4, 3, 3)
    y = jax.lax.conv_general_dilated(x, w, (1,), "VALID")
    with pytest.raises(ValueError, match="register_conv2d: w has shape .* a 4-D kernel"):
        tags.register_conv2d(y, x, w, padding="VALID")


def test_register_scale_and_shift_needs_scale_or_shift():
    x = np.ones((4, 5), np.float32)
    with pytest.raises(ValueError, match="give at least one of scale and shift"):
        tags.register_scale_and_shift(x, x)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(scale_offset=np.float32(1.0)), TypeError, "scale_offset must be a Python number"),
        (dict(scale_offset=True), TypeError, "scale_offset must be a Python number"),
        (dict(scale_offset=float("nan")), ValueError, "scale_offset=nan needs a finite value"),
        (dict(scale_offset=1.0, scale=None), ValueError, "needs a finite value and a scale"),
    ],
)
def test_register_scale_and_shift_rejects_bad_scale_offset(kwargs, error, match):
    x = np.ones((4, 5), np.float32)
    args = {"scale": np.ones((5,), np.float32), "shift": np.ones((5,), np.float32), **kwargs}
    with pytest.raises(error, match=match):
        tags.register_scale_and_shift(x, x, **args)


@pytest.mark.parametrize("what", ["scale", "shift"])
def test_register_scale_and_shift_rejects_batch_axis_in_param(what):
    x = np.ones((4, 5), np.float32)
    p = np.ones((4, 5), np.float32)
    with pytest.raises(ValueError, match=rf"register_scale_and_shift: {what} has shape \(4, 5\)"):
        tags.register_scale_and_shift(x, x, **{what: p})


def test_register_scale_and_shift_rejects_non_broadcasting_param():
    x = np.ones((4, 5), np.float32)
    with pytest.raises(ValueError, match=r"scale has shape \(3,\)"):
        tags.register_scale_and_shift(x, x, scale=np.ones((3,), np.float32))


def test_register_scale_and_shift_rejects_wrong_y_shape():
    x = np.ones((4, 5), np.float32)
    with pytest.raises(ValueError, match=r"y has shape \(4, 1\), expected \(4, 5\)"):
        tags.register_scale_and_shift(x[:, :1], x, scale=np.ones((5,), np.float32))


@pytest.mark.parametrize("name", ["dense_tag", "conv_tag", "scale_and_shift_tag", "generic_tag"])
def test_layer_tag_rejects_existing_name(name):
    with pytest.raises(ValueError, match=f"A layer tag named '{name}' exists already"):
        tags.LayerTag(name, num_inputs=1, num_outputs=1)


def test_layer_tag_rejects_invalid_counts_and_name():
    name = f"bad_tag_{uuid.uuid4().hex}"
    with pytest.raises(ValueError, match="num_inputs must be >= 0"):
        tags.LayerTag(name, num_inputs=-1, num_outputs=1)
    with pytest.raises(ValueError, match="must mark at least one array"):
        tags.LayerTag(name, num_inputs=1, num_outputs=0)
    with pytest.raises(TypeError, match="non-empty string name"):
        tags.LayerTag("", num_inputs=1, num_outputs=1)


def test_bind_with_too_few_operands():
    tag = tags.LayerTag(f"custom_{uuid.uuid4().hex}", num_inputs=1, num_outputs=2)
    with pytest.raises(ValueError, match="needs at least 2 operands, got 1"):
        tag.bind(np.ones(3, np.float32))


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
