"""Benchmark: sharded curvature state; distributed inverse refresh and checkpoint size.

``--part sharded_state`` measures, for an MLP of width 2048 (with 64-wide
bottlenecks, 8 dense layers: 8 curvature blocks of equal bytes) on 1, 2, 4 and 8
devices, under the sharded jit and under ``shard_map``, with the replicated and the
sharded curvature state (``shard_curvature_state=True``):

- the optimizer state's bytes per device, from its arrays' addressable shards (all of
  it, and its curvature part alone), against the bar sharded <= 1.15 x replicated / n;
- the bytes communicated per step and per refresh: the collectives of the compiled
  step's HLO (all-reduce, reduce-scatter, all-gather, collective-permute, all-to-all)
  and their operands, those inside conditional branches counted as the refresh's;
- the median time of a step without and with the cache refresh (the "devices" share
  the host's CPU cores, so replicated work shows up as time);
- on 8 devices with ``curvature_update_period=10``: the bytes every step sends, and
  those only the steps that update the curvature or refresh send;
- for 8 layers of width 2048 in a ``lax.scan`` (one `kfacx.blocks.StackedBlock`), the
  curvature state per device against the ideal, cut into runs of slices and whole.

``--part refresh`` measures, for the autoencoder of ``examples/autoencoder_mnist.py`` (2.8 M
parameters, 8 dense layers):

- the time of one cache refresh (the damped inverses of all Kronecker factors)
  on 1 device, and distributed over 2 and 4 devices (``update_cache`` with a
  device axis: each piece of the refresh on its cost-balanced owner, then one
  all-reduce),
  under ``jax.pmap`` and under ``jax.shard_map`` on a mesh; with the owners'
  share of the work (the ideal speed-up is total cost / largest device load);
- the size on disk of an orbax checkpoint of the parameters and the
  `kfacx.OptimizerState` after a few steps, and the state's bytes by part.

The host's CPU cores bound the speed-up: the 4 "devices" are
``--xla_force_host_platform_device_count=4`` threads on this machine's cores.

Each part updates its own key of the JSON file.

Run:  python benchmarks/scale_out.py [--part sharded_state|refresh|all] [--repeats 20]
        [--out benchmarks/scale_out.json]
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import argparse  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import kfacx  # noqa: E402
from kfacx.estimator import _refresh, _sharded_curvature  # noqa: E402
from kfacx.parallel import _distributed  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _timing import median_seconds  # noqa: E402

DAMPING = 1e-2


def refresh_times(opt, state, repeats: int) -> dict:
    """Median seconds of one refresh: serial on one device, and distributed."""
    est = opt.estimator
    est_state = state.estimator_state
    out = {
        "1 device": median_seconds(
            jax.jit(lambda s: est.update_cache(s, DAMPING)), est_state, repeats
        )
    }
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
        out[f"{n} devices (pmap)"] = median_seconds(pmapped, replicated, repeats)
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
        out[f"{n} devices (shard_map)"] = median_seconds(mapped, on_mesh, repeats)
        loads = _piece_loads(est.blocks, est._cache_spec, n)
        # Each device's share, timed alone on one device: the wall time of a refresh on
        # devices that really run in parallel is the largest share (plus the all-reduce).
        share_s = [
            median_seconds(jax.jit(functools.partial(_owned_part, est, n, d)), est_state, repeats)
            for d in range(n)
        ]
        psum = jax.pmap(
            lambda s: jax.lax.psum(tuple(b.cache for b in s.blocks), "i"),
            axis_name="i",
            devices=devices,
        )
        shares[n] = dict(
            owners=list(est.block_owners(n)),
            cost_loads=loads,
            ideal_speedup=sum(loads) / max(loads),
            share_seconds=share_s,
            all_reduce_seconds=median_seconds(psum, replicated, repeats),
        )
    return dict(seconds=out, shares=shares)


def _owned_part(est, num_devices, device, est_state):
    """The pieces of the refresh distributed over ``num_devices`` that ``device`` runs
    (`kfacx.estimator._refresh.pieces`), serially."""
    plan = _refresh.plan(est.blocks, est_state.blocks, est._block_weights(est_state, DAMPING))
    cut = _refresh.pieces(plan, num_devices)
    owners = _distributed.assign_owners([p.cost for p in cut], num_devices)
    return [_refresh._piece_run(plan, p)() for p, o in zip(cut, owners, strict=True) if o == device]


def _piece_loads(blocks, cache_spec, num_devices) -> list[float]:
    """Each device's cost (``K n^3`` per bucket of ``K`` padded ``n x n`` factors) in the
    refresh of ``blocks`` distributed over ``num_devices`` (``distributed_inverses``)."""
    cut = _refresh.pieces(_refresh.abstract_plan(blocks, cache_spec), num_devices)
    costs = [p.cost for p in cut]
    return _distributed.device_loads(
        costs, _distributed.assign_owners(costs, num_devices), num_devices
    )


def _tree_bytes(tree) -> int:
    return int(sum(np.asarray(x).nbytes for x in jax.tree.leaves(tree)))


def checkpoint_size(params, state) -> dict:
    """Bytes on disk of an orbax checkpoint of params + state, and the state's parts."""
    import orbax.checkpoint as ocp

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


