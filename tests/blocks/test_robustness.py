"""Numerical robustness of the blocks' inverses and powers (float32).

Degenerate statistics — rank-deficient factors with damping 1e-12, 1x1 factors,
exactly zero rows / columns (dead units) or whole factors, and non-finite
factors — must give finite caches and finite products equal to their float64
references. The references apply the documented rules of `kfacx.linalg`:

- the damping of a PSD matrix ``M`` is floored at ``max(eps * tr(M), sqrt(tiny))``
  (float32 ``eps`` and ``tiny``): ``M`` is a Kronecker factor for the approximate
  (pi-damped) powers, the whole block ``A (x) G`` (per group) for the exact ones;
- pi damping splits ``l`` as ``(pi sqrt(l), sqrt(l) / pi)``, ``pi = 1`` when a trace
  is zero or not finite;
- a non-finite factor counts as zero (a whole matrix factor; a diagonal entry).

Every block kind is fitted by one jitted update and one jitted program (cache
refresh plus all products); the scenarios of a kind share both compilations.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kfacx import blocks

from . import _cases as C

EPS = float(np.finfo(np.float32).eps)
SQRT_TINY = float(np.sqrt(np.finfo(np.float32).tiny))
POWERS = (-1.0, -0.5)
# (power, exact_power, use_cached): every inverse and inverse square root.
CONFIGS = [(p, e, u) for e in (True, False) for p in POWERS for u in (False, True)]
L = 3  # Slices of the stacked block.

# Rank-deficient statistics: 2 rows (examples or positions), inputs of width 64.
WIDE = {
    "dense_kf": C.dense_case("dense_kf", (2, 64), 4, True, num_samples=1),
    "conv_kf": C.conv_case("conv_kf", (1, 16, 5), (3, 16, 4), True),  # 2 positions x 64.
    "ss_diag": C.scale_and_shift_case(
        "ss_diag", (2, 64), (64,), (64,), blocks.ScaleAndShiftDiagonal
    ),
    "ss_full": C.scale_and_shift_case("ss_full", (2, 64), (64,), (64,), blocks.ScaleAndShiftFull),
    "full": C.dense_case("full", (2, 64), 2, True, blocks.Full),
    "diag": C.dense_case("diag", (2, 64), 4, True, blocks.Diagonal),
}
# One input and one output.
ONE = {
    "dense_kf_bias": C.dense_case("dense_kf_bias", (3, 1), 1, True),
    "dense_kf_nobias": C.dense_case("dense_kf_nobias", (3, 1), 1, False),
    "conv_kf_1x1": C.conv_case("conv_kf_1x1", (2, 1, 3), (1, 1, 1), True),
    "ss_diag_1": C.scale_and_shift_case(
        "ss_diag_1", (3, 1), (1,), (1,), blocks.ScaleAndShiftDiagonal
    ),
    "ss_full_1": C.scale_and_shift_case("ss_full_1", (3, 1), (1,), (1,), blocks.ScaleAndShiftFull),
    "full_1": C.dense_case("full_1", (3, 1), 1, True, blocks.Full),
    "diag_1": C.dense_case("diag_1", (3, 1), 1, False, blocks.Diagonal),
}


# ----------------------------------------------------------------------------- running


@functools.cache
def _fit(block):
    return C.fast_jit(block.update_curvature_matrix_estimate, static_argnums=(4,))


@functools.cache
def _program(block):
    """``(state, vector, damping) -> (state with refreshed cache, [products of CONFIGS])``."""

    def run(state, vector, damping):
        state = block.update_cache(state, damping)
        return state, [block.multiply_matpower(state, vector, damping, *c) for c in CONFIGS]

    return C.fast_jit(run)


def _init(block):
    return block.init(jax.random.key(0), POWERS, POWERS)


def fitted_factors(case, data):
    block = case.block()
    return _fit(block)(_init(block), data, 0.0, 1.0, case.batch_size).factors


def run(case, factors, damping, vector=None):
    """``(block, state, vector, {config: product})`` for the given factors."""
    block = case.block()
    vector = case.vector() if vector is None else vector
    state, outs = _program(block)(_init(block)._replace(factors=factors), vector, damping)
    return block, state, vector, dict(zip(CONFIGS, outs, strict=True))


def kill(data, inputs=None, outputs=None):
    """Estimation data with the given input features / output features set to zero (dead
    units; ``slice(None)``: all of them). Features are the last axis, or axis 1 for the
    NCH convolution."""

    def zero(x, index, axis):
        if index is None:
            return x
        x = np.array(x)
        x[(slice(None),) * (axis % x.ndim) + (index,)] = 0
        return jnp.asarray(x)

    (x,), (dy,) = data["inputs"], data["outputs_tangent"]
    conv = x.ndim == 3
    return dict(
        data,
        inputs=(zero(x, inputs, 1 if conv else -1),),
        outputs_tangent=(zero(dy, outputs, 2 if conv else -1),),
    )


def with_nan(factors, index):
    """The factors with one NaN entry in factor ``index``."""
    f = factors[index]
    raw = np.array(f.raw_value)
    raw.reshape(-1)[0] = np.nan
    return tuple(
        g._replace(raw_value=jnp.asarray(raw)) if i == index else g for i, g in enumerate(factors)
    )


# ----------------------------------------------------------------------------- references


def _floor(damping, trace):
    trace = trace if np.isfinite(trace) else 0.0
    return max(damping, EPS * max(trace, 0.0), SQRT_TINY)


def _values(block, factors):
    """Factor values in float64; a non-finite matrix factor (Kronecker, full) counts as
    zero, a non-finite entry of a diagonal block's factor as zero."""
    matrices = isinstance(
        block, (blocks.TwoKroneckerFactored, blocks.Full, blocks.ScaleAndShiftFull)
    )
    out = []
    for f in factors:
        v = C.factor_value(f)
        if matrices:
            v = np.where(np.all(np.isfinite(v), axis=(-2, -1), keepdims=True), v, 0.0)
        out.append(np.where(np.isfinite(v), v, 0.0))
    return out


