"""Shared pieces of the examples: a training-curve record, progress bars and plots."""

from __future__ import annotations

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
