"""The MNIST-1D classifier and the optax pipeline examples run end to end (tiny settings);
the multiprocess example shows its options."""

from __future__ import annotations

import math
import pathlib
import re

import pytest
from _scripts import run_script

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"


def run_example(name: str, *args: str, cwd: pathlib.Path | None = None) -> str:
    """Runs ``examples/<name>`` with ``args``; returns its stdout (asserting exit code 0)."""
    run = run_script(EXAMPLES / name, *args, cwd=cwd)
    assert run.returncode == 0, f"exit code {run.returncode}\n{run.stdout}\n{run.stderr}"
    return run.stdout


def number(pattern: str, text: str) -> float:
    """The float captured by ``pattern`` in ``text`` (which must contain it)."""
    match = re.search(pattern, text)
    assert match, f"{pattern!r} not found in:\n{text}"
    return float(match.group(1))


def assert_png(path: pathlib.Path) -> None:
    assert path.is_file() and path.stat().st_size > 1000, path
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("name", ["classifier_mnist1d.py", "optax_pipeline.py"])
def test_help(name):
    out = run_example(name, "--help")
    for flag in ("--steps", "--batch-size", "--plot", "--no-progress"):
        assert flag in out, out


def test_multiprocess_help():
    """examples/multiprocess.py trains in tests/parallel/test_multiprocess.py's two processes;
    here its launcher's options."""
    out = run_example("multiprocess.py", "--help")
    for flag in ("--num-processes", "--cluster", "--steps", "--batch-size", "--checkpoint"):
        assert flag in out, out
    assert "--process-id" not in out  # set by the launcher only


def test_classifier_mnist1d_trains_above_chance(tmp_path):
    plot = tmp_path / "curves.png"
    out = run_example(
        "classifier_mnist1d.py",
        *("--steps", "40", "--batch-size", "64", "--adam-lrs", "3e-3,1e-2"),
        *(
            "--sgd-lrs",
            "3e-2",
            "--muon-lrs",
            "1e-2",
            "--sfadamw-lrs",
            "3e-3",
            "--sophia-lrs",
            "1e-3",
        ),
        *("--no-progress", "--plot", str(plot)),
        cwd=tmp_path,
    )
    assert_png(plot)
    assert "registration check: all 8 parameters matched (3 conv layers, 1 dense layer)" in out
    assert "8/8 parameters matched" in out
    summary = out[out.index("summary") :]
    kfac_loss = number(r"kfacx\s+final train loss (\S+)", summary)
    kfac_acc = number(r"kfacx\s+final train loss .* test accuracy (\S+)", summary)
    adam_loss = number(r"adam lr=\S+\s+final train loss (\S+)", summary)
    adam_acc = number(r"adam lr=\S+\s+final train loss .* test accuracy (\S+)", summary)
    chosen = number(r"adam learning rate chosen: (\S+) ", summary)
    grid = dict(
        (float(lr), float(loss))
        for lr, loss in re.findall(
            r"([\d.e-]+): ([\d.e+-]+|nan)", summary.split("by lr:")[1].split(")")[0]
        )
    )
    assert set(grid) == {3e-3, 1e-2}
    assert grid[chosen] == min(grid.values())
    assert math.isfinite(kfac_loss) and math.isfinite(adam_loss)
    # Ten classes: chance is 0.1. After 40 steps kfacx is at about 0.5, Adam about 0.4.
    assert kfac_loss < math.log(10) and adam_loss < math.log(10)
    assert kfac_acc > 0.3 and adam_acc > 0.2, summary
    assert "0 skipped steps" in summary
    for name in ("sgd", "muon", "sfadamw", "sophia"):  # one rate each, finite and learning
        loss = number(rf"{name} lr=\S+\s+final train loss (\S+)", summary)
        assert loss < math.log(10), (name, summary)
        assert f"{name} learning rate chosen" in summary


def test_optax_pipeline_matches_chain(tmp_path):
    plot = tmp_path / "curves.png"
    out = run_example(
        "optax_pipeline.py",
        *("--steps", "30", "--batch-size", "64", "--microbatches", "4"),
        *("--no-progress", "--plot", str(plot)),
        cwd=tmp_path,
    )
    assert_png(plot)
    assert "6/6 parameters matched" in out
    # The first-update check: one (b) update over 4 micro-batches equals one (a) update.
    diff = number(r"max \|update \(a\) - update \(b\)\| = (\S+)", out)
    scale = number(r"max \|update \(a\)\| = (\S+?),", out)
    assert math.isfinite(diff) and 0 < scale < 10 and diff <= 1e-4 * scale
    summary = out[out.index("summary") :]
    loss_a = number(r"\(a\) final train loss (\S+)", summary)
    loss_b = number(r"\(b\) final train loss (\S+)", summary)
    acc_a = number(r"\(a\) final train loss .* test accuracy (\S+)", summary)
    acc_b = number(r"\(b\) final train loss .* test accuracy (\S+)", summary)
    assert math.isfinite(loss_a) and math.isfinite(loss_b)
    assert loss_a < 1.0 and abs(loss_a - loss_b) <= 1e-3 * loss_a + 1e-5, summary
    assert acc_a > 0.7 and abs(acc_a - acc_b) < 0.02, summary


def test_optax_pipeline_rejects_indivisible_batch(tmp_path):
    run = run_script(EXAMPLES / "optax_pipeline.py", "--batch-size", "30", cwd=tmp_path)
    assert run.returncode == 2 and "multiple of --microbatches" in run.stderr
