"""K-FAC as an optax transformation on a Flax linen MLP (scikit-learn's 8x8 digits).

Two ways of running the same optimizer, preconditioning by the damped K-FAC
curvature followed by SGD with momentum:

(a) a plain chain, one update per batch::

      tx = optax.chain(kfacx.scale_by_kfac(estimator, (params, batch), damping=...),
                       optax.sgd(learning_rate, momentum=0.9))
      loss, grads, stats = estimator.value_grads_and_curvature_stats(rng, (params, batch))
      updates, state = tx.update(grads, state, params, curvature_stats=stats)

(b) micro-batch accumulation with ``optax.experimental.aggregating.process``:
    every batch is fed as ``k`` micro-batches; `kfacx.accumulate_curvature_stats`
    averages their gradients *and* curvature statistics, and the K-FAC + SGD
    chain runs once per ``k`` micro-batches (the other micro-steps return zero
    updates).

Both see the same batches. With a deterministic estimation mode (the default
here, ``ggn_exact``) one update of (b) over ``k`` micro-batches is the update of
(a) on their concatenation, up to float32 rounding; the script checks it on
the first batch before training. (With a sampling mode such as kfacx's default
``fisher_gradients`` the two differ by the sampling noise of the statistics.)

The clock of the loss-vs-seconds plot starts when each run's first update has
finished (compilation is left out); the summary gives the total wall time.

Run:  python examples/optax_pipeline.py [--steps 300] [--microbatches 4]
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time
from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from optax.experimental import aggregating

import kfacx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import common  # noqa: E402
import datasets  # noqa: E402


class MLP(nn.Module):
    features: Sequence[int] = (64, 64, 10)

    @nn.compact
    def __call__(self, x):
        for i, width in enumerate(self.features[:-1]):
            x = nn.tanh(nn.Dense(width, name=f"hidden{i}")(x))
        return nn.Dense(self.features[-1], name="head")(x)


model = MLP()


def loss_fn(params, batch):
    """``params`` is Flax's ``{"params": ...}`` dict; ``batch`` is ``(images, labels)``."""
    x, labels = batch
    logits = kfacx.register_softmax_cross_entropy_loss(model.apply(params, x), labels)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))


@jax.jit
def evaluate(params, x, labels):
    """Mean loss and accuracy on a whole split."""
    return common.classification_metrics(model.apply(params, x), labels)


def split(batch, k: int) -> list:
    """``k`` equal micro-batches of a batch (leading axis)."""
    return [tuple(np.split(a, k)[j] for a in batch) for j in range(k)]


def max_abs(tree) -> float:
    return max(float(jnp.max(jnp.abs(leaf))) for leaf in jax.tree_util.tree_leaves(tree))


def kfac_sgd(estimator, example_args, args):
    """``scale_by_kfac`` then SGD with momentum; sets ``estimator`` up from ``example_args``."""
    return optax.chain(
        kfacx.scale_by_kfac(
            estimator,
            example_args,
            damping=args.damping,
            curvature_ema=args.curvature_ema,
            inverse_update_period=args.inverse_update_period,
        ),
        optax.sgd(args.learning_rate, momentum=args.momentum),
    )


def make_chain(params, batch, args):
    """(a): one ``tx.update`` per batch. Returns ``(init, step)``, both jitted."""
    estimator = kfacx.BlockDiagonalCurvature(loss_fn, default_estimation_mode=args.estimation_mode)
    tx = kfac_sgd(estimator, (params, batch), args)

    @jax.jit
    def step(params, opt_state, rng, batch):
        loss, grads, stats = estimator.value_grads_and_curvature_stats(rng, (params, batch))
        updates, opt_state = tx.update(grads, opt_state, params, curvature_stats=stats)
        return optax.apply_updates(params, updates), opt_state, loss, updates

    return jax.jit(tx.init), step, estimator


def make_pipeline(params, micro_batch, args):
    """(b): ``process(identity, accumulate_curvature_stats, K-FAC + SGD)``, one call per
    micro-batch. Returns ``(init, micro_step)``, both jitted."""
    estimator = kfacx.BlockDiagonalCurvature(loss_fn, default_estimation_mode=args.estimation_mode)
    # The postprocessor first: scale_by_kfac sets the estimator up, and the aggregator
    # needs the statistics' shapes.
    post = kfac_sgd(estimator, (params, micro_batch), args)
    tx = aggregating.process(
        optax.with_extra_args_support(optax.identity()),
        kfacx.accumulate_curvature_stats(estimator, args.microbatches),
        post,
        aggregator_has_aux=True,
    )

    @jax.jit
    def micro_step(params, opt_state, rng, micro_batch):
        loss, grads, stats = estimator.value_grads_and_curvature_stats(rng, (params, micro_batch))
        updates, opt_state = tx.update(grads, opt_state, params, curvature_stats=stats)
        return optax.apply_updates(params, updates), opt_state, loss, updates

    return jax.jit(tx.init), micro_step


def check_equivalence(params, batch, chain, pipeline, k: int) -> float:
    """One (b) update over ``k`` micro-batches against one (a) update on the whole batch,
    from the same parameters and fresh optimizer states. Returns the relative difference."""
    (init_a, step_a), (init_b, micro_step_b) = chain, pipeline
    key = jax.random.key(0)
    _, _, _, updates_a = step_a(params, init_a(params), key, batch)
    state_b, p = init_b(params), params
    for j, micro in enumerate(split(batch, k)):
        p, state_b, _, updates_b = micro_step_b(p, state_b, key, micro)
        if j < k - 1:
            assert max_abs(updates_b) == 0.0, f"micro-step {j} moved the parameters"
            assert not bool(state_b[1].ready)
    assert bool(state_b[1].ready)
    diff = max_abs(jax.tree_util.tree_map(jnp.subtract, updates_a, updates_b))
    scale = max_abs(updates_a)
    print(
        f"check: one (b) update over {k} micro-batches of {len(batch[0]) // k} vs one (a) "
        f"update on their concatenation ({len(batch[0])} examples):\n"
        f"  max |update (a) - update (b)| = {diff:.3g}  (max |update (a)| = {scale:.3g}, "
        f"relative {diff / scale:.3g}); the first {k - 1} micro-steps returned zero updates"
    )
    assert diff <= 1e-4 * scale, (diff, scale)
    return diff / scale


