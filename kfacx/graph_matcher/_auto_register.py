"""`auto_register_tags`: trace a function, match patterns, return a tagged function."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend as jex
import jax.numpy as jnp
import numpy as np

from kfacx import tags
from kfacx._helpers import _jaxpr, _user_warnings
from kfacx._helpers._paths import checked_param_paths, param_origins
from kfacx.graph_matcher import _custom_rules, _elementwise, _tagged_sites, _views
from kfacx.graph_matcher._claims import AmbiguousPatternsError
from kfacx.graph_matcher._defaults import DEFAULT_GRAPH_PATTERNS
from kfacx.graph_matcher._match import Match, find_matches
from kfacx.graph_matcher._pattern import GraphPattern
from kfacx.graph_matcher._report import RegistrationEntry, RegistrationReport

ON_UNMATCHED = ("warn", "error", "full")

_warn = _user_warnings.warn


@dataclasses.dataclass
class _Plan:
    """Matches of one jaxpr level, and the plans of the bodies below it: by equation (its
    ``id``), one plan per body the equation runs (`kfacx._helpers._jaxpr.bodies`: one for a call
    or scan body, one per branch of a cond)."""

    matches: list[Match]
    children: dict[int, tuple[_Plan, ...]]

    def drop(self, leaves: set[int]) -> None:
        """Removes, here and below, the matches that use any of ``leaves``."""
        self.matches = [m for m in self.matches if not leaves & set(m.param_leaves)]
        for plans in self.children.values():
            for plan in plans:
                plan.drop(leaves)

    def all_matches(self) -> list[Match]:
        out = list(self.matches)
        for plans in self.children.values():
            for plan in plans:
                out.extend(plan.all_matches())
        return out

    @property
    def empty(self) -> bool:
        return not (self.matches or self.children)


def _plan(
    jaxpr, origins, patterns, claims: dict, notes: list, depth=0, batch_sizes=None, consts=None
) -> _Plan:
    """Matches in ``jaxpr`` and, recursively, in call bodies, cond branches and (nested)
    scan bodies; ``depth`` counts the scans around ``jaxpr``; ``batch_sizes`` and
    ``consts`` (its `kfacx.graph_matcher._elementwise.Constants`): see `find_matches`.

    Origins follow `kfacx._helpers._jaxpr.bodies`: inside a scan body, parameters closed over
    (consts) keep their leaf index and scanned-over ones (xs) are labelled
    `kfacx._helpers._jaxpr.ScanSlice` (stacked layers); a cond branch sees the labels of the
    cond's operands after the index.
    """
    consts = consts or _elementwise.Constants(jaxpr)
    matches = find_matches(jaxpr, origins, patterns, claims, notes, batch_sizes, consts)
    if depth:
        matches = _without_stacked_dense(matches, notes)
    children = {}
    for eqn, ins in _jaxpr.eqns_with_origins(jaxpr, origins):
        if all(o is None for o in ins):
            continue
        inner = _jaxpr.bodies(eqn, ins, depth)
        if inner is None:
            _note_unseen_body(eqn, ins, notes)
            continue
        if _jaxpr.is_scan(eqn):
            _note_scan_carry(eqn, ins, notes)
        plans = tuple(
            _plan(
                b.jaxpr,
                b.origins,
                patterns,
                claims,
                notes,
                depth + (b.scan is not None),
                batch_sizes,
                _elementwise.body_constants(consts, eqn, b),
            )
            for b in inner
        )
        if not all(plan.empty for plan in plans):
            children[id(eqn)] = plans
    return _Plan(matches, children)


def _note_unseen_body(eqn, ins, notes: list) -> None:
    if any(True for _ in _jaxpr.sub_jaxprs(eqn)):
        notes.append(
            (
                f"parameters enter a `{eqn.primitive.name}` primitive, which detection "
                "does not look into yet; those used only there get the fallback block",
                tuple(_jaxpr.leaf_origin(o) for o in ins if o is not None),
            )
        )


def _without_stacked_dense(matches: list[Match], notes: list) -> list[Match]:
    """Drops stacked dense layers (batched over the weight's leading axis) found inside a
    scan body: kfacx serves one level of stacking, so they get the fallback block."""
    kept = []
    for m in matches:
        shapes = [v.aval.shape for v in m.param_vars]
        if tags.stacked_input_axis(m.pattern.tag_primitive.name, m.meta, shapes) is None:
            kept.append(m)
            continue
        notes.append(
            (
                "a stacked dense layer (batched over its weight's leading axis, e.g. experts) "
                "sits inside a `scan`; kfacx serves one level of stacking, so its parameters "
                "get the fallback block",
                tuple(m.param_leaves),
            )
        )
    return kept


def _note_scan_carry(eqn, ins, notes: list) -> None:
    nc, ncarry = _jaxpr.scan_counts(eqn.params)
    carried = tuple(_jaxpr.leaf_origin(o) for o in ins[nc : nc + ncarry] if o is not None)
    if carried:
        notes.append(
            (
                "parameters enter a `scan` as its carry (loop state); detection follows "
                "parameters the scan runs over (xs) or closes over (consts), so those used only "
                "through the carry get the fallback block",
                carried,
            )
        )


def _specs(func_args):
    return jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), tuple(func_args)
    )


def _evaluate(jaxpr, consts, args, plan: _Plan):
    """Evaluates ``jaxpr``, wrapping every match's output in its layer tag."""
    env: dict[Any, Any] = {}
    by_output = {id(m.output_var): m for m in plan.matches}

    def eval_eqn(eqn, invals):
        plans = plan.children.get(id(eqn))
        outvals = _jaxpr.bind_eqn(eqn, invals) if plans is None else _rebind(eqn, invals, plans)
        return [
            _tag_output(by_output.get(id(v)), val, env)
            for v, val in zip(eqn.outvars, outvals, strict=True)
        ]

    return _jaxpr.eval_jaxpr(jaxpr, consts, args, eval_eqn, env)


def _tag_output(match: Match | None, value, env):
    """``value``, wrapped in the tag of ``match`` (its operands read from ``env``)."""
    if match is None:
        return value
    params = [_jaxpr.read(env, u) for u in match.param_vars]
    inputs = [_jaxpr.read(env, u) for u in match.input_vars]
    inputs = match.pattern.tag_inputs(inputs, params, value)
    return _bind_tag(match, value, inputs, params)


def _rebind(eqn, invals, plans: tuple[_Plan, ...]):
    """An equation whose bodies hold matches, evaluated with tagged bodies."""
    if eqn.primitive.name in _CUSTOM_DERIVATIVES:
        return _rebind_custom(eqn, invals, plans[0])
    if _jaxpr.is_scan(eqn):
        return _rebind_scan(eqn, invals, plans[0])
    if _jaxpr.is_cond(eqn):
        return _switch(eqn, invals, plans)
    body, body_consts = _jaxpr.call_body(eqn)
    return _evaluate(body, body_consts, invals, plans[0])


def _bind_tag(match: Match, value, inputs, params):
    """``value`` wrapped in the match's tag (in the tag's output layout, see
    `kfacx.graph_matcher._pattern.OUTPUT_PERMUTATION`)."""
    perm = match.output_permutation
    if perm is not None:
        value = jnp.transpose(value, np.argsort(perm))
    value = match.pattern.tag_primitive.bind(value, *inputs, *params, **match.meta)[0]
    return value if perm is None else jnp.transpose(value, perm)


_CUSTOM_DERIVATIVES = ("custom_jvp_call", "custom_vjp_call")


def _rebind_custom(eqn, invals, plan: _Plan):
    """Binds a custom-derivative call with a tagged body, keeping its derivative rules.

    The tracer evaluates a tagged body in place to read its layers, so the gradient it
    computes is the body's own derivative. When the rule computes another one (checked
    once per equation, `_custom_rules.rule_differs`), a warning says so."""
    if _custom_rules.first_check_differs(eqn):
        _warn(
            f"kfacx: layers were found inside a `{eqn.primitive.name}` whose derivative "
            "rule differs from its body's derivative; kfacx differentiates the body to "
            "read the layers, so the gradient is the body's, not the rule's. Register "
            "the layers outside the custom-derivative function to keep the rule."
        )
    body, consts = _jaxpr.call_body(eqn)
    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in body.invars]
    tagged_body = jax.make_jaxpr(lambda *a: _evaluate(body, consts, a, plan))(*avals)
    new = eqn.replace(params=dict(eqn.params, call_jaxpr=tagged_body))
    return _jaxpr.bind_eqn(new, invals)


