"""Benchmark: the deep autoencoder (Martens & Grosse, 2015), K-FAC vs Adam vs SGD.

Prints a table and writes JSON (``--out``) with, for each batch size:

- time per step: the median step time and the time amortised over whole
  inverse-refresh periods (``inverse_update_period`` steps, refresh included),
  for K-FAC with curvature statistics on the full batch and on 1/8 of it, Adam
  and SGD-Nesterov, all measured in this process, and the K-FAC / Adam ratios;
- the compile time of the first step and XLA's memory estimate of the
  compiled step (arguments + outputs + temporaries) and the process' peak RSS;
- with ``--train``, steps and seconds for K-FAC and SGD-Nesterov to reach
  Adam's final training loss (the autoencoder example's training).

Run:  python benchmarks/autoencoder.py [--batch-sizes 1000 4000] [--train]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import resource
import statistics
import sys
import time

import jax
import numpy as np
import optax

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import autoencoder_mnist as ae  # noqa: E402
import datasets  # noqa: E402


def _block(tree):
    jax.block_until_ready(tree)
    return tree


def _memory(compiled) -> int | None:
    """XLA's estimate of the bytes a compiled step needs (None if unavailable)."""
    try:
        m = compiled.memory_analysis()
        return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes)
    except Exception:  # noqa: BLE001 - not every backend reports it
        return None


def _time_step(step, params, state, batch, steps, warmup, with_rng: bool) -> dict:
    """Compiles ``step(params, state, [rng,] batch)`` and times ``steps`` calls after
    ``warmup`` (each step's outputs feed the next). ``amortised_s`` is the mean
    over all timed steps (a whole number of inverse-refresh periods)."""
    extra = (jax.random.key(0),) if with_rng else ()
    lowered = jax.jit(step).lower(params, state, *extra, batch)
    t0 = time.perf_counter()
    compiled = lowered.compile()
    compile_s = time.perf_counter() - t0
    times = []
    for i in range(warmup + steps):
        extra = (jax.random.key(i),) if with_rng else ()
        t0 = time.perf_counter()
        params, state, _ = _block(compiled(params, state, *extra, batch))
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return dict(
        median_s=statistics.median(times),
        amortised_s=float(np.mean(times)),
        compile_s=compile_s,
        memory_bytes=_memory(compiled),
    )


def time_kfac(params, images, batch_size, fraction, period, steps, warmup):
    """Step times of kfacx.Optimizer (adaptive lr, momentum and damping)."""
    args = argparse.Namespace(
        initial_damping=1.0,
        inverse_update_period=period,
        curvature_fraction=fraction,
        burnin=0,
    )
    opt = ae.make_kfac(args)
    batch = images[:batch_size]
    state = opt.init(params, jax.random.key(0), batch)
    return _time_step(opt.unstaged_step, params, state, batch, steps, warmup, with_rng=True)


def time_optax(tx, params, images, batch_size, steps, warmup):
    """Step times of an optax optimizer (with the same L2 regularisation)."""
    tx = optax.chain(optax.add_decayed_weights(ae.L2_REG), tx)

    def step(params, state, batch):
        loss, grads = jax.value_and_grad(ae.loss_fn)(params, batch)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    batch = images[:batch_size]
    return _time_step(step, params, tx.init(params), batch, steps, warmup, with_rng=False)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1000, 4000])
    parser.add_argument("--inverse-update-period", type=int, default=10)
    parser.add_argument("--steps", type=int, default=40, help="timed steps (x period)")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--adam-lr", type=float, default=1e-3)
    parser.add_argument("--sgd-lr", type=float, default=1e-2)
    parser.add_argument("--train", action="store_true", help="also run steps-to-target")
    parser.add_argument("--train-steps", type=int, default=300)
    parser.add_argument("--out", default="benchmarks/autoencoder.json")
    args = parser.parse_args(argv)

    (images, _), _ = datasets.mnist()
    params = ae.net.init(jax.random.key(42), images[:1])
    period = args.inverse_update_period
    steps = max(period, (args.steps // period) * period)
    warmup = max(period, (args.warmup // period) * period)
    results: dict = dict(
        machine=dict(
            platform=platform.platform(),
            devices=[str(d) for d in jax.devices()],
            jax=jax.__version__,
            cpu_count=__import__("os").cpu_count(),
        ),
        inverse_update_period=period,
        timed_steps=steps,
        step_time={},
    )
    print(f"deep autoencoder, inverse_update_period={period}, {steps} timed steps after {warmup}")
    header = f"{'batch':>6} {'optimizer':<22}{'median ms':>10}{'amortised ms':>14}"
    header += f"{'/ Adam':>8}{'compile s':>11}{'XLA MB':>8}"
    print(header)
    for batch_size in args.batch_sizes:
        row = {}
        row["Adam"] = time_optax(
            optax.adam(args.adam_lr), params, images, batch_size, steps, warmup
        )
        row["SGD-Nesterov"] = time_optax(
            optax.sgd(args.sgd_lr, momentum=0.9, nesterov=True),
            params,
            images,
            batch_size,
            steps,
            warmup,
        )
        row["K-FAC (full-batch stats)"] = time_kfac(
            params, images, batch_size, 1.0, period, steps, warmup
        )
        row["K-FAC (1/8-batch stats)"] = time_kfac(
            params, images, batch_size, 1 / 8, period, steps, warmup
        )
        adam = row["Adam"]["amortised_s"]
        for name, r in row.items():
            r["ratio_to_adam"] = r["amortised_s"] / adam
            mem = "-" if r["memory_bytes"] is None else f"{r['memory_bytes'] / 2**20:.0f}"
            print(
                f"{batch_size:>6} {name:<22}{1e3 * r['median_s']:>10.1f}"
                f"{1e3 * r['amortised_s']:>14.1f}{r['ratio_to_adam']:>8.2f}"
                f"{r['compile_s']:>11.1f}{mem:>8}"
            )
        results["step_time"][str(batch_size)] = row
    results["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak RSS {results['peak_rss_mb']:.0f} MB")

    if args.train:
        summary = ae.main(
            [
                "--steps",
                str(args.train_steps),
                "--no-progress",
                "--plot",
                "benchmarks/autoencoder.png",
                "--no-compilation-cache",  # the compile times above are cold ones
            ]
        )
        results["to_target"] = summary

    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"results written to {out}")
    return results


if __name__ == "__main__":
    main()
