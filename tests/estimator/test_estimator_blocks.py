"""`kfacx.BlockDiagonalCurvature` with other blocks and layers than a plain dense
Kronecker-factored one, against the exact GGN: full and diagonal blocks, multi-axis dense
layers, embeddings, tied weights.
"""

from __future__ import annotations

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _estimator_cases import (
    SIZES_2,
    _jitted_ggn_exact_dense,
    assert_close,
    estimate,
    masked_to_blocks,
)
from _models import exact_ggn, init_mlp, make_batch, make_tagged_mlp, mlp_layer_index
from jax.flatten_util import ravel_pytree

import kfacx

# ----------------------------------------------------------------------------- other blocks


@pytest.mark.parametrize("batch_size", [1, 3])
def test_full_blocks_equal_exact_ggn_blocks(batch_size):
    params = init_mlp(SIZES_2, seed=17)
    x, t = make_batch("softmax", SIZES_2, batch=batch_size, seed=18)
    est = kfacx.BlockDiagonalCurvature(
        make_tagged_mlp("softmax"),
        layer_tag_to_block_ctor={"dense_tag": kfacx.blocks.Full},
        default_estimation_mode="ggn_exact",
    )
    _, matrix = estimate(est, params, (x, t), jit=True)
    assert all(type(b) is kfacx.blocks.Full for b in est.blocks)
    ggn = exact_ggn("softmax", params, x, 1.0)
    assert_close(matrix, masked_to_blocks(ggn, mlp_layer_index(params)))


def test_diagonal_blocks_equal_exact_ggn_diagonal():
    params = init_mlp(SIZES_2, seed=17)
    x, t = make_batch("softmax", SIZES_2, batch=1, seed=18)
    est = kfacx.BlockDiagonalCurvature(
        make_tagged_mlp("softmax"),
        layer_tag_to_block_ctor={"dense_tag": kfacx.blocks.Diagonal},
        default_estimation_mode="ggn_exact",
    )
    _, matrix = estimate(est, params, (x, t), jit=True)
    assert all(type(b) is kfacx.blocks.Diagonal for b in est.blocks)
    ggn = exact_ggn("softmax", params, x, 1.0)
    assert_close(matrix, np.diag(np.diag(ggn)))


def test_default_blocks_are_dense_kronecker():
    params = init_mlp(SIZES_2)
    est = kfacx.BlockDiagonalCurvature(make_tagged_mlp("softmax"))
    est.init(jax.random.PRNGKey(0), (params, make_batch("softmax", SIZES_2, 2)))
    assert len(est.blocks) == 2
    assert all(type(b) is kfacx.DenseTwoKroneckerFactored for b in est.blocks)


# ----------------------------------------------------------------------------- multi-axis dense


def _attention_like_loss(params, batch):
    x, labels = batch
    w1, b1, w2 = params["w1"], params["b1"], params["w2"]
    dn1 = (((2,), (0,)), ((), ()))
    h = jnp.einsum("btd,dhk->bthk", x, w1) + jnp.broadcast_to(b1, (*x.shape[:2], *b1.shape))
    h = jnp.tanh(kfacx.register_dense(h, x, w1, b1, dimension_numbers=dn1))
    logits = jnp.einsum("bthk,hko->bto", h, w2)
    logits = kfacx.register_dense(logits, h, w2, dimension_numbers=(((2, 3), (0, 1)), ((), ())))
    logits = kfacx.register_softmax_cross_entropy_loss(logits, labels)
    log_p = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(log_p, labels[..., None], axis=-1))


def test_multi_axis_dense_blocks_equal_exact_ggn_blocks():
    """einsum('btd,dhk->bthk') and einsum('bthk,hko->bto') layers: the Kronecker blocks
    of ggn_exact equal the exact Gauss-Newton blocks for one example and position."""
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    params = {
        "w1": 0.7 * jax.random.normal(keys[0], (4, 2, 3)),
        "b1": 0.1 * jax.random.normal(keys[1], (2, 3)),
        "w2": 0.7 * jax.random.normal(keys[2], (2, 3, 5)),
    }
    x = jax.random.normal(keys[3], (1, 1, 4))
    labels = jnp.array([[2]])
    est = kfacx.BlockDiagonalCurvature(_attention_like_loss)
    state = est.init(jax.random.PRNGKey(1), (params, (x, labels)))

    got = _jitted_ggn_exact_dense(est, state, (params, (x, labels)))

    flat, unravel = ravel_pytree(params)

    def logits_fn(f):
        p = unravel(f)
        h = jnp.einsum("btd,dhk->bthk", x, p["w1"])
        h = jnp.tanh(h + jnp.broadcast_to(p["b1"], h.shape))
        return jnp.einsum("bthk,hko->bto", h, p["w2"]).reshape(-1)

    jac = np.asarray(jax.jit(jax.jacfwd(logits_fn))(flat), np.float64)
    prob = np.asarray(jax.nn.softmax(logits_fn(flat)), np.float64)
    exact = jac.T @ (np.diag(prob) - np.outer(prob, prob)) @ jac
    # Leaf order (sorted dict keys): b1, w1, w2; the first block is (w1, b1).
    sizes = {"b1": 6, "w1": 24, "w2": 30}
    offsets = {"b1": 0, "w1": 6, "w2": 30}
    first = np.r_[offsets["b1"] : 6, offsets["w1"] : 30]
    second = np.arange(30, 60)
    for idx in (first, second):
        np.testing.assert_allclose(got[np.ix_(idx, idx)], exact[np.ix_(idx, idx)], atol=1e-5)
    np.testing.assert_allclose(got[np.ix_(first, second)], 0.0)
    assert sum(sizes.values()) == got.shape[0]


