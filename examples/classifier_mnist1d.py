"""A 1-D CNN on MNIST-1D: kfacx.Optimizer against first-order methods (best rate of a grid each).

The model is three Haiku `hk.Conv1D` layers with ReLU and a dense head on the
40-sample MNIST-1D sequences (generated offline: 4,000 training and 1,000 test
examples). kfacx finds the convolutions and the dense layer itself; the
registration report is printed and checked (every parameter must be matched to
a conv or dense layer tag). `kfacx.Optimizer` chooses its learning rate,
momentum and damping each step; Adam, SGD-Nesterov, Muon, schedule-free AdamW
and Sophia (``--first-order``) are each run once per learning rate of their grid
(``--adam-lrs``, ``--muon-lrs``, ...) and the one with the lowest final training
loss (on the whole training set) is reported. All runs see the same batches in the same order
from the same initial parameters.

The clock of the loss-vs-seconds plot starts when each optimizer's first step
has finished, so compilation (and kfacx's curvature burn-in) is left out of the
curves; the summary gives the total wall time including it.

Run:  python examples/classifier_mnist1d.py [--steps 1000] [--plot mnist1d.png]
"""

from __future__ import annotations

import argparse
import math
import pathlib
import sys
import time

import haiku as hk
import jax
import jax.numpy as jnp
import optax

import kfacx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import common  # noqa: E402
import datasets  # noqa: E402


def cnn(x):
    """``x: [n, 40]`` -> logits ``[n, 10]``; the sequence is one input channel."""
    h = x[..., None]
    h = jax.nn.relu(hk.Conv1D(32, kernel_shape=5, name="conv1")(h))
    h = jax.nn.relu(hk.Conv1D(32, kernel_shape=5, stride=2, name="conv2")(h))
    h = jax.nn.relu(hk.Conv1D(32, kernel_shape=5, stride=2, name="conv3")(h))
    return hk.Linear(10, name="head")(h.reshape(h.shape[0], -1))


net = hk.without_apply_rng(hk.transform(cnn))


def loss_fn(params, batch):
    x, labels = batch
    logits = kfacx.register_softmax_cross_entropy_loss(net.apply(params, x), labels)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))


@jax.jit
def evaluate(params, x, labels):
    """Mean loss and accuracy on a whole split."""
    return common.classification_metrics(net.apply(params, x), labels)


GRIDS = {  # learning rates tried per first-order method; the best final training loss counts
    "adam": [1e-3, 3e-3, 1e-2],
    "sgd": [1e-2, 3e-2, 1e-1],
    "muon": [3e-3, 1e-2, 3e-2],
    "sfadamw": [1e-3, 3e-3, 1e-2],
    "sophia": [3e-4, 1e-3, 3e-3],
}


def check_report(report) -> str:
    """Every parameter is matched to a conv or dense tag; returns a one-line account."""
    tags = {e.path: e.tag for e in report.entries}
    problems = []
    if report.unmatched:
        problems.append(f"unmatched parameters: {', '.join(report.unmatched)}")
    for path, tag in tags.items():
        want = "dense_tag" if path.startswith("head/") else "conv_tag"
        if tag != want:
            problems.append(f"{path} got {tag}, expected {want}")
    if problems:
        raise SystemExit("registration check failed: " + "; ".join(problems))
    layers = {e.layer: e.tag for e in report.entries}
    n_conv = sum(t == "conv_tag" for t in layers.values())
    n_dense = sum(t == "dense_tag" for t in layers.values())
    return (
        f"registration check: all {len(tags)} parameters matched "
        f"({n_conv} conv layers, {n_dense} dense layer)"
    )


def run_kfac(params, train, order, args):
    optimizer = kfacx.Optimizer(
        jax.value_and_grad(loss_fn),
        l2_reg=args.l2_reg,
        add_l2_reg=True,
        use_adaptive_learning_rate=True,
        use_adaptive_momentum=True,
        use_adaptive_damping=True,
        initial_damping=1.0,
    )
    rng = jax.random.key(args.seed)
    x, y = train
    state = optimizer.init(params, rng, (x[order[0]], y[order[0]]))
    print(optimizer.estimator.report)
    print(check_report(optimizer.estimator.report), end="\n\n")

    curve, skipped = common.Curve("kfacx (adaptive)"), 0
    start = time.perf_counter()
    bar = common.progress(range(args.steps), "kfacx", enabled=args.progress)
    for step in bar:
        idx = order[step]
        params, state, stats = optimizer.step(
            params, state, jax.random.fold_in(rng, step), (x[idx], y[idx])
        )
        loss = float(stats["loss"])
        curve.add(step, loss)
        skipped += int(stats["skipped"])
        bar.set_postfix(
            loss=f"{loss:.4f}", lr=f"{float(stats['learning_rate']):.2g}", refresh=False
        )
    seconds = time.perf_counter() - start
    extra = (
        f"last lr {float(stats['learning_rate']):.3g}, momentum {float(stats['momentum']):.3g}, "
        f"damping {float(stats['damping']):.3g}, {skipped} skipped steps"
    )
    return params, curve, seconds, extra


