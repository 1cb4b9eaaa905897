"""Layers inside lax.scan and the registration report (docs/registration_report.md)."""

import warnings

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
from _data import classification

import kfacx


# [layer-stack]
def forward(x):
    x = jnp.tanh(hk.Linear(16, name="inp")(x))
    x = hk.layer_stack(3)(lambda h: jnp.tanh(hk.Linear(16, name="hidden")(h)))(x)
    return hk.Linear(3, name="out")(x)


net = hk.without_apply_rng(hk.transform(forward))


def loss_fn(params, batch):
    x, labels = batch
    logits = kfacx.register_softmax_cross_entropy_loss(net.apply(params, x), labels)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))


batch = classification()
params = net.init(jax.random.key(0), batch[0][:1])
estimator = kfacx.BlockDiagonalCurvature(loss_fn)
estimator.init(jax.random.key(0), (params, batch))
print(estimator.report)
# [/layer-stack]
stacked = [e for e in estimator.report.entries if e.stack_size]
assert {e.stack_size for e in stacked} == {3} and len(stacked) == 2, estimator.report
assert "StackedBlock(DenseTwoKroneckerFactored)" in str(estimator.report)


# [rnn]
def rnn_loss(params, batch):
    xs, labels = batch  # xs: [batch, time, features]

    def cell(h, x_t):
        h = jnp.tanh(x_t @ params["wx"] + (h @ params["wh"] + params["b"]))
        return h, None

    h0 = jnp.zeros((xs.shape[0], params["wh"].shape[0]))
    h, _ = jax.lax.scan(cell, h0, jnp.swapaxes(xs, 0, 1))  # scan over time
    logits = h @ params["wo"] + params["bo"]
    logits = kfacx.register_softmax_cross_entropy_loss(logits, labels)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))


# [/rnn]
rng = np.random.default_rng(0)
rnn_params = {
    "wx": rng.standard_normal((8, 16)).astype(np.float32) / 3,
    "wh": rng.standard_normal((16, 16)).astype(np.float32) / 4,
    "b": np.zeros((16,), np.float32),
    "wo": rng.standard_normal((16, 3)).astype(np.float32) / 4,
    "bo": np.zeros((3,), np.float32),
}
x, labels = batch
sequences = np.stack([x, np.roll(x, 1, 0), np.roll(x, 2, 0), np.roll(x, 3, 0)], axis=1)
with warnings.catch_warnings():
    warnings.simplefilter("error")  # every parameter is matched: no warning
    _, report = kfacx.auto_register_tags(rnn_loss, (rnn_params, (sequences, labels)))
estimator = kfacx.BlockDiagonalCurvature(rnn_loss)
estimator.init(jax.random.key(0), (rnn_params, (sequences, labels)))
print(estimator.report)
found = {e.path: (e.source, e.uses) for e in report.entries}
assert found == {
    "b": ("dense_with_bias", 4),
    "wh": ("dense_with_bias", 4),
    "wx": ("dense", 4),
    "wo": ("dense_with_bias", 1),
    "bo": ("dense_with_bias", 1),
}, found
print("OK")
