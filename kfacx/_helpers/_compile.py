"""XLA options that trade a little run time for a much shorter compilation."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

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
