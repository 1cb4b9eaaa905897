"""How long automatic layer detection takes on deep models.

Run:  python benchmarks/detection_time.py

Two families of growing depth: ResNet-style convolution stacks and Transformer
language models (attention, MLP, LayerNorm, embedding). Each model is measured
in a fresh process, so the first call pays what a user's first call pays
(tracing, matching, and the one-off compilations that verify each distinct
match numerically); "again" is a second call in the same process. Prints, per
model, the number of jaxpr equations, parameters, unmatched parameters and
both times.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

import kfacx


def _res_block(x, i):
    h = hk.Conv2D(8, 3, with_bias=False, name=f"c{i}a")(x)
    h = jax.nn.relu(hk.LayerNorm(-1, True, True, name=f"n{i}a")(h))
    h = hk.Conv2D(8, 3, with_bias=False, name=f"c{i}b")(h)
    h = hk.LayerNorm(-1, True, True, name=f"n{i}b")(h)
    return jax.nn.relu(x + h)


def _resnet(depth: int):
    def net_fn(x):
        x = hk.Conv2D(8, 3, name="stem")(x)
        for i in range(depth):
            x = _res_block(x, i)
        return hk.Linear(10)(jnp.mean(x, axis=(1, 2)))

    x, t = np.zeros((2, 8, 8, 3), np.float32), np.zeros(2, np.int32)
    return net_fn, x, t


def _transformer(depth: int, vocab: int = 32, d: int = 16, seq: int = 8):
    def net_fn(tokens):
        h = hk.Embed(vocab, d, name="embed")(tokens)
        mask = jnp.tril(jnp.ones((seq, seq), bool))[None, None]
        for i in range(depth):
            a = hk.LayerNorm(-1, True, True, name=f"ln{i}a")(h)
            attention = hk.MultiHeadAttention(
                2, d // 2, w_init=hk.initializers.VarianceScaling(), name=f"attn{i}"
            )
            a = attention(a, a, a, mask=mask)
            h = h + a
            m = hk.LayerNorm(-1, True, True, name=f"ln{i}b")(h)
            h = h + hk.Linear(d, name=f"mlp{i}b")(jax.nn.gelu(hk.Linear(4 * d, name=f"mlp{i}a")(m)))
        h = hk.LayerNorm(-1, True, True, name="ln_f")(h)
        return hk.Linear(vocab, name="head")(h).reshape(-1, vocab)

    tokens = np.zeros((2, seq), np.int32)
    return net_fn, tokens, np.zeros(2 * seq, np.int32)


_FAMILIES = {"resnet": (_resnet, (8, 24, 48)), "transformer": (_transformer, (2, 8, 21))}


def _problem(family: str, depth: int):
    net_fn, x, t = _FAMILIES[family][0](depth)
    net = hk.without_apply_rng(hk.transform(net_fn))
    params = net.init(jax.random.PRNGKey(0), x)

    def loss(p, batch):
        logits = kfacx.register_softmax_cross_entropy_loss(net.apply(p, batch[0]), batch[1])
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), batch[1][:, None], 1))

    return loss, (params, (x, t))


def _measure(family: str, depth: int) -> None:
    loss, args = _problem(family, depth)
    num_eqns = len(jax.make_jaxpr(loss)(*args).eqns)
    start = time.perf_counter()
    _, report = kfacx.auto_register_tags(loss, args)
    first = time.perf_counter() - start
    start = time.perf_counter()
    kfacx.auto_register_tags(loss, args)
    again = time.perf_counter() - start
    print(
        f"{family:11s} depth {depth:3d}: {num_eqns:5d} equations, {len(report.entries):4d} "
        f"parameters, {len(report.unmatched)} unmatched, detection {first:.2f} s "
        f"(again {again:.2f} s)",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=sorted(_FAMILIES), help="measure one model, here")
    parser.add_argument("--depth", type=int)
    args = parser.parse_args()
    if args.family is not None:
        _measure(args.family, args.depth)
        return
    for family, (_, depths) in _FAMILIES.items():
        for depth in depths:
            command = [sys.executable, __file__, "--family", family, "--depth", str(depth)]
            subprocess.run(command, check=True)


if __name__ == "__main__":
    main()
