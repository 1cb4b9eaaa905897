"""Where the first step's compilation goes: the deep autoencoder's K-FAC step with and
without its inverse refresh, the refresh alone, and Adam's step for scale.

Each piece is traced, lowered and compiled as the first compilation of a fresh
process (a subprocess per piece), and timed separately; the XLA compilation is
also given in CPU time (XLA uses more than one core), with the number of fused
kernels in the optimized module. Same model, batch and settings as
``vs_kfac_jax.py`` (standard configuration, curvature on the whole batch).

Run:  python benchmarks/compile_anatomy.py [--config adaptive]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time

PIECES = {
    "adam": "Adam step",
    "step_without_refresh": "K-FAC step without the refresh",
    "step": "K-FAC step",
    "refresh": "refresh alone",
    "refresh_fast": "refresh alone, fast_compile_options()",
}


def measure(piece: str, config: str) -> dict:
    """Traces, lowers and compiles ``piece`` in this process."""
    import jax
    import jax.numpy as jnp
    import vs_kfac_jax as v

    import kfacx

    loss_fn = v._make_loss(kfacx.register_sigmoid_cross_entropy_loss)
    batch = jnp.asarray(v._images())
    params = v.NET.init(jax.random.key(42), batch[:1])
    options = {}
    if piece == "adam":
        tx, fn = v.adam_step(loss_fn)
        args = (params, tx.init(params), batch)
    else:
        kwargs, values = v._options(config)
        kwargs["curvature_batch_fraction"] = 1.0
        opt = kfacx.Optimizer(value_and_grad_func=jax.value_and_grad(loss_fn), **kwargs)
        state = jax.block_until_ready(opt.init(params, jax.random.key(0), batch))
        if piece.startswith("refresh"):
            fn, args = opt.estimator.update_cache, (state.estimator_state, jnp.float32(1.0))
            if piece == "refresh_fast":
                options = kfacx.fast_compile_options()
        else:
            if piece == "step_without_refresh":
                opt.estimator.update_cache = lambda est_state, *_: est_state
            values = {k: jnp.float32(x) for k, x in values.items()}

            def fn(p, s, r, b, vals):
                return opt.unstaged_step(p, s, r, b, **vals)

            args = (params, state, jax.random.key(0), batch, values)
    t0 = time.perf_counter()
    traced = jax.jit(fn, compiler_options=options or None).trace(*args)
    t1 = time.perf_counter()
    lowered = traced.lower()
    t2, c2 = time.perf_counter(), time.process_time()
    compiled = lowered.compile()
    t3, c3 = time.perf_counter(), time.process_time()
    kernels = sum(
        1
        for line in compiled.as_text().splitlines()
        if re.match(r"\s+(ROOT )?%\S+ = \S+ fusion\(", line)
    )
    return dict(trace=t1 - t0, lower=t2 - t1, compile=t3 - t2, compile_cpu=c3 - c2, kernels=kernels)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", choices=["standard", "adaptive"], default="standard")
    parser.add_argument("--piece", choices=list(PIECES), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.piece:
        print(json.dumps(measure(args.piece, args.config)))
        return []
    rows = []
    print(f"deep autoencoder, batch 1000, {args.config} configuration")
    print(f"{'piece':<40}{'trace s':>9}{'lower s':>9}{'XLA s':>8}{'(CPU s)':>9}{'kernels':>9}")
    for piece, title in PIECES.items():
        cmd = [sys.executable, __file__, "--piece", piece, "--config", args.config]
        done = subprocess.run(cmd, check=True, capture_output=True, text=True)
        r = dict(json.loads(done.stdout.strip().splitlines()[-1]), piece=piece)
        rows.append(r)
        print(
            f"{title:<40}{r['trace']:>9.2f}{r['lower']:>9.2f}{r['compile']:>8.2f}"
            f"{r['compile_cpu']:>9.2f}{r['kernels']:>9d}"
        )
    return rows


if __name__ == "__main__":
    main()
