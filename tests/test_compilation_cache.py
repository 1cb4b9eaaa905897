"""JAX's persistent compilation cache serves kfacx's step in a new process.

The cache key is a hash of the lowered module: anything that changes between
processes (an ``id()`` in a name, the iteration order of a ``set`` of strings,
which Python's hash seed changes) would make every process compile afresh, as
kfac-jax 0.0.8's step does (docs/benchmarks.md). The cache is turned on with
`kfacx.enable_compilation_cache`, after a first compilation of the process.
"""

import os
import subprocess
import sys
import textwrap

import jax
import pytest

import kfacx
from kfacx._helpers import _compile

SCRIPT = textwrap.dedent(
    """
    import sys
    import jax, jax.numpy as jnp, optax
    import kfacx
    # The one-liner, after a first compilation (it must still take effect).
    jax.jit(lambda x: x + 1)(1.0)
    kfacx.enable_compilation_cache(sys.argv[1], min_compile_time_secs=0.0)

    def loss_fn(params, batch):
        x, labels = batch
        h = jnp.tanh(x @ params["w1"] + params["b1"])
        logits = kfacx.register_softmax_cross_entropy_loss(h @ params["w2"], labels)
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))

    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    params = {"w1": jax.random.normal(k1, (6, 5)), "b1": jnp.zeros(5),
              "w2": jax.random.normal(k2, (5, 3))}
    batch = (jax.random.normal(k3, (8, 6)), jnp.arange(8) % 3)
    opt = kfacx.Optimizer(jax.value_and_grad(loss_fn), l2_reg=1e-4,
                          use_adaptive_learning_rate=True, use_adaptive_momentum=True,
                          use_adaptive_damping=True, initial_damping=1.0)
    state = opt.init(params, jax.random.key(1), batch)
    params, state, stats = opt.step(params, state, jax.random.key(2), batch)
    assert bool(jnp.isfinite(stats["loss"]))
    """
)


def _run(cache_dir, hash_seed):
    env = dict(os.environ, PYTHONHASHSEED=str(hash_seed), JAX_PLATFORMS="cpu")
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(cache_dir)],
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]


def test_second_process_compiles_nothing(tmp_path):
    cache = tmp_path / "made" / "by" / "enable_compilation_cache"
    _run(cache, 1)
    first = sorted(os.listdir(cache))
    assert any(name.startswith("jit_") for name in first), first
    _run(cache, 2)  # another hash seed: set and dict orders of strings change
    new = sorted(set(os.listdir(cache)) - set(first))
    assert not new, f"compiled again in a second process (cache keys changed): {new}"


def test_default_cache_dir_follows_the_environment_then_jax_then_xdg():
    env = {"KFACX_COMPILATION_CACHE_DIR": "/a/b", "XDG_CACHE_HOME": "/x"}
    assert _compile.default_cache_dir(env) == "/a/b"
    before = jax.config.jax_compilation_cache_dir
    try:
        jax.config.update("jax_compilation_cache_dir", "/from/jax")
        assert _compile.default_cache_dir({"XDG_CACHE_HOME": "/x"}) == "/from/jax"
        jax.config.update("jax_compilation_cache_dir", None)
        assert _compile.default_cache_dir({"XDG_CACHE_HOME": "/x"}) == "/x/kfacx/jax"
        home = os.path.join(os.path.expanduser("~"), ".cache", "kfacx", "jax")
        assert _compile.default_cache_dir({}) == home
    finally:
        jax.config.update("jax_compilation_cache_dir", before)


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        (dict(directory=3), TypeError, "takes a path"),
        (dict(directory=""), ValueError, "names no directory"),
        (dict(directory="/tmp", min_compile_time_secs="1"), TypeError, "number of seconds"),
        (dict(directory="/tmp", min_compile_time_secs=True), TypeError, "number of seconds"),
        (dict(directory="/tmp", min_compile_time_secs=-1.0), ValueError, ">= 0"),
    ],
)
def test_enable_compilation_cache_rejects_bad_arguments(kwargs, error, words):
    before = jax.config.jax_compilation_cache_dir
    with pytest.raises(error, match=words):
        kfacx.enable_compilation_cache(**kwargs)
    assert jax.config.jax_compilation_cache_dir == before  # nothing was changed
