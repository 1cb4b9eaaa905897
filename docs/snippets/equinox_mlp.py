"""Equinox: a filter_value_and_grad loop, and with K-FAC added (docs/frameworks.md)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from _data import classification

import kfacx

batch = classification()
key = jax.random.key(0)

# [equinox-loop]
model = eqx.nn.MLP(8, 3, width_size=32, depth=2, activation=jnp.tanh, key=jax.random.key(0))
optim = optax.adam(1e-2)
opt_state = optim.init(eqx.filter(model, eqx.is_inexact_array))


@eqx.filter_jit
def train_step(model, opt_state, batch):
    x, labels = batch

    def loss_fn(model):
        logits = jax.vmap(model)(x)
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))

    loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
    updates, opt_state = optim.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
    return eqx.apply_updates(model, updates), opt_state, loss


for _ in range(20):
    model, opt_state, loss = train_step(model, opt_state, batch)
# [/equinox-loop]
assert float(loss) < 0.6, loss

# [equinox]
model = eqx.nn.MLP(8, 3, width_size=32, depth=2, activation=jnp.tanh, key=jax.random.key(0))


def loss_fn(model, batch):  # (1) a function of the model and its inputs
    x, labels = batch
    logits = jax.vmap(model)(x)
    logits = kfacx.register_softmax_cross_entropy_loss(logits, labels)  # (2)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))


params, static = eqx.partition(model, eqx.is_inexact_array)  # (3)


def params_loss(params, batch):
    return loss_fn(eqx.combine(params, static), batch)


estimator = kfacx.BlockDiagonalCurvature(params_loss)
optim = optax.chain(  # (4)
    kfacx.scale_by_kfac(estimator, (params, batch), damping=1e-2),
    optax.sgd(learning_rate=0.05, momentum=0.9),
)
opt_state = optim.init(params)


@eqx.filter_jit
def train_step(model, opt_state, key, batch):
    params = eqx.filter(model, eqx.is_inexact_array)
    loss, grads, stats = estimator.value_grads_and_curvature_stats(key, (params, batch))  # (5)
    updates, opt_state = optim.update(grads, opt_state, params, curvature_stats=stats)
    return eqx.apply_updates(model, updates), opt_state, loss


for step in range(20):
    model, opt_state, loss = train_step(model, opt_state, jax.random.fold_in(key, step), batch)
# [/equinox]
print(estimator.report)
assert estimator.report.unmatched == ()
assert float(loss) < 0.6, loss

print("OK")
