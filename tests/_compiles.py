"""Counting the programs XLA compiles while a function runs (for tests that guard
against needless compilations)."""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import jax


def compiled_programs(fn: Callable[[], Any]) -> tuple[Any, collections.Counter]:
    """``(fn(), how many times each program was compiled meanwhile, by name)``."""
    compiled: collections.Counter = collections.Counter()

    def listen(name, duration, **kwargs):
        if name.endswith("backend_compile_duration"):
            compiled[str(kwargs.get("fun_name"))] += 1

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        result = fn()
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    return result, compiled
