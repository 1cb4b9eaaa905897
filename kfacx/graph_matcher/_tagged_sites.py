"""What the layer tags already in a jaxpr say: which parameter leaves a hand-placed tag
claims (`manual_claims`), and for every tag site its layer, uses, stack size and kind
(`tagged_leaves`: the registration report's rows, before and after detection)."""

from __future__ import annotations

import math

from kfacx import tags
from kfacx._helpers import _jaxpr
from kfacx.graph_matcher import _views
from kfacx.graph_matcher._claims import MANUAL


def manual_claims(jaxpr, origins) -> dict[int, tuple]:
    claims = {}
    for eqn, ins, *_ in _jaxpr.tag_sites(jaxpr, origins):
        tag = tags.layer_tag_for(eqn.primitive)
        if tag is not None:
            claims.update(
                {_jaxpr.leaf_origin(o): MANUAL for o in tag.split(ins)[2] if o is not None}
            )
    return claims


def tagged_leaves(jaxpr, origins) -> dict[int, tuple[str, int, int, int | None, bool]]:
    """Parameter leaf -> (tag name, layer index, uses, stack size, in branch) for every layer
    tag, in evaluation order (a layer applied several times with the same parameters, e.g. at
    every iteration of a scan, is one layer; a scan over its parameters makes a stacked layer;
    parameters that layer tags of different kinds use make one tied layer, whose tag name
    lists the kinds: ``"tied(embedding_tag, dense_tag)"``; a layer all of whose uses sit in
    cond branches is *in branch*)."""
    out: dict[int, list] = {}
    kinds: dict[int, list[tuple]] = {}  # leaf -> (tag, meta) of each kind of use
    layer = 0
    for site in _jaxpr.tag_sites(jaxpr, origins):
        tag = tags.layer_tag_for(site.eqn.primitive)
        if tag is None:
            continue
        leaves, uses, size, kind = _use_summary(tag, site)
        in_branch = bool(site.branches)
        known = [o for o in leaves if o in out]
        if not known:
            out.update({o: [tag.name, layer, uses, size, in_branch] for o in leaves})
            kinds.update({o: [kind] for o in leaves})
            layer += 1
            continue
        index = out[known[0]][1]
        for o in leaves:
            if o not in out:
                out[o], kinds[o] = [tag.name, index, 0, size, in_branch], []
            out[o][2] += uses
            out[o][4] = out[o][4] and in_branch
            if kind not in kinds[o]:
                kinds[o].append(kind)
            if len(kinds[o]) > 1:
                out[o][0] = _joined_tag_name(kinds[o])
    return {o: tuple(v) for o, v in out.items()}


def _joined_tag_name(kinds: list[tuple]) -> str:
    """The report's tag of a layer whose parameters several kinds of tags use:
    ``"sliced(dense_tag, dense_tag)"`` when each reads its own slices of them (e.g. the
    column blocks of ``hk.GRU``'s ``w_h``), else ``"tied(embedding_tag, dense_tag)"``."""
    names = ", ".join(name for name, _ in kinds)
    return f"sliced({names})" if all(_views.sliced(dict(m)) for _, m in kinds) else f"tied({names})"


def _use_summary(tag: tags.LayerTag, site: _jaxpr.TagSite) -> tuple[list, int, int | None, tuple]:
    """``(parameter leaves, uses, stack size or None, kind)`` of one layer tag site: its
    iterations in scans that do not run over its parameters are uses; a scan over them,
    or a batch dimension over the weight's leading axis, makes it stacked."""
    params = [o for o in tag.split(site.origins)[2] if o is not None]
    levels = {level for o in params for level in _jaxpr.slice_levels(o)}
    lengths = [int(scan.params["length"]) for scan in site.scans]
    stacked, length = bool(levels), (lengths[min(levels)] if levels else None)
    uses = math.prod(n for i, n in enumerate(lengths) if i not in levels)
    shapes = [v.aval.shape for v in tag.split(site.eqn.invars)[2]]
    if tags.stacked_input_axis(tag.name, site.eqn.params, shapes) is not None:
        stacked, length = True, int(shapes[0][0])  # a stacked dense layer (batch dims)
    kind = (tag.name, tuple(sorted(site.eqn.params.items())))
    leaves = [_jaxpr.leaf_origin(o) for o in params]
    return leaves, uses, (length if stacked else None), kind
