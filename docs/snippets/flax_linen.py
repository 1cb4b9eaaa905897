"""Flax linen: a TrainState loop, with K-FAC added, and kfacx.Optimizer (docs/frameworks.md)."""

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from _data import classification
from flax.training import train_state

import kfacx
import kfacx.flax


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.BatchNorm(use_running_average=not train)(nn.Dense(32)(x))
        return nn.Dense(3)(jnp.tanh(x))


model = MLP()
batch = classification()
key = jax.random.key(0)


# [trainstate]
class TrainState(train_state.TrainState):
    batch_stats: Any


variables = model.init(key, batch[0][:1], train=False)
state = TrainState.create(
    apply_fn=model.apply,
    params=variables["params"],
    batch_stats=variables["batch_stats"],
    tx=optax.adam(1e-2),
)


@jax.jit
def train_step(state, batch):
    x, labels = batch

    def loss_fn(params):
        logits, updates = state.apply_fn(
            {"params": params, "batch_stats": state.batch_stats},
            x,
            train=True,
            mutable=["batch_stats"],
        )
        loss = jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))
        return loss, updates["batch_stats"]

    (loss, batch_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    state = state.apply_gradients(grads=grads, batch_stats=batch_stats)
    return state, loss


for _ in range(20):
    state, loss = train_step(state, batch)
# [/trainstate]
assert float(loss) < 0.6, loss


# [trainstate-kfac]
def loss_fn(params, batch_stats, batch):  # (1) a function of its inputs
    x, labels = batch
    logits, updates = model.apply(
        {"params": params, "batch_stats": batch_stats}, x, train=True, mutable=["batch_stats"]
    )
    logits = kfacx.register_softmax_cross_entropy_loss(logits, labels)  # (2)
    loss = jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))
    return loss, updates["batch_stats"]


class TrainState(kfacx.flax.TrainState):  # (3)
    batch_stats: Any


params, batch_stats = variables["params"], variables["batch_stats"]
estimator = kfacx.BlockDiagonalCurvature(loss_fn)  # (4)
tx = optax.chain(
    kfacx.scale_by_kfac(estimator, (params, batch_stats, batch), damping=1e-2),
    optax.sgd(learning_rate=0.05, momentum=0.9),
)
state = TrainState.create(apply_fn=model.apply, params=params, batch_stats=batch_stats, tx=tx)


@jax.jit
def train_step(state, key, batch):
    (loss, batch_stats), grads, stats = estimator.value_grads_and_curvature_stats(  # (5)
        key, (state.params, state.batch_stats, batch), has_aux=True
    )
    state = state.apply_gradients(grads=grads, curvature_stats=stats, batch_stats=batch_stats)
    return state, loss


for step in range(20):
    state, loss = train_step(state, jax.random.fold_in(key, step), batch)
# [/trainstate-kfac]
print(estimator.report)
assert estimator.report.unmatched == ()
assert float(loss) < 0.6, loss
assert float(jnp.abs(state.batch_stats["BatchNorm_0"]["mean"]).max()) > 0  # the state moved


# [optimizer]
optimizer = kfacx.Optimizer(
    jax.value_and_grad(loss_fn, has_aux=True),
    value_func_has_state=True,
    use_adaptive_learning_rate=True,
    use_adaptive_momentum=True,
    use_adaptive_damping=True,
    initial_damping=1.0,
)
opt_state = optimizer.init(params, key, batch, func_state=batch_stats)
for step in range(10):
    params, opt_state, batch_stats, stats = optimizer.step(
        params, opt_state, jax.random.fold_in(key, step), batch, func_state=batch_stats
    )
# [/optimizer]
assert float(stats["loss"]) < 0.6, stats["loss"]
assert float(jnp.abs(batch_stats["BatchNorm_0"]["mean"]).max()) > 0  # the state moved
print("OK")