def _eig(m):
    vals, vecs = np.linalg.eigh((m + m.T) / 2)
    return np.maximum(vals, 0.0), vecs


def decomposition(block, factors, damping, exact):
    """Per-part ``(eigenvalues, eigenvectors)`` of the damped matrix ``M`` in float64, from
    the float32 factors (powers of ``M`` are taken from them by `reference`).

    A Kronecker part ``M = A (x) G + d I`` (exact) or ``(A + d_a I) (x) (G + d_g I)``
    (approximate) is decomposed through its factors: ``A = U a U^T``, ``G = W g W^T`` give
    ``M = (U (x) W) (a (x) g + d) (U (x) W)^T`` (resp. ``(a + d_a) (x) (g + d_g)``),
    exactly the eigendecomposition of the Kronecker product (float64 ``eigh`` of the
    ``[n m, n m]`` product costs most of this file's time)."""
    values = _values(block, factors)
    if isinstance(block, blocks.TwoKroneckerFactored):
        parts = []
        for a, g in zip(*values, strict=True):
            ta, tg = np.trace(a), np.trace(g)
            (la, u), (lg, w) = (np.linalg.eigh((m + m.T) / 2) for m in (a, g))
            if exact:
                vals = np.kron(la, lg) + _floor(damping, ta * tg)
            else:
                ok = ta > 0 and tg > 0
                pi = np.sqrt((ta / a.shape[0]) / (tg / g.shape[0])) if ok else 1.0
                d_a = _floor(pi * np.sqrt(damping), ta)
                d_g = _floor(np.sqrt(damping) / pi, tg)
                vals = np.kron(la + d_a, lg + d_g)
            parts.append((np.maximum(vals, 0.0), np.kron(u, w)))
        return parts
    if len(values) == 1 and values[0].shape == (block.dim, block.dim):  # Full.
        m = values[0]
        return [_eig(m + _floor(damping, np.trace(m)) * np.eye(block.dim))]
    diag = np.maximum(np.concatenate([x.reshape(-1) for x in values]), 0.0)  # Diagonal.
    return [(diag + _floor(damping, diag.sum()), np.eye(block.dim))]


def reference(block, parts, vector, power):
    """The expected product ``M^p v`` (in the comparison layout) from `decomposition`."""
    if isinstance(block, blocks.TwoKroneckerFactored):
        v = C.to_matrix_layout(block, vector)
        outs = [
            (vecs @ (vals**power * (vecs.T @ vg.reshape(-1)))).reshape(vg.shape)
            for (vals, vecs), vg in zip(parts, v, strict=True)
        ]
        return np.stack(outs)
    flat = np.asarray(C.flat(vector), np.float64)
    ((vals, vecs),) = parts
    return vecs @ (vals**power * (vecs.T @ flat))


