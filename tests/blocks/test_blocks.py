"""Shared property tests of all curvature blocks, driven by one table of cases.

Every block in `CASES` is checked against independent float64 references: its
dense matrix (statistics), moving averages, exact and approximate matrix powers
(with and without the cache), degenerate statistics, jit, pytree structure,
dtypes, pmap averaging and error messages.

Compilation dominates the run time, and eager mode compiles every op for every
new shape: so updates, dense matrices and matrix products are computed by jitted
programs cached per case (`_cases.products`, `_cases.jit_update`, ...). Eager
calls are compared with jitted ones on `REPRESENTATIVE_CASES` (one per kind of
code path), which also drive the other checks that need fresh compilations
(bfloat16, pmap).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kfacx import blocks, tags

from . import _cases as C
from ._cases import Case

KF = blocks.DenseTwoKroneckerFactored
CONV = blocks.ConvTwoKroneckerFactored
NHWC = ("NHWC", "HWIO", "NHWC")

DAMPING = 0.5
TOL = 1e-4

# One table of all blocks: every shared property test below runs on every case.
CASES: list[Case] = [
    C.dense_case("dense_kf_bias", (5, 4), 3, True),
    C.dense_case("dense_kf_nobias", (5, 4), 3, False),
    C.dense_case("dense_kf_bias_seq", (3, 2, 4), 3, True),
    C.dense_case("dense_kf_nobias_seq", (3, 2, 4), 3, False),
    # x @ w.T, and an attention-style projection einsum("btd,dhk->bthk").
    C.dense_case(
        "dense_kf_transposed_bias",
        (5, 4),
        None,
        True,
        w_shape=(3, 4),
        dimension_numbers=(((1,), (1,)), ((), ())),
    ),
    C.dense_case("dense_kf_multihead_seq_bias", (3, 2, 4), None, True, w_shape=(4, 2, 3)),
    C.conv_case("conv1d_kf_bias", (2, 3, 7), (4, 3, 3), True),
    C.conv_case(
        "conv1d_kf_nobias_nwc",
        (2, 7, 3),
        (3, 3, 4),
        False,
        window_strides=(2,),
        dimension_numbers=("NWC", "WIO", "NWC"),
    ),
    C.conv_case(
        "conv2d_kf_bias_nhwc",
        (2, 5, 5, 3),
        (3, 3, 3, 4),
        True,
        window_strides=(2, 2),
        padding="SAME",
        dimension_numbers=NHWC,
    ),
    C.conv_case(
        "conv2d_kf_groups_nobias", (2, 4, 5, 5), (6, 2, 2, 2), False, feature_group_count=2
    ),
    C.conv_case("conv3d_kf_bias", (2, 2, 4, 3, 3), (3, 2, 2, 2, 2), True),
    C.conv_case(
        "conv3d_kf_nobias_ndhwc",
        (2, 3, 3, 4, 2),
        (2, 2, 2, 2, 3),
        False,
        dimension_numbers=("NDHWC", "DHWIO", "NDHWC"),
    ),
    C.scale_and_shift_case(
        "ss_diag_scale_shift", (3, 2, 4), (4,), (4,), blocks.ScaleAndShiftDiagonal
    ),
    C.scale_and_shift_case("ss_diag_scale", (4, 5), (5,), None, blocks.ScaleAndShiftDiagonal),
    C.scale_and_shift_case("ss_full_scale_shift", (3, 2, 4), (4,), (4,), blocks.ScaleAndShiftFull),
    C.scale_and_shift_case("ss_full_scale", (4, 5), (5,), None, blocks.ScaleAndShiftFull),
    C.dense_case("diag_dense", (5, 4), 3, True, blocks.Diagonal),
    C.dense_case("diag_dense_seq", (3, 2, 4), 2, False, blocks.Diagonal),
    C.dense_case("full_dense", (5, 4), 3, True, blocks.Full),
    C.dense_case("full_dense_seq", (3, 2, 4), 2, False, blocks.Full),
    C.dense_case("full_dense_multihead_seq", (2, 2, 3), None, True, blocks.Full, w_shape=(3, 2, 2)),
    C.generic_case("diag_generic", (3, 2), blocks.Diagonal),
    C.generic_case("full_generic", (3, 2), blocks.Full),
]
KRONECKER_CASES = [c for c in CASES if c.is_kronecker]
# Dense K-FAC with the default contraction x @ w, w [d_in, d_out].
DENSE_KRONECKER_CASES = [
    c
    for c in CASES
    if c.is_dense_kronecker
    and c.meta["dimension_numbers"][0][1] == (0,)
    and len(c.param_shapes[0]) == 2
]
CACHED_CASES = [c for c in CASES if c.is_kronecker or c.is_full]
# The products see a Kronecker block only through its factors and its matrix layout
# (`params_to_matrix`); the product tests leave out the cases whose layout another case
# has: the sequence cases (the dense cases' parameters and layout: the same program) and
# three conv cases (their kernel layouts are the channel-first or spatial-first ones of
# the conv cases kept; test_conv_statistics.py checks every conv layout).
PRODUCT_CASES = [
    c
    for c in CASES
    if c.name
    not in {
        "dense_kf_bias_seq",
        "dense_kf_nobias_seq",
        "conv1d_kf_nobias_nwc",
        "conv3d_kf_bias",
        "conv3d_kf_nobias_ndhwc",
    }
]
PRODUCT_KRONECKER_CASES = [c for c in PRODUCT_CASES if c.is_kronecker]
# Dense and conv Kronecker, closed-form (scale and shift) and vjp-based (generic)
# per-example gradients: the blocks' code paths that jit / dtype / pmap checks can
# distinguish (see the module docstring).
REPRESENTATIVE_CASES = [
    c
    for c in CASES
    if c.name
    in {"dense_kf_bias_seq", "conv2d_kf_bias_nhwc", "ss_diag_scale_shift", "full_dense_seq"}
]

# Degenerate statistics (1x1, rank-deficient and exactly zero factors).
_SPECIAL = {
    "1x1": C.dense_case("1x1", (4, 1), 1, False),
    "rank_deficient": C.dense_case("rank_deficient", (2, 6), 5, True),
    "zero_inputs": C.dense_case("zero_inputs", (3, 4), 3, False, zero_inputs=True),
    "zero_tangents": C.dense_case("zero_tangents", (3, 4), 3, True, zero_tangents=True),
}
SPECIAL_CASES = [
    dataclasses.replace(_SPECIAL[name], name=f"{prefix}_{name}", block_cls=cls)
    for prefix, cls, names in (
        ("kf", KF, ("1x1", "rank_deficient", "zero_inputs", "zero_tangents")),
        ("full", blocks.Full, ("1x1", "rank_deficient", "zero_inputs")),
        ("diag", blocks.Diagonal, ("rank_deficient", "zero_tangents")),
    )
    for name in names
] + [
    C.conv_case(
        "conv_kf_zero_tangents", (2, 2, 5), (3, 2, 2), True, case_kwargs=dict(zero_tangents=True)
    ),
]


def _ids(cases):
    return [c.name for c in cases]


def _config_id(config) -> str:
    power, exact_power, use_cached = config
    return f"p{power}-{'exact' if exact_power else 'approx'}-{'cached' if use_cached else 'fresh'}"


def _product_params(cases):
    return [
        pytest.param(c, cfg, id=f"{c.name}-{_config_id(cfg)}")
        for c in cases
        for cfg in C.EXACT_CONFIGS + C.APPROX_CONFIGS
    ]


def _exact_reference(block, state, vector, identity_weight, power) -> np.ndarray:
    dense = C.state_dense(block, state)
    flat = np.asarray(C.flat(vector), np.float64)
    return C.dense_matpower(dense, identity_weight, power) @ flat


def _check_product(case, identity_weight, config) -> None:
    """One product of `_cases.products` against its float64 reference."""
    power, exact_power, _ = config
    block, state, v, outputs = C.products(case, identity_weight, exact_power)
    out = outputs[config]
    assert [o.shape for o in out] == [x.shape for x in v]
    assert all(o.dtype == x.dtype for o, x in zip(out, v, strict=True))
    what = f"{case.name} {_config_id(config)}"
    if case.is_kronecker and not exact_power:
        expected = C.pi_damped_reference(block, state, v, identity_weight, power)
        C.assert_close_rel(C.to_matrix_layout(block, out), expected, TOL, what)
    else:
        expected = _exact_reference(block, state, v, identity_weight, power)
        C.assert_close_rel(C.flat(out), expected, TOL, what)


# ----------------------------------------------------------------------------- statistics


@pytest.mark.parametrize("case", CASES, ids=_ids(CASES))
def test_dense_matrix_matches_reference(case):
    """One update with ``ema_old=0, ema_new=1`` stores exactly this batch's statistics;
    `to_dense_matrix` lays them out over the flattened parameters."""
    block, state, data = case.fitted()
    assert block.dim == case.dim
    assert all(float(f.weight) == 1.0 for f in state.factors)
    dense = C.jit_to_dense(block)(state)
    assert dense.shape == (case.dim, case.dim)
    assert dense.dtype == jnp.float32
    C.assert_close_rel(dense, C.reference_dense_matrix(case, block, data), 1e-5, "dense matrix")


@pytest.mark.parametrize("case", CASES, ids=_ids(CASES))
def test_dense_matrix_symmetric_psd(case):
    block, state, _ = case.fitted()
    dense = np.asarray(C.jit_to_dense(block)(state), np.float64)
    scale = np.abs(dense).max()
    np.testing.assert_allclose(dense, dense.T, rtol=0, atol=1e-6 * scale)
    assert np.linalg.eigvalsh(dense).min() >= -1e-5 * scale


@pytest.mark.parametrize("case", DENSE_KRONECKER_CASES, ids=_ids(DENSE_KRONECKER_CASES))
def test_dense_kronecker_layout(case):
    """Dense K-FAC: ``F = A (x) G`` over ``(w row-major, b)``; ``A`` is averaged over all
    rows (examples x positions), ``G`` summed over samples and rows over the batch size."""
    block, state, data = case.fitted()
    x = np.asarray(data["inputs"][0], np.float64)
    dy = np.asarray(data["outputs_tangent"][0], np.float64)
    rows = x.reshape(-1, x.shape[-1])
    if block.has_bias:
        rows = np.concatenate([rows, np.ones((rows.shape[0], 1))], axis=1)
    a = rows.T @ rows / rows.shape[0]
    dy = dy.reshape(-1, dy.shape[-1])
    g = dy.T @ dy / case.batch_size
    assert [f.value.shape for f in state.factors] == [(1, *a.shape), (1, *g.shape)]
    C.assert_close_rel(state.factors[0].value[0], a, 1e-5, "A")
    C.assert_close_rel(state.factors[1].value[0], g, 1e-5, "G")
    C.assert_close_rel(C.jit_to_dense(block)(state), np.kron(a, g), 1e-5, "dense")


@pytest.mark.parametrize("case", CASES, ids=_ids(CASES))
def test_moving_average(case):
    """Zero before any data; two updates give the bias-corrected weighted average."""
    block = case.block()
    d1, d2 = case.data(seed=1), case.data(seed=2)
    state = block.init(jax.random.key(0))
    for f, shape in zip(state.factors, block.factor_shapes(), strict=True):
        assert f.value.shape == shape
        np.testing.assert_array_equal(f.value, 0.0)
    update = C.jit_update(block)
    # This batch's statistics: the state after one update with ema_old=0, ema_new=1
    # (compute_statistics itself is compared with it in test_jit_update_matches_eager).
    s1 = [f.raw_value for f in update(state, d1, 0.0, 1.0, case.batch_size).factors]
    s2 = [f.raw_value for f in update(state, d2, 0.0, 1.0, case.batch_size).factors]
    state = update(state, d1, 0.0, 1.0, case.batch_size)
    state = update(state, d2, 0.5, 1.5, case.batch_size)
    for f, a, b in zip(state.factors, s1, s2, strict=True):
        np.testing.assert_allclose(f.weight, 2.0)
        expected = (0.5 * np.asarray(a, np.float64) + 1.5 * np.asarray(b, np.float64)) / 2.0
        C.assert_close_rel(f.value, expected, 1e-6, "moving average")


@pytest.mark.parametrize("bias", [True, False])
def test_batch_one_kronecker_equals_full(bias):
    """One example, one sample, no shared positions: K-FAC is exact,
    ``A (x) G = vec(g) vec(g)^T``, and the diagonal block is its diagonal."""
    base = C.dense_case("b1", (1, 4), 3, bias, num_samples=1)
    mats = {}
    for cls in (KF, blocks.Full, blocks.Diagonal):
        block, state, data = dataclasses.replace(base, block_cls=cls).fitted(seed=3)
        mats[cls] = np.asarray(C.jit_to_dense(block)(state), np.float64)
    x = np.asarray(data["inputs"][0][0], np.float64)
    g = np.outer(np.append(x, 1.0) if bias else x, data["outputs_tangent"][0][0, 0])
    C.assert_close_rel(mats[blocks.Full], np.outer(g.ravel(), g.ravel()), 1e-5, "full")
    C.assert_close_rel(mats[KF], mats[blocks.Full], 1e-5, "kronecker")
    C.assert_close_rel(mats[blocks.Diagonal], np.diag(np.diag(mats[blocks.Full])), 1e-5, "diag")


# ----------------------------------------------------------------------------- matrix powers


@pytest.mark.parametrize(("case", "config"), _product_params(PRODUCT_CASES))
def test_matpower(case, config):
    """``(C + l I)^p v`` for p in (1, -1, -0.5), exact (numpy eigh of the dense block) or
    approximate (Kronecker blocks: pi-damped factors; the others are exact), fresh or
    from the cache filled by `update_cache`."""
    _check_product(case, DAMPING, config)


@pytest.mark.parametrize(("case", "config"), _product_params(SPECIAL_CASES))
def test_special_states(case, config):
    """1x1 factors, rank-deficient and exactly zero factors: finite, exact results."""
    _check_product(case, 0.1, config)


@pytest.mark.parametrize(
    "case",
    [c for c in SPECIAL_CASES if c.zero_inputs or c.zero_tangents],
    ids=_ids(c for c in SPECIAL_CASES if c.zero_inputs or c.zero_tangents),
)
def test_zero_block(case):
    """All zero cases have an exactly zero block: ``(l I)^p v = l^p v``."""
    block, state, v, outputs = C.products(case, 0.1, exact_power=True)
    np.testing.assert_array_equal(C.state_dense(block, state), 0.0)
    flat = np.asarray(C.flat(v), np.float64)
    if not case.is_kronecker:  # Factored damping is not exact when one factor is zero.
        outputs = {**outputs, **C.products(case, 0.1, exact_power=False)[3]}
    for (power, _, _), out in outputs.items():
        C.assert_close_rel(C.flat(out), 0.1**power * flat, 1e-5, f"power {power}")


@pytest.mark.parametrize("case", PRODUCT_KRONECKER_CASES, ids=_ids(PRODUCT_KRONECKER_CASES))
def test_approx_differs_from_exact_kronecker(case):
    """Sanity check of the references: pi damping is not the exact damped power."""
    approx = C.flat(C.products(case, DAMPING, False)[3][(-0.5, False, False)])
    exact = C.flat(C.products(case, DAMPING, True)[3][(-0.5, True, False)])
    assert np.linalg.norm(approx - exact) > 1e-3 * np.linalg.norm(exact)


# ----------------------------------------------------------------------------- jit and eager


@pytest.mark.parametrize("case", REPRESENTATIVE_CASES, ids=_ids(REPRESENTATIVE_CASES))
def test_jit_update_matches_eager(case):
    block = case.block()
    data = case.data()
    state = block.init(jax.random.key(0))
    update = jax.jit(block.update_curvature_matrix_estimate, static_argnums=(4, 5))
    jitted = update(state, data, 0.0, 1.0, case.batch_size, None)
    eager = block.update_curvature_matrix_estimate(state, data, 0.0, 1.0, case.batch_size)
    stats = block.compute_statistics(data, case.batch_size)
    for fj, fe, s in zip(jitted.factors, eager.factors, stats, strict=True):
        np.testing.assert_array_equal(fe.value, s)
        C.assert_close_rel(fj.value, np.asarray(fe.value), 1e-5, "jit update")


# The conv case's cache and products are `TwoKroneckerFactored`'s, as the dense case's
# (its eager products, through its own matrix layout, are in `test_jit_default_inverse`).
EAGER_PRODUCT_CASES = [c for c in REPRESENTATIVE_CASES if not c.is_conv]


@pytest.mark.parametrize("case", EAGER_PRODUCT_CASES, ids=_ids(EAGER_PRODUCT_CASES))
def test_jit_multiply_matches_eager(case):
    """Eager `update_cache` and products (all powers, cached or not) equal the jitted
    ones of `products`."""
    for block, state, v, outputs in C.all_products(case, DAMPING):
        empty = state._replace(cache=jax.tree.map(jnp.zeros_like, state.cache))
        eager_state = block.update_cache(empty, DAMPING)
        for config, jitted in outputs.items():
            eager = block.multiply_matpower(eager_state, v, DAMPING, *config)
            C.assert_close_rel(
                C.flat(eager),
                np.asarray(C.flat(jitted), np.float64),
                1e-5,
                _config_id(config),
            )


@pytest.mark.parametrize("case", REPRESENTATIVE_CASES, ids=_ids(REPRESENTATIVE_CASES))
def test_jit_default_inverse(case):
    """``jax.jit(lambda s, v: block.multiply_matpower(s, v, 0.1, -1))``: the default
    (approximate) inverse jits and matches eager and its reference."""
    block, state, _ = case.fitted()
    v = case.vector()
    out = jax.jit(lambda s, v_: block.multiply_matpower(s, v_, 0.1, -1))(state, v)
    eager = block.multiply_matpower(state, v, 0.1, -1)
    C.assert_close_rel(C.flat(out), np.asarray(C.flat(eager), np.float64), 1e-5)
    if case.is_kronecker:
        expected = C.pi_damped_reference(block, state, v, 0.1, -1.0)
        C.assert_close_rel(C.to_matrix_layout(block, out), expected, TOL, "jit inverse")
    else:
        expected = _exact_reference(block, state, v, 0.1, -1.0)
        C.assert_close_rel(C.flat(out), expected, TOL, "jit inverse")


@pytest.mark.parametrize("case", REPRESENTATIVE_CASES, ids=_ids(REPRESENTATIVE_CASES))
def test_jit_to_dense_matrix_matches_eager(case):
    block, state, _ = case.fitted()
    jitted = jax.jit(block.to_dense_matrix)(state)
    np.testing.assert_allclose(jitted, block.to_dense_matrix(state), rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------- pytrees, dtypes


@pytest.mark.parametrize("case", PRODUCT_CASES, ids=_ids(PRODUCT_CASES))
def test_state_pytree_roundtrip(case):
    """States with either cache, and with all cache entries, survive flatten/unflatten."""
    block, _, _ = case.fitted()
    full = block.init(jax.random.key(0), (-1.0, -0.5), (-1.0, -0.5), cache_eigenvalues=True)
    states = [state for _, state, _, _ in C.all_products(case, DAMPING)] + [full]
    for state in states:
        leaves, treedef = jax.tree_util.tree_flatten(state)
        assert all(isinstance(x, jax.Array) for x in leaves)
        assert len(leaves) >= 2 * len(state.factors)
        rebuilt = jax.tree_util.tree_unflatten(treedef, leaves)
        assert isinstance(rebuilt, blocks.BlockState)
        assert type(rebuilt.cache) is type(state.cache)
        assert jax.tree_util.tree_structure(rebuilt) == treedef
        jax.tree.map(np.testing.assert_array_equal, rebuilt, state)


@pytest.mark.parametrize("case", PRODUCT_CASES, ids=_ids(PRODUCT_CASES))
def test_dtypes_float32(case):
    for block, state, _, outputs in C.all_products(case, DAMPING):
        assert block.dtype == jnp.float32
        assert {x.dtype for x in jax.tree.leaves(state)} == {jnp.dtype(jnp.float32)}
        assert {o.dtype for out in outputs.values() for o in out} == {jnp.dtype(jnp.float32)}


@pytest.mark.parametrize("case", REPRESENTATIVE_CASES, ids=_ids(REPRESENTATIVE_CASES))
def test_dtypes_bfloat16_params(case):
    """bfloat16 parameters: factors in float32, products returned in the vector's dtype."""
    block, state, data = case.fitted(dtype=jnp.bfloat16)
    assert block.dtype == jnp.float32
    assert all(f.value.dtype == jnp.float32 for f in state.factors)
    assert all(f.weight.dtype == jnp.float32 for f in state.factors)
    # The statistics match those of the same (bf16-rounded) data in float32. Kronecker
    # blocks cast inputs and cotangents to float32 before any product; the per-example
    # gradients of the other blocks are products computed in bfloat16.
    data32 = jax.tree.map(lambda x: x.astype(jnp.float32), data)
    expected = C.reference_dense_matrix(case, block, data32)
    tol = 1e-5 if case.is_kronecker else 1e-2
    C.assert_close_rel(C.state_dense(block, state), expected, tol, "bf16 statistics")
    v = case.vector(dtype=jnp.bfloat16)
    out = jax.jit(lambda s, v_: block.multiply_matpower(s, v_, DAMPING, -0.5, True))(state, v)
    assert all(o.dtype == jnp.bfloat16 for o in out)
    expected = _exact_reference(block, state, v, DAMPING, -0.5)
    C.assert_close_rel(C.flat(out), expected, 2e-2, "bf16 power")


