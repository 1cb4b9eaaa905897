"""Finding `GraphPattern` occurrences in a jaxpr.

A match is a structural unification, backwards from the pattern's output
equation: primitives must agree (their params may differ — shapes, axes and
strides are read by the pattern's parameter extractor), pattern inputs bind to
any value, and pattern parameters bind to parameter leaves of the model, seen
through shape-only operations (broadcasts, reshapes, casts). Shape-only
operations of the model between two of the pattern's operations (the rank
promotion of ``(1 + g) / std`` when ``g`` has fewer axes than ``std``, a cast)
are matched along, so a pattern needs no variant per place where broadcasting
happens (write patterns whose example arguments have one rank). A pattern without
inputs (a parameter used as it is, e.g. tiled over the batch) matches the end of
such a chain instead (`GraphPattern`). Every structural
match is then verified numerically: the matched equations and the tag's
``compute`` must give the same output on random values, so a match never
changes what the model computes nor mislabels a layer (`kfacx.graph_matcher._verify`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax.extend as jex
import numpy as np

from kfacx import tags
from kfacx._helpers import _jaxpr
from kfacx._helpers import _views as views_meta
from kfacx.graph_matcher import _elementwise, _views
from kfacx.graph_matcher._claims import MANUAL, can_tie, check_unambiguous, claim_key
from kfacx.graph_matcher._graph import SHAPE_ONLY, Graph, Match
from kfacx.graph_matcher._pattern import OUTPUT_PERMUTATION, GraphPattern
from kfacx.graph_matcher._verify import prefetch, verified

_COMMUTATIVE = {"add", "mul", "add_any"}


@dataclasses.dataclass
class _State:
    """Pattern inputs and parameters -> model values; pattern equations (by id) -> model
    equations; ``bridges``: the model's shape-only equations matched along."""

    binding: dict[Any, Any]
    matched: dict[int, Any]
    bridges: list[Any] = dataclasses.field(default_factory=list)

    def copy(self) -> _State:
        return _State(dict(self.binding), dict(self.matched), list(self.bridges))

    def eqns(self) -> list[Any]:
        """The matched model equations (bridges included), each once."""
        out = {id(e): e for e in self.matched.values()}
        out.update((id(e), e) for e in self.bridges)
        return list(out.values())


class _Unifier:
    def __init__(self, pattern: GraphPattern, graph: Graph, claimed: set[int]):
        p = pattern.jaxpr
        self.graph = graph
        self.claimed = claimed
        self.inputs = set(p.invars[: pattern.num_inputs])
        self.params = set(p.invars[pattern.num_inputs :])
        self.producer = {v: e for e in p.eqns for v in e.outvars}

    def _pattern_param(self, pv) -> Any | None:
        """The pattern parameter behind a chain of pattern shape-only ops, if any."""
        while pv not in self.params:
            eqn = self.producer.get(pv)
            if eqn is None or eqn.primitive.name not in SHAPE_ONLY:
                return None
            pv = eqn.invars[0]
        return pv

    def unify(self, pv, tv, state: _State) -> _State | None:
        if pv in state.binding:
            return state if state.binding[pv] is tv else None
        if pv in self.inputs:
            state.binding[pv] = tv
            return state
        param = self._pattern_param(pv)
        if param is not None:
            found = _views.resolve(self.graph, tv)  # a leaf, or a concatenation of leaves
            if found is None:
                return None
            if param in state.binding:
                return state if _views.same_source(state.binding[param], found) else None
            state.binding[param] = found
            return state
        return self._unify_eqn(pv, tv, state)

    def _unify_eqn(self, pv, tv, state: _State) -> _State | None:
        p_eqn, t_eqn = self.producer.get(pv), self.graph.producer.get(tv)
        if p_eqn is None or t_eqn is None or id(t_eqn) in self.claimed:
            return None
        if p_eqn.primitive.name != t_eqn.primitive.name:
            return self._bridge(pv, t_eqn, state)
        if len(p_eqn.invars) != len(t_eqn.invars):
            return None
        if p_eqn.outvars.index(pv) != t_eqn.outvars.index(tv):
            return None
        if id(p_eqn) in state.matched:
            return state if state.matched[id(p_eqn)] is t_eqn else None
        state.matched[id(p_eqn)] = t_eqn
        orders = [list(t_eqn.invars)]
        if p_eqn.primitive.name in _COMMUTATIVE:
            orders.append(list(reversed(t_eqn.invars)))
        for t_invars in orders:
            result = self._unify_operands(p_eqn.invars, t_invars, state.copy())
            if result is not None:
                return result
        return None

    def _bridge(self, pv, t_eqn, state: _State) -> _State | None:
        """Matches ``pv`` to the operand of ``t_eqn``, a shape-only operation of the model
        the pattern does not have (a broadcast, reshape or cast), matched along."""
        if t_eqn.primitive.name not in SHAPE_ONLY or isinstance(t_eqn.invars[0], jex.core.Literal):
            return None
        state.bridges.append(t_eqn)
        return self.unify(pv, t_eqn.invars[0], state)

    def _unify_operands(self, p_invars, t_invars, state: _State) -> _State | None:
        for pi, ti in zip(p_invars, t_invars, strict=True):
            if isinstance(pi, jex.core.Literal):
                if not isinstance(ti, jex.core.Literal):
                    return None
                continue
            if isinstance(ti, jex.core.Literal):
                return None
            state = self.unify(pi, ti, state)
            if state is None:
                return None
        return state


