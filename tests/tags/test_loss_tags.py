"""Tests for the loss tags in `kfacx.tags`: identity semantics, jaxpr form, errors."""

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


@dataclasses.dataclass(frozen=True)
class Case:
    """A registered loss: ``register(prediction, targets, *extra)`` returns the prediction."""

    name: str
    tag: tags.LossTag
    make: Callable[[np.random.Generator], tuple]
    register: Callable[..., jax.Array]
    params: dict[str, Any]

    def data(self, seed: int = 0) -> tuple:
        return self.make(np.random.default_rng(seed))


def _normal(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def _labels(rng, shape, num_classes):
    return rng.integers(0, num_classes, shape).astype(np.int32)


def _softmax_int(rng):
    return _normal(rng, 4, 3), _labels(rng, (4,), 3)


def _softmax_int_masked_3d(rng):
    return (
        _normal(rng, 4, 2, 3),
        _labels(rng, (4, 2), 3),
        (rng.random((4, 2)) > 0.3).astype(np.float32),
    )


def _softmax_soft(rng):
    logits = _normal(rng, 4, 3)
    return logits, np.asarray(jax.nn.softmax(_normal(rng, 4, 3), axis=-1))


def _sigmoid_masked(rng):
    return (
        _normal(rng, 4, 3),
        rng.random((4, 3)).astype(np.float32),
        rng.random((4, 3)).astype(np.float32),
    )


def _regression(rng):
    return _normal(rng, 4, 3), _normal(rng, 4, 3)


CASES = [
    Case(
        "softmax_int",
        tags.softmax_cross_entropy,
        _softmax_int,
        tags.register_softmax_cross_entropy_loss,
        {"weight": 1.0},
    ),
    Case(
        "softmax_int_masked_3d",
        tags.softmax_cross_entropy,
        _softmax_int_masked_3d,
        lambda p, t, m: tags.register_softmax_cross_entropy_loss(p, t, m, weight=2.0),
        {"weight": 2.0},
    ),
    Case(
        "softmax_soft",
        tags.softmax_cross_entropy,
        _softmax_soft,
        lambda p, t: tags.register_softmax_cross_entropy_loss(p, t, weight=0.5),
        {"weight": 0.5},
    ),
    Case(
        "sigmoid_masked",
        tags.sigmoid_cross_entropy,
        _sigmoid_masked,
        lambda p, t, m: tags.register_sigmoid_cross_entropy_loss(p, t, m, weight=3.0),
        {"weight": 3.0},
    ),
    Case(
        "normal",
        tags.normal_predictive,
        _regression,
        lambda p, t: tags.register_normal_predictive_distribution(p, t, variance=2.0, weight=0.5),
        {"weight": 0.5, "variance": 2.0},
    ),
    Case(
        "squared_error",
        tags.normal_predictive,
        _regression,
        lambda p, t: tags.register_squared_error_loss(p, t, weight=0.25),
        {"weight": 0.25, "variance": 0.5},
    ),
]
case_params = pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)


def _tag_eqns(jaxpr, tag):
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive is tag.primitive:
            found.append(eqn)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found.extend(_tag_eqns(sub, tag))
    return found


# ----------------------------------------------------------------------------- identity semantics


@case_params
def test_register_returns_prediction_unchanged(case):
    prediction, *rest = case.data()
    out = case.register(prediction, *rest)
    assert out.shape == prediction.shape and out.dtype == prediction.dtype
    np.testing.assert_array_equal(np.asarray(out), prediction)


@case_params
def test_register_under_jit(case):
    prediction, *rest = case.data()
    out = jax.jit(case.register)(prediction, *rest)
    np.testing.assert_array_equal(np.asarray(out), prediction)


@case_params
def test_register_under_grad(case):
    prediction, *rest = case.data()

    def f(p, *rest):
        return jnp.sum(jnp.sin(case.register(p, *rest)))

    grad = jax.grad(f)(prediction, *rest)
    np.testing.assert_allclose(np.asarray(grad), np.cos(prediction), rtol=1e-6, atol=1e-6)
    jit_grad = jax.jit(jax.grad(f))(prediction, *rest)
    np.testing.assert_allclose(np.asarray(jit_grad), np.cos(prediction), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "case", [c for c in CASES if not c.name.startswith("softmax_int")], ids=lambda c: c.name
)
def test_targets_receive_no_gradient_through_the_tag(case):
    prediction, targets, *rest = case.data()

    def f(t):
        return jnp.sum(jnp.sin(case.register(prediction, t, *rest)))

    np.testing.assert_array_equal(np.asarray(jax.grad(f)(targets)), np.zeros_like(targets))


