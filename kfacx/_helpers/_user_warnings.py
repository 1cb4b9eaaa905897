"""Warnings at the user's line, each said once.

kfacx warns while it traces the user's function: at `kfacx.Optimizer.init`, and
again inside a compiled step when new argument shapes make JAX trace it anew
(e.g. batch-norm statistics that change shape after the first update). `warn`
points the warning at the first stack frame outside kfacx and the libraries
around it (JAX, optax, Flax, Haiku, Equinox), i.e. the user's call, and `said_once`
keeps a second trace from repeating what the first one said.
"""

from __future__ import annotations

import contextlib
import contextvars
import pathlib
import sys
import warnings
from collections.abc import Iterator

_KFACX_DIR = str(pathlib.Path(__file__).resolve().parents[1])  # the kfacx package

#: Packages whose frames sit between the user's call and kfacx's warning.
_WRAPPERS = ("jax", "jaxlib", "optax", "flax", "haiku", "equinox", "chex")

_SEEN: contextvars.ContextVar[set[str] | None] = contextvars.ContextVar("kfacx_seen", default=None)


def _library_dirs() -> tuple[str, ...]:
    dirs = [_KFACX_DIR]
    for name in _WRAPPERS:
        module = sys.modules.get(name)
        path = getattr(module, "__file__", None)
        if path:
            dirs.append(str(pathlib.Path(path).resolve().parent))
    return tuple(dirs)


def warn(message: str) -> None:
    """Warns ``message`` (a `UserWarning`) at the user's line, unless `said_once` has
    seen it already."""
    seen = _SEEN.get()
    if seen is not None:
        if message in seen:
            return
        seen.add(message)
    dirs = _library_dirs()
    frame, level = sys._getframe(1), 2
    while frame is not None and frame.f_code.co_filename.startswith(dirs):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, stacklevel=level)


@contextlib.contextmanager
def said_once(seen: set[str]) -> Iterator[None]:
    """Within the block, `warn` skips the messages in ``seen`` and adds the others."""
    token = _SEEN.set(seen)
    try:
        yield
    finally:
        _SEEN.reset(token)
