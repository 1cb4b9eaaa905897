"""Benchmark: seconds to a target loss, K-FAC against the first-order methods users pick.

The deep autoencoder of `examples/autoencoder_mnist.py` on the 5,000 MNIST images
(batch 1000). Every first-order method (Adam, SGD-Nesterov, Muon, schedule-free
AdamW, Sophia; `optax` and `optax.contrib`) runs ``--steps`` steps at each rate
of its grid; the best rate (lowest final loss) counts. K-FAC runs with

- ``readme``: the README's `kfacx.Optimizer` snippet (``l2_reg``, adaptive
  learning rate, momentum and damping, ``initial_damping=1.0``, every other
  option at its default);
- ``example``: the settings of kfac-jax's autoencoder example (adaptive
  everything, ``initial_damping=150``, ``inverse_update_period=5``).

"Loss" is the training loss on all 5,000 images (the data term, without the L2
term), evaluated after every K-FAC step and after the last step of every
first-order run; the evaluation is not timed. "Seconds" are the summed wall
time of the steps (each blocked until done). Compilation is excluded: every
optimizer is compiled on a throwaway step first and its compile time printed
next to it. K-FAC's seconds include its curvature burn-in.

For each K-FAC run it prints the seconds to reach (a) the best first-order final
loss, as a fraction of that optimizer's seconds, and (b) Adam's final loss, as a
fraction of Adam's seconds; and the robustness figures: the largest loss after
the burn-in relative to the loss at its end (spike; the burn-in does not move
the parameters, so that is the initial loss), the largest loss relative to the
best loss before it (rise), the final loss relative to the best loss of the run
(stall), and the range of the solved momentum. K-FAC runs with batches shuffled
every epoch and with a fixed cyclic order.

Run:  python benchmarks/time_to_target.py [--steps 300] [--out results.json]
      python benchmarks/time_to_target.py --methods adam kfac-readme   (a subset)
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import autoencoder_mnist as ae  # noqa: E402
import common  # noqa: E402
import datasets  # noqa: E402

import kfacx  # noqa: E402

GRIDS = {  # learning rates tried per first-order method (`common.first_order`)
    "adam": (3e-4, 1e-3, 3e-3),
    "sgd": (1e-3, 3e-3, 1e-2),
    "muon": (0.01, 0.03, 0.1),
    "sfadamw": (1e-3, 3e-3, 1e-2),
    "sophia": (1e-4, 3e-4, 1e-3),
}
KFAC = {
    "kfac-readme": dict(initial_damping=1.0),
    "kfac-example": dict(initial_damping=150.0, inverse_update_period=5),
}


def order(n: int, batch_size: int, steps: int, shuffled: bool) -> list[np.ndarray]:
    """Each step's batch indices: reshuffled every epoch, or a fixed cyclic order."""
    if shuffled:
        return common.batch_order(n, batch_size, steps, seed=0)
    per_epoch = n // batch_size
    return [
        np.arange(i % per_epoch * batch_size, (i % per_epoch + 1) * batch_size)
        for i in range(steps)
    ]


@jax.jit
def full_loss(params, images):
    """The data loss on all images (mean over images of the summed pixel cross-entropy)."""
    logits = ae.net.apply(params, images)
    return jnp.mean(jnp.sum(optax.sigmoid_binary_cross_entropy(logits, images), axis=-1))


def _timed(fn, *args):
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    return out, time.perf_counter() - t0


def adam_step_seconds(params, images, batch_size: int, steps: int = 30) -> float:
    """The median time of an Adam step here and now: the unit that makes runs of
    different processes (on a shared machine) comparable."""
    step, tx = common.optax_step("adam", 1e-3, ae.loss_fn, ae.L2_REG)
    state, batch = tx.init(params), images[:batch_size]
    times = []
    for _ in range(steps + 1):
        (params, state, _), dt = _timed(step, params, state, batch)
        times.append(dt)
    return float(np.median(times[1:]))


