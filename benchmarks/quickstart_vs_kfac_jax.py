"""Benchmark: the quick start's problem with kfac-jax's quick-start settings, in both libraries.

scikit-learn's digits (the 1,437 training images of `examples/quickstart.py`'s split),
`hk.nets.MLP([64, 64, 10])`, batches of 256 drawn afresh each step, and the settings of
kfac-jax's README: adaptive learning rate, momentum and damping,
``initial_damping=1.0``, ``min_damping=1e-4``, ``l2_reg=1e-5`` with the regularizer in
the loss. The same file runs in either library: ``--library kfacx`` imports
``kfacx.kfac_jax as kfac_jax`` (the one-line port), ``--library kfac-jax`` the peer
itself, which needs a second virtualenv (``jax==0.9.0``, ``kfac-jax==0.0.8``,
``dm-haiku``, ``optax``, ``scikit-learn``).

Each seed (the initial parameters, the batches and the step keys) is one run. A run
diverges when a step's loss is not finite, or its final loss is above 10x its own
minimum. Printed per run, one JSON line: the final loss on all training images (data
term only, the same function in both libraries), the test accuracy, the minimum and
final step losses and the seconds of the steps (compilation excluded).

Run:  python benchmarks/quickstart_vs_kfac_jax.py --library kfacx [--steps 1000 --seeds 0 1 2]
      PEER_VENV/bin/python benchmarks/quickstart_vs_kfac_jax.py --library kfac-jax
Runtime on a 2-core CPU: about 20 s a run of 1,000 steps (kfacx), 15 s (kfac-jax).
"""

from __future__ import annotations

import argparse
import json
import math
import time

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits

L2_REG = 1e-5

net = hk.without_apply_rng(hk.transform(lambda x: hk.nets.MLP([64, 64, 10])(x)))


def load_data(seed: int = 0):
    """`examples/quickstart.py`'s split of the digits (80% train, 20% test)."""
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    split = int(0.8 * len(x))
    return (x[:split], y[:split]), (x[split:], y[split:])


def data_loss(params, images, labels):
    logits = net.apply(params, images)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))


def run(kfac_jax, seed: int, steps: int, batch_size: int, train, test) -> dict:
    def loss_fn(params, batch):
        images, labels = batch
        logits = net.apply(params, images)
        kfac_jax.register_softmax_cross_entropy_loss(logits, labels)
        loss = jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))
        return loss + L2_REG * kfac_jax.utils.inner_product(params, params) / 2.0

    rng = jax.random.PRNGKey(seed)
    rng, init_key = jax.random.split(rng)
    params = net.init(init_key, train[0][:1])
    sampler = np.random.default_rng(seed)
    n = len(train[0])

    def batch():
        idx = sampler.choice(n, batch_size, replace=False)
        return train[0][idx], train[1][idx]

    def batches():
        while True:
            yield batch()

    data = batches()  # each step (and kfac-jax's burn-in at the first) draws from it

    optimizer = kfac_jax.Optimizer(
        value_and_grad_func=jax.value_and_grad(loss_fn),
        l2_reg=L2_REG,
        value_func_has_aux=False,
        value_func_has_state=False,
        value_func_has_rng=False,
        use_adaptive_learning_rate=True,
        use_adaptive_momentum=True,
        use_adaptive_damping=True,
        initial_damping=1.0,
        min_damping=1e-4,
        multi_device=False,
    )
    rng, key = jax.random.split(rng)
    state = optimizer.init(params, key, next(data))
    losses, seconds = [], 0.0
    for step in range(steps):
        rng, key = jax.random.split(rng)
        t0 = time.perf_counter()
        params, state, stats = optimizer.step(
            params, state, key, data_iterator=data, global_step_int=step
        )
        loss = float(stats["loss"])  # blocks until the step is done
        if step:
            seconds += time.perf_counter() - t0
        losses.append(loss)
        if not math.isfinite(loss):
            break
    final = float(data_loss(params, *train))
    accuracy = float(jnp.mean(jnp.argmax(net.apply(params, test[0]), -1) == test[1]))
    finite = all(math.isfinite(x) for x in losses)
    return dict(
        seed=seed,
        steps=len(losses),
        final_train_loss=final,
        test_accuracy=accuracy,
        min_step_loss=min(losses),
        final_step_loss=losses[-1],
        diverged=not finite or not math.isfinite(final) or losses[-1] > 10 * min(losses),
        step_seconds=round(seconds, 2),
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--library", choices=["kfacx", "kfac-jax"], default="kfacx")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--seeds", type=int, nargs="+", default=list(range(8)))
    args = parser.parse_args(argv)
    if args.library == "kfacx":
        import kfacx.kfac_jax as kfac_jax
    else:
        import kfac_jax
    train, test = load_data()
    for seed in args.seeds:
        result = run(kfac_jax, seed, args.steps, args.batch_size, train, test)
        print(json.dumps(dict(library=args.library, jax=jax.__version__, **result)), flush=True)


if __name__ == "__main__":
    main()
