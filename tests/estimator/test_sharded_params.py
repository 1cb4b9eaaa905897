"""Parameters sharded over the mesh (fully-sharded data parallel, or over a model axis):
the step keeps the parameters' and the velocities' shardings (nothing parameter-sized
comes back replicated) and takes the steps of replicated parameters, with the curvature
state replicated or sharded (``shard_curvature_state``)."""

import jax
import numpy as np
import pytest
from _optimizer_cases import make_batch, make_params, mlp_loss
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from parallel.test_distributed import KWARGS, N, _single_reference_x64, _x64

import kfacx

#: Per parameter of `make_params` (w1 [5, 8], b1 [8], w2 [8, 3], b2 [3]): its spec.
DATA_SPECS = dict(w1=P(None, "data"), b1=P("data"), w2=P("data", None), b2=P())
MODEL_SPECS = dict(w1=P(None, "model"), b1=P("model"), w2=P("model", None), b2=P())

CASES = {  # (mesh axes, mesh shape, specs, use_shard_map, shard_curvature_state)
    "fsdp_mesh": (("data",), (N,), DATA_SPECS, False, False),
    "fsdp_shard_map": (("data",), (N,), DATA_SPECS, True, False),
    "fsdp_shard_map_sharded_state": (("data",), (N,), DATA_SPECS, True, True),
    # (Under shard_map a model axis takes fsdp_shard_map's path: replicated inputs.)
    "model_axis_mesh": (("data", "model"), (2, 2), MODEL_SPECS, False, False),
}


def _sharded(params, mesh, specs):
    return {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()}


@pytest.mark.parametrize("case", sorted(CASES))
def test_sharded_params_keep_their_sharding_and_take_the_replicated_steps(case):
    names, shape, specs, use_shard_map, shard_state = CASES[case]
    mesh = jax.make_mesh(shape, names, devices=jax.devices()[: np.prod(shape)])
    want_params, want_state, want_stats = _single_reference_x64()
    with jax.enable_x64(True):
        params, batch = _x64((make_params(), make_batch(n=32)))
        params = _sharded(params, mesh, specs)
        opt = kfacx.Optimizer(
            jax.value_and_grad(mlp_loss),
            mesh=mesh,
            data_axis_name="data",
            use_shard_map=use_shard_map,
            shard_curvature_state=shard_state,
            **KWARGS,
        )
        state = opt.init(params, jax.random.key(7), batch)
        for tree in (params, state.velocities):
            for k, leaf in tree.items():
                assert leaf.sharding.spec == specs[k], (k, leaf.sharding)
        for i in range(10):
            params, state, stats = opt.step(params, state, jax.random.key(100 + i), batch)
    # No silent replication: each parameter and its velocity keep the spec they came with
    # (a device holds 1/n of a sharded leaf); the curvature state stays replicated.
    for tree in (params, state.velocities):
        for k, leaf in tree.items():
            assert leaf.sharding.spec == specs[k], (k, leaf.sharding)
            shard = leaf.addressable_shards[0].data
            assert shard.size * (1 if specs[k] == P() else 2 if "model" in names else N) == (
                leaf.size
            )
    for leaf in jax.tree.leaves(state.estimator_state):
        assert leaf.sharding.is_fully_replicated != shard_state  # the curvature state's layout
    if shard_state:
        with jax.enable_x64(True):
            gathered = kfacx.gather_estimator_state(opt.estimator, state.estimator_state)
        state = state._replace(estimator_state=gathered)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12),
        (want_params, want_state),
        jax.device_get((params, state)),
    )
    # A float32 loss to about one rounding (test_distributed.py's placement comparison).
    rtol = 1e-9 if want_stats["loss"].dtype == np.float64 else 2e-7
    np.testing.assert_allclose(stats["loss"], want_stats["loss"], rtol=rtol)


def test_replicated_params_compile_one_step_program():
    """Without sharded parameters the step is the replicated one (a single program)."""
    mesh = jax.make_mesh((N,), ("data",), devices=jax.devices()[:N])
    placement = kfacx.parallel._placement.Placement(False, "i", mesh, None, False, True)
    assert placement.param_shardings(make_params()) is None
    params = _sharded(make_params(), mesh, DATA_SPECS)
    shardings = placement.param_shardings(params)
    assert shardings["w1"].spec == P(None, "data") and shardings["b2"].is_fully_replicated
