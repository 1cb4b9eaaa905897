"""The compiled K-FAC step's kernel count, guarded against regressions.

On an accelerator a step of many small kernels is launch-bound, so the number of
kernels XLA runs is a cost of its own (`benchmarks/kernels.py` measures it on the
benchmark models). Here: the deep autoencoder's shape (eight dense layers, sigmoid
cross-entropy) at small widths, with the README's settings, on the CPU. The bounds are
today's counts plus a little slack: a change that adds kernels to the step must lower
them (and say so), one that removes kernels should lower them too.
"""

from __future__ import annotations

import pathlib
import sys

import jax
import jax.numpy as jnp
import optax
import pytest

import kfacx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import kernels  # noqa: E402

WIDTHS = (24, 20, 16, 8, 16, 20, 24, 28)
BATCH = 16
#: Kernels of the whole step (the refresh in its conditional, so both are counted): 567
#: at the time of writing (jaxlib 0.10.2's CPU backend, the suite's XLA options; Adam's
#: step 100), with 3% slack for other jaxlib releases. It was 750 before the step drew its
#: keys with 2 threefry calls instead of 5 (each a loop of about 25 kernels on the CPU),
#: 678 before the non-finite guard chose the small leaves by selects instead of a
#: conditional (one device only, `kfacx._helpers._tree.keep_unless`), and 592 before a
#: model that takes no key stopped costing a key split (`BatchPasses.chunk_keys`).
MAX_STEP = 585


def _params(seed=0):
    keys = jax.random.split(jax.random.key(seed), len(WIDTHS))
    params, fan_in = {}, WIDTHS[-1]
    for i, (key, width) in enumerate(zip(keys, WIDTHS, strict=True)):
        params[f"layer_{i}"] = {
            "w": jax.random.normal(key, (fan_in, width)) / jnp.sqrt(fan_in),
            "b": jnp.zeros((width,)),
        }
        fan_in = width
    return params


def loss_fn(params, images):
    x = images
    for i in range(len(WIDTHS)):
        layer = params[f"layer_{i}"]
        x = x @ layer["w"] + layer["b"][None]
        if i < len(WIDTHS) - 1:
            x = jnp.tanh(x)
    kfacx.register_sigmoid_cross_entropy_loss(x, images)
    return jnp.mean(jnp.sum(optax.sigmoid_binary_cross_entropy(x, images), axis=-1))


@pytest.fixture(scope="module")
def counts():
    images = jax.nn.sigmoid(jax.random.normal(jax.random.key(1), (BATCH, WIDTHS[-1])))
    params = _params()
    opt = kernels.readme_optimizer(loss_fn)
    state = opt.init(params, jax.random.key(0), images)
    args = (params, state, jax.random.key(0), images)

    def compiled(fn, *a):
        return jax.jit(fn).lower(*a).compile()

    def compiled_kernels(fn, *a):
        return kernels.count_kernels(compiled(fn, *a).as_text())

    step = compiled_kernels(lambda *a: opt.unstaged_step(*a), *args)
    tx, adam_step = kernels._adam(loss_fn, False)
    adam = compiled_kernels(adam_step, params, tx.init(params), images)
    # The same step given keys of JAX's rbg implementation (docs/quickstart.md).
    rbg = jax.random.key(0, impl="rbg")
    rbg_state = opt.init(params, rbg, images)
    rbg_step = compiled(lambda *a: opt.unstaged_step(*a), params, rbg_state, rbg, images)
    new_params, _, stats = rbg_step(params, rbg_state, jax.random.fold_in(rbg, 1), images)
    return dict(
        step=step,
        adam=adam,
        rbg_step=kernels.count_kernels(rbg_step.as_text()),
        rbg_out=(new_params, stats),
        params=params,
    )


def test_the_step_has_no_more_kernels_than_it_had(counts):
    assert counts["adam"] < counts["step"] <= MAX_STEP, counts


def test_an_rbg_key_samples_with_fewer_kernels_and_the_step_runs(counts):
    """The curvature's sampled targets are drawn with the key passed to the step; an rbg
    key makes them one random-bit kernel instead of threefry's rounds."""
    assert counts["adam"] < counts["rbg_step"] < counts["step"], counts
    new_params, stats = counts["rbg_out"]
    assert not bool(stats["skipped"]) and bool(jnp.isfinite(stats["loss"]))
    moved = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), new_params, counts["params"])
    assert max(jax.tree.leaves(moved)) > 0


def test_count_kernels_follows_loops_and_branches():
    def fn(x):
        y = jax.lax.fori_loop(0, 3, lambda i, v: jnp.sin(v) * 2.0, x)
        return jax.lax.cond(y.sum() > 0, lambda v: jnp.exp(v) + 1.0, lambda v: v, y)

    text = jax.jit(fn).lower(jnp.ones(5)).compile().as_text()
    with_bodies = kernels.count_kernels(text)
    entry_only = sum(
        1
        for line in text.split("ENTRY", 1)[1].splitlines()[1:]
        if kernels._INSTRUCTION.match(line)
        and kernels._INSTRUCTION.match(line).group(1) not in kernels.FREE
    )
    assert with_bodies > entry_only >= 2
