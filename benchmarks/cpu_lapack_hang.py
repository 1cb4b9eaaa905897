"""Reproduces the hang of batched LAPACK calls on JAX's CPU backend (jaxlib 0.10.2).

One jitted program inverts several stacks of positive definite matrices, each by a
batched Cholesky factorisation and two batched triangular solves, as a bucketed
refresh of K-FAC's factors would. The stacks are independent, so XLA's CPU runtime may
run their LAPACK calls at the same time. Each case runs in a subprocess with a
timeout. Measured on a 2-core machine, it is a race:

- unchained, 3 to 5 stacks (4 x 1001, 4 x 501, 4 x 251; the deep autoencoder's
  buckets 2 x 785, 4 x 1001, 4 x 501, 4 x 251, 2 x 31; 5 x (4 x 300)) hang at 0% CPU
  in most runs and finish in about 0.2 s in the others (3 stacks: 3 hangs in 5 runs;
  4 stacks: 1 in 2; 5 stacks: 3 in 3);
- chained by `jax.lax.optimization_barrier` (each stack's input tied to the previous
  stack's inverse), the 5 buckets hang too: the barrier is no kernel, so it orders
  nothing at run time;
- chained by adding ``0 * nan_to_num(previous inverse[0, 0, 0])`` to each input, a data
  dependency read inside a kernel, they finish in about 0.2 s (8 runs of 8).

The cause (gdb on a hung run, jaxlib 0.10.2): a batched LAPACK call
(``lapack_spotrf_ffi``) splits its matrices into chunks, schedules them on XLA's
intra-op thread pool (as many threads as cores) and blocks in ``jax::ParallelBatchMap``
until they are done. Once every thread of the pool is blocked so, nobody runs the
chunks. A batch of one matrix is factorised inline, without the pool: that is why the
loop is safe. A chain makes one program safe, but not programs running beside each
other: with the refresh chained this way inside kfacx's one-device step (2026-11-29),
four such steps dispatched together on four CPU devices hung (both runs), and four
Python threads stepping four optimizers on one CPU device hung in one run of two.

This is why kfacx's CPU refresh inverts a bucket's matrices one at a time
(`jax.lax.map` in `kfacx.linalg.cholesky_inverse_padded`), and why `kfacx.linalg`
decomposes any stack one matrix at a time on the CPU
(`kfacx.linalg._common.one_at_a_time_on_cpu`), at the cost of about 150
kernels (docs/performance_notes.md, "The floor of a step" and "The CPU refresh loops
over matrices").

Run:  python benchmarks/cpu_lapack_hang.py [--timeout 40]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

#: (stacks as "count x size", how they are chained).
CASES = [
    ("4x1001,4x501,4x251", "none"),
    ("2x785,4x1001,4x501,4x251", "none"),
    ("2x785,4x1001,4x501,4x251,2x31", "none"),
    ("4x300,4x300,4x300,4x300,4x300", "none"),
    ("2x785,4x1001,4x501,4x251,2x31", "barrier"),
    ("2x785,4x1001,4x501,4x251,2x31", "zero"),
]


def run_case(spec: str, chain: str) -> None:
    """Compiles and runs one case in this process (prints how long the run took)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(0)
    stacks = []
    for count, size in (map(int, s.split("x")) for s in spec.split(",")):
        x = rng.standard_normal((count, size, size + 10)).astype(np.float32)
        stacks.append(jnp.asarray(x @ np.swapaxes(x, 1, 2) / size + np.eye(size, dtype=np.float32)))

    def inverse(a):
        eye = jnp.broadcast_to(jnp.eye(a.shape[-1], dtype=a.dtype), a.shape)
        chol = jax.lax.linalg.cholesky(a, symmetrize_input=False)
        half = jax.lax.linalg.triangular_solve(chol, eye, left_side=True, lower=True)
        return jax.lax.linalg.triangular_solve(
            chol, half, left_side=True, lower=True, transpose_a=True
        )

    def invert_all(*stacks):
        out = []
        for a in stacks:
            if out and chain == "barrier":
                a, _ = jax.lax.optimization_barrier((a, out[-1]))
            elif out and chain == "zero":
                a = a + 0.0 * jnp.nan_to_num(out[-1][0, 0, 0])
            out.append(inverse(a))
        return out

    compiled = jax.jit(invert_all).lower(*stacks).compile()
    start = time.perf_counter()
    jax.block_until_ready(compiled(*stacks))
    print(f"{time.perf_counter() - start:.2f}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--timeout", type=float, default=40.0, help="seconds per case")
    parser.add_argument("--case", nargs=2, help=argparse.SUPPRESS)  # runs one case here
    args = parser.parse_args(argv)
    if args.case:
        run_case(*args.case)
        return
    print(f"{'stacks':<34}{'chained by':<12}result")
    for spec, chain in CASES:
        try:
            done = subprocess.run(
                [sys.executable, __file__, "--case", spec, chain],
                capture_output=True,
                text=True,
                timeout=args.timeout,
            )
            result = (
                f"ran in {done.stdout.strip()} s"
                if done.returncode == 0
                else f"failed: {done.stderr.strip()[-200:]}"
            )
        except subprocess.TimeoutExpired:
            result = f"hung (killed after {args.timeout:.0f} s)"
        print(f"{spec:<34}{chain:<12}{result}", flush=True)


if __name__ == "__main__":
    main()