def run_first_order(kind, lr, params, images, batches) -> dict:
    """``len(batches)`` steps of a first-order method."""
    step, tx = common.optax_step(kind, lr, ae.loss_fn, ae.L2_REG)
    state = tx.init(params)
    _, first = _timed(step, params, state, images[batches[0]])  # compiles
    seconds = 0.0
    for index in batches:
        (params, state, _), dt = _timed(step, params, state, images[index])
        seconds += dt
    loss = float(full_loss(common.eval_params(kind, state, params), images))
    return dict(
        name=common.first_order(kind, lr)[0],
        lr=lr,
        final_loss=loss if np.isfinite(loss) else float("inf"),
        seconds=seconds,
        compile_s=first - seconds / len(batches),
    )


def run_kfac(kind, params, images, batches, donate: bool = False) -> dict:
    """K-FAC with the settings ``KFAC[kind]``; the full-data loss after every step.

    ``donate``: the step's params and state are donated (``donate_params_and_state``).
    """
    options = dict(
        donate_params_and_state=donate,
        l2_reg=ae.L2_REG,
        add_l2_reg=True,
        use_adaptive_learning_rate=True,
        use_adaptive_momentum=True,
        use_adaptive_damping=True,
        **KFAC[kind],
    )
    burnin = kfacx.Optimizer(jax.value_and_grad(ae.loss_fn), **options).curvature.num_burnin_steps
    # Burn-in is run (and timed) explicitly, so the optimizer itself runs none.
    opt = kfacx.Optimizer(jax.value_and_grad(ae.loss_fn), num_burnin_steps=0, **options)
    first = images[batches[0]]
    state = opt.init(params, jax.random.key(0), first)
    rng = jax.random.key(1)
    # Compile the burn-in and the step on throwaway calls.
    t0 = time.perf_counter()
    warm, _ = opt.burnin(1, params, state, rng, iter([first]))
    # On copies: a donating step deletes its params and state.
    jax.block_until_ready(opt.step(jax.tree.map(jnp.copy, params), warm, rng, first))
    compile_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    source = (images[batches[i % len(batches)]] for i in range(burnin))
    state, _ = opt.burnin(burnin, params, state, rng, source)
    jax.block_until_ready(state)
    seconds = [time.perf_counter() - t0]
    losses, momenta, dampings = [float(full_loss(params, images))], [], []
    for i, index in enumerate(batches):
        (params, state, stats), dt = _timed(
            opt.step, params, state, jax.random.fold_in(rng, i), images[index]
        )
        seconds.append(seconds[-1] + dt)
        losses.append(float(full_loss(params, images)))
        momenta.append(float(stats["momentum"]))
        dampings.append(float(stats["damping"]))
    losses = np.asarray(losses)
    return dict(
        name=f"K-FAC ({kind[5:]})",
        settings=KFAC[kind],
        compile_s=compile_s - (seconds[1] - seconds[0]),
        burnin_s=seconds[0],
        losses=losses.tolist(),
        seconds=seconds,
        final_loss=float(losses[-1]),
        spike=float(losses[1:].max() / losses[0]),
        rise=float((losses[1:] / np.minimum.accumulate(losses)[:-1]).max()),
        stall=float(losses[-1] / losses.min()),
        momentum_range=[min(momenta), max(momenta)],
        final_damping=dampings[-1],
    )


def seconds_to(run: dict, target: float) -> float | None:
    hits = np.flatnonzero(np.asarray(run["losses"]) <= target)
    return float(run["seconds"][hits[0]]) if hits.size else None


def _row(r: dict, note: str = "") -> str:
    return (
        f"{r['name']:<24}{r['lr']:>8g}{r['final_loss']:>12.2f}{r['seconds']:>9.1f}"
        f"{r['compile_s']:>11.1f}{note}"
    )


