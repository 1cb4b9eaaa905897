"""Every list of ``curvature_block`` names (docstrings, the extension guide) names every
family `kfacx.blocks.CURVATURE_BLOCKS` accepts."""

from __future__ import annotations

import inspect
import pathlib

import pytest

import kfacx

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs"

LISTS = {
    "BlockDiagonalCurvature": inspect.getdoc(kfacx.BlockDiagonalCurvature),
    "CurvatureConfig": inspect.getdoc(kfacx.CurvatureConfig),
    "docs/extending.md": (DOCS / "extending.md").read_text(),
}


@pytest.mark.parametrize("where", sorted(LISTS))
def test_every_curvature_block_name_is_listed(where):
    text = LISTS[where]
    quoted = ('``"{}"``', '`"{}"`')
    missing = [
        name
        for name in kfacx.blocks.CURVATURE_BLOCKS
        if not any(q.format(name) in text for q in quoted)
    ]
    assert missing == [], f"{where} does not list curvature_block names {missing}"


def test_the_extension_guide_knows_the_ekfac_block():
    text = " ".join((DOCS / "extending.md").read_text().split())
    assert "no EKFAC block" not in text
    for name in ("kfacx.DenseEKFAC", "ConvEKFAC", "EmbeddingEKFAC"):
        assert name in text
