"""Curvature blocks: one block of the block-diagonal curvature matrix per layer.

All blocks are pure: ``init`` / ``update_curvature_matrix_estimate`` /
``update_cache`` return a new `BlockState`; ``multiply_matpower`` returns a new
vector. Abstract bases: `CurvatureBlock` and `TwoKroneckerFactored`.
`StackedBlock` wraps any block for layers stacked along a leading axis
(`lax.scan` over the parameters, `hk.layer_stack`); `TiedKroneckerFactored`
serves a 2-D weight used by dense and embedding layers of different kinds
(tied input/output embeddings, ``w`` and ``w.T``); `ViewBlock` serves a layer whose
parameters are concatenations of parameter leaves (fused-gate LSTMs), `SlicedBlock`
parameters split into slices between layers (``hk.GRU``), `MappedBlock` a parameter
passed through an elementwise map before its layer (``x * softplus(s)``,
``w * mask``). `block_norm` computes a
block's matrix norms (for scaling the damping per block).
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
from kfacx.blocks._ekfac import ConvEKFAC, DenseEKFAC, EKFACCache, EmbeddingEKFAC
from kfacx.blocks._embedding import (
    EmbeddingCache,
    EmbeddingEigen,
    EmbeddingKroneckerFactored,
    EmbeddingPair,
)
from kfacx.blocks._families import CURVATURE_BLOCKS, curvature_block_ctors
from kfacx.blocks._kronecker import (
    ConvTwoKroneckerFactored,
    DenseTwoKroneckerFactored,
    KroneckerCache,
    KroneckerEigen,
    KroneckerPair,
    TwoKroneckerFactored,
)
from kfacx.blocks._make import layer_block
from kfacx.blocks._mapped import MAP_SCALES, MappedBlock, MappedCache
from kfacx.blocks._norms import NORM_TYPES, Factor, block_norm, check_norm_type, kronecker_pieces
from kfacx.blocks._reduce import ConvTwoKroneckerFactoredReduce, DenseTwoKroneckerFactoredReduce
from kfacx.blocks._sliced import SLICED_TAG, SlicedBlock
from kfacx.blocks._stacked import StackedBlock
from kfacx.blocks._tied import (
    TIED_TAG,
    TiedCache,
    TiedEigen,
    TiedFactor,
    TiedKroneckerFactored,
)
from kfacx.blocks._tnt import ConvTNT, DenseTNT
from kfacx.blocks._views import ViewBlock, effective_layer, view_ctor

__all__ = [
    "BlockState",
    "CURVATURE_BLOCKS",
    "ConvEKFAC",
    "ConvTNT",
    "ConvTwoKroneckerFactored",
    "ConvTwoKroneckerFactoredReduce",
    "CurvatureBlock",
    "DenseEKFAC",
    "DenseTNT",
    "DenseTwoKroneckerFactored",
    "DenseTwoKroneckerFactoredReduce",
    "Diagonal",
    "EKFACCache",
    "EmbeddingCache",
    "EmbeddingEKFAC",
    "EmbeddingEigen",
    "EmbeddingKroneckerFactored",
    "EmbeddingPair",
    "Full",
    "FullEigen",
    "InverseRefresh",
    "KroneckerCache",
    "KroneckerEigen",
    "KroneckerPair",
    "NORM_TYPES",
    "Factor",
    "LayerInfo",
    "MAP_SCALES",
    "MappedBlock",
    "MappedCache",
    "ScaleAndShiftDiagonal",
    "SLICED_TAG",
    "ScaleAndShiftFull",
    "SlicedBlock",
    "StackedBlock",
    "TIED_TAG",
    "TiedCache",
    "TiedEigen",
    "TiedFactor",
    "TiedKroneckerFactored",
    "TwoKroneckerFactored",
    "ViewBlock",
    "WeightedMovingAverage",
    "block_norm",
    "check_norm_type",
    "curvature_block_ctors",
    "effective_layer",
    "flatten_params",
    "kronecker_pieces",
    "layer_block",
    "unflatten_params",
    "view_ctor",
]