def run_first_order(name, params, train, order, learning_rate, args):
    """A first-order method (`common.first_order`) at one learning rate."""
    step_fn, tx = common.optax_step(name, learning_rate, loss_fn)
    label = f"{name} lr={learning_rate:g}"
    x, y = train
    state = tx.init(params)
    curve = common.Curve(label)
    start = time.perf_counter()
    bar = common.progress(range(args.steps), label, enabled=args.progress)
    for step in bar:
        idx = order[step]
        params, state, loss = step_fn(params, state, (x[idx], y[idx]))
        loss = float(loss)
        curve.add(step, loss)
        bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
    return common.eval_params(name, state, params), curve, time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=1000, help="training steps (default 1000)")
    parser.add_argument("--batch-size", type=int, default=128, help="batch size (default 128)")
    rates = lambda s: [float(v) for v in s.split(",")]  # noqa: E731
    for name, default in GRIDS.items():
        parser.add_argument(
            f"--{name}-lrs",
            type=rates,
            default=default,
            help=f"comma-separated {name} learning rates to try (default "
            f"{','.join(f'{v:g}' for v in default)})",
        )
    parser.add_argument(
        "--first-order",
        type=lambda s: s.split(","),
        default=list(common.FIRST_ORDER_NAMES),
        help="comma-separated first-order methods next to adam (default: all of "
        f"{','.join(common.FIRST_ORDER_NAMES)})",
    )
    parser.add_argument("--l2-reg", type=float, default=1e-5, help="kfacx l2_reg (default 1e-5)")
    parser.add_argument("--seed", type=int, default=0, help="initialisation and data order seed")
    parser.add_argument(
        "--plot", default="mnist1d.png", help="PNG of the training curves (default mnist1d.png)"
    )
    parser.add_argument(
        "--no-progress", dest="progress", action="store_false", help="no progress bars"
    )
    common.add_compilation_cache_flag(parser)
    args = parser.parse_args(argv)
    common.use_compilation_cache(args)
    if args.steps < 1 or args.batch_size < 1:
        parser.error("--steps and --batch-size must be positive")

    train, test = datasets.mnist1d()
    order = common.batch_order(len(train[0]), args.batch_size, args.steps, args.seed)
    params = net.init(jax.random.key(args.seed), train[0][:1])
    n_params = sum(p.size for p in jax.tree_util.tree_leaves(params))
    print(
        f"MNIST-1D: {len(train[0])} train / {len(test[0])} test sequences of length "
        f"{train[0].shape[1]}; 1-D CNN with {n_params} parameters; {args.steps} steps of "
        f"batch {args.batch_size}\n"
    )

    kfac_params, kfac_curve, kfac_seconds, kfac_extra = run_kfac(params, train, order, args)
    kfac_train_loss, kfac_train_acc = map(float, evaluate(kfac_params, *train))
    kfac_test_loss, kfac_test_acc = map(float, evaluate(kfac_params, *test))
    print(f"\nsummary ({args.steps} steps, batch {args.batch_size}):")
    width = 22
    print(
        f"  {'kfacx':<{width}}  final train loss {kfac_train_loss:.4f}  "
        f"train accuracy {kfac_train_acc:.3f}  test loss {kfac_test_loss:.4f}  "
        f"test accuracy {kfac_test_acc:.3f}  time {kfac_seconds:.1f} s"
    )
    curves, grids = [kfac_curve], []
    for name in dict.fromkeys(["adam", *args.first_order]):
        if name not in common.FIRST_ORDER_NAMES:
            parser.error(f"--first-order: unknown method {name!r}")
        runs = {}
        for lr in getattr(args, f"{name}_lrs"):
            run_params, curve, seconds = run_first_order(name, params, train, order, lr, args)
            runs[lr] = (float(evaluate(run_params, *train)[0]), run_params, curve, seconds)
            curves.append(curve)
        # The best learning rate by final training loss (a NaN loss never wins).
        best = min(runs, key=lambda lr: (not math.isfinite(runs[lr][0]), runs[lr][0]))
        _, best_params, _, seconds = runs[best]
        train_loss, train_acc = map(float, evaluate(best_params, *train))
        test_loss, test_acc = map(float, evaluate(best_params, *test))
        print(
            f"  {f'{name} lr={best:g}':<{width}}  final train loss {train_loss:.4f}  "
            f"train accuracy {train_acc:.3f}  test loss {test_loss:.4f}  "
            f"test accuracy {test_acc:.3f}  time {seconds:.1f} s"
        )
        grid = ", ".join(f"{lr:g}: {runs[lr][0]:.4g}" for lr in runs)
        grids.append(f"  {name} learning rate chosen: {best:g} (final train loss by lr: {grid})")
    print(f"  kfacx: {kfac_extra}")
    print("\n".join(grids))
    common.plot_curves(curves, args.plot, "MNIST-1D, 1-D CNN: training loss (per batch)")
    print(f"  plot: {args.plot}")


if __name__ == "__main__":
    main()
