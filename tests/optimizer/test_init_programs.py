"""What `Optimizer.init` compiles: its own program and detection's one check program,
not an eager slice of every leaf to learn a device's or a micro-batch's shapes (each a
program of its own, compiled per leaf shape: seconds for a large model under pmap)."""

from __future__ import annotations

import jax
from _compiles import compiled_programs
from _optimizer_cases import make_batch, make_params, mlp_loss

import kfacx

#: Programs a leaf-by-leaf eager slice, squeeze or reshape would compile.
EAGER_SLICES = {"jit(dynamic_slice)", "jit(squeeze)", "jit(reshape)", "jit(getitem)"}


def test_init_under_pmap_with_micro_batches_slices_no_leaf_eagerly():
    # Odd shapes: an eager slice another test compiled would be reused unseen.
    params, batch = make_params(din=9, dh=13, dout=3), make_batch(n=40, din=9)
    opt = kfacx.Optimizer(jax.value_and_grad(mlp_loss), multi_device=True, num_microbatches=2)
    rep = kfacx.parallel.replicate_all_local_devices
    args = (rep(params), rep(jax.random.key(0)), kfacx.parallel.shard_batch(batch))
    state, compiled = compiled_programs(lambda: opt.init(*args))
    assert not EAGER_SLICES & set(compiled), dict(compiled)
    assert compiled["jit(evaluate_all)"] <= 1, dict(compiled)
    # And the state is the one the shapes call for.
    assert jax.tree.leaves(state.velocities)[0].shape[0] == jax.local_device_count()
