"""Quick start: a hand-tagged Haiku MLP on scikit-learn's digits, preconditioned by kfacx.

Every dense layer is marked with `kfacx.register_dense` and the loss with
`kfacx.register_softmax_cross_entropy_loss`. Each step estimates the
Kronecker-factored curvature on the batch, refreshes the damped inverses every
few steps, and takes a plain SGD step along the preconditioned gradient. The
same network trained by SGD on the raw gradient is printed for comparison.

Run:  python examples/quickstart.py [--steps 200]
"""

from __future__ import annotations

import argparse
import time

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
from sklearn.datasets import load_digits

import kfacx


class TaggedLinear(hk.Module):
    """``hk.Linear`` that marks itself for kfacx."""

    def __init__(self, output_size: int, name: str | None = None):
        super().__init__(name=name)
        self.output_size = output_size

    def __call__(self, x: jax.Array) -> jax.Array:
        d_in = x.shape[-1]
        w_init = hk.initializers.TruncatedNormal(1.0 / np.sqrt(d_in))
        w = hk.get_parameter("w", [d_in, self.output_size], x.dtype, init=w_init)
        b = hk.get_parameter("b", [self.output_size], x.dtype, init=jnp.zeros)
        y = x @ w + jnp.broadcast_to(b, (x.shape[0], self.output_size))
        return kfacx.register_dense(y, x, w, b)


def mlp(x: jax.Array) -> jax.Array:
    for i, width in enumerate((64, 64)):
        x = jnp.tanh(TaggedLinear(width, name=f"linear_{i}")(x))
    return TaggedLinear(10, name="logits")(x)


net = hk.without_apply_rng(hk.transform(mlp))


def loss_fn(params, batch):
    images, labels = batch
    logits = kfacx.register_softmax_cross_entropy_loss(net.apply(params, images), labels)
    log_p = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(log_p, labels[:, None], axis=1))


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
    parser.add_argument("--learning-rate", type=float, default=0.1)
    parser.add_argument("--damping", type=float, default=0.1)
    parser.add_argument("--inverse-update-period", type=int, default=5)
    parser.add_argument("--sgd-learning-rate", type=float, default=0.3)
    parser.add_argument("--print-every", type=int, default=20)
    args = parser.parse_args()

    train, test = load_data()
    rng = jax.random.PRNGKey(0)
    init_params = net.init(rng, train[0][:1])
    estimator = kfacx.BlockDiagonalCurvature(loss_fn)
    batch0 = (train[0][: args.batch_size], train[1][: args.batch_size])
    curvature = estimator.init(rng, (init_params, batch0))

    @jax.jit
    def kfac_step(params, curvature, rng, batch, refresh):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        curvature = estimator.update_curvature_matrix_estimate(
            curvature, 0.95, 0.05, None, rng, (params, batch)
        )
        curvature = jax.lax.cond(
            refresh, lambda c: estimator.update_cache(c, args.damping), lambda c: c, curvature
        )
        direction = estimator.multiply_inverse(curvature, grads, args.damping, use_cached=True)
        params = jax.tree_util.tree_map(lambda p, d: p - args.learning_rate * d, params, direction)
        return params, curvature, loss

    @jax.jit
    def sgd_step(params, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        return jax.tree_util.tree_map(
            lambda p, g: p - args.sgd_learning_rate * g, params, grads
        ), loss

    n = len(train[0])
    kfac_params, sgd_params = init_params, init_params
    start = time.perf_counter()
    for step in range(args.steps):
        idx = np.random.default_rng(step).choice(n, args.batch_size, replace=False)
        batch = (train[0][idx], train[1][idx])
        rng, key = jax.random.split(rng)
        refresh = step % args.inverse_update_period == 0
        kfac_params, curvature, kfac_loss = kfac_step(kfac_params, curvature, key, batch, refresh)
        sgd_params, sgd_loss = sgd_step(sgd_params, batch)
        if step % args.print_every == 0 or step == args.steps - 1:
            print(
                f"step {step:4d}  kfac loss {float(kfac_loss):.4f}  sgd loss {float(sgd_loss):.4f}"
            )
    seconds = time.perf_counter() - start
    print(f"{args.steps} steps in {seconds:.1f} s")
    kfac_acc, sgd_acc = accuracy(kfac_params, test), accuracy(sgd_params, test)
    print(f"test accuracy: kfacx {kfac_acc:.3f}, sgd {sgd_acc:.3f}")


if __name__ == "__main__":
    main()
