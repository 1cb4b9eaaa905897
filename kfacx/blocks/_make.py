"""`layer_block`: the curvature block of a layer, from the block classes of its tags."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from kfacx.blocks._base import CurvatureBlock, LayerInfo
from kfacx.blocks._stacked import StackedBlock
from kfacx.blocks._views import view_ctor

#: A block class, or a factory taking a `LayerInfo`.
BlockCtor = Callable[[LayerInfo], CurvatureBlock]


def layer_block(layer: LayerInfo, ctors: Mapping[str, BlockCtor]) -> CurvatureBlock:
    """The block of ``layer``: ``ctors[layer.tag_name]``, wrapped in a `ViewBlock` for
    parameters concatenated from leaves, and in a `StackedBlock` for a stacked layer (a
    `lax.scan` over its parameters: one block per slice).

    Raises:
      ValueError: if ``ctors`` has no block class for the layer's tag.
    """
    ctor = ctors.get(layer.tag_name)
    if ctor is None:
        raise ValueError(
            f"No curvature block for layer tag {layer.tag_name!r} ({layer.name}); pass "
            f"layer_tag_to_block_ctor={{{layer.tag_name!r}: SomeBlockClass}}."
        )
    ctor = view_ctor(layer, ctor)
    if layer.stack_size is not None:
        return StackedBlock(layer, ctor)
    return ctor(layer)
