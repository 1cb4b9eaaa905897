"""Tied layers: layer tags that share parameters make one layer, with one use per tag.

The same kind of layer on the same parameters (a layer applied twice, tied weights of
one kind) is one layer used several times; tags of different kinds sharing a weight (an
embedding table reused as the output projection, ``w`` and ``w.T``) make a *tied* layer
(pseudo tag `kfacx.blocks.TIED_TAG`) with one role per kind; tags that read disjoint
slices of the same parameters (``hk.GRU``'s ``w_h``, split between two dense layers)
make a *sliced* layer (pseudo tag `kfacx.blocks.SLICED_TAG`), one role per slice.
"""

from __future__ import annotations

import dataclasses

from kfacx._helpers import _views
from kfacx.blocks import SLICED_TAG, TIED_TAG, LayerInfo


def same_kind(first: LayerInfo, first_leaves, info: LayerInfo, leaf_ids) -> bool:
    """Whether two tags are the same layer applied twice (one block folds their uses)."""
    k = 1 if info.stack_size is None else 2  # per-example shapes: after [batch] or [L, batch]
    return (
        tuple(first_leaves) == tuple(leaf_ids)
        and first.tag_name == info.tag_name
        and first.stack_size == info.stack_size
        and dict(first.meta) == dict(info.meta)
        and [s[k:] for s in first.input_shapes] == [s[k:] for s in info.input_shapes]
        and [s[k:] for s in first.output_shapes] == [s[k:] for s in info.output_shapes]
    )


def join_layer(shared: set[int], layers, leaves_of, info: LayerInfo, leaf_ids) -> tuple[int, int]:
    """Adds a tag that shares parameters with an earlier layer: ``(layer, role)``.

    The same kind of layer on the same parameters is one more use of it (tied
    weights of one kind); another kind makes the layer a tied one (pseudo tag
    ``"tied"``, one role per kind, served by `kfacx.blocks.TiedKroneckerFactored`
    by default), updated in ``layers`` and ``leaves_of``.
    """
    if len(shared) > 1:
        paths = [p for i in sorted(shared) for p in layers[i].parameter_paths]
        raise ValueError(
            f"Layer {info.name} shares parameters with several other layer tags ({paths}); "
            "one block serves one group of shared parameters. Tag the shared parameters once, "
            "or with kfacx.register_generic."
        )
    (index,) = shared
    first = layers[index]
    roles = first.roles or (first,)
    role_params = first.role_params or (tuple(range(len(leaves_of[index]))),)
    for r, (role, positions) in enumerate(zip(roles, role_params, strict=True)):
        if same_kind(role, [leaves_of[index][i] for i in positions], info, leaf_ids):
            role = dataclasses.replace(role, num_uses=role.num_uses + info.num_uses)
            roles = roles[:r] + (role,) + roles[r + 1 :]
            if first.roles:
                layers[index] = dataclasses.replace(first, roles=roles)
            else:
                layers[index] = role
            return index, r
    leaves = list(leaves_of[index]) + [i for i in leaf_ids if i not in leaves_of[index]]
    roles += (info,)
    role_params += (tuple(leaves.index(i) for i in leaf_ids),)
    shapes, paths, dtypes = {}, {}, {}
    for role, positions in zip(roles, role_params, strict=True):
        for j, pos in enumerate(positions):
            shapes[pos] = tuple(role.parameter_shapes[j])
            paths[pos] = role.parameter_paths[j]
            dtypes[pos] = role.parameter_dtypes[j]
    layers[index] = LayerInfo(
        tag_name=_joined_tag(roles, role_params, leaves, paths),
        parameter_paths=tuple(paths[i] for i in range(len(leaves))),
        parameter_shapes=tuple(shapes[i] for i in range(len(leaves))),
        parameter_dtypes=tuple(dtypes[i] for i in range(len(leaves))),
        roles=roles,
        role_params=role_params,
    )
    leaves_of[index] = tuple(leaves)
    return index, len(roles) - 1


def _sliced(info: LayerInfo) -> bool:
    return any(map(_views.is_sliced, _views.views_of(info.meta) or ()))


def _joined_tag(roles, role_params, leaves, paths) -> str:
    """`SLICED_TAG` when every role reads its own slices of the parameters, else
    `TIED_TAG`.

    Raises:
      ValueError: if roles reading slices read an entry twice.
    """
    if not all(map(_sliced, roles)):
        return TIED_TAG
    boxes = []
    for role, positions in zip(roles, role_params, strict=True):
        role_boxes = _views.all_boxes(_views.views_of(role.meta))
        boxes += _views.renumber_boxes(role_boxes or [(0, None, None)], positions)
    if not _views.disjoint(boxes):
        names = [paths[i] for i in range(len(leaves))]
        raise ValueError(
            f"Layers read overlapping slices of parameters {names}; kfacx serves a parameter "
            "split into disjoint slices, one per layer. Register the layers on separate "
            "parameters, or tag the parameter with kfacx.register_generic."
        )
    return SLICED_TAG
