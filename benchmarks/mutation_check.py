"""Mutation check: seeds one bug at a time into a copy of the package and checks that
the tests meant to catch it fail.

Each mutation replaces one exact string of one module (the script stops if the string
is gone, so a refactor cannot silently turn a mutation into a no-op) and runs the test
files that cover that code. A mutation no test catches is reported as SURVIVED and the
script exits 1.

  python benchmarks/mutation_check.py            # all mutations
  python benchmarks/mutation_check.py ema sink   # those whose names contain a word
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass(frozen=True)
class Mutation:
    name: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]


MUTATIONS = (
    Mutation(
        "damping floor dropped",
        "kfacx/linalg/_damping.py",
        "return jnp.maximum(jnp.asarray(info.eps, trace.dtype) * trace, floor)",
        "return jnp.zeros_like(trace)",
        (
            "tests/linalg/test_linalg.py",
            "tests/linalg/test_linalg_robustness.py",
            "tests/linalg/test_linalg_batched.py",
            "tests/blocks/test_robustness.py",
        ),
    ),
    Mutation(
        "inverse ignores the damping",
        "kfacx/linalg/_inverse.py",
        "        return _floored_inverse(m, d).astype(dtype)",
        "        return _floored_inverse(m, d * 0 + d.dtype.type(1e-6)).astype(dtype)",
        (
            "tests/linalg/test_linalg.py",
            "tests/linalg/test_linalg_robustness.py",
            "tests/linalg/test_linalg_batched.py",
        ),
    ),
    Mutation(
        "Levenberg-Marquardt rule inverted",
        "kfacx/optimizer/_damping.py",
        "d = jnp.where(ratio < config.damping_lower_threshold, d / decay, d)",
        "d = jnp.where(ratio < config.damping_lower_threshold, d * decay, d)",
        ("tests/optimizer/test_damping.py",),
    ),
    Mutation(
        "non-finite guard ignores the update",
        "kfacx/optimizer/_step.py",
        "checked = (loss, grad_sq, update_sq, new_state.damping, positive, stats.blocks)",
        "checked = (loss, grad_sq, new_state.damping, positive, stats.blocks)",
        ("tests/test_bad_inputs.py",),
    ),
    Mutation(
        "device mean not weighted by batch size",
        "kfacx/parallel/_reductions.py",
        "jax.lax.psum(s * weight.astype(s.dtype), axis_name) / safe.astype(s.dtype)",
        "jax.lax.pmean(s, axis_name)",
        ("tests/parallel/test_reductions.py",),
    ),
    Mutation(
        "partial coverage moving average",
        "kfacx/estimator/_statistics.py",
        "old = jnp.where(c < 1, 1 - c * (1 - ema_old), ema_old)",
        "old = ema_old",
        (
            "tests/tracer/test_control_flow.py",
            "tests/estimator/test_estimator.py",
            "tests/estimator/test_estimator_products.py",
            "tests/estimator/test_estimator_blocks.py",
            "tests/estimator/test_estimator_errors.py",
        ),
    ),
    Mutation(
        "scan fold order",
        "kfacx/tracer/_layer_data.py",
        "            a = jnp.moveaxis(a, offset + level, offset)",
        "            a = jnp.moveaxis(a, offset + level, -1)",
        ("tests/tracer/test_layer_data.py", "tests/tracer/test_nested_scans.py"),
    ),
    Mutation(
        "scan reverse ignored",
        "kfacx/_helpers/_jaxpr/_sites.py",
        'reverse=params["reverse"],',
        "reverse=False,",
        (
            "tests/tracer/test_tracer.py",
            "tests/graph_matcher/test_scan.py",
            "tests/graph_matcher/test_scan_unsupported.py",
        ),
    ),
    Mutation(
        "cond: untaken branch counted as taken",
        "kfacx/_helpers/_jaxpr/_sites.py",
        "lambda a: jnp.zeros(a.shape, a.dtype), s)",
        "lambda a: jnp.ones(a.shape, a.dtype), s)",
        ("tests/tracer/test_control_flow.py",),
    ),
    Mutation(
        "casts not sunk into calls",
        "kfacx/_helpers/_jaxpr/_passes.py",
        "    jaxpr = _sink(closed.jaxpr)\n",
        "    jaxpr = closed.jaxpr\n",
        ("tests/_helpers/test_jaxpr.py", "tests/test_modern_architectures.py"),
    ),
    Mutation(
        "tied use of the same kind not counted",
        "kfacx/tracer/_tied_layers.py",
        "role = dataclasses.replace(role, num_uses=role.num_uses + info.num_uses)",
        "role = dataclasses.replace(role, num_uses=role.num_uses)",
        ("tests/tracer/test_tied_layers.py", "tests/graph_matcher/test_tied_weights.py"),
    ),
    Mutation(
        "scale_by_kfac ignores its damping schedule",
        "kfacx/transform/__init__.py",
        "jnp.asarray(damping_fn(state.count)),",
        "jnp.asarray(damping_fn(0)),",
        (
            "tests/transform/test_optax.py",
            "tests/transform/test_optax_microbatches.py",
            "tests/transform/test_optax_multidevice.py",
        ),
    ),
)


def _run(mutation: Mutation, tree: str) -> tuple[bool, float]:
    """Whether a test fails with the mutation applied in ``tree`` (pytest's exit code 1:
    a collection error or a crash does not count); the seconds taken."""
    path = os.path.join(tree, mutation.path)
    with open(path) as f:
        source = f.read()
    if source.count(mutation.old) != 1:
        raise SystemExit(f"{mutation.name}: {mutation.old!r} is not once in {mutation.path}")
    with open(path, "w") as f:
        f.write(source.replace(mutation.old, mutation.new))
    try:
        start = time.perf_counter()
        env = dict(os.environ, PYTHONPATH=tree)
        cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider"]
        done = subprocess.run([*cmd, *mutation.tests], cwd=tree, env=env, capture_output=True)
        return done.returncode == 1, time.perf_counter() - start
    finally:
        with open(path, "w") as f:
            f.write(source)


def main(words: list[str]) -> int:
    chosen = [m for m in MUTATIONS if not words or any(w in m.name for w in words)]
    survived = 0
    with tempfile.TemporaryDirectory() as tmp:
        tree = os.path.join(tmp, "tree")
        shutil.copytree(ROOT, tree, ignore=shutil.ignore_patterns(".venv", ".git", "_build"))
        for m in chosen:
            caught, seconds = _run(m, tree)
            survived += not caught
            print(f"{'caught  ' if caught else 'SURVIVED'} {seconds:6.1f} s  {m.name}", flush=True)
    print(f"{len(chosen) - survived}/{len(chosen)} mutations caught")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