def _switch(eqn, invals, plans: tuple[_Plan, ...]):
    """A cond with tagged branches, as `jax.lax.switch` on its index."""

    def branch_fn(branch, plan):
        return lambda *ops: _evaluate(branch.jaxpr, branch.consts, ops, plan)

    fns = [branch_fn(b, p) for b, p in zip(eqn.params["branches"], plans, strict=True)]
    return jax.lax.switch(invals[0], fns, *invals[1:])


def _rebind_scan(eqn, invals, plan: _Plan):
    """Binds a scan with a tagged body (same length, direction and operands)."""
    closed = eqn.params["jaxpr"]
    body = closed.jaxpr
    avals = [
        jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, weak_type=v.aval.weak_type)
        for v in body.invars
    ]
    tagged = jax.make_jaxpr(lambda *a: _evaluate(body, closed.consts, a, plan))(*avals)
    params = dict(eqn.params)
    if tagged.consts:
        # Constants captured by the tagged body become leading const operands of the scan.
        k = len(tagged.consts)
        jaxpr = tagged.jaxpr
        jaxpr = jaxpr.replace(constvars=[], invars=[*jaxpr.constvars, *jaxpr.invars])
        invals = [*tagged.consts, *invals]
        tagged = jex.core.ClosedJaxpr(jaxpr, ())
        nc = _jaxpr.scan_counts(params)[0]
        params = _jaxpr.scan_params(params, nc + k, len(invals), len(eqn.outvars))
        if "linear" in params:
            params["linear"] = (False,) * k + tuple(params["linear"])
    params["jaxpr"] = tagged
    return _jaxpr.bind_eqn(eqn.replace(params=params), invals)


