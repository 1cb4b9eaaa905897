"""A fused-gate LSTM (Flax's OptimizedLSTMCell) and its registration report
(docs/registration_report.md)."""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import kfacx

# [fused-lstm]
model = nn.RNN(nn.OptimizedLSTMCell(8))  # x @ concatenate([w_i, w_f, w_g, w_o], -1)


def loss_fn(params, batch):
    x, targets = batch
    outputs = kfacx.register_squared_error_loss(model.apply(params, x), targets)
    return 0.5 * jnp.mean(jnp.sum((outputs - targets) ** 2, -1))


rng = np.random.default_rng(0)
x = jnp.asarray(rng.normal(size=(4, 5, 3)), jnp.float32)  # [batch, time, features]
batch = (x, jnp.zeros((4, 5, 8), jnp.float32))
params = model.init(jax.random.key(0), x)
optimizer = kfacx.Optimizer(
    jax.value_and_grad(loss_fn), learning_rate_schedule=0.1, momentum_schedule=0.5
)
with warnings.catch_warnings():
    warnings.simplefilter("error")  # every parameter is matched: no warning
    optimizer.init(params, jax.random.key(0), batch)
print(optimizer.estimator.report)
# [/fused-lstm]
report = optimizer.estimator.report
assert report.unmatched == () and report.notes == ()
assert len({e.layer for e in report.entries}) == 2, report
print("OK")