def _internal_values_escape(graph: Graph, eqns: list[Any], output_var) -> bool:
    """Whether a value computed inside the match is used outside of it."""
    inside = {id(e) for e in eqns}
    for eqn in eqns:
        for v in eqn.outvars:
            if v is output_var:
                continue
            if v in graph.outvars or any(id(u) not in inside for u in graph.users.get(v, [])):
                return True
    return False


def _try_match(pattern, graph, t_eqn, claimed, claims, notes) -> Match | None:
    """The match of ``pattern`` whose output equation is ``t_eqn``, if it unifies, passes
    the numerical check and kfacx can serve it (else None, and maybe a note)."""
    match = _structural_match(pattern, graph, t_eqn, claimed)
    if match is None or not verified(match, graph):
        return None
    origins = [graph.origin[v] for v in match.param_vars]
    if not _servable_in_scans(pattern, origins, match.param_leaves, notes):
        return None
    if not _claims_allow(match, claims, notes):
        return None
    return match


def _structural_match(pattern, graph, t_eqn, claimed) -> Match | None:
    """The match by unification (before the numerical check), or None."""
    if pattern.num_inputs:
        bound = _unify_output(pattern, graph, t_eqn, claimed)
    else:
        bound = _parameter_chain(graph, t_eqn, claimed)
    if bound is None:
        return None
    inputs, params, eqns, tv = bound
    if _constant_inputs(graph, inputs):
        return None
    flat = _views.flatten(params)  # parameters concatenated from leaves
    params, exprs, view_eqns = flat if flat is not None else (params, None, [])
    origins = [graph.origin[v] for v in params]
    leaves = [_jaxpr.leaf_origin(o) for o in origins]
    if len(set(leaves)) != len(leaves) or _internal_values_escape(graph, eqns, tv):
        return None
    extracted = _extract_meta(pattern, eqns)
    if extracted is None:
        return None
    meta, permutation = extracted
    if not _bias_fits(pattern, meta, params, exprs) or _spans_batch(pattern, params, exprs, tv):
        return None
    stacked = any(_jaxpr.slice_levels(o) for o in origins)
    if exprs is not None:
        shapes = [v.aval.shape for v in params]
        if not _views.servable(pattern, meta, exprs, shapes, stacked):
            return None
        meta[views_meta.VIEWS] = exprs
    eqns = sorted([*eqns, *_elementwise.map_eqns(view_eqns)], key=lambda e: graph.order[id(e)])
    match = Match(pattern, eqns, inputs, params, leaves, tv, meta, stacked, permutation)
    match.view_eqns = view_eqns
    return match


