"""The jaxpr interpreter: a read / write loop over ``jaxpr.eqns`` with a hook per equation.

Every evaluation of a jaxpr in kfacx runs through `eval_jaxpr` (or `eval_eqns`): the
tracer's forward pass (`kfacx._helpers._jaxpr.eval_jaxpr_sites`), the tagged function of
automatic registration and the numerical check of a match. They differ only in their
hook, ``eval_eqn(eqn, invals) -> outvals``, which defaults to binding the equation.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import jax
import jax.extend as jex
import jax.numpy as jnp

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


def scan_counts(params: dict) -> tuple[int, int]:
    """``(num_consts, num_carry)`` of a scan equation's ``params``: jax <= 0.11 names
    them; jax 0.12 gives the groups of the operands as ``ft_in`` (consts, carry, xs)."""
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].unpack()
    return len(consts), len(carry)


def scan_params(params: dict, num_consts: int, num_operands: int, num_outputs: int) -> dict:
    """A scan's ``params`` for ``num_operands`` operands of which ``num_consts`` consts
    and ``num_outputs`` outputs (the carry unchanged); in jax 0.12's form, the operand and
    output groups are taken from a scan of that shape traced with `jax.lax.scan`."""
    num_carry = scan_counts(params)[1]
    if "num_consts" in params:
        return dict(params, num_consts=num_consts)
    groups = _scan_groups(
        num_consts,
        num_carry,
        num_operands - num_consts - num_carry,
        num_outputs - num_carry,
        params["length"],
    )
    return dict(params, ft_in=groups[0], ft_out=groups[1])


@functools.cache
def _scan_groups(num_consts: int, num_carry: int, num_xs: int, num_ys: int, length: int):
    def scan(consts, carry, xs):
        def body(carry, x):  # every output computed (none forwarded), every operand used
            total = sum(consts, 0.0) + sum(x, 0.0)
            return [c + total for c in carry], [total * (i + 2.0) for i in range(num_ys)]

        return jax.lax.scan(body, carry, xs, length=length)

    closed = jax.make_jaxpr(scan)(
        [jnp.float32(1.0)] * num_consts,
        [jnp.float32(1.0)] * num_carry,
        [jnp.ones((length,), jnp.float32)] * num_xs,
    )
    (eqn,) = [e for e in closed.jaxpr.eqns if is_scan(e)]
    return eqn.params["ft_in"], eqn.params["ft_out"]


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
