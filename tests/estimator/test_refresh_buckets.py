"""The bucketed refresh computes what each block's own refresh computes: in float64,
to 1e-10, for every block family and for the tied, stacked, view and sliced blocks, and
under every placement of the optimizer's step.

`update_cache` pads the factors of all blocks with a damped-inverse plan
(`kfacx.blocks.CurvatureBlock.inverse_refresh`) into size buckets and inverts each
bucket as one stack; ``kfacx.estimator._refresh.BATCH_INVERSES = False`` makes every
block refresh itself instead (`update_cache` of the block), the per-layer reference.
One model holds a layer of every kind detection finds: a tied embedding, a
convolution, dense layers (one wide enough for a bucket of its own), a scale and
shift, a scanned stack, a masked weight and fused gates (views of their leaves), and a
GRU-style weight split between two layers.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kfacx
from kfacx._helpers import _tree
from kfacx.estimator import _refresh

B, V, E, C, L, W = 8, 11, 6, 3, 2, 70
MASK = np.tril(np.ones((E, E)))
DAMPING = 1e-2


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


def _conv(x, w):
    dims = ("NHWC", "HWIO", "NHWC")
    return jax.lax.conv_general_dilated(x, w, (1, 1), "VALID", dimension_numbers=dims)


def loss(p, batch):
    ids, images, targets = batch
    e = jnp.take(p["emb"], ids, axis=0)  # the embedding, tied to the output layer
    c = jnp.tanh(_conv(images, p["conv_w"]) + p["conv_b"][None, None, None])
    h = jnp.tanh(c.reshape(c.shape[0], -1) @ p["w_in"] + p["b_in"][None]) + e
    h = h * p["scale"][None] + p["shift"][None]
    h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), h, p["stack"])
    h = jnp.tanh(h @ (p["w_mask"] * MASK))
    z = h @ jnp.concatenate([p["w_i"], p["w_f"]], axis=1)  # fused gates
    h = jnp.tanh(z[:, :E]) * jax.nn.sigmoid(z[:, E:])
    w_z, w_a = jnp.split(p["w_h"], [E], axis=1)  # one weight, two layers
    h = jnp.tanh((jax.nn.sigmoid(h @ w_z) * h) @ w_a)
    h = h + jnp.tanh(h @ p["w_wide"]) @ p["w_back"]
    logits = h @ p["emb"].T
    kfacx.register_softmax_cross_entropy_loss(logits, targets)
    log_p = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(log_p, targets[:, None], axis=1))


#: The blocks detection gives the model (family "kfac"), in order.
KFAC_BLOCKS = [
    "TiedKroneckerFactored",
    "ConvTwoKroneckerFactored",
    "DenseTwoKroneckerFactored",
    "ScaleAndShiftDiagonal",
    "StackedBlock",
    "ViewBlock",
    "ViewBlock",
    "SlicedBlock",
    "DenseTwoKroneckerFactored",
    "DenseTwoKroneckerFactored",
]


def _inputs():
    """``(params, batch)`` as host float64 arrays (integer ids and targets)."""
    rng = np.random.default_rng(0)

    def normal(*shape, scale=1.0):
        return scale * rng.standard_normal(shape) / np.sqrt(shape[-2] if len(shape) > 1 else 1)

    params = dict(
        emb=normal(V, E),
        conv_w=normal(2, 2, 1, C),
        conv_b=normal(C, scale=0.1),
        w_in=normal(9 * C, E),
        b_in=normal(E, scale=0.1),
        scale=1.0 + normal(E, scale=0.1),
        shift=normal(E, scale=0.1),
        stack=normal(L, E, E),
        w_mask=normal(E, E),
        w_i=normal(E, E),
        w_f=normal(E, E),
        w_h=normal(E, 2 * E),
        w_wide=normal(E, W),
        w_back=normal(W, E, scale=0.3),
    )
    batch = (rng.integers(0, V, B), rng.standard_normal((B, 4, 4, 1)), rng.integers(0, V, B))
    return params, batch


def _close(got, want):
    """Every floating leaf equal to 1e-10 relative to the leaf's largest entry."""

    def check(g, w):
        g, w = np.asarray(g), np.asarray(w)
        if w.dtype.kind != "f":
            np.testing.assert_array_equal(g, w)
            return
        assert w.dtype == np.float64
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-10 * np.abs(w).max())

    jax.tree.map(check, got, want)


def _estimator(family: str) -> tuple:
    """``(estimator, initial state, params, batch)`` with the exact curvature."""
    params, batch = jax.tree.map(jnp.asarray, _inputs())
    est = kfacx.BlockDiagonalCurvature(
        loss, default_estimation_mode="ggn_exact", curvature_block=family
    )
    return est, est.init(jax.random.key(0), (params, batch)), params, batch


