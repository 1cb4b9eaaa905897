"""Parameters passed through an elementwise map before their layer (a masked weight, a
softplus query scaler, a log-scale), and the registration report
(docs/registration_report.md)."""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import kfacx


# [elementwise]
class MaskedDense(nn.Module):  # an autoregressive (MADE-style) layer
    mask: np.ndarray

    @nn.compact
    def __call__(self, x):
        w = self.param("kernel", nn.initializers.lecun_normal(), self.mask.shape)
        b = self.param("bias", nn.initializers.zeros, self.mask.shape[-1:])
        return x @ (w * self.mask) + b


class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = jax.nn.relu(MaskedDense(np.triu(np.ones((4, 8), np.float32)))(x))
        q = nn.Dense(8, use_bias=False, name="query")(h)
        scale = self.param("query_scale", nn.initializers.zeros, (8,))
        q = q * (1.44 * jax.nn.softplus(scale))  # a learned per-feature query scaler
        log_scale = self.param("log_scale", nn.initializers.zeros, (8,))
        return nn.Dense(2, name="head")(jnp.tanh(q) * jnp.exp(log_scale))


model = Model()


def loss_fn(params, batch):
    x, targets = batch
    outputs = kfacx.register_squared_error_loss(model.apply(params, x), targets)
    return 0.5 * jnp.mean(jnp.sum((outputs - targets) ** 2, -1))


rng = np.random.default_rng(0)
batch = (jnp.asarray(rng.normal(size=(16, 4)), jnp.float32), jnp.zeros((16, 2), jnp.float32))
params = model.init(jax.random.key(0), batch[0])
optimizer = kfacx.Optimizer(
    jax.value_and_grad(loss_fn), learning_rate_schedule=0.1, momentum_schedule=0.5
)
with warnings.catch_warnings():
    warnings.simplefilter("error")  # every parameter is matched: no warning
    optimizer.init(params, jax.random.key(0), batch)
print(optimizer.estimator.report)
# [/elementwise]
report = optimizer.estimator.report
assert report.unmatched == () and report.notes == ()
print("OK")
