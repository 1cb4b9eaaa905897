"""optax recipes: micro-batch accumulation with aggregating.process (docs/optax.md)."""

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
from _data import classification
from optax.experimental import aggregating

import kfacx

net = hk.without_apply_rng(hk.transform(lambda x: hk.nets.MLP([32, 3])(x)))


def loss_fn(params, batch):
    x, labels = batch
    logits = kfacx.register_softmax_cross_entropy_loss(net.apply(params, x), labels)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))


batch = classification()
params = net.init(jax.random.key(0), batch[0][:1])

# [microbatches]
k = 4  # micro-batches per update
micro_batches = [jax.tree.map(lambda a, i=i: a[i::k], batch) for i in range(k)]

estimator = kfacx.BlockDiagonalCurvature(loss_fn)
kfac_sgd = optax.chain(  # scale_by_kfac sets the estimator up
    kfacx.scale_by_kfac(estimator, (params, micro_batches[0]), damping=1e-2),
    optax.sgd(learning_rate=0.1, momentum=0.9),
)
tx = aggregating.process(
    optax.with_extra_args_support(optax.identity()),  # preprocessor
    kfacx.accumulate_curvature_stats(estimator, k),  # aggregator
    kfac_sgd,  # postprocessor: runs once every k micro-batches
    aggregator_has_aux=True,
)
opt_state = tx.init(params)


@jax.jit
def micro_step(params, opt_state, key, micro_batch):
    loss, grads, stats = estimator.value_grads_and_curvature_stats(key, (params, micro_batch))
    updates, opt_state = tx.update(grads, opt_state, params, curvature_stats=stats)
    return optax.apply_updates(params, updates), opt_state, loss


key = jax.random.key(1)
for i, micro_batch in enumerate(micro_batches):
    before = params
    key, step_key = jax.random.split(key)
    params, opt_state, loss = micro_step(params, opt_state, step_key, micro_batch)
    # The updates are zero until the k-th micro-batch completes the batch.
    # [/microbatches]
    moved = any(
        bool(np.any(a != b))
        for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(params), strict=True)
    )
    assert moved == (i == k - 1), (i, moved)
print("OK")
