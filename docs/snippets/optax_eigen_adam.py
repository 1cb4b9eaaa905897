"""optax recipes: Adam's second moment in the Kronecker eigenbasis (SOAP) with
scale_by_kfac_eigen_adam (docs/optax.md)."""

import haiku as hk
import jax
import jax.numpy as jnp
import optax
from _data import classification

import kfacx

net = hk.without_apply_rng(hk.transform(lambda x: hk.nets.MLP([32, 3])(x)))


def loss_fn(params, batch):
    x, labels = batch
    logits = kfacx.register_softmax_cross_entropy_loss(net.apply(params, x), labels)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))


batch = classification()
params = net.init(jax.random.key(0), batch[0][:1])

# [eigen-adam]
estimator = kfacx.BlockDiagonalCurvature(loss_fn)
tx = optax.chain(
    kfacx.scale_by_kfac_eigen_adam(estimator, (params, batch), b2=0.99, inverse_update_period=10),
    optax.trace(decay=0.9),  # momentum: with it, this is SOAP
    optax.scale_by_learning_rate(1e-2),
)
opt_state = tx.init(params)


@jax.jit
def train_step(params, opt_state, key, batch):
    loss, grads, stats = estimator.value_grads_and_curvature_stats(key, (params, batch))
    updates, opt_state = tx.update(grads, opt_state, params, curvature_stats=stats)
    return optax.apply_updates(params, updates), opt_state, loss


key = jax.random.key(1)
for _ in range(20):
    key, step_key = jax.random.split(key)
    params, opt_state, loss = train_step(params, opt_state, step_key, batch)
# [/eigen-adam]
print(f"loss after 20 steps: {float(loss):.3f}")
assert float(loss) < 0.2, loss
print("OK")
