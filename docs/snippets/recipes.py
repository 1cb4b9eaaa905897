"""Recipes: kfacx.kfac_soap and kfacx.kfac_adamw with a schedule, curvature on part of
each batch, and their own rate for embeddings, output layer, norms and biases
(docs/recipes.md)."""

import haiku as hk
import jax
import jax.numpy as jnp
import optax
from _data import classification

import kfacx

net = hk.without_apply_rng(hk.transform(lambda x: hk.nets.MLP([32, 32, 3])(x)))


def loss_fn(params, batch):
    x, labels = batch
    logits = kfacx.register_softmax_cross_entropy_loss(net.apply(params, x), labels)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))


batch = classification()
params = net.init(jax.random.key(0), batch[0][:1])
steps = 30

# [recipe]
estimator = kfacx.BlockDiagonalCurvature(loss_fn)


def output_layer(params):  # as Muon's Adam part: its own rate
    return {name: "linear_2" in name for name in params}


# AdamW's warmup and cosine decay; the momentum is a sum, so a tenth of AdamW's rates.
tx = kfacx.kfac_soap(
    estimator,
    (params, batch),
    learning_rate=optax.warmup_cosine_decay_schedule(0.0, 3e-3, steps // 10, steps),
    other_learning_rate=optax.warmup_cosine_decay_schedule(0.0, 3e-3, steps // 10, steps),
    other_mask=output_layer,
)
opt_state = tx.init(params)


@jax.jit
def train_step(params, opt_state, key, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    quarter = jax.tree.map(lambda a: a[: len(a) // 4], batch)  # curvature on 1/4 of the batch
    stats = estimator.compute_curvature_stats(key, (params, quarter))
    updates, opt_state = tx.update(grads, opt_state, params, curvature_stats=stats)
    return optax.apply_updates(params, updates), opt_state, loss


key = jax.random.key(1)
for _ in range(steps):
    key, step_key = jax.random.split(key)
    params, opt_state, loss = train_step(params, opt_state, step_key, batch)
# [/recipe]
print(f"loss after {steps} steps: {float(loss):.3f}")
assert float(loss) < 0.3, loss
print("OK")
