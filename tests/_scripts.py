"""Runs an example script in the test process, as ``python <script> <args>`` would.

A new process would import JAX, Haiku, optax and matplotlib again (2 to 3 s of CPU
for each script run); here the script runs as ``__main__`` with `runpy`, from its own
folder on ``sys.path``, with ``sys.argv`` set and its output captured. The JAX
settings a script may change for itself (the persistent compilation cache's, which
the training examples turn on) are restored afterwards.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import pathlib
import runpy
import sys

import jax

#: JAX options a script may set for its own run (`kfacx.enable_compilation_cache`).
_RESTORED = (
    "jax_enable_compilation_cache",
    "jax_compilation_cache_dir",
    "jax_persistent_cache_min_compile_time_secs",
)


@dataclasses.dataclass(frozen=True)
class ScriptRun:
    returncode: int
    stdout: str
    stderr: str


def run_script(path: pathlib.Path, *args: str, cwd: pathlib.Path | None = None) -> ScriptRun:
    """Runs ``path`` as ``__main__`` with ``args`` (from ``cwd`` if given); the exit code
    is 0 unless the script raises `SystemExit` with another (an exception propagates)."""
    folder = str(path.parent)
    stdout, stderr = io.StringIO(), io.StringIO()
    argv, old_cwd = sys.argv, os.getcwd()
    sys.argv = [str(path), *args]
    sys.path.insert(0, folder)
    code = 0
    settings = {name: getattr(jax.config, name) for name in _RESTORED}
    try:
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            try:
                runpy.run_path(str(path), run_name="__main__")
            except SystemExit as exit_:
                code = exit_.code if isinstance(exit_.code, int) else (exit_.code is not None)
    finally:
        for name, value in settings.items():
            jax.config.update(name, value)
        sys.argv = argv
        sys.path.remove(folder)
        os.chdir(old_cwd)
    return ScriptRun(int(code), stdout.getvalue(), stderr.getvalue())
