"""The examples run end to end (small settings), as scripts (`_scripts.run_script`)."""

from __future__ import annotations

import pathlib

from _scripts import run_script

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _run(name: str, *args: str) -> str:
    run = run_script(ROOT / "examples" / name, *args)
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout


def test_quickstart_at_its_defaults_matches_adam():
    """The quick start as a user runs it: its default settings, for its full length."""
    out = _run("quickstart.py")
    assert "nan" not in out.lower(), out
    accuracies = out.split("test accuracy: kfacx ")[1]
    kfac_acc = float(accuracies.split(",")[0])
    adam_acc = float(accuracies.split("adam ")[1])
    assert kfac_acc >= adam_acc and kfac_acc > 0.95, out


def test_autoencoder_example_runs_and_writes_its_plot(tmp_path):
    plot = tmp_path / "ae.png"
    out = _run(
        "autoencoder_mnist.py",
        "--steps",
        "4",
        "--grid-steps",
        "2",
        "--batch-size",
        "100",
        "--burnin",
        "1",
        "--adam-rates",
        "1e-3",
        "--first-order",
        "adam",
        "--no-progress",
        "--plot",
        str(plot),
    )
    assert plot.stat().st_size > 10_000
    rows = {
        line.split()[0]: line.split() for line in out.splitlines() if line[:1] and line[0] in "KAS"
    }
    kfac_final = float(rows["K-FAC"][1])
    assert 0 < kfac_final < 543.0, out  # below the loss of the untrained network
    # Adam only: the other first-order baselines come from examples/common.py, which
    # tests/test_examples_extra.py runs through the MNIST-1D example.
    table = out[out.index("target:") :]
    assert "Adam (lr=" in table and "Sophia" not in table, out