# ----------------------------------------------------------------------------- multi-device


@pytest.mark.parametrize("case", REPRESENTATIVE_CASES, ids=_ids(REPRESENTATIVE_CASES))
def test_pmap_averages_statistics(case):
    """With ``pmap_axis_name`` every device holds the average of all devices' statistics."""
    n = 4
    assert jax.local_device_count() >= n
    block = case.block()
    datas = [case.data(seed=10 + i) for i in range(n)]
    # Stacked and indexed on the host: eagerly, each shape compiles a program.
    stacked = jax.tree.map(lambda *xs: jnp.asarray(np.stack(xs)), *datas)
    state = block.init(jax.random.key(0))

    def update(s, d):
        return block.update_curvature_matrix_estimate(s, d, 0.0, 1.0, case.batch_size, "i")

    new = jax.pmap(update, axis_name="i", in_axes=(None, 0))(state, stacked)
    per_device = [C.jit_statistics(block)(d, case.batch_size) for d in datas]
    means = [
        np.mean([np.asarray(s[k], np.float64) for s in per_device], axis=0)
        for k in range(len(per_device[0]))
    ]
    # The devices' statistics differ, so the check is not vacuous.
    assert np.abs(np.asarray(per_device[0][0]) - np.asarray(per_device[1][0])).max() > 1e-3
    for dev in range(n):
        factors = jax.tree.map(lambda x, dev=dev: np.asarray(x)[dev], new.factors)
        for k, (f, expected) in enumerate(zip(factors, means, strict=True)):
            C.assert_close_rel(C.factor_value(f), expected, 1e-5, f"factor {k} on device {dev}")


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize("case", CASES, ids=_ids(CASES))
def test_wrong_vector_shapes(case):
    block, state, _ = case.fitted()
    v = case.vector()
    v = tuple(np.asarray(x) for x in v)  # Only shapes matter (and numpy needs no compiles).
    bad = [
        v[:-1] if len(v) > 1 else v + (np.zeros(3),),  # Wrong number of arrays.
        (np.zeros(v[0].shape + (1,)),) + v[1:],  # Extra axis.
        (v[0].reshape(-1)[:-1],) + v[1:],  # Wrong size.
        list(v[:-1]) + [v[-1][..., None]],  # Last array wrong.
    ]
    if v[0].shape[::-1] != v[0].shape:
        bad.append((np.zeros(v[0].shape[::-1]),) + v[1:])  # Permuted axes.
    for vector in bad:
        with pytest.raises(ValueError, match="vector has shapes"):
            block.multiply_matpower(state, vector, 0.1, -1.0, exact_power=True)
        with pytest.raises(ValueError, match="vector has shapes"):
            block.multiply(state, vector)


