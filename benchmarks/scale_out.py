"""Benchmark: distributed inverse refresh and checkpoint size, deep autoencoder.

Measures, for the autoencoder of ``examples/autoencoder_mnist.py`` (2.8 M
parameters, 8 dense layers):

- the time of one cache refresh (the damped inverses of all Kronecker factors)
  on 1 device, and distributed over 2 and 4 devices (``update_cache`` with a
  device axis: each block on its cost-balanced owner, then one all-reduce),
  under ``jax.pmap`` and under ``jax.shard_map`` on a mesh; with the owners'
  share of the work (the ideal speed-up is total cost / largest device load);
- the size on disk of an orbax checkpoint of the parameters and the
  `kfacx.OptimizerState` after a few steps, and the state's bytes by part.

The host's CPU cores bound the speed-up: the 4 "devices" are
``--xla_force_host_platform_device_count=4`` threads on this machine's cores.

Run:  python benchmarks/scale_out.py [--repeats 20] [--out benchmarks/scale_out.json]
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
).strip()

import argparse  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import autoencoder_mnist as ae  # noqa: E402
import datasets  # noqa: E402

from kfacx.parallel import _distributed  # noqa: E402

DAMPING = 1e-2


def _median_time(fn, arg, repeats: int) -> float:
    jax.block_until_ready(fn(arg))  # compile
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(arg))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def refresh_times(opt, state, repeats: int) -> dict:
    """Median seconds of one refresh: serial on one device, and distributed."""
    est = opt.estimator
    est_state = state.estimator_state
    out = {
        "1 device": _median_time(
            jax.jit(lambda s: est.update_cache(s, DAMPING)), est_state, repeats
        )
    }
    costs = [_distributed.refresh_cost(b) for b in est.blocks]
    shares = {}
    for n in (2, 4):
        devices = jax.devices()[:n]
        stacked = jax.tree.map(
            lambda x, n=n: np.broadcast_to(np.asarray(x), (n, *x.shape)), est_state
        )
        replicated = jax.pmap(lambda s: s, devices=devices)(stacked)  # on the devices once
        pmapped = jax.pmap(
            lambda s: est.update_cache(s, DAMPING, pmap_axis_name="i"),
            axis_name="i",
            devices=devices,
        )
        out[f"{n} devices (pmap)"] = _median_time(pmapped, replicated, repeats)
        mesh = jax.make_mesh(
            (n,), ("data",), devices=devices, axis_types=(jax.sharding.AxisType.Auto,)
        )
        on_mesh = jax.device_put(est_state, jax.sharding.NamedSharding(mesh, P()))
        mapped = jax.jit(
            jax.shard_map(
                lambda s: est.update_cache(s, DAMPING, pmap_axis_name="data"),
                mesh=mesh,
                in_specs=P(),
                out_specs=P(),
                check_vma=False,
            )
        )
        out[f"{n} devices (shard_map)"] = _median_time(mapped, on_mesh, repeats)
        owners = est.block_owners(n)
        loads = _distributed.device_loads(costs, owners, n)
        # Each device's share, timed alone on one device: the wall time of a refresh on
        # devices that really run in parallel is the largest share (plus the all-reduce).
        share_s = [
            _median_time(
                jax.jit(functools.partial(_owned_part, est, owners, d)), est_state, repeats
            )
            for d in range(n)
        ]
        psum = jax.pmap(
            lambda s: jax.lax.psum(tuple(b.cache for b in s.blocks), "i"),
            axis_name="i",
            devices=devices,
        )
        shares[n] = dict(
            owners=list(owners),
            cost_loads=loads,
            ideal_speedup=sum(costs) / max(loads),
            share_seconds=share_s,
            all_reduce_seconds=_median_time(psum, replicated, repeats),
        )
    return dict(seconds=out, costs=costs, shares=shares)


def _owned_part(est, owners, device, est_state):
    """The caches of the blocks ``device`` owns, refreshed serially."""
    return [
        block.update_cache(state, DAMPING).cache
        for block, state, owner in zip(est.blocks, est_state.blocks, owners, strict=True)
        if owner == device
    ]


def _tree_bytes(tree) -> int:
    return int(sum(np.asarray(x).nbytes for x in jax.tree.leaves(tree)))


def checkpoint_size(params, state) -> dict:
    """Bytes on disk of an orbax checkpoint of params + state, and the state's parts."""
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "ckpt"
        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save(path, {"params": params, "state": state})
        checkpointer.wait_until_finished()
        on_disk = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    blocks = state.estimator_state.blocks
    return dict(
        on_disk_bytes=int(on_disk),
        params_bytes=_tree_bytes(params),
        velocities_bytes=_tree_bytes(state.velocities),
        factors_bytes=_tree_bytes([b.factors for b in blocks]),
        caches_bytes=_tree_bytes([b.cache for b in blocks]),
        state_bytes=_tree_bytes(state),
    )


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch-size", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default="benchmarks/scale_out.json")
    args = parser.parse_args(argv)

    (images, _), _ = datasets.mnist()
    params = ae.net.init(jax.random.key(42), images[:1])
    opt = ae.make_kfac(
        argparse.Namespace(
            initial_damping=1.0, inverse_update_period=10, curvature_fraction=1.0, burnin=0
        )
    )
    batch = images[: args.batch_size]
    state = opt.init(params, jax.random.key(0), batch)
    for i in range(3):
        params, state, _ = opt.step(params, state, jax.random.key(i), batch)

    refresh = refresh_times(opt, state, args.repeats)
    size = checkpoint_size(params, state)
    results = dict(
        machine=dict(
            platform=platform.platform(),
            cpu_count=os.cpu_count(),
            jax=jax.__version__,
            devices=len(jax.devices()),
        ),
        refresh=refresh,
        checkpoint=size,
    )
    print("cache refresh of the autoencoder (all Kronecker factors, pi-damped inverses):")
    base = refresh["seconds"]["1 device"]
    for name, seconds in refresh["seconds"].items():
        print(f"  {name:<24}{seconds * 1e3:8.1f} ms   {base / seconds:5.2f}x")
    for n, share in refresh["shares"].items():
        largest = max(share["share_seconds"])
        shares_ms = ", ".join(f"{t * 1e3:.0f}" for t in share["share_seconds"])
        print(
            f"  {n} devices: owners {share['owners']}; each device's share alone "
            f"[{shares_ms}] ms -> {base / largest:.2f}x on parallel devices (cost model "
            f"{share['ideal_speedup']:.2f}x); all-reduce {share['all_reduce_seconds'] * 1e3:.0f} ms"
        )
    mb = 1024**2
    print(
        f"checkpoint (params + optimizer state): {size['on_disk_bytes'] / mb:.1f} MB on disk; "
        f"params {size['params_bytes'] / mb:.1f} MB, velocities "
        f"{size['velocities_bytes'] / mb:.1f} MB, factors {size['factors_bytes'] / mb:.1f} MB, "
        f"cached inverses {size['caches_bytes'] / mb:.1f} MB"
    )
    pathlib.Path(args.out).write_text(json.dumps(results, indent=2, default=float) + "\n")
    return results


if __name__ == "__main__":
    main()
