"""Curvature blocks: one block of the block-diagonal curvature matrix per layer.

All blocks are pure: ``init`` / ``update_curvature_matrix_estimate`` /
``update_cache`` return a new `BlockState`; ``multiply_matpower`` returns a new
vector. Abstract bases: `CurvatureBlock` and `TwoKroneckerFactored`.
`StackedBlock` wraps any block for layers stacked along a leading axis
(`lax.scan` over the parameters, `hk.layer_stack`).
"""

from kfacx.blocks._base import (
    BlockState,
    CurvatureBlock,
    InverseRefresh,
    LayerInfo,
    WeightedMovingAverage,
    flatten_params,
    unflatten_params,
)
from kfacx.blocks._diagonal_full import (
    Diagonal,
    Full,
    FullEigen,
    ScaleAndShiftDiagonal,
    ScaleAndShiftFull,
)
from kfacx.blocks._embedding import (
    EmbeddingCache,
    EmbeddingEigen,
    EmbeddingKroneckerFactored,
    EmbeddingPair,
)
from kfacx.blocks._kronecker import (
    ConvTwoKroneckerFactored,
    DenseTwoKroneckerFactored,
    KroneckerCache,
    KroneckerEigen,
    KroneckerPair,
    TwoKroneckerFactored,
)
from kfacx.blocks._stacked import StackedBlock

__all__ = [
    "BlockState",
    "ConvTwoKroneckerFactored",
    "CurvatureBlock",
    "DenseTwoKroneckerFactored",
    "Diagonal",
    "EmbeddingCache",
    "EmbeddingEigen",
    "EmbeddingKroneckerFactored",
    "EmbeddingPair",
    "Full",
    "FullEigen",
    "InverseRefresh",
    "KroneckerCache",
    "KroneckerEigen",
    "KroneckerPair",
    "LayerInfo",
    "ScaleAndShiftDiagonal",
    "ScaleAndShiftFull",
    "StackedBlock",
    "TwoKroneckerFactored",
    "WeightedMovingAverage",
    "flatten_params",
    "unflatten_params",
]
