"""The table of all curvature blocks shared by the property tests
(tests/blocks/test_blocks*.py): `CASES` and its subsets (Kronecker, cached, products,
representative, degenerate), their test ids, and the check of one matrix product
against its float64 reference.

The cases are built once per process here, so that the per-case caches of
tests/blocks/_cases.py (`_cases.products`, `_cases.jit_update`, ...) serve every test
file.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kfacx import blocks

from . import _cases as C
from ._cases import Case

KF = blocks.DenseTwoKroneckerFactored
CONV = blocks.ConvTwoKroneckerFactored
NHWC = ("NHWC", "HWIO", "NHWC")

DAMPING = 0.5
TOL = 1e-4

# One table of all blocks: every shared property test (tests/blocks/test_blocks*.py) runs
# on every case.
CASES: list[Case] = [
    C.dense_case("dense_kf_bias", (5, 4), 3, True),
    C.dense_case("dense_kf_nobias", (5, 4), 3, False),
    C.dense_case("dense_kf_bias_seq", (3, 2, 4), 3, True),
    C.dense_case("dense_kf_nobias_seq", (3, 2, 4), 3, False),
    # x @ w.T, and an attention-style projection einsum("btd,dhk->bthk").
    C.dense_case(
        "dense_kf_transposed_bias",
        (5, 4),
        None,
        True,
        w_shape=(3, 4),
        dimension_numbers=(((1,), (1,)), ((), ())),
    ),
    C.dense_case("dense_kf_multihead_seq_bias", (3, 2, 4), None, True, w_shape=(4, 2, 3)),
    C.conv_case("conv1d_kf_bias", (2, 3, 7), (4, 3, 3), True),
    C.conv_case(
        "conv1d_kf_nobias_nwc",
        (2, 7, 3),
        (3, 3, 4),
        False,
        window_strides=(2,),
        dimension_numbers=("NWC", "WIO", "NWC"),
    ),
    C.conv_case(
        "conv2d_kf_bias_nhwc",
        (2, 5, 5, 3),
        (3, 3, 3, 4),
        True,
        window_strides=(2, 2),
        padding="SAME",
        dimension_numbers=NHWC,
    ),
    C.conv_case(
        "conv2d_kf_groups_nobias", (2, 4, 5, 5), (6, 2, 2, 2), False, feature_group_count=2
    ),
    C.conv_case("conv3d_kf_bias", (2, 2, 4, 3, 3), (3, 2, 2, 2, 2), True),
    C.conv_case(
        "conv3d_kf_nobias_ndhwc",
        (2, 3, 3, 4, 2),
        (2, 2, 2, 2, 3),
        False,
        dimension_numbers=("NDHWC", "DHWIO", "NDHWC"),
    ),
    C.scale_and_shift_case(
        "ss_diag_scale_shift", (3, 2, 4), (4,), (4,), blocks.ScaleAndShiftDiagonal
    ),
    C.scale_and_shift_case("ss_diag_scale", (4, 5), (5,), None, blocks.ScaleAndShiftDiagonal),
    C.scale_and_shift_case("ss_full_scale_shift", (3, 2, 4), (4,), (4,), blocks.ScaleAndShiftFull),
    C.scale_and_shift_case("ss_full_scale", (4, 5), (5,), None, blocks.ScaleAndShiftFull),
    C.dense_case("diag_dense", (5, 4), 3, True, blocks.Diagonal),
    C.dense_case("diag_dense_seq", (3, 2, 4), 2, False, blocks.Diagonal),
    C.dense_case("full_dense", (5, 4), 3, True, blocks.Full),
    C.dense_case("full_dense_seq", (3, 2, 4), 2, False, blocks.Full),
    C.dense_case("full_dense_multihead_seq", (2, 2, 3), None, True, blocks.Full, w_shape=(3, 2, 2)),
    C.generic_case("diag_generic", (3, 2), blocks.Diagonal),
    C.generic_case("full_generic", (3, 2), blocks.Full),
]
KRONECKER_CASES = [c for c in CASES if c.is_kronecker]
# Dense K-FAC with the default contraction x @ w, w [d_in, d_out].
DENSE_KRONECKER_CASES = [
    c
    for c in CASES
    if c.is_dense_kronecker
    and c.meta["dimension_numbers"][0][1] == (0,)
    and len(c.param_shapes[0]) == 2
]
CACHED_CASES = [c for c in CASES if c.is_kronecker or c.is_full]
# The products see a Kronecker block only through its factors and its matrix layout
# (`params_to_matrix`); the product tests leave out the cases whose layout another case
# has: the sequence cases (the dense cases' parameters and layout: the same program) and
# three conv cases (their kernel layouts are the channel-first or spatial-first ones of
# the conv cases kept; test_conv_statistics.py checks every conv layout).
PRODUCT_CASES = [
    c
    for c in CASES
    if c.name
    not in {
        "dense_kf_bias_seq",
        "dense_kf_nobias_seq",
        "conv1d_kf_nobias_nwc",
        "conv3d_kf_bias",
        "conv3d_kf_nobias_ndhwc",
    }
]
PRODUCT_KRONECKER_CASES = [c for c in PRODUCT_CASES if c.is_kronecker]
# Dense and conv Kronecker, closed-form (scale and shift) and vjp-based (generic)
# per-example gradients: the blocks' code paths that jit / dtype / pmap checks can
# distinguish (see the docstring of tests/blocks/test_blocks.py).
REPRESENTATIVE_CASES = [
    c
    for c in CASES
    if c.name
    in {"dense_kf_bias_seq", "conv2d_kf_bias_nhwc", "ss_diag_scale_shift", "full_dense_seq"}
]

# Degenerate statistics (1x1, rank-deficient and exactly zero factors).
_SPECIAL = {
    "1x1": C.dense_case("1x1", (4, 1), 1, False),
    "rank_deficient": C.dense_case("rank_deficient", (2, 6), 5, True),
    "zero_inputs": C.dense_case("zero_inputs", (3, 4), 3, False, zero_inputs=True),
    "zero_tangents": C.dense_case("zero_tangents", (3, 4), 3, True, zero_tangents=True),
}
SPECIAL_CASES = [
    dataclasses.replace(_SPECIAL[name], name=f"{prefix}_{name}", block_cls=cls)
    for prefix, cls, names in (
        ("kf", KF, ("1x1", "rank_deficient", "zero_inputs", "zero_tangents")),
        ("full", blocks.Full, ("1x1", "rank_deficient", "zero_inputs")),
        ("diag", blocks.Diagonal, ("rank_deficient", "zero_tangents")),
    )
    for name in names
] + [
    C.conv_case(
        "conv_kf_zero_tangents", (2, 2, 5), (3, 2, 2), True, case_kwargs=dict(zero_tangents=True)
    ),
]


def _ids(cases):
    return [c.name for c in cases]


def _config_id(config) -> str:
    power, exact_power, use_cached = config
    return f"p{power}-{'exact' if exact_power else 'approx'}-{'cached' if use_cached else 'fresh'}"


def _product_params(cases):
    return [
        pytest.param(c, cfg, id=f"{c.name}-{_config_id(cfg)}")
        for c in cases
        for cfg in C.EXACT_CONFIGS + C.APPROX_CONFIGS
    ]


def _exact_reference(block, state, vector, identity_weight, power) -> np.ndarray:
    dense = C.state_dense(block, state)
    flat = np.asarray(C.flat(vector), np.float64)
    return C.dense_matpower(dense, identity_weight, power) @ flat


def _check_product(case, identity_weight, config) -> None:
    """One product of `_cases.products` against its float64 reference."""
    power, exact_power, _ = config
    block, state, v, outputs = C.products(case, identity_weight, exact_power)
    out = outputs[config]
    assert [o.shape for o in out] == [x.shape for x in v]
    assert all(o.dtype == x.dtype for o, x in zip(out, v, strict=True))
    what = f"{case.name} {_config_id(config)}"
    if case.is_kronecker and not exact_power:
        expected = C.pi_damped_reference(block, state, v, identity_weight, power)
        C.assert_close_rel(C.to_matrix_layout(block, out), expected, TOL, what)
    else:
        expected = _exact_reference(block, state, v, identity_weight, power)
        C.assert_close_rel(C.flat(out), expected, TOL, what)
