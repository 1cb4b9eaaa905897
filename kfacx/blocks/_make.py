"""`layer_block`: the curvature block of a layer, from the block classes of its tags."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from kfacx.blocks._base import CurvatureBlock, LayerInfo
from kfacx.blocks._sliced import SLICED_TAG, SlicedBlock
from kfacx.blocks._stacked import StackedBlock
from kfacx.blocks._views import view_ctor

#: A block class, or a factory taking a `LayerInfo`.
BlockCtor = Callable[[LayerInfo], CurvatureBlock]


def layer_block(layer: LayerInfo, ctors: Mapping[str, BlockCtor]) -> CurvatureBlock:
    """The block of ``layer``: ``ctors[layer.tag_name]``, wrapped in a `ViewBlock` for
    parameters concatenated from leaves, and in a `StackedBlock` for a stacked layer (a
    `lax.scan` over its parameters: one block per slice). A layer whose parameters are
    split into slices between layers (pseudo tag `SLICED_TAG`) gets a `SlicedBlock` of
    its roles' blocks, unless ``ctors`` names a block for it.

    Raises:
      ValueError: if ``ctors`` has no block class for the layer's tag (or a role's).
    """
    if layer.tag_name == SLICED_TAG and SLICED_TAG not in ctors:
        return SlicedBlock(layer, lambda role: _ctor(role, ctors))
    ctor = _ctor(layer, ctors)
    ctor = view_ctor(layer, ctor)
    if layer.stack_size is not None:
        return StackedBlock(layer, ctor)
    return ctor(layer)


def _ctor(layer: LayerInfo, ctors: Mapping[str, BlockCtor]) -> BlockCtor:
    ctor = ctors.get(layer.tag_name)
    if ctor is None:
        raise ValueError(
            f"No curvature block for layer tag {layer.tag_name!r} ({layer.name}); pass "
            f"layer_tag_to_block_ctor={{{layer.tag_name!r}: SomeBlockClass}}."
        )
    return ctor