# ----------------------------------------------------------------------------- embeddings


def test_detected_embedding_block_equals_exact_ggn_block():
    """hk.Embed is detected; for one example and one position its Kronecker block
    (diagonal input factor) equals the exact Gauss-Newton block."""

    def fn(ids):
        e = hk.Embed(7, 4)(ids)
        return hk.Linear(3)(jnp.tanh(e.reshape(e.shape[0], -1)))

    net = hk.without_apply_rng(hk.transform(fn))
    ids, labels = np.array([[5]], np.int32), np.array([2])
    params = net.init(jax.random.PRNGKey(0), ids)

    def loss(params, batch):
        ids, labels = batch
        logits = kfacx.register_softmax_cross_entropy_loss(net.apply(params, ids), labels)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], 1))

    est = kfacx.BlockDiagonalCurvature(loss)
    state = est.init(jax.random.PRNGKey(1), (params, (ids, labels)))
    assert isinstance(est.blocks[0], kfacx.EmbeddingKroneckerFactored)
    assert est.report.unmatched == ()
    got = _jitted_ggn_exact_dense(est, state, (params, (ids, labels)))
    flat, unravel = ravel_pytree(params)
    logits = jax.jit(jax.jacfwd(lambda f: net.apply(unravel(f), ids).reshape(-1)))
    jac = np.asarray(logits(flat), np.float64)
    prob = np.asarray(jax.nn.softmax(net.apply(params, ids)).reshape(-1), np.float64)
    exact = jac.T @ (np.diag(prob) - np.outer(prob, prob)) @ jac
    table = np.arange(28)  # ravel_pytree order: embed/embeddings first
    np.testing.assert_allclose(got[np.ix_(table, table)], exact[np.ix_(table, table)], atol=1e-6)


# ----------------------------------------------------------------------------- weight sharing


def _tied_loss(params, batch, eps=(0.0, 0.0)):
    x, t = batch
    w, b = params["w"], params["b"]
    h1 = x @ w + jnp.broadcast_to(b, (x.shape[0], 3)) + eps[0]
    h2 = jnp.tanh(h1) @ w + jnp.broadcast_to(b, (x.shape[0], 3)) + eps[1]
    logits = kfacx.register_softmax_cross_entropy_loss(jnp.tanh(h2) @ params["out"], t)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), t[:, None], 1)), (x, h1)


def test_tied_weights_are_one_block_with_uses_folded_into_the_batch():
    """The same dense layer applied twice: one block whose input factor averages the
    inputs of both uses and whose output factor sums their cotangent moments."""
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    params = dict(
        w=jax.random.normal(keys[0], (3, 3)),
        b=0.1 * jax.random.normal(keys[1], (3,)),
        out=jax.random.normal(keys[2], (3, 4)),
    )
    x, t = jax.random.normal(keys[3], (5, 3)), jnp.arange(5) % 4
    loss = lambda p, batch: _tied_loss(p, batch)[0]  # noqa: E731
    est = kfacx.BlockDiagonalCurvature(loss)
    state = est.init(jax.random.PRNGKey(1), (params, (x, t)))
    update = jax.jit(  # one program instead of every operation compiled on its own
        lambda s, args: est.update_curvature_matrix_estimate(
            s, 0.0, 1.0, None, jax.random.PRNGKey(2), args, "fisher_empirical"
        )
    )
    state = update(state, (params, (x, t)))
    assert len(est.blocks) == 2 and est.report.unmatched == ()
    assert {e.path: e.uses for e in est.report.entries} == {"b": 2, "out": 1, "w": 2}
    assert "0 (x2)" in str(est.report)
    a, g = (np.asarray(f.value[0], np.float64) for f in state.blocks[0].factors)

    # Reference: per-example gradients w.r.t. each use's output, by perturbation.
    def summed(eps):
        return _tied_loss(params, (x, t), eps)[0] * x.shape[0]

    eps = (jnp.zeros((5, 3)), jnp.zeros((5, 3)))
    dy1, dy2 = (np.asarray(d, np.float64) for d in jax.jit(jax.grad(summed))(eps))
    _, (x1, h1) = _tied_loss(params, (x, t))
    rows = np.concatenate([np.asarray(x1), np.tanh(np.asarray(h1))], 0)
    rows = np.concatenate([rows, np.ones((10, 1))], 1)
    np.testing.assert_allclose(a, rows.T @ rows / 10, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(g, (dy1.T @ dy1 + dy2.T @ dy2) / 5, rtol=1e-4, atol=1e-6)
