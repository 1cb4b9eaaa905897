"""Checkpoint and resume with orbax: k steps + save + restore + n steps == k + n steps."""

import functools

import jax
import numpy as np
import orbax.checkpoint as ocp
from _optimizer_cases import ADAPTIVE, make_batch, make_params, mlp_loss

import kfacx


def _optimizer():
    return kfacx.Optimizer(
        jax.value_and_grad(mlp_loss),
        l2_reg=1e-3,
        inverse_update_period=3,
        estimation_mode="fisher_gradients",
        num_burnin_steps=2,
        **ADAPTIVE,
    )


def _steps(opt, params, state, batch, start, stop):
    for i in range(start, stop):
        params, state, _ = opt.step(params, state, jax.random.key(100 + i), batch)
    return params, state


def test_resume_from_an_orbax_checkpoint_is_bit_identical(tmp_path):
    params, batch = make_params(), make_batch()
    opt = _optimizer()
    state = opt.init(params, jax.random.key(0), batch)
    want_params, want_state = _steps(opt, params, state, batch, 0, 5)

    # The same optimizer (its compiled step) runs the three steps before the checkpoint.
    state = opt.init(params, jax.random.key(0), batch)
    p, s = _steps(opt, params, state, batch, 0, 3)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "ckpt", {"params": p, "state": s})
    checkpointer.wait_until_finished()

    # A new process would build a fresh optimizer and restore into its state's layout.
    fresh = _optimizer()
    template = {"params": params, "state": fresh.init(params, jax.random.key(0), batch)}
    restored = checkpointer.restore(tmp_path / "ckpt", template)
    assert int(restored["state"].step_counter) == 3
    got_params, got_state = _steps(fresh, restored["params"], restored["state"], batch, 3, 5)
    jax.tree.map(np.testing.assert_array_equal, (got_params, got_state), (want_params, want_state))


# ----------------------------------------------------------------------------- other device counts

# Exact curvature (no sampling): every placement and device count takes the same steps.
LAYOUT_KWARGS = dict(
    l2_reg=1e-3,
    estimation_mode="ggn_exact",
    learning_rate_schedule=0.3,
    momentum_schedule=0.5,
    initial_damping=1e-2,
    inverse_update_period=2,
    num_burnin_steps=0,
)


def _layout_optimizer(**kwargs):
    return kfacx.Optimizer(jax.value_and_grad(mlp_loss), **LAYOUT_KWARGS, **kwargs)


@functools.cache
def _shared_optimizer(mesh_devices=None, use_shard_map=False):
    """One optimizer per layout, shared by the tests (each compiles its steps once):
    single-device (``mesh_devices`` None) or on a mesh of that many devices."""
    if mesh_devices is None:
        return _layout_optimizer()
    return _layout_optimizer(mesh=_mesh(mesh_devices), use_shard_map=use_shard_map)


def _mesh(n):
    return jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])


def _replicate(tree, n):
    return jax.tree.map(lambda x: np.broadcast_to(np.asarray(x), (n, *np.shape(x))), tree)


def _replicate_key(key, n):
    return jax.random.wrap_key_data(_replicate(jax.random.key_data(key), n))


def _shard(batch, n):
    return jax.tree.map(lambda x: np.reshape(x, (n, -1, *np.shape(x)[1:])), batch)


def _continue(opt, params, state, batch, start, stop, devices=None):
    """Steps ``start..stop`` (pmapped over ``devices`` when given); one copy back."""
    for i in range(start, stop):
        if devices:
            rng = _replicate_key(jax.random.key(100 + i), devices)
            params, state, _ = opt.step(params, state, rng, _shard(batch, devices))
        else:
            params, state, _ = opt.step(params, state, jax.random.key(100 + i), batch)
    if devices:
        params, state = kfacx.parallel.get_first((params, state))
    return params, state


@functools.cache
def _reference():
    """Five single-device steps from ``make_params()`` on ``make_batch(n=32)``."""
    params, batch = make_params(), make_batch(n=32)
    opt = _shared_optimizer()
    return _continue(opt, params, opt.init(params, jax.random.key(0), batch), batch, 0, 5)


def _assert_close(got, want):
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5), got, want)


def _single_template(params, batch):
    state = _shared_optimizer().init(params, jax.random.key(0), batch)
    return {"params": params, "state": state}


def test_pmap_checkpoint_restores_onto_other_device_counts(tmp_path):
    """Save one copy of a 4-device pmapped state; resume on 1 device, on 2 pmapped
    devices, and on a 2-device mesh."""
    params, batch = make_params(), make_batch(n=32)
    want = _reference()
    opt = _layout_optimizer(multi_device=True)
    rng = kfacx.parallel.replicate_all_local_devices(jax.random.key(0))
    state = opt.init(_replicate(params, 4), rng, _shard(batch, 4))
    p, s = _continue(opt, _replicate(params, 4), state, batch, 0, 3, devices=4)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "ckpt", {"params": p, "state": s})
    checkpointer.wait_until_finished()

    # One device.
    restored = checkpointer.restore(tmp_path / "ckpt", _single_template(params, batch))
    single = _shared_optimizer()
    _assert_close(_continue(single, restored["params"], restored["state"], batch, 3, 5), want)

    # Two pmapped devices: replicate the single copy.
    two = _layout_optimizer(multi_device=True)
    two.init(
        _replicate(params, 2),
        _replicate_key(jax.random.key(0), 2),
        _shard(batch, 2),
    )
    got = _continue(
        two,
        _replicate(restored["params"], 2),
        _replicate(restored["state"], 2),
        batch,
        3,
        5,
        devices=2,
    )
    _assert_close(got, want)

    # A two-device mesh: restore straight into its (replicated) layout.
    meshed = _shared_optimizer(2)
    template = {"params": params, "state": meshed.init(params, jax.random.key(0), batch)}
    template["params"] = jax.device_put(params, template["state"].damping.sharding)
    restored = checkpointer.restore(tmp_path / "ckpt", template)
    assert len(restored["state"].damping.sharding.device_set) == 2
    _assert_close(_continue(meshed, restored["params"], restored["state"], batch, 3, 5), want)


def test_mesh_checkpoint_restores_onto_a_smaller_mesh_and_one_device(tmp_path):
    params, batch = make_params(), make_batch(n=32)
    want = _reference()
    opt = _layout_optimizer(mesh=_mesh(4))
    p, s = _continue(opt, params, opt.init(params, jax.random.key(0), batch), batch, 0, 3)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "ckpt", {"params": p, "state": s})
    checkpointer.wait_until_finished()

    for use_shard_map in (False, True):
        smaller = _shared_optimizer(2, use_shard_map)
        state = smaller.init(params, jax.random.key(0), batch)
        template = {"params": jax.device_put(params, state.damping.sharding), "state": state}
        restored = checkpointer.restore(tmp_path / "ckpt", template)
        leaves = jax.tree.leaves(restored)
        assert all(len(x.sharding.device_set) == 2 for x in leaves)
        _assert_close(_continue(smaller, restored["params"], restored["state"], batch, 3, 5), want)

    restored = checkpointer.restore(tmp_path / "ckpt", _single_template(params, batch))
    single = _shared_optimizer()
    _assert_close(_continue(single, restored["params"], restored["state"], batch, 3, 5), want)
