"""Repository-wide checks: lint, public JAX API only, public names documented."""

from __future__ import annotations

import inspect
import pathlib
import shutil
import subprocess
import sys

import pytest

import kfacx

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_no_private_jax_imports():
    offenders = [
        f"{path.relative_to(ROOT)}:{i}"
        for path in (ROOT / "kfacx").rglob("*.py")
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if "jax._src" in line
    ]
    assert offenders == [], (
        f"private JAX API used at {offenders}; use jax.extend / jax.interpreters"
    )


def test_ruff_lint_and_format():
    ruff = shutil.which("ruff") or str(pathlib.Path(sys.executable).parent / "ruff")
    if not pathlib.Path(ruff).exists():
        pytest.skip("ruff is not installed (it is in the `test` extra)")
    targets = ["kfacx", "tests", "examples", "benchmarks"]
    lint = subprocess.run([ruff, "check", *targets], cwd=ROOT, capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    fmt = subprocess.run(
        [ruff, "format", "--check", *targets], cwd=ROOT, capture_output=True, text=True
    )
    assert fmt.returncode == 0, fmt.stdout + fmt.stderr


def _public_objects():
    for name in kfacx.__all__:
        obj = getattr(kfacx, name)
        if inspect.ismodule(obj) or not (inspect.isclass(obj) or inspect.isfunction(obj)):
            continue
        yield name, obj


@pytest.mark.parametrize("name", [n for n, _ in _public_objects()])
def test_public_names_have_docstrings(name):
    assert inspect.getdoc(getattr(kfacx, name)), f"kfacx.{name} has no docstring"


def test_all_is_sorted_and_complete():
    for name in kfacx.__all__:
        assert hasattr(kfacx, name), name
    assert len(set(kfacx.__all__)) == len(kfacx.__all__)
