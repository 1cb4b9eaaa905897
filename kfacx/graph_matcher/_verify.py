"""The numerical check of a structural match, answered once per distinct match.

The matched equations (with the shape-only chains from the parameters) and the
tag's ``compute`` are evaluated on the same random values in one compiled
function; they must agree. The answer depends only on the match's structure,
so it is kept under a key of that structure and a deep model's repeated
blocks are checked once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend as jex
import jax.numpy as jnp
import numpy as np

from kfacx._helpers import _compile, _jaxpr, _views
from kfacx.graph_matcher._graph import SHAPE_ONLY, Graph, Match


def _subgraph_eqns(graph: Graph, eqns, param_vars, view_eqns=()) -> list[Any]:
    """The matched equations and the shape-only chains from the parameter leaves (and, for
    parameters concatenated from leaves, the concatenations and the chains from them), in
    order."""
    sources = [*param_vars, *(v for e in view_eqns for v in e.outvars)]
    chain_eqns = {id(e): e for e in view_eqns}
    chain_eqns.update({id(e): e for pv in sources for e in _chains_from(graph, pv)})
    chain_eqns.update({id(e): e for e in eqns})
    return sorted(chain_eqns.values(), key=lambda e: graph.order[id(e)])


def _constants(graph: Graph, todo) -> dict[Any, Any]:
    """The known constants the equations read (those of elementwise maps: ``w * mask``)."""
    values = graph.constants.values
    return {
        v: values[v]
        for e in todo
        for v in e.invars
        if not isinstance(v, jex.core.Literal) and values.get(v) is not None
    }


def _evaluate_subgraph(todo, input_vars, param_vars, inputs, params, output_var, consts=None):
    env = dict(consts or {})
    env |= dict(zip(input_vars, inputs, strict=True)) | dict(zip(param_vars, params, strict=True))
    _jaxpr.eval_eqns(_computable(todo, env), env)
    return env[output_var]


def _computable(eqns, known) -> list[Any]:
    """The equations, in order, whose operands are literals, ``known`` values or results
    of the equations kept before them (the others cannot be evaluated: skipped)."""
    known, kept = set(known), []
    for eqn in eqns:
        if all(isinstance(v, jex.core.Literal) or v in known for v in eqn.invars):
            kept.append(eqn)
            known.update(eqn.outvars)
    return kept


def _structure(match: Match, todo) -> tuple | None:
    """A key that determines `verified`'s answer: the pattern, the metadata, the
    operand shapes and the evaluated equations with their operands renamed by
    position. Two matches with equal keys run the same computation on the same
    random values (repeated blocks of a deep model verify once). None when a
    value's printed form is abbreviated (a large array constant), so that two
    different constants cannot share a key."""
    names: dict[Any, int] = {}

    def name(var) -> Any:
        if isinstance(var, jex.core.Literal):
            return ("literal", repr(var.val), str(var.aval))
        return names.setdefault(var, len(names))

    operands = [(name(v), v.aval.shape, str(v.aval.dtype)) for v in match.input_vars]
    operands += [(name(v), v.aval.shape, str(v.aval.dtype)) for v in match.param_vars]
    body = tuple(
        (
            e.primitive.name,
            repr(sorted(e.params.items())),
            tuple(name(v) for v in e.invars),
            tuple(name(v) for v in e.outvars),
        )
        for e in todo
    )
    key = (
        repr(sorted(match.meta.items())),
        match.output_permutation,
        tuple(operands),
        body,
        name(match.output_var),
        str(match.output_var.aval),
    )
    return None if "..." in repr(key) else (match.pattern, *key)


def _chains_from(graph: Graph, var) -> list[Any]:
    out, frontier = [], [var]
    while frontier:
        v = frontier.pop()
        for eqn in graph.users.get(v, []):
            if eqn.primitive.name in SHAPE_ONLY:
                out.append(eqn)
                frontier.extend(eqn.outvars)
    return out


#: `verified`'s answers by `_structure` key, shared by all detections of the process.
_VERIFIED: dict[tuple, bool] = {}
_VERIFIED_MAX = 4096


def verified(match: Match, graph: Graph) -> bool:
    """Numerical check: the matched equations equal the tag's compute function."""
    if match.pattern.tag_primitive.compute is None:
        return True
    todo = _subgraph_eqns(graph, match.eqns, match.param_vars, match.view_eqns)
    key = _structure(match, todo)
    consts = _constants(graph, todo)
    if key is None:
        return _check_numerically(match, todo, consts)
    if key not in _VERIFIED:
        _remember(key, _check_numerically(match, todo, consts))
    return _VERIFIED[key]