def layout(block, out):
    if isinstance(block, blocks.TwoKroneckerFactored):
        return C.to_matrix_layout(block, out)
    return np.asarray(C.flat(out), np.float64)


def energy_error(actual, expected, parts, power):
    """``||M^(-p/2) (actual - expected)|| / ||M^(-p/2) expected||``: the error weighted as
    the quadratic model of the damped curvature ``M`` weighs it (for ``p = -1`` the energy
    norm). Directions with tiny eigenvalues, where float32 rounding noise of the factors
    dominates, count for what they change in the model."""
    num = den = 0.0
    shape = (len(parts), -1)
    for (vals, vecs), a, e in zip(
        parts, actual.reshape(shape), expected.reshape(shape), strict=True
    ):
        w = vals ** (-power / 2)
        num += np.sum((w * (vecs.T @ (a - e))) ** 2)
        den += np.sum((w * (vecs.T @ e)) ** 2)
    return np.sqrt(num / max(den, 1e-300))


def check(case, factors, damping, tol, metric="relative", vector=None):
    """Runs the program; checks the cache is finite and every product against its
    reference. Returns ``(block, state, vector, outputs)``."""
    block, state, vector, outputs = run(case, factors, damping, vector)
    assert_cache_finite(state)
    # Non-Kronecker blocks have one damped matrix for the exact and approximate powers.
    kronecker = isinstance(block, blocks.TwoKroneckerFactored)
    decompositions = {}
    for config, out in outputs.items():
        what = f"{case.name} {config}"
        assert all(o.dtype == v.dtype for o, v in zip(out, vector, strict=True)), what
        actual = layout(block, out)
        assert np.all(np.isfinite(actual)), f"{what}: non-finite product"
        exact = config[1] or not kronecker
        if exact not in decompositions:
            decompositions[exact] = decomposition(block, factors, damping, exact)
        parts = decompositions[exact]
        expected = reference(block, parts, vector, config[0])
        if metric == "energy":
            err = energy_error(actual, expected, parts, config[0])
            assert err <= tol, f"{what}: energy error {err:.3g} > {tol}"
        else:
            C.assert_close_rel(actual, expected, tol, what)
    return block, state, vector, outputs


def assert_cache_finite(state):
    leaves = jax.tree.leaves(state.cache)
    for leaf in leaves:
        assert np.all(np.isfinite(np.asarray(leaf))), "non-finite cache entry"


def _ids(d):
    return list(d)


# ----------------------------------------------------------------------------- (a) tiny damping


@pytest.mark.parametrize("name", _ids(WIDE))
def test_rank_deficient_tiny_damping(name):
    """Damping 1e-12 with factors of rank <= 2 (width 64): the floor ``eps * tr`` acts; the
    result is finite and close, in the quadratic model's norm, to the float64 result with
    the floored damping.

    The tolerance is loose because this is the edge of float32: the null-space
    eigenvalues of a float32 factor are rounding noise of size ~``eps * max eigenvalue``,
    comparable to the floor (errors of 5-10 % here). Without the floor the noise would be
    amplified by ``1 / damping = 1e12``, or Cholesky would fail."""
    case = WIDE[name]
    factors = fitted_factors(case, case.data())
    check(case, factors, 1e-12, tol=0.25, metric="energy")


@pytest.mark.parametrize("name", _ids(WIDE))
def test_rank_deficient_moderate_damping(name):
    """The same factors with damping 0.1: the floor does not act; equal to the float64
    reference up to float32 rounding amplified by the condition number (~1e3)."""
    case = WIDE[name]
    factors = fitted_factors(case, case.data())
    check(case, factors, 0.1, tol=1e-3)


# ----------------------------------------------------------------------------- (b) 1x1 factors


@pytest.mark.parametrize("damping", [1e-12, 1e-3])
@pytest.mark.parametrize("name", _ids(ONE))
def test_one_input_one_output(name, damping):
    case = ONE[name]
    block = case.block()
    factors = fitted_factors(case, case.data())
    if isinstance(block, blocks.TwoKroneckerFactored):
        assert block.output_size == 1 and block.input_size == 1 + int(block.has_bias)
    check(case, factors, damping, tol=1e-5)


# ----------------------------------------------------------------------------- (c) zero factors