@pytest.mark.parametrize("case", KRONECKER_CASES, ids=_ids(KRONECKER_CASES))
def test_kronecker_unsupported_powers(case):
    block, state, _ = case.fitted()
    v = case.vector()
    for power in (-2, 0.5, 2):
        with pytest.raises(ValueError, match=rf"power {float(power)} is not supported with exact"):
            block.multiply_matpower(state, v, 0.1, power, exact_power=False)
    with pytest.raises(ValueError, match="power -2 is not supported in approx_powers_to_cache"):
        block.init(jax.random.key(0), approx_powers_to_cache=(-2,))


@pytest.mark.parametrize("case", CACHED_CASES, ids=_ids(CACHED_CASES))
def test_use_cached_without_cache(case):
    block, state, _ = case.fitted()
    v = case.vector()
    with pytest.raises(ValueError, match="use_cached=True needs an eigendecomposition"):
        block.multiply_matpower(state, v, 0.1, -1.0, exact_power=True, use_cached=True)
    if case.is_kronecker:
        with pytest.raises(ValueError, match=r"use_cached=True needs the power -1\.0"):
            block.multiply_matpower(state, v, 0.1, -1.0, exact_power=False, use_cached=True)
        # Only the -1 approximation is cached: -0.5 is missing.
        block, state, _ = case.fitted(approx_powers_to_cache=(-1.0,))
        with pytest.raises(ValueError, match=r"use_cached=True needs the power -0\.5"):
            block.multiply_matpower(state, v, 0.1, -0.5, exact_power=False, use_cached=True)


