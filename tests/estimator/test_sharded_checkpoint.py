"""Orbax checkpoints of a sharded curvature state: a resumed run on the same device
count is bit-identical to an uninterrupted one; the state restores onto another device
count (repacked with `kfacx.shard_estimator_state`) and onto one device (per block,
replicated) and takes the same steps."""

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from _optimizer_cases import make_batch

import kfacx
from estimator.test_sharded_state import KWARGS, _loss, _params, _x64

STEPS, RESUME = 5, 3


def _optimizer(devices, shard=True):
    if devices is None:
        return kfacx.Optimizer(jax.value_and_grad(_loss), **KWARGS)
    mesh = jax.make_mesh((devices,), ("data",), devices=jax.devices()[:devices])
    return kfacx.Optimizer(
        jax.value_and_grad(_loss), mesh=mesh, shard_curvature_state=shard, **KWARGS
    )


def _steps(opt, params, state, batch, start, stop):
    for i in range(start, stop):
        params, state, _ = opt.step(params, state, jax.random.key(100 + i), batch)
    return params, state


def _close(a, b):
    np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


def test_sharded_state_checkpoints_resume_on_any_device_count(tmp_path):
    with jax.enable_x64(True):
        params, batch = _x64((_params(), make_batch(n=32, din=5)))
        opt4 = _optimizer(4)
        start = opt4.init(params, jax.random.key(7), batch)
        p3, s3 = _steps(opt4, params, start, batch, 0, RESUME)
        ckpt = ocp.StandardCheckpointer()
        ckpt.save(tmp_path / "ckpt", {"params": p3, "state": s3})
        ckpt.wait_until_finished()
        want_p, want_s = jax.device_get(_steps(opt4, p3, s3, batch, RESUME, STEPS))
        want_est = kfacx.gather_estimator_state(opt4.estimator, want_s.estimator_state)

        # The same count: restored into the run's own layout, bit for bit.
        restored = ckpt.restore(tmp_path / "ckpt", {"params": params, "state": start})
        assert not restored["state"].estimator_state.buffers[0].sharding.is_fully_replicated
        got_p, got_s = jax.device_get(
            _steps(opt4, restored["params"], restored["state"], batch, RESUME, STEPS)
        )
        jax.tree.map(np.testing.assert_array_equal, (want_p, want_s), (got_p, got_s))

        # Two devices: restore into the saved (4-device) layout as host arrays, repack.
        opt2 = _optimizer(2)
        state2 = opt2.init(params, jax.random.key(7), batch)
        per_block = kfacx.gather_estimator_state(opt2.estimator, state2.estimator_state)
        saved_layout = kfacx.shard_estimator_state(opt2.estimator, per_block, 4)
        template = {"params": params, "state": state2._replace(estimator_state=saved_layout)}
        restored = jax.device_get(ckpt.restore(tmp_path / "ckpt", template))
        on_two = kfacx.shard_estimator_state(opt2.estimator, restored["state"].estimator_state, 2)
        assert on_two.buffers[0].shape[0] == 2
        state = restored["state"]._replace(estimator_state=on_two)
        got_p, got_s = _steps(opt2, restored["params"], state, batch, RESUME, STEPS)
        got_est = kfacx.gather_estimator_state(opt2.estimator, got_s.estimator_state)
        jax.tree.map(_close, (want_p, want_est), (got_p, got_est))

        # One device, replicated layout: the per-block state.
        opt1 = _optimizer(None)
        state1 = opt1.init(params, jax.random.key(7), batch)
        per_block = kfacx.gather_estimator_state(opt4.estimator, restored["state"].estimator_state)
        state1 = state1._replace(
            **{k: v for k, v in restored["state"]._asdict().items() if k != "estimator_state"},
            estimator_state=per_block,
        )
        got_p, got_s = _steps(opt1, restored["params"], state1, batch, RESUME, STEPS)
        jax.tree.map(_close, (want_p, want_est), (got_p, got_s.estimator_state))
    assert float(np.max(np.abs(want_p["w1"] - np.asarray(params["w1"])))) > 0.05


def test_shard_estimator_state_rejects_bad_input():
    opt = _optimizer(2)
    opt.init(_params(), jax.random.key(7), make_batch(n=32, din=5))
    with pytest.raises(ValueError, match="num_devices must be a positive int"):
        kfacx.shard_estimator_state(opt.estimator, None, 0)
    with pytest.raises(TypeError, match="takes an EstimatorState or a ShardedEstimatorState"):
        kfacx.shard_estimator_state(opt.estimator, {"w": 1}, 2)
