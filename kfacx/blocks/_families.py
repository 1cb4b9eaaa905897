"""Block families: the blocks of the dense and convolution (and, for EKFAC, embedding)
tags, chosen by name.

`kfacx.BlockDiagonalCurvature` (and `kfacx.Optimizer`) take ``curvature_block``,
one of `CURVATURE_BLOCKS`, for the whole model; ``layer_tag_to_block_ctor`` still
overrides it tag by tag.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from kfacx.blocks._diagonal_full import Diagonal, ScaleAndShiftDiagonal
from kfacx.blocks._ekfac import ConvEKFAC, DenseEKFAC, EmbeddingEKFAC
from kfacx.blocks._embedding import EmbeddingKroneckerFactored
from kfacx.blocks._kronecker import ConvTwoKroneckerFactored, DenseTwoKroneckerFactored
from kfacx.blocks._reduce import ConvTwoKroneckerFactoredReduce, DenseTwoKroneckerFactoredReduce
from kfacx.blocks._tied import TIED_TAG, TiedKroneckerFactored
from kfacx.blocks._tnt import ConvTNT, DenseTNT

#: The block class used for each built-in layer tag (`kfacx.BlockDiagonalCurvature`'s
#: default ``layer_tag_to_block_ctor``).
DEFAULT_LAYER_TAG_TO_BLOCK_CTOR: Mapping[str, Callable[..., Any]] = {
    "dense_tag": DenseTwoKroneckerFactored,
    "conv_tag": ConvTwoKroneckerFactored,
    "scale_and_shift_tag": ScaleAndShiftDiagonal,
    "embedding_tag": EmbeddingKroneckerFactored,
    "generic_tag": Diagonal,
    TIED_TAG: TiedKroneckerFactored,
}

#: ``curvature_block`` name -> the block class of each tag it sets.
CURVATURE_BLOCKS: Mapping[str, Mapping[str, Callable[..., Any]]] = {
    # K-FAC ("expand" for layers over shared positions): every position a row.
    "kfac": {"dense_tag": DenseTwoKroneckerFactored, "conv_tag": ConvTwoKroneckerFactored},
    # K-FAC-reduce: inputs averaged and cotangents summed over the positions.
    "kfac_reduce": {
        "dense_tag": DenseTwoKroneckerFactoredReduce,
        "conv_tag": ConvTwoKroneckerFactoredReduce,
    },
    # TNT (tensor-normal training, kfac-jax's semantics): L (x) R / tr L.
    "tnt": {"dense_tag": DenseTNT, "conv_tag": ConvTNT},
    # EKFAC: K-FAC's eigenbasis with the scaling re-estimated every step.
    "ekfac": {"dense_tag": DenseEKFAC, "conv_tag": ConvEKFAC, "embedding_tag": EmbeddingEKFAC},
}


def curvature_block_ctors(name: Any) -> dict[str, Callable[..., Any]]:
    """The block classes of the family ``name`` (a key of `CURVATURE_BLOCKS`).

    Raises:
      ValueError: for an unknown name, listing the known ones.
    """
    if not isinstance(name, str) or name not in CURVATURE_BLOCKS:
        raise ValueError(
            f"curvature_block must be one of {sorted(CURVATURE_BLOCKS)}, got {name!r} (per "
            "tag, pass layer_tag_to_block_ctor instead)."
        )
    return dict(CURVATURE_BLOCKS[name])
