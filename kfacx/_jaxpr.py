"""Small helpers over jaxprs (public JAX API only: `jax.extend.core`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import jax
import jax.extend as jex
import jax.numpy as jnp

from kfacx import tags

Jaxpr = jex.core.Jaxpr
JaxprEqn = jex.core.JaxprEqn

# Primitives whose body runs exactly once per call: tags inside them can be
# read by evaluating the body in place.
_CALL_BODY_PARAMS = {
    "jit": "jaxpr",
    "pjit": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "remat": "jaxpr",
    "remat2": "jaxpr",
    "checkpoint": "jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
}


def is_tag_eqn(eqn: JaxprEqn) -> bool:
    """Whether the equation binds a layer or loss tag."""
    p = eqn.primitive
    return tags.layer_tag_for(p) is not None or tags.loss_tag_for(p) is not None


def contains_tags(jaxpr: Jaxpr) -> bool:
    """Whether any equation of ``jaxpr`` or of its sub-jaxprs is a tag."""
    return any(is_tag_eqn(e) or any(map(contains_tags, sub_jaxprs(e))) for e in jaxpr.eqns)


def sub_jaxprs(eqn: JaxprEqn) -> Iterator[Jaxpr]:
    """The (open) jaxprs found in an equation's params."""
    for sub in jex.core.jaxprs_in_params(eqn.params):
        yield getattr(sub, "jaxpr", sub)


def call_body(eqn: JaxprEqn) -> tuple[Jaxpr, Sequence[Any]] | None:
    """``(jaxpr, consts)`` of a call-like equation's body, or None for other primitives."""
    key = _CALL_BODY_PARAMS.get(eqn.primitive.name)
    if key is None or key not in eqn.params:
        return None
    body = eqn.params[key]
    if isinstance(body, jex.core.ClosedJaxpr):
        return body.jaxpr, body.consts
    return body, ()


