"""Haiku's GRU, whose recurrent weight is split between two layers, and its registration
report (docs/registration_report.md)."""

import warnings

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

import kfacx


# [gru]
def forward(x):  # x: [batch, time, features]
    core = hk.GRU(8)  # w_h_z, w_h_a = jnp.split(w_h, [16], axis=1); b likewise
    outputs, _ = hk.dynamic_unroll(core, jnp.swapaxes(x, 0, 1), core.initial_state(x.shape[0]))
    return jnp.swapaxes(outputs, 0, 1)


model = hk.without_apply_rng(hk.transform(forward))


def loss_fn(params, batch):
    x, targets = batch
    outputs = kfacx.register_squared_error_loss(model.apply(params, x), targets)
    return 0.5 * jnp.mean(jnp.sum((outputs - targets) ** 2, -1))


rng = np.random.default_rng(0)
x = jnp.asarray(rng.normal(size=(4, 5, 3)), jnp.float32)
batch = (x, jnp.zeros((4, 5, 8), jnp.float32))
params = model.init(jax.random.key(0), x)
optimizer = kfacx.Optimizer(
    jax.value_and_grad(loss_fn), learning_rate_schedule=0.1, momentum_schedule=0.5
)
with warnings.catch_warnings():
    warnings.simplefilter("error")  # every parameter is matched: no warning
    optimizer.init(params, jax.random.key(0), batch)
print(optimizer.estimator.report)
# [/gru]
report = optimizer.estimator.report
assert report.unmatched == () and report.notes == ()
print("OK")