def _bias_fits(pattern, meta: dict, params, exprs) -> bool:
    """Whether a dense or conv match's bias (its second parameter, as the layer reads it)
    has the layer's output features, leading ones aside (`kfacx.register_dense`'s
    contract). A bias broadcast from one entry (``x @ w + jnp.broadcast_to(b, (1, n))``
    with ``b: [1]``) taken for the layer's bias would be refused by the estimator's block
    at set-up (a case the detection fuzzer draws); refused here, the layer is matched
    without it."""
    name = pattern.tag_primitive.name
    shapes = [v.aval.shape for v in params]
    if exprs is not None:
        shapes = [views_meta.shape(e, shapes) for e in exprs]
    if name not in (tags.dense.name, tags.conv.name) or len(shapes) != 2:
        return True
    w, b = shapes
    dims = meta.get("dimension_numbers")
    if name == tags.conv.name:
        if dims is None or len(dims.rhs_spec) != len(w):
            return True  # a weight read through a reshape: other checks refuse the match
        outputs = (w[dims.rhs_spec[0]],)
    else:
        (_, w_axes), (_, w_batch) = dims
        if len(w) < 2 or any(a >= len(w) for a in (*w_axes, *w_batch)):
            return True  # as above
        outputs = tuple(d for i, d in enumerate(w) if i not in (*w_axes, *w_batch))
        outputs = ((*(w[i] for i in w_batch), *outputs), outputs)
        return _strip_ones(b) in {_strip_ones(o) for o in outputs}
    return _strip_ones(b) == _strip_ones(outputs)


def _spans_batch(pattern, params, exprs, output_var) -> bool:
    """Whether a scale-and-shift match's parameter (as the layer reads it) spans the
    output's leading (batch) axis: then it is no per-feature parameter but one value per
    row (``h + w`` with ``w`` shaped like ``h``, where a weight's first size equals the
    batch size), and a full block's per-example gradients could not broadcast it over one
    example (a case the detection fuzzer draws: the scale-and-shift compute would raise
    an internal ValueError)."""
    if pattern.tag_primitive.name != tags.scale_and_shift.name:
        return False
    out = output_var.aval.shape
    shapes = [v.aval.shape for v in params]
    if exprs is not None:
        shapes = [views_meta.shape(e, shapes) for e in exprs]
    return bool(out) and any(len(s) == len(out) and s[0] != 1 for s in shapes)


def _strip_ones(shape) -> tuple[int, ...]:
    shape = tuple(shape)
    return shape[next((i for i, d in enumerate(shape) if d != 1), len(shape)) :]


def _constant_inputs(graph, inputs) -> bool:
    """Whether a match's inputs are constants that are not the batch's: a ramp, a mask or
    indices from ``np.arange`` (``b + iota``, ``w[perm]``). Such a "layer" is the
    parameter through a map with constant operands, which a layer that uses the result
    may read as a view; matched as a layer, its statistics would take the constant's rows
    for the batch's examples and the curvature would be wrong (cases the detection fuzzer
    draws: a layer norm's offset plus a ramp would become a shift layer on the ramp,
    ``x @ w[perm]`` an embedding of the indices). A constant whose rows are the batch's
    and all equal (an RNN's zero initial state) is still a layer's input
    (`_batch_constant`)."""
    if not inputs or not all(graph.constants.is_constant(v) for v in inputs):
        return False
    return not all(_batch_constant(graph, v) for v in inputs)


def _batch_constant(graph, var) -> bool:
    """Whether a constant has the batch on its leading axis, all its rows equal."""
    shape = var.aval.shape
    if not shape or (graph.batch_sizes is not None and shape[0] not in graph.batch_sizes):
        return False
    value = graph.constants.value(var)
    return value is not None and bool(np.all(value == value[:1]))


