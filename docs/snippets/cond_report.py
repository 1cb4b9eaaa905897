"""Layers inside lax.cond branches: stochastic depth and the registration report
(docs/registration_report.md)."""

import warnings

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
from _data import classification

import kfacx


# [stochastic-depth]
def forward(x, keep):
    """A residual MLP whose two hidden blocks are each skipped when keep[i] is False."""
    h = jnp.tanh(hk.Linear(16, name="inp")(x))
    for i in range(2):
        block = hk.Linear(16, name=f"block{i}")
        if hk.running_init():
            block(h)  # create the branch's parameters outside it
        h = hk.cond(keep[i], lambda h, block=block: h + jnp.tanh(block(h)), lambda h: h, h)
    return hk.Linear(3, name="out")(h)


net = hk.without_apply_rng(hk.transform(forward))


def loss_fn(params, rng, batch):
    x, labels = batch
    keep = jax.random.bernoulli(rng, 0.7, (2,))  # a new draw every step
    logits = kfacx.register_softmax_cross_entropy_loss(net.apply(params, x, keep), labels)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))


batch = classification()
params = net.init(jax.random.key(0), batch[0][:1], jnp.ones(2, bool))
optimizer = kfacx.Optimizer(
    jax.value_and_grad(loss_fn),
    value_func_has_rng=True,
    use_adaptive_learning_rate=True,
    use_adaptive_momentum=True,
    initial_damping=1e-2,
)
state = optimizer.init(params, jax.random.key(1), batch)
print(optimizer.estimator.report)
# [/stochastic-depth]
with warnings.catch_warnings():
    warnings.simplefilter("error")  # every parameter is matched: no warning
    _, report = kfacx.auto_register_tags(
        lambda p, b: loss_fn(p, jax.random.key(0), b), (params, batch)
    )
assert report.notes == () and report.unmatched == (), report
assert {e.path.split("/")[0] for e in report.entries if e.in_branch} == {"block0", "block1"}
losses = []
for step in range(10):
    params, state, stats = optimizer.step(params, state, jax.random.key(2 + step), batch=batch)
    losses.append(float(stats["loss"]))
print(f"loss {losses[0]:.2f} -> {losses[-1]:.2f} in {len(losses)} steps")
assert np.isfinite(losses).all() and losses[-1] < 0.5 * losses[0], losses
print("OK")
