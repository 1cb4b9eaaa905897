"""kfac-jax's estimator classes on kfacx: the exact-curvature estimators against products
built here from `jax.jvp` / `jax.vjp` and the loss's Hessian, the block-diagonal
estimator's kfac-jax views (``index_to_block_ctor``, ``param_order``, dense blocks in
leaf order, eigenvalues, caches asked for late) and `OptaxPreconditioner` against kfacx's
own estimator; the curried tracer functions against kfacx's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kfacx
import kfacx.kfac_jax as kfac_jax

B, D_IN, D_HID, D_OUT = 6, 3, 4, 3


def _params(seed=0):
    k = jax.random.split(jax.random.PRNGKey(seed), 4)
    # Leaves in pytree order: l1/b, l1/w, l2/b, l2/w (the tag's order is w, b).
    return {
        "l1": {
            "b": 0.1 * jax.random.normal(k[0], (D_HID,)),
            "w": jax.random.normal(k[1], (D_IN, D_HID)),
        },
        "l2": {
            "b": 0.1 * jax.random.normal(k[2], (D_OUT,)),
            "w": jax.random.normal(k[3], (D_HID, D_OUT)),
        },
    }


def _batch(seed=1):
    kx, ky = jax.random.split(jax.random.PRNGKey(seed))
    return jax.random.normal(kx, (B, D_IN)), jax.random.randint(ky, (B,), 0, D_OUT)


def _logits(params, x):
    h = jnp.tanh(x @ params["l1"]["w"] + params["l1"]["b"][None])
    return h @ params["l2"]["w"] + params["l2"]["b"][None]


def _ce(logits, y):
    return -jnp.sum(jax.nn.log_softmax(logits)[jnp.arange(B), y])


def loss_fn(params, batch):
    x, y = batch
    logits = _logits(params, x)
    kfac_jax.register_softmax_cross_entropy_loss(logits, y)
    return _ce(logits, y) / B


def _ggn_product(params, batch, v):
    """``J^T H J v / B`` from jax.jvp, the Hessian of the summed cross-entropy in the
    logits, and jax.vjp."""
    x, y = batch
    logits, jv = jax.jvp(lambda p: _logits(p, x), (params,), (v,))
    hjv = jax.jvp(jax.grad(lambda z: _ce(z, y)), (logits,), (jv,))[1]
    (out,) = jax.vjp(lambda p: _logits(p, x), params)[1](hjv)
    return jax.tree_util.tree_map(lambda t: t / B, out)


def _flat(tree):
    return jnp.concatenate([x.reshape(-1) for x in jax.tree_util.tree_leaves(tree)])


def _close(a, b, tol=1e-10):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        np.testing.assert_allclose(x, y, rtol=tol, atol=tol)


@pytest.fixture(scope="module")
def setup():
    with jax.enable_x64(True):
        params, batch = _params(), _batch()
        v = _params(seed=2)
        yield params, batch, v


def test_implicit_products_are_the_exact_ones(setup):
    params, batch, v = setup
    implicit = kfac_jax.ImplicitExactCurvature(loss_fn)
    want = _ggn_product(params, batch, v)
    _close(implicit.multiply_ggn((params, batch), v), want)
    _close(implicit.multiply_fisher((params, batch), v), want)
    # B B^T v through the factors is the same product.
    inner = implicit.multiply_ggn_factor_transpose((params, batch), v)
    _close(implicit.multiply_ggn_factor((params, batch), inner), want)
    hvp = jax.jvp(jax.grad(lambda p: B * loss_fn(p, batch)), (params,), (v,))[1]
    _close(
        implicit.multiply_hessian((params, batch), v), jax.tree_util.tree_map(lambda t: t / B, hvp)
    )


def test_explicit_matrix_is_the_exact_ggn_and_its_blocks_are_kfacx_full_blocks(setup):
    params, batch, _ = setup
    rng = jax.random.PRNGKey(0)
    explicit = kfac_jax.ExplicitExactCurvature(loss_fn, default_estimation_mode="ggn_exact")
    state = explicit.init(rng, (params, batch))
    state = explicit.update_curvature_matrix_estimate(state, 0.0, 1.0, 0.0, B, rng, (params, batch))
    dense = explicit.to_dense_matrix(state)
    leaves, treedef = jax.tree_util.tree_flatten(params)
    sizes = np.cumsum([0] + [x.size for x in leaves])

    def unit(i):
        e = jnp.zeros(sizes[-1]).at[i].set(1.0)
        parts = [
            e[a:b].reshape(x.shape) for a, b, x in zip(sizes[:-1], sizes[1:], leaves, strict=True)
        ]
        return jax.tree_util.tree_unflatten(treedef, parts)

    columns = jnp.stack([_flat(_ggn_product(params, batch, unit(i))) for i in range(sizes[-1])], 1)
    np.testing.assert_allclose(dense, columns, rtol=1e-10, atol=1e-12)
    # kfacx's own estimator with Full blocks gives its diagonal blocks (leaf order within).
    est = kfac_jax.BlockDiagonalCurvature(
        loss_fn, layer_tag_to_block_ctor={"dense": kfac_jax.DenseFull}
    )
    bstate = est.init(rng, (params, batch))
    bstate = est.update_curvature_matrix_estimate(
        bstate, 0.0, 1.0, 0.0, B, rng, (params, batch), estimation_mode="ggn_exact"
    )
    blocks = est.to_diagonal_block_dense_matrix(bstate)
    assert list(est.param_order) == [1, 0, 3, 2]
    start = 0
    for block in blocks:
        stop = start + block.shape[0]
        np.testing.assert_allclose(block, dense[start:stop, start:stop], rtol=1e-10, atol=1e-12)
        start = stop
    with pytest.raises(ValueError, match="ExplicitExactCurvature serves estimation_mode"):
        kfac_jax.ExplicitExactCurvature(loss_fn, default_estimation_mode="fisher_gradients")


def test_index_to_block_ctor_is_honoured_and_checked(setup):
    params, batch, v = setup
    rng = jax.random.PRNGKey(0)
    est = kfac_jax.BlockDiagonalCurvature(
        loss_fn, index_to_block_ctor={(3, 2): kfac_jax.ScaledIdentity}
    )
    state = est.init(rng, (params, batch))
    state = est.update_curvature_matrix_estimate(
        state, 0.0, 1.0, 0.0, B, rng, (params, batch), estimation_mode="ggn_exact"
    )
    assert [b.block_name for b in est.blocks] == ["DenseTwoKroneckerFactored", "ScaledIdentity"]
    out = est.multiply_inverse(state, v, 0.5)
    _close(out["l2"], jax.tree_util.tree_map(lambda t: t / 1.5, v["l2"]))
    eig = est.block_eigenvalues(state, False)
    dense = est.to_diagonal_block_dense_matrix(state)
    np.testing.assert_allclose(
        np.sort(eig[0].reshape(-1)), np.linalg.eigvalsh(dense[0]), rtol=1e-8, atol=1e-12
    )
    np.testing.assert_allclose(eig[1], np.ones(D_HID * D_OUT + D_OUT))
    bad = kfac_jax.BlockDiagonalCurvature(loss_fn, index_to_block_ctor={(0, 3): kfac_jax.DenseFull})
    with pytest.raises(ValueError, match=r"index_to_block_ctor has keys \[\(0, 3\)\]"):
        bad.init(rng, (params, batch))
    with pytest.raises(TypeError, match="tuple of parameter-leaf indices"):
        kfac_jax.BlockDiagonalCurvature(loss_fn, index_to_block_ctor={"dense": kfac_jax.DenseFull})


def test_update_cache_adds_the_powers_it_is_asked_for(setup):
    params, batch, v = setup
    rng = jax.random.PRNGKey(0)
    est = kfac_jax.BlockDiagonalCurvature(loss_fn)
    state = est.init(rng, (params, batch))
    state = est.update_curvature_matrix_estimate(
        state, 0.0, 1.0, 0.0, B, rng, (params, batch), estimation_mode="ggn_exact"
    )
    cached = est.update_cache(state, 0.1, exact_powers=-1, eigenvalues=True)
    _close(
        est.multiply_inverse(cached, v, 0.1, True, True),
        est.multiply_inverse(state, v, 0.1, True, False),
        tol=1e-9,
    )


def test_optax_preconditioner_is_kfacx_estimator_inverse(setup):
    params, batch, v = setup
    rng = jax.random.PRNGKey(0)
    precon = kfac_jax.OptaxPreconditioner(
        loss_fn,
        damping=0.1,
        curvature_ema=0.0,
        estimation_mode="ggn_exact",
        inverse_update_period=1,
    )
    state = precon.init((params, batch), rng)
    state = precon.maybe_update(state, (params, batch), rng)
    native = kfacx.BlockDiagonalCurvature(loss_fn, default_estimation_mode="ggn_exact")
    nstate = native.init(rng, (params, batch))
    nstate = native.update_curvature_matrix_estimate(nstate, 0.0, 1.0, B, rng, (params, batch))
    want = native.multiply_inverse(nstate, v, 0.1)
    _close(precon.apply(v, state), want)
    tx = precon.as_gradient_transform()
    got, _ = tx.update(v, tx.init(params), precond_state=state)
    _close(got, want)
    assert int(precon.increment_count(state).count) == 1


def test_curried_tracer_functions_are_kfacx_functions(setup):
    params, batch, v = setup
    jvp, _ = kfac_jax.tracer.loss_tags_jvp(loss_fn)
    losses, tangents = jvp((params, batch), v)
    native_losses, native_tangents = kfacx.tracer.loss_tags_jvp(loss_fn, (params, batch), v)
    _close(tangents, tuple((t,) for t in native_tangents))
    # kfac-jax's evaluate: the loss of every example (kfacx's: their batch mean).
    np.testing.assert_allclose(jnp.mean(losses[0].evaluate()), native_losses[0].evaluate())
    assert isinstance(losses[0], kfac_jax.NegativeLogProbLoss)
    vjp_fn, _ = kfac_jax.tracer.loss_tags_vjp(loss_fn)
    _, vjp = vjp_fn((params, batch))
    _close(vjp(tangents), kfacx.tracer.loss_tags_vjp(loss_fn, (params, batch))[1](native_tangents))
    layers_fn, _ = kfac_jax.tracer.layer_tags_vjp(loss_fn)
    _, layers_vjp = layers_fn((params, batch))
    data = layers_vjp(tangents)
    (grads,) = jax.vjp(lambda p: _logits(p, batch[0]), params)[1](tangents[0][0])
    assert [type(d).__name__ for d in data] == ["LayerVjpData"] * 2
    _close(data[1].tangents.params, (grads["l2"]["w"], grads["l2"]["b"]))
    _close(data[0].primals.inputs, (batch[0],))
    hvp_fn, _ = kfac_jax.tracer.loss_tags_hvp(loss_fn)
    hvp, _ = hvp_fn((params, batch), v)
    _close(hvp, jax.jvp(jax.grad(lambda p: B * loss_fn(p, batch)), (params,), (v,))[1], tol=1e-9)


def test_optax_preconditioner_and_tracer_errors_name_the_argument():
    with pytest.raises(ValueError, match="exactly one of damping and damping_schedule"):
        kfac_jax.OptaxPreconditioner(loss_fn)
    with pytest.raises(ValueError, match="curvature_update_period=2"):
        kfac_jax.OptaxPreconditioner(loss_fn, damping=1.0, curvature_update_period=2)
    params, batch = _params(), _batch()
    vjp_fn, _ = kfac_jax.tracer.loss_tags_vjp(loss_fn)
    _, vjp = vjp_fn((params, batch))
    logits = _logits(params, batch[0])
    with pytest.raises(ValueError, match="loss 0 was given 2 arrays"):
        vjp([(logits, logits)])


def test_explicit_exact_curvature_rejects_unknown_arguments():
    with pytest.raises(TypeError, match=r"unexpected arguments \['num_sample'\]"):
        kfac_jax.ExplicitExactCurvature(loss_fn, num_sample=2)
    with pytest.raises(ValueError, match="Exactly one of `func` and `func_and_grad`"):
        kfac_jax.ExplicitExactCurvature()
