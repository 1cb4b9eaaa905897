"""A FermiNet-style extension written against kfac-jax's API (`tests.kfac_jax._extension`)
runs on kfacx through ``kfacx.kfac_jax``, and trains exactly as the same model written
with kfacx's own API (float64)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kfacx
import kfacx.kfac_jax as kfac_jax
from tests.kfac_jax import _extension as E

STEPS = 3
_OPTIONS = dict(
    l2_reg=0.0,
    value_func_has_aux=True,
    value_func_has_rng=True,
    learning_rate_schedule=lambda t: 0.02,
    curvature_ema=0.9,
    inverse_update_period=1,
    min_damping=1e-4,
    num_burnin_steps=0,
    estimation_mode="fisher_exact",
    norm_constraint=1e-2,
)
_BLOCKS = {"per_particle_dense": E.PerParticleDenseBlock, "envelope": E.EnvelopeBlock}


def _kfac_jax_optimizer(**kwargs):
    return kfac_jax.Optimizer(
        jax.value_and_grad(E.total_energy, has_aux=True),
        **_OPTIONS,
        auto_register_kwargs=dict(graph_patterns=E.GRAPH_PATTERNS),
        layer_tag_to_block_ctor=_BLOCKS,
        **kwargs,
    )


def _run(opt, params, data, rng, steps=STEPS):
    state = opt.init(params, rng, data)
    all_stats = []
    for i in range(steps):
        params, state, stats = opt.step(
            params, state, jax.random.fold_in(rng, i), batch=data, momentum=0.0, damping=1e-3
        )
        all_stats.append(stats)
    return params, state, all_stats


@functools.cache
def _runs():
    """The kfac-jax-API run and the kfacx-API run of the same model (float64)."""
    with jax.enable_x64(True):
        hosted = _kfac_jax_optimizer()
        native = kfacx.Optimizer(
            jax.value_and_grad(E.native_total_energy, has_aux=True), **_OPTIONS
        )
        params, data, rng = E.init_params(), E.batch(), jax.random.PRNGKey(0)
        return (hosted, _run(hosted, params, data, rng)), (native, _run(native, params, data, rng))


def test_extension_finds_its_layers_and_blocks():
    (hosted, _), _ = _runs()
    rows = {e.path: (e.tag, e.block) for e in hosted.estimator.report.entries}
    assert rows == {
        "w1": ("per_particle_dense_tag", "PerParticleDenseBlock"),
        "b1": ("per_particle_dense_tag", "PerParticleDenseBlock"),
        "env": ("envelope_tag", "EnvelopeBlock"),
        # the readout is an ordinary dense layer: kfacx's own block, not the pattern's
        "w2": ("dense_tag", "DenseTwoKroneckerFactored"),
        "b2": ("dense_tag", "DenseTwoKroneckerFactored"),
    }
    # the network's weights are also used in the local energy's Laplacian; only their
    # use in the registered wavefunction is a layer (no tied uses)
    assert {e.uses for e in hosted.estimator.report.entries} == {1}


def test_extension_trains_as_the_native_model():
    (hosted, (p1, s1, stats1)), (native, (p2, s2, stats2)) = _runs()
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)
    blocks = zip(hosted.estimator.blocks, native.estimator.blocks, strict=True)
    states = zip(s1.estimator_state.blocks, s2.estimator_state.blocks, strict=True)
    for (b1, b2), (x1, x2) in zip(blocks, states, strict=True):
        np.testing.assert_allclose(b1.to_dense_matrix(x1), b2.to_dense_matrix(x2), atol=1e-12)
    for a, b in zip(stats1, stats2, strict=True):
        np.testing.assert_allclose(a["loss"], b["loss"], rtol=1e-6)
        np.testing.assert_allclose(a["aux"]["variance"], b["aux"]["variance"], rtol=1e-10)


def test_step_returns_kfac_jax_stats():
    (_, (_, _, stats)), (_, (_, _, native_stats)) = _runs()
    assert [int(s["step"]) for s in stats] == [1, 2, 3]  # kfac-jax counts the steps taken
    assert int(stats[0]["batch_size"]) == E.B
    assert {"loss", "aux", "learning_rate", "momentum", "damping", "rho", "data_seen"} <= set(
        stats[0]
    )
    # include_norms_in_stats=False (kfac-jax's default): no norms, as kfac-jax
    assert not {"grad_norm", "precon_grad_norm", "update_norm", "param_norm"} & set(stats[0])
    assert "grad_norm" in native_stats[0]


def test_energy_gradient_is_the_custom_rule():
    """kfacx's one-pass gradient is the energy's custom JVP (FermiNet's unbiased estimator),
    not the derivative of the local energy's computation: the first step's gradient norm
    is the rule's."""
    _, (_, (_, _, stats)) = _runs()
    f = jax.value_and_grad(E.native_total_energy, has_aux=True)
    _, want = jax.jit(f)(E.init_params(), jax.random.PRNGKey(0), E.batch())
    want_norm = np.sqrt(sum(np.sum(np.square(g)) for g in jax.tree.leaves(want)))
    np.testing.assert_allclose(stats[0]["grad_norm"], want_norm, rtol=1e-10)


@pytest.mark.skipif(jax.local_device_count() < 2, reason="needs several devices")
def test_pmapped_loop_equals_one_device():
    """FermiNet's pmapped loop, written with kfac-jax's helpers, takes the one-device steps."""
    utils = kfac_jax.utils
    n = jax.local_device_count()
    with jax.enable_x64(True):
        opt = _kfac_jax_optimizer(multi_device=True, pmap_axis_name="walkers")
        params = utils.replicate_all_local_devices(E.init_params())
        data = utils.broadcast_all_local_devices(E.batch().reshape(n, E.B // n, E.N, E.D))
        key = utils.make_different_rng_key_on_all_devices(jax.random.PRNGKey(0))
        key, subkeys = utils.p_split(key)
        state = opt.init(params, subkeys, data)
        mom = utils.replicate_all_local_devices(jnp.zeros([]))
        damping = utils.replicate_all_local_devices(jnp.asarray(1e-3))
        for _ in range(STEPS):
            key, subkeys = utils.p_split(key)
            params, state, stats = opt.step(
                params=params, state=state, rng=subkeys, batch=data, momentum=mom, damping=damping
            )
    (_, (want, _, want_stats)), _ = _runs()
    for a, b in zip(jax.tree.leaves(utils.get_first(params)), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-11)
    # the aux output is averaged over the devices, as kfac-jax's
    np.testing.assert_allclose(stats["aux"]["variance"], want_stats[-1]["aux"]["variance"])
    assert stats["loss"].shape == (n,) and int(stats["batch_size"][0]) == E.B
