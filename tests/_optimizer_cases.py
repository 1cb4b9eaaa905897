"""Helpers of the `kfacx.Optimizer` tests (tests/optimizer/, and the other files that
train its MLP): a registered tanh MLP, its parameters and batches, a
run of several steps, option sets.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import kfacx

# ----------------------------------------------------------------------------- fixtures


def mlp_loss(params, batch):
    x, y = batch
    h = jnp.tanh(x @ params["w1"] + params["b1"][None, :])
    logits = h @ params["w2"] + params["b2"][None, :]
    kfacx.register_softmax_cross_entropy_loss(logits, y)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y))


def masked_mlp_loss(params, batch):
    x, y, mask = batch
    h = jnp.tanh(x @ params["w1"] + params["b1"][None, :])
    logits = h @ params["w2"] + params["b2"][None, :]
    kfacx.register_softmax_cross_entropy_loss(logits, y, mask=mask)
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, y)
    return jnp.sum(mask * nll) / jnp.sum(mask)


def make_params(seed=0, din=5, dh=8, dout=3):
    k = jax.random.split(jax.random.key(seed), 2)
    return dict(
        w1=jax.random.normal(k[0], (din, dh)) * 0.5,
        b1=jnp.zeros(dh),
        w2=jax.random.normal(k[1], (dh, dout)) * 0.5,
        b2=jnp.zeros(dout),
    )


def make_batch(n=32, din=5, seed=1):
    x = jax.random.normal(jax.random.key(seed), (n, din))
    y = (x[:, 0] > 0).astype(jnp.int32) + (x[:, 1] > 0).astype(jnp.int32)
    return x, y


def run(opt, params, batch, steps, func_state=None, **step_kwargs):
    state = opt.init(params, jax.random.key(7), batch, func_state)
    history = []
    for i in range(steps):
        out = opt.step(params, state, jax.random.key(100 + i), batch, func_state, **step_kwargs)
        if func_state is not None:
            params, state, func_state, stats = out
        else:
            params, state, stats = out
        history.append(stats)
    return params, state, history


def assert_trees_close(a, b, rtol=1e-5, atol=1e-6):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=rtol, atol=atol), a, b)


DETERMINISTIC = dict(estimation_mode="fisher_empirical", num_burnin_steps=0)


ADAPTIVE = dict(
    use_adaptive_learning_rate=True,
    use_adaptive_momentum=True,
    use_adaptive_damping=True,
    initial_damping=1.0,
    damping_adaptation_interval=2,
)
