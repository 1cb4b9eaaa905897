"""K-FAC-reduce blocks (`kfacx.blocks.DenseTwoKroneckerFactoredReduce`,
`kfacx.blocks.ConvTwoKroneckerFactoredReduce`) against their definition:

    a_n = mean_t x_{n,t},  g_{s,n} = sum_t dy_{s,n,t},
    A = sum_n a_n a_n^T / B,  G = sum_{s,n} g_{s,n} g_{s,n}^T / B,

equal to K-FAC-expand with one position, exact where expand is not (a linear layer
whose outputs are averaged over the positions before the loss, at batch 1), and with
products equal to the dense matrix's powers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kfacx
from kfacx import blocks

from ._cases import (
    conv_case,
    conv_patches_reference,
    dense_case,
    factor_value,
    fast_jit,
    jit_statistics,
    kronecker_dense,
)

DENSE_REDUCE = blocks.DenseTwoKroneckerFactoredReduce
CONV_REDUCE = blocks.ConvTwoKroneckerFactoredReduce


def _stats(case, seed=0, mask=None):
    block = case.block()
    data = case.data(seed)
    if mask is not None:
        data = dict(data, mask=jnp.asarray(mask, jnp.float32))
    batch = case.batch_size if mask is None else float(np.sum(mask))
    # Jitted: one compilation instead of one per operation run eagerly.
    stats = jit_statistics(block)(data, batch)
    return data, [np.asarray(s, np.float64) for s in stats]


def _reference(x_rows, dy_rows, bias, batch, mask=None):
    """``(A, G)`` of the definition from ``x_rows [B, T, n]`` and ``dy_rows [S, B, T, m]``
    (per feature group: a trailing group axis is handled by the caller)."""
    a = x_rows.mean(axis=1)
    if bias:
        a = np.concatenate([a, np.ones((a.shape[0], 1))], axis=1)
    weights = np.ones(a.shape[0]) if mask is None else np.asarray(mask, np.float64)
    big_a = (a * weights[:, None]).T @ a / weights.sum()
    g = dy_rows.sum(axis=2).reshape(-1, dy_rows.shape[-1])
    return big_a, g.T @ g / batch


@pytest.mark.parametrize("bias", [False, True])
def test_dense_statistics_are_the_reduced_second_moments(bias):
    case = dense_case("seq", (3, 4, 5), 2, bias, DENSE_REDUCE, num_samples=2)
    data, (a, g) = _stats(case)
    x = np.asarray(data["inputs"][0], np.float64)
    dy = np.asarray(data["outputs_tangent"][0], np.float64)
    want_a, want_g = _reference(x, dy, bias, case.batch_size)
    np.testing.assert_allclose(a[0], want_a, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(g[0], want_g, rtol=1e-5, atol=1e-6)
    # Not expand's: the positions are reduced, not treated as examples.
    _, (expand_a, _) = _stats(dense_case("seq", (3, 4, 5), 2, bias, num_samples=2))
    assert not np.allclose(a, expand_a, rtol=1e-2)


def test_dense_with_several_position_axes_and_a_padding_mask():
    case = dense_case("grid", (3, 2, 2, 4), 3, True, DENSE_REDUCE)
    mask = np.array([1.0, 0.0, 1.0])
    data, (a, _) = _stats(case, mask=mask)
    x = np.asarray(data["inputs"][0], np.float64).reshape(3, 4, 4)
    dy = np.asarray(data["outputs_tangent"][0], np.float64).reshape(-1, 3, 4, 3)
    want_a, _ = _reference(x, dy, True, 2.0, mask)
    np.testing.assert_allclose(a[0], want_a, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("expand", "reduce"),
    [
        (
            dense_case("one", (4, 5), 3, True, num_samples=2),
            dense_case("one", (4, 5), 3, True, DENSE_REDUCE, num_samples=2),
        ),
        (
            conv_case("pixel", (2, 2, 3, 3), (4, 2, 3, 3), True),
            conv_case("pixel", (2, 2, 3, 3), (4, 2, 3, 3), True, CONV_REDUCE),
        ),
    ],
    ids=["dense", "conv_1x1_output"],
)
def test_reduce_equals_expand_with_one_position(expand, reduce):
    for got, want in zip(_stats(reduce)[1], _stats(expand)[1], strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("layout", ["NHWC", "NCHW"])
def test_conv_statistics_are_the_reduced_patch_moments(layout):
    if layout == "NHWC":
        case = conv_case(
            "c",
            (2, 4, 4, 4),
            (3, 3, 2, 4),
            True,
            CONV_REDUCE,
            dimension_numbers=("NHWC", "HWIO", "NHWC"),
            feature_group_count=2,
        )
    else:
        case = conv_case(
            "c",
            (2, 4, 5, 5),
            (6, 4, 3, 3),
            False,
            CONV_REDUCE,
            dimension_numbers=("NCHW", "OIHW", "NCHW"),
            window_strides=(2, 2),
            padding="SAME",
        )
    block = case.block()
    data, (a, g) = _stats(case)
    patches = conv_patches_reference(block, data["inputs"][0])  # [B * T, groups, k]
    batch, groups = case.batch_size, block.num_groups
    patches = patches.reshape(batch, -1, groups, patches.shape[-1])
    dy = np.asarray(data["outputs_tangent"][0], np.float64)
    out_spec = block.dnums.out_spec
    dy = np.moveaxis(dy, (out_spec[0] + 1, out_spec[1] + 1), (1, -1))
    dy = dy.reshape(dy.shape[0], batch, -1, groups, block.out_per_group)
    for k in range(groups):
        want_a, want_g = _reference(patches[:, :, k], dy[..., k, :], block.has_bias, batch)
        np.testing.assert_allclose(a[k], want_a, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(g[k], want_g, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("power", [1.0, -1.0, -0.5])
def test_products_are_the_dense_matrix_powers(power):
    case = dense_case("seq", (3, 4, 5), 2, True, DENSE_REDUCE)
    block, state, _ = case.fitted(exact_powers_to_cache=(power,) if power != 1 else ())
    weight = 0.3

    @fast_jit  # one compilation instead of one per operation run eagerly
    def run(state, v):
        state = block.update_cache(state, weight)
        cached = power != 1
        return state, block.multiply_matpower(state, v, weight, power, True, cached)

    v = case.vector()
    state, got = run(state, v)
    a, g = (factor_value(f) for f in state.factors)
    dense = kronecker_dense(block, a, g) + weight * np.eye(block.dim)
    vals, vecs = np.linalg.eigh(dense)
    want = vecs @ np.diag(vals**power) @ vecs.T
    flat = np.concatenate([np.ravel(x) for x in v]).astype(np.float64)
    got = np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in got])
    np.testing.assert_allclose(got, want @ flat, rtol=2e-4, atol=1e-5)


def test_reduce_is_the_exact_gauss_newton_block_where_expand_is_not():
    """``y = mean_t (x_t @ w + b)`` with a squared error at batch 1: the Gauss-Newton
    matrix is ``(a a^T) (x) 2 I`` with ``a`` the averaged input (and 1): K-FAC-reduce's
    block, not expand's."""

    def loss_fn(params, batch):
        x, t = batch
        y = jnp.mean(x @ params["w"] + params["b"][None, None], axis=1)
        kfacx.register_squared_error_loss(y, t)
        return jnp.mean(jnp.sum((y - t) ** 2, axis=-1))

    with jax.enable_x64():
        rng = np.random.default_rng(0)
        params = dict(w=jnp.asarray(rng.standard_normal((4, 3))), b=jnp.zeros(3))
        batch = (jnp.asarray(rng.standard_normal((1, 5, 4))), jnp.zeros((1, 3)))

        def block_of(ctor):
            est = kfacx.BlockDiagonalCurvature(
                loss_fn,
                default_estimation_mode="ggn_exact",
                layer_tag_to_block_ctor={"dense_tag": ctor},
            )
            state = est.init(jax.random.key(0), (params, batch))

            @jax.jit  # one compilation instead of one per operation run eagerly
            def dense_block(state, args):
                _, _, stats = est.value_grads_and_curvature_stats(jax.random.key(1), args)
                state = est.update_curvature_estimate_from_stats(state, stats, 0.0, 1.0)
                return est.to_dense_matrix(state)

            return np.asarray(dense_block(state, (params, batch)))

        def outputs(flat):  # the parameters in leaf order: b, then w
            b, w = flat[:3], flat[3:].reshape(4, 3)
            return jnp.mean(batch[0] @ w + b[None, None], axis=1)[0]

        flat = np.concatenate([params["b"], np.ravel(params["w"])])
        # one compilation instead of one per operation run eagerly
        jac = np.asarray(jax.jit(jax.jacobian(outputs))(flat))
        exact = 2 * jac.T @ jac  # the squared error's Hessian is 2 I
        np.testing.assert_allclose(block_of(DENSE_REDUCE), exact, rtol=1e-10, atol=1e-12)
        assert not np.allclose(block_of(blocks.DenseTwoKroneckerFactored), exact, atol=1e-3)
