"""optax recipes: scale_by_kfac inside optax's combinators (docs/optax.md)."""

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
from _data import classification

import kfacx


def mlp(x):
    h = hk.LayerNorm(-1, create_scale=True, create_offset=True)(hk.Linear(32)(x))
    return hk.Linear(3)(jnp.tanh(h))


net = hk.without_apply_rng(hk.transform(mlp))


def loss_fn(params, batch):
    x, labels = batch
    logits = kfacx.register_softmax_cross_entropy_loss(net.apply(params, x), labels)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))


batch = classification()
params = net.init(jax.random.key(0), batch[0][:1])
key = jax.random.key(1)


def make_train_step(tx):
    @jax.jit
    def train_step(params, opt_state, key, batch):
        loss, grads, stats = estimator.value_grads_and_curvature_stats(key, (params, batch))
        updates, opt_state = tx.update(grads, opt_state, params, curvature_stats=stats)
        return optax.apply_updates(params, updates), opt_state, loss

    return train_step


# [partition]
estimator = kfacx.BlockDiagonalCurvature(loss_fn)
kfac_sgd = optax.chain(
    kfacx.scale_by_kfac(estimator, (params, batch), damping=1e-2),
    optax.sgd(learning_rate=0.1, momentum=0.9),
)
labels = kfacx.block_labels(estimator, {"dense_tag": "kfac", "conv_tag": "kfac"}, default="adam")
tx = optax.partition({"kfac": kfac_sgd, "adam": optax.adam(1e-2)}, labels)
opt_state = tx.init(params)
train_step = make_train_step(tx)  # the train_step of the chain above, with this tx
for step in range(20):
    params, opt_state, loss = train_step(params, opt_state, jax.random.fold_in(key, step), batch)
# [/partition]
for path, label in jax.tree_util.tree_flatten_with_path(labels(params))[0]:
    print(f"{'/'.join(k.key for k in path):<18} {label}")
kfac_blocks = opt_state.inner_states["kfac"].inner_state[0].estimator_state.blocks
print(f"K-FAC blocks kept: {len(kfac_blocks)} of {len(estimator.blocks)}")
assert float(loss) < 0.5, loss

# [masked]
on_kfac = lambda params: jax.tree.map(lambda label: label == "kfac", labels(params))  # noqa: E731
tx = optax.chain(
    optax.masked(kfacx.scale_by_kfac(estimator, (params, batch), damping=1e-2), on_kfac),
    optax.sgd(learning_rate=0.1, momentum=0.9),
)
# [/masked]
assert len(tx.init(params)[0].inner_state.estimator_state.blocks) == 2


# [inject]
def kfac_sgd(learning_rate, damping):
    return optax.chain(
        kfacx.scale_by_kfac(estimator, (params, batch), damping=damping),
        optax.sgd(learning_rate, momentum=0.9),
    )


tx = optax.inject_hyperparams(kfac_sgd)(
    learning_rate=optax.cosine_decay_schedule(0.1, decay_steps=20), damping=1e-2
)
opt_state = tx.init(params)
train_step = make_train_step(tx)
for step in range(20):
    if step == 10:
        opt_state.hyperparams["damping"] *= 0.5  # used from the next cache refresh on
    params, opt_state, loss = train_step(params, opt_state, jax.random.fold_in(key, step), batch)
# [/inject]
assert np.isclose(float(opt_state.hyperparams["damping"]), 5e-3)
assert float(loss) < 0.5, loss

# [apply-if-finite]
tx = optax.chain(
    kfacx.flag_non_finite_stats(),  # non-finite statistics skip the step too
    optax.apply_if_finite(kfac_sgd(learning_rate=0.1, damping=1e-2), max_consecutive_errors=5),
)
# [/apply-if-finite]
# tests/transform/test_optax_combinators.py runs it on a NaN batch: the step is skipped and the
# parameters and the K-FAC state stay bit-identical.
assert int(tx.init(params)[1].notfinite_count) == 0

try:
    optax.MultiSteps(kfac_sgd(learning_rate=0.1, damping=1e-2), every_k_schedule=4).init(params)
except ValueError as e:
    print(f"ValueError: {e}")
print("OK")
