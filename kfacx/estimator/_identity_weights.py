"""The identity weight (damping) of every curvature block: one for all blocks, one per
block, and kfac-jax's per-block scaling by a norm of the block
(``norm_to_scale_identity_weight_per_block``); and the dense block-diagonal matrix of
all blocks."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kfacx._helpers import _checks
from kfacx.blocks import BlockState, CurvatureBlock
from kfacx.blocks._norms import block_norm


def per_block(identity_weight: Any, num_blocks: int) -> tuple[Any, ...]:
    """One identity weight per block: a sequence of them as it is, else the one weight
    repeated.

    Raises:
      ValueError: for a sequence that does not have one weight per block.
    """
    if isinstance(identity_weight, (tuple, list)):
        if len(identity_weight) != num_blocks:
            raise ValueError(
                f"identity_weight has {len(identity_weight)} entries; pass one number, or one "
                f"per curvature block ({num_blocks})."
            )
        return tuple(identity_weight)
    return (identity_weight,) * num_blocks


def check(identity_weight: Any, what: str, allow_zero: bool) -> None:
    """`kfacx._helpers._checks.check_damping` of the weight, or of every per-block weight."""
    weights = identity_weight if isinstance(identity_weight, (tuple, list)) else [identity_weight]
    for w in weights:
        _checks.check_damping(w, what, allow_zero)


def scaled(
    blocks: Sequence[CurvatureBlock],
    states: Sequence[BlockState],
    identity_weight: Any,
    norm_type: str | None,
) -> Any:
    """``identity_weight`` (unchanged without ``norm_type``), each block's times the
    ``norm_type`` norm of its curvature (`kfacx.blocks.block_norm`). A block whose norm
    is 0 (nothing estimated yet) or not finite keeps its weight."""
    if norm_type is None:
        return identity_weight
    weights = per_block(identity_weight, len(blocks))
    return tuple(
        w * _usable(block_norm(b, s, norm_type))
        for b, s, w in zip(blocks, states, weights, strict=True)
    )


def _usable(norm: jax.Array) -> jax.Array:
    return jnp.where(jnp.isfinite(norm) & (norm > 0), norm, 1.0)


def dense_block_diagonal(
    blocks: Sequence[CurvatureBlock],
    states: Sequence[BlockState],
    layer_param_leaves: Sequence[Sequence[int]],
    num_param_leaves: int,
) -> jax.Array:
    """The blocks' dense matrices placed on the diagonal of one matrix over all
    parameters, flattened in pytree-leaf order (block ``i`` covers the parameter leaves
    ``layer_param_leaves[i]``)."""
    sizes = [0] * num_param_leaves
    for block, ids in zip(blocks, layer_param_leaves, strict=True):
        for i, shape in zip(ids, block.parameters_shapes, strict=True):
            sizes[i] = math.prod(shape)
    offsets = np.cumsum([0] + sizes)
    dtype = blocks[0].dtype if blocks else jnp.float32
    dense = jnp.zeros((offsets[-1], offsets[-1]), dtype)
    for block, s, ids in zip(blocks, states, layer_param_leaves, strict=True):
        index = np.concatenate([np.arange(offsets[i], offsets[i + 1]) for i in ids])
        dense = dense.at[index[:, None], index[None, :]].set(block.to_dense_matrix(s))
    return dense
