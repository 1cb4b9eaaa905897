"""Shrunk failures of the detection fuzzer (tests/graph_matcher/test_fuzz.py), as plain
tests: each model runs the checks of tests/graph_matcher/_fuzz_checks.py (detection and
its report, float64 products against the dense exact GGN; one optimizer step where the
failure was the step's). No hypothesis needed.
"""

from __future__ import annotations

import pytest

from . import _fuzz_checks as C
from ._fuzz_models import Model, Op

#: name -> (shrunk model, what it raised before the fix). The step (a compilation of a
#: whole K-FAC step) runs for the cases whose failure was in the step only.
STEP = ("conv_row_bias", "scalar_bias")
CASES = {
    # A convolution's bias through a view (+ iota): `_views.servable` unpacked the conv's
    # ConvDimensionNumbers as a dense contraction's.
    "conv_bias_view": (Model((Op("conv", 1, bias="iota"),)), "ValueError (unpacking)"),
    # A layer norm's offset plus a ramp (``b + iota``) was matched as a shift layer on the
    # constant ramp: its statistics took the ramp's single row for the examples.
    "offset_plus_ramp": (
        Model((Op("ln", 1, view="dyn", bias="iota"),), loss="softmax", inputs="ids"),
        "product mismatch",
    ),
    # A weight gathered by constant indices (``x @ w[perm]``) was matched as an embedding
    # of the indices (the dense layer then found no weight).
    "gathered_weight": (Model((Op("dense", 1, view="gather"),)), "product mismatch"),
    # A convolution's bias stored as a row [1, out]: the conv block's products returned it
    # as [out], and the optimizer's step failed on the tangent's shape.
    "conv_row_bias": (Model((Op("conv", 1, bias="row"),)), "ValueError (jvp tangent shape)"),
    # A dense layer's bias broadcast from one entry (``b: [1]``) was tagged as its bias,
    # and the estimator's dense block refused it when the optimizer was set up.
    "scalar_bias": (Model((Op("dense", 3, view="split", bias="bcast"),)), "ValueError (block)"),
    # A weight [3, 1] plus a ramp (``w + iota``) with a batch of 3: matched as a shift on
    # the ramp whose parameter spans the batch axis; the full block's per-example
    # gradients failed to broadcast it over one example (JAX ValueError in kfacx).
    "weight_shaped_like_batch": (
        Model(
            (Op("where"), Op("scatter"), Op("dense_t", 1, view="iota", bias="row")),
            loss="softmax",
            inputs="ids",
            dtype="bfloat16",
        ),
        "ValueError (broadcast)",
    ),
    # A conv whose weight is read through a reshape: the bias check of the previous fix
    # read the kernel's output axis from the flat leaf (IndexError).
    "flat_conv_kernel": (
        Model((Op("dense", 1), Op("dense", 1), Op("conv", 1, view="flat"))),
        "IndexError",
    ),
    # float32 round trips of activations in the float64 check: a relative 1.3e-6 apart.
    "rounded_activations": (
        Model(
            (
                Op("rms", 1, view="cumsum"),
                Op("conv", 2, view="gather", bias="row"),
                Op("vmap", body=(Op("tanh"), Op("rms", 1, view="cumsum"))),
                Op("convert"),
            ),
            loss="softmax",
            dtype="bfloat16",
        ),
        "product mismatch (tolerance)",
    ),
    # A model whose GGN has NaN entries (in both): the tolerance was NaN.
    "nan_products": (
        Model((Op("max_sub"), Op("ln", 1, view="dyn"), Op("max_sub"), Op("dense", 1))),
        "product mismatch (atol NaN)",
    ),
    # Softmax saturated in bfloat16 rounding: a float64 product that is zero up to rounding.
    "zero_products": (
        Model(
            (Op("ln", 4, view="flat"), Op("ln", 4, view="flat"), Op("expand"), Op("expand")),
            loss="softmax",
            dtype="bfloat16",
        ),
        "product mismatch (tolerance)",
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_shrunk_fuzzer_failure(name):
    model, _ = CASES[name]
    done = C.check_model(model, products=True, step=name in STEP)
    assert done["detected"] and done["compared"] > 0, done