def first_order_results(args, params, images, unit: float) -> dict:
    """Runs the first-order methods of ``args.methods`` (their grids, or the best rates
    of ``--best-from``) and adds the others from ``--reference``."""
    batches = order(len(images), args.batch_size, args.steps, shuffled=True)
    best_rates, results = {}, {}
    if args.best_from:
        earlier = json.loads(pathlib.Path(args.best_from).read_text())["first_order"]
        best_rates = {kind: (entry["best"]["lr"],) for kind, entry in earlier.items()}
    print(
        f"{'first-order (shuffled)':<24}{'lr':>8}{'final loss':>12}{'seconds':>9}{'compile s':>11}"
    )
    for kind in (m for m in args.methods if m in GRIDS):
        runs = [
            run_first_order(kind, lr, params, images, batches)
            for lr in best_rates.get(kind, GRIDS[kind])
        ]
        print("\n".join(_row(r) for r in runs), flush=True)
        results[kind] = dict(best=min(runs, key=lambda r: r["final_loss"]), grid=runs)
    if args.reference:
        ref = json.loads(pathlib.Path(args.reference).read_text())
        scale = unit / ref["adam_step_s"]  # to this process' speed
        for kind, entry in ref["first_order"].items():
            if kind not in results:
                for r in (entry["best"], *entry["grid"]):
                    r["seconds"] *= scale
                results[kind] = entry
                print(_row(entry["best"], "  (reference)"))
    return results


def report_kfac(run: dict, targets: dict) -> str:
    """One K-FAC run's line, and its seconds to each target (added to ``run``)."""
    line = (
        f"{run['name']} {run['order']}: final {run['final_loss']:.2f}"
        f" (best {min(run['losses']):.2f}), {run['seconds'][-1]:.1f} s"
        f" + compile {run['compile_s']:.1f} s (burn-in {run['burnin_s']:.1f} s);"
        f" spike {run['spike']:.2f}, largest rise {run['rise']:.2f},"
        f" final/best {run['stall']:.3f},"
        f" momentum {run['momentum_range'][0]:.2f}..{run['momentum_range'][1]:.2f},"
        f" final damping {run['final_damping']:.2g}"
    )
    for label, ref in targets.items():
        target, secs = ref["final_loss"], ref["seconds"]
        hit = seconds_to(run, target)
        run[f"to {label}"] = dict(target=target, seconds=hit, reference_s=secs)
        line += f"\n    to {label} ({ref['name']}, {target:.2f}): "
        line += (
            "not reached" if hit is None else f"{hit:.1f} s = {hit / secs:.2f}x its {secs:.1f} s"
        )
    return line


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=1000)
    parser.add_argument("--methods", nargs="+", default=[*GRIDS, *KFAC])
    parser.add_argument("--orders", nargs="+", default=["shuffled", "fixed"])
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument(
        "--reference",
        default=None,
        help="take the first-order results not run now from this earlier --out file (their "
        "seconds rescaled by the ratio of the two processes' Adam step times)",
    )
    parser.add_argument(
        "--best-from",
        default=None,
        help="run each first-order method at its best rate in this earlier --out file only",
    )
    parser.add_argument(
        "--donate",
        action="store_true",
        help="K-FAC steps donate their params and state (donate_params_and_state=True)",
    )
    args = parser.parse_args(argv)
    unknown = set(args.methods) - set(GRIDS) - set(KFAC)
    if unknown:
        parser.error(f"unknown methods {sorted(unknown)}; choose from {[*GRIDS, *KFAC]}")

    (images, _), _ = datasets.mnist()
    params = ae.net.init(jax.random.key(42), images[:1])
    images = jnp.asarray(images)
    unit = adam_step_seconds(params, images, args.batch_size)
    print(f"Adam step here and now: {1e3 * unit:.0f} ms")
    first_order = first_order_results(args, params, images, unit)
    results: dict = dict(
        steps=args.steps, batch_size=args.batch_size, adam_step_s=unit, first_order=first_order
    )
    targets = {}
    if first_order:
        targets["best first-order"] = min(
            (e["best"] for e in first_order.values()), key=lambda r: r["final_loss"]
        )
    if "adam" in first_order:
        targets["Adam"] = first_order["adam"]["best"]
    results["kfac"] = {}
    for kind in (m for m in args.methods if m in KFAC):
        for name in args.orders:
            batches = order(len(images), args.batch_size, args.steps, shuffled=name == "shuffled")
            run = dict(
                run_kfac(kind, params, images, batches, donate=args.donate),
                order=name,
                donated=args.donate,
            )
            print(report_kfac(run, targets), flush=True)
            results["kfac"][f"{kind} {name}"] = run
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(results, indent=1))
        print(f"results written to {args.out}")
    return results


if __name__ == "__main__":
    main()
