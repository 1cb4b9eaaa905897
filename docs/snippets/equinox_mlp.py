"""Equinox models (docs/frameworks.md)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from _data import classification

import kfacx

# [equinox]
model = eqx.nn.MLP(8, 3, width_size=32, depth=2, activation=jnp.tanh, key=jax.random.key(0))
params, static = eqx.partition(model, eqx.is_inexact_array)


def loss_fn(params, batch):
    x, labels = batch
    logits = jax.vmap(eqx.combine(params, static))(x)
    logits = kfacx.register_softmax_cross_entropy_loss(logits, labels)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))


batch = classification()
estimator = kfacx.BlockDiagonalCurvature(loss_fn)
tx = optax.chain(
    kfacx.scale_by_kfac(estimator, (params, batch), damping=1e-2),
    optax.sgd(learning_rate=0.05, momentum=0.9),
)
opt_state = tx.init(params)


@jax.jit
def train_step(params, opt_state, key, batch):
    loss, grads, stats = estimator.value_grads_and_curvature_stats(key, (params, batch))
    updates, opt_state = tx.update(grads, opt_state, params, curvature_stats=stats)
    return eqx.apply_updates(params, updates), opt_state, loss


for step in range(20):
    params, opt_state, loss = train_step(params, opt_state, jax.random.key(step), batch)
model = eqx.combine(params, static)
# [/equinox]
print(estimator.report)
assert estimator.report.unmatched == ()
assert float(loss) < 0.6, loss
print("OK")
