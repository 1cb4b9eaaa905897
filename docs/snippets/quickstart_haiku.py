"""Quick start: kfacx.Optimizer on a Haiku MLP (docs/quickstart.md)."""

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax

import kfacx

# [model]
net = hk.without_apply_rng(hk.transform(lambda x: hk.nets.MLP([32, 32, 3])(x)))


def loss_fn(params, batch):
    x, labels = batch
    logits = kfacx.register_softmax_cross_entropy_loss(net.apply(params, x), labels)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))


# [/model]

rng = np.random.default_rng(0)
x = rng.standard_normal((128, 8)).astype(np.float32)
labels = ((x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 0)).astype(np.int32)  # 3 classes
batch = (x, labels)

# [optimizer]
optimizer = kfacx.Optimizer(
    jax.value_and_grad(loss_fn),
    l2_reg=1e-5,
    use_adaptive_learning_rate=True,
    use_adaptive_momentum=True,
    use_adaptive_damping=True,
    initial_damping=1.0,
)
key = jax.random.key(0)
params = net.init(key, batch[0][:1])
state = optimizer.init(params, key, batch)  # finds the layers
print(optimizer.estimator.report)

for step in range(20):
    key, step_key = jax.random.split(key)
    params, state, stats = optimizer.step(params, state, step_key, batch)
    if step % 5 == 0:
        print(
            f"step {step}: loss {float(stats['loss']):.3f}, "
            f"learning rate {float(stats['learning_rate']):.3f}, "
            f"momentum {float(stats['momentum']):.2f}, damping {float(stats['damping']):.2g}"
        )
# [/optimizer]

assert float(stats["loss"]) < 0.5, stats["loss"]
assert optimizer.estimator.report.unmatched == ()

# [configs]
grouped = kfacx.Optimizer(
    jax.value_and_grad(loss_fn),
    l2_reg=1e-5,
    curvature=kfacx.CurvatureConfig(curvature_ema=0.9, inverse_update_period=10),
    learning_rate=kfacx.LearningRateConfig(
        learning_rate_schedule=optax.cosine_decay_schedule(0.1, decay_steps=1000),
        momentum_schedule=0.9,
    ),
    damping=kfacx.DampingConfig(damping_schedule=1e-3),
)
flat = kfacx.Optimizer(  # the same options with kfac-jax's flat names
    jax.value_and_grad(loss_fn),
    l2_reg=1e-5,
    curvature_ema=0.9,
    inverse_update_period=10,
    learning_rate_schedule=grouped.learning_rate.learning_rate_schedule,
    momentum_schedule=0.9,
    damping_schedule=1e-3,
)
assert (flat.curvature, flat.learning_rate, flat.damping) == (
    grouped.curvature,
    grouped.learning_rate,
    grouped.damping,
)
# [/configs]

print("OK")
