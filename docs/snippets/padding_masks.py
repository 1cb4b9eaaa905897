"""optax recipes: padded batches with an example mask (docs/optax.md)."""

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
from _data import classification

import kfacx

net = hk.without_apply_rng(hk.transform(lambda x: hk.nets.MLP([32, 3])(x)))


# [loss]
def loss_fn(params, batch):
    x, labels, mask = batch  # mask: 1.0 for real examples, 0.0 for padding
    logits = kfacx.register_softmax_cross_entropy_loss(net.apply(params, x), labels, mask=mask)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    return jnp.sum(mask * losses) / jnp.maximum(jnp.sum(mask), 1.0)


# [/loss]

x, labels = classification(n=100)
pad = 28  # pad the last batch of 100 examples to 128
batch = (
    np.concatenate([x, np.zeros((pad, x.shape[1]), x.dtype)]),
    np.concatenate([labels, np.zeros((pad,), labels.dtype)]),
    np.concatenate([np.ones((100,), np.float32), np.zeros((pad,), np.float32)]),
)
params = net.init(jax.random.key(0), x[:1])
key = jax.random.key(1)

# [estimator]
estimator = kfacx.BlockDiagonalCurvature(loss_fn)
loss, grads, stats = jax.jit(estimator.value_grads_and_curvature_stats)(
    key, (params, batch), example_mask=batch[2]
)
assert float(stats.batch_size) == 100  # statistics average over the real examples only
# [/estimator]

# The padded batch gives the statistics and gradients of the real examples alone
# (checked here with the deterministic empirical Fisher).
real = (x, labels, np.ones((100,), np.float32))
real_estimator = kfacx.BlockDiagonalCurvature(loss_fn)


@jax.jit
def padded_and_real(params):
    mode = dict(estimation_mode="fisher_empirical")
    _, g_pad, s_pad = estimator.value_grads_and_curvature_stats(
        key, (params, batch), example_mask=batch[2], **mode
    )
    _, g_real, s_real = real_estimator.value_grads_and_curvature_stats(key, (params, real), **mode)
    return (g_pad, s_pad), (g_real, s_real)


padded, unpadded = padded_and_real(params)
for a, b in zip(jax.tree.leaves(padded), jax.tree.leaves(unpadded), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)

# [optimizer]
optimizer = kfacx.Optimizer(
    jax.value_and_grad(loss_fn),
    learning_rate_schedule=0.1,
    momentum_schedule=0.9,
    damping_schedule=1e-2,
    num_burnin_steps=0,
    example_mask_extractor=lambda batch: batch[2],
)
state = optimizer.init(params, key, batch)
params, state, stats = optimizer.step(params, state, key, batch)
# [/optimizer]
assert int(stats["data_seen"]) == 100, stats["data_seen"]
print("OK")