def test_dense_kronecker_rejects_bad_parameters():
    dnums = (((1,), (0,)), ((), ()))
    for params, meta in [
        ((jnp.zeros(4),), {}),  # 1-D weight.
        ((jnp.zeros((4, 3)), jnp.zeros((4,))), {}),  # Bias of the wrong size.
        ((jnp.zeros((4, 3)), jnp.zeros((3, 1))), {}),  # Bias of the wrong layout.
        ((jnp.zeros((4, 2, 3)), jnp.zeros((3,))), {}),  # Bias without all output axes.
        ((jnp.zeros((4, 3)),), {"dimension_numbers": (((1, 2), (0, 1)), ((), ()))}),  # No output.
        ((jnp.zeros((4, 3)), jnp.zeros((4,))), {"dimension_numbers": dnums}),
    ]:
        with pytest.raises(ValueError, match=r"expected parameters \(w\) or \(w, b\)"):
            KF(blocks.LayerInfo.from_params("dense_tag", params, meta=meta))


def test_dense_kronecker_accepts_row_vector_bias():
    """A ``[1, d_out]`` bias (leading axes of size 1) is the same bias row."""
    w, b = jnp.arange(12.0).reshape(4, 3), jnp.arange(3.0).reshape(1, 3)
    block = KF(blocks.LayerInfo.from_params("dense_tag", (w, b)))
    m = block.params_to_matrix((w, b))
    np.testing.assert_array_equal(m[0, 4], b[0])
    for p, q in zip(block.matrix_to_params(m), (w, b), strict=True):
        np.testing.assert_array_equal(p, q)


