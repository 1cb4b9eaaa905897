"""The jaxpr interpreter: a read / write loop over ``jaxpr.eqns`` with a hook per equation.

Every evaluation of a jaxpr in kfacx runs through `eval_jaxpr` (or `eval_eqns`): the
tracer's forward pass (`kfacx._jaxpr.eval_jaxpr_sites`), the tagged function of
automatic registration and the numerical check of a match. They differ only in their
hook, ``eval_eqn(eqn, invals) -> outvals``, which defaults to binding the equation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import jax.extend as jex

from kfacx import tags

Jaxpr = jex.core.Jaxpr
JaxprEqn = jex.core.JaxprEqn

#: ``eval_eqn(eqn, invals) -> outvals``: evaluates one equation on its operands' values.
EvalEqn = Callable[[JaxprEqn, list[Any]], Sequence[Any]]

#: Primitives whose body runs exactly once per call, by the param that holds the body:
#: tags inside them can be read by evaluating the body in place.
CALL_BODY_PARAMS = {
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


def bind_eqn(eqn: JaxprEqn, invals: Sequence[Any]) -> list[Any]:
    """Evaluates one equation on concrete or traced values (the default hook)."""
    params = eqn.primitive.get_bind_params(eqn.params)
    subfuns, params = params if isinstance(params, tuple) else ((), params)
    with eqn.ctx.manager:
        out = eqn.primitive.bind(*subfuns, *invals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def read(env: dict[Any, Any], v: Any) -> Any:
    """The value of a variable (or literal) ``v`` in ``env``."""
    return v.val if isinstance(v, jex.core.Literal) else env[v]


def eval_eqns(eqns: Iterable[JaxprEqn], env: dict[Any, Any], eval_eqn: EvalEqn = bind_eqn) -> None:
    """Evaluates ``eqns`` in order: reads each one's operands from ``env``, hands them to
    ``eval_eqn`` and writes its results back into ``env``."""
    for eqn in eqns:
        outvals = eval_eqn(eqn, [read(env, v) for v in eqn.invars])
        env.update(zip(eqn.outvars, outvals, strict=True))


def eval_jaxpr(
    jaxpr: Jaxpr,
    consts: Sequence[Any],
    args: Sequence[Any],
    eval_eqn: EvalEqn = bind_eqn,
    env: dict[Any, Any] | None = None,
) -> list[Any]:
    """Evaluates ``jaxpr`` on ``consts`` and ``args`` with `eval_eqns`; returns its outputs.

    ``env`` (a fresh dict by default) receives every variable's value; a hook that
    needs other values than its equation's operands reads them there (`read`).

    Example::

      closed = jax.make_jaxpr(f)(x)
      (y,) = eval_jaxpr(closed.jaxpr, closed.consts, [x])   # y == f(x)
    """
    env = {} if env is None else env
    env.update(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    eval_eqns(jaxpr.eqns, env, eval_eqn)
    return [read(env, v) for v in jaxpr.outvars]


# ----------------------------------------------------------------------------- equations


def is_tag_eqn(eqn: JaxprEqn) -> bool:
    """Whether the equation binds a layer or loss tag."""
    p = eqn.primitive
    return tags.layer_tag_for(p) is not None or tags.loss_tag_for(p) is not None


def contains_tags(jaxpr: Jaxpr) -> bool:
    """Whether any equation of ``jaxpr`` or of its sub-jaxprs is a tag."""
    return any(is_tag_eqn(e) or any(map(contains_tags, sub_jaxprs(e))) for e in jaxpr.eqns)


def has_tagged_body(eqn: JaxprEqn) -> bool:
    """Whether a sub-jaxpr of the equation (a body, a branch) holds tags."""
    return any(map(contains_tags, sub_jaxprs(eqn)))


def sub_jaxprs(eqn: JaxprEqn) -> Iterator[Jaxpr]:
    """The (open) jaxprs found in an equation's params."""
    for sub in jex.core.jaxprs_in_params(eqn.params):
        yield getattr(sub, "jaxpr", sub)


def call_body(eqn: JaxprEqn) -> tuple[Jaxpr, Sequence[Any]] | None:
    """``(jaxpr, consts)`` of a call-like equation's body, or None for other primitives."""
    key = CALL_BODY_PARAMS.get(eqn.primitive.name)
    if key is None or key not in eqn.params:
        return None
    body = eqn.params[key]
    if isinstance(body, jex.core.ClosedJaxpr):
        return body.jaxpr, body.consts
    return body, ()


def is_scan(eqn: JaxprEqn) -> bool:
    """Whether the equation is a `lax.scan`."""
    return eqn.primitive.name == "scan"


def is_cond(eqn: JaxprEqn) -> bool:
    """Whether the equation is a `lax.cond` / `lax.switch` (operands: index, then the
    operands every branch takes)."""
    return eqn.primitive.name == "cond"


def unsupported_container(eqn: JaxprEqn) -> ValueError:
    """The error for tags inside a primitive the tracer cannot look into."""
    return ValueError(
        f"A layer or loss tag sits inside a `{eqn.primitive.name}` primitive; kfacx reads tags "
        "inside jit, checkpoint and custom_jvp/custom_vjp functions, `lax.scan` bodies and "
        f"`lax.cond` / `lax.switch` branches, but not inside `{eqn.primitive.name}`. Move the "
        "registration out of it (e.g. unroll the loop, or write it with lax.scan)."
    )
