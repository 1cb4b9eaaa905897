"""Flax NNX: an nnx.Optimizer loop, with K-FAC added, and kfacx.Optimizer (docs/frameworks.md)."""

import jax
import jax.numpy as jnp
import optax
from _data import classification
from flax import nnx

import kfacx
import kfacx.flax


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(8, 32, rngs=rngs)
        self.norm = nnx.BatchNorm(32, rngs=rngs)
        self.out = nnx.Linear(32, 3, rngs=rngs)

    def __call__(self, x):
        return self.out(jnp.tanh(self.norm(self.hidden(x))))


batch = classification()
key = jax.random.key(0)

# [nnx-optimizer]
model = MLP(nnx.Rngs(0))
optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)


@nnx.jit
def train_step(model, optimizer, batch):
    x, labels = batch

    def loss_fn(model):
        logits = model(x)
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


for _ in range(20):
    loss = train_step(model, optimizer, batch)
# [/nnx-optimizer]
assert float(loss) < 0.6, loss

# [nnx-kfac]
model = MLP(nnx.Rngs(0))


def loss_fn(model, batch):  # (1) a function of the model and its inputs
    x, labels = batch
    logits = kfacx.register_softmax_cross_entropy_loss(model(x), labels)  # (2)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))


loss = kfacx.flax.NNXLoss(loss_fn, model)  # (3)
estimator = kfacx.BlockDiagonalCurvature(loss)
tx = optax.chain(  # (4)
    kfacx.scale_by_kfac(estimator, loss.func_args(model, batch), damping=1e-2),
    optax.sgd(learning_rate=0.05, momentum=0.9),
)
optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)


@nnx.jit
def train_step(model, optimizer, key, batch):
    value, grads, stats = kfacx.flax.nnx_value_grads_and_curvature_stats(  # (5)
        estimator, key, model, batch
    )
    optimizer.update(model, grads, curvature_stats=stats)
    return value


for step in range(20):
    value = train_step(model, optimizer, jax.random.fold_in(key, step), batch)
# [/nnx-kfac]
print(estimator.report)
assert estimator.report.unmatched == ()
assert float(value) < 0.6, value
assert float(jnp.abs(model.norm.mean[...]).max()) > 0  # the batch statistics moved

# [nnx-optimizer-kfacx]
model = MLP(nnx.Rngs(0))
loss = kfacx.flax.NNXLoss(loss_fn, model)
params, rest = loss.split(model)  # the nnx.Param arrays, and all other variables
optimizer = kfacx.Optimizer(
    jax.value_and_grad(loss, has_aux=True),
    value_func_has_state=True,
    use_adaptive_learning_rate=True,
    use_adaptive_momentum=True,
    use_adaptive_damping=True,
    initial_damping=1.0,
)
state = optimizer.init(params, key, batch, func_state=rest)
for step in range(10):
    params, state, rest, stats = optimizer.step(
        params, state, jax.random.fold_in(key, step), batch, func_state=rest
    )
nnx.update(model, params, rest)  # back into the module
# [/nnx-optimizer-kfacx]
assert float(stats["loss"]) < 0.6, stats["loss"]
assert float(jnp.abs(model.norm.mean[...]).max()) > 0
print("OK")
