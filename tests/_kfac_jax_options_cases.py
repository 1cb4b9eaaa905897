"""Problems and helpers of the kfac-jax option tests (tests/test_kfac_jax_*.py): a
registered tanh MLP, a float64 linear least-squares problem, one optimizer step, dense
matrix powers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.flatten_util import ravel_pytree

import kfacx

DETERMINISTIC = dict(estimation_mode="fisher_empirical", num_burnin_steps=0)
PLAIN = (((1,), (0,)), ((), ()))
TRANSPOSED = (((1,), (1,)), ((), ()))


# ----------------------------------------------------------------------------- problems


def mlp_loss(params, batch):
    x, y = batch
    h = jnp.tanh(x @ params["w1"] + params["b1"][None, :])
    logits = h @ params["w2"] + params["b2"][None, :]
    kfacx.register_softmax_cross_entropy_loss(logits, y)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y))


def mlp_params(dtype=jnp.float32):
    k1, k2 = jax.random.split(jax.random.key(0))
    return dict(
        w1=(jax.random.normal(k1, (4, 5)) * 0.5).astype(dtype),
        b1=jnp.zeros(5, dtype),
        w2=(jax.random.normal(k2, (5, 3)) * 0.5).astype(dtype),
        b2=jnp.zeros(3, dtype),
    )


def mlp_batch(n=16, dtype=jnp.float32):
    x = jax.random.normal(jax.random.key(1), (n, 4)).astype(dtype)
    y = (x[:, 0] > 0).astype(jnp.int32) + (x[:, 1] > 0).astype(jnp.int32)
    return x, y


def linear_loss(params, batch):
    x, t = batch
    pred = x @ params["w"] + params["b"][None, :]
    kfacx.register_squared_error_loss(pred, t)
    return jnp.mean(jnp.sum(jnp.square(pred - t), axis=-1))


def linear_problem():
    """Linear least squares in float64 (call inside ``jax.enable_x64``): its
    Gauss-Newton model is the loss itself."""
    kx, kt, kw = jax.random.split(jax.random.key(3), 3)
    x = jax.random.normal(kx, (24, 3), jnp.float64)
    t = x @ jax.random.normal(kw, (3, 2), jnp.float64) + 0.1 * jax.random.normal(kt, (24, 2))
    params = dict(w=jnp.full((3, 2), 0.1, jnp.float64), b=jnp.full((2,), 0.2, jnp.float64))
    return params, (x, t)


def one_step(opt, params, batch, **step_kwargs):
    state = opt.init(params, jax.random.key(7), batch)
    new_params, new_state, stats = opt.step(params, state, jax.random.key(8), batch, **step_kwargs)
    return state, new_params, new_state, stats


def flat(tree):
    return np.asarray(ravel_pytree(tree)[0], np.float64)


def dense_power(matrix, weight, power):
    vals, vecs = np.linalg.eigh(np.asarray(matrix, np.float64))
    return vecs @ np.diag(np.power(np.maximum(vals, 0) + weight, power)) @ vecs.T
