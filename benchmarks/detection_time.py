"""How long automatic layer detection takes on ResNet-style stacks of growing depth.

Run:  python benchmarks/detection_time.py
Prints, per depth, the number of jaxpr equations, parameters, unmatched
parameters and the time of `auto_register_tags` (first call, and again).
"""

from __future__ import annotations

import time

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

import kfacx


def _block(x, i):
    h = hk.Conv2D(8, 3, with_bias=False, name=f"c{i}a")(x)
    h = jax.nn.relu(hk.LayerNorm(-1, True, True, name=f"n{i}a")(h))
    h = hk.Conv2D(8, 3, with_bias=False, name=f"c{i}b")(h)
    h = hk.LayerNorm(-1, True, True, name=f"n{i}b")(h)
    return jax.nn.relu(x + h)


def _problem(depth: int):
    def net_fn(x):
        x = hk.Conv2D(8, 3, name="stem")(x)
        for i in range(depth):
            x = _block(x, i)
        return hk.Linear(10)(jnp.mean(x, axis=(1, 2)))

    net = hk.without_apply_rng(hk.transform(net_fn))
    x, t = np.zeros((2, 8, 8, 3), np.float32), np.zeros(2, np.int32)
    params = net.init(jax.random.PRNGKey(0), x)

    def loss(p, batch):
        logits = kfacx.register_softmax_cross_entropy_loss(net.apply(p, batch[0]), batch[1])
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), batch[1][:, None], 1))

    return loss, (params, (x, t))


def main() -> None:
    for depth in (8, 24, 48):
        loss, args = _problem(depth)
        num_eqns = len(jax.make_jaxpr(loss)(*args).eqns)
        start = time.perf_counter()
        _, report = kfacx.auto_register_tags(loss, args)
        first = time.perf_counter() - start
        start = time.perf_counter()
        kfacx.auto_register_tags(loss, args)
        again = time.perf_counter() - start
        print(
            f"depth {depth:3d}: {num_eqns:5d} equations, {len(report.entries):4d} parameters, "
            f"{len(report.unmatched)} unmatched, detection {first:.2f} s (again {again:.2f} s)"
        )


if __name__ == "__main__":
    main()