@case_params
def test_register_under_vmap(case):
    stacked = [np.stack(arrays) for arrays in zip(*(case.data(s) for s in range(3)), strict=True)]
    out = jax.vmap(case.register)(*stacked)
    np.testing.assert_array_equal(np.asarray(out), stacked[0])
    out_jit = jax.jit(jax.vmap(case.register))(*stacked)
    np.testing.assert_array_equal(np.asarray(out_jit), stacked[0])


# ----------------------------------------------------------------------------- jaxpr form


@case_params
def test_tag_appears_in_jaxpr_with_params(case):
    data = case.data()
    closed = jax.make_jaxpr(case.register)(*data)
    (eqn,) = _tag_eqns(closed.jaxpr, case.tag)
    assert eqn.primitive.name == case.tag.name
    assert eqn.params == case.params
    assert all(isinstance(v, float) for v in eqn.params.values())
    assert len(eqn.invars) == len(data)  # prediction, targets[, mask]
    assert len(eqn.outvars) == 1
    assert eqn.invars[0] is closed.jaxpr.invars[0]
    assert eqn.invars[1].aval.shape == data[1].shape
    assert tags.loss_tag_for(eqn.primitive) is case.tag
    marked, extra = case.tag.split_operands(eqn.invars)
    assert marked == (eqn.invars[0],) and len(extra) == len(data) - 1


def test_soft_targets_keep_dtype_and_int_targets_stay_integer_in_jaxpr():
    logits = np.zeros((2, 3), np.float32)
    labels = np.array([0, 2], np.int32)
    (eqn,) = _tag_eqns(
        jax.make_jaxpr(tags.register_softmax_cross_entropy_loss)(logits, labels).jaxpr,
        tags.softmax_cross_entropy,
    )
    assert jnp.issubdtype(eqn.invars[1].aval.dtype, jnp.integer)


def test_sigmoid_and_normal_targets_are_cast_to_prediction_dtype():
    logits = np.zeros((2, 3), np.float32)
    int_targets = np.ones((2, 3), np.int32)
    for register, tag in [
        (tags.register_sigmoid_cross_entropy_loss, tags.sigmoid_cross_entropy),
        (tags.register_normal_predictive_distribution, tags.normal_predictive),
    ]:
        (eqn,) = _tag_eqns(jax.make_jaxpr(register)(logits, int_targets).jaxpr, tag)
        assert eqn.invars[1].aval.dtype == jnp.float32


def test_mask_is_cast_to_float_in_jaxpr():
    logits = np.zeros((2, 3), np.float32)
    labels = np.array([0, 2], np.int32)
    mask = np.array([True, False])
    (eqn,) = _tag_eqns(
        jax.make_jaxpr(tags.register_softmax_cross_entropy_loss)(logits, labels, mask).jaxpr,
        tags.softmax_cross_entropy,
    )
    assert jnp.issubdtype(eqn.invars[2].aval.dtype, jnp.floating)


@pytest.mark.parametrize(
    "tag", [tags.softmax_cross_entropy, tags.sigmoid_cross_entropy, tags.normal_predictive]
)
def test_loss_tag_for(tag):
    assert tags.loss_tag_for(tag.primitive) is tag
    assert isinstance(tag, tags.LossTag)
    assert tags.layer_tag_for(tag.primitive) is None


def test_loss_tag_for_unknown_primitive_is_none():
    assert tags.loss_tag_for(jax.lax.add_p) is None
    assert tags.loss_tag_for(tags.dense.primitive) is None


def test_loss_tag_rejects_existing_name():
    with pytest.raises(ValueError, match="A loss tag named 'softmax_cross_entropy_loss_tag'"):
        tags.LossTag("softmax_cross_entropy_loss_tag")


def test_custom_loss_tag_binds_and_returns_prediction():
    tag = tags.LossTag(f"custom_loss_{uuid.uuid4().hex}")
    prediction, targets = _regression(np.random.default_rng(0))
    (out,) = tag.bind(prediction, targets, weight=1.5)
    np.testing.assert_array_equal(np.asarray(out), prediction)
    (eqn,) = _tag_eqns(
        jax.make_jaxpr(lambda p, t: tag.bind(p, t, weight=1.5))(prediction, targets).jaxpr, tag
    )
    assert eqn.params == {"weight": 1.5}
    assert tags.loss_tag_for(tag.primitive) is tag
    with pytest.raises(ValueError, match="exists already"):
        tags.LossTag(tag.name)


# ----------------------------------------------------------------------------- errors


LOGITS = np.zeros((4, 3), np.float32)
SOFTMAX = tags.register_softmax_cross_entropy_loss
SIGMOID = tags.register_sigmoid_cross_entropy_loss
NORMAL = tags.register_normal_predictive_distribution


@pytest.mark.parametrize("shape", [(3,), (4, 1), (4, 3)])
def test_softmax_integer_targets_wrong_shape(shape):
    with pytest.raises(ValueError, match=r"integer targets have shape .*, expected \(4,\)"):
        SOFTMAX(LOGITS, np.zeros(shape, np.int32))


