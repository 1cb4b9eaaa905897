"""`RegistrationReport`: the table it prints, its matched fraction and block names."""

from __future__ import annotations

import dataclasses

import pytest

from kfacx.graph_matcher import RegistrationEntry, RegistrationReport

ENTRIES = (
    RegistrationEntry("embed/table", "tied(embedding_tag, dense_tag)", 0, "manual", uses=2),
    RegistrationEntry("stack/w", "dense_tag", 1, "dense_with_bias", stack_size=4),
    RegistrationEntry("stack/b", "dense_tag", 1, "dense_with_bias", stack_size=4),
    RegistrationEntry("gate/scale", "scale_and_shift_tag", 2, "scale_only", in_branch=True),
    RegistrationEntry("step_scale", "generic_tag", 3, "unmatched"),
)


def test_str_is_an_aligned_table_with_a_summary():
    report = RegistrationReport(ENTRIES, unmatched=("step_scale",), notes=("a note", "another"))
    assert str(report).splitlines() == [
        "parameter    layer          tag                             found by         block",
        "-----------  -------------  ------------------------------  ---------------  -----",
        "embed/table  0 (x2)         tied(embedding_tag, dense_tag)  manual           -",
        "stack/w      1 (4 stacked)  dense_tag                       dense_with_bias  -",
        "stack/b      1 (4 stacked)  dense_tag                       dense_with_bias  -",
        "gate/scale   2 (in branch)  scale_and_shift_tag             scale_only       -",
        "step_scale   3              generic_tag                     unmatched        -",
        "4/5 parameters matched to a layer tag.",
        "unmatched (fallback block): step_scale",
        "note: a note",
        "note: another",
    ]


def test_with_blocks_names_each_entry_and_keeps_the_rest():
    report = RegistrationReport(ENTRIES, unmatched=("step_scale",))
    named = report.with_blocks(lambda e: "Diagonal" if e.tag == "generic_tag" else "Kron")
    assert [e.block for e in named.entries] == ["Kron"] * 4 + ["Diagonal"]
    assert [dataclasses.replace(e, block="") for e in named.entries] == list(ENTRIES)
    assert named.unmatched == report.unmatched and report.entries[0].block == ""
    assert str(named).splitlines()[2].endswith("manual           Kron")


def test_matched_fraction():
    assert RegistrationReport(ENTRIES, unmatched=("step_scale",)).matched_fraction == 0.8
    assert RegistrationReport(ENTRIES).matched_fraction == 1.0
    assert RegistrationReport(()).matched_fraction == 1.0


def test_report_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        RegistrationReport(ENTRIES).notes = ("x",)
