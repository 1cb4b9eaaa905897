"""Quick start: kfacx.Optimizer on a Haiku MLP (scikit-learn's digits), next to Adam.

The loss function registers its loss on the model output; the optimizer finds
the layers of `hk.nets.MLP` itself (the registration report is printed) and
chooses the learning rate, momentum and damping each step from the quadratic
model of the loss. Adam on the same batches is printed for comparison.

Run:  python examples/quickstart.py [--steps 200]
"""

from __future__ import annotations

import argparse
import time

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits

import kfacx

net = hk.without_apply_rng(hk.transform(lambda x: hk.nets.MLP([64, 64, 10])(x)))


def loss_fn(params, batch):
    images, labels = batch
    logits = kfacx.register_softmax_cross_entropy_loss(net.apply(params, images), labels)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))


def load_data(seed: int = 0):
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    split = int(0.8 * len(x))
    return (x[:split], y[:split]), (x[split:], y[split:])


def accuracy(params, data) -> float:
    images, labels = data
    return float(jnp.mean(jnp.argmax(net.apply(params, images), -1) == labels))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--adam-learning-rate", type=float, default=3e-3)
    parser.add_argument("--print-every", type=int, default=20)
    args = parser.parse_args()

    train, test = load_data()
    rng = jax.random.key(0)
    init_params = net.init(rng, train[0][:1])
    n = len(train[0])

    def batch_at(step):
        idx = np.random.default_rng(step).choice(n, args.batch_size, replace=False)
        return train[0][idx], train[1][idx]

    optimizer = kfacx.Optimizer(
        jax.value_and_grad(loss_fn),
        l2_reg=1e-5,
        add_l2_reg=True,
        use_adaptive_learning_rate=True,
        use_adaptive_momentum=True,
        use_adaptive_damping=True,
        initial_damping=1.0,
        min_damping=1e-4,
    )
    kfac_params = init_params
    kfac_state = optimizer.init(kfac_params, rng, batch_at(0))
    print(optimizer.estimator.report, end="\n\n")

    adam = optax.adam(args.adam_learning_rate)
    adam_params, adam_state = init_params, adam.init(init_params)

    @jax.jit
    def adam_step(params, state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, state = adam.update(grads, state)
        return optax.apply_updates(params, updates), state, loss

    start = time.perf_counter()
    for step in range(args.steps):
        batch = batch_at(step)
        rng, key = jax.random.split(rng)
        kfac_params, kfac_state, stats = optimizer.step(kfac_params, kfac_state, key, batch)
        adam_params, adam_state, adam_loss = adam_step(adam_params, adam_state, batch)
        if step % args.print_every == 0 or step == args.steps - 1:
            print(
                f"step {step:4d}  kfac loss {float(stats['loss']):.4f}  "
                f"(lr {float(stats['learning_rate']):.3f}, momentum "
                f"{float(stats['momentum']):.2f}, damping {float(stats['damping']):.2g})  "
                f"adam loss {float(adam_loss):.4f}"
            )
    seconds = time.perf_counter() - start
    print(f"{args.steps} steps of both in {seconds:.1f} s")
    kfac_acc, adam_acc = accuracy(kfac_params, test), accuracy(adam_params, test)
    print(f"test accuracy: kfacx {kfac_acc:.3f}, adam {adam_acc:.3f}")


if __name__ == "__main__":
    main()