def _unify_output(pattern, graph, t_eqn, claimed) -> tuple | None:
    """Unifies the pattern's output with that of ``t_eqn``: ``(input_vars, param_vars,
    matched equations in jaxpr order, output_var)``, or None."""
    p = pattern.jaxpr
    p_out = p.outvars[0]
    p_last = next((e for e in p.eqns if p_out in e.outvars), None)
    if p_last is None or p_last.primitive.name != t_eqn.primitive.name:
        return None
    tv = t_eqn.outvars[p_last.outvars.index(p_out)]
    state = _Unifier(pattern, graph, claimed).unify(p_out, tv, _State({}, {}))
    if state is None:
        return None
    inputs = [state.binding.get(v) for v in p.invars[: pattern.num_inputs]]
    params = [state.binding.get(v) for v in p.invars[pattern.num_inputs :]]
    if any(v is None for v in inputs + params) or any(v in params for v in inputs):
        return None
    eqns = sorted(state.eqns(), key=lambda e: graph.order[id(e)])
    return inputs, params, eqns, tv


def _parameter_chain(graph, t_eqn, claimed) -> tuple | None:
    """A pattern without inputs, at ``t_eqn``: ``([], [leaf var], chain, output_var)`` if
    ``t_eqn`` ends a chain of unclaimed shape-only operations from a parameter leaf, its
    result has the batch on its leading axis and no match reads it as that parameter (a
    bias is broadcast before it is added), else None."""
    if t_eqn.primitive.name not in SHAPE_ONLY or len(t_eqn.outvars) != 1:
        return None
    tv = t_eqn.outvars[0]
    sizes, shape = graph.batch_sizes, tv.aval.shape
    if not shape or (sizes is not None and shape[0] not in sizes) or not graph.chain_end(tv):
        return None
    found = graph.param_leaf(tv)
    if found is None or any(id(e) in claimed for e in found[1]):
        return None
    leaf, chain = found
    if graph.used_as_parameter(tv, leaf):
        return None
    return [], [leaf], sorted(chain, key=lambda e: graph.order[id(e)]), tv


def _extract_meta(pattern, eqns) -> tuple[dict, tuple[int, ...] | None] | None:
    """``(meta, output permutation)`` from the pattern's extractor, or None if it refuses."""
    try:
        meta = pattern.parameters_extractor_func(eqns)
    except ValueError:
        return None
    if meta is None:
        return None
    meta = dict(meta)
    permutation = meta.pop(OUTPUT_PERMUTATION, None)
    return meta, None if permutation is None else tuple(int(i) for i in permutation)


def _servable_in_scans(pattern, origins, leaves, notes: list) -> bool:
    """Whether the parameters are all stacked by one scan level, or all shared (else a note)."""
    sliced = {_jaxpr.slice_levels(o) for o in origins}
    if len(sliced) > 1:
        notes.append(
            (
                f"a `{pattern.name}` layer inside a `scan` has parameters the scan runs over (xs) "
                "and parameters it closes over (consts), or slices of different scans; kfacx "
                "serves a layer in scans whose parameters are all stacked by one scan or all "
                "shared, so it is not tagged",
                tuple(leaves),
            )
        )
        return False
    if any(len(levels) > 1 for levels in sliced):
        notes.append(
            (
                f"a `{pattern.name}` layer sits in nested `scan`s that both run over its "
                "parameters (two levels of stacking); kfacx serves one level, so it is not tagged",
                tuple(leaves),
            )
        )
        return False
    return True


def _claims_allow(match: Match, claims: dict, notes: list) -> bool:
    """Whether the parameters are free, or claimed by a layer they can be tied with (else a
    note, unless they are tagged by hand: the user's registration is kept as it is)."""
    leaves, pattern = match.param_leaves, match.pattern
    key = claim_key(pattern.tag_primitive.name, leaves, match.meta, match.stacked)
    if any(claims.get(leaf) == MANUAL for leaf in leaves):
        return False
    others = {k for leaf in leaves for k in _views.claimants(claims.get(leaf, key)) if k != key}
    shapes = dict(zip(leaves, (tuple(v.aval.shape) for v in match.param_vars), strict=True))
    if others and _views.can_share_slices(key, others):
        if _views.one_group(claims, leaves):
            return True  # (disjoint slices of the leaves)
        notes.append((_views.BRIDGE_NOTE.format(name=pattern.name), tuple(leaves)))
        return False
    if others and not all(can_tie(key, other, shapes) for other in others):
        if not pattern.num_inputs:
            return False  # A parameter-only layer is the reading of last resort: no note.
        notes.append(
            (
                f"a `{pattern.name}` layer reuses parameters of a different kind of layer; "
                "kfacx serves one 2-D weight shared by dense and embedding layers (tied "
                "embeddings, w and w.T), not this sharing, so only the first use is tagged "
                "and the curvature misses the others",
                tuple(leaves),
            )
        )
        return False
    return True