def bind_eqn(eqn: JaxprEqn, invals: Sequence[Any]) -> list[Any]:
    """Evaluates one equation on concrete or traced values."""
    params = eqn.primitive.get_bind_params(eqn.params)
    subfuns, params = params if isinstance(params, tuple) else ((), params)
    with eqn.ctx.manager:
        out = eqn.primitive.bind(*subfuns, *invals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def eval_jaxpr_sites(
    jaxpr: Jaxpr,
    consts: Sequence[Any],
    args: Sequence[Any],
    on_tag: Callable[[JaxprEqn, list[Any], Any], tuple[list[Any], Any]],
    site_inputs: Sequence[Any],
) -> tuple[list[Any], list[Any], list[Any]]:
    """Evaluates ``jaxpr`` functionally, tag *sites* included, also inside `lax.scan`
    bodies and `lax.cond` / `lax.switch` branches.

    The sites are the tag equations in the order of `tag_sites`. At each,
    ``on_tag(eqn, invals, site_input)`` returns ``(outvals, site_output)``
    (pytrees of arrays). Call-like equations are evaluated in place.

    A scan whose body holds tags is evaluated by `jax.lax.scan` over a body that
    evaluates its jaxpr the same way (``length``, ``reverse`` and the
    consts / carry / xs split are respected): the site inputs of its tags must
    be stacked ``[L, ...]`` and enter as extra ``xs`` (the iteration on slice
    ``l`` of the xs gets slice ``l``); their site outputs come out as extra
    ``ys``, stacked the same way.

    A cond whose branches hold tags is evaluated by `jax.lax.switch` over
    branches evaluated the same way. Only the branch taken runs: the site
    outputs of the other branches' tags are zeros, and each site has an
    *active* flag (float32, 1 where its tag ran and 0 where it did not).

    Args:
      jaxpr, consts, args: what to evaluate.
      on_tag: ``(eqn, invals, site_input) -> (outvals, site_output)``.
      site_inputs: one entry per site.

    Returns:
      ``(outputs, site_outputs, site_active)``, one site output and one active
      flag per site. The flag is None for a site outside every cond branch (it
      always runs); inside a branch it is a scalar, stacked ``[L]`` when the
      cond sits in a scan of length ``L``.

    Raises:
      ValueError: for tags inside other higher-order primitives, or a wrong
        number of site inputs.
    """
    site_inputs = list(site_inputs)
    num_sites = count_tag_sites(jaxpr)
    if len(site_inputs) != num_sites:
        raise ValueError(f"{len(site_inputs)} site inputs for {num_sites} tag sites.")
    sites: list[tuple[Any, Any]] = []
    outs = _eval(jaxpr, consts, args, on_tag, iter(site_inputs), sites)
    return outs, [out for out, _ in sites], [active for _, active in sites]


def _eval(jaxpr, consts, args, on_tag, site_inputs, sites: list) -> list[Any]:
    """Evaluates ``jaxpr``; appends ``(site_output, active)`` to ``sites`` per tag site."""
    env: dict[Any, Any] = {}

    def read(v):
        return v.val if isinstance(v, jex.core.Literal) else env[v]

    def write(vs, vals):
        for v, val in zip(vs, vals, strict=True):
            env[v] = val

    write(jaxpr.constvars, consts)
    write(jaxpr.invars, args)
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        if is_tag_eqn(eqn):
            outvals, site_output = on_tag(eqn, invals, next(site_inputs))
            sites.append((site_output, None))
        elif any(map(contains_tags, sub_jaxprs(eqn))):
            body = call_body(eqn)
            if body is not None:
                outvals = _eval(body[0], body[1], invals, on_tag, site_inputs, sites)
            elif is_scan(eqn):
                outvals = _eval_scan(eqn, invals, on_tag, site_inputs, sites)
            elif is_cond(eqn):
                outvals = _eval_cond(eqn, invals, on_tag, site_inputs, sites)
            else:
                raise unsupported_container(eqn)
        else:
            outvals = bind_eqn(eqn, invals)
        write(eqn.outvars, outvals)
    return [read(v) for v in jaxpr.outvars]


def unsupported_container(eqn: JaxprEqn) -> ValueError:
    """The error for tags inside a primitive the tracer cannot look into."""
    return ValueError(
        f"A layer or loss tag sits inside a `{eqn.primitive.name}` primitive; kfacx reads tags "
        "inside jit, checkpoint and custom_jvp/custom_vjp functions, `lax.scan` bodies and "
        f"`lax.cond` / `lax.switch` branches, but not inside `{eqn.primitive.name}`. Move the "
        "registration out of it (e.g. unroll the loop, or write it with lax.scan)."
    )


# Cheap single-operand shape operations that JAX hoists out of a scan body as
# loop-invariant residuals (e.g. the broadcast of a bias under `jax.value_and_grad`).
_SHAPE_OPS = ("broadcast_in_dim", "reshape", "squeeze", "convert_element_type", "transpose")


def sink_invariants(closed: jex.core.ClosedJaxpr) -> jex.core.ClosedJaxpr:
    """Moves shape operations on a scan's consts back into the scan body.

    Differentiating a scan (``jax.value_and_grad`` of a loss, whose forward
    pass the optimizer traces) hoists loop-invariant work out of the body: the
    broadcast of an RNN cell's bias is computed once, before the scan, and the
    body adds the broadcast array. Detection matches one body at a time, so it
    would see ``x @ w + c`` with ``c`` not a parameter. Moving such chains of
    `_SHAPE_OPS` (from an input of the enclosing jaxpr) back into the body
    restores ``x @ w + broadcast(b)``; the result computes the same values.
    Nested scans and call bodies are rewritten too.
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
    eqns, changed = [], False
    for eqn in jaxpr.eqns:
        new = eqn
        if is_scan(eqn):
            new = _sink_scan(eqn, producers, roots)
        elif _CALL_BODY_PARAMS.get(eqn.primitive.name) in eqn.params:
            key = _CALL_BODY_PARAMS[eqn.primitive.name]
            inner = _sink(_open(eqn.params[key]))
            if inner is not _open(eqn.params[key]):
                new = eqn.replace(params={**eqn.params, key: _reclose(eqn.params[key], inner)})
        changed = changed or new is not eqn
        eqns.append(new)
    return jaxpr.replace(eqns=eqns) if changed else jaxpr


def _sink_scan(eqn: JaxprEqn, producers: dict, roots: set) -> JaxprEqn:
    nc = eqn.params["num_consts"]
    chains = []  # per const operand: the shape ops from an input of the jaxpr to it
    for v in eqn.invars[:nc]:
        chain = []
        while isinstance(v, jex.core.Var) and v in producers:
            chain.append(producers[v])
            v = producers[v].invars[0]
        rooted = chain and isinstance(v, jex.core.Var) and v in roots
        chains.append((v, chain[::-1]) if rooted else None)
    body = eqn.params["jaxpr"]
    if not any(chains):
        inner = _sink(body.jaxpr)
        if inner is body.jaxpr:
            return eqn
        return eqn.replace(params=dict(eqn.params, jaxpr=jex.core.ClosedJaxpr(inner, body.consts)))
    invars = [c[0] if c else v for v, c in zip(eqn.invars[:nc], chains, strict=True)]
    invars += eqn.invars[nc:]

    def new_body(*args):
        args = list(args)
        for i, item in enumerate(chains):
            for op in item[1] if item else ():
                (args[i],) = bind_eqn(op, [args[i]])
        return jex.core.jaxpr_as_fun(body)(*args)

    # The body's own input types, but the roots' for the sunk consts.
    kinds = chains + [None] * (len(body.jaxpr.invars) - nc)
    avals = [c[0].aval if c else v.aval for v, c in zip(body.jaxpr.invars, kinds, strict=True)]
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for a in avals]
    new = jax.make_jaxpr(new_body)(*specs)
    if new.consts:
        return eqn  # (keep the scan as it is rather than add operands)
    new = jex.core.ClosedJaxpr(_sink(new.jaxpr), ())
    return eqn.replace(invars=invars, params=dict(eqn.params, jaxpr=new))


def dce(closed: jex.core.ClosedJaxpr) -> jex.core.ClosedJaxpr:
    """Drops the equations whose results are unused, also inside jit and remat bodies
    and scan bodies (a scan's unused stacked outputs go too).

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
    differentiated scan saves for its backward pass) and what only they need."""
    ncarry = eqn.params["num_carry"]
    keep = [True] * ncarry + list(used[ncarry:])
    body = eqn.params["jaxpr"]
    inner = _dce(body.jaxpr, keep)
    if inner is body.jaxpr:
        return eqn
    outvars = [v for v, k in zip(eqn.outvars, keep, strict=True) if k]
    params = dict(eqn.params, jaxpr=jex.core.ClosedJaxpr(inner, body.consts))
    return eqn.replace(params=params, outvars=outvars)


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
    key = _CALL_BODY_PARAMS[eqn.primitive.name]
    if key not in eqn.params:
        return eqn
    body = eqn.params[key]
    inner = _dce(_open(body), used)
    if inner is _open(body):
        return eqn
    params = dict(eqn.params)
    params[key] = _reclose(body, inner)
    for name in _PRUNABLE_CALLS[eqn.primitive.name]:
        if name in params:
            params[name] = tuple(x for x, u in zip(params[name], used, strict=True) if u)
    outvars = [v for v, u in zip(eqn.outvars, used, strict=True) if u]
    return eqn.replace(params=params, outvars=outvars)


def walk_tags(jaxpr: Jaxpr, origins: Sequence[Any]) -> Iterator[tuple[JaxprEqn, list[Any]]]:
    """Yields every tag equation with the *origin* of each of its operands.

    ``origins`` labels the jaxpr's inputs (e.g. the index of a parameter leaf);
    labels flow into the bodies of call-like equations, of scans and of cond
    branches (see `tag_sites`) and are None for any value computed inside the
    function, in the order `eval_jaxpr_sites` visits tags.
    """
    for site in tag_sites(jaxpr, origins):
        yield site.eqn, site.origins


# ----------------------------------------------------------------------------- lax.scan


@dataclasses.dataclass(frozen=True)
class ScanSlice:
    """Origin label of a scan body input that is a slice of a scanned-over (``xs``)
    operand labelled ``origin``: iteration ``l`` sees ``operand[l]``. ``level`` is the
    depth of that scan among nested scans (0 for the outermost)."""

    origin: Any
    level: int = 0


def leaf_origin(origin: Any) -> Any:
    """The label under any `ScanSlice` wrappers (e.g. the parameter leaf index)."""
    while isinstance(origin, ScanSlice):
        origin = origin.origin
    return origin


def slice_levels(origin: Any) -> tuple[int, ...]:
    """The levels of the scans that slice ``origin`` (empty if none does), innermost first."""
    levels = []
    while isinstance(origin, ScanSlice):
        levels.append(origin.level)
        origin = origin.origin
    return tuple(levels)


class TagSite(NamedTuple):
    """A tag equation in the (nested) jaxpr.

    Attributes:
      eqn: the tag equation.
      origins: the origin label of each of its operands.
      scans: the `lax.scan` equations it sits in, outermost first (it runs once
        per iteration of each; ``scans[-1].params["length"]`` times in one scan).
      branches: the `lax.cond` equations it sits in, outermost first, each with
        the index of the branch it sits in (it runs only when they are taken).
    """

    eqn: JaxprEqn
    origins: list[Any]
    scans: tuple[JaxprEqn, ...]
    branches: tuple[tuple[JaxprEqn, int], ...] = ()


def is_scan(eqn: JaxprEqn) -> bool:
    """Whether the equation is a `lax.scan`."""
    return eqn.primitive.name == "scan"


def is_cond(eqn: JaxprEqn) -> bool:
    """Whether the equation is a `lax.cond` / `lax.switch` (operands: index, then the
    operands every branch takes)."""
    return eqn.primitive.name == "cond"


def scan_body_origins(eqn: JaxprEqn, origins: Sequence[Any], level: int = 0) -> list[Any]:
    """Origin labels of a scan body's inputs from those of the scan's operands.

    Consts (closed over: the same value at every iteration) keep their label;
    the carry is computed (None); an ``xs`` operand labelled ``o`` gives
    ``ScanSlice(o, level)`` (``level``: the depth of this scan among nested ones).
    """
    nc, ncarry = eqn.params["num_consts"], eqn.params["num_carry"]
    xs = [None if o is None else ScanSlice(o, level) for o in origins[nc + ncarry :]]
    return [*origins[:nc], *([None] * ncarry), *xs]


def tag_sites(
    jaxpr: Jaxpr,
    origins: Sequence[Any],
    scans: tuple[JaxprEqn, ...] = (),
    branches: tuple[tuple[JaxprEqn, int], ...] = (),
) -> Iterator[TagSite]:
    """Every tag equation, in evaluation order, with its operands' origins, scans and
    cond branches.

    Labels flow into call bodies positionally, into scan bodies by
    `scan_body_origins`, and into every branch of a cond from the cond's
    operands after the index; the sites of a cond are those of its branches,
    in branch order.

    Raises:
      ValueError: for tags inside other higher-order primitives (while...).
    """
    env: dict[Any, Any] = dict(zip(jaxpr.invars, origins, strict=True))
    for eqn in jaxpr.eqns:
        ins = [None if isinstance(v, jex.core.Literal) else env.get(v) for v in eqn.invars]
        if is_tag_eqn(eqn):
            yield TagSite(eqn, ins, scans, branches)
        elif any(map(contains_tags, sub_jaxprs(eqn))):
            body = call_body(eqn)
            if body is not None:
                yield from tag_sites(body[0], ins, scans, branches)
            elif is_scan(eqn):
                body_origins = scan_body_origins(eqn, ins, len(scans))
                yield from tag_sites(
                    eqn.params["jaxpr"].jaxpr, body_origins, (*scans, eqn), branches
                )
            elif is_cond(eqn):
                for b, branch in enumerate(eqn.params["branches"]):
                    yield from tag_sites(branch.jaxpr, ins[1:], scans, (*branches, (eqn, b)))
            else:
                raise unsupported_container(eqn)


def count_tag_sites(jaxpr: Jaxpr) -> int:
    """The number of `tag_sites` of ``jaxpr``."""
    return sum(1 for _ in tag_sites(jaxpr, [None] * len(jaxpr.invars)))


def _eval_scan(eqn, invals, on_tag, site_inputs, sites: list) -> list[Any]:
    """A scan whose body holds tags, by `jax.lax.scan` (see `eval_jaxpr_sites`)."""
    params = eqn.params
    body = params["jaxpr"]
    nc, ncarry = params["num_consts"], params["num_carry"]
    consts, init, xs = invals[:nc], invals[nc : nc + ncarry], invals[nc + ncarry :]
    extras = [next(site_inputs) for _ in range(count_tag_sites(body.jaxpr))]

    def step(carry, x):
        x_slice, extra = x
        inner: list[tuple[Any, Any]] = []
        args = [*consts, *carry, *x_slice]
        outs = _eval(body.jaxpr, body.consts, args, on_tag, iter(extra), inner)
        return outs[:ncarry], (outs[ncarry:], inner)

    options = {k: params[k] for k in ("_split_transpose",) if k in params}
    carry, (ys, inner) = jax.lax.scan(
        step,
        list(init),
        (list(xs), extras),
        length=params["length"],
        reverse=params["reverse"],
        unroll=params["unroll"],
        **options,
    )
    sites.extend(inner)
    return [*carry, *ys]


def _eval_cond(eqn, invals, on_tag, site_inputs, sites: list) -> list[Any]:
    """A cond whose branches hold tags, by `jax.lax.switch` (see `eval_jaxpr_sites`).

    Every branch returns the site outputs of all branches' tags: its own, with
    active flags of 1 (or the flags of conds nested in it), and zeros for the
    others' (active 0). The branch taken thus decides which tags ran.
    """
    index, ops = invals[0], invals[1:]
    branches = eqn.params["branches"]
    extras = [[next(site_inputs) for _ in range(count_tag_sites(b.jaxpr))] for b in branches]

    def run(b, operands):
        inner: list[tuple[Any, Any]] = []
        branch = branches[b]
        outs = _eval(branch.jaxpr, branch.consts, operands, on_tag, iter(extras[b]), inner)
        one = jnp.ones((), jnp.float32)
        return outs, [(out, one if active is None else active) for out, active in inner]

    shapes = [jax.eval_shape(lambda o, b=b: run(b, o)[1], list(ops)) for b in range(len(branches))]

    def branch_fn(b):
        def fn(operands):
            outs, own = run(b, operands)
            parts = [
                own if c == b else jax.tree_util.tree_map(lambda a: jnp.zeros(a.shape, a.dtype), s)
                for c, s in enumerate(shapes)
            ]
            return outs, [site for part in parts for site in part]

        return fn

    outs, inner = jax.lax.switch(index, [branch_fn(b) for b in range(len(branches))], list(ops))
    sites.extend(inner)
    return outs
