"""`DenseTNT` and `ConvTNT` against the definition of TNT, in float64.

The reference never uses the blocks' statistics code: the gradient matrix of
every row (one example at one position) and sample, ``G[s, r] = x_r dy[s, r]^T``,
is the parameter gradient (`jax.vjp` of the layer) for the cotangent ``dy[s]``
kept at that row's output position only, in the block's matrix layout
(`params_to_matrix`, checked by test_conv_statistics.py and test_blocks.py). Then

``L = sum_{s, r} G G^T / B``, ``R = sum_{s, r} G^T G / B`` and the curvature is
``L (x) R / tr L`` per feature group, whose trace is ``sum_{s, r} ||G||_F^2 / B``.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kfacx import blocks
from kfacx.blocks._tnt import ConvTNT, DenseTNT

from . import _cases as C

F64 = jnp.float64
NHWC = ("NHWC", "HWIO", "NHWC")
DAMPING = 0.3
TOL = 1e-10

DENSE = C.dense_case("dense_bias", (5, 4), 3, True, DenseTNT)
CASES = [
    DENSE,
    # Sequence positions and two output axes (einsum("btd,dhk->bthk")), no bias.
    C.dense_case("dense_seq_multihead", (3, 2, 4), None, False, DenseTNT, w_shape=(4, 2, 3)),
    # Bias, two feature groups, stride, SAME padding, channels last.
    C.conv_case(
        "conv2d_groups_bias_nhwc",
        (2, 5, 5, 4),
        (2, 2, 2, 6),
        True,
        ConvTNT,
        window_strides=(2, 1),
        padding="SAME",
        feature_group_count=2,
        dimension_numbers=NHWC,
    ),
]
IDS = [c.name for c in CASES]


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


# ----------------------------------------------------------------------------- references


def _feature_axes(case: C.Case, ndim: int) -> tuple[int, ...]:
    """The output axes of ``y`` that are features (not positions)."""
    if case.is_conv:
        return (case.meta["dimension_numbers"].out_spec[1],)
    (_, w_axes), _ = case.meta["dimension_numbers"]
    n_out_axes = len(case.param_shapes[0]) - len(w_axes)
    return tuple(range(ndim - n_out_axes, ndim))


def row_gradients(case: C.Case, data) -> np.ndarray:
    """``G [samples, rows, groups, n, m]``: the gradient of every (sample, row)."""
    block = case.block(F64)
    (x,), params, (dy,) = data["inputs"], data["params"], data["outputs_tangent"]

    def layer(p):
        return case.tag.compute((x,), p, **case.meta)[0]

    y = jax.eval_shape(layer, params)  # the layer runs in `grads` only (one compilation)
    features = _feature_axes(case, len(y.shape))
    positions = [d for i, d in enumerate(y.shape) if i not in features]
    count = math.prod(positions)
    one_hot = np.eye(count).reshape(count, *positions)
    one_hot = np.expand_dims(one_hot, tuple(1 + a for a in features))

    @C.fast_jit
    def grads(dy, one_hot):
        cotangents = dy[:, None] * one_hot[None]  # [samples, rows, *y.shape]
        vjp = jax.vjp(layer, params)[1]
        return jax.vmap(jax.vmap(lambda c: block.params_to_matrix(vjp(c)[0])))(cotangents)

    return np.asarray(grads(dy, jnp.asarray(one_hot)))


@functools.cache
def setup(case: C.Case):
    """``(block, state after one update, data, L, R, G)``, the references in float64."""
    block, state, data = case.fitted(dtype=F64)
    g = row_gradients(case, data)
    return block, state, data, *reference_factors(case, g), g


def reference_factors(case: C.Case, g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``L = sum G G^T / B`` and ``R = sum G^T G / B`` over samples and rows, per group."""
    left = np.einsum("srgik,srgjk->gij", g, g) / case.batch_size
    right = np.einsum("srgki,srgkj->gij", g, g) / case.batch_size
    return left, right