@pytest.mark.parametrize("shape", [(4,), (4, 2), (3, 3)])
def test_softmax_one_hot_targets_wrong_shape(shape):
    with pytest.raises(ValueError, match=r"one-hot/soft targets have shape .*, expected \(4, 3\)"):
        SOFTMAX(LOGITS, np.zeros(shape, np.float32))


@pytest.mark.parametrize(
    "register, targets, mask_shape, expected",
    [
        (SOFTMAX, np.zeros(4, np.int32), (4, 3), r"\(4,\)"),
        (SOFTMAX, np.zeros(4, np.int32), (3,), r"\(4,\)"),
        (SIGMOID, LOGITS, (4,), r"\(4, 3\)"),
        (SIGMOID, LOGITS, (4, 1), r"\(4, 3\)"),
    ],
    ids=["softmax_class_axis", "softmax_batch", "sigmoid_missing_axis", "sigmoid_broadcast"],
)
def test_mask_wrong_shape(register, targets, mask_shape, expected):
    with pytest.raises(ValueError, match=rf"mask has shape .*, expected {expected}"):
        register(LOGITS, targets, np.ones(mask_shape, np.float32))


@pytest.mark.parametrize("shape", [(4,), (4, 2), (4, 3, 1)])
def test_sigmoid_targets_wrong_shape(shape):
    with pytest.raises(ValueError, match=r"targets have shape .*, expected \(4, 3\)"):
        SIGMOID(LOGITS, np.zeros(shape, np.float32))


def test_normal_targets_wrong_shape():
    with pytest.raises(ValueError, match=r"targets have shape \(4,\), expected \(4, 3\)"):
        NORMAL(LOGITS, np.zeros(4, np.float32))
    with pytest.raises(ValueError, match=r"targets have shape \(3, 3\), expected \(4, 3\)"):
        tags.register_squared_error_loss(LOGITS, np.zeros((3, 3), np.float32))


@pytest.mark.parametrize("weight", [0.0, -1.0, float("nan"), float("inf")])
@pytest.mark.parametrize(
    "register, targets",
    [
        (SOFTMAX, np.zeros(4, np.int32)),
        (SIGMOID, LOGITS),
        (NORMAL, LOGITS),
        (tags.register_squared_error_loss, LOGITS),
    ],
    ids=["softmax", "sigmoid", "normal", "squared_error"],
)
def test_non_positive_or_non_finite_weight(register, targets, weight):
    with pytest.raises(ValueError, match="weight must be finite and positive"):
        register(LOGITS, targets, weight=weight)


@pytest.mark.parametrize(
    "register, targets",
    [(SOFTMAX, np.zeros(4, np.int32)), (SIGMOID, LOGITS), (NORMAL, LOGITS)],
    ids=["softmax", "sigmoid", "normal"],
)
def test_traced_weight_is_a_type_error(register, targets):
    @jax.jit
    def f(logits, weight):
        return register(logits, targets, weight=weight)

    with pytest.raises(TypeError, match="weight must be a Python float known at trace time"):
        f(LOGITS, 1.0)


def test_traced_variance_is_a_type_error():
    @jax.jit
    def f(mean, variance):
        return NORMAL(mean, LOGITS, variance=variance)

    with pytest.raises(TypeError, match="variance must be a Python float known at trace time"):
        f(LOGITS, 1.0)


@pytest.mark.parametrize("variance", [0.0, -0.5, float("nan")])
def test_normal_variance_must_be_positive(variance):
    with pytest.raises(ValueError, match="variance must be finite and positive"):
        NORMAL(LOGITS, LOGITS, variance=variance)


@pytest.mark.parametrize(
    "register, targets",
    [
        (SOFTMAX, np.zeros(4, np.int32)),
        (SIGMOID, np.zeros((4, 3), np.int32)),
        (NORMAL, np.zeros((4, 3), np.int32)),
    ],
    ids=["softmax", "sigmoid", "normal"],
)
def test_integer_prediction_is_a_type_error(register, targets):
    with pytest.raises(TypeError, match="the prediction must be floating point, got int32"):
        register(np.zeros((4, 3), np.int32), targets)


@pytest.mark.parametrize(
    "register, prediction, targets",
    [
        (SOFTMAX, np.zeros(3, np.float32), np.zeros((), np.int32)),
        (SIGMOID, np.zeros((), np.float32), np.zeros((), np.float32)),
        (NORMAL, np.zeros((), np.float32), np.zeros((), np.float32)),
    ],
    ids=["softmax_1d", "sigmoid_scalar", "normal_scalar"],
)
def test_prediction_without_batch_axis(register, prediction, targets):
    with pytest.raises(ValueError, match="it needs a leading batch axis"):
        register(prediction, targets)
