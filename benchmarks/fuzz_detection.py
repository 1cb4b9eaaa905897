"""Detection fuzzer, long run: random small models through layer detection.

Run:  python benchmarks/fuzz_detection.py --examples 10000 --seed 0

Draws ``--examples`` models from tests/graph_matcher/_fuzz_models.py (dense, conv,
norm and embedding layers; parameters through views and ``jax.lax`` primitives;
control flow, jit, remat, custom derivatives, vmap) and checks each with
tests/graph_matcher/_fuzz_checks.py: detection finishes (or raises kfacx's documented
ValueError/TypeError), its report lists every parameter once; every
``--products-every``-th model's float64 curvature products match the dense exact GGN
on the matched layers, and every ``--step-every``-th one trains one finite step. A
failure is shrunk by hypothesis and printed; the run then exits with status 1. The
suite runs the same property with a quick profile (tests/graph_matcher/test_fuzz.py).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time
import traceback

ROOT = pathlib.Path(__file__).resolve().parents[1]
# As in tests/conftest.py: cheap XLA compilation (the run compiles many small programs).
os.environ.setdefault(
    "XLA_FLAGS", "--xla_cpu_use_fusion_emitters=false --xla_backend_optimization_level=0"
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import hypothesis  # noqa: E402
import jax  # noqa: E402

from tests.graph_matcher import _fuzz_runner as R  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--products-every", type=int, default=10)
    parser.add_argument("--step-every", type=int, default=100)
    args = parser.parse_args()
    jax.config.update("jax_numpy_rank_promotion", "raise")  # as the suite runs
    tally = R.Tally()
    prop = R.fuzz_property(args.products_every, args.step_every, tally)
    prop = hypothesis.settings(
        hypothesis.settings.get_profile("kfacx-fuzz-long"), max_examples=args.examples
    )(hypothesis.seed(args.seed)(prop))
    start = time.perf_counter()
    failed = False
    try:
        prop()
    except Exception as e:
        traceback.print_exc()  # with hypothesis's notes: the shrunk example
        print(f"FAILED: {type(e).__name__}: {e}", flush=True)
        failed = True
    seconds = time.perf_counter() - start
    print(f"seed {args.seed}, {seconds:.0f} s, jax {jax.__version__}")
    for name, n in tally.counts.items():
        print(f"  {name}: {n}")
    for message, n in tally.errors.most_common():
        print(f"  kfacx error ({n}x): {message}")
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())
