"""Tests for `kfacx.losses`: values, gradients, curvature products, factors, sampling."""

from __future__ import annotations

import dataclasses
import functools
import math
import uuid
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from kfacx import losses, tags

TOL = dict(rtol=1e-5, atol=1e-5)
NUM_SAMPLES = 20_000


@dataclasses.dataclass(frozen=True, eq=False)
class Case:
    """Arguments of one loss: ``cls(prediction, targets, mask, **kwargs)``."""

    name: str
    cls: type[losses.LossFunction]
    prediction: np.ndarray
    targets: np.ndarray
    mask: np.ndarray | None = None
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)

    def loss(self, prediction=None) -> losses.LossFunction:
        prediction = self.prediction if prediction is None else prediction
        return self.cls(prediction, self.targets, self.mask, **self.kwargs)

    @property
    def batch_size(self) -> int:
        return self.prediction.shape[0]


def _make_cases() -> list[Case]:
    rng = np.random.default_rng(0)

    def normal(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    def uniform(*shape):
        return rng.random(shape).astype(np.float32)

    def soft_labels(*shape):
        return np.asarray(jax.nn.softmax(normal(*shape), axis=-1))

    mask_3x2 = np.array([[1.0, 0.0], [0.5, 1.0], [0.0, 0.25]], np.float32)
    softmax = losses.SoftmaxCrossEntropyLoss
    sigmoid = losses.SigmoidCrossEntropyLoss
    gauss = losses.NormalPredictiveLoss
    return [
        Case("softmax_int", softmax, normal(3, 4), rng.integers(0, 4, (3,)).astype(np.int32)),
        Case(
            "softmax_int_3d_masked",
            softmax,
            normal(3, 2, 4),
            rng.integers(0, 4, (3, 2)).astype(np.int32),
            mask_3x2,
            {"weight": 2.0},
        ),
        Case(
            "softmax_soft_masked",
            softmax,
            normal(3, 4),
            soft_labels(3, 4),
            np.array([1.0, 0.5, 0.0], np.float32),
            {"weight": 0.5},
        ),
        Case(
            "sigmoid_masked",
            sigmoid,
            normal(3, 4),
            uniform(3, 4),
            uniform(3, 4),
            {"weight": 1.5},
        ),
        Case("sigmoid_3d_labels", sigmoid, normal(3, 2, 2), (uniform(3, 2, 2) > 0.5) * 1.0),
        Case(
            "normal_masked",
            gauss,
            normal(3, 4),
            normal(3, 4),
            uniform(3, 4),
            {"weight": 0.5, "variance": 2.0},
        ),
        Case("normal_3d", gauss, normal(3, 2, 2), normal(3, 2, 2), None, {"variance": 1.0}),
    ]


CASES = _make_cases()
case_params = pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)


def _case(name: str) -> Case:
    (case,) = [c for c in CASES if c.name == name]
    return case


# ----------------------------------------------------------------------------- helpers


def _reference_loss(case: Case) -> np.ndarray:
    """``weight * sum(mask * per-term nll) / B`` computed with optax / explicit formulas."""
    pred, targets = jnp.asarray(case.prediction), jnp.asarray(case.targets)
    if case.cls is losses.SoftmaxCrossEntropyLoss:
        if jnp.issubdtype(targets.dtype, jnp.integer):
            terms = optax.softmax_cross_entropy_with_integer_labels(pred, targets)
        else:
            terms = optax.softmax_cross_entropy(pred, targets)
    elif case.cls is losses.SigmoidCrossEntropyLoss:
        terms = optax.sigmoid_binary_cross_entropy(pred, targets)
    else:
        terms = jnp.square(targets - pred) / (2.0 * case.kwargs.get("variance", 0.5))
    if case.mask is not None:
        terms = terms * case.mask
    return case.kwargs.get("weight", 1.0) * jnp.sum(terms) / case.batch_size


def _basis(shape: tuple[int, ...]) -> jax.Array:
    """``[K, *shape]``: the k-th unit vector of every example's ``K`` entries, for all examples."""
    k = math.prod(shape[1:])
    eye = jnp.eye(k, dtype=jnp.float32).reshape((k, 1) + tuple(shape[1:]))
    return jnp.broadcast_to(eye, (k,) + tuple(shape))


