"""Scaling out (docs/scaling.md): one optimizer, four placements, checkpoints that
move between device counts.

Sets up 4 CPU devices when run on a CPU-only machine.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import pathlib  # noqa: E402
import tempfile  # noqa: E402

import haiku as hk  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from _data import classification  # noqa: E402

import kfacx  # noqa: E402

net = hk.without_apply_rng(hk.transform(lambda x: hk.nets.MLP([32, 3])(x)))


def loss_fn(params, batch):
    x, labels = batch
    logits = kfacx.register_softmax_cross_entropy_loss(net.apply(params, x), labels)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))


batch = classification()  # 128 examples
params = net.init(jax.random.key(0), batch[0][:1])
options = dict(
    learning_rate_schedule=0.1,
    momentum_schedule=0.9,
    initial_damping=1e-2,
    estimation_mode="ggn_exact",  # no sampling: every placement takes the same steps
)

# [mesh]
n = len(jax.devices())
mesh = jax.make_mesh((n,), ("data",))
optimizer = kfacx.Optimizer(jax.value_and_grad(loss_fn), mesh=mesh, **options)
state = optimizer.init(params, jax.random.key(1), batch)  # replicated on the mesh
p = params
for step in range(3):
    # A global batch: step splits it over "data"; params and state stay replicated.
    p, state, stats = optimizer.step(p, state, jax.random.key(step), batch)
# [/mesh]
print(f"{n} devices, sharded jit: loss {float(stats['loss']):.4f}")

# [shard_map]
mapped = kfacx.Optimizer(jax.value_and_grad(loss_fn), mesh=mesh, use_shard_map=True, **options)
state_m = mapped.init(params, jax.random.key(1), batch)
p_m = params
for step in range(3):
    p_m, state_m, stats_m = mapped.step(p_m, state_m, jax.random.key(step), batch)
# [/shard_map]
print(f"{n} devices, shard_map:   loss {float(stats_m['loss']):.4f}")
for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(p_m), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)

# [checkpoint]
path = pathlib.Path(tempfile.mkdtemp()) / "step3"
checkpointer = ocp.StandardCheckpointer()
checkpointer.save(path, {"params": p, "state": state})
checkpointer.wait_until_finished()

# Later, maybe in a job with fewer devices: restore into the new layout.
small_mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
resumed = kfacx.Optimizer(jax.value_and_grad(loss_fn), mesh=small_mesh, **options)
template_state = resumed.init(params, jax.random.key(1), batch)
replicated = template_state.damping.sharding  # replicated on the small mesh
template = {"params": jax.device_put(params, replicated), "state": template_state}
restored = checkpointer.restore(path, template)
p2, state2, stats2 = resumed.step(restored["params"], restored["state"], jax.random.key(3), batch)
# [/checkpoint]
p, state, stats = optimizer.step(p, state, jax.random.key(3), batch)
for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(p2), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
print(
    f"resumed on 2 devices at step {int(state2.step_counter) - 1}: loss {float(stats2['loss']):.4f}"
)
print("OK")