@pytest.mark.parametrize("name", _ids(WIDE))
def test_dead_units(name):
    """Half the input features and half the output features are always zero (dead ReLU
    units): zero rows and columns in the factors. Equal to the reference; the parameters
    that only dead units touch get exactly ``damping^p v`` from the exact powers."""
    case = WIDE[name]
    data = kill(case.data(), inputs=slice(0, None, 2), outputs=slice(0, None, 2))
    factors = fitted_factors(case, data)
    block, _, vector, outputs = check(case, factors, 0.1, tol=1e-3)
    dead = _dead_parameters(block, factors)
    assert dead.any() and not dead.all()
    flat = np.asarray(C.flat(vector), np.float64)
    for power in POWERS:
        for cached in (False, True):
            out = np.asarray(C.flat(outputs[(power, True, cached)]), np.float64)
            C.assert_close_rel(out[dead], 0.1**power * flat[dead], 1e-4, f"dead, power {power}")


def _dead_parameters(block, factors):
    """Parameters whose row and column of the dense block are zero."""
    dense = np.asarray(C.jit_to_dense(block)(blocks.BlockState(factors, None)), np.float64)
    return np.all(dense == 0, axis=0)


@pytest.mark.parametrize("name", _ids(WIDE))
@pytest.mark.parametrize("damping", [1e-12, 0.1])
def test_all_zero_statistics(name, damping):
    """All inputs and all cotangents zero: the block is zero (up to the bias row of the
    input factor) and ``(l I)^p v = l^p v`` exactly; Kronecker approximate powers with
    ``pi = 1`` give ``(A + sqrt(l) I)^p (x) sqrt(l)^p``."""
    case = WIDE[name]
    data = kill(case.data(), inputs=slice(None), outputs=slice(None))
    factors = fitted_factors(case, data)
    block, _, vector, outputs = check(case, factors, damping, tol=1e-5)
    flat = np.asarray(C.flat(vector), np.float64)
    kronecker = isinstance(block, blocks.TwoKroneckerFactored)
    for (power, exact, _), out in outputs.items():
        if exact or not kronecker:
            out = np.asarray(C.flat(out), np.float64)
            C.assert_close_rel(out, damping**power * flat, 1e-5, f"power {power}")
        else:
            # A = diag(0, ..., 0, 1) (the bias row), G = 0: pi = 1.
            a = C.factor_value(factors[0])
            np.testing.assert_array_equal(a[:, :-1, :], 0.0)
            np.testing.assert_array_equal(C.factor_value(factors[1]), 0.0)
            root = np.sqrt(damping)
            scale = ((np.diagonal(a, axis1=1, axis2=2) + root) * root) ** power
            expected = scale[..., None] * C.to_matrix_layout(block, vector)
            C.assert_close_rel(layout(block, out), expected, 1e-5, f"approx power {power}")


def test_zero_input_factor_kronecker_split():
    """Dense K-FAC without bias, all inputs zero: ``A = 0``, so ``pi = 1`` and the
    approximate inverse is ``V (G + sqrt(l) I)^-1 / sqrt(l)``; the exact one ``V / l``."""
    case = C.dense_case("dense_kf_nobias", (2, 64), 4, False, num_samples=1)
    factors = fitted_factors(case, kill(case.data(), inputs=slice(None)))
    block, _, vector, outputs = check(case, factors, 1e-4, tol=1e-5)
    (w,) = (np.asarray(x, np.float64) for x in vector)
    g = C.factor_value(factors[1])[0]
    assert np.all(C.factor_value(factors[0]) == 0) and np.trace(g) > 0
    expected = w @ np.linalg.inv(g + 1e-2 * np.eye(4)) / 1e-2
    for cached in (False, True):
        C.assert_close_rel(outputs[(-1.0, False, cached)][0], expected, 1e-5, "approx")
        C.assert_close_rel(outputs[(-1.0, True, cached)][0], w / 1e-4, 1e-5, "exact")


# ----------------------------------------------------------------------------- (d) non-finite


@pytest.mark.parametrize("name", _ids(WIDE))
def test_non_finite_factor(name):
    """A NaN in a factor (e.g. a NaN statistic was folded in): the cache stays finite and
    the products treat the factor (the entry, for a diagonal block) as zero."""
    case = WIDE[name]
    factors = fitted_factors(case, case.data())
    for index in range(len(factors)):
        check(case, with_nan(factors, index), 0.1, tol=1e-4)


# ----------------------------------------------------------------------------- stacked