def refresh_part(args) -> dict:
    """The autoencoder's refresh times and checkpoint size (``--part refresh``)."""
    import autoencoder_mnist as ae
    import datasets

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
    return dict(refresh=refresh, checkpoint=size)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--part", choices=["all", "sharded_state", "refresh"], default="all")
    parser.add_argument("--batch-size", type=int, default=1000)
    parser.add_argument("--state-batch-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--state-repeats", type=int, default=1)
    parser.add_argument("--placements", default="shard_map,mesh")
    parser.add_argument("--devices", default="1,2,4,8")
    parser.add_argument("--out", default="benchmarks/scale_out.json")
    args = parser.parse_args(argv)

    out = pathlib.Path(args.out)
    results = json.loads(out.read_text()) if out.exists() else {}
    results["machine"] = dict(
        platform=platform.platform(),
        cpu_count=os.cpu_count(),
        jax=jax.__version__,
        devices=len(jax.devices()),
    )
    if args.part in ("all", "refresh"):
        results.update(refresh_part(args))
    if args.part in ("all", "sharded_state"):
        print("optimizer state per device, communication and times, replicated vs sharded:")
        results["sharded_state"] = sharded_state(
            args.state_batch_size,
            args.state_repeats,
            args.placements.split(","),
            [int(n) for n in args.devices.split(",")],
        )
    out.write_text(json.dumps(results, indent=2, default=float) + "\n")
    return results


# ----------------------------------------------------------------------------- sharded state

#: The model of the sharded-state measurement: an MLP of width 2048 with 64-wide
#: bottlenecks (2048 -> 64 -> 2048 -> ... -> 2048, 8 dense layers). Every layer's
#: curvature state is one 2048 x 2048 factor (and its inverse) plus a 64 x 64 one: 8
#: blocks of equal bytes, 98 % of the optimizer state, and cheap products (the two
#: CPU cores can time 8 replicated devices).
WIDTH, BOTTLENECK, LAYERS = 2048, 64, 8

