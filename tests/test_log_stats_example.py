"""examples/log_stats.py at a tiny size: its CSV file has every documented field of every
step (``rho`` a number exactly on the damping adaptation steps and on the long steps that
``long_step_ratio`` checks) and its plot is a PNG."""

from __future__ import annotations

import csv
import math
import pathlib
import runpy
import sys

from optimizer.test_step_stats import OPTIONAL, page_fields

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "log_stats.py"
STEPS, PRINT_EVERY, ADAPTATION_INTERVAL = 7, 3, 5


def test_log_stats_example_logs_every_field_of_every_step_and_plots(tmp_path, monkeypatch, capsys):
    """Run as ``__main__`` in this process (a new one would import JAX again: 3 s)."""
    log, plot = tmp_path / "stats.csv", tmp_path / "stats.png"
    args = ["--dataset", "digits", "--steps", str(STEPS), "--batch-size", "32", "--width", "8"]
    args += ["--burnin", "0", "--print-every", str(PRINT_EVERY)]
    monkeypatch.setattr(sys, "argv", [str(EXAMPLE), *args, "--csv", str(log), "--plot", str(plot)])
    monkeypatch.setattr(sys, "path", list(sys.path))  # the example adds its folder
    runpy.run_path(str(EXAMPLE), run_name="__main__")
    stdout = capsys.readouterr().out

    with open(log, newline="") as f:
        reader = csv.DictReader(f)
        header, rows = reader.fieldnames, list(reader)
    # Adaptive damping with the default long_step_ratio: ``rejected`` is logged too.
    optional = [name for name in OPTIONAL if name != "rejected"]
    fields = [name for name in page_fields() if name not in optional] + ["aux/accuracy"]
    assert header[0] == "step" and sorted(header) == sorted(fields)
    assert [int(row["step"]) for row in rows] == list(range(STEPS))
    assert [int(row["data_seen"]) for row in rows] == [32 * (i + 1) for i in range(STEPS)]
    assert {row["skipped"] for row in rows} == {"False"}
    previous = 0.0  # the velocity's norm: the last update that was not rejected
    for row in rows:
        flags = ("skipped", "rejected")
        values = {name: float(row[name]) for name in header if name not in flags}
        adapts = (values["step"] + 1) % ADAPTATION_INTERVAL == 0
        long_step = previous > 0 and values["update_norm"] > 2.0 * previous
        assert math.isfinite(values["rho"]) == (adapts or long_step), row
        if row["rejected"] == "False":
            previous = values["update_norm"]
        else:
            assert long_step, row
        assert all(math.isfinite(v) for name, v in values.items() if name != "rho"), row
    assert float(rows[-1]["loss"]) < float(rows[0]["loss"])

    printed = [line.split()[1] for line in stdout.splitlines() if line.startswith("step")]
    assert printed == [str(s) for s in range(PRINT_EVERY - 1, STEPS, PRINT_EVERY)], stdout
    assert "test accuracy" in stdout
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 10_000
