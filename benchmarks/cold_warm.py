"""A cold and a warm start: the README example's first K-FAC step, with and without
JAX's persistent compilation cache (`kfacx.enable_compilation_cache`).

Each run is a new process that builds the deep autoencoder's optimizer as
``examples/autoencoder_mnist.py`` does (its default settings, batch 1000), then times
``optimizer.init`` and the first ``optimizer.step`` (compilation included) to the
first loss on the host. Runs, in order: no cache; a cold cache (an empty directory);
the same directory warm, ``--repeats`` times.

Run:  python benchmarks/cold_warm.py [--repeats 2] [--cache-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]

CHILD = """
import json, sys, time
t0 = time.perf_counter()
sys.path.insert(0, {examples!r})
import jax
import kfacx
if {cache!r}:
    kfacx.enable_compilation_cache({cache!r})
import autoencoder_mnist as ex
import datasets
import argparse
args = argparse.Namespace(
    batch_size=1000, inverse_update_period=5, initial_damping=1.0,
    curvature_fraction=None, burnin=5)
(images, _), _ = datasets.mnist()
params = ex.net.init(jax.random.key(42), images[:1])
optimizer = ex.make_kfac(args)
batch = next(ex.batches(images, 1000, 1))
t1 = time.perf_counter()
state = optimizer.init(params, jax.random.key(0), batch)
jax.block_until_ready(state)
t2 = time.perf_counter()
params, state, stats = optimizer.step(params, state, jax.random.key(1), batch)
float(stats["loss"])
t3 = time.perf_counter()
print(json.dumps({{"imports_and_data": t1 - t0, "init": t2 - t1, "first_step": t3 - t2}}))
"""


def run(cache: str | None) -> dict:
    code = CHILD.format(examples=str(ROOT / "examples"), cache=cache or "")
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    env.pop("KFACX_COMPILATION_CACHE_DIR", None)
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False
    )
    if done.returncode:
        raise RuntimeError(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=2, help="warm runs")
    parser.add_argument("--cache-dir", help="default: a new temporary directory")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    cache = args.cache_dir or tempfile.mkdtemp(prefix="kfacx-cold-warm-")
    rows = [("no cache", run(None)), ("cold cache", run(cache))]
    rows += [(f"warm cache ({i + 1})", run(cache)) for i in range(args.repeats)]
    print(f"{'run':<18}{'init s':>8}{'first step s':>14}{'both s':>8}")
    for name, r in rows:
        both = r["init"] + r["first_step"]
        print(f"{name:<18}{r['init']:>8.2f}{r['first_step']:>14.2f}{both:>8.2f}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(dict(rows), indent=1))
    return dict(rows)


if __name__ == "__main__":
    main()
