"""Shared property tests of all curvature blocks (see tests/blocks/test_blocks.py): jit
against eager, pytree round trips, float32 and bfloat16 dtypes, pmap averaging.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kfacx import blocks

from . import _cases as C
from ._block_table import (
    DAMPING,
    PRODUCT_CASES,
    REPRESENTATIVE_CASES,
    TOL,
    _config_id,
    _exact_reference,
    _ids,
)

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
