"""One process of tests/parallel/test_multiprocess.py: the same training under every placement,
whether this is one process with all the devices or one of several processes joined
with `jax.distributed` (as on several hosts).

Each process feeds only its own rows of the global batch. The test runs the
functions here in its own process (one process, 4 devices) and starts this file
as a script in 2 processes of 2 CPU devices each::

    python tests/_multiprocess_worker.py PROCESS_ID NUM_PROCESSES PORT OUT

which join over gloo (CPU collectives) with the coordinator at ``localhost:PORT``,
read the parameters and the global batch from ``OUT/inputs.npz``, and write
``OUT/process_<id>.npz`` (the parameters, optimizer state and stats after each
placement's steps) and the orbax checkpoints ``OUT/ckpt_mesh``, ``OUT/ckpt_pmap``,
``OUT/ckpt_sharded_state``.
Last, they run the training of examples/multiprocess.py for a few steps (the
recipe docs/scaling.md shows); the first process prints its losses.
"""

from __future__ import annotations

import os
import pathlib
import runpy
import sys
import traceback

import jax
import numpy as np
import orbax.checkpoint as ocp
from _optimizer_cases import ADAPTIVE, mlp_loss
from jax.sharding import NamedSharding, PartitionSpec

import kfacx

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "multiprocess.py"
#: ``sharded_state``: the sharded jit with ``shard_curvature_state=True``;
#: ``sharded_shard_map``: shard_map with it (statistics and gradients reduce-scattered).
PLACEMENTS = ("mesh", "shard_map", "pmap", "sharded_state", "sharded_shard_map")
SHARDED = ("sharded_state", "sharded_shard_map")
STEPS = 10
STATS = ("loss", "learning_rate", "momentum", "damping")
OPTIONS = dict(
    estimation_mode="ggn_exact",  # No sampling: every device layout takes the same steps.
    inverse_update_period=3,
    num_burnin_steps=0,
    **ADAPTIVE,
)


def process_rows(array: np.ndarray) -> np.ndarray:
    """This process's rows of a global batch (all of them in a single process)."""
    n = len(array) // jax.process_count()
    return array[n * jax.process_index() : n * (jax.process_index() + 1)]


def optimizer(placement: str) -> kfacx.Optimizer:
    """The optimizer of ``placement``, over all processes' devices."""
    if placement == "pmap":
        return kfacx.Optimizer(jax.value_and_grad(mlp_loss), multi_device=True, **OPTIONS)
    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    return kfacx.Optimizer(
        jax.value_and_grad(mlp_loss),
        mesh=mesh,
        use_shard_map=placement in ("shard_map", "sharded_shard_map"),
        shard_curvature_state=placement in SHARDED,
        **OPTIONS,
    )


def train(placement: str, params, batch):
    """``STEPS`` steps under ``placement`` from ``params`` on the global ``batch``
    (NumPy arrays), of which this process feeds only its rows.

    Returns:
      ``(optimizer, params, state, stats)``: one copy of params and state (global
      arrays on the mesh; under pmap the first local device's), the last stats.
    """
    opt = optimizer(placement)
    rows = tuple(process_rows(a) for a in batch)
    if placement == "pmap":
        rep = kfacx.parallel.replicate_all_local_devices
        local = kfacx.parallel.shard_batch(rows)
        params, state = rep(params), opt.init(rep(params), rep(jax.random.key(7)), local)
        for i in range(STEPS):
            params, state, stats = opt.step(params, state, rep(jax.random.key(100 + i)), local)
        return (opt, *kfacx.parallel.get_first((params, state, stats)))
    data = NamedSharding(opt.placement.mesh, PartitionSpec("data"))
    local = tuple(jax.make_array_from_process_local_data(data, a) for a in rows)
    state = opt.init(params, jax.random.key(7), local)
    for i in range(STEPS):
        params, state, stats = opt.step(params, state, jax.random.key(100 + i), local)
    return opt, params, state, stats


def gathered(opt: kfacx.Optimizer, state):
    """``state`` with a sharded curvature state read back per block (its rows live on
    the devices of all processes: replicated first, so that every process reads them)."""
    rep = NamedSharding(opt.placement.mesh, PartitionSpec())
    buffers = jax.jit(lambda b: b, out_shardings=rep)(state.estimator_state)
    return state._replace(estimator_state=kfacx.gather_estimator_state(opt.estimator, buffers))


def flat(placement: str, params, state, stats=None) -> dict[str, np.ndarray]:
    """The results as NumPy arrays named ``<placement>/<path>``, e.g. ``mesh/[0]['w1']``
    (params), ``mesh/[1].damping`` (state), ``mesh/stats/loss``."""
    leaves = jax.tree_util.tree_flatten_with_path((params, state))[0]
    named = {f"{placement}/{jax.tree_util.keystr(path)}": x for path, x in leaves}
    named.update({f"{placement}/stats/{key}": stats[key] for key in STATS if stats})
    return {name: np.asarray(x) for name, x in named.items()}


def main(process_id: int, num_processes: int, port: int, out: pathlib.Path) -> None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_enable_x64", True)
    jax.distributed.initialize(f"localhost:{port}", num_processes, process_id)
    inputs = np.load(out / "inputs.npz")
    params = {name: inputs[name] for name in ("w1", "b1", "w2", "b2")}
    results, checkpointer = {}, ocp.StandardCheckpointer()
    for placement in PLACEMENTS:
        opt, p, state, stats = train(placement, params, (inputs["x"], inputs["y"]))
        sharded = placement in SHARDED
        results.update(flat(placement, p, gathered(opt, state) if sharded else state, stats))
        # Mesh arrays are global (the sharded state's rows too); pmap's first copy is
        # local to each process, so it is saved as NumPy arrays (by the first process).
        tree = {"params": p, "state": state}
        if placement in ("mesh", "pmap", "sharded_state"):
            tree = jax.device_get(tree) if placement == "pmap" else tree
            checkpointer.save(out / f"ckpt_{placement}", tree)
    checkpointer.wait_until_finished()
    key = kfacx.parallel.make_different_rng_key_on_all_devices(jax.random.key(5))
    results["rng_keys"] = np.asarray(jax.random.key_data(key))
    np.savez(out / f"process_{process_id}.npz", **results)
    runpy.run_path(str(EXAMPLE))["train"](steps=3, batch_size=32, checkpoint=None)


if __name__ == "__main__":
    try:
        main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), pathlib.Path(sys.argv[4]))
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        # Exit now, so that the test sees the failure and stops the other process:
        # JAX's exit would wait minutes for it at the shutdown barrier.
        os._exit(1)
