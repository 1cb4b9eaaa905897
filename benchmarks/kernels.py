"""Kernels and compile seconds of the K-FAC step, its refresh and an Adam step, on
whatever backend runs this script.

A step on an accelerator is launch-bound when it is hundreds of small kernels: what
matters there is how many kernels XLA's optimized module runs, not their FLOPs. For
each model this compiles, in one process:

- ``adam``: an Adam step (optax, weight decay), the first-order reference;
- ``kfac``: `kfacx.Optimizer`'s step with the README's settings (L2 term, adaptive
  learning rate, momentum and damping, ``initial_damping=1.0``), its refresh inside;
- ``kfac_donated``: the same step with its params and state donated
  (``donate_params_and_state=True``, as kfac-jax's step always donates);
- ``kfac_no_refresh``: the same step with the refresh taken out (what most steps run);
- ``refresh``: the refresh alone (`BlockDiagonalCurvature.update_cache`).

"Kernels" counts the instructions XLA runs (`count_kernels`): those of the entry
computation and of every ``while`` / ``conditional`` / ``call`` body it reaches, other
than parameters, constants, tuples, tuple elements and bitcasts; a fusion counts as
one. Trace, lowering and XLA compilation are timed separately (first compilation of
each program in this process, after a small warm-up program has paid the backend's
one-time start; the persistent compilation cache is off).

With ``--time-steps N`` each compiled program is also run: N steps fed back into
themselves (the K-FAC step's refresh every ``inverse_update_period`` steps inside, so
its time is amortised over whole periods), without a host synchronisation between
steps, as a training loop runs; the median of three such rounds, per step.

Models: the deep autoencoder of ``vs_kfac_jax.py`` (batch 1000), and the Transformer LM
and the ResNet of ``modern.py`` at their default widths.

Run:  python benchmarks/kernels.py [--models autoencoder lm resnet] [--json out.json]
      python benchmarks/kernels.py --models autoencoder --pieces adam kfac --time-steps 50
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

import kfacx

#: Instructions that do no work of their own.
FREE = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast"}

_COMPUTATION = re.compile(r"^(ENTRY )?%?(\S+) .*\{\s*$")
_INSTRUCTION = re.compile(r"^\s+(?:ROOT )?%?\S+ = .*?\b([a-z][a-z0-9\-]*)\(")
_CALLEES = re.compile(
    r"\b(?:condition|body|to_apply|true_computation|false_computation)=%?([\w.\-]+)"
    r"|branch_computations=\{([^}]*)\}"
)


def count_kernels(hlo_text: str) -> int:
    """Instructions run by the optimized HLO module ``hlo_text`` (see the module)."""
    bodies: dict[str, list[str]] = {}
    entry, current = None, None
    for line in hlo_text.splitlines():
        m = _COMPUTATION.match(line)
        if m and not line.startswith(" "):
            current = m.group(2)
            bodies[current] = []
            if m.group(1):
                entry = current
        elif current is not None and line.startswith(" "):
            bodies[current].append(line)
    if entry is None:
        raise ValueError("No ENTRY computation in the HLO text.")

    def count(name: str, seen: frozenset) -> int:
        total = 0
        for line in bodies.get(name, []):
            m = _INSTRUCTION.match(line)
            if m is None:
                continue
            op = m.group(1)
            if op in ("while", "conditional", "call"):
                for single, several in _CALLEES.findall(line):
                    callees = (
                        [single] if single else [c.strip().lstrip("%") for c in several.split(",")]
                    )
                    for callee in callees:
                        if callee and callee not in seen:
                            total += count(callee, seen | {callee})
                continue
            if op not in FREE:
                total += 1
        return total

    return count(entry, frozenset({entry}))


def measure(fn: Callable, args: tuple, feedback: int = 0, **jit_kwargs) -> dict:
    """Trace, lower and compile ``jax.jit(fn, **jit_kwargs)`` on ``args``; its kernels.

    With ``TIME_STEPS`` set, also the seconds per call: the first ``feedback`` outputs
    are fed back as the first arguments (params and state), ``TIME_STEPS`` calls a round.
    """
    t0 = time.perf_counter()
    traced = jax.jit(fn, **jit_kwargs).trace(*args)
    t1 = time.perf_counter()
    lowered = traced.lower()
    t2 = time.perf_counter()
    compiled = lowered.compile()
    t3 = time.perf_counter()
    out = dict(
        trace=t1 - t0,
        lower=t2 - t1,
        compile=t3 - t2,
        first_compile=t3 - t0,
        kernels=count_kernels(compiled.as_text()),
    )
    if TIME_STEPS:
        out["step_s"] = time_calls(compiled, args, feedback, TIME_STEPS)
    return out


#: Calls per timed round (``--time-steps``); 0: compile only.
TIME_STEPS = 0


def time_calls(compiled, args: tuple, feedback: int, n: int, rounds: int = 3) -> float:
    """Median over ``rounds`` of the mean seconds of ``n`` chained calls of ``compiled``.

    The arguments are copied first, so that a donating program consumes only its copies.
    """
    args = jax.tree.map(lambda x: jnp.array(x, copy=True) if isinstance(x, jax.Array) else x, args)

    def run(args, k):
        for _ in range(k):
            out = compiled(*args)
            if feedback == 1:  # the output is the one argument fed back
                args = (out, *args[1:])
            elif feedback:
                args = (*out[:feedback], *args[feedback:])
        jax.block_until_ready(args)
        return args

    args = run(args, 2)  # warm-up
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        args = run(args, n)
        times.append((time.perf_counter() - t0) / n)
    return statistics.median(times)


def warm_up_backend() -> None:
    """Compile and run a small program: the backend's one-time start (CUDA context,
    compiler initialisation) is not charged to the first measured program."""
    x = jnp.ones((64, 64))
    jax.block_until_ready(jax.jit(lambda a: jnp.tanh(a @ a).sum())(x))


def readme_optimizer(loss_fn: Callable, has_state: bool = False) -> kfacx.Optimizer:
    return kfacx.Optimizer(
        jax.value_and_grad(loss_fn, has_aux=has_state),
        value_func_has_state=has_state,
        num_burnin_steps=0,
        l2_reg=1e-5,
        add_l2_reg=True,
        use_adaptive_learning_rate=True,
        use_adaptive_momentum=True,
        use_adaptive_damping=True,
        initial_damping=1.0,
    )


def _adam(loss_fn, has_state):
    tx = optax.chain(optax.add_decayed_weights(1e-5), optax.adam(1e-3))

    def step(params, opt_state, *rest):
        if has_state:
            func_state, batch = rest
            (loss, func_state), g = jax.value_and_grad(loss_fn, has_aux=True)(
                params, func_state, batch
            )
        else:
            (batch,) = rest
            loss, g = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return tx, step


PIECES = ("adam", "kfac", "kfac_donated", "kfac_no_refresh", "refresh")


def model_pieces(loss_fn, params, batch, func_state=None, pieces=PIECES) -> dict:
    """The programs ``pieces`` of one model, measured (Adam first)."""
    has_state = func_state is not None
    tx, adam_step = _adam(loss_fn, has_state)
    rest = (func_state, batch) if has_state else (batch,)
    out = {"adam": measure(adam_step, (params, tx.init(params), *rest), feedback=2)}
    opt = readme_optimizer(loss_fn, has_state)
    rng = jax.random.key(0)
    if has_state:
        state = jax.block_until_ready(opt.init(params, rng, batch, func_state=func_state))
        args = (params, state, rng, batch, func_state)
    else:
        state = jax.block_until_ready(opt.init(params, rng, batch))
        args = (params, state, rng, batch)
    fed = 2  # params and state go back into the next step (func_state stays as it is)

    def make_step():  # a new function each time: jax.jit caches by function
        return lambda *a: opt.unstaged_step(*a)

    if "kfac" in pieces:
        out["kfac"] = measure(make_step(), args, feedback=fed)
    if "kfac_donated" in pieces:
        # As `Optimizer(donate_params_and_state=True)` stages it (kfac-jax's step donates).
        out["kfac_donated"] = measure(make_step(), args, feedback=fed, donate_argnums=(0, 1))
    if "refresh" in pieces:
        out["refresh"] = measure(
            opt.estimator.update_cache, (state.estimator_state, jnp.float32(1.0)), feedback=1
        )
    if "kfac_no_refresh" in pieces:
        opt.estimator.update_cache = lambda est_state, *_, **__: est_state
        try:
            out["kfac_no_refresh"] = measure(make_step(), args, feedback=fed)
        finally:
            del opt.estimator.update_cache
    return out


def autoencoder(pieces=PIECES) -> dict:
    import vs_kfac_jax as v

    loss_fn = v._make_loss(kfacx.register_sigmoid_cross_entropy_loss)
    batch = jnp.asarray(v._images())
    params = v.NET.init(jax.random.key(42), batch[:1])
    return model_pieces(loss_fn, params, batch, pieces=pieces)


def _modern(kind: str, pieces=PIECES) -> dict:
    import modern

    args = modern.make_parser().parse_args([])
    if kind == "lm":
        problem = modern.lm_problem(int(args.lm_width.split(",")[0]), args)
    else:
        problem = modern.resnet_problem(int(args.resnet_width.split(",")[0]), args)
    return model_pieces(
        problem.loss_fn, problem.params, problem.batch(0), problem.func_state, pieces=pieces
    )


MODELS = {
    "autoencoder": autoencoder,
    "lm": lambda pieces: _modern("lm", pieces),
    "resnet": lambda pieces: _modern("resnet", pieces),
}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument(
        "--pieces", nargs="+", choices=PIECES, default=list(PIECES), help="adam is always run"
    )
    parser.add_argument(
        "--time-steps", type=int, default=0, help="also time each program over N chained calls"
    )
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    global TIME_STEPS
    TIME_STEPS = args.time_steps
    jax.config.update("jax_enable_compilation_cache", False)
    device = jax.devices()[0]
    xla_flags = os.environ.get("XLA_FLAGS", "")
    print(f"backend: {device.platform} ({device.device_kind}), jax {jax.__version__}")
    print(f"XLA_FLAGS: {xla_flags or '(none)'}")
    warm_up_backend()
    results = {}
    for name in args.models:
        pieces = MODELS[name](tuple(args.pieces))
        results[name] = pieces
        adam = pieces["adam"]
        print(f"\n{name}")
        print(
            f"{'program':<18}{'kernels':>9}{'x Adam':>8}{'trace s':>9}{'lower s':>9}"
            f"{'XLA s':>8}{'first s':>9}{'x Adam':>8}"
            + (f"{'step ms':>9}{'x Adam':>8}" if TIME_STEPS else "")
        )
        for piece in PIECES:
            if piece not in pieces:
                continue
            r = pieces[piece]
            print(
                f"{piece:<18}{r['kernels']:>9d}{r['kernels'] / adam['kernels']:>8.2f}"
                f"{r['trace']:>9.2f}{r['lower']:>9.2f}{r['compile']:>8.2f}"
                f"{r['first_compile']:>9.2f}{r['first_compile'] / adam['first_compile']:>8.2f}"
                + (
                    f"{1e3 * r['step_s']:>9.3f}{r['step_s'] / adam['step_s']:>8.2f}"
                    if TIME_STEPS
                    else ""
                )
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                dict(
                    backend=device.platform,
                    device=device.device_kind,
                    jax=jax.__version__,
                    xla_flags=xla_flags,
                    time_steps=TIME_STEPS,
                    models=results,
                ),
                f,
                indent=1,
            )
    return results


if __name__ == "__main__":
    sys.path.insert(0, __import__("os").path.dirname(__file__))
    main()
