"""Timing shared by the benchmark scripts."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import jax


def median_seconds(fn: Callable[[Any], Any], arg: Any, repeats: int) -> float:
    """Median seconds of ``fn(arg)`` over ``repeats`` calls, each waited for, after one
    call that compiles it."""
    jax.block_until_ready(fn(arg))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(arg))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
