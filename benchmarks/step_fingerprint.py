"""Fingerprints of the lowered K-FAC step, to show that a refactor changes no computation.

Lowers the deep autoencoder's step (the model, batch and options of
``vs_kfac_jax.py``) in several configurations and prints, for each, the sha256 of
its StableHLO text with source locations and the module name removed. Equal
fingerprints before and after a change mean XLA compiles the same program: step
time, compile time and memory cannot have moved, so the benchmarks need not be
rerun for that configuration. Only lowering is done (no XLA compilation): a few
seconds in all.

Configurations:

* ``standard`` / ``adaptive``: `kfacx.Optimizer`'s step on one device, as in
  ``vs_kfac_jax.py --config standard|adaptive``;
* ``pmap``: the standard step under `jax.pmap` over 2 CPU devices;
* ``mesh``: the standard step jit-compiled over a 2-device mesh;
* ``sharded``: the same with the curvature state sharded (``shard_curvature_state``);
* ``optax``: ``estimator.value_grads_and_curvature_stats`` followed by
  ``optax.chain(kfacx.scale_by_kfac(...), optax.sgd(...))``'s update.

Run:  python benchmarks/step_fingerprint.py [--show CONFIG]   (prints the text too)
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import sys

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
import vs_kfac_jax as v  # noqa: E402

import kfacx  # noqa: E402

_LOC = re.compile(r"\s*loc\(.*?\)$|^#loc.*$", re.MULTILINE)


def normalise(text: str) -> str:
    """StableHLO text without locations and with a fixed module name."""
    text = _LOC.sub("", text)
    return re.sub(r"^module @\S+", "module @step", text, count=1, flags=re.MULTILINE)


def _setup(config: str, **extra):
    loss_fn = v._make_loss(kfacx.register_sigmoid_cross_entropy_loss)
    batch = jnp.asarray(v._images())
    params = v.NET.init(jax.random.key(42), batch[:1])
    kwargs, values = v._options(config)
    opt = kfacx.Optimizer(value_and_grad_func=jax.value_and_grad(loss_fn), **kwargs, **extra)
    values = {k: jnp.float32(x) for k, x in values.items()}
    return loss_fn, opt, params, batch, values


def _step_text(config: str) -> str:
    _, opt, params, batch, values = _setup(config)
    state = opt.init(params, jax.random.key(0), batch)

    def step(p, s, r, b, vals):
        return opt.unstaged_step(p, s, r, b, **vals)

    return jax.jit(step).lower(params, state, jax.random.key(0), batch, values).as_text()


def _pmap_text() -> str:
    _, opt, params, batch, values = _setup("standard", multi_device=True)
    n = 2
    rep = lambda t: jax.tree.map(lambda x: jnp.stack([x] * n), t)  # noqa: E731
    batch = batch.reshape(n, -1, *batch.shape[1:])
    rngs = jax.random.split(jax.random.key(0), n)
    state = opt.init(rep(params), rngs, batch)

    def step(p, s, r, b, vals):
        return opt.unstaged_step(p, s, r, b, **vals)

    pmapped = jax.pmap(step, axis_name=opt.pmap_axis_name, in_axes=(0, 0, 0, 0, None))
    return pmapped.lower(rep(params), state, rngs, batch, values).as_text()


def _mesh_text(**extra) -> str:
    mesh = jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    _, opt, params, batch, values = _setup("standard", mesh=mesh, **extra)
    state = opt.init(params, jax.random.key(0), batch)
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    batch = jax.device_put(batch, sharding)

    def step(p, s, r, b, vals):
        return opt.unstaged_step(p, s, r, b, **vals)

    return jax.jit(step).lower(params, state, jax.random.key(0), batch, values).as_text()


def _optax_text() -> str:
    loss_fn, _, params, batch, _ = _setup("standard")
    est = kfacx.BlockDiagonalCurvature(loss_fn)
    tx = optax.chain(
        kfacx.scale_by_kfac(est, (params, batch), damping=1e-3),
        optax.sgd(learning_rate=0.1, momentum=0.9),
    )
    opt_state = tx.init(params)

    def step(p, s, r, b):
        loss, grads, stats = est.value_grads_and_curvature_stats(r, (p, b))
        updates, s = tx.update(grads, s, p, curvature_stats=stats)
        return optax.apply_updates(p, updates), s, loss

    return jax.jit(step).lower(params, opt_state, jax.random.key(0), batch).as_text()


CONFIGS = {
    "standard": lambda: _step_text("standard"),
    "adaptive": lambda: _step_text("adaptive"),
    "pmap": _pmap_text,
    "mesh": _mesh_text,
    "sharded": lambda: _mesh_text(shard_curvature_state=True),
    "optax": _optax_text,
}


def main(argv=None) -> dict[str, str]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--show", choices=sorted(CONFIGS), help="also print this module")
    parser.add_argument("--only", choices=sorted(CONFIGS), action="append")
    args = parser.parse_args(argv)
    out = {}
    for name in args.only or CONFIGS:
        text = normalise(CONFIGS[name]())
        out[name] = hashlib.sha256(text.encode()).hexdigest()[:16]
        print(f"{name:9s} {out[name]}  ({len(text):,} characters)", flush=True)
        if args.show == name:
            print(text)
    return out


if __name__ == "__main__":
    main()
