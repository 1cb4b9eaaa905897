"""Tests of `kfacx.parallel._placement`: option checks and staging by argument name."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kfacx.parallel._placement import STEP_INPUTS, Placement


def _placement(**kwargs):
    options = dict(
        multi_device=False,
        pmap_axis_name="i",
        mesh=None,
        data_axis_name=None,
        use_shard_map=False,
        distributed_inverses=True,
    )
    return Placement(**{**options, **kwargs})


def _mesh(*names):
    return jax.make_mesh((2,) * len(names), names)


def _step(params, state, rng, batch, func_state, scale):
    """A step function: per-device inputs first, then a shared option."""
    noise = jax.random.uniform(rng, ())
    return params + scale * jnp.mean(batch), state, {"noise": noise}


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(mesh="data"), TypeError, "jax.sharding.Mesh"),
        (dict(multi_device=True, mesh=_mesh("d")), ValueError, "not both"),
        (dict(use_shard_map=True), ValueError, "needs a mesh"),
        (dict(data_axis_name="d"), ValueError, "only used with mesh"),
        (dict(mesh=_mesh("a", "b")), ValueError, "pass data_axis_name"),
        (dict(mesh=_mesh("d"), data_axis_name="x"), ValueError, "not an axis of the mesh"),
        (dict(compiler_options="fast"), TypeError, "compiler_options must be a dict"),
        (dict(compiler_options={"a": 1}, multi_device=True), ValueError, "cannot take them"),
    ],
)
def test_bad_options_raise(kwargs, error, match):
    with pytest.raises(error, match=match):
        _placement(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "kind", "axis"),
    [
        (dict(), "single", None),
        (dict(multi_device=True), "pmap", "i"),
        (dict(mesh=_mesh("d")), "mesh", None),
        (dict(mesh=_mesh("d"), use_shard_map=True), "shard_map", "d"),
    ],
)
def test_kind_and_axis(kwargs, kind, axis):
    placement = _placement(**kwargs)
    assert (placement.kind, placement.axis_name) == (kind, axis)


def test_stage_names_the_step_inputs():
    def positional(p, s, r, b, f):
        return p

    with pytest.raises(TypeError, match="takes .*'params', 'state'"):
        _placement().stage(positional, debug=False)
    assert STEP_INPUTS == ("params", "state", "rng", "batch", "func_state")


def test_pmap_maps_the_step_inputs_and_shares_the_options():
    n = 2
    params, batch = jnp.zeros((n,)), jnp.arange(8.0).reshape(n, 4)
    rngs = jax.random.split(jax.random.key(0), n)
    staged = _placement(multi_device=True).stage(_step, debug=False)
    out, _, _ = staged(params, params, rngs, batch, None, 2.0)
    np.testing.assert_allclose(out, 2.0 * batch.mean(axis=1))


def test_a_pmapped_step_is_freed_with_its_function():
    """jax.pmap (jax >= 0.10) caches every function it maps for the life of the process,
    with its compiled programs: FermiNet's tests, an optimizer each, ran out of memory
    mappings and crashed in XLA's compiler. The staged pmap step lives only as long as
    the function it stages."""
    import gc
    import weakref

    class Step:
        def run(self, params, state, rng, batch, func_state, scale):
            return _step(params, state, rng, batch, func_state, scale)

    n = 2
    params, batch = jnp.zeros((n,)), jnp.arange(8.0).reshape(n, 4)
    rngs = jax.random.split(jax.random.key(0), n)
    step = Step()
    alive = weakref.ref(step)
    staged = _placement(multi_device=True).stage(step.run, debug=False)
    jax.block_until_ready(staged(params, params, rngs, batch, None, 2.0))
    del step, staged
    gc.collect()
    assert alive() is None
    # As pmap: mapped arguments must share their leading size.
    staged = _placement(multi_device=True).stage(_step, debug=False)
    with pytest.raises(ValueError, match="leading axes have sizes"):
        staged(params, jnp.zeros((3,)), rngs, batch, None, 2.0)


def test_shard_map_splits_the_batch_and_draws_other_samples_per_device():
    mesh = _mesh("d")
    placement = _placement(mesh=mesh, use_shard_map=True)

    def step(params, state, rng, batch, func_state, scale):
        params, state, stats = _step(params, state, rng, batch, func_state, scale)
        stats["aux"] = stats.pop("noise")
        return params, state, stats

    staged = placement.stage(step, debug=False, has_aux=True)
    batch = jnp.arange(8.0)
    params, _, stats = staged(jnp.zeros(()), jnp.zeros(()), jax.random.key(0), batch, None, 1.0)
    # Each device sees its half of the batch: device 0's result is returned.
    np.testing.assert_allclose(params, batch[:4].mean())
    noise = np.asarray(stats["aux"])
    assert noise.shape == (2,) and noise[0] != noise[1]


def test_local_batch_and_put_split_over_the_data_axis():
    mesh = _mesh("d")
    batch = {"x": jnp.arange(8.0)}
    assert _placement(mesh=mesh, use_shard_map=True).local_batch(batch)["x"].shape == (4,)
    assert _placement(mesh=mesh).local_batch(batch)["x"].shape == (8,)
    placed, params = _placement(mesh=mesh).put(batch, jnp.ones(3))
    assert placed["x"].sharding.spec == jax.sharding.PartitionSpec("d")
    assert params.sharding.is_fully_replicated
    with pytest.raises(ValueError, match="divisible by the 2 devices"):
        _placement(mesh=mesh).put({"x": jnp.arange(3.0)})