def _stacked_case():
    inner = WIDE["dense_kf"]
    info = inner.layer()

    def lead(shapes):
        return tuple((L, *s) for s in shapes)

    layer = dataclasses.replace(
        info,
        parameter_shapes=lead(info.parameter_shapes),
        input_shapes=lead(info.input_shapes),
        output_shapes=lead(info.output_shapes),
        stack_size=L,
    )
    return inner, blocks.StackedBlock(layer, blocks.DenseTwoKroneckerFactored)


@pytest.mark.parametrize("damping", [1e-12, 0.1])
def test_stacked_degenerate_slices(damping):
    """A stacked dense K-FAC block whose slices are rank-deficient, all zero and NaN: each
    slice equals the inner block on that slice (whose references are checked above), only
    the degenerate slices are affected, and everything is finite."""
    inner_case, block = _stacked_case()
    base = fitted_factors(inner_case, inner_case.data())
    zero = fitted_factors(
        inner_case, kill(inner_case.data(seed=1), inputs=slice(None), outputs=slice(None))
    )
    slices = [base, zero, with_nan(base, 0)]
    factors = jax.tree.map(lambda *xs: jnp.stack(xs), *slices)
    vectors = [inner_case.vector(seed=i) for i in range(L)]
    vector = tuple(jnp.stack(v) for v in zip(*vectors, strict=True))
    state, outs = _program(block)(_init(block)._replace(factors=factors), vector, damping)
    assert_cache_finite(state)
    for i, (f, v) in enumerate(zip(slices, vectors, strict=True)):
        _, _, _, want = run(inner_case, f, damping, v)
        for config, out in zip(CONFIGS, outs, strict=True):
            got = tuple(o[i] for o in out)
            assert all(np.all(np.isfinite(np.asarray(g))) for g in got)
            # Same computation batched: equal up to float32 rounding of the batched kernels
            # (the slices at damping 1e-12 sit at the edge of float32 precision).
            tol = 1e-5 if damping >= 0.1 or i == 1 else 0.25
            C.assert_close_rel(
                C.flat(got),
                np.asarray(C.flat(want[config]), np.float64),
                tol,
                f"slice {i} {config}",
            )


# ----------------------------------------------------------------------------- embedding


def test_embedding_unseen_ids_and_nan():
    """An embedding whose ids hit 2 of 8 rows, damping 1e-12, and the same with a NaN in
    the output factor: finite cache and products; unseen rows get ``v / l`` (exact) with
    ``l`` floored at ``eps * tr(diag(a)) tr(G)`` (``G`` counts as zero when it is NaN)."""
    vocab, width, damping = 8, 4, 1e-12
    table = jax.ShapeDtypeStruct((vocab, width), jnp.float32)
    block = blocks.EmbeddingKroneckerFactored(blocks.LayerInfo.from_params("embed", (table,)))
    rng = np.random.default_rng(0)
    data = dict(
        inputs=(jnp.asarray([[0, 1], [1, 1]]),),
        outputs_tangent=(jnp.asarray(rng.standard_normal((1, 2, 2, width)), jnp.float32),),
    )
    factors = _fit(block)(_init(block), data, 0.0, 1.0, 2).factors
    v = (jnp.asarray(rng.standard_normal((vocab, width)), jnp.float32),)
    trace_g = np.trace(C.factor_value(factors[1]))
    np.testing.assert_allclose(np.sum(C.factor_value(factors[0])), 1.0)
    for fs, floor in ((factors, _floor(damping, trace_g)), (with_nan(factors, 1), damping)):
        state, outs = _program(block)(_init(block)._replace(factors=fs), v, damping)
        assert_cache_finite(state)
        for (power, exact, _), (out,) in zip(CONFIGS, outs, strict=True):
            assert np.all(np.isfinite(np.asarray(out)))
            if exact:
                unseen = np.asarray(out)[2:]
                C.assert_close_rel(unseen, floor**power * np.asarray(v[0])[2:], 1e-5, "unseen")


def test_stacked_cache_refresh_keeps_the_fallback_conditional():
    """`StackedBlock.update_cache` of Kronecker (and full) blocks is not vmapped, so the
    `lax.cond` of the inverse fallback stays a branch (vmapped, it would become a select
    that always computes the eigendecomposition too)."""
    _, block = _stacked_case()
    jaxpr = str(jax.make_jaxpr(block.update_cache)(_init(block), 0.1))
    assert "cond" in jaxpr
