"""The `LayerInfo` of a layer tag equation: its parameters, shapes and metadata.

`layer_info` reads a tag's operands (a stacked dense layer, batched over its weight's
leading axis, is described by one slice); `scan_layer_info` adapts it to the
`lax.scan`s the tag sits in: a scan over its parameters makes a *stacked* layer, the
iterations of the other scans are uses of one layer.
"""

from __future__ import annotations

import dataclasses
import math

from kfacx import tags
from kfacx._helpers import _jaxpr
from kfacx.blocks import LayerInfo


def layer_info(tag, eqn, ins, param_paths) -> tuple[LayerInfo, tuple[int, ...]]:
    outputs, inputs, params = tag.split(eqn.invars)
    _, _, param_origins = tag.split(ins)
    bad = [i for i, o in enumerate(param_origins) if o is None]
    if bad:
        raise ValueError(
            f"Layer tag {tag.name!r}: parameter operand {bad[0]} is computed inside the function "
            "(or is a constant), not a leaf of the parameters. Pass the parameter array itself "
            "to the register_* call."
        )
    leaf_ids = tuple(_jaxpr.leaf_origin(o) for o in param_origins)
    info = LayerInfo(
        tag_name=tag.name,
        parameter_paths=tuple(param_paths[i] for i in leaf_ids),
        parameter_shapes=tuple(tuple(v.aval.shape) for v in params),
        parameter_dtypes=tuple(v.aval.dtype for v in params),
        input_shapes=tuple(tuple(v.aval.shape) for v in inputs),
        output_shapes=tuple(tuple(v.aval.shape) for v in outputs),
        meta=dict(eqn.params),
        compute=tag.compute,
    )
    axis = tags.stacked_input_axis(tag.name, eqn.params, info.parameter_shapes)
    if axis is not None:
        # A stacked dense layer (a batch dimension over the weight's leading axis): the
        # slices are separate layers, described like those of a scan over parameters.
        (x_shape,) = info.input_shapes
        moved = (x_shape[axis],) + x_shape[:axis] + x_shape[axis + 1 :]
        info = dataclasses.replace(
            info,
            input_shapes=(moved,),
            meta=tags.dense_slice_meta(eqn.params["dimension_numbers"]),
            stack_size=int(info.parameter_shapes[0][0]),
        )
    return info, leaf_ids


def scan_layer_info(
    info: LayerInfo, param_origins, scans
) -> tuple[LayerInfo, tuple[int, ...], int | None]:
    """A layer tag inside (nested) `lax.scan`s: ``(LayerInfo, scan lengths, stacked level)``.

    Parameters a scan runs over (``xs``, e.g. `hk.layer_stack`) make a stacked
    layer (shapes with the leading layer axis, ``stack_size`` set; the level is
    that scan's index among ``scans``); the iterations of the other scans, which
    close over the parameters (``consts``), are uses of one layer (``num_uses``
    = the product of their lengths). Outside scans: ``(info, (), None)``.

    Raises:
      ValueError: for parameters stacked by two scans, by different scans, or
        stacked and shared in one layer.
    """
    if not scans:
        return info, (), None
    levels = [_jaxpr.slice_levels(o) for o in param_origins]
    _check_scan_stacking(info, levels)
    lengths = tuple(int(scan.params["length"]) for scan in scans)
    level = levels[0][0] if levels and levels[0] else None
    folded = math.prod(n for i, n in enumerate(lengths) if i != level)
    info = dataclasses.replace(info, num_uses=info.num_uses * folded)
    if level is None:
        return info, lengths, None
    size = lengths[level]

    def stack(shapes):
        return tuple((size, *s) for s in shapes)

    return (
        dataclasses.replace(
            info,
            parameter_shapes=stack(info.parameter_shapes),
            input_shapes=stack(info.input_shapes),
            output_shapes=stack(info.output_shapes),
            stack_size=size,
        ),
        lengths,
        level,
    )


def _check_scan_stacking(info: LayerInfo, levels: list[tuple[int, ...]]) -> None:
    """Raises unless the layer's parameters (their `kfacx._helpers._jaxpr.slice_levels`) are all
    sliced by one scan, or all closed over, and the layer is not a stacked dense one."""
    if info.stack_size is not None:
        raise ValueError(
            f"Layer {info.name} is a stacked dense layer (a batch dimension over its weight's "
            "leading axis) inside a `scan`; kfacx serves one level of stacking. Move the "
            "layer out of the scan, or scan over the slices instead of batching them."
        )
    if any(len(lv) > 1 for lv in levels):
        raise ValueError(
            f"Layer {info.name} sits in nested `scan`s that both run over its parameters (two "
            "levels of stacking); kfacx serves one. Flatten the two stacked axes into one "
            "scan, or unroll one of the loops."
        )
    stacked = [bool(lv) for lv in levels]
    if any(stacked) and not all(stacked) or len(set(levels)) > 1:
        sliced = [p for p, s in zip(info.parameter_paths, stacked, strict=True) if s]
        closed = [p for p, s in zip(info.parameter_paths, stacked, strict=True) if not s]
        raise ValueError(
            f"Layer {info.name} inside a `scan` takes parameters {sliced} as scanned-over inputs "
            f"(xs: one slice per iteration) and {closed} as closed-over constants (the same at "
            "every iteration), or slices of different scans. kfacx serves a layer in a scan "
            "when all its parameters are stacked by one scan (like hk.layer_stack) or all are "
            "shared: scan over all of them, or close over all of them (or split the layer into "
            "two registered layers)."
        )
