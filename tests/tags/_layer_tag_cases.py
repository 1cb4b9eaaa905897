"""Cases of the layer-tag tests (tests/tags/test_layer_tag*.py): one `Case` per tag and
layer form (dense, einsum, conv, scale-and-shift, generic) with its data, and helpers
that apply a case with and without its tag.
"""

from __future__ import annotations

import dataclasses
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
