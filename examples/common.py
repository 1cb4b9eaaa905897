"""Shared pieces of the examples: a training-curve record, progress bars and plots."""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Iterable

import numpy as np


@dataclasses.dataclass
class Curve:
    """Training loss of one optimizer, against steps and wall-clock seconds."""

    name: str
    steps: list[int] = dataclasses.field(default_factory=list)
    seconds: list[float] = dataclasses.field(default_factory=list)
    losses: list[float] = dataclasses.field(default_factory=list)
    _start: float | None = None

    def start(self) -> None:
        """Starts (or restarts) the clock."""
        self._start = time.perf_counter()

    def add(self, step: int, loss: float) -> None:
        """Records the loss after ``step`` (call after the step's result is ready)."""
        if self._start is None:
            self.start()
        self.steps.append(step)
        self.seconds.append(time.perf_counter() - self._start)
        self.losses.append(float(loss))

    def steps_to(self, target: float) -> int | None:
        """The first recorded step whose loss is at most ``target`` (None if never)."""
        hits = np.flatnonzero(np.asarray(self.losses) <= target)
        return int(self.steps[hits[0]]) if hits.size else None

    def seconds_to(self, target: float) -> float | None:
        """Seconds until the loss first reached ``target`` (None if never)."""
        hits = np.flatnonzero(np.asarray(self.losses) <= target)
        return float(self.seconds[hits[0]]) if hits.size else None


def batch_order(n: int, batch_size: int, steps: int, seed: int) -> list[np.ndarray]:
    """Indices of every step's batch: epochs of a seeded permutation (remainder dropped).

    Every optimizer of an example gets the same batches in the same order.
    """
    if batch_size > n:
        raise ValueError(f"--batch-size {batch_size} exceeds the {n} training examples.")
    rng = np.random.default_rng(seed)
    per_epoch = n // batch_size
    out: list[np.ndarray] = []
    while len(out) < steps:
        perm = rng.permutation(n)
        out.extend(perm[i * batch_size : (i + 1) * batch_size] for i in range(per_epoch))
    return out[:steps]


def classification_metrics(logits, labels):
    """Mean softmax cross-entropy and accuracy of ``logits`` for integer ``labels``."""
    import jax.numpy as jnp
    import optax

    loss = jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))
    return loss, jnp.mean(jnp.argmax(logits, -1) == labels)


def progress(iterable: Iterable, description: str, enabled: bool = True):
    """A tqdm progress bar (``bar.set_postfix(loss=...)`` shows the live loss)."""
    from tqdm.auto import tqdm

    return tqdm(iterable, desc=description, disable=not enabled, dynamic_ncols=True)


def plot_curves(curves: list[Curve], path: str, title: str, log_scale: bool = True) -> None:
    """Writes a PNG with the training loss against steps and against seconds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4), constrained_layout=True)
    for curve in curves:
        by_step.plot(curve.steps, curve.losses, label=curve.name)
        by_time.plot(curve.seconds, curve.losses, label=curve.name)
    by_step.set_xlabel("step")
    by_time.set_xlabel("seconds")
    for ax in (by_step, by_time):
        ax.set_ylabel("training loss")
        if log_scale:
            ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# First-order methods the examples and benchmarks compare K-FAC with: name ->
# (label, ``learning_rate -> optax.GradientTransformation``).
FIRST_ORDER_NAMES = ("adam", "sgd", "muon", "sfadamw", "sophia")


def first_order(name: str, learning_rate: float):
    """The label and the optax transformation of a first-order method at a learning rate.

    ``adam``, ``sgd`` (Nesterov momentum 0.9), ``muon`` (``optax.contrib.muon``:
    orthogonalised momentum for matrices, Adam for the rest), ``sfadamw``
    (``optax.contrib.schedule_free_adamw``; evaluate at `eval_params`) and
    ``sophia`` (``optax.contrib.sophia``, which needs ``obj_fn``: see `optax_step`).
    """
    import optax

    makers = {
        "adam": ("Adam", optax.adam),
        "sgd": ("SGD-Nesterov", lambda lr: optax.sgd(lr, momentum=0.9, nesterov=True)),
        "muon": ("Muon", optax.contrib.muon),
        "sfadamw": ("schedule-free AdamW", optax.contrib.schedule_free_adamw),
        "sophia": ("Sophia", optax.contrib.sophia),
    }
    if name not in makers:
        raise ValueError(f"unknown first-order method {name!r}; choose from {FIRST_ORDER_NAMES}")
    label, make = makers[name]
    return label, make(learning_rate)


def optax_step(name: str, learning_rate: float, loss_fn, l2_reg: float = 0.0):
    """``(step, tx)``: a jitted ``step(params, state, batch) -> (params, state, loss)`` of
    ``first_order(name, learning_rate)`` on ``loss_fn(params, batch)``, with ``l2_reg`` as
    decayed weights (the gradient of ``l2_reg / 2 * |params|^2``), and its transformation."""
    import jax
    import optax

    _, tx = first_order(name, learning_rate)
    if l2_reg:
        tx = optax.chain(optax.add_decayed_weights(l2_reg), tx)

    @jax.jit
    def step(params, state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        extra = {}
        if name == "sophia":  # its Hutchinson estimate of the Hessian diagonal needs the loss
            extra["obj_fn"] = lambda p: loss_fn(p, batch)
        updates, state = tx.update(grads, state, params, **extra)
        return optax.apply_updates(params, updates), state, loss

    return step, tx


def eval_params(name: str, state, params):
    """The parameters to evaluate: schedule-free AdamW's averaged point, else ``params``."""
    if name != "sfadamw":
        return params
    import optax

    if not isinstance(state, optax.contrib.ScheduleFreeState):  # chained after the L2 term
        state = state[-1]
    return optax.contrib.schedule_free_eval_params(state, params)


def add_compilation_cache_flag(parser: argparse.ArgumentParser) -> None:
    """``--no-compilation-cache``: by default the example turns on JAX's persistent
    compilation cache (`kfacx.enable_compilation_cache`), so a second run loads its
    compiled steps from disk."""
    parser.add_argument(
        "--no-compilation-cache",
        action="store_true",
        help="compile every program afresh (default: JAX's persistent compilation cache "
        "in $KFACX_COMPILATION_CACHE_DIR or ~/.cache/kfacx/jax, via "
        "kfacx.enable_compilation_cache())",
    )


def use_compilation_cache(args: argparse.Namespace) -> None:
    if not args.no_compilation_cache:
        import kfacx

        kfacx.enable_compilation_cache()
