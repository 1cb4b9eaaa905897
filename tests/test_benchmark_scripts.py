"""Every benchmark script the documentation cites shows its usage with ``--help``.

The cited scripts are those that docs/benchmarks.md, docs/numerics.md, docs/recipes.md
and README.md name as ``benchmarks/<name>.py``. Each runs in this process as
``python benchmarks/<name>.py --help`` would (`_scripts.run_script`), so only its own
imports are paid. The environment, ``sys.path`` and the repository's own modules a
script adds (``scale_out.py`` sets ``XLA_FLAGS`` for 8 host devices at import, which
later subprocesses would inherit) are restored afterwards.
"""

from __future__ import annotations

import os
import pathlib
import re
import sys

import pytest
from _scripts import run_script

ROOT = pathlib.Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
CITING = ("docs/benchmarks.md", "docs/numerics.md", "docs/recipes.md", "README.md")
_CITED = re.compile(r"\bbenchmarks/([A-Za-z0-9_]+)\.py\b")


def _cited() -> list[str]:
    names = set()
    for page in CITING:
        names.update(_CITED.findall((ROOT / page).read_text()))
    return sorted(names)


CITED = _cited()


def _own_module(module) -> bool:
    """Whether ``module`` is one of the repository's scripts or test helpers (not kfacx,
    not an installed package)."""
    path = getattr(module, "__file__", None)
    if not path:
        return getattr(module, "__name__", "").split(".")[0] == "tests"
    folder = pathlib.Path(path).resolve()
    return any(folder.is_relative_to(ROOT / name) for name in ("benchmarks", "examples", "tests"))


def test_the_docs_cite_benchmark_scripts_that_exist():
    assert {"stress", "quickstart_vs_kfac_jax", "time_to_target"} <= set(CITED), CITED
    missing = [name for name in CITED if not (BENCHMARKS / f"{name}.py").is_file()]
    assert not missing, f"the docs cite benchmark scripts that are not there: {missing}"


@pytest.mark.parametrize("name", CITED)
def test_cited_benchmark_shows_its_usage(name):
    environ, path, modules = dict(os.environ), list(sys.path), set(sys.modules)
    try:
        run = run_script(BENCHMARKS / f"{name}.py", "--help")
    finally:
        os.environ.clear()
        os.environ.update(environ)
        sys.path[:] = path
        for added in set(sys.modules) - modules:
            if _own_module(sys.modules[added]):
                del sys.modules[added]
    assert run.returncode == 0, f"exit code {run.returncode}\n{run.stdout}\n{run.stderr}"
    assert "usage" in run.stdout.lower(), run.stdout + run.stderr
