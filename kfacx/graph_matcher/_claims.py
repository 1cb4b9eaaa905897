"""Which layers may share parameters: the claim a match makes on its parameter leaves,
tied weights, and the ambiguity of two patterns of equal precedence matching one layer."""

from __future__ import annotations

from collections.abc import Sequence

from kfacx._helpers import _views as views_meta
from kfacx.graph_matcher import _views
from kfacx.graph_matcher._graph import Match
from kfacx.graph_matcher._pattern import GraphPattern

#: The claim of a parameter that is tagged by hand in the model.
MANUAL = ("manual",)


def claim_key(tag_name: str, leaves: Sequence[int], meta: dict, stacked: bool = False) -> tuple:
    """What a layer claims of its parameters: a later match may share them (tied
    weights) only if it is the same kind of layer on the same parameters (stacked
    slices of them, or the whole parameters)."""
    return (tag_name, tuple(leaves), tuple(sorted(meta.items())), stacked)


#: Layer tags whose uses of one 2-D weight a tied block serves together
#: (`kfacx.blocks.TiedKroneckerFactored`): tied embeddings, w and w.T.
TIEABLE_TAGS = ("dense_tag", "embedding_tag")


def can_tie(key: tuple, other: tuple, shapes: dict[int, tuple[int, ...]]) -> bool:
    """Whether two layers (`claim_key`s) that share parameters make one tied layer: both
    dense or embedding layers, not stacked, sharing one 2-D weight, their first parameter
    (``shapes``: leaf -> shape)."""
    shared = set(key[1]) & set(other[1])
    if len(shared) != 1 or key[3] or other[3]:
        return False
    if any(views_meta.VIEWS in dict(k[2]) for k in (key, other)):
        return False  # (a tied block serves whole weights)
    (leaf,) = shared
    return (
        key[0] in TIEABLE_TAGS
        and other[0] in TIEABLE_TAGS
        and key[1][0] == leaf == other[1][0]
        and len(shapes.get(leaf, ())) == 2
    )


class AmbiguousPatternsError(ValueError):
    """Two patterns of equal precedence match the same equations or parameters."""

    def __init__(self, first: GraphPattern, second: GraphPattern, leaves: Sequence[int]):
        self.patterns = (first, second)
        self.leaves = tuple(leaves)
        super().__init__(
            f"Patterns {first.name!r} and {second.name!r} (both precedence {first.precedence}) "
            f"match the same layer (parameter leaves {self.leaves}); give one of them a higher "
            "precedence, or remove one."
        )


def check_unambiguous(group: Sequence[GraphPattern], found: Sequence[list[Match]]) -> None:
    """Raises if two patterns of the group claim the same equations, or the same
    parameters in a way no block serves together (a tied weight is not ambiguous)."""
    owner_eqn: dict[int, GraphPattern] = {}
    owner_leaf: dict[int, tuple[GraphPattern, Match]] = {}
    for pattern, pattern_matches in zip(group, found, strict=True):
        for m in pattern_matches:
            others = [owner_eqn.get(id(e)) for e in m.eqns]
            for leaf in m.param_leaves:
                if leaf in owner_leaf and not _tied(owner_leaf[leaf][1], m):
                    others.append(owner_leaf[leaf][0])
            other = next((o for o in others if o is not None and o is not pattern), None)
            if other is not None:
                raise AmbiguousPatternsError(other, pattern, m.param_leaves)
            owner_eqn.update({id(e): pattern for e in m.eqns})
            owner_leaf.update({leaf: (pattern, m) for leaf in m.param_leaves})


def _tied(first: Match, second: Match) -> bool:
    keys = [
        claim_key(m.pattern.tag_primitive.name, m.param_leaves, m.meta, m.stacked)
        for m in (first, second)
    ]
    shapes = {
        leaf: tuple(v.aval.shape)
        for m in (first, second)
        for leaf, v in zip(m.param_leaves, m.param_vars, strict=True)
    }
    shared = keys[0] == keys[1] or _views.can_share_slices(keys[0], keys[1:])
    return shared or can_tie(keys[0], keys[1], shapes)
