"""Several processes, as on several hosts: one kfacx.Optimizer over the devices of all.

Every process runs this same script (multi-controller JAX). It joins the others
with `jax.distributed.initialize`, builds one mesh over the devices of all
processes and feeds only its own rows of each global batch; the optimizer's
sharded step averages over all of them, and every process holds the same
(replicated) parameters and optimizer state.

Run:
  python examples/multiprocess.py                    # 2 processes on this machine
  python examples/multiprocess.py --num-processes 4  # 4 processes, 2 CPU devices each
  python examples/multiprocess.py --cluster          # in each process of a cluster job

Without ``--cluster`` the script starts the processes itself, on this machine: each
gets 2 CPU devices, and they talk over gloo (JAX's CPU collectives). With
``--cluster`` your job scheduler starts one process per host (SLURM, Open MPI,
Kubernetes, a Cloud TPU pod...) and ``jax.distributed.initialize()`` finds the
others from the environment. ``--checkpoint DIR`` writes an orbax checkpoint at
the end, from all processes (on a cluster, DIR must be on a shared file system).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import subprocess
import sys

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec

import kfacx

net = hk.without_apply_rng(hk.transform(lambda x: hk.nets.MLP([64, 4])(x)))


def loss_fn(params, batch):
    x, labels = batch
    logits = kfacx.register_softmax_cross_entropy_loss(net.apply(params, x), labels)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))


def dataset(n: int = 4096, dim: int = 16, seed: int = 0):
    """A toy data set, the same in every process: 4 classes from a random teacher."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, dim)).astype(np.float32)
    labels = np.argmax(np.tanh(x @ rng.standard_normal((dim, 4))), axis=1).astype(np.int32)
    return x, labels


def train(steps: int, batch_size: int, checkpoint: str | None) -> None:
    """Trains on the devices of all processes; process 0 prints the loss.

    Raises:
      ValueError: if the devices of all processes do not divide ``batch_size``.
    """
    if batch_size % jax.device_count():
        raise ValueError(
            f"--batch-size {batch_size} must divide over the {jax.device_count()} devices."
        )
    # [multihost]
    mesh = jax.make_mesh((jax.device_count(),), ("data",))  # the devices of all processes
    rows = NamedSharding(mesh, PartitionSpec("data"))
    x, labels = dataset()  # On a cluster, each process would read only its own part.
    per_process = batch_size // jax.process_count()

    def batch_at(step):
        """The global batch of ``step``, of which this process gives its own rows."""
        start = step % (len(x) // batch_size) * batch_size + jax.process_index() * per_process
        local = (x[start : start + per_process], labels[start : start + per_process])
        return tuple(jax.make_array_from_process_local_data(rows, a) for a in local)

    optimizer = kfacx.Optimizer(
        jax.value_and_grad(loss_fn),
        mesh=mesh,
        use_adaptive_learning_rate=True,
        use_adaptive_momentum=True,
        use_adaptive_damping=True,
        initial_damping=1.0,
        num_burnin_steps=1,
    )
    params = net.init(jax.random.key(0), x[:1])  # The same in every process.
    state = optimizer.init(params, jax.random.key(1), batch_at(0))
    for step in range(steps):
        params, state, stats = optimizer.step(params, state, jax.random.key(step), batch_at(step))
        if jax.process_index() == 0:
            print(f"step {step:3d}  loss {float(stats['loss']):.4f}", flush=True)
    # [/multihost]
    if checkpoint:
        checkpointer = ocp.StandardCheckpointer()  # every process takes part
        checkpointer.save(os.path.abspath(checkpoint), {"params": params, "state": state})
        checkpointer.wait_until_finished()
        if jax.process_index() == 0:
            print(f"checkpoint written to {checkpoint}")


def launch(num_processes: int, argv: list[str]) -> int:
    """Starts ``num_processes`` copies of this script with arguments ``argv`` on this
    machine, each with 2 CPU devices; returns the first non-zero exit code (0 if all
    succeed)."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        coordinator = f"localhost:{s.getsockname()[1]}"
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    flags.append("--xla_force_host_platform_device_count=2")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": " ".join(flags)}
    processes = [
        subprocess.Popen(
            # The options added last override any given in argv.
            [sys.executable, __file__, *argv, "--coordinator", coordinator]
            + ["--num-processes", str(num_processes), "--process-id", str(i)],
            env=env,
        )
        for i in range(num_processes)
    ]
    return wait(processes)


def wait(processes: list[subprocess.Popen]) -> int:
    """Waits for all processes; when one fails, stops the others (they would wait for
    it in the next collective) and returns its exit code."""
    while any(p.poll() is None for p in processes):
        failed = [p.returncode for p in processes if p.returncode]
        if failed:
            for p in processes:
                p.kill()
            return failed[0]
        with contextlib.suppress(subprocess.TimeoutExpired):
            next(p for p in processes if p.returncode is None).wait(timeout=1)
    return next((p.returncode for p in processes if p.returncode), 0)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=256, help="the global batch")
    parser.add_argument("--checkpoint", help="write an orbax checkpoint to this folder")
    parser.add_argument("--num-processes", type=int, default=2)
    parser.add_argument("--cluster", action="store_true", help="jax.distributed.initialize()")
    parser.add_argument("--process-id", type=int, help=argparse.SUPPRESS)  # set by launch
    parser.add_argument("--coordinator", help=argparse.SUPPRESS)  # set by launch
    args = parser.parse_args()

    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU devices only
    if args.cluster:
        jax.distributed.initialize()  # Processes and coordinator from the environment.
    elif args.process_id is None:
        sys.exit(launch(args.num_processes, sys.argv[1:]))
    else:
        jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    train(args.steps, args.batch_size, args.checkpoint)


if __name__ == "__main__":
    main()