def reference_dense(block, left: np.ndarray, right: np.ndarray) -> np.ndarray:
    """``block_diag_g(L[g] (x) R[g] / tr L[g])`` over the flattened parameters."""
    traces = np.trace(left, axis1=1, axis2=2)[:, None, None]
    return C.kronecker_dense(block, left / traces, right)


def scaled_factors(left: np.ndarray, right: np.ndarray):
    """``(L, R) / sqrt(sqrt(tr L tr R))`` per group."""
    root = np.sqrt(np.sqrt(np.trace(left, axis1=1, axis2=2) * np.trace(right, axis1=1, axis2=2)))
    return left / root[:, None, None], right / root[:, None, None]


def to_layout(block, vector) -> np.ndarray:
    """``params_to_matrix(vector)`` ``[groups, n, m]`` in float64 (`_cases.kronecker_positions`)."""
    flat = np.asarray(C.flat(vector))
    shape = (block.num_groups, block.input_size, block.output_size)
    return (C.kronecker_positions(block).T @ flat).reshape(shape)


def pi_damped(block, a, g, vector, weight: float, power: float) -> np.ndarray:
    """``(A + pi sqrt(l) I)^p (x) (G + sqrt(l)/pi I)^p v`` per group, in matrix layout."""
    v = to_layout(block, vector)
    out = []
    for ai, gi, vi in zip(a, g, v, strict=True):
        n, m = ai.shape[0], gi.shape[0]
        pi = np.sqrt((np.trace(ai) / n) / (np.trace(gi) / m))
        ma = C.dense_matpower(ai, pi * np.sqrt(weight), power)
        mg = C.dense_matpower(gi, np.sqrt(weight) / pi, power)
        out.append(ma @ vi @ mg)  # (A (x) G) vec(V) = vec(A V G) for row-major V, symmetric G.
    return np.stack(out)


