"""The kernel floor of a K-FAC step: a hand-written minimal step of the deep autoencoder
next to kfacx's step with the same settings and an Adam step, compiled in one process
(kernels counted as in ``kernels.py``).

The hand-written step is K-FAC with nothing else: the loss and gradient, a backward
pass with Bernoulli targets sampled from the model (as ``fisher_gradients``), the two
Kronecker factors of each of the 8 dense layers (bias folded into the input factor)
and their moving averages, the product with the cached inverses, and momentum. No
refresh, no non-finite guard, no L2 term, no stats. kfacx's step runs the
``standard`` configuration of ``vs_kfac_jax.py`` (fixed learning rate, momentum and
damping) with its refresh taken out, as ``kernels.py``'s ``kfac_no_refresh``.

Run:  python benchmarks/kernel_floor.py
"""

from __future__ import annotations

import sys

sys.path.insert(0, __import__("os").path.dirname(__file__))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import kernels as K  # noqa: E402
import optax  # noqa: E402
import vs_kfac_jax as v  # noqa: E402

import kfacx  # noqa: E402


def forward(params, x, eps):
    h, ins = x, []
    for i, (w, b) in enumerate(params):
        ins.append(h)
        z = h @ w + b + eps[i]
        h = jnp.tanh(z) if i < len(params) - 1 else z
    return h, ins


def xent(logits, t):
    return jnp.sum(optax.sigmoid_binary_cross_entropy(logits, t)) / logits.shape[0]


def step(params, state, rng, x):
    A, G, Ainv, Ginv, vel = state
    eps = [jnp.zeros((x.shape[0], w.shape[1])) for w, _ in params]

    def loss_fn(p, e):
        logits, ins = forward(p, x, e)
        return xent(logits, x), (logits, ins)

    (loss, (logits, ins)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, eps)
    t = jax.random.bernoulli(rng, jax.nn.sigmoid(logits)).astype(x.dtype)
    gs = jax.grad(lambda e: xent(forward(params, x, e)[0], t))(eps)
    n = x.shape[0]
    new_A, new_G, upd, new_vel = [], [], [], []
    for i, ((gw, gb), a, g) in enumerate(zip(grads, ins, gs, strict=True)):
        a1 = jnp.concatenate([a, jnp.ones((n, 1))], 1)
        new_A.append(0.95 * A[i] + 0.05 * (a1.T @ a1) / n)
        new_G.append(0.95 * G[i] + 0.05 * (g.T @ g) * n)
        gwb = jnp.concatenate([gw, gb[None]], 0)
        p = Ainv[i] @ gwb @ Ginv[i]
        vv = 0.9 * vel[i] - 0.1 * p
        new_vel.append(vv)
        upd.append((vv[:-1], vv[-1]))
    new_params = [(w + dw, b + db) for (w, b), (dw, db) in zip(params, upd, strict=True)]
    return new_params, (new_A, new_G, Ainv, Ginv, new_vel), loss


def main() -> dict:
    jax.config.update("jax_enable_compilation_cache", False)
    sizes = [784, 1000, 500, 250, 30, 250, 500, 1000, 784]
    batch = jnp.asarray(v._images())
    keys = jax.random.split(jax.random.key(0), 8)
    params = [
        (jax.random.normal(k, (a, b)) / jnp.sqrt(a), jnp.zeros(b))
        for k, a, b in zip(keys, sizes[:-1], sizes[1:], strict=True)
    ]
    A = [jnp.eye(a + 1) for a in sizes[:-1]]
    G = [jnp.eye(b) for b in sizes[1:]]
    vel = [jnp.zeros((a + 1, b)) for a, b in zip(sizes[:-1], sizes[1:], strict=True)]
    state = (A, G, A, G, vel)
    r = K.measure(step, (params, state, jax.random.key(1), batch))
    loss_fn = v._make_loss(kfacx.register_sigmoid_cross_entropy_loss)
    hp = v.NET.init(jax.random.key(42), batch[:1])
    tx, adam_step = K._adam(loss_fn, False)
    a = K.measure(adam_step, (hp, tx.init(hp), batch))
    ctor, fixed = v._options("standard")
    opt = kfacx.Optimizer(jax.value_and_grad(loss_fn), **ctor)
    st = opt.init(hp, jax.random.key(0), batch)
    opt.estimator.update_cache = lambda est_state, *_, **__: est_state
    k = K.measure(lambda *x: opt.unstaged_step(*x, **fixed), (hp, st, jax.random.key(0), batch))
    rows = dict(adam=a, hand_written_kfac=r, kfacx_no_refresh=k)
    print(f"{'program':<20}{'kernels':>9}{'x Adam':>8}{'first compile s':>17}{'x Adam':>8}")
    for name, m in rows.items():
        print(
            f"{name:<20}{m['kernels']:>9d}{m['kernels'] / a['kernels']:>8.2f}"
            f"{m['first_compile']:>17.2f}{m['first_compile'] / a['first_compile']:>8.2f}"
        )
    return rows


if __name__ == "__main__":
    main()
