"""optax recipes: data parallelism with jax.pmap (docs/optax.md).

On a CPU, run with XLA_FLAGS=--xla_force_host_platform_device_count=2 to get two
devices; on one device it still runs.
"""

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
from _data import classification

import kfacx

net = hk.without_apply_rng(hk.transform(lambda x: hk.nets.MLP([32, 3])(x)))


def loss_fn(params, batch):
    x, labels = batch
    logits = kfacx.register_softmax_cross_entropy_loss(net.apply(params, x), labels)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))


batch = classification()
init_params = net.init(jax.random.key(0), batch[0][:1])

# [optimizer]
optimizer = kfacx.Optimizer(
    jax.value_and_grad(loss_fn),
    learning_rate_schedule=0.1,
    momentum_schedule=0.9,
    damping_schedule=1e-2,
    multi_device=True,  # step is pmapped over jax.local_devices()
)
replicated = kfacx.parallel.replicate_all_local_devices(init_params)  # [devices, ...] copies
sharded = kfacx.parallel.shard_batch(batch)  # [devices, batch / devices, ...]
keys = kfacx.parallel.make_different_rng_key_on_all_devices(jax.random.key(1))
state = optimizer.init(replicated, keys, sharded)
for step in range(3):
    step_keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, step)
    replicated, state, stats = optimizer.step(replicated, state, step_keys, sharded)
params = jax.device_get(kfacx.parallel.get_first(replicated))  # all copies are equal
# [/optimizer]
print(f"{jax.local_device_count()} devices, loss {float(stats['loss'][0]):.3f}")

# [optax]
shard = kfacx.parallel.get_first(sharded)  # one device's batch: the shapes to set up with
estimator = kfacx.BlockDiagonalCurvature(loss_fn)
tx = optax.chain(
    kfacx.scale_by_kfac(estimator, (init_params, shard), damping=1e-2, pmap_axis_name="devices"),
    optax.sgd(learning_rate=0.1, momentum=0.9),
)


def device_step(params, opt_state, key, batch):
    loss, grads, stats = estimator.value_grads_and_curvature_stats(key, (params, batch))
    grads = jax.lax.pmean(grads, "devices")  # equal shards; scale_by_kfac averages the stats
    updates, opt_state = tx.update(grads, opt_state, params, curvature_stats=stats)
    return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, "devices")


train_step = jax.pmap(device_step, axis_name="devices")
replicated = kfacx.parallel.replicate_all_local_devices(init_params)
opt_state = kfacx.parallel.replicate_all_local_devices(tx.init(init_params))
replicated, opt_state, loss = train_step(replicated, opt_state, keys, sharded)
# [/optax]
first = kfacx.parallel.get_first(replicated)
for leaf in jax.tree.leaves(jax.tree.map(lambda a, b: a - b[None], replicated, first)):
    assert np.all(np.asarray(leaf) == 0)  # devices stay in sync
print("OK")
