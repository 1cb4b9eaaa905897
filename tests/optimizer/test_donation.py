"""``donate_params_and_state``: the step donates its params, state (and func_state) under
every placement, takes the same steps bit for bit, and deletes the arrays passed in."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _optimizer_cases import ADAPTIVE, make_batch, make_params, mlp_loss

import kfacx

OPTIONS = dict(
    l2_reg=1e-3,
    estimation_mode="ggn_exact",  # no sampling: the placements agree exactly
    inverse_update_period=2,  # a step with the refresh and one without
    num_burnin_steps=0,  # the burn-in's own program is not donated
    **ADAPTIVE,
)
STEPS = 3


def _mesh():
    return jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])


PLACEMENTS = {
    "single": {},
    "pmap": dict(multi_device=True),
    "mesh": dict(mesh=None),
    "shard_map_sharded_state": dict(mesh=None, use_shard_map=True, shard_curvature_state=True),
}


def _inputs(placement):
    params, batch = jax.tree.map(np.float64, make_params()), make_batch(n=32)
    batch = (np.float64(batch[0]), np.asarray(batch[1]))
    rngs = [jax.random.key(7)] + [jax.random.key(100 + i) for i in range(STEPS)]
    if placement == "pmap":
        rep = kfacx.parallel.replicate_all_local_devices
        return rep(params), kfacx.parallel.shard_batch(batch), [rep(r) for r in rngs]
    return jax.tree.map(jnp.asarray, params), batch, rngs


def _run(placement, donate):
    kwargs = dict(PLACEMENTS[placement])
    if "mesh" in kwargs:
        kwargs["mesh"] = _mesh()
    opt = kfacx.Optimizer(
        jax.value_and_grad(mlp_loss), donate_params_and_state=donate, **OPTIONS, **kwargs
    )
    params, batch, rngs = _inputs(placement)
    state = opt.init(params, rngs[0], batch)
    passed_in = []
    for rng in rngs[1:]:
        passed_in.append((params, state))
        params, state, stats = opt.step(params, state, rng, batch)
    return opt, jax.device_get((params, state, stats)), passed_in


def _deleted(tree) -> list[bool]:
    """Per leaf: a deleted `jax.Array` (host arrays, as pmap's first inputs, never are)."""
    return [isinstance(x, jax.Array) and x.is_deleted() for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
def test_donated_steps_are_the_same_steps_and_free_their_inputs(placement):
    with jax.enable_x64(True):
        _, want, kept = _run(placement, donate=False)
        opt, got, donated = _run(placement, donate=True)
    jax.tree.map(np.testing.assert_array_equal, want, got)
    assert opt.donate_params_and_state
    assert not any(_deleted(kept))
    # Every step's params and optimizer state were handed over to its outputs (on a
    # mesh, the step's first inputs are the user's arrays, placed as they are).
    for params, state in donated[1:]:
        assert all(_deleted((params, state))), placement
    assert float(np.max(np.abs(got[0]["w1"] - np.float64(make_params()["w1"])))) > 0.05


def _stateful_loss(params, func_state, batch):
    loss = mlp_loss(params, batch)
    return loss, {"calls": func_state["calls"] + 1.0}


def test_func_state_is_donated_too():
    opts = [
        kfacx.Optimizer(
            jax.value_and_grad(_stateful_loss, has_aux=True),
            value_func_has_state=True,
            donate_params_and_state=donate,
            num_burnin_steps=0,
        )
        for donate in (False, True)
    ]
    params, batch = make_params(), make_batch()
    outs, func_states = [], []
    for opt in opts:
        func_state = {"calls": jnp.zeros(())}
        state = opt.init(params, jax.random.key(0), batch, func_state)
        p = jax.tree.map(jnp.copy, params)
        values = dict(learning_rate=0.1, momentum=0.0, damping=1e-2)
        out = opt.step(p, state, jax.random.key(1), batch, func_state, **values)
        outs.append(jax.device_get(out[:3]))
        func_states.append((p, state, func_state))
    jax.tree.map(np.testing.assert_array_equal, outs[0], outs[1])
    assert float(outs[1][2]["calls"]) == 1.0
    assert not any(_deleted(func_states[0]))
    assert all(_deleted(func_states[1]))


def test_the_donated_step_writes_its_outputs_over_its_inputs():
    """Donated, XLA writes the new params and state over the buffers of the old ones
    (all their bytes are aliased); without donation it allocates new ones."""
    params, batch = make_params(), make_batch()
    aliased = []
    for donate in (False, True):
        opt = kfacx.Optimizer(
            jax.value_and_grad(mlp_loss), donate_params_and_state=donate, **ADAPTIVE
        )
        state = opt.init(params, jax.random.key(0), batch)
        args = (params, state, jax.random.key(1), batch, None, None, None, None, None)
        compiled = opt._stage().lower(*args).compile()
        aliased.append(compiled.memory_analysis().alias_size_in_bytes)
        if donate:
            assert "input_output_alias" in compiled.as_text()
    nbytes = sum(x.nbytes for x in jax.tree.leaves((params, state)))
    assert aliased == [0, nbytes], (aliased, nbytes)


def test_donate_params_and_state_must_be_a_bool():
    with pytest.raises(TypeError, match="donate_params_and_state must be True or False, got 'yes'"):
        kfacx.Optimizer(jax.value_and_grad(mlp_loss), donate_params_and_state="yes")
