"""Flax NNX models (docs/frameworks.md)."""

import jax
import jax.numpy as jnp
import optax
from _data import classification
from flax import nnx

import kfacx


# [nnx]
class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(8, 32, rngs=rngs)
        self.norm = nnx.LayerNorm(32, rngs=rngs)
        self.out = nnx.Linear(32, 3, rngs=rngs)

    def __call__(self, x):
        return self.out(self.norm(jnp.tanh(self.hidden(x))))


model = MLP(nnx.Rngs(0))
graphdef, params = nnx.split(model, nnx.Param)  # params: an nnx.State pytree


def loss_fn(params, batch):
    x, labels = batch
    logits = nnx.merge(graphdef, params)(x)
    logits = kfacx.register_softmax_cross_entropy_loss(logits, labels)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))


batch = classification()
key = jax.random.key(0)
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
nnx.update(model, params)  # back into the module
# [/nnx]
print(optimizer.estimator.report)
assert optimizer.estimator.report.unmatched == ()
assert float(stats["loss"]) < 0.6, stats["loss"]
print("OK")