def _per_example_matrices(fn, shape: tuple[int, ...]) -> np.ndarray:
    """Dense ``[B, K, K]`` matrices ``M_b`` of a per-example linear map ``fn``."""
    batch, k = shape[0], math.prod(shape[1:])
    columns = jax.vmap(fn)(_basis(shape)).reshape(k, batch, k)  # [k_in, b, k_out]
    return np.asarray(jnp.transpose(columns, (1, 2, 0)))


def _random_like(array: np.ndarray, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(array.shape).astype(np.float32)


# ----------------------------------------------------------------------------- values and gradients


@case_params
def test_evaluate_matches_reference(case):
    value, expected = jax.jit(lambda: (case.loss().evaluate(), _reference_loss(case)))()
    np.testing.assert_allclose(value, expected, **TOL)


@case_params
def test_evaluate_with_explicit_targets(case):
    loss = case.loss()
    other_targets = np.ascontiguousarray(case.targets[::-1])
    other = case.cls(case.prediction, other_targets, case.mask, **case.kwargs)

    @jax.jit
    def values():
        return (
            loss.evaluate(case.targets),
            loss.evaluate(),
            loss.evaluate(other_targets),
            other.evaluate(),
        )

    same, default, explicit, expected = values()
    np.testing.assert_allclose(same, default, **TOL)
    np.testing.assert_allclose(explicit, expected, **TOL)
    assert not np.isclose(explicit, default)  # the explicit targets are actually used


@case_params
def test_batch_size_and_term_shape(case):
    loss = case.loss()
    assert loss.batch_size == case.batch_size
    if case.cls is losses.SoftmaxCrossEntropyLoss:
        assert loss.term_shape == case.prediction.shape[:-1]
    else:
        assert loss.term_shape == case.prediction.shape
    if case.mask is not None:
        assert loss.term_shape == case.mask.shape


def test_mask_zero_drops_terms():
    case = _case("softmax_int_3d_masked")  # softmax, [3, 2, 4], mask with zeros
    keep = case.mask > 0
    loss = case.loss()
    unmasked = losses.SoftmaxCrossEntropyLoss(case.prediction, case.targets, weight=2.0)
    per_term = optax.softmax_cross_entropy_with_integer_labels(case.prediction, case.targets)
    expected = 2.0 * np.sum(np.where(keep, case.mask * per_term, 0.0)) / 3
    np.testing.assert_allclose(loss.evaluate(), expected, **TOL)
    assert float(loss.evaluate()) < float(unmasked.evaluate())
    grad = np.asarray(loss.per_example_gradient())
    np.testing.assert_array_equal(grad[~keep], 0.0)


def test_softmax_int_and_one_hot_targets_agree():
    case = _case("softmax_int_3d_masked")
    one_hot = np.asarray(jax.nn.one_hot(case.targets, 4, dtype=jnp.float32))
    int_loss = case.loss()
    hot_loss = losses.SoftmaxCrossEntropyLoss(case.prediction, one_hot, case.mask, weight=2.0)
    np.testing.assert_allclose(hot_loss.evaluate(), int_loss.evaluate(), **TOL)
    np.testing.assert_allclose(
        hot_loss.per_example_gradient(), int_loss.per_example_gradient(), **TOL
    )
    np.testing.assert_allclose(int_loss.evaluate(one_hot), int_loss.evaluate(), **TOL)


@case_params
def test_per_example_gradient_is_batch_size_times_grad(case):
    grad = jax.jit(jax.grad(lambda p: case.loss(p).evaluate()))(case.prediction)
    np.testing.assert_allclose(
        case.loss().per_example_gradient(), case.batch_size * np.asarray(grad), **TOL
    )


# ----------------------------------------------------------------------------- curvature


@functools.cache
def _hessian_of_evaluate(case: Case) -> np.ndarray:
    """Full Hessian of ``B * evaluate`` w.r.t. the prediction, as ``[N, N]``."""
    n = case.prediction.size
    hess = jax.jit(jax.hessian(lambda p: case.loss(p).evaluate()))(case.prediction)
    return case.batch_size * np.asarray(hess).reshape(n, n)


@case_params
def test_multiply_ggn_is_hessian_vector_product(case):
    hess = _hessian_of_evaluate(case)
    v = _random_like(case.prediction, seed=1)
    expected = (hess @ v.reshape(-1)).reshape(v.shape)
    np.testing.assert_allclose(case.loss().multiply_ggn(v), expected, **TOL)


@case_params
def test_ggn_is_block_diagonal_per_example_hessian(case):
    hess = _hessian_of_evaluate(case)
    ggn = _per_example_matrices(case.loss().multiply_ggn, case.prediction.shape)
    batch, k = ggn.shape[:2]
    expected = np.zeros_like(hess)
    for b in range(batch):
        expected[b * k : (b + 1) * k, b * k : (b + 1) * k] = ggn[b]
    np.testing.assert_allclose(hess, expected, **TOL)


@case_params
def test_fisher_aliases_equal_ggn(case):
    loss, v = case.loss(), _random_like(case.prediction, seed=2)
    np.testing.assert_array_equal(loss.multiply_fisher(v), loss.multiply_ggn(v))
    np.testing.assert_array_equal(loss.multiply_fisher_factor(v), loss.multiply_ggn_factor(v))
    np.testing.assert_array_equal(
        loss.multiply_fisher_factor_transpose(v), loss.multiply_ggn_factor_transpose(v)
    )


@case_params
def test_factor_times_its_transpose_is_ggn(case):
    loss, shape = case.loss(), case.prediction.shape
    ggn = _per_example_matrices(loss.multiply_ggn, shape)
    factor = _per_example_matrices(loss.multiply_ggn_factor, shape)
    factor_t = _per_example_matrices(loss.multiply_ggn_factor_transpose, shape)
    np.testing.assert_allclose(factor_t, np.transpose(factor, (0, 2, 1)), **TOL)
    np.testing.assert_allclose(factor @ np.transpose(factor, (0, 2, 1)), ggn, **TOL)
    # Composition of the two maps as well (S (S^T v) == G v).
    v = _random_like(case.prediction, seed=3)
    composed = loss.multiply_ggn_factor(loss.multiply_ggn_factor_transpose(v))
    np.testing.assert_allclose(composed, loss.multiply_ggn(v), **TOL)


@case_params
def test_factor_transpose_is_adjoint(case):
    loss = case.loss()
    u = _random_like(case.prediction, seed=4)
    v = _random_like(case.prediction, seed=5)
    lhs = jnp.vdot(loss.multiply_ggn_factor(u), v)
    rhs = jnp.vdot(u, loss.multiply_ggn_factor_transpose(v))
    np.testing.assert_allclose(lhs, rhs, **TOL)


@case_params
def test_ggn_factor_columns(case):
    loss, shape = case.loss(), case.prediction.shape
    batch, k = shape[0], math.prod(shape[1:])
    columns = loss.ggn_factor_columns()
    assert columns.shape == (k,) + shape
    columns = np.asarray(columns).reshape(k, batch, k)
    ggn = _per_example_matrices(loss.multiply_ggn, shape)
    np.testing.assert_allclose(np.einsum("kbi,kbj->bij", columns, columns), ggn, **TOL)
    factor = _per_example_matrices(loss.multiply_ggn_factor, shape)
    np.testing.assert_allclose(np.transpose(columns, (1, 2, 0)), factor, **TOL)


@case_params
def test_ggn_is_symmetric_positive_semidefinite(case):
    ggn = _per_example_matrices(case.loss().multiply_ggn, case.prediction.shape)
    np.testing.assert_allclose(ggn, np.transpose(ggn, (0, 2, 1)), **TOL)
    assert np.linalg.eigvalsh(ggn).min() > -1e-5


# ----------------------------------------------------------------------------- sampling


def _keys(n: int, seed: int = 0) -> jax.Array:
    return jax.random.split(jax.random.key(seed), n)


@functools.cache
def _samples(case: Case) -> tuple[np.ndarray, np.ndarray]:
    """``NUM_SAMPLES`` targets and Fisher cotangents (one compilation per case)."""
    loss = case.loss()
    draw = jax.jit(jax.vmap(lambda key: (loss.sample(key), loss.sampled_fisher_cotangent(key))))
    samples, cotangents = draw(_keys(NUM_SAMPLES))
    return np.asarray(samples), np.asarray(cotangents)


#: One case per loss class, each with a mask and a weight.
SAMPLING_CASES = [c for c in CASES if c.mask is not None and c.name != "softmax_soft_masked"]


@pytest.mark.parametrize("case", SAMPLING_CASES, ids=lambda c: c.name)
def test_sampled_fisher_cotangent_outer_product_estimates_ggn(case):
    shape = case.prediction.shape
    batch, k = shape[0], math.prod(shape[1:])
    _, cotangents = _samples(case)
    assert cotangents.shape == (NUM_SAMPLES,) + shape
    cotangents = cotangents.astype(np.float64).reshape(NUM_SAMPLES, batch, k)
    estimate = np.einsum("nbi,nbj->bij", cotangents, cotangents) / NUM_SAMPLES
    ggn = _per_example_matrices(case.loss().multiply_ggn, shape)
    np.testing.assert_allclose(estimate, ggn, atol=0.05 * max(1.0, np.abs(ggn).max()))


def test_softmax_samples_are_labels_with_the_model_probabilities():
    case = _case("softmax_int_3d_masked")  # [3, 2, 4] logits
    samples, _ = _samples(case)
    assert samples.shape == (NUM_SAMPLES, 3, 2)
    assert np.issubdtype(samples.dtype, np.integer)
    assert samples.min() >= 0 and samples.max() < 4
    freq = (samples[..., None] == np.arange(4)).mean(axis=0)
    np.testing.assert_allclose(freq, jax.nn.softmax(case.prediction, axis=-1), atol=0.02)


def test_sigmoid_samples_are_bernoulli_with_the_model_probabilities():
    case = _case("sigmoid_masked")
    samples, _ = _samples(case)
    assert samples.shape == (NUM_SAMPLES,) + case.prediction.shape
    assert samples.dtype == np.float32
    assert set(np.unique(samples)) <= {0.0, 1.0}
    np.testing.assert_allclose(samples.mean(axis=0), jax.nn.sigmoid(case.prediction), atol=0.02)


def test_normal_samples_have_the_model_mean_and_variance():
    case = _case("normal_masked")  # variance 2.0
    samples, _ = _samples(case)
    samples = samples.astype(np.float64)
    assert samples.shape == (NUM_SAMPLES,) + case.prediction.shape
    np.testing.assert_allclose(samples.mean(axis=0), case.prediction, atol=0.05)
    np.testing.assert_allclose(samples.var(axis=0), np.full_like(samples[0], 2.0), rtol=0.05)


def test_sampling_is_deterministic_given_the_key():
    loss = _case("softmax_int").loss()
    key = jax.random.key(7)
    np.testing.assert_array_equal(loss.sample(key), loss.sample(key))
    np.testing.assert_array_equal(
        loss.sampled_fisher_cotangent(key), loss.sampled_fisher_cotangent(key)
    )


# ----------------------------------------------------------------------------- loss_from_tag


def test_loss_from_tag_softmax_with_mask():
    case = _case("softmax_int_3d_masked")
    loss = losses.loss_from_tag(
        tags.softmax_cross_entropy, (case.prediction, case.targets, case.mask), {"weight": 2.0}
    )
    assert type(loss) is losses.SoftmaxCrossEntropyLoss
    assert loss.weight == 2.0 and loss.mask is case.mask and loss.targets is case.targets
    np.testing.assert_allclose(loss.evaluate(), case.loss().evaluate(), **TOL)


def test_loss_from_tag_sigmoid_without_mask():
    case = _case("sigmoid_3d_labels")
    loss = losses.loss_from_tag(
        tags.sigmoid_cross_entropy, (case.prediction, case.targets), {"weight": 1.0}
    )
    assert type(loss) is losses.SigmoidCrossEntropyLoss
    assert loss.mask is None and loss.weight == 1.0


def test_loss_from_tag_normal_reads_variance():
    case = _case("normal_3d")
    loss = losses.loss_from_tag(
        tags.normal_predictive, (case.prediction, case.targets), {"weight": 0.5, "variance": 3.0}
    )
    assert type(loss) is losses.NormalPredictiveLoss
    assert (loss.weight, loss.variance) == (0.5, 3.0)
    np.testing.assert_allclose(
        loss.multiply_ggn(np.ones_like(case.prediction)),
        np.full_like(case.prediction, 0.5 / 3.0),
        **TOL,
    )


@pytest.mark.parametrize(
    "name, register, params",
    [
        (
            "softmax_int_3d_masked",
            lambda p, t, m: tags.register_softmax_cross_entropy_loss(p, t, m, weight=2.0),
            {"weight": 2.0},
        ),
        (
            "sigmoid_3d_labels",
            lambda p, t: tags.register_sigmoid_cross_entropy_loss(p, t, weight=1.5),
            {"weight": 1.5},
        ),
        (
            "normal_3d",
            lambda p, t: tags.register_normal_predictive_distribution(p, t, 2.0, 0.5),
            {"weight": 0.5, "variance": 2.0},
        ),
    ],
    ids=["softmax", "sigmoid", "normal"],
)
def test_loss_from_tag_equation_in_jaxpr(name, register, params):
    """The tag equation's operands and params rebuild the registered loss."""
    case = _case(name)
    args = [case.prediction, case.targets] + ([] if case.mask is None else [case.mask])
    closed = jax.make_jaxpr(register)(*args)
    (eqn,) = [e for e in closed.jaxpr.eqns if tags.loss_tag_for(e.primitive) is not None]
    tag = tags.loss_tag_for(eqn.primitive)
    assert tag.name == case.cls.tag_name
    assert eqn.params == params
    # Here every operand of the tag is an input of the function (no dtype casts).
    env = dict(zip(closed.jaxpr.invars, args, strict=True))
    loss = losses.loss_from_tag(tag, [env[v] for v in eqn.invars], eqn.params)
    assert type(loss) is case.cls
    expected = case.cls(case.prediction, case.targets, case.mask, **params)
    np.testing.assert_allclose(loss.evaluate(), expected.evaluate(), **TOL)
    v = _random_like(case.prediction, seed=6)
    np.testing.assert_allclose(loss.multiply_ggn(v), expected.multiply_ggn(v), **TOL)


def test_loss_from_tag_without_registered_class():
    tag = tags.LossTag(f"unregistered_{uuid.uuid4().hex}")
    case = _case("softmax_int")
    with pytest.raises(ValueError, match="has no LossFunction; register one"):
        losses.loss_from_tag(tag, (case.prediction, case.targets), {"weight": 1.0})


def test_register_loss_class_for_custom_tag():
    class MyGaussianLoss(losses.NormalPredictiveLoss):
        """A user-defined loss class for a user-defined tag."""

    tag = tags.LossTag(f"custom_{uuid.uuid4().hex}")
    losses.register_loss_class(tag, MyGaussianLoss)
    case = _case("normal_3d")
    loss = losses.loss_from_tag(
        tag, (case.prediction, case.targets), {"weight": 1.0, "variance": 0.25}
    )
    assert type(loss) is MyGaussianLoss and loss.variance == 0.25


@pytest.mark.parametrize(
    "bad",
    [object, dict, "SoftmaxCrossEntropyLoss", None, _case("softmax_int").loss()],
    ids=["object", "dict", "str", "none", "instance"],
)
def test_register_loss_class_rejects_non_loss_function(bad):
    tag = tags.LossTag(f"custom_{uuid.uuid4().hex}")
    with pytest.raises(TypeError, match="is not a LossFunction subclass"):
        losses.register_loss_class(tag, bad)
    case = _case("softmax_int")
    with pytest.raises(ValueError, match="has no LossFunction"):
        losses.loss_from_tag(tag, (case.prediction, case.targets), {})


def test_loss_function_is_abstract():
    case = _case("softmax_int")
    with pytest.raises(TypeError):
        losses.LossFunction(case.prediction, case.targets)
