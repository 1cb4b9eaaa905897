"""Sphinx configuration of the kfacx documentation.

Build with warnings as errors (``tests/test_docs.py`` does)::

    sphinx-build -W --keep-going -b html docs docs/_build/html

Besides the usual set-up this file checks that every name in ``kfacx.__all__``
is documented in the API reference (a missing one is a build warning, hence an
error with ``-W``), and gives module-level constants re-exported by ``kfacx``
the ``#:`` doc comment of the module that defines them.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)

from docutils import nodes  # noqa: E402
from sphinx.pycode import ModuleAnalyzer  # noqa: E402
from sphinx.util import logging  # noqa: E402

import kfacx  # noqa: E402

project = "kfacx"
author = "the kfacx authors"
copyright = "2026, the kfacx authors"
release = kfacx.__version__
version = release

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "snippets", "Thumbs.db", ".DS_Store"]

# Docstrings write `name` for references: link them when the name is documented.
default_role = "py:obj"

myst_enable_extensions = ["dollarmath", "colon_fence"]
myst_heading_anchors = 3

autodoc_default_options = {"members": True, "member-order": "bysource"}
autodoc_typehints = "signature"
autodoc_typehints_format = "short"
autodoc_preserve_defaults = True
autodoc_inherit_docstrings = False
napoleon_google_docstring = True
napoleon_numpy_docstring = False
# "Attributes:" sections become fields of the class, not separate objects (the
# NamedTuple / dataclass fields would otherwise be described twice).
napoleon_use_ivar = True
napoleon_attr_annotations = False  # the class signature shows the types

html_theme = "alabaster"
html_title = f"kfacx {release}"
html_static_path: list[str] = []
html_theme_options = {
    "description": "K-FAC second-order optimization for JAX",
    "fixed_sidebar": True,
}

logger = logging.getLogger("kfacx.docs")

# Submodules whose own ``#:`` comments document the constants kfacx re-exports.
_DEFINING_MODULES = (
    "kfacx.estimator",
    "kfacx.estimator._statistics",
    "kfacx.graph_matcher._defaults",
    "kfacx.graph_matcher._auto_register",
    "kfacx.tags._layer_tags",
    "kfacx.tags._loss_tags",
)


def _module_comment(obj: object) -> list[str] | None:
    """The ``#:`` comment above the assignment that defines ``obj``, if any."""
    for modname in _DEFINING_MODULES:
        module = importlib.import_module(modname)
        attr_docs = ModuleAnalyzer.for_module(modname).find_attr_docs()
        for name, value in vars(module).items():
            if value is obj and ("", name) in attr_docs:
                return list(attr_docs[("", name)])
    return None


def _describe_constant(obj: object) -> list[str]:
    """Generated lines listing what a constant holds (never drifts from the code)."""
    if obj is kfacx.DEFAULT_GRAPH_PATTERNS:
        header = ("pattern", "tag", "precedence")
        rows = [(f"``{p.name}``", f"``{p.tag_primitive.name}``", str(p.precedence)) for p in obj]
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(3)]
        rule = "  ".join("=" * w for w in widths)

        def row(cells):
            return "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()

        return ["", rule, row(header), rule, *map(row, rows), rule]
    if obj is kfacx.DEFAULT_LAYER_TAG_TO_BLOCK_CTOR:
        return ["", *(f"- ``{tag}``: `kfacx.{ctor.__name__}`" for tag, ctor in obj.items())]
    return []


def _tag_description(obj: object) -> list[str] | None:
    """One line for a built-in layer or loss tag instance."""
    if isinstance(obj, kfacx.LayerTag):
        block = kfacx.DEFAULT_LAYER_TAG_TO_BLOCK_CTOR.get(obj.name)
        served = f"; served by `kfacx.{block.__name__}` by default" if block else ""
        return [f"The built-in layer tag ``{obj.name}``{served}."]
    if isinstance(obj, kfacx.LossTag):
        classes = [c for c in kfacx.LossFunction.__subclasses__() if c.tag_name == obj.name]
        meaning = f", interpreted by `kfacx.{classes[0].__name__}`" if classes else ""
        return [f"The built-in loss tag ``{obj.name}``{meaning}."]
    return None


def _process_docstring(app, what, name, obj, options, lines):
    """Re-exported constants and tag instances get their module's doc comment.

    Runs before napoleon. Without a ``#:`` comment autodoc shows the docstring
    of the object's type (e.g. of ``tuple``); that is replaced by the defining
    module's comment, a generated description, or nothing (the directive's own
    content then describes the object).
    """
    if what != "data":
        return
    if "\n".join(lines).strip() != (inspect.getdoc(type(obj)) or "").strip():
        return  # autodoc found a real doc comment
    comment = _module_comment(obj) or _tag_description(obj) or []
    lines[:] = [*comment, *_describe_constant(obj)]


def _skip_member(app, what, name, obj, skip, options):
    """NamedTuple fields ("Alias for field number 0") are described by the class docstring."""
    doc = getattr(obj, "__doc__", None)
    if isinstance(doc, str) and doc.startswith("Alias for field number"):
        return True
    return None


def _strip_trailing_blank_lines(app, doctree):
    """Included code regions end before a marker comment: drop the blank lines above it."""
    for node in doctree.findall(nodes.literal_block):
        text = node.astext()
        if text != text.rstrip() and node.rawsource == text and len(node.children) == 1:
            node.rawsource = text.rstrip()
            node.replace(node.children[0], nodes.Text(node.rawsource))


def _check_api_coverage(app, env):
    """Every name in ``kfacx.__all__`` must be documented somewhere in the API pages."""
    documented = set(env.get_domain("py").objects)
    missing = [n for n in kfacx.__all__ if f"kfacx.{n}" not in documented]
    if missing:
        logger.warning(
            "kfacx.__all__ names missing from the API reference (docs/api/*.rst): %s",
            ", ".join(missing),
        )


def setup(app):
    app.connect("autodoc-process-docstring", _process_docstring, priority=400)
    app.connect("autodoc-skip-member", _skip_member)
    app.connect("doctree-read", _strip_trailing_blank_lines)
    app.connect("env-check-consistency", _check_api_coverage)
    return {"parallel_read_safe": True}
