"""Log every step's stats of kfacx.Optimizer to a CSV file and plot them.

A Haiku MLP on MNIST-1D (or scikit-learn's 8x8 digits: ``--dataset digits``),
trained with the adaptive learning rate, momentum and damping. Each step's
``stats`` dict (docs/logging.md describes every field) becomes one row of a CSV
file written with Python's `csv` module; the loss function's aux output (here
the batch accuracy) becomes ``aux/<name>`` columns. Every ``--print-every``
steps one line is printed.

The stats stay on the device in between: they are fetched ``--print-every``
steps at a time with one `jax.device_get`, so logging does not make the host
wait for every step. At the end the CSV file is read back and damping, learning
rate, momentum and the reduction ratio rho (with the Levenberg-Marquardt
thresholds) are plotted against steps, next to the loss and the norms.

Run:  python examples/log_stats.py [--steps 500] [--csv log_stats.csv] [--plot log_stats.png]
"""

from __future__ import annotations

import argparse
import csv
import pathlib
import sys

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

import kfacx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import common  # noqa: E402
import datasets  # noqa: E402

#: The Levenberg-Marquardt rule's settings (kfac-jax's defaults), shown on the rho plot.
ADAPTATION_INTERVAL, LOWER_THRESHOLD, UPPER_THRESHOLD = 5, 0.25, 0.75


#: The data sets to train on: MNIST-1D (harder; 4,000 sequences of length 40, generated
#: offline in a few seconds) and scikit-learn's 8x8 digits (easy; loads at once).
DATASETS = {"mnist1d": datasets.mnist1d, "digits": datasets.digits}


def make_loss(width: int):
    """``loss_fn(params, (x, labels)) -> (loss, {"accuracy": ...})`` of a two-hidden-layer
    tanh MLP, and its Haiku transform."""
    net = hk.without_apply_rng(
        hk.transform(lambda x: hk.nets.MLP([width, width, 10], activation=jnp.tanh)(x))
    )

    def loss_fn(params, batch):
        x, labels = batch
        logits = kfacx.register_softmax_cross_entropy_loss(net.apply(params, x), labels)
        loss, accuracy = common.classification_metrics(logits, labels)
        return loss, {"accuracy": accuracy}

    return loss_fn, net


def flatten(stats: dict) -> dict:
    """One step's fetched stats as a CSV row: Python scalars, the aux tree's (scalar)
    leaves as ``aux/<path>`` columns."""
    row = {}
    for name in sorted(stats, key=lambda n: n != "step"):  # step first, then as returned
        if name == "aux":
            for path, leaf in jax.tree_util.tree_leaves_with_path(stats[name]):
                key = jax.tree_util.keystr(path, simple=True, separator="/")
                row[f"aux/{key}"] = np.asarray(leaf).item()
        else:
            row[name] = np.asarray(stats[name]).item()
    return row


class StatsLog:
    """Buffers each step's stats (device arrays) and writes them to a CSV file in
    blocks, one `jax.device_get` per block (the columns: the first step's keys). A
    context manager: leaving it writes what is left and closes the file."""

    def __init__(self, path: str, block: int):
        self.block = block
        self.pending: list[dict] = []
        self._file = open(path, "w", newline="")  # noqa: SIM115 (closed by close())
        self._writer: csv.DictWriter | None = None

    def __enter__(self) -> StatsLog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def add(self, stats: dict) -> list[dict]:
        """Buffers ``stats``; returns the rows written (none until a block is full)."""
        self.pending.append(stats)
        return self.flush() if len(self.pending) >= self.block else []

    def flush(self) -> list[dict]:
        """Fetches and writes the buffered stats; returns their rows."""
        rows = [flatten(s) for s in jax.device_get(self.pending)]
        self.pending = []
        if rows and self._writer is None:
            self._writer = csv.DictWriter(self._file, fieldnames=list(rows[0]))
            self._writer.writeheader()
        if rows:
            self._writer.writerows(rows)
            self._file.flush()
        return rows

    def close(self) -> None:
        """Writes what is left and closes the file."""
        self.flush()
        self._file.close()


def summary(row: dict) -> str:
    """The one-line progress print of a CSV row (rho is NaN between adaptations)."""
    return (
        f"step {row['step']:4d}  loss {row['loss']:.4f}  "
        f"accuracy {row['aux/accuracy']:.3f}  learning rate {row['learning_rate']:.3g}  "
        f"momentum {row['momentum']:.3f}  damping {row['damping']:.3g}  rho {row['rho']:.3f}"
    )