def prefetch(graph: Graph, matches: Sequence[Match]) -> None:
    """Answers the checks of ``matches`` (structural matches of ``graph`` that `verified`
    may be asked about) whose answers are not known yet, in one compiled function.

    Each check is a small program to trace, lower and compile (about 30 ms on the CPU,
    mostly fixed costs), so a model with a dozen distinct layers paid a dozen of them;
    together they are one. The answers are the ones `verified` would give: each check
    draws its own values as it would alone, and one that fails to trace fails alone.
    Nothing is kept if the combined function fails as a whole: `verified` then checks
    each match on its own, as before.
    """
    checks: dict[tuple, tuple[Match, list[Any], dict[Any, Any]]] = {}
    for match in matches:
        if match.pattern.tag_primitive.compute is None:
            continue
        todo = _subgraph_eqns(graph, match.eqns, match.param_vars, match.view_eqns)
        key = _structure(match, todo)
        if key is not None and key not in _VERIFIED and key not in checks:
            checks[key] = (match, todo, _constants(graph, todo))
    if len(checks) < 2:  # One check compiles no faster here than in `verified`.
        return
    items = list(checks.values())
    samples = [_samples(match) for match, _, _ in items]
    untraceable: set[int] = set()

    def evaluate_all(samples):
        outs = []
        for i, ((match, todo, consts), (inputs, params)) in enumerate(
            zip(items, samples, strict=True)
        ):
            try:
                outs.append(_evaluator(match, todo, consts)(inputs, params))
            except (TypeError, ValueError, KeyError):
                untraceable.add(i)
                outs.append(None)
        return outs

    try:
        outs = _compile.run_once(evaluate_all, samples)
    except Exception:  # noqa: BLE001 - `verified` checks them one by one instead.
        return
    for i, (key, (match, todo, _)) in enumerate(zip(checks, items, strict=True)):
        _remember(key, i not in untraceable and _agree(match, todo, *outs[i]))


def _remember(key: tuple, answer: bool) -> None:
    if len(_VERIFIED) >= _VERIFIED_MAX:
        _VERIFIED.clear()
    _VERIFIED[key] = answer


def _narrowest_float_itemsize(match: Match, todo) -> int:
    """Bytes of the narrowest floating dtype the checked computation passes through: a
    float32 layer whose weight is cast to bfloat16 (``x @ w.astype(bf16)`` with a float32
    ``x``) is as precise as its bfloat16 weight, whatever its output's dtype."""
    values = [match.output_var, *match.input_vars, *match.param_vars]
    values += [v for eqn in todo for v in (*eqn.invars, *eqn.outvars)]
    sizes = [
        np.dtype(v.aval.dtype).itemsize
        for v in values
        if jnp.issubdtype(v.aval.dtype, jnp.floating)
    ]
    return min(sizes, default=4)


def _samples(match: Match) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The check's random inputs and parameters (the same for every check of a key)."""
    rng = np.random.default_rng(0)

    def sample(var):
        aval = var.aval
        if np.issubdtype(aval.dtype, np.integer):  # ids / indices: small, in range
            return rng.integers(0, 2, aval.shape).astype(aval.dtype)
        return (rng.standard_normal(aval.shape) * 0.5 + 0.25).astype(aval.dtype)

    inputs = [sample(v) for v in match.input_vars]
    return inputs, [sample(v) for v in match.param_vars]


def _evaluator(match: Match, todo, consts) -> Callable[..., tuple[Any, Any]]:
    """``(inputs, params) -> (want, got)``: the matched equations, and the tag's compute."""
    compute = match.pattern.tag_primitive.compute

    def evaluate(inputs, params):
        want = _evaluate_subgraph(
            todo,
            match.input_vars,
            match.param_vars,
            inputs,
            params,
            match.output_var,
            consts,
        )
        tag_inputs = match.pattern.tag_inputs(inputs, params, want)
        views = _views.views_of(match.meta)
        layer_params = tuple(params) if views is None else _views.effective(params, views)
        (got,) = compute(tag_inputs, layer_params, **_views.without_views(match.meta))
        if match.output_permutation is not None:
            got = jax.numpy.transpose(got, match.output_permutation)
        return want, got

    return evaluate


def _agree(match: Match, todo, want, got) -> bool:
    """Whether the tag's output ``got`` equals the equations' ``want`` (to a tolerance of
    the narrowest floating dtype the computation passes through)."""
    if np.shape(got) != np.shape(want):
        return False
    scale = 1.0 + float(np.max(np.abs(np.asarray(want, np.float64)), initial=0.0))
    tol = 1e-3 if _narrowest_float_itemsize(match, todo) >= 4 else 5e-2
    return bool(
        np.allclose(
            np.asarray(got, np.float64),
            np.asarray(want, np.float64),
            atol=tol * scale,
            rtol=tol,
        )
    )


def _check_numerically(match: Match, todo, consts=None) -> bool:
    inputs, params = _samples(match)
    try:
        # One compiled function for both sides (evaluating op by op compiles each
        # operation on its own, several times slower).
        want, got = _compile.run_once(_evaluator(match, todo, consts), inputs, params)
    except (TypeError, ValueError, KeyError):
        return False
    return _agree(match, todo, want, got)