def close(actual, expected, what: str, tol: float = TOL) -> None:
    """``||actual - expected|| <= tol ||expected||`` (Frobenius), both float64."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.dtype == expected.dtype == np.float64, what
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    assert np.all(np.isfinite(actual)), f"{what}: non-finite values"
    err, scale = np.linalg.norm(actual - expected), max(np.linalg.norm(expected), 1e-300)
    assert err <= tol * scale, f"{what}: relative error {err / scale:.3g} > {tol:.3g}"


# ----------------------------------------------------------------------------- statistics


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_factors_are_second_moments_of_row_gradients(case):
    """``L = sum G G^T / B`` and ``R = sum G^T G / B`` over samples and rows, equal traces."""
    block, state, _, left, right, _ = setup(case)
    assert [f.value.shape for f in state.factors] == [left.shape, right.shape]
    close(state.factors[0].value, left, "L")
    close(state.factors[1].value, right, "R")
    np.testing.assert_allclose(
        np.trace(state.factors[0].value, axis1=1, axis2=2),
        np.trace(state.factors[1].value, axis1=1, axis2=2),
        rtol=1e-12,
    )


def test_one_sample_dense_is_kfac_jax_formula():
    """One sample: ``L = sum_n ||dy_n||^2 x_n x_n^T / B``, ``R = sum_n ||x_n||^2 dy_n dy_n^T / B``
    with ``x_n`` the input with a 1 appended (kfac-jax's DenseTNT), from numpy."""
    case = C.dense_case("one_sample", (5, 4), 3, True, DenseTNT, num_samples=1)
    data = case.data(seed=4, dtype=F64)
    x = np.asarray(data["inputs"][0])
    x = np.concatenate([x, np.ones((x.shape[0], 1))], axis=1)
    dy = np.asarray(data["outputs_tangent"][0][0])
    dy_sq, x_sq = np.sum(dy**2, axis=1), np.sum(x**2, axis=1)
    left = np.einsum("n,ni,nj->ij", dy_sq, x, x) / 5
    right = np.einsum("n,ni,nj->ij", x_sq, dy, dy) / 5
    stats = C.jit_statistics(case.block(F64))(data, 5)
    close(stats[0][0], left, "L")
    close(stats[1][0], right, "R")


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_dense_matrix_is_normalized_kronecker(case):
    """``to_dense_matrix = L (x) R / tr L`` (per group); its trace is the mean squared
    Frobenius norm of the rows' gradients, summed over samples."""
    block, state, _, left, right, g = setup(case)
    dense = np.asarray(C.jit_to_dense(block)(state))
    close(dense, reference_dense(block, left, right), "dense matrix")
    np.testing.assert_allclose(np.trace(dense), np.sum(g**2) / case.batch_size, rtol=1e-12)
    # Not the unscaled product (the checks above would pass only by chance).
    assert np.all(np.abs(np.trace(left, axis1=1, axis2=2) - 1.0) > 0.5)


def test_trace_is_empirical_fisher_trace():
    """Without shared positions a row is an example: ``tr(C) = sum_s mean_n ||g_{s,n}||^2``
    with ``g`` the per-example gradients of all parameters (jax.grad), the trace of the
    layer's exact empirical Fisher."""
    block, state, data, _, _, _ = setup(DENSE)
    (x,), params, (dy,) = data["inputs"], data["params"], data["outputs_tangent"]

    def grad(xb, dyb):
        def inner(p):
            return jnp.sum(DENSE.tag.compute((xb[None],), p, **DENSE.meta)[0] * dyb[None])

        return blocks.flatten_params(jax.grad(inner)(params))

    g = C.fast_jit(jax.vmap(jax.vmap(grad), in_axes=(None, 0)))(x, dy)  # [samples, batch, dim]
    fisher = np.einsum("sni,snj->ij", g, g) / DENSE.batch_size
    dense = np.asarray(C.jit_to_dense(block)(state))
    np.testing.assert_allclose(np.trace(dense), np.trace(fisher), rtol=1e-12)
    assert not np.allclose(dense, fisher, rtol=1e-2)  # An approximation, with its trace.


@pytest.mark.parametrize("bias", [True, False])
def test_batch_one_is_exact(bias):
    """One example, one sample: ``G = x dy^T`` has rank one and
    ``L (x) R / tr L = vec(G) vec(G)^T``, the exact empirical Fisher."""
    case = C.dense_case("b1", (1, 4), 3, bias, DenseTNT, num_samples=1)
    block, state, data = case.fitted(seed=2, dtype=F64)
    x = np.asarray(data["inputs"][0][0])
    x = np.append(x, 1.0) if bias else x
    grad = np.outer(x, np.asarray(data["outputs_tangent"][0][0, 0])).ravel()
    close(C.jit_to_dense(block)(state), np.outer(grad, grad), "dense matrix")


def test_moving_average_keeps_equal_traces():
    """Two updates: the factors are the averaged ``L`` and ``R`` and the curvature is
    ``L_avg (x) R_avg / tr L_avg``."""
    case = CASES[1]
    block = case.block(F64)
    d1, d2 = case.data(seed=1, dtype=F64), case.data(seed=2, dtype=F64)
    s1, s2 = (C.jit_statistics(block)(d, case.batch_size) for d in (d1, d2))
    update = C.jit_update(block)
    state = update(block.init(jax.random.key(0)), d1, 0.0, 1.0, case.batch_size)
    state = update(state, d2, 0.5, 1.5, case.batch_size)
    left, right = (
        (0.5 * np.asarray(a) + 1.5 * np.asarray(b)) / 2 for a, b in zip(s1, s2, strict=True)
    )
    np.testing.assert_allclose(np.trace(left[0]), np.trace(right[0]), rtol=1e-12)
    close(C.jit_to_dense(block)(state), reference_dense(block, left, right), "averaged")


# ----------------------------------------------------------------------------- products


@functools.cache
def products(case: C.Case):
    """``(vector, {config: output})`` for every configuration of `_cases`, exact and
    approximate, fresh and from the cache, after ``update_cache``."""
    block, state, _, _, _, _ = setup(case)
    state = block.init(jax.random.key(0), (-1.0, -0.5), (-1.0, -0.5))._replace(
        factors=state.factors
    )
    configs = C.EXACT_CONFIGS + C.APPROX_CONFIGS
    vector = case.vector(dtype=F64)

    @C.fast_jit
    def run(state, vector):
        state = block.update_cache(state, DAMPING)
        return [block.multiply_matpower(state, vector, DAMPING, *c) for c in configs]

    return vector, dict(zip(configs, run(state, vector), strict=True))


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_exact_powers(case):
    """``(C + l I)^p v`` for p in (1, -1, -0.5) against numpy's eigh of the reference."""
    block, _, _, left, right, _ = setup(case)
    vector, outputs = products(case)
    dense = reference_dense(block, left, right)
    flat = np.asarray(C.flat(vector))
    for config in C.EXACT_CONFIGS:
        expected = C.dense_matpower(dense, DAMPING, config[0]) @ flat
        close(C.flat(outputs[config]), expected, str(config))


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_approximate_powers_use_scaled_factors(case):
    """Factored ("pi") damping of the scaled factors ``(L, R) / sqrt(s)``: the same
    Kronecker product, and the damping split by their (equal) traces."""
    block, _, _, left, right, _ = setup(case)
    vector, outputs = products(case)
    a, g = scaled_factors(left, right)
    for config in C.APPROX_CONFIGS:
        expected = pi_damped(block, a, g, vector, DAMPING, config[0])
        close(to_layout(block, outputs[config]), expected, str(config))
    # The unscaled factors would give another result.
    unscaled = pi_damped(block, left, right, vector, DAMPING, -1.0)
    assert not np.allclose(unscaled, pi_damped(block, a, g, vector, DAMPING, -1.0), rtol=1e-3)


@pytest.mark.parametrize("case", CASES[:1] + CASES[-1:], ids=IDS[:1] + IDS[-1:])
def test_refresh_and_norms_see_the_scaled_factors(case):
    """The batched inverse refresh inverts the scaled factors; `block_norm` is the dense
    matrix's norm."""
    block, state, _, left, right, _ = setup(case)
    state = block.init(jax.random.key(0), approx_powers_to_cache=(-1.0,))._replace(
        factors=state.factors
    )
    matrices = C.fast_jit(lambda s: block.inverse_refresh(s, DAMPING).matrices)(state)
    for got, want, what in zip(matrices, scaled_factors(left, right), "LR", strict=True):
        close(got, want, what)
    dense = reference_dense(block, left, right)
    norms = C.fast_jit(lambda s: [blocks.block_norm(block, s, n) for n in ("trace", "fro")])
    trace, fro = norms(state)
    np.testing.assert_allclose(trace, np.trace(dense), rtol=1e-12)
    np.testing.assert_allclose(fro, np.linalg.norm(dense), rtol=1e-12)


def test_stacked_slices_are_scaled_separately():
    """A `StackedBlock` of two slices (its cache refresh sees both slices' factors at once):
    each slice's curvature is its own ``L (x) R / tr L``."""
    case = CASES[1]
    stacked, data, slices = C.stacked_two(case, DenseTNT, F64)
    vector = tuple(jnp.stack([v, -2 * v]) for v in case.vector(dtype=F64))

    @C.fast_jit
    def run(data, vector):
        state = stacked.init(jax.random.key(0), approx_powers_to_cache=(-1.0,))
        state = stacked.update_curvature_matrix_estimate(state, data, 0.0, 1.0, case.batch_size)
        state = stacked.update_cache(state, DAMPING)
        out = stacked.multiply_matpower(state, vector, DAMPING, -1.0, use_cached=True)
        return stacked.to_dense_matrix(state), out

    dense, out = run(data, vector)
    inner = case.block(F64)
    refs = [reference_factors(case, row_gradients(case, d)) for d in slices]
    expected = np.asarray(jax.scipy.linalg.block_diag(*(reference_dense(inner, *r) for r in refs)))
    close(dense, expected, "stacked dense matrix")
    for i, (left, right) in enumerate(refs):
        v_i = tuple(v[i] for v in vector)
        want = pi_damped(inner, *scaled_factors(left, right), v_i, DAMPING, -1.0)
        close(to_layout(inner, tuple(o[i] for o in out)), want, f"slice {i} inverse")


# ----------------------------------------------------------------------------- degenerate


@functools.cache
def zero_products(case: C.Case):
    """``run(state, vector) -> (factor values, dense matrix, {config: output})`` after
    ``update_cache(state, 0.1)``, jitted."""
    block = case.block(F64)
    configs = C.EXACT_CONFIGS + C.APPROX_CONFIGS

    @C.fast_jit
    def run(state, vector):
        values, dense = block.factor_values(state), block.to_dense_matrix(state)
        state = block.update_cache(state, 0.1)
        outs = [
            blocks.flatten_params(block.multiply_matpower(state, vector, 0.1, *c)) for c in configs
        ]
        return values, dense, dict(zip(configs, outs, strict=True))

    return run


@pytest.mark.parametrize("case", CASES[:1] + CASES[-1:], ids=IDS[:1] + IDS[-1:])
def test_zero_statistics_give_finite_products(case):
    """Before any update, and after one with zero cotangents, the block is zero: no NaN
    from the scale, every product is ``l^p v``."""
    block = case.block(F64)
    fresh = block.init(jax.random.key(0), (-1.0, -0.5), (-1.0, -0.5))
    data = case.data(dtype=F64)
    data["outputs_tangent"] = (jnp.zeros_like(data["outputs_tangent"][0]),)
    zero = C.jit_update(block)(fresh, data, 0.0, 1.0, case.batch_size)
    assert all(float(f.weight) == 1.0 for f in zero.factors)
    vector = case.vector(dtype=F64)
    flat = np.asarray(C.flat(vector))
    for name, state in (("fresh", fresh), ("zero tangents", zero)):
        values, dense, outputs = zero_products(case)(state, vector)
        for value in values:
            np.testing.assert_array_equal(value, 0.0)
        np.testing.assert_array_equal(dense, 0.0)
        for config, out in outputs.items():
            close(out, 0.1 ** config[0] * flat, f"{name} {config}", tol=1e-12)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_padding_examples_add_nothing(case):
    """A batch padded with two examples (non-finite inputs, zero cotangents, mask 0)
    has the statistics of its real examples."""
    block = case.block(F64)
    data = case.data(seed=3, dtype=F64)
    (x,), (dy,) = data["inputs"], data["outputs_tangent"]
    junk = np.full((2, *x.shape[1:]), 1e30)
    junk[0].reshape(-1)[0], junk[1].reshape(-1)[-1] = np.nan, np.inf
    padded = dict(
        data,
        inputs=(jnp.concatenate([x, jnp.asarray(junk)]),),
        outputs_tangent=(jnp.concatenate([dy, jnp.zeros((dy.shape[0], 2, *dy.shape[2:]))], 1),),
        mask=jnp.asarray([1.0] * case.batch_size + [0.0, 0.0]),
    )
    want = C.jit_statistics(block)(data, case.batch_size)
    got = C.jit_statistics(block)(padded, case.batch_size)
    for g, w, what in zip(got, want, "LR", strict=True):
        close(g, np.asarray(w), what, tol=1e-14)


def test_rows_must_pair_up():
    block = DENSE.block(F64)
    data = DENSE.data(dtype=F64)
    data["outputs_tangent"] = (data["outputs_tangent"][0][:, :-1],)
    with pytest.raises(ValueError, match="input rows but 4 cotangent rows"):
        block.compute_statistics(data, DENSE.batch_size)