def auto_register_tags(
    func: Callable[..., Any],
    func_args: Sequence[Any],
    graph_patterns: Sequence[GraphPattern] = DEFAULT_GRAPH_PATTERNS,
    params_index: int = 0,
    on_unmatched: str = "warn",
) -> tuple[Callable[..., Any], RegistrationReport]:
    """Finds the layers of ``func`` and returns a function with layer tags inserted.

    Args:
      func: the loss function (with its loss registered).
      func_args: example arguments (arrays or `jax.ShapeDtypeStruct`); the
        tagged function must be called with arguments of the same shapes.
      graph_patterns: the patterns to look for (user patterns may be added to
        or replace `DEFAULT_GRAPH_PATTERNS`).
      params_index: the position of the parameters among ``func_args``.
      on_unmatched: what to do with parameters no pattern matched: ``"warn"``
        (generic tag, diagonal block, and a warning naming them), ``"error"``
        (raise), or ``"full"`` (generic tag served by a full block).

    Returns:
      ``(tagged_func, report)``: ``tagged_func`` computes exactly what ``func``
      does, with layer tags around every match; ``report`` is a
      `RegistrationReport`. Layers tagged by hand in ``func`` are kept as they
      are and never tagged twice.

    Raises:
      ValueError: for an unknown ``on_unmatched``, or unmatched parameters
        with ``on_unmatched="error"``.

    Example::

      tagged, report = kfacx.graph_matcher.auto_register_tags(loss_fn, (params, batch))
      print(report)
    """
    _check_arguments(graph_patterns, on_unmatched)
    func_args = tuple(func_args)
    closed, out_tree = _traced_for_detection(func, func_args)
    paths = list(checked_param_paths(func_args[params_index]))
    origins = param_origins(func_args, params_index, len(closed.jaxpr.invars))
    manual = _tagged_sites.tagged_leaves(closed.jaxpr, origins)
    sizes = _batch_sizes(func_args, params_index)
    relevant = _jaxpr.loss_ancestors(closed)
    plan, notes = _detect(relevant, origins, list(graph_patterns), paths, sizes)
    for note in notes:
        _warn(f"kfacx: {note}")
    sources = _sources(manual, plan)
    unmatched = _check_unmatched(paths, sources, on_unmatched)
    unmatched_leaves = {i for i, p in enumerate(paths) if i not in sources}
    tagged = _tagged_function(closed, out_tree, plan, origins, unmatched_leaves)
    entries = _entries(tagged, func_args, origins, paths, sources)
    return tagged, RegistrationReport(entries, tuple(unmatched), notes)


