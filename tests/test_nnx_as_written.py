"""Flax NNX as people write it: ``graphdef, params = nnx.split(model, nnx.Param)``, a loss
that calls ``nnx.merge(graphdef, p)(x)``, ``kfacx.scale_by_kfac(estimator, (params,
batch))`` and ``nnx.Optimizer(model, tx, wrt=nnx.Param)``.

The estimator is set up with ``nnx.Param``-boxed parameters, while ``nnx.Optimizer``
hands ``tx.update`` plain arrays (and ``tx.init`` boxed ones): the structures are
compared with the boxes removed and every update comes back in the caller's structure.
The steps are those of the documented `kfacx.flax.NNXLoss` path on the same model,
batch and keys.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import kfacx
import kfacx.flax

STEPS = 4
BATCH = (
    jax.random.normal(jax.random.key(1), (16, 3)),
    jax.random.normal(jax.random.key(2), (16, 2)),
)


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(3, 8, rngs=rngs)
        self.out = nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x):
        return self.out(jnp.tanh(self.hidden(x)))


def model_loss(model, batch):
    """The loss as ``nnx.value_and_grad`` takes it (a function of the model)."""
    x, y = batch
    out = model(x)
    kfacx.register_squared_error_loss(out, y)
    return 0.5 * jnp.mean(jnp.sum((out - y) ** 2, axis=-1))


def _hidden_kfac_rest_adam(params):
    return jax.tree_util.tree_map_with_path(
        lambda path, _: "kfac" if "hidden" in jax.tree_util.keystr(path) else "adam", params
    )


def make_tx(kind, estimator, func_args):
    kfac = kfacx.scale_by_kfac(estimator, func_args, damping=1e-2)
    if kind == "sgd":
        return optax.chain(kfac, optax.sgd(0.2))
    if kind == "partition":  # K-FAC on the hidden layer (masked updates), Adam on the rest
        groups = {"kfac": optax.chain(kfac, optax.sgd(0.2)), "adam": optax.adam(1e-2)}
        return optax.partition(groups, _hidden_kfac_rest_adam)
    return kfacx.kfac_soap(estimator, func_args, 1e-2)  # the eigenbasis path


def run_as_written(kind):
    """The split/merge pattern: the estimator's parameters are an `nnx.State` of
    ``nnx.Param``s; the statistics are computed on the model's current ones."""
    model = MLP(nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)

    def loss_fn(p, batch):
        x, y = batch
        out = nnx.merge(graphdef, p)(x)
        kfacx.register_squared_error_loss(out, y)
        return 0.5 * jnp.mean(jnp.sum((out - y) ** 2, axis=-1))

    estimator = kfacx.BlockDiagonalCurvature(loss_fn)
    optimizer = nnx.Optimizer(model, make_tx(kind, estimator, (params, BATCH)), wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, rng):
        p = nnx.state(model, nnx.Param)
        loss, grads, stats = estimator.value_grads_and_curvature_stats(rng, (p, BATCH))
        return loss, optimizer.update(model, grads, curvature_stats=stats)

    return [train_step(model, optimizer, jax.random.key(i)) for i in range(STEPS)]


def run_documented(kind):
    """The same training through `kfacx.flax.NNXLoss` (plain-array parameters)."""
    model = MLP(nnx.Rngs(0))
    loss = kfacx.flax.NNXLoss(model_loss, model)
    estimator = kfacx.BlockDiagonalCurvature(loss)
    tx = make_tx(kind, estimator, loss.func_args(model, BATCH))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, rng):
        value, grads, stats = kfacx.flax.nnx_value_grads_and_curvature_stats(
            estimator, rng, model, BATCH
        )
        return value, optimizer.update(model, grads, curvature_stats=stats)

    return [train_step(model, optimizer, jax.random.key(i)) for i in range(STEPS)]


@pytest.mark.parametrize("kind", ["sgd", "partition", "soap"])
def test_split_merge_pattern_trains_as_the_nnx_loss_path(kind):
    written, documented = run_as_written(kind), run_documented(kind)
    losses = [float(loss) for loss, _ in written]
    assert losses[-1] < 0.9 * losses[0], losses
    for (loss, updates), (want_loss, want_updates) in zip(written, documented, strict=True):
        np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
        assert jax.tree.structure(updates) == jax.tree.structure(want_updates)
        for got, want in zip(jax.tree.leaves(updates), jax.tree.leaves(want_updates), strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


def test_products_take_boxed_or_plain_vectors_and_keep_their_structure():
    """An estimator set up with plain arrays takes ``nnx.Param``-boxed vectors and the
    reverse; each product comes back in its vector's structure, with the same values.
    Another structure is still an error."""
    model = MLP(nnx.Rngs(0))
    loss = kfacx.flax.NNXLoss(model_loss, model)
    estimator = kfacx.BlockDiagonalCurvature(loss)
    args = loss.func_args(model, BATCH)
    state = estimator.init(jax.random.key(0), args)
    boxed = nnx.state(model, nnx.Param)
    plain = args[0]

    @jax.jit
    def products(state, boxed, plain):
        stats = estimator.compute_curvature_stats(jax.random.key(1), args, has_aux=True)
        state = estimator.update_curvature_estimate_from_stats(state, stats, 0.0, 1.0)
        return estimator.multiply(state, boxed, 0.1), estimator.multiply(state, plain, 0.1)

    from_boxed, from_plain = products(state, boxed, plain)
    assert jax.tree.structure(from_boxed) == jax.tree.structure(boxed)
    assert jax.tree.structure(from_plain) == jax.tree.structure(plain)
    assert isinstance(from_boxed["out"]["kernel"], nnx.Param)
    for got, want in zip(jax.tree.leaves(from_boxed), jax.tree.leaves(from_plain), strict=True):
        np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="does not match the parameters'.*nnx.Param aside"):
        estimator.params_to_blocks({"params": plain, "extra": jnp.zeros(3)})
    with pytest.raises(ValueError, match="does not match the parameters'"):
        estimator.params_to_blocks(jax.tree.map(lambda x: (x, x), plain))