def train(name, params, init, step, batches, args, micro: int | None = None):
    """Runs (a) (``micro=None``) or (b) (``micro=k``) over ``batches``."""
    key = jax.random.key(args.seed)
    state, curve = init(params), common.Curve(name)
    start = time.perf_counter()
    bar = common.progress(range(len(batches)), name, enabled=args.progress)
    for t in bar:
        rng = jax.random.fold_in(key, t)
        if micro is None:
            params, state, loss, _ = step(params, state, rng, batches[t])
            loss = float(loss)
        else:
            losses = []
            for j, chunk in enumerate(split(batches[t], micro)):
                params, state, chunk_loss, _ = step(
                    params, state, jax.random.fold_in(rng, j), chunk
                )
                losses.append(chunk_loss)
            loss = float(np.mean(losses))  # equal micro-batches: the batch's loss
        curve.add(t, loss)
        bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
    return params, curve, time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=300, help="updates (default 300)")
    parser.add_argument(
        "--batch-size", type=int, default=128, help="examples per update (default 128)"
    )
    parser.add_argument(
        "--microbatches", type=int, default=4, help="k, micro-batches per update in (b)"
    )
    parser.add_argument("--learning-rate", type=float, default=0.03, help="SGD learning rate")
    parser.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    parser.add_argument("--damping", type=float, default=1e-2, help="K-FAC damping")
    parser.add_argument("--curvature-ema", type=float, default=0.95)
    parser.add_argument("--inverse-update-period", type=int, default=5)
    parser.add_argument(
        "--estimation-mode",
        default="ggn_exact",
        choices=kfacx.ESTIMATION_MODES,
        help="curvature estimation mode (default ggn_exact, deterministic)",
    )
    parser.add_argument("--seed", type=int, default=0, help="initialisation and data order seed")
    parser.add_argument(
        "--plot",
        default="optax_pipeline.png",
        help="PNG of the training curves (default optax_pipeline.png)",
    )
    parser.add_argument(
        "--no-progress", dest="progress", action="store_false", help="no progress bars"
    )
    args = parser.parse_args(argv)
    if args.steps < 1 or args.batch_size < 1 or args.microbatches < 1:
        parser.error("--steps, --batch-size and --microbatches must be positive")
    if args.batch_size % args.microbatches:
        parser.error("--batch-size must be a multiple of --microbatches")
    k = args.microbatches

    train_data, test_data = datasets.digits()
    x, y = train_data
    batches = [
        (x[i], y[i]) for i in common.batch_order(len(x), args.batch_size, args.steps, args.seed)
    ]
    params = model.init(jax.random.key(args.seed), x[:1])
    n_params = sum(p.size for p in jax.tree_util.tree_leaves(params))
    print(
        f"digits: {len(x)} train / {len(test_data[0])} test images; Flax MLP with "
        f"{n_params} parameters; {args.steps} updates of {args.batch_size} examples "
        f"((b): {k} micro-batches of {args.batch_size // k}); K-FAC ({args.estimation_mode}, "
        f"damping {args.damping:g}) + SGD (lr {args.learning_rate:g}, momentum "
        f"{args.momentum:g})\n"
    )

    *chain, estimator = make_chain(params, batches[0], args)
    pipeline = make_pipeline(params, split(batches[0], k)[0], args)
    print(estimator.report, end="\n\n")
    if estimator.report.unmatched:
        raise SystemExit(f"unmatched parameters: {estimator.report.unmatched}")
    relative = check_equivalence(params, batches[0], chain, pipeline, k)
    print()

    params_a, curve_a, seconds_a = train("(a) chain", params, *chain, batches, args)
    params_b, curve_b, seconds_b = train(
        f"(b) process, k={k}", params, *pipeline, batches, args, micro=k
    )
    common.plot_curves(
        [curve_a, curve_b], args.plot, "digits, Flax MLP: K-FAC + SGD as optax transformations"
    )

    results = {}
    for name, p, seconds in (("(a)", params_a, seconds_a), ("(b)", params_b, seconds_b)):
        train_loss, train_acc = map(float, evaluate(p, *train_data))
        test_loss, test_acc = map(float, evaluate(p, *test_data))
        results[name] = train_loss
        print_line = (
            f"  {name} final train loss {train_loss:.4f}  train accuracy {train_acc:.3f}  "
            f"test loss {test_loss:.4f}  test accuracy {test_acc:.3f}  time {seconds:.1f} s"
        )
        if name == "(a)":
            print(f"summary ({args.steps} updates of {args.batch_size} examples, k={k}):")
        print(print_line)
    gap = np.abs(np.asarray(curve_a.losses) - np.asarray(curve_b.losses))
    final_gap = abs(results["(a)"] - results["(b)"]) / max(results["(a)"], 1e-12)
    print(
        f"  (a) and (b) final train losses differ by {100 * final_gap:.2g}% "
        f"(batch losses by at most {gap.max():.2g}); "
        f"first-update check: relative difference {relative:.2g}"
    )
    print(f"  plot: {args.plot}")


if __name__ == "__main__":
    main()