def _check_arguments(graph_patterns: Sequence[GraphPattern], on_unmatched: str) -> None:
    if on_unmatched not in ON_UNMATCHED:
        raise ValueError(f"on_unmatched={on_unmatched!r}; choose one of {ON_UNMATCHED}.")
    for p in graph_patterns:
        if not isinstance(p, GraphPattern):
            raise TypeError(f"graph_patterns must hold GraphPattern objects, got {p!r}.")
        _ = p.jaxpr  # Fails early, with the pattern's name, if it does not trace.


def _traced_for_detection(func, func_args: tuple):
    """``(closed jaxpr, output tree)`` of ``func``, prepared for matching: unused results
    dropped (`kfacx._helpers._jaxpr.dce`), shape operations hoisted out of scans moved back in
    (`kfacx._helpers._jaxpr.sink_invariants`), and what that left unused dropped."""
    closed, out_shape = jax.make_jaxpr(func, return_shape=True)(*_specs(func_args))
    closed = _jaxpr.dce(_jaxpr.sink_invariants(_jaxpr.dce(closed)))
    return closed, jax.tree_util.tree_structure(out_shape)


def _batch_sizes(func_args: tuple, params_index: int) -> frozenset[int]:
    """The leading sizes of the arrays of ``func_args`` other than the parameters: where
    a batch's examples are (`kfacx.optimizer._batch_layout`)."""
    others = [a for i, a in enumerate(func_args) if i != params_index]
    shapes = [jnp.shape(x) for x in jax.tree_util.tree_leaves(others)]
    return frozenset(int(s[0]) for s in shapes if s)


def _detect(closed, origins, patterns: list[GraphPattern], paths: list[str], batch_sizes):
    """``(plan, notes)``: the matches of ``patterns`` in ``closed`` (parameters tagged by
    hand are kept as they are; layers reading slices of a parameter of which others are
    no layer's are dropped, `_drop_incomplete_slices`) and the notes for the user, with
    parameter paths, without repeats.

    Raises:
      ValueError: if two patterns of equal precedence match one layer.
    """
    raw_notes: list[tuple[str, tuple[int, ...]]] = []
    jaxpr, consts = closed.jaxpr, _elementwise.Constants(closed.jaxpr, closed.consts)
    shapes = {o: v.aval.shape for o, v in zip(origins, jaxpr.invars, strict=True) if o is not None}
    claims = _tagged_sites.manual_claims(jaxpr, origins)
    try:
        plan = _plan(jaxpr, origins, patterns, dict(claims), raw_notes, 0, batch_sizes, consts)
    except AmbiguousPatternsError as e:
        raise ValueError(f"{e} Parameters: {[paths[i] for i in e.leaves]}.") from e
    _drop_incomplete_slices(plan, shapes, raw_notes)
    served = set(claims) | {leaf for m in plan.all_matches() for leaf in m.param_leaves}
    raw_notes = _views.unserved_leaves(raw_notes, served)
    notes = dict.fromkeys(f"{text}: {[paths[i] for i in leaves]}" for text, leaves in raw_notes)
    return plan, tuple(notes)