def find_matches(
    jaxpr: jex.core.Jaxpr,
    origins: Sequence[Any],
    patterns: Sequence[GraphPattern],
    claims: dict[int, tuple],
    notes: list[tuple[str, tuple[int, ...]]] | None = None,
    batch_sizes: Sequence[int] | None = None,
    constants: _elementwise.Constants | None = None,
) -> list[Match]:
    """All non-overlapping matches in one jaxpr (not its sub-jaxprs).

    Patterns are tried by decreasing precedence; an equation belongs to at most
    one match. ``claims`` maps parameter leaves to the `claim_key` of the layer
    that owns them (a `kfacx.graph_matcher._views.SlicedClaim` of several layers
    for a leaf whose disjoint slices they read): a new match may only reuse
    parameters as the same kind of layer (tied weights) or read other slices of
    them; ``claims`` is updated with the new matches. Parameter
    reuse that cannot be served is appended to ``notes`` as ``(text, leaves)``.
    ``batch_sizes``: the leading sizes of the batch's arrays, which the result of a
    pattern without inputs must have first (None: any); ``constants``: its values that
    depend on no input (for elementwise maps of parameters, ``w * mask``; None: literals
    and what they compute).
    """
    notes = [] if notes is None else notes
    graph = Graph(jaxpr, origins, batch_sizes, constants)
    _views.mixed_concatenation_notes(graph, notes)
    # The numerical checks the matching below may ask for, answered in one compiled
    # function: those of every structural match with nothing claimed yet (a superset).
    prefetch(graph, [m for p in patterns for m in _structural_matches(p, graph)])
    claimed: set[int] = set()
    matches: list[Match] = []
    for precedence in sorted({p.precedence for p in patterns}, reverse=True):
        group = [p for p in patterns if p.precedence == precedence]
        found = [_match_pattern(p, graph, set(claimed), dict(claims), notes) for p in group]
        found = _elementwise.prefer_unmapped(found)
        check_unambiguous(group, found)
        for pattern_matches in found:
            for match in pattern_matches:
                matches.append(match)
                claimed.update(id(e) for e in match.eqns)
                graph.owner.update((id(e), match) for e in match.eqns)
                key = claim_key(
                    match.pattern.tag_primitive.name, match.param_leaves, match.meta, match.stacked
                )
                _views.claim(claims, match.param_leaves, key)
    return matches


def _structural_matches(pattern, graph: Graph) -> list[Match]:
    """The structural matches of ``pattern`` at each of its candidate equations, nothing
    claimed (those without a numerical check: none)."""
    if pattern.tag_primitive.compute is None:
        return []
    found = (_structural_match(pattern, graph, e, set()) for e in graph.candidates(pattern))
    return [m for m in found if m is not None]


def _match_pattern(pattern, graph: Graph, claimed: set[int], claims: dict, notes) -> list[Match]:
    """All matches of one pattern, given what higher-precedence patterns claimed."""
    out = []
    for eqn in graph.candidates(pattern):
        if id(eqn) in claimed:
            continue
        match = _try_match(pattern, graph, eqn, claimed, claims, notes)
        if match is None:
            continue
        out.append(match)
        claimed.update(id(e) for e in match.eqns)
        key = claim_key(pattern.tag_primitive.name, match.param_leaves, match.meta, match.stacked)
        _views.claim(claims, match.param_leaves, key)
    return out
