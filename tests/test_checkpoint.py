"""Checkpoint and resume with orbax: k steps + save + restore + n steps == k + n steps."""

import jax
import numpy as np
import orbax.checkpoint as ocp
from test_optimizer import ADAPTIVE, make_batch, make_params, mlp_loss

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

    opt = _optimizer()
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