def _drop_incomplete_slices(plan: _Plan, shapes: dict, notes: list) -> None:
    """Drops the layers that read slices of a parameter some of whose entries are no
    layer's (and, in turn, those that read slices of what that left incomplete), with a
    note: a block serves whole parameters."""
    dropped: set[int] = set()
    while True:
        partial = _views.incomplete_slices(plan.all_matches(), shapes) - dropped
        if not partial:
            break
        plan.drop(partial)
        dropped |= partial
    if dropped:
        notes.append((_views.PARTIAL_NOTE, tuple(sorted(dropped))))


def _sources(manual, plan: _Plan) -> dict[int, str]:
    """Parameter leaf -> what tagged it: ``"manual"`` (``manual``: the leaves tagged by hand),
    or the names of the patterns that matched it, joined by ``+``."""
    sources = {leaf: "manual" for leaf in manual}
    for m in plan.all_matches():
        for leaf in m.param_leaves:
            names = sources[leaf].split("+") if sources.get(leaf, "manual") != "manual" else []
            name = _views.source_name(m.pattern.name, m.meta)
            sources[leaf] = "+".join(dict.fromkeys([*names, name]))
    return sources


def _check_unmatched(paths: list[str], sources: dict[int, str], on_unmatched: str) -> list[str]:
    """The paths of the parameters nothing tagged; raises or warns as ``on_unmatched`` says."""
    unmatched = [p for i, p in enumerate(paths) if i not in sources]
    if unmatched and on_unmatched == "error":
        raise ValueError(
            f"No layer pattern matched parameters {unmatched}. Register their layers by hand "
            "(kfacx.register_*), add a GraphPattern, or use on_unmatched='warn' or 'full'."
        )
    if unmatched and on_unmatched == "warn":
        _warn(
            f"kfacx: no layer pattern matched parameters {unmatched}; they get a diagonal "
            "block. Pass on_unmatched='error' to make this an error, or 'full' for a full block."
        )
    return unmatched


def _entries(tagged, func_args, origins, paths, sources) -> tuple[RegistrationEntry, ...]:
    """The report's entries, which follow the tags of the tagged function (evaluation order)."""
    tagged_jaxpr = jax.make_jaxpr(tagged)(*_specs(func_args)).jaxpr
    final = _tagged_sites.tagged_leaves(tagged_jaxpr, origins)
    return tuple(
        RegistrationEntry(
            path,
            *final[i][:2],
            source=sources.get(i, "unmatched"),
            uses=final[i][2],
            stack_size=final[i][3],
            in_branch=final[i][4],
        )
        for i, path in enumerate(paths)
    )


def _tagged_function(closed, out_tree, plan: _Plan, origins, unmatched_leaves: set[int]):
    expected = [v.aval for v in closed.jaxpr.invars]

    def tagged(*args):
        flat = jax.tree_util.tree_leaves(args)
        shapes = [(jnp.shape(a), jnp.result_type(a)) for a in flat]
        if shapes != [(a.shape, a.dtype) for a in expected]:
            raise ValueError(
                "The auto-tagged function was built for arguments of shapes "
                f"{[(a.shape, str(a.dtype)) for a in expected]}, got {shapes}. Call "
                "auto_register_tags again for the new shapes."
            )
        flat = [
            tags.register_generic(a) if origins[i] in unmatched_leaves else a
            for i, a in enumerate(flat)
        ]
        outs = _evaluate(closed.jaxpr, closed.consts, flat, plan)
        return jax.tree_util.tree_unflatten(out_tree, outs)

    return tagged
