"""`kfacx.BlockDiagonalCurvature` on bad input: unknown modes, bad arguments, untagged
parameters, use before init, vectors of the wrong structure; and the parameter / block
round trip.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _estimator_cases import SIZES_2, estimate, random_like
from _models import dense, init_mlp, make_batch, make_tagged_mlp

import kfacx

# ----------------------------------------------------------------------------- errors


def _fitted_small():
    params = init_mlp(SIZES_2)
    batch = make_batch("softmax", SIZES_2, batch=3)
    est = kfacx.BlockDiagonalCurvature(
        make_tagged_mlp("softmax"), default_estimation_mode="ggn_exact"
    )
    state, _ = estimate(est, params, batch)
    return est, state, params, batch


def test_unknown_estimation_mode_raises():
    with pytest.raises(ValueError, match="estimation_mode"):
        kfacx.BlockDiagonalCurvature(make_tagged_mlp("softmax"), default_estimation_mode="bogus")
    est, state, params, batch = _fitted_small()
    with pytest.raises(ValueError, match="bogus"):
        est.update_curvature_matrix_estimate(
            state, 0.0, 1.0, None, jax.random.PRNGKey(0), (params, batch), estimation_mode="bogus"
        )


@pytest.mark.parametrize("num_samples", [0, -1, 2.0])
def test_bad_num_samples_raises(num_samples):
    with pytest.raises(ValueError, match="num_samples"):
        kfacx.BlockDiagonalCurvature(make_tagged_mlp("softmax"), num_samples=num_samples)


def test_parameter_without_tag_raises_naming_it():
    params = {"layers": init_mlp(SIZES_2), "temperature": jnp.ones((), jnp.float32)}
    batch = make_batch("softmax", SIZES_2, batch=3)

    def loss_fn(params, batch):
        x, t = batch
        (w1, b1), (w2, b2) = params["layers"]
        h = jnp.tanh(kfacx.register_dense(dense(x, w1, b1), x, w1, b1))
        logits = kfacx.register_dense(dense(h, w2, b2), h, w2, b2) * params["temperature"]
        return kfacx.register_softmax_cross_entropy_loss(logits, t).sum()

    est = kfacx.BlockDiagonalCurvature(loss_fn, auto_register_tags=False)
    with pytest.raises(ValueError, match="temperature"):
        est.init(jax.random.PRNGKey(0), (params, batch))


def test_non_callable_block_ctor_raises():
    with pytest.raises(TypeError, match="dense_tag"):
        kfacx.BlockDiagonalCurvature(
            make_tagged_mlp("softmax"), layer_tag_to_block_ctor={"dense_tag": "Full"}
        )


def test_non_callable_func_raises():
    with pytest.raises(TypeError, match="callable"):
        kfacx.BlockDiagonalCurvature(None)


@pytest.mark.parametrize("damping", [0.0, -1.0, float("nan")])
def test_bad_damping_raises(damping):
    est, state, params, _ = _fitted_small()
    v = random_like(params, seed=0)
    with pytest.raises(ValueError, match="damping"):
        est.multiply_inverse(state, v, damping)
    with pytest.raises(ValueError, match="damping"):
        est.multiply_inverse(state, v, damping, exact_power=True)
    with pytest.raises(ValueError, match="damping"):
        est.multiply_matpower(state, v, damping, -0.5)
    with pytest.raises(ValueError, match="damping"):
        est.update_cache(state, damping)


def test_use_before_init_raises():
    params = init_mlp(SIZES_2)
    est = kfacx.BlockDiagonalCurvature(make_tagged_mlp("softmax"))
    with pytest.raises(ValueError, match="init"):
        _ = est.blocks
    with pytest.raises(ValueError, match="init"):
        est.multiply(None, params)
    with pytest.raises(ValueError, match="init"):
        est.to_dense_matrix(None)


def test_vector_with_wrong_structure_raises():
    est, state, params, _ = _fitted_small()
    with pytest.raises(ValueError, match="structure"):
        est.multiply(state, params[:1])
    with pytest.raises(ValueError, match="structure"):
        est.multiply(state, {"w": params[0][0]})
    with pytest.raises(ValueError, match="shape"):
        est.multiply(state, [(params[0][0].T, params[0][1]), params[1]])


def test_params_to_blocks_round_trip():
    est, _, params, _ = _fitted_small()
    split = est.params_to_blocks(params)
    assert len(split) == 2
    back = est.blocks_to_params(split)
    assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(params)
    for a, b in zip(
        jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(params), strict=True
    ):
        np.testing.assert_array_equal(a, b)
