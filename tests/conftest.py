"""Test configuration: 4 CPU devices, fast XLA compilation, one compilation cache per run.

Most of the suite's time is XLA compiling small K-FAC steps (a warm compilation
cache runs tests/optimizer/test_optimizer.py in a fifth of the time of a cold one), so:

* every compilation uses XLA's classic CPU fusion emitters (jaxlib < 0.12) and LLVM optimisation
  level 0 (XLA's defaults: the MLIR emitters and level 2): the suite takes about half
  the CPU time, and every tolerance still holds (tests that compare against XLA's own
  defaults pass them as ``compiler_options``);
* LLVM code generation runs as one piece, not split for threads (the xdist workers
  keep both cores busy already): a K-FAC step compiles in about 15% less time, to
  the same code;
* the xdist workers share one JAX compilation cache, made fresh for the run, so a
  program that several tests compile is compiled once; programs that compile in under
  50 ms are not written to it (writing every eager operation's program cost more than
  the hits saved: about 4% of the suite's time);
* Python's cyclic garbage collector runs rarely: a worker holds about a million objects
  (JAX's caches of traced and compiled programs), and with Python's default thresholds
  it scanned them all about twenty times per worker in the optimizer, blocks and
  graph-matcher tests alone (10 s of CPU per worker); the objects alive after
  collection are frozen out of its scans. The whole suite: 3-5% less time.

``KFACX_TEST_XLA_DEFAULTS=1`` runs the suite with XLA's default options and no cache.
"""

import atexit
import gc
import importlib.metadata
import os
import shutil
import sys
import tempfile

# Bytecode is cached even where the environment says not to (PYTHONDONTWRITEBYTECODE,
# as on this project's CI machines): otherwise every xdist worker and every subprocess
# a test starts compiles JAX, Flax, the tests and kfacx from source again (about 11 s
# of CPU for each process that collects the suite).
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

_DEVICES = "--xla_force_host_platform_device_count=4"
_FAST = "--xla_backend_optimization_level=0 --xla_cpu_parallel_codegen_split_count=1"
if tuple(int(p) for p in importlib.metadata.version("jaxlib").split(".")[:2]) < (0, 12):
    # jaxlib 0.12 has no classic emitters, and XLA stops at an unknown flag.
    _FAST = f"--xla_cpu_use_fusion_emitters=false {_FAST}"
_CACHE = "KFACX_TEST_COMPILATION_CACHE"

# Must happen before JAX is imported anywhere. The environment reaches the xdist
# workers and the examples' subprocesses too.
_flags = os.environ.get("XLA_FLAGS", "")
if _DEVICES not in _flags:
    _flags = f"{_flags} {_DEVICES}"
if os.environ.get("KFACX_TEST_XLA_DEFAULTS") != "1" and _FAST not in _flags:
    _flags = f"{_flags} {_FAST}"
os.environ["XLA_FLAGS"] = _flags.strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

if os.environ.get("KFACX_TEST_XLA_DEFAULTS") != "1" and _CACHE not in os.environ:
    # The controller (or a run without xdist) makes the cache; workers inherit it.
    os.environ[_CACHE] = tempfile.mkdtemp(prefix="kfacx-test-jax-cache-")
    atexit.register(shutil.rmtree, os.environ[_CACHE], ignore_errors=True)

# The examples turn on the persistent compilation cache (`kfacx.enable_compilation_cache`);
# under the tests they use the run's own cache, or a throwaway one, never ~/.cache.
if "KFACX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["KFACX_COMPILATION_CACHE_DIR"] = os.environ.get(_CACHE) or tempfile.mkdtemp(
        prefix="kfacx-test-examples-cache-"
    )
    if _CACHE not in os.environ:
        atexit.register(
            shutil.rmtree, os.environ["KFACX_COMPILATION_CACHE_DIR"], ignore_errors=True
        )

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
if _CACHE in os.environ:
    jax.config.update("jax_compilation_cache_dir", os.environ[_CACHE])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.05)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


#: Test files whose tests each take tens of seconds (examples and docs snippets run in
#: subprocesses): started first, so that no worker is left with one of them at the end.
_SLOW_FIRST = (
    "test_examples.py",
    "test_examples_extra.py",
    "test_docs.py",
    "test_multiprocess.py",
)


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.path.name not in _SLOW_FIRST)


# A young collection after 100,000 net allocations (Python's default: 700), a full one
# after 1,000 of those, if the long-lived objects have grown by a quarter since the last.
# Garbage is still freed: the largest worker's memory stays the same (about 3.5 GB).
gc.set_threshold(100_000, 50, 1_000)


def pytest_collection_finish():
    """The modules, tests and fixtures collected live until the end: out of the scans."""
    gc.collect()
    gc.freeze()


@pytest.hookimpl(tryfirst=True)
def pytest_unconfigure(config):
    """An xdist worker has sent its results (when the run finishes): it ends here, without
    the interpreter's teardown (pytest's final garbage collection and JAX's freeing of
    every cached program: about 7 s per worker after a whole run, checking nothing)."""
    if hasattr(config, "workerinput"):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
