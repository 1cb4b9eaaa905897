"""Property-based fuzzer of layer detection.

Random small models (tests/graph_matcher/_fuzz_models.py) through
`kfacx.auto_register_tags`: detection never raises anything but kfacx's documented
ValueError/TypeError, its report lists every parameter once, the matched layers'
float64 curvature products equal the dense exact GGN, and an optimizer step is finite
(tests/graph_matcher/_fuzz_checks.py).

The suite runs the ``quick`` profile (deterministic, a few seconds); the long run is

    python benchmarks/fuzz_detection.py --examples 10000 --seed 0

or ``KFACX_FUZZ_PROFILE=long pytest tests/graph_matcher/test_fuzz.py``. Shrunk
failures are kept in tests/graph_matcher/test_fuzz_regressions.py.
"""

from __future__ import annotations

import pytest

hypothesis = pytest.importorskip("hypothesis")

from . import _fuzz_runner as R  # noqa: E402

LONG = R.profile_name() == "long"


def _run(products_every: int, step_every: int, examples: int | None = None) -> None:
    profile = hypothesis.settings.get_profile(f"kfacx-fuzz-{R.profile_name()}")
    if examples is not None:
        profile = hypothesis.settings(profile, max_examples=examples)
    hypothesis.settings(profile)(R.fuzz_property(products_every, step_every))()


def test_detection_of_random_models():
    """Detection and its report (no compilation): many models. The long profile also
    checks every 10th model's products and every 100th model's step."""
    _run(*((10, 100) if LONG else (0, 0)))


@pytest.mark.skipif(LONG, reason="the long profile checks products in the test above")
def test_products_of_random_models():
    """Fewer models, each with the float64 product check."""
    _run(products_every=1, step_every=0, examples=6)


@pytest.mark.skipif(LONG, reason="the long profile runs steps in the test above")
def test_optimizer_step_of_random_models():
    """Two models, each with an optimizer step (a K-FAC step's compilation each)."""
    _run(products_every=0, step_every=1, examples=2)
