"""Several processes (multi-controller JAX, as on several hosts): 2 processes of 2 CPU
devices, joined with `jax.distributed` over gloo, each feeding only its own rows, take
the steps of this process with 4 devices, under the sharded jit, shard_map and pmap,
and with the curvature state sharded over the devices of both processes (sharded jit
and shard_map); their orbax checkpoints restore in one process.

The two processes run tests/_multiprocess_worker.py once for all the checks, and
then the training of examples/multiprocess.py.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import socket
import subprocess
import sys
import time

import _multiprocess_worker as worker
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from _optimizer_cases import make_batch, make_params, mlp_loss

import kfacx

ROOT = pathlib.Path(__file__).resolve().parents[2]
NUM_PROCESSES = 2
TIMEOUT_S = 240


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _worker_env() -> dict[str, str]:
    """This environment with 2 CPU devices a process (other XLA flags kept) and
    this checkout's kfacx first on the path."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    flags.append("--xla_force_host_platform_device_count=2")
    path = os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))
    return {**os.environ, "XLA_FLAGS": " ".join(flags), "JAX_PLATFORMS": "cpu", "PYTHONPATH": path}


def _start(out: pathlib.Path) -> list[tuple[subprocess.Popen, pathlib.Path]]:
    port, env = _free_port(), _worker_env()
    started = []
    for i in range(NUM_PROCESSES):
        log = out / f"process_{i}.log"
        args = [sys.executable, str(ROOT / "tests" / "_multiprocess_worker.py")]
        args += [str(i), str(NUM_PROCESSES), str(port), str(out)]
        with log.open("w") as f:
            started.append(
                (subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT, env=env), log)
            )
    return started


def _wait(started, timeout_s: float) -> None:
    """Waits for every process; if one fails or time runs out, stops them all and
    fails with their output."""
    procs = [proc for proc, _ in started]
    deadline = time.monotonic() + timeout_s
    while any(proc.poll() is None for proc in procs):
        failed = any(proc.returncode not in (None, 0) for proc in procs)
        if failed or time.monotonic() > deadline:
            break
        running = next(proc for proc in procs if proc.returncode is None)
        with contextlib.suppress(subprocess.TimeoutExpired):
            running.wait(timeout=0.5)
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if any(proc.returncode for proc in procs):
        logs = "\n".join(
            f"--- process {i} (exit {proc.returncode}):\n{log.read_text()[-6000:]}"
            for i, (proc, log) in enumerate(started)
        )
        pytest.fail(f"The worker processes failed or timed out ({timeout_s} s):\n{logs}")


def _run(out: pathlib.Path) -> dict:
    """The two processes' results, and this process's (4 devices) for the same steps."""
    with jax.enable_x64(True):
        params, (x, y) = jax.tree.map(np.float64, make_params()), make_batch(n=32)
        batch = (np.float64(x), np.asarray(y))
        np.savez(out / "inputs.npz", x=batch[0], y=batch[1], **params)
        started = _start(out)
        try:
            # While the two processes run: one process with 4 devices, under the sharded
            # jit (tests/parallel/test_distributed.py shows the placements agree to 1e-9 in
            # float64).
            # The sharded curvature state, read back per block, is the replicated one.
            one_process = worker.train("mesh", params, batch)[1:]
            want = {}
            for placement in worker.PLACEMENTS:
                want.update(worker.flat(placement, *one_process))
        finally:
            _wait(started, TIMEOUT_S)
    got = [dict(np.load(out / f"process_{i}.npz")) for i in range(NUM_PROCESSES)]
    log = (out / "process_0.log").read_text()
    return dict(out=out, params=params, batch=batch, want=want, got=got, log=log)


def _assert_equal_to_one_process(got: dict, want: dict, prefix: str, where: str) -> None:
    names = sorted(name for name in want if name.startswith(prefix))
    assert sorted(name for name in got if name.startswith(prefix)) == names, where
    for name in names:
        # float64 but for the float32 stats (e.g. the loss).
        rtol = 1e-9 if want[name].dtype == np.float64 else 1e-6
        np.testing.assert_allclose(
            got[name], want[name], rtol=rtol, atol=rtol * 1e-3, err_msg=f"{where}: {name}"
        )


def _check_steps(runs: dict, placement: str) -> None:
    """Each process ends with the parameters, state and stats of one process."""
    want = runs["want"]
    for i, got in enumerate(runs["got"]):
        _assert_equal_to_one_process(got, want, f"{placement}/", f"process {i}")
    assert int(want[f"{placement}/[1].step_counter"]) == worker.STEPS
    assert int(want[f"{placement}/[1].data_seen"]) == worker.STEPS * 32
    # The steps moved the parameters a fair way (the comparison is not vacuous).
    assert np.max(np.abs(want[f"{placement}/[0]['w1']"] - runs["params"]["w1"])) > 0.1


def _check_checkpoint(runs: dict, placement: str) -> None:
    """The checkpoint the two processes wrote restores here, on one device."""
    params, batch = runs["params"], runs["batch"]
    with jax.enable_x64(True):
        if placement == "sharded_state":  # onto this process's mesh of as many devices
            opt = worker.optimizer(placement)
        else:
            opt = kfacx.Optimizer(jax.value_and_grad(mlp_loss), **worker.OPTIONS)
        template = {"params": params, "state": opt.init(params, jax.random.key(7), batch)}
        restored = ocp.StandardCheckpointer().restore(runs["out"] / f"ckpt_{placement}", template)
        state = restored["state"]
        if placement == "sharded_state":
            assert not state.estimator_state.buffers[0].sharding.is_fully_replicated
            state = worker.gathered(opt, state)
        else:
            assert state.damping.sharding.device_set == {jax.devices()[0]}
    got = worker.flat(placement, restored["params"], state)
    _assert_equal_to_one_process(got, runs["want"], f"{placement}/[", f"restored {placement}")


def _check_keys(runs: dict) -> None:
    """`kfacx.parallel.make_different_rng_key_on_all_devices`: each process takes its
    slice of the keys of all devices, together the keys one process would get."""
    got = np.concatenate([process["rng_keys"] for process in runs["got"]])
    want = jax.random.key_data(jax.random.split(jax.random.key(5), 2 * NUM_PROCESSES))
    np.testing.assert_array_equal(got, want)


def _check_example(runs: dict) -> None:
    """examples/multiprocess.py's training (docs/scaling.md's recipe) ran in the two
    processes: the first printed its losses."""
    losses = [float(line.split()[-1]) for line in runs["log"].splitlines() if " loss " in line]
    assert len(losses) == 3, runs["log"]
    assert losses[-1] < losses[0], runs["log"]


def test_two_processes_of_two_devices_act_as_one_process_of_four(tmp_path):
    """One test, so that one pair of processes serves every check (pytest-xdist
    spreads the tests of a file over its workers, and each would start its own).

    - 10 adaptive steps under the sharded jit, shard_map and pmap, and the sharded
      jit with a sharded curvature state: the parameters, optimizer state and stats
      of one process with 4 devices;
    - the orbax checkpoints the two processes wrote (mesh: global arrays; pmap: the
      first copy as NumPy arrays; the sharded state's rows) restore in one process;
    - every device of every process gets its own rng key;
    - the example's training runs in the two processes.
    """
    runs = _run(tmp_path)
    for placement in worker.PLACEMENTS:
        _check_steps(runs, placement)
    for placement in ("mesh", "pmap", "sharded_state"):
        _check_checkpoint(runs, placement)
    _check_keys(runs)
    _check_example(runs)
