"""Flax linen models (docs/frameworks.md)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from _data import classification

import kfacx


# [linen]
class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.LayerNorm()(jnp.tanh(nn.Dense(32)(x)))
        return nn.Dense(3)(x)


model = MLP()


def loss_fn(params, batch):
    x, labels = batch
    logits = kfacx.register_softmax_cross_entropy_loss(model.apply(params, x), labels)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))


batch = classification()
key = jax.random.key(0)
params = model.init(key, batch[0][:1])  # {"params": {"Dense_0": ..., ...}}
optimizer = kfacx.Optimizer(
    jax.value_and_grad(loss_fn),
    use_adaptive_learning_rate=True,
    use_adaptive_momentum=True,
    use_adaptive_damping=True,
    initial_damping=1.0,
)
state = optimizer.init(params, key, batch)
for step in range(10):
    params, state, stats = optimizer.step(params, state, jax.random.fold_in(key, step), batch)
# [/linen]
print(optimizer.estimator.report)
assert optimizer.estimator.report.unmatched == ()
assert float(stats["loss"]) < 0.6, stats["loss"]


# [batchnorm]
class BNMLP(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.BatchNorm(use_running_average=not train)(nn.Dense(32)(x))
        return nn.Dense(3)(jnp.tanh(x))


bn_model = BNMLP()


def bn_loss_fn(params, batch_stats, batch):
    x, labels = batch
    logits, updates = bn_model.apply(
        {"params": params, "batch_stats": batch_stats}, x, train=True, mutable=["batch_stats"]
    )
    logits = kfacx.register_softmax_cross_entropy_loss(logits, labels)
    loss = jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))
    return loss, updates["batch_stats"]


variables = bn_model.init(key, batch[0][:1], train=False)
params, batch_stats = variables["params"], variables["batch_stats"]
optimizer = kfacx.Optimizer(
    jax.value_and_grad(bn_loss_fn, has_aux=True),
    value_func_has_state=True,
    use_adaptive_learning_rate=True,
    use_adaptive_momentum=True,
    use_adaptive_damping=True,
    initial_damping=1.0,
)
state = optimizer.init(params, key, batch, func_state=batch_stats)
for step in range(10):
    params, state, batch_stats, stats = optimizer.step(
        params, state, jax.random.fold_in(key, step), batch, func_state=batch_stats
    )
# [/batchnorm]
print(optimizer.estimator.report)
assert optimizer.estimator.report.unmatched == ()
assert float(stats["loss"]) < 0.6, stats["loss"]
assert float(jnp.abs(batch_stats["BatchNorm_0"]["mean"]).max()) > 0  # the state moved
print("OK")