def read_csv(path: str) -> dict[str, np.ndarray]:
    """The CSV file's columns as float arrays (``nan`` parses; ``skipped`` as 0/1)."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    parse = {"True": 1.0, "False": 0.0}
    return {k: np.array([float(parse.get(r[k], r[k])) for r in rows]) for k in rows[0]}


def plot_stats(csv_path: str, png_path: str, title: str) -> None:
    """Plots the CSV file's loss, damping, learning rate, momentum, rho and norms against
    steps into a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    log = read_csv(csv_path)
    steps = log["step"]
    fig, axes = plt.subplots(2, 3, figsize=(13, 6.5), constrained_layout=True, sharex=True)
    panels = [
        ("loss", ["loss"], "log"),
        ("damping", ["damping"], "log"),
        ("learning rate", ["learning_rate"], "log"),
        ("momentum", ["momentum"], "linear"),
        ("rho (adaptation steps only)", ["rho"], "linear"),
        ("norms", ["grad_norm", "precon_grad_norm", "update_norm"], "log"),
    ]
    for ax, (name_of_panel, names, scale) in zip(axes.flat, panels, strict=True):
        for name in names:
            finite = np.isfinite(log[name])
            style = "o" if name == "rho" else "-"
            ax.plot(steps[finite], log[name][finite], style, markersize=3, label=name)
        ax.set_title(name_of_panel)
        ax.set_yscale(scale)
        ax.grid(True, alpha=0.3)
    rho_ax = axes.flat[4]
    for threshold in (LOWER_THRESHOLD, UPPER_THRESHOLD):
        rho_ax.axhline(threshold, color="gray", linestyle="--", linewidth=1)
    axes.flat[5].legend()
    for ax in axes[1]:
        ax.set_xlabel("step")
    fig.suptitle(title)
    fig.savefig(png_path, dpi=110)
    plt.close(fig)


def train(args) -> None:
    """Trains with every step's stats logged to ``args.csv``; prints the test accuracy."""
    (x, y), (x_test, y_test) = DATASETS[args.dataset]()
    loss_fn, net = make_loss(args.width)
    optimizer = kfacx.Optimizer(
        jax.value_and_grad(loss_fn, has_aux=True),
        l2_reg=1e-5,
        add_l2_reg=True,
        value_func_has_aux=True,
        use_adaptive_learning_rate=True,
        use_adaptive_momentum=True,
        use_adaptive_damping=True,
        initial_damping=1.0,
        damping_adaptation_interval=ADAPTATION_INTERVAL,
        damping_lower_threshold=LOWER_THRESHOLD,
        damping_upper_threshold=UPPER_THRESHOLD,
        num_burnin_steps=args.burnin,
    )
    order = common.batch_order(len(x), args.batch_size, args.steps, args.seed)
    rng = jax.random.key(args.seed)
    params = net.init(rng, x[:1])
    state = optimizer.init(params, rng, (x[order[0]], y[order[0]]))
    with StatsLog(args.csv, args.print_every) as log:
        for step, idx in enumerate(order):
            key = jax.random.fold_in(rng, step)
            params, state, stats = optimizer.step(params, state, key, (x[idx], y[idx]))
            for row in log.add(stats)[-1:]:
                print(summary(row), flush=True)
    logits = net.apply(params, x_test)
    _, accuracy = common.classification_metrics(logits, y_test)
    print(f"test accuracy {float(accuracy):.3f}; stats of {args.steps} steps in {args.csv}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=500, help="training steps (default 500)")
    parser.add_argument("--batch-size", type=int, default=128, help="batch size (default 128)")
    parser.add_argument(
        "--dataset", choices=sorted(DATASETS), default="mnist1d", help="default: mnist1d"
    )
    parser.add_argument("--width", type=int, default=128, help="hidden width (default 128)")
    parser.add_argument(
        "--print-every", type=int, default=25, help="print (and fetch the stats) every N steps"
    )
    parser.add_argument(
        "--burnin", type=int, default=10, help="curvature burn-in steps (default 10)"
    )
    parser.add_argument("--csv", default="log_stats.csv", help="where to write the stats")
    parser.add_argument("--plot", default="log_stats.png", help="where to write the plot")
    parser.add_argument("--seed", type=int, default=0, help="initialisation and data order seed")
    args = parser.parse_args()
    if args.steps < 1 or args.print_every < 1:
        parser.error("--steps and --print-every must be at least 1")
    train(args)
    plot_stats(args.csv, args.plot, f"kfacx.Optimizer's stats per step (MLP on {args.dataset})")
    print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
