"""Shorter compilation: XLA options that trade a little run time for it, and JAX's
persistent compilation cache, which removes it from every run after the first."""

from __future__ import annotations

import functools
import os
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental.compilation_cache import compilation_cache as _jax_cache

#: The environment variable that names the cache directory of
#: `enable_compilation_cache` (before JAX's own ``JAX_COMPILATION_CACHE_DIR``).
CACHE_DIR_VARIABLE = "KFACX_COMPILATION_CACHE_DIR"

#: On the CPU: XLA's classic (not the MLIR) fusion emitters and one level less of LLVM
#: optimisation. Measured on the deep autoencoder's K-FAC step (2-core CPU, jax 0.10.2):
#: XLA compilation 6.3-6.5 s -> 3.6 s, step time +2-3 % at first; later, with a smaller
#: step, 4.6-4.8 s -> 2.5-3.0 s and step time +9 % (docs/benchmarks.md).
_CPU_FAST_COMPILE = {"xla_cpu_use_fusion_emitters": False, "xla_backend_optimization_level": 1}


def fast_compile_options(platform: str | None = None) -> dict[str, Any]:
    """XLA options that compile a K-FAC step faster, for ``platform`` (default: JAX's
    default backend); ``{}`` where kfacx knows none or this jaxlib does not take them.

    On the CPU they cut the compilation of a step by about 40 % and slow each step by
    up to about 10 %: worth it for short runs and interactive work, not for runs of
    more than about a hundred steps. Across runs, JAX's persistent compilation cache
    (``jax_compilation_cache_dir``) removes the compilation instead. Pass them as
    ``kfacx.Optimizer(..., compiler_options=kfacx.fast_compile_options())``, or to your
    own ``jax.jit`` of a step that uses `kfacx.scale_by_kfac` (``jax.jit(step,
    compiler_options=...)``).
    """
    platform = jax.default_backend() if platform is None else platform
    if platform != "cpu" or not _cpu_accepts_fast_compile():
        return {}
    return dict(_CPU_FAST_COMPILE)


def _cpu_accepts_fast_compile() -> bool:
    return cpu_accepts(tuple(_CPU_FAST_COMPILE.items()))


@functools.cache
def cpu_accepts(options: tuple[tuple[str, Any], ...]) -> bool:
    """Whether this jaxlib's CPU compiler knows ``options`` (``(name, value)`` pairs;
    XLA rejects unknown ones at compile time: jaxlib 0.12 dropped
    ``xla_cpu_use_fusion_emitters``, the classic emitters with it)."""
    try:
        x = jax.device_put(jnp.zeros(()), jax.devices("cpu")[0])
        jax.jit(lambda y: y + 1, compiler_options=dict(options)).lower(x).compile()
    except jax.errors.JaxRuntimeError:
        return False
    return True


#: XLA options for one-off programs (detection's numerical checks): compile fast,
#: run slow (they run once).
_ONE_OFF = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def one_off_compile_options(platform: str | None = None) -> dict[str, Any]:
    """XLA options for a small program that runs once on ``platform`` (default: JAX's
    default backend): fastest compilation."""
    # On the CPU, the classic fusion emitters halve such a program's compilation (~28 ->
    # ~15 ms); jaxlib 0.12 has none (and rejects the option).
    classic = (("xla_cpu_use_fusion_emitters", False),)
    platform = jax.default_backend() if platform is None else platform
    if platform == "cpu" and cpu_accepts(classic):
        return {**dict(classic), **_ONE_OFF}
    return dict(_ONE_OFF)


def host_device() -> Any:
    """This process' first CPU device, or None where JAX has no CPU backend
    (``JAX_PLATFORMS`` without ``cpu``). Local: in a multi-process run, ``jax.devices``
    lists the other processes' devices too."""
    try:
        return jax.local_devices(backend="cpu")[0]
    except RuntimeError:
        return None


def run_once(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` compiled and run once, on the host's CPU where JAX has one.

    For small programs that answer a question about a model (detection's numerical
    checks): on an accelerator each new program costs far more to compile (a GPU's
    compiler autotunes its matrix products) and may compute its products at a lower
    precision than the check's tolerance assumes. ``fn`` is traced in a context of its
    own, so it runs now even when called while another function is being traced, and
    its constant parts stay inside its one program.
    """
    device = host_device()
    sharding = None if device is None else jax.sharding.SingleDeviceSharding(device)
    platform = None if device is None else device.platform
    jitted = jax.jit(fn, in_shardings=sharding, compiler_options=one_off_compile_options(platform))
    return jitted.lower(*args).compile()(*args)


def default_cache_dir(environ: Any = None) -> str:
    """The directory `enable_compilation_cache` uses when it is given none: the
    environment's ``KFACX_COMPILATION_CACHE_DIR``, else the directory JAX is already
    configured with (``jax_compilation_cache_dir``, e.g. from ``JAX_COMPILATION_CACHE_DIR``),
    else ``$XDG_CACHE_HOME/kfacx/jax`` (``~/.cache/kfacx/jax`` without ``XDG_CACHE_HOME``)."""
    environ = os.environ if environ is None else environ
    if environ.get(CACHE_DIR_VARIABLE):
        return environ[CACHE_DIR_VARIABLE]
    configured = jax.config.jax_compilation_cache_dir
    if configured:
        return str(configured)
    root = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "kfacx", "jax")


def enable_compilation_cache(
    directory: str | os.PathLike | None = None, *, min_compile_time_secs: float = 0.5
) -> str:
    """Turns on JAX's persistent compilation cache; returns its directory.

    ``kfacx.enable_compilation_cache()`` at the top of a training script, and every run
    after the first loads its compiled K-FAC step from disk instead of compiling it:
    kfacx lowers a step to the same module in every process, so the cache key does not
    change between runs (the README example's ``init`` and first step: 8.5 s cold,
    2.8 s warm, on a 2-core CPU; ``benchmarks/cold_warm.py``). It takes effect for the
    next compilation, also after earlier ones in this process.

    Args:
      directory: where the compiled programs go (created if missing); a local path or
        any path JAX's cache takes (e.g. ``gs://...``). Default: `default_cache_dir`.
      min_compile_time_secs: programs that compile faster than this are not written
        (writing every small eager operation costs more than it saves); JAX's own
        default is 1 s.
    """
    if directory is None:
        directory = default_cache_dir()
    elif not isinstance(directory, (str, os.PathLike)):
        raise TypeError(
            "enable_compilation_cache(directory=...) takes a path (str or os.PathLike), "
            f"got {type(directory).__name__}."
        )
    directory = os.fspath(directory)
    if not directory:
        raise ValueError("enable_compilation_cache(directory='') names no directory.")
    if isinstance(min_compile_time_secs, bool) or not isinstance(
        min_compile_time_secs, (int, float)
    ):
        raise TypeError(
            "enable_compilation_cache(min_compile_time_secs=...) takes a number of "
            f"seconds, got {min_compile_time_secs!r}."
        )
    if not min_compile_time_secs >= 0:
        raise ValueError(
            "enable_compilation_cache(min_compile_time_secs=...) must be >= 0, got "
            f"{min_compile_time_secs!r}."
        )
    if "://" not in directory:
        os.makedirs(directory, exist_ok=True)
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_time_secs))
    # JAX opens its cache at the first compilation of the process; reopen it here.
    _jax_cache.reset_cache()
    return directory
