"""K-FAC in Flax linen's own training loop: a CNN with batch norm, trained with a TrainState.

The loop is Flax's usual one (a ``TrainState`` subclass with ``batch_stats``,
``apply_gradients(grads=..., batch_stats=...)``); three things change for K-FAC:

1. the loss function takes ``(params, batch_stats, batch)``, registers its loss
   on the logits, and returns ``(loss, new batch_stats)``;
2. ``tx`` is ``optax.chain(kfacx.scale_by_kfac(estimator, ...), optax.sgd(...))``;
3. the state is a `kfacx.flax.TrainState`, and the step takes the loss, the
   gradient *and* the curvature statistics from the estimator in one pass and
   hands the statistics to ``apply_gradients(..., curvature_stats=stats)``.

The same loop with Flax's own ``TrainState`` and ``optax.adam`` runs next to it
on the same batches (``--adam-learning-rate 0`` leaves it out). The test
accuracy uses the running batch statistics (``train=False``).

Run:  python examples/flax_trainstate.py [--steps 300]
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training import train_state

import kfacx
import kfacx.flax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import common  # noqa: E402
import datasets  # noqa: E402


class CNN(nn.Module):
    """Two 3x3 convolutions with batch norm, ReLU and average pooling, then a dense layer."""

    channels: int = 16

    @nn.compact
    def __call__(self, x, train: bool):
        x = x.reshape(x.shape[0], 8, 8, 1)
        for features in (self.channels, 2 * self.channels):
            x = nn.Conv(features, (3, 3), use_bias=False)(x)
            x = nn.BatchNorm(use_running_average=not train)(x)
            x = nn.avg_pool(nn.relu(x), (2, 2), strides=(2, 2))
        return nn.Dense(10)(x.reshape(x.shape[0], -1))


def make_loss(model: CNN):
    """``loss_fn(params, batch_stats, batch) -> (loss, new batch_stats)``."""

    def loss_fn(params, batch_stats, batch):
        images, labels = batch
        logits, updates = model.apply(
            {"params": params, "batch_stats": batch_stats},
            images,
            train=True,
            mutable=["batch_stats"],
        )
        logits = kfacx.register_softmax_cross_entropy_loss(logits, labels)
        loss = jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))
        return loss, updates["batch_stats"]

    return loss_fn


class KfacState(kfacx.flax.TrainState):
    batch_stats: Any


class AdamState(train_state.TrainState):
    batch_stats: Any


def kfac_run(model, variables, example_batch, args):
    """``(state, train_step)`` of the K-FAC loop (the step is jitted)."""
    loss_fn = make_loss(model)
    params, batch_stats = variables["params"], variables["batch_stats"]
    estimator = kfacx.BlockDiagonalCurvature(loss_fn)
    tx = optax.chain(
        kfacx.scale_by_kfac(
            estimator,
            (params, batch_stats, example_batch),
            damping=args.damping,
            inverse_update_period=args.inverse_update_period,
        ),
        optax.sgd(args.learning_rate, momentum=args.momentum),
    )
    print(estimator.report)
    state = KfacState.create(apply_fn=model.apply, params=params, tx=tx, batch_stats=batch_stats)

    @jax.jit
    def train_step(state, rng, batch):
        (loss, batch_stats), grads, stats = estimator.value_grads_and_curvature_stats(
            rng, (state.params, state.batch_stats, batch), has_aux=True
        )
        state = state.apply_gradients(grads=grads, curvature_stats=stats, batch_stats=batch_stats)
        return state, loss

    return state, train_step


def adam_run(model, variables, args):
    """``(state, train_step)`` of Flax's own loop with ``optax.adam``."""
    loss_fn = make_loss(model)
    state = AdamState.create(
        apply_fn=model.apply,
        params=variables["params"],
        tx=optax.adam(args.adam_learning_rate),
        batch_stats=variables["batch_stats"],
    )

    @jax.jit
    def train_step(state, rng, batch):
        del rng
        (loss, batch_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            state.params, state.batch_stats, batch
        )
        return state.apply_gradients(grads=grads, batch_stats=batch_stats), loss

    return state, train_step


@jax.jit
def _metrics(state, images, labels):
    variables = {"params": state.params, "batch_stats": state.batch_stats}
    return common.classification_metrics(state.apply_fn(variables, images, train=False), labels)


def evaluate(state, data) -> tuple[float, float]:
    """Loss and accuracy with the running batch statistics."""
    loss, accuracy = _metrics(state, *data)
    return float(loss), float(accuracy)


def train(name, state, train_step, train_data, order, args) -> tuple[Any, common.Curve]:
    """Runs ``train_step`` over the batches of ``order``; prints the loss now and then."""
    curve = common.Curve(name)
    for step, index in enumerate(order, 1):
        batch = (train_data[0][index], train_data[1][index])
        state, loss = train_step(state, jax.random.fold_in(jax.random.key(args.seed), step), batch)
        if step == 1:
            jax.block_until_ready(loss)
            curve.start()  # the clock starts after compilation
        if step % args.print_every == 0 or step == len(order):
            curve.add(step, float(loss))
            print(f"{name:5s} step {step:4d}  train loss {float(loss):.4f}")
    return state, curve


def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=300, help="updates (default 300)")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--channels", type=int, default=16, help="channels of the first conv")
    parser.add_argument("--learning-rate", type=float, default=0.1, help="K-FAC's SGD rate")
    parser.add_argument("--momentum", type=float, default=0.9, help="K-FAC's SGD momentum")
    parser.add_argument("--damping", type=float, default=0.1, help="K-FAC damping")
    parser.add_argument("--inverse-update-period", type=int, default=5)
    parser.add_argument(
        "--adam-learning-rate", type=float, default=3e-3, help="0 leaves the Adam run out"
    )
    parser.add_argument("--print-every", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0, help="initialisation and data order seed")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, tuple[float, float, common.Curve]]:
    """Trains and prints; returns ``{run: (test loss, test accuracy, training curve)}``."""
    args = parse_args(argv)
    train_data, test_data = datasets.digits(test_fraction=0.2, seed=args.seed)
    order = common.batch_order(len(train_data[0]), args.batch_size, args.steps, args.seed)
    model = CNN(args.channels)
    variables = model.init(jax.random.key(args.seed), train_data[0][:1], train=False)
    first = (train_data[0][order[0]], train_data[1][order[0]])  # shapes of every batch
    runs = {"K-FAC": kfac_run(model, variables, first, args)}
    if args.adam_learning_rate > 0:
        runs["Adam"] = adam_run(model, variables, args)
    results = {}
    start = time.perf_counter()
    for name, (state, train_step) in runs.items():
        state, curve = train(name, state, train_step, train_data, order, args)
        loss, accuracy = evaluate(state, test_data)
        results[name] = (loss, accuracy, curve)
        print(
            f"{name:5s} test loss {loss:.4f}  test accuracy {accuracy:.3f}  "
            f"({curve.seconds[-1]:.1f} s after compilation)"
        )
    print(f"total {time.perf_counter() - start:.1f} s")
    return results


if __name__ == "__main__":
    main()
