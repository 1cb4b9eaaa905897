"""The documentation: it builds with warnings as errors, documents every public name, and
its code runs.

The pages include their code from ``docs/snippets/*.py`` and ``examples/custom_layer.py``
(``literalinclude``), so running those files tests the code the pages show. Outputs shown on
a page after a ``% output of <file>`` comment must appear verbatim in what the file prints.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import re
import subprocess
import sys
import zlib

import jax
import pytest
from _scripts import ScriptRun, run_script

import kfacx

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.rglob("*.md"))
SNIPPETS = sorted(p for p in (DOCS / "snippets").glob("*.py") if not p.name.startswith("_"))
CUSTOM_LAYER = ROOT / "examples" / "custom_layer.py"
TIMEOUT = 600  # the Sphinx build


def _run(script: pathlib.Path, *args: str) -> ScriptRun:
    """Runs ``script`` in this process, from its own folder, as ``python script`` would
    (with JAX's default rank promotion: the suite raises on implicit promotion)."""
    with jax.numpy_rank_promotion("allow"):
        return run_script(script, *args, cwd=script.parent)


#: A shown output: the marker, a blank line, then a fenced block (``text`` or bare).
OUTPUT_BLOCK = r"^% output of (\S+)\n\n```(?:text)?\n(.*?)\n```"


def _shown_outputs(script: pathlib.Path) -> list[tuple[str, str]]:
    """``(page, text)`` of every ``% output of <script>`` block in the pages."""
    marker = re.compile(OUTPUT_BLOCK, re.M | re.S)
    shown = []
    for page in PAGES:
        for path, text in marker.findall(page.read_text()):
            if (page.parent / path).resolve() == script.resolve():
                shown.append((page.name, text))
    return shown


def _check_shown_outputs(script: pathlib.Path, stdout: str) -> None:
    for page, text in _shown_outputs(script):
        assert text in stdout, (
            f"docs/{page} shows an output of {script.name} that it no longer prints:\n{text}\n"
            f"--- it prints:\n{stdout}"
        )


# ----------------------------------------------------------------------------- the build


@pytest.fixture(scope="module")
def html(tmp_path_factory) -> pathlib.Path:
    """Builds the site once (``sphinx-build -W --keep-going``); returns the output dir."""
    pytest.importorskip("sphinx", reason="Sphinx is not installed (it is in the `docs` extra)")
    pytest.importorskip("myst_parser", reason="myst-parser is not installed (`docs` extra)")
    out = tmp_path_factory.mktemp("docs")
    build = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-b", "html", "-q"]
        + ["-d", str(out / "doctrees"), str(DOCS), str(out / "html")],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert build.returncode == 0, f"the docs build has warnings or errors:\n{build.stderr}"
    return out / "html"


def test_docs_build_with_warnings_as_errors(html):
    pages = {p.relative_to(html).as_posix() for p in html.rglob("*.html")}
    expected = {p.relative_to(DOCS).with_suffix(".html").as_posix() for p in PAGES}
    expected.add("api/index.html")
    assert expected <= pages, sorted(expected - pages)


def _inventory(html: pathlib.Path) -> set[str]:
    """The object names in Sphinx's ``objects.inv`` (4 header lines, then zlib data)."""
    data = (html / "objects.inv").read_bytes()
    body = data.split(b"\n", 4)[4]
    return {line.split(" ", 1)[0] for line in zlib.decompress(body).decode().splitlines()}


def test_api_reference_documents_every_public_name(html):
    documented = _inventory(html)
    missing = [name for name in kfacx.__all__ if f"kfacx.{name}" not in documented]
    assert missing == [], f"kfacx.__all__ names missing from docs/api/*.rst: {missing}"


def test_every_snippet_is_shown_on_a_page():
    text = "\n".join(page.read_text() for page in PAGES)
    orphans = [s.name for s in SNIPPETS if f"snippets/{s.name}" not in text]
    assert orphans == [], f"snippets no page includes: {orphans}"
    assert "../examples/custom_layer.py" in (DOCS / "extending.md").read_text()


def test_config_table_lists_every_field():
    """The table of config fields in quickstart.md matches the dataclasses."""
    text = (DOCS / "quickstart.md").read_text()
    for cls in (
        kfacx.CurvatureConfig,
        kfacx.LearningRateConfig,
        kfacx.DampingConfig,
        kfacx.BatchConfig,
    ):
        (row,) = re.findall(rf"^\| {{py:class}}`~kfacx\.{cls.__name__}` \|(.*)\|$", text, re.M)
        shown = re.findall(r"`(\w+)`", row)
        assert shown == [f.name for f in dataclasses.fields(cls)], cls.__name__


# ----------------------------------------------------------------------------- the code


def test_every_shown_output_is_checked():
    """Each ``% output of`` marker is followed by a block `_shown_outputs` reads, naming a
    script that exists (else the output it shows would go unchecked)."""
    for page in PAGES:
        text = page.read_text()
        markers = re.findall(r"^% output of (\S+)$", text, re.M)
        blocks = re.findall(OUTPUT_BLOCK, text, re.M | re.S)
        assert [path for path, _ in blocks] == markers, page.name
        for path in markers:
            assert (page.parent / path).is_file(), f"{page.name}: {path}"


@pytest.mark.parametrize("snippet", SNIPPETS, ids=lambda p: p.name)
def test_snippet_runs_and_prints_what_its_page_shows(snippet):
    """In this process (`_scripts.run_script`): a new one would import JAX, Haiku, Flax
    and Equinox again, and would not share the suite's compilation cache."""
    result = _run(snippet)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.rstrip().endswith("OK"), result.stdout
    _check_shown_outputs(snippet, result.stdout)


@functools.cache
def _custom_layer_run() -> ScriptRun:
    return _run(CUSTOM_LAYER)


def test_custom_layer_example_detects_serves_and_trains():
    result = _custom_layer_run()
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "OK: detection found the custom layer, ScaledDenseBlock served it" in out, out
    assert "unmatched (fallback block): scaled_dense/log_scale" in out  # defaults only
    assert re.search(
        r"scaled_dense/w\s+0\s+scaled_dense_tag\s+scaled_dense\s+ScaledDenseBlock", out
    )
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", out).groups())
    assert last < 0.5 * first
    _check_shown_outputs(CUSTOM_LAYER, out)


def test_custom_layer_example_has_help():
    # In a new process: the script creates its layer tag at import, and a tag name can
    # be created once per process (the in-process run above creates it).
    result = subprocess.run(
        [sys.executable, str(CUSTOM_LAYER), "--help"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert "--steps" in result.stdout and "custom layer tag" in result.stdout
