"""Benchmark: does the adaptive optimizer diverge? A matrix of problems x option sets x seeds.

Each cell trains one small problem with one set of options from several seeds (the
initial parameters, the batches and the step keys), for a horizon of steps, and
evaluates the training loss on the whole training set (data term only) every twentieth
of the horizon. A run **diverges** when a loss is not finite, or when its final
whole-set loss is above 10x the lowest whole-set loss it reached. Printed per cell: the
runs that diverge, and the median and the worst final loss over the seeds; with
``--out`` every run as JSON.

Problems (`PROBLEMS`; data from scikit-learn's bundled sets, no download):

- ``quickstart``: `examples/quickstart.py`'s digits MLP (64-64-10), batches of 256 drawn
  afresh each step, softmax cross-entropy;
- ``digits-full``: the same model on the whole training set (1,437 images) every step;
- ``digits-small``: batches of 32;
- ``digits-bf16``: the parameters in bfloat16, batches of 256;
- ``digits-fallback``: the MLP's logits plus a cumulative sum of a parameter vector,
  which no layer pattern serves (a diagonal fallback block);
- ``diabetes``: a 32-32-1 tanh MLP regressing the diabetes targets (standardised), the
  whole set of 442 every step, squared error.

Option sets (`OPTIONS`): ``readme``, the README's adaptive learning rate, momentum and
damping from ``initial_damping=1.0`` (``l2_reg=1e-5`` added by the optimizer); and
``kfac-jax``, the same with the curvature on the whole batch
(``curvature_batch_fraction=1.0``), as kfac-jax estimates it.

Profiles: ``--profile quick`` (2 seeds, 150 steps; about 2 minutes on a 2-core CPU; the
test suite runs a smaller slice of it) and ``--profile long`` (4 seeds, 1,000 steps,
5x the quick start's default length; about 40 minutes).

Run:  python benchmarks/stress.py [--profile quick|long] [--problems ...] [--options ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import time
from collections.abc import Callable

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_diabetes, load_digits

import kfacx

L2_REG = 1e-5


@dataclasses.dataclass(frozen=True)
class Problem:
    """A model, its loss (registered) and its data; ``batch_size=None``: the whole set."""

    net: hk.Transformed
    loss: Callable
    data: tuple[np.ndarray, np.ndarray]
    batch_size: int | None
    dtype: jnp.dtype = jnp.float32


def _digits():
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    order = np.random.default_rng(0).permutation(len(x))
    split = int(0.8 * len(x))
    return x[order][:split], y[order][:split]


def _classifier(fallback: bool = False) -> hk.Transformed:
    def forward(x):
        logits = hk.nets.MLP([64, 64, 10])(x)
        if fallback:
            c = hk.get_parameter("offsets", [10], logits.dtype, init=jnp.zeros)
            logits = logits + jnp.cumsum(c)[None, :]
        return logits

    return hk.without_apply_rng(hk.transform(forward))


def _cross_entropy(net):
    def loss(params, batch):
        x, y = batch
        logits = kfacx.register_softmax_cross_entropy_loss(net.apply(params, x), y)
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y))

    return loss


def _regression():
    data = load_diabetes()
    x = ((data.data - data.data.mean(0)) / data.data.std(0)).astype(np.float32)
    y = ((data.target - data.target.mean()) / data.target.std()).astype(np.float32)[:, None]
    net = hk.without_apply_rng(
        hk.transform(lambda x: hk.nets.MLP([32, 32, 1], activation=jnp.tanh)(x))
    )

    def loss(params, batch):
        inputs, targets = batch
        out = net.apply(params, inputs)
        kfacx.register_squared_error_loss(out, targets)
        return 0.5 * jnp.mean(jnp.sum((out - targets) ** 2, axis=-1))

    return Problem(net, loss, (x, y), None)


def make_problem(name: str) -> Problem:
    if name == "diabetes":
        return _regression()
    net = _classifier(fallback=name == "digits-fallback")
    sizes = {"quickstart": 256, "digits-full": None, "digits-small": 32}
    dtype = jnp.bfloat16 if name == "digits-bf16" else jnp.float32
    return Problem(net, _cross_entropy(net), _digits(), sizes.get(name, 256), dtype)


PROBLEMS = (
    "quickstart",
    "digits-full",
    "digits-small",
    "digits-bf16",
    "digits-fallback",
    "diabetes",
)

OPTIONS = {
    "readme": dict(),
    "kfac-jax": dict(curvature_batch_fraction=1.0),
}

PROFILES = {"quick": dict(seeds=2, steps=150), "long": dict(seeds=4, steps=1000)}


def run(problem: Problem, options: dict, seed: int, steps: int) -> dict:
    """One training run; the whole-set losses and whether it diverged."""
    x, y = problem.data
    rng = jax.random.key(seed)
    rng, init_key = jax.random.split(rng)
    params = problem.net.init(init_key, x[:1])
    params = jax.tree.map(lambda p: p.astype(problem.dtype), params)
    sampler = np.random.default_rng(seed)

    def batch():
        if problem.batch_size is None:
            return x, y
        idx = sampler.choice(len(x), problem.batch_size, replace=False)
        return x[idx], y[idx]

    optimizer = kfacx.Optimizer(
        jax.value_and_grad(problem.loss),
        l2_reg=L2_REG,
        add_l2_reg=True,
        use_adaptive_learning_rate=True,
        use_adaptive_momentum=True,
        use_adaptive_damping=True,
        initial_damping=1.0,
        **options,
    )
    whole = jax.jit(problem.loss)
    rng, key = jax.random.split(rng)
    state = optimizer.init(params, key, batch())
    every = max(1, steps // 20)
    losses = [float(whole(params, (x, y)))]
    for step in range(steps):
        rng, key = jax.random.split(rng)
        params, state, stats = optimizer.step(params, state, key, batch())
        if not math.isfinite(float(stats["loss"])):
            losses.append(math.nan)
            break
        if (step + 1) % every == 0 or step == steps - 1:
            losses.append(float(whole(params, (x, y))))
    finite = all(math.isfinite(v) for v in losses)
    final = losses[-1]
    diverged = not finite or final > 10 * min(losses)
    return dict(seed=seed, final=final, best=min(losses), diverged=diverged)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--profile", choices=sorted(PROFILES), default="quick")
    parser.add_argument("--problems", nargs="+", choices=PROBLEMS, default=list(PROBLEMS))
    parser.add_argument("--options", nargs="+", choices=sorted(OPTIONS), default=list(OPTIONS))
    parser.add_argument("--seeds", type=int, default=None, help="default: the profile's")
    parser.add_argument("--steps", type=int, default=None, help="default: the profile's")
    parser.add_argument("--out", default=None, help="write every run as JSON here")
    args = parser.parse_args(argv)
    profile = PROFILES[args.profile]
    seeds = range(args.seeds or profile["seeds"])
    steps = args.steps or profile["steps"]
    rows, cells = [], []
    print(f"{'problem':<17}{'options':<10}{'diverged':>9}{'median final':>14}{'worst final':>13}")
    for name in args.problems:
        problem = make_problem(name)
        for option in args.options:
            start = time.perf_counter()
            runs = [run(problem, OPTIONS[option], seed, steps) for seed in seeds]
            finals = [r["final"] for r in runs]
            cell = dict(
                problem=name,
                options=option,
                steps=steps,
                diverged=sum(r["diverged"] for r in runs),
                runs=len(runs),
                median_final=statistics.median(finals),
                worst_final=max(finals, key=lambda v: math.inf if math.isnan(v) else v),
                seconds=round(time.perf_counter() - start, 1),
            )
            cells.append(cell)
            rows.extend(dict(problem=name, options=option, **r) for r in runs)
            print(
                f"{name:<17}{option:<10}{cell['diverged']:>5} of {len(runs)}"
                f"{cell['median_final']:>14.3g}{cell['worst_final']:>13.3g}",
                flush=True,
            )
    total = sum(c["diverged"] for c in cells)
    print(f"{total} of {len(rows)} runs diverged")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(jax=jax.__version__, steps=steps, cells=cells, runs=rows), f, indent=1)
    return cells


if __name__ == "__main__":
    main()