#: Collective ops of XLA's HLO: ``(data, ring)``: the bytes of the data the collective
#: combines (the full array: an all-reduce's operand, a reduce-scatter's input, an
#: all-gather's output) and the bytes each device sends in a ring algorithm, both as
#: multiples of the bytes of the op's result on one device (n devices). The compiled
#: HLO prints the result's shape, not the operands'.
_COLLECTIVES = {
    "all-reduce": lambda n: (1, 2 * (n - 1) / n),
    "reduce-scatter": lambda n: (n, n - 1),
    "all-gather": lambda n: (1, (n - 1) / n),
    "collective-permute": lambda n: (1, 1),
    "all-to-all": lambda n: (1, (n - 1) / n),
}
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2}
_BYTES.update({"s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8})
_SHAPE = re.compile(r"\b(" + "|".join(_BYTES) + r")\[([\d,]*)\]")
_OP = re.compile(r"=\s*(.+?)\s+(" + "|".join(_COLLECTIVES) + r")(?:-start)?\((.*?)\)(,|$)")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")


def _shape_bytes(text: str) -> int:
    return sum(
        _BYTES[t] * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
        for t, dims in _SHAPE.findall(text)
    )


def hlo_collectives(hlo: str, num_devices: int) -> dict:
    """The collectives of a compiled program's HLO text: per kind, their count, data
    bytes and bytes sent per device in a ring (see `_COLLECTIVES`), split into those
    every step runs (``step``) and those inside a conditional's branches
    (``conditional``: the inverse refresh, run every ``inverse_update_period`` steps;
    the sharded layout's owner branches hold none)."""
    computations: dict[str, list[str]] = {}
    current = None
    for line in hlo.splitlines():
        header = _HEADER.match(line)
        if header and not line.startswith(" "):
            current = header.group(1)
            computations[current] = []
        elif current is not None:
            computations[current].append(line)
    branches, calls = set(), {name: set() for name in computations}
    for name, lines in computations.items():
        for line in lines:
            for key, value in re.findall(
                r"(\w+_computations?|calls|to_apply|body|condition)=(\{[^}]*\}|%?[\w.\-]+)", line
            ):
                targets = set(re.findall(r"%?([\w.\-]+)", value.strip("{}")))
                calls[name] |= targets
                if key in ("branch_computations", "true_computation", "false_computation"):
                    branches |= targets
    conditional = set()
    todo = list(branches)
    while todo:
        name = todo.pop()
        if name in conditional or name not in computations:
            continue
        conditional.add(name)
        todo.extend(calls[name])
    out = {part: {} for part in ("step", "conditional")}
    for name, lines in computations.items():
        part = "conditional" if name in conditional else "step"
        for line in lines:
            op = _OP.search(line)
            if not op or "-done" in line.split("=")[1].split("(")[0]:
                continue
            kind = op.group(2)
            entry = out[part].setdefault(kind, dict(count=0, data_bytes=0, ring_bytes=0.0))
            entry["count"] += 1
            size = _shape_bytes(op.group(1))
            data, ring = _COLLECTIVES[kind](num_devices)
            entry["data_bytes"] += size * data
            entry["ring_bytes"] += size * ring
    for part in out.values():
        part["total_ring_bytes"] = sum(e["ring_bytes"] for e in list(part.values()))
    return out


def _bottleneck_loss(params, batch):
    h = batch
    for i, layer in enumerate(params):
        h = h @ layer["w"] + layer["b"][None, :]
        if i < len(params) - 1:
            h = jnp.tanh(h)
    kfacx.register_squared_error_loss(h, batch)
    return jnp.mean(jnp.sum((h - batch) ** 2, axis=-1))


def _bottleneck_params():
    widths = [WIDTH] + [BOTTLENECK, WIDTH] * (LAYERS // 2)
    keys = jax.random.split(jax.random.key(0), LAYERS)
    return [
        dict(w=jax.random.normal(k, (i, o)) / np.sqrt(i), b=jnp.zeros(o))
        for k, i, o in zip(keys, widths[:-1], widths[1:], strict=True)
    ]


def refresh_loads(batch_size: int, counts: list[int]) -> dict:
    """Per device count and layout, the refresh work of the busiest device (cost model:
    ``K n^3`` per bucket of ``K`` padded ``n x n`` factors), as a fraction of the whole
    refresh: replicated, the pieces of the buckets go to cost-balanced owners
    (``distributed_inverses``); sharded, each owner refreshes its own blocks."""
    est = kfacx.BlockDiagonalCurvature(_bottleneck_loss)
    params = _bottleneck_params()
    est.set_up((params, jnp.zeros((batch_size, WIDTH))))
    spec = est._cache_spec
    total = sum(_refresh.abstract_plan(est.blocks, spec).costs)
    out = {}
    for n in counts:
        loads = _piece_loads(est.blocks, spec, n)
        owners = _sharded_curvature.plan_for(est, n).owners
        sharded = [
            sum(
                _piece_loads(
                    [b for b, o in zip(est.blocks, owners, strict=True) if o == d], spec, 1
                )
            )
            for d in range(n)
        ]
        out[n] = dict(replicated=max(loads) / total, sharded=max(sharded) / total)
    return out


def _scanned_loss(params, batch):
    """``LAYERS`` dense layers of width ``WIDTH`` in a `lax.scan` over their stacked
    parameters: one `kfacx.blocks.StackedBlock` holds the whole curvature state."""

    def layer(h, p):
        return jnp.tanh(h @ p["w"] + p["b"]), None

    h, _ = jax.lax.scan(layer, batch, params)
    kfacx.register_squared_error_loss(h, batch)
    return jnp.mean(jnp.sum((h - batch) ** 2, axis=-1))


def stacked_bytes(counts: list[int]) -> dict:
    """For the scanned model (one stacked block of ``LAYERS`` slices), the curvature
    state each device stores (one row of the packed buffers, padding included) as a
    multiple of the ideal (all of it / n), with the block cut into runs of slices (the
    default) and kept whole; from the layout alone (no arrays are made)."""
    est = kfacx.BlockDiagonalCurvature(_scanned_loss)
    params = dict(w=jnp.zeros((LAYERS, WIDTH, WIDTH)), b=jnp.zeros((LAYERS, WIDTH)))
    est.set_up((params, jnp.zeros((8, WIDTH))))
    total = sum(_sharded_curvature.plan_for(est, 1).state_layout.owner_bytes())
    out = {}
    for n in counts:
        plan = _sharded_curvature.plan_for(est, n)
        out[n] = dict(
            runs=len(plan.units.units),
            cut_ratio_to_ideal=plan.state_layout.row_bytes() / (total / n),
            whole_ratio_to_ideal=float(n),  # one block, one owner: all of it
        )
        print(
            f"  scanned model, n={n}: {len(plan.units.units)} runs of slices; state per "
            f"device {out[n]['cut_ratio_to_ideal']:.3f} x ideal (kept whole: "
            f"{out[n]['whole_ratio_to_ideal']:.3f})",
            flush=True,
        )
    return out


def _bytes_per_device(tree) -> list[int]:
    """Bytes of ``tree``'s arrays on each device, from their addressable shards."""
    per: dict = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            per[shard.device] = per.get(shard.device, 0) + shard.data.nbytes
    return [per[d] for d in sorted(per, key=lambda d: d.id)]


def _compiled_step(placement: str, n: int, layout: str, batch_size: int, **options):
    """The benchmark model's step on ``n`` devices, compiled: ``(compiled, inputs,
    optimizer, compile seconds)``."""
    params = _bottleneck_params()
    batch = jax.random.normal(jax.random.key(1), (batch_size, WIDTH))
    mesh = jax.make_mesh(
        (n,), ("data",), devices=jax.devices()[:n], axis_types=(jax.sharding.AxisType.Auto,)
    )
    opt = kfacx.Optimizer(
        jax.value_and_grad(_bottleneck_loss),
        mesh=mesh,
        use_shard_map=placement == "shard_map",
        shard_curvature_state=layout == "sharded",
        learning_rate_schedule=1e-3,
        momentum_schedule=0.9,
        initial_damping=1.0,
        num_burnin_steps=0,
        **options,
    )
    state = opt.init(params, jax.random.key(0), batch)
    b, p, s, r, _ = opt.placement.put(batch, params, state, jax.random.key(0), None)
    t0 = time.perf_counter()
    compiled = opt._stage().lower(p, s, r, b, None, None, None, None, None).compile()
    return compiled, (p, s, r, b), opt, time.perf_counter() - t0


def sharded_state(batch_size: int, repeats: int, placements: list[str], counts: list[int]) -> dict:
    """Optimizer-state bytes per device, bytes communicated per step and per refresh
    (from the compiled HLO), and step / refresh-step times, for the replicated and
    the sharded curvature state on 1, 2, 4 and 8 devices; and the bytes communicated
    on the largest count with ``curvature_update_period=10``."""
    rows = []
    for placement in placements:
        for n in counts:
            for layout in ("replicated", "sharded"):
                # The even steps refresh, the odd ones do not.
                compiled, (p, s, r, b), opt, compile_s = _compiled_step(
                    placement, n, layout, batch_size, inverse_update_period=2
                )
                comm = hlo_collectives(compiled.as_text(), n)
                times = {0: [], 1: []}
                for i in range(2 + 2 * repeats):  # step counter i: even ones refresh
                    t0 = time.perf_counter()
                    p, s, _ = compiled(p, s, r, b, None, None, None, None, None)
                    jax.block_until_ready((p, s))
                    if i >= 2:
                        times[i % 2].append(time.perf_counter() - t0)
                state_bytes = _bytes_per_device(s)
                curvature_bytes = _bytes_per_device(s.estimator_state)
                row = dict(
                    placement=placement,
                    devices=n,
                    layout=layout,
                    state_bytes_per_device=max(state_bytes),
                    curvature_bytes_per_device=max(curvature_bytes),
                    state_bytes_all_devices=sum(state_bytes),
                    step_comm=comm["step"],
                    refresh_comm=comm["conditional"],
                    step_seconds=statistics.median(times[1]),
                    refresh_step_seconds=statistics.median(times[0]),
                    compile_seconds=compile_s,
                )
                rows.append(row)
                print(
                    f"  {placement:<9} n={n} {layout:<10} state/device "
                    f"{row['state_bytes_per_device'] / 2**20:7.1f} MiB (curvature "
                    f"{row['curvature_bytes_per_device'] / 2**20:7.1f}); comm/step "
                    f"{comm['step']['total_ring_bytes'] / 2**20:7.2f} MiB, /refresh "
                    f"{comm['conditional']['total_ring_bytes'] / 2**20:7.2f} MiB; step "
                    f"{row['step_seconds'] * 1e3:7.1f} ms, refresh step "
                    f"{row['refresh_step_seconds'] * 1e3:7.1f} ms",
                    flush=True,
                )
                del opt, s, p, compiled
    for row in rows:
        if row["layout"] != "sharded":
            continue
        (rep,) = [
            r
            for r in rows
            if r["layout"] == "replicated"
            and r["devices"] == row["devices"]
            and r["placement"] == row["placement"]
        ]
        n = row["devices"]
        for key in ("state_bytes_per_device", "curvature_bytes_per_device"):
            row[key.replace("_per_device", "_ratio_to_ideal")] = row[key] / (rep[key] / n)
    loads = refresh_loads(batch_size, counts)
    for row in rows:
        row["refresh_busiest_device_share"] = loads[row["devices"]][row["layout"]]
    # Statistics every 10 steps (refresh every 20): those collectives run in the
    # conditional's branches with the refresh's; the other steps send the rest.
    n, periodic = max(counts), []
    for placement in placements:
        for layout in ("replicated", "sharded"):
            compiled, _, _, _ = _compiled_step(
                placement,
                n,
                layout,
                batch_size,
                curvature_update_period=10,
                inverse_update_period=20,
            )
            comm = hlo_collectives(compiled.as_text(), n)
            periodic.append(
                dict(
                    placement=placement,
                    devices=n,
                    layout=layout,
                    every_step_comm=comm["step"],
                    update_or_refresh_comm=comm["conditional"],
                )
            )
            print(
                f"  {placement:<9} n={n} {layout:<10} curvature_update_period=10: comm/step "
                f"{comm['step']['total_ring_bytes'] / 2**20:7.2f} MiB, on update or refresh "
                f"steps {comm['conditional']['total_ring_bytes'] / 2**20:7.2f} MiB more",
                flush=True,
            )
    return dict(
        model=dict(width=WIDTH, bottleneck=BOTTLENECK, layers=LAYERS, batch_size=batch_size),
        curvature_update_period_10=periodic,
        scanned_model=dict(
            model=f"{LAYERS} dense layers of width {WIDTH} in a lax.scan (one StackedBlock)",
            bytes=stacked_bytes(counts),
        ),
        timed_steps=repeats,
        bar="sharded bytes per device <= 1.15 * replicated / n",
        rows=rows,
    )


if __name__ == "__main__":
    main()
