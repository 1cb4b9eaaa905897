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

This file checks the statistics and the matrix powers; jit, pytrees, dtypes and pmap
are checked in tests/blocks/test_blocks_transforms.py, error messages in
tests/blocks/test_blocks_errors.py. The table of cases lives in
tests/blocks/_block_table.py.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kfacx import blocks

from . import _cases as C
from ._block_table import (
    CASES,
    DAMPING,
    DENSE_KRONECKER_CASES,
    KF,
    PRODUCT_CASES,
    PRODUCT_KRONECKER_CASES,
    SPECIAL_CASES,
    _check_product,
    _ids,
    _product_params,
)

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
