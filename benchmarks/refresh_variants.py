"""Where the inverse refresh's time goes, and what else could compute it, on whatever
backend runs this script (prepared for a GPU run: `device_run.sh`).

On an NVIDIA H200 the deep autoencoder's refresh took 8.6 ms, eleven Adam steps
(docs/benchmarks.md, "On an NVIDIA H200"; docs/performance_notes.md, "The GPU step"):
one batched Cholesky and two batched triangular solves per size bucket. This times,
per bucket of that refresh (its shapes: ``[K, n, n]`` stacks of damped factors,
float32) and each as a program of its own:

- ``cholesky``: the batched factorisation alone;
- ``cholesky+solves``: kfacx's path off the CPU (`kfacx.linalg._inverse._unblocked_inverse`);
- ``looped``: the same per matrix, in a `jax.lax.map` (unbatched library calls);
- ``solve+product`` (and ``_looped``): Cholesky, one triangular solve for ``L^-1`` and
  the product ``L^-T L^-1`` in place of the second solve;
- ``lu_inv``: `jnp.linalg.inv` (LU with pivoting), batched;
- ``block``: kfacx's CPU path (`_block_inverse`, products above 256 rows), per matrix;
- ``eigh``: the eigendecomposition, for scale (kfacx's fallback).

Each variant's accuracy is its largest relative error against a float64 inverse
(NumPy), so that a faster one is only taken if it is as exact. Off the CPU, the whole
refresh (all buckets in one program) is timed too. On the CPU the buckets stay in
separate programs: independent batched LAPACK calls in one program can hang there
(`cpu_lapack_hang.py`).

Run:  python benchmarks/refresh_variants.py [--repeats 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

from kfacx.linalg import _inverse

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _timing import median_seconds  # noqa: E402

#: The deep autoencoder's refresh buckets (`kfacx.linalg.size_buckets` of its factor
#: sizes 1001, 1000, 785, 784, 501, 500, 251, 250, 31, 30): (matrices, size).
BUCKETS = ((4, 1001), (2, 785), (4, 501), (4, 251), (4, 64))


def spd_stack(k: int, n: int, seed: int) -> np.ndarray:
    """``k`` damped covariance-like matrices (a factor's moving average plus damping)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((k, 2 * n, n)) * np.linspace(0.1, 2.0, n)
    return (np.einsum("kbi,kbj->kij", x, x) / (2 * n) + 1e-3 * np.eye(n)).astype(np.float32)


def _solve_and_product(a: jax.Array) -> jax.Array:
    """``a^-1 = L^-T L^-1``: Cholesky, one triangular solve for ``L^-1``, then a matrix
    product in place of the second solve (products run faster than solves on most
    hardware; the result is symmetric up to rounding)."""
    chol = jax.lax.linalg.cholesky(a, symmetrize_input=False)
    eye = jnp.broadcast_to(jnp.eye(a.shape[-1], dtype=a.dtype), a.shape)
    inv_chol = jax.lax.linalg.triangular_solve(chol, eye, left_side=True, lower=True)
    return jnp.swapaxes(inv_chol, -1, -2) @ inv_chol


VARIANTS = {
    "cholesky": lambda a: jax.lax.linalg.cholesky(a, symmetrize_input=False),
    "cholesky+solves": _inverse._unblocked_inverse,
    "looped": lambda a: jax.lax.map(_inverse._unblocked_inverse, a),
    "solve+product": _solve_and_product,
    "solve+product_looped": lambda a: jax.lax.map(_solve_and_product, a),
    "lu_inv": jnp.linalg.inv,
    "block": lambda a: jax.lax.map(_inverse._block_inverse, a),
    "eigh": lambda a: jnp.linalg.eigh(a)[0],
}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    device = jax.devices()[0]
    print(f"backend: {device.platform} ({device.device_kind}), jax {jax.__version__}")
    stacks = [jnp.asarray(spd_stack(k, n, seed)) for seed, (k, n) in enumerate(BUCKETS)]
    exact = [np.linalg.inv(np.asarray(s, np.float64)) for s in stacks]
    results: dict = {"backend": device.platform, "device": device.device_kind, "buckets": {}}
    print(f"{'bucket':<12}" + "".join(f"{v:>17}" for v in args.variants) + "   (ms; rel. error)")
    totals = dict.fromkeys(args.variants, 0.0)
    for (k, n), stack, want in zip(BUCKETS, stacks, exact, strict=True):
        row = {}
        for name in args.variants:
            fn = jax.jit(VARIANTS[name])
            seconds = median_seconds(fn, stack, args.repeats)
            error = None
            if name not in ("cholesky", "eigh"):
                got = np.asarray(fn(stack), np.float64)
                error = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
            row[name] = dict(ms=1e3 * seconds, error=error)
            totals[name] += 1e3 * seconds
        results["buckets"][f"{k}x{n}"] = row
        print(
            f"{f'{k} x {n}':<12}"
            + "".join(
                f"{r['ms']:>9.3f}" + (f" {r['error']:7.1e}" if r["error"] is not None else " " * 8)
                for r in row.values()
            )
        )
    print(f"{'sum':<12}" + "".join(f"{totals[v]:>9.3f}        " for v in args.variants))
    results["sum_ms"] = totals
    if device.platform != "cpu":
        whole = {}
        for name in ("cholesky+solves", "looped", "solve+product", "lu_inv"):
            if name in args.variants:
                fn = jax.jit(lambda *s, f=VARIANTS[name]: [f(x) for x in s])
                whole[name] = 1e3 * median_seconds(lambda s, fn=fn: fn(*s), stacks, args.repeats)
        results["whole_refresh_ms"] = whole
        print("all buckets in one program (ms):", {k: round(v, 3) for k, v in whole.items()})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    sys.exit(main() and 0)
