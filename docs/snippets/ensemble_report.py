"""A vmapped ensemble and its registration report (docs/registration_report.md)."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _data import classification

import kfacx


# [ensemble]
def member(p, x):  # one member: a two-layer MLP
    h = jnp.tanh(x @ p["hidden"]["w"] + p["hidden"]["b"][None, :])
    return h @ p["out"]["w"] + p["out"]["b"][None, :]


def loss_fn(params, batch):
    x, labels = batch
    logits = jax.vmap(member, in_axes=(0, None))(params, x).mean(0)  # average the members
    logits = kfacx.register_softmax_cross_entropy_loss(logits, labels)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))


members, features, hidden, classes = 5, 8, 16, 3
rng = np.random.default_rng(0)
params = {  # every parameter has a leading member axis
    "hidden": {
        "w": rng.normal(size=(members, features, hidden)) / 3,
        "b": np.zeros((members, hidden)),
    },
    "out": {
        "w": rng.normal(size=(members, hidden, classes)) / 4,
        "b": np.zeros((members, classes)),
    },
}
params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params)
batch = classification()
estimator = kfacx.BlockDiagonalCurvature(loss_fn)
with warnings.catch_warnings():
    warnings.simplefilter("error")  # every parameter is matched: no warning
    estimator.init(jax.random.key(0), (params, batch))
print(estimator.report)
# [/ensemble]
assert {e.stack_size for e in estimator.report.entries} == {members}, estimator.report
assert estimator.report.unmatched == () and estimator.report.notes == ()
print("OK")
