"""The examples run end to end (small settings)."""

from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_quickstart_trains_and_beats_chance():
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "quickstart.py"),
            "--steps",
            "30",
            "--print-every",
            "10",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    assert "test accuracy" in out
    kfac_acc = float(out.split("kfacx ")[1].split(",")[0])
    assert kfac_acc > 0.8, out
