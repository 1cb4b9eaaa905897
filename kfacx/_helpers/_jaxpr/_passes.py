"""Jaxpr -> jaxpr passes run before detection and tracing: `dce` and `sink_invariants`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.extend as jex

from kfacx._helpers._jaxpr._interpret import (
    CALL_BODY_PARAMS,
    Jaxpr,
    JaxprEqn,
    bind_eqn,
    eval_jaxpr,
    is_scan,
    is_tag_eqn,
    scan_counts,
    scan_params,
    sub_jaxprs,
)

# Cheap single-operand shape operations that JAX hoists out of a scan body as
# loop-invariant residuals (e.g. the broadcast of a bias under `jax.value_and_grad`).
_SHAPE_OPS = ("broadcast_in_dim", "reshape", "squeeze", "convert_element_type", "transpose")

# Operations that build an operand of a scan from parameter leaves and that JAX hoists
# out of its body alike: the concatenation of a fused-gate cell's weights
# (``concatenate([w_i, w_f, w_g, w_o], -1)``) and the slices of a weight split between
# layers (``jnp.split(w_h, [2 * hidden], axis=1)`` in ``hk.GRU``).
_GATHER_OPS = ("concatenate", "split", "slice")


def sink_invariants(closed: jex.core.ClosedJaxpr) -> jex.core.ClosedJaxpr:
    """Moves shape operations (and concatenations) on a scan's consts back into the body.

    Differentiating a scan (``jax.value_and_grad`` of a loss, whose forward
    pass the optimizer traces) hoists loop-invariant work out of the body: the
    broadcast of an RNN cell's bias is computed once, before the scan, and the
    body adds the broadcast array. Detection matches one body at a time, so it
    would see ``x @ w + c`` with ``c`` not a parameter. Moving such chains of
    `_SHAPE_OPS` (from an input of the enclosing jaxpr) back into the body
    restores ``x @ w + broadcast(b)``; the result computes the same values.
    A fused-gate cell's ``concatenate([w_i, w_f, w_g, w_o], -1)`` and ``hk.GRU``'s
    ``jnp.split(w_h, ...)`` (`_GATHER_OPS`, with the shape operations before them) move
    in the same way, its inputs becoming the
    scan's consts in its place. Nested scans and call bodies are rewritten too (the
    operands of a call are moved in only as chains of shape operations).
    """
    jaxpr = _sink(closed.jaxpr)
    return closed if jaxpr is closed.jaxpr else jex.core.ClosedJaxpr(jaxpr, closed.consts)


def _sink(jaxpr: Jaxpr) -> Jaxpr:
    roots = set(jaxpr.invars)
    producers = {
        eqn.outvars[0]: eqn
        for eqn in jaxpr.eqns
        if eqn.primitive.name in _SHAPE_OPS and len(eqn.invars) == 1 and len(eqn.outvars) == 1
    }
    gathers = {
        **producers,
        **{v: eqn for eqn in jaxpr.eqns if eqn.primitive.name in _GATHER_OPS for v in eqn.outvars},
    }
    eqns, changed = [], False
    for eqn in jaxpr.eqns:
        new = eqn
        if is_scan(eqn):
            new = _sink_scan(eqn, gathers, roots)
        elif eqn.primitive.name in _SINKABLE_CALLS and _SINKABLE_CALLS[eqn.primitive.name] in (
            eqn.params
        ):
            new = _sink_call(eqn, producers, roots)
        elif CALL_BODY_PARAMS.get(eqn.primitive.name) in eqn.params:
            key = CALL_BODY_PARAMS[eqn.primitive.name]
            inner = _sink(_open(eqn.params[key]))
            if inner is not _open(eqn.params[key]):
                new = eqn.replace(params={**eqn.params, key: _reclose(eqn.params[key], inner)})
        changed = changed or new is not eqn
        eqns.append(new)
    return jaxpr.replace(eqns=eqns) if changed else jaxpr


#: Calls whose operands' shape-op chains `sink_invariants` moves into the body: their
#: params do not depend on the operands' types (a custom derivative's rule would;
#: `jax.checkpoint`'s policy names values, not types).
_SINKABLE_CALLS = {
    "jit": "jaxpr",
    "pjit": "jaxpr",
    "closed_call": "call_jaxpr",
    "checkpoint": "jaxpr",
    "remat": "jaxpr",
    "remat2": "jaxpr",
}


def _chains(operands: Sequence[Any], producers: dict, roots: set) -> list:
    """Per operand: ``(root, shape ops from the root to it)`` when the operand is a chain
    of `_SHAPE_OPS` from an input of the jaxpr, else None."""
    chains = []
    for v in operands:
        chain = []
        while isinstance(v, jex.core.Var) and v in producers:
            chain.append(producers[v])
            v = producers[v].invars[0]
        rooted = chain and isinstance(v, jex.core.Var) and v in roots
        chains.append((v, chain[::-1]) if rooted else None)
    return chains


def _with_chains(body: jex.core.ClosedJaxpr, chains: list) -> jex.core.ClosedJaxpr | None:
    """``body`` taking the chains' roots in place of the chained operands (it applies the
    chains first), or None if that would need constants."""

    def new_body(*args):
        args = list(args)
        for i, item in enumerate(chains):
            for op in item[1] if item else ():
                (args[i],) = bind_eqn(op, [args[i]])
        return eval_jaxpr(body.jaxpr, body.consts, args)

    # The body's own input types, but the roots' for the chained operands.
    kinds = chains + [None] * (len(body.jaxpr.invars) - len(chains))
    avals = [c[0].aval if c else v.aval for v, c in zip(body.jaxpr.invars, kinds, strict=True)]
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for a in avals]
    new = jax.make_jaxpr(new_body)(*specs)
    return None if new.consts else jex.core.ClosedJaxpr(_sink(new.jaxpr), ())


def _sink_call(eqn: JaxprEqn, producers: dict, roots: set) -> JaxprEqn:
    """A jit call whose operands are shape-op chains from inputs of the enclosing jaxpr
    (a parameter cast to bfloat16 before ``jnp.take``, itself a jit) takes the roots
    and applies the chains in its body, where detection sees the parameter."""
    key = _SINKABLE_CALLS[eqn.primitive.name]
    body = eqn.params[key]
    chains = _chains(eqn.invars, producers, roots)
    new = _with_chains(_closed(body), chains) if any(chains) else None
    if new is None:
        inner = _sink(_open(body))
        return (
            eqn
            if inner is _open(body)
            else eqn.replace(params={**eqn.params, key: _reclose(body, inner)})
        )
    invars = [c[0] if c else v for v, c in zip(eqn.invars, chains, strict=True)]
    body = new if isinstance(body, jex.core.ClosedJaxpr) else new.jaxpr
    return eqn.replace(invars=invars, params={**eqn.params, key: body})


def _closed(body: Any) -> jex.core.ClosedJaxpr:
    return body if isinstance(body, jex.core.ClosedJaxpr) else jex.core.ClosedJaxpr(body, ())


def _sink_scan(eqn: JaxprEqn, producers: dict, roots: set) -> JaxprEqn:
    nc = scan_counts(eqn.params)[0]
    recipes = [_recipe(v, producers, roots) for v in eqn.invars[:nc]]
    body = eqn.params["jaxpr"]
    if not any(recipes):
        inner = _sink(body.jaxpr)
        if inner is body.jaxpr:
            return eqn
        return eqn.replace(params=dict(eqn.params, jaxpr=jex.core.ClosedJaxpr(inner, body.consts)))
    sunk = _with_recipes(body, eqn.invars[:nc], recipes, roots)
    if sunk is None:
        return eqn  # (keep the scan as it is rather than add operands)
    operands, new = sunk
    invars = [*operands, *eqn.invars[nc:]]
    params = scan_params(dict(eqn.params, jaxpr=new), len(operands), len(invars), len(eqn.outvars))
    if "linear" in params:
        params["linear"] = (False,) * len(operands) + tuple(params["linear"][nc:])
    return eqn.replace(invars=invars, params=params)


def _recipe(var: Any, producers: dict, roots: set) -> list[JaxprEqn] | None:
    """The equations of `_SHAPE_OPS` and `_GATHER_OPS` (``producers``) that compute ``var``
    from inputs of the jaxpr (``roots``), in evaluation order; None if ``var`` is an input
    or is not computed so."""
    eqns: dict[int, JaxprEqn] = {}

    def visit(v) -> bool:
        if not isinstance(v, jex.core.Var):
            return False
        if v in roots:
            return True
        eqn = producers.get(v)
        if eqn is None or not all(visit(u) for u in eqn.invars):
            return False
        eqns.setdefault(id(eqn), eqn)  # (after its operands' equations)
        return True

    if not isinstance(var, jex.core.Var) or var in roots or not visit(var):
        return None
    return list(eqns.values())


def _with_recipes(body, operands, recipes, roots) -> tuple[list, jex.core.ClosedJaxpr] | None:
    """``(new operands, new body)``: ``body`` taking the inputs of the recipes in place of
    the operands they compute (it evaluates the recipes first), or None if that would
    need constants."""
    new_operands: list[Any] = []

    def position(u) -> int:
        found = next((i for i, w in enumerate(new_operands) if w is u), None)
        if found is None:
            new_operands.append(u)
            return len(new_operands) - 1
        return found

    kept = {}  # operand index -> its position among the new operands
    for i, (v, recipe) in enumerate(zip(operands, recipes, strict=True)):
        if recipe is None:
            kept[i] = position(v)
        else:
            for u in (u for e in recipe for u in e.invars if u in roots):
                position(u)
    steps = list({id(e): e for r in recipes if r for e in r}.values())
    k = len(new_operands)

    def new_body(*args):
        env = {
            v: a for v, a in zip(new_operands, args, strict=False) if isinstance(v, jex.core.Var)
        }
        for e in steps:
            env.update(zip(e.outvars, bind_eqn(e, [env[u] for u in e.invars]), strict=True))
        consts = [args[kept[i]] if i in kept else env[v] for i, v in enumerate(operands)]
        return eval_jaxpr(body.jaxpr, body.consts, [*consts, *args[k:]])

    avals = [v.aval for v in new_operands] + [v.aval for v in body.jaxpr.invars[len(operands) :]]
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for a in avals]
    new = jax.make_jaxpr(new_body)(*specs)
    return None if new.consts else (new_operands, jex.core.ClosedJaxpr(_sink(new.jaxpr), ()))


def dce(closed: jex.core.ClosedJaxpr) -> jex.core.ClosedJaxpr:
    """Drops the equations whose results are unused, also inside jit and remat bodies
    and scan bodies (a scan's unused stacked outputs go too, and so do the operands of a
    jit and the consts of a scan that their bodies then no longer read).

    Tags and effectful equations are always kept. This removes, e.g., the
    backward pass of a function built as ``jax.value_and_grad(f)(...)[0]``
    (or ``jax.jit(jax.value_and_grad(f))(...)[0]``), so that detection does
    not mistake its products for layers.
    """
    jaxpr = _dce(closed.jaxpr, [True] * len(closed.jaxpr.outvars))
    return closed if jaxpr is closed.jaxpr else jex.core.ClosedJaxpr(jaxpr, closed.consts)


# Call primitives whose unused outputs can be dropped, with their per-output params.
_PRUNABLE_CALLS = {
    "jit": ("out_shardings", "out_layouts"),
    "pjit": ("out_shardings", "out_layouts"),
    "closed_call": (),
    "core_call": (),
    "remat": (),
    "remat2": (),
    "checkpoint": (),
}


def _dce(jaxpr: Jaxpr, used_outputs: Sequence[bool]) -> Jaxpr:
    outvars = [v for v, used in zip(jaxpr.outvars, used_outputs, strict=True) if used]
    live = {v for v in outvars if not isinstance(v, jex.core.Literal)}
    kept, changed = [], len(outvars) != len(jaxpr.outvars)
    for eqn in reversed(jaxpr.eqns):
        used = [v in live for v in eqn.outvars]
        if not (eqn.effects or is_tag_eqn(eqn) or any(used)):
            changed = True
            continue
        if not eqn.effects and (eqn.primitive.name in _PRUNABLE_CALLS or is_scan(eqn)):
            prune = _prune_scan if is_scan(eqn) else _prune_call
            pruned = prune(eqn, used if any(used) else [True] * len(used))
            changed = changed or pruned is not eqn
            eqn = pruned
        kept.append(eqn)
        live.update(v for v in eqn.invars if not isinstance(v, jex.core.Literal))
    if not changed:
        return jaxpr
    return jaxpr.replace(eqns=kept[::-1], outvars=outvars)


def _prune_scan(eqn: JaxprEqn, used: Sequence[bool]) -> JaxprEqn:
    """Drops a scan's unused stacked outputs (``ys``: e.g. the residuals a
    differentiated scan saves for its backward pass), what only they need, and the
    consts the body then no longer reads (the backward pass's constants)."""
    nconsts, ncarry = scan_counts(eqn.params)
    keep = [True] * ncarry + list(used[ncarry:])
    body = eqn.params["jaxpr"]
    inner = _dce(body.jaxpr, keep)
    if inner is body.jaxpr:
        return eqn
    outvars = [v for v, k in zip(eqn.outvars, keep, strict=True) if k]
    read = _read(inner)
    kept = [i >= nconsts or id(v) in read for i, v in enumerate(inner.invars)]
    params = dict(eqn.params)
    invars = eqn.invars
    if not all(kept) and _prune_per_operand(params, ("linear",), kept):
        inner = inner.replace(invars=[v for v, k in zip(inner.invars, kept, strict=True) if k])
        invars = [v for v, k in zip(eqn.invars, kept, strict=True) if k]
        nconsts = sum(kept[:nconsts])
    params["jaxpr"] = jex.core.ClosedJaxpr(inner, body.consts)
    params = scan_params(params, nconsts, len(invars), len(outvars))
    return eqn.replace(params=params, invars=invars, outvars=outvars)


def _read(jaxpr: Jaxpr) -> set[int]:
    """The ids of the variables ``jaxpr``'s equations and outputs read."""
    read = {id(v) for e in jaxpr.eqns for v in e.invars}
    return read | {id(v) for v in jaxpr.outvars}


def _prune_per_operand(params: dict, names: Sequence[str], kept: Sequence[bool]) -> bool:
    """Keeps the ``kept`` entries of the per-operand ``params`` ``names`` (in place);
    False, changing nothing, where one of them does not have an entry per operand."""
    present = [n for n in names if params.get(n) is not None]
    if any(len(params[n]) != len(kept) for n in present):
        return False
    for n in present:
        params[n] = tuple(x for x, k in zip(params[n], kept, strict=True) if k)
    return True


def _open(body: Any) -> Jaxpr:
    """The jaxpr of a call body param (a `Jaxpr` or a `ClosedJaxpr`)."""
    return body.jaxpr if isinstance(body, jex.core.ClosedJaxpr) else body


def _reclose(body: Any, inner: Jaxpr) -> Any:
    """``inner`` in place of the jaxpr of the call body param ``body`` (same kind)."""
    return (
        jex.core.ClosedJaxpr(inner, body.consts)
        if isinstance(body, jex.core.ClosedJaxpr)
        else inner
    )


def _prune_call(eqn: JaxprEqn, used: Sequence[bool]) -> JaxprEqn:
    key = CALL_BODY_PARAMS[eqn.primitive.name]
    if key not in eqn.params:
        return eqn
    body = eqn.params[key]
    inner = _dce(_open(body), used)
    if inner is _open(body):
        return eqn
    params = dict(eqn.params)
    for name in _PRUNABLE_CALLS[eqn.primitive.name]:
        if name in params:
            params[name] = tuple(x for x, u in zip(params[name], used, strict=True) if u)
    outvars = [v for v, u in zip(eqn.outvars, used, strict=True) if u]
    invars = eqn.invars
    # A jit also drops the operands its body no longer reads (a differentiated function
    # keeps those of its dropped residuals), unless it was asked to keep them.
    if eqn.primitive.name in ("jit", "pjit") and not params.get("keep_unused", False):
        read = _read(inner)
        kept = [id(v) in read for v in inner.invars]
        per_operand = ("in_shardings", "in_layouts", "donated_invars")
        if not all(kept) and _prune_per_operand(params, per_operand, kept):
            inner = inner.replace(invars=[v for v, k in zip(inner.invars, kept, strict=True) if k])
            invars = [v for v, k in zip(eqn.invars, kept, strict=True) if k]
    params[key] = _reclose(body, inner)
    return eqn.replace(params=params, invars=invars, outvars=outvars)


def _holds_loss_tag(eqn: JaxprEqn) -> bool:
    from kfacx import tags

    if tags.loss_tag_for(eqn.primitive) is not None:
        return True
    return any(any(map(_holds_loss_tag, sub.eqns)) for sub in sub_jaxprs(eqn))


def _holds_tag(eqn: JaxprEqn) -> bool:
    return is_tag_eqn(eqn) or any(any(map(_holds_tag, sub.eqns)) for sub in sub_jaxprs(eqn))


def _ancestors(closed: jex.core.ClosedJaxpr, root) -> jex.core.ClosedJaxpr:
    """The equations for which ``root(eqn)`` holds and, transitively, the producers of their
    operands (the same equation objects, in order); the jaxpr's outputs are kept where
    they are still defined. ``closed`` as it is when that is every equation, or when no
    equation holds a loss tag."""
    jaxpr = closed.jaxpr
    needed: set[Any] = set()
    kept: list[JaxprEqn] = []
    for eqn in reversed(jaxpr.eqns):
        if root(eqn) or any(v in needed for v in eqn.outvars):
            kept.append(eqn)
            needed.update(v for v in eqn.invars if not isinstance(v, jex.core.Literal))
    if not any(map(_holds_loss_tag, kept)) or len(kept) == len(jaxpr.eqns):
        return closed
    kept.reverse()
    defined = {*jaxpr.invars, *jaxpr.constvars, *(v for e in kept for v in e.outvars)}
    outvars = [v for v in jaxpr.outvars if isinstance(v, jex.core.Literal) or v in defined]
    return jex.core.ClosedJaxpr(jaxpr.replace(eqns=kept, outvars=outvars), closed.consts)


def loss_ancestors(closed: jex.core.ClosedJaxpr) -> jex.core.ClosedJaxpr:
    """The equations the registered losses depend on: those holding a loss tag (also in a
    body or branch) and, transitively, the producers of their operands.

    Detection looks for layers here only: the curvature of the registered losses flows
    through these equations alone. A parameter also used elsewhere (FermiNet's network
    weights, also used in the local energy's Laplacian beside the wavefunction whose
    distribution is registered) is a layer only where it feeds the losses, as in kfac-jax,
    which traces the losses' computation alone.
    """
    return _ancestors(closed, _holds_loss_tag)


def tag_ancestors(closed: jex.core.ClosedJaxpr) -> jex.core.ClosedJaxpr:
    """The equations every tag (layer or loss) depends on, tags included: what the
    curvature statistics need of a tagged function (`kfacx.tracer.layer_tags_vjp`), without
    the rest of the loss's computation (FermiNet's local energy, and its custom derivative
    rule, which a pass that differentiates the statistics must not run)."""
    return _ancestors(closed, _holds_tag)