def test_dense_kronecker_multi_axis_weight_layout():
    """A 3-D weight (default contraction: its first axis) is a [d_in, h * k] matrix; its
    bias is an extra row; the round trip through the matrix layout is exact."""
    w, b = jnp.arange(24.0).reshape(4, 2, 3), jnp.arange(6.0).reshape(2, 3) + 100
    block = KF(blocks.LayerInfo.from_params("dense_tag", (w, b)))
    assert (block.input_size, block.output_size) == (5, 6)
    m = block.params_to_matrix((w, b))
    np.testing.assert_array_equal(m[0, :4], w.reshape(4, 6))
    np.testing.assert_array_equal(m[0, 4], b.reshape(6))
    for p, q in zip(block.matrix_to_params(m), (w, b), strict=True):
        np.testing.assert_array_equal(p, q)


def test_conv_kronecker_requires_metadata():
    layer = blocks.LayerInfo.from_params(
        "conv_tag", (jnp.zeros((4, 3, 2, 2)),), compute=tags.conv.compute
    )
    with pytest.raises(
        ValueError, match=r"no \['dimension_numbers', 'padding', 'window_strides'\]"
    ):
        CONV(layer)


def test_conv_kronecker_rejects_indivisible_groups():
    meta = tags.conv_meta((2, 4, 5, 5), (6, 2, 2, 2), feature_group_count=2)
    meta["feature_group_count"] = 4
    layer = blocks.LayerInfo.from_params("conv_tag", (jnp.zeros((6, 2, 2, 2)),), meta=meta)
    with pytest.raises(ValueError, match="not divisible"):
        CONV(layer)


@pytest.mark.parametrize("cls", [blocks.ScaleAndShiftDiagonal, blocks.ScaleAndShiftFull])
def test_scale_and_shift_requires_metadata(cls):
    params = (jnp.zeros(4), jnp.zeros(4))
    for meta in ({}, {"has_shift": True}, {"has_scale": True}):
        with pytest.raises(ValueError, match="has_scale/has_shift metadata"):
            cls(blocks.LayerInfo.from_params("scale_and_shift_tag", params, meta=meta))
    with pytest.raises(ValueError, match="parameter count does not match"):
        cls(
            blocks.LayerInfo.from_params(
                "scale_and_shift_tag", params, meta=dict(has_scale=True, has_shift=False)
            )
        )
