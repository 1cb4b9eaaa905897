"""A slice of `benchmarks/stress.py`'s matrix in the suite: the README's adaptive settings
on problems unlike the quick start (small batches, a whole-set regression with a
squared error, a parameter on the diagonal fallback), one seed each; none diverges.
The quick start itself is tests/optimizer/test_robust_defaults.py's."""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))

import pytest  # noqa: E402
import stress  # noqa: E402


# digits-fallback's offsets get a diagonal block on purpose (the warning says so).
@pytest.mark.filterwarnings("ignore:kfacx. no layer pattern matched")
def test_quick_slice_of_the_stress_matrix_does_not_diverge(capsys):
    problems = ["digits-small", "diabetes", "digits-fallback"]
    cells = stress.main(
        ["--problems", *problems, "--options", "readme", "--seeds", "1", "--steps", "80"]
    )
    out = capsys.readouterr().out
    assert [c["problem"] for c in cells] == problems
    assert all(c["diverged"] == 0 for c in cells), out
    assert "0 of 3 runs diverged" in out