@pytest.mark.parametrize("family", ["kfac", "kfac_reduce", "tnt", "ekfac"])
def test_the_model_has_every_kind_of_block_and_its_factors_fill_two_buckets(family):
    est, state = _estimator(family)[:2]
    if family == "kfac":
        assert [type(b).__name__ for b in est.blocks] == KFAC_BLOCKS
    # Every block's refresh passes its moving averages on unchanged (the sharded state
    # rewrites only the caches' rows at a refresh; tests/blocks/test_refresh_contract.py).
    for block, block_state in zip(est.blocks, state.blocks, strict=True):
        changed = _tree.leaves_changed(block.update_cache, block_state, jnp.float32(DAMPING))
        assert not any(changed[: len(jax.tree.leaves(block_state.factors))]), block
    plan = _refresh.abstract_plan(est.blocks, est._cache_spec)
    if family == "ekfac":
        # EKFAC's eigenbases are no damped inverses: every block is its own unit, so its
        # refresh is the per-layer one by construction.
        assert plan.counts == (0,) * len(est.blocks)
        return
    # Every Kronecker factor of the plain, stacked and view blocks is in a bucket (the 70
    # x 70 output factor of w_wide and input factor of w_back make their own); the tied
    # and sliced blocks, and the diagonal one, refresh themselves.
    assert plan.counts == (2, 14, 0, 0, 0)
    assert plan.unit_blocks[2:] == ((0,), (3,), (7,))


# The family "kfac" is compared through whole steps below.
@pytest.mark.parametrize("family", ["kfac_reduce", "tnt"])
def test_bucketed_refresh_equals_each_block_refreshing_itself(family, monkeypatch):
    est, state, params, batch = _estimator(family)

    @jax.jit
    def both(state):
        state = est.update_curvature_matrix_estimate(
            state, 0.0, 1.0, None, jax.random.key(1), (params, batch)
        )
        bucketed = est.update_cache(state, DAMPING)
        monkeypatch.setattr(_refresh, "BATCH_INVERSES", False)  # read while tracing
        own = est.update_cache(state, DAMPING)
        monkeypatch.setattr(_refresh, "BATCH_INVERSES", True)
        return bucketed, own

    bucketed, own = both(state)
    _close(bucketed, own)
    # The caches hold the damped inverses (not the state they started from).
    inverse = own.blocks[8].cache.inverse[1]
    assert inverse.shape[-1] == W and float(jnp.abs(inverse).max()) > 1.0


# ----------------------------------------------------------------------------- the step

OPTIONS = dict(
    l2_reg=1e-3,
    estimation_mode="ggn_exact",  # no sampling: the placements agree to rounding
    inverse_update_period=2,  # refreshes at steps 0 and 2, a step without between
    num_burnin_steps=0,
)
#: Fixed values (the adaptive ones add nothing to the refresh, and compile longer).
VALUES = dict(learning_rate=0.3, momentum=0.5, damping=1e-2)
STEPS = 3

PLACEMENTS = {
    "single": {},
    "pmap": dict(multi_device=True),
    "mesh": dict(mesh=True),
    "mesh_sharded_state": dict(mesh=True, shard_curvature_state=True),
    "shard_map_sharded_state": dict(mesh=True, use_shard_map=True, shard_curvature_state=True),
}


def _steps(placement: str) -> tuple:
    """``(params, optimizer state)`` after `STEPS` steps under ``placement``."""
    kwargs = dict(PLACEMENTS[placement])
    if kwargs.get("mesh"):
        kwargs["mesh"] = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    opt = kfacx.Optimizer(jax.value_and_grad(loss), **OPTIONS, **kwargs)
    params, batch = _inputs()
    rngs = [jax.random.key(7)] + [jax.random.key(100 + i) for i in range(STEPS)]
    if placement == "pmap":
        rep = kfacx.parallel.replicate_all_local_devices
        params, batch, rngs = rep(params), kfacx.parallel.shard_batch(batch), list(map(rep, rngs))
    else:
        params, batch = jax.tree.map(jnp.asarray, (params, batch))
    state = opt.init(params, rngs[0], batch)
    for rng in rngs[1:]:
        params, state, _ = opt.step(params, state, rng, batch, **VALUES)
    params, state = jax.device_get((params, state))
    if placement == "pmap":
        params, state = jax.tree.map(lambda x: x[0], (params, state))
    if kwargs.get("shard_curvature_state"):
        state = state._replace(
            estimator_state=kfacx.gather_estimator_state(opt.estimator, state.estimator_state)
        )
    return params, state


@functools.cache
def _per_layer() -> tuple:
    """The per-layer reference: one device, every block refreshing itself."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_refresh, "BATCH_INVERSES", False)
        with jax.enable_x64(True):
            return _steps("single")


@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
def test_steps_with_bucketed_refreshes_equal_per_layer_steps(placement):
    params, state = _steps(placement)
    want_params, want_state = _per_layer()
    _close(params, want_params)
    _close(state.estimator_state, want_state.estimator_state)
    start = _inputs()[0]
    assert float(np.max(np.abs(params["w_wide"] - start["w_wide"]))) > 1e-3
