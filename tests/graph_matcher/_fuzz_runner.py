"""The detection fuzzer's hypothesis profiles and property, shared by
tests/graph_matcher/test_fuzz.py (the ``quick`` profile, in the suite) and
benchmarks/fuzz_detection.py (the ``long`` run).

Every generated model is detected (`_fuzz_checks.check_detection`); every
``products_every``-th model also gets the float64 product check and every
``step_every``-th one an optimizer step (both compile, detection does not).
"""

from __future__ import annotations

import collections
import os
import zlib

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from . import _fuzz_checks as C
from . import _fuzz_models as F


def ops(depth: int = 2) -> st.SearchStrategy[tuple[F.Op, ...]]:
    """Lists of one to four ops; wrappers nest ``depth`` levels at most."""
    layer = st.tuples(
        st.sampled_from(F.LAYERS),
        st.integers(1, 4),
        st.sampled_from(F.VIEWS),
        st.sampled_from(F.BIASES),
    ).map(lambda fields: F.Op(*fields))
    activation = st.sampled_from(F.ACTIVATION_OPS).map(F.Op)
    options = [layer, layer, activation]  # layers twice as often
    if depth > 0:
        wrapper = st.tuples(st.sampled_from(F.WRAPPERS), ops(depth - 1))
        options.append(wrapper.map(lambda kind_body: F.Op(kind_body[0], body=kind_body[1])))
    return st.lists(st.one_of(options), min_size=1, max_size=4).map(tuple)


@st.composite
def models(draw, depth: int = 2) -> F.Model:
    """Random `Model`s: float32 or bfloat16 parameters, float or id inputs."""
    return F.Model(
        draw(ops(depth)),
        loss=draw(st.sampled_from(("squared", "softmax"))),
        inputs=draw(st.sampled_from(("float", "ids"))),
        dtype=draw(st.sampled_from(("float32", "bfloat16"))),
    )


PROFILES = {
    # In the suite: deterministic (derandomized), no example database, no output.
    "quick": dict(max_examples=40, derandomize=True),
    # benchmarks/fuzz_detection.py sets max_examples and the seed.
    "long": dict(max_examples=10_000, derandomize=False),
}
for _name, _options in PROFILES.items():
    settings.register_profile(
        f"kfacx-fuzz-{_name}",
        deadline=None,
        database=None,
        print_blob=False,
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.filter_too_much,
        ],
        **_options,
    )


def profile_name() -> str:
    """``KFACX_FUZZ_PROFILE`` (``quick`` unless set)."""
    return os.environ.get("KFACX_FUZZ_PROFILE", "quick")


class Tally:
    """What a run checked, for the long run's summary."""

    def __init__(self):
        self.counts: collections.Counter = collections.Counter()
        self.errors: collections.Counter = collections.Counter()

    def add(self, done: dict) -> None:
        self.counts["models"] += 1
        self.counts["detected"] += done["detected"]
        self.counts["product checks"] += "compared" in done
        self.counts["with compared entries"] += bool(done.get("compared"))
        self.counts["optimizer steps"] += "stepped" in done
        if done["error"]:
            self.errors[done["error"].split(".")[0][:100]] += 1


def fuzz_property(products_every: int, step_every: int, tally: Tally | None = None):
    """The property over `_fuzz_models.models`: `_fuzz_checks.check_model` on each."""

    @given(models())
    def prop(model):
        # Chosen by the model (not by a call count): hypothesis replays a failure exactly.
        i = zlib.crc32(repr(model).encode())
        products = products_every > 0 and i % products_every == 0
        step = step_every > 0 and (i >> 12) % step_every == 0
        done = C.check_model(model, products=products, step=step)
        if tally is not None:
            tally.add(done)

    return prop
