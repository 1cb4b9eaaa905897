"""Parameters passed through an elementwise map before their layer, in a jaxpr.

``x * (1.4 * softplus(s))`` (a learned per-feature query scaler), ``x * exp(log_scale)``,
``h @ (w * mask)`` with a constant mask, ``h @ (2.0 * w)``: the layer's parameter is
``f(theta)`` for an elementwise map ``f`` of `kfacx._helpers._elementwise.MAPS` whose other
operands are constants. `map_step` recognises one such equation; the matcher's
`kfacx.graph_matcher._views.resolve` follows them from a pattern parameter down to the
leaves, into a ``("map", name, args, e)`` view expression.

A constant is a literal, a constant of the traced function (``closed.consts``: a
NumPy mask closed over, also where a `lax.scan` or `jax.checkpoint` body receives it as
an operand), or a value computed from those alone (``jnp.tril(jnp.ones(..))``),
evaluated once at detection (`Constants`). A cast is no map: it is a shape-only
operation the matcher follows anyway.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.extend as jex
import numpy as np

from kfacx._helpers import _elementwise, _jaxpr
from kfacx._helpers import _views as views_meta

#: Unary primitives that are maps of `kfacx._helpers._elementwise.MAPS` (same name).
_UNARY = ("neg", "exp", "logistic", "square")
#: Binary primitives ``x op c`` -> map name, and ``c op x`` -> map name (None: not served).
_BINARY = {
    "mul": ("mul", "mul"),
    "div": ("div", None),
    "add": ("add", "add"),
    "sub": ("sub", "rsub"),
}
#: The primitives of the maps (`_is_softplus`: a ``jit`` or its ``custom_jvp_call``).
_MAP_PRIMITIVES = (*_UNARY, "integer_pow", *_BINARY, "jit", "pjit", "custom_jvp_call")
#: The most equations a constant may be computed by.
_MAX_CONSTANT_EQNS = 64


class Constants:
    """The values of a jaxpr that do not depend on its inputs, computed on demand.

    Args:
      jaxpr: the (open) jaxpr.
      consts: the values of its ``constvars`` (unknown, hence no constants, when their
        number differs).
      outer: for a body, its inputs that are constants outside: ``input -> (Constants
        of the jaxpr around, operand)`` (`body_constants`).
    """

    def __init__(self, jaxpr: jex.core.Jaxpr, consts: Sequence[Any] = (), outer=None):
        self._jaxpr = jaxpr
        self._outer: dict[Any, tuple[Constants, Any]] = dict(outer or {})
        self.values: dict[Any, Any] = {}
        if len(consts) == len(jaxpr.constvars):
            for var, value in zip(jaxpr.constvars, consts, strict=True):
                if not isinstance(value, jax.core.Tracer):
                    self.values[var] = value
        self._producer: dict[Any, Any] = {}
        self._dependent: set[Any] | None = None

    def _index(self) -> None:
        """Producers, and the values that depend on an input (or an unknown constant)."""
        dependent = {v for v in self._jaxpr.invars if v not in self._outer}
        dependent.update(v for v in self._jaxpr.constvars if v not in self.values)
        for eqn in self._jaxpr.eqns:
            self._producer.update((v, eqn) for v in eqn.outvars)
            inputs = [v for v in eqn.invars if not isinstance(v, jex.core.Literal)]
            if eqn.effects or any(v in dependent for v in inputs):
                dependent.update(eqn.outvars)
        self._dependent = dependent

    def is_constant(self, var: Any) -> bool:
        """Whether ``var`` depends on no input of the jaxpr."""
        if isinstance(var, jex.core.Literal) or var in self.values:
            return True
        if self._dependent is None:
            self._index()
        return var not in self._dependent

    def value(self, var: Any) -> Any:
        """The value of a constant ``var`` (a NumPy array or scalar), or None if it is no
        constant or cannot be computed here."""
        if isinstance(var, jex.core.Literal):
            return np.asarray(var.val)
        if not self.is_constant(var):
            return None
        if var not in self.values:
            self._compute(var)
        value = self.values.get(var)
        return None if value is None else np.asarray(value)

    def _compute(self, var: Any) -> None:
        """Evaluates the equations ``var`` is computed by (at most `_MAX_CONSTANT_EQNS`)."""
        todo, stack, seen = [], [var], set()
        while stack:
            v = stack.pop()
            if isinstance(v, jex.core.Literal) or v in self.values or v in seen:
                continue
            seen.add(v)
            if v in self._outer:
                constants, operand = self._outer[v]
                self.values[v] = constants.value(operand)
                if self.values[v] is None:
                    self.values[var] = None
                    return
                continue
            eqn = self._producer.get(v)
            if eqn is None or len(todo) >= _MAX_CONSTANT_EQNS:
                self.values[var] = None
                return
            todo.append(eqn)
            stack.extend(eqn.invars)
        order = {id(e): i for i, e in enumerate(self._jaxpr.eqns)}
        todo = sorted({id(e): e for e in todo}.values(), key=lambda e: order[id(e)])
        env = dict(self.values)
        try:
            with jax.ensure_compile_time_eval():
                _jaxpr.eval_eqns(todo, env)
        except Exception:  # (a constant kfacx cannot evaluate is treated as no constant)
            self.values[var] = None
            return
        self.values.update((v, env[v]) for e in todo for v in e.outvars)


def body_constants(constants: Constants, eqn: Any, body: Any) -> Constants:
    """The `Constants` of ``body``, one of the `kfacx._helpers._jaxpr.bodies` of ``eqn`` in a jaxpr
    of ``constants``: its own constants, and its inputs whose operands are constants
    there (a mask closed over by a `lax.scan` or `jax.checkpoint` body is an operand)."""
    if body.scan is not None:
        nc = _jaxpr.scan_counts(eqn.params)[0]
        operands, closed = eqn.invars[:nc], eqn.params["jaxpr"]
    elif body.branch is not None:
        operands, closed = eqn.invars[1:], eqn.params["branches"][body.branch[1]]
    else:
        operands, closed = eqn.invars, _jaxpr.call_body(eqn)
    inputs = body.jaxpr.invars[: len(operands)]
    if len(inputs) != len(operands):
        return Constants(body.jaxpr)
    outer = {v: (constants, o) for v, o in zip(inputs, operands, strict=True)}
    outer = {v: c for v, c in outer.items() if constants.is_constant(c[1])}
    consts = getattr(closed, "consts", None)
    if consts is None:  # a call body: (jaxpr, consts)
        consts = closed[1] if isinstance(closed, tuple) else ()
    return Constants(body.jaxpr, consts, outer)


def map_step(graph: Any, eqn: Any) -> tuple[str, Any, Any] | None:
    """``(name, constant operand or None, operand)`` if ``eqn`` may compute an elementwise
    map (`kfacx._helpers._elementwise.MAPS`) of ``operand`` with the other operands constant,
    ``operand`` having the result's shape; None otherwise. The constant's value is read
    by `map_args`, once the operand is known to be parameters."""
    if len(eqn.outvars) != 1 or not _is_float(eqn.outvars[0]):
        return None
    name = eqn.primitive.name
    if name in _UNARY or name == "integer_pow":
        step = (name, None, eqn.invars[0])
    elif name in _BINARY and len(eqn.invars) == 2:
        step = _binary_step(graph, name, *eqn.invars)
    elif _is_softplus(eqn):
        step = ("softplus", None, eqn.invars[0])
    else:
        return None
    if step is None or isinstance(step[2], jex.core.Literal):
        return None
    return step if tuple(step[2].aval.shape) == tuple(eqn.outvars[0].aval.shape) else None


def _binary_step(graph: Any, name: str, a: Any, b: Any) -> tuple[str, Any, Any] | None:
    constants = graph.constants
    left, right = constants.is_constant(a), constants.is_constant(b)
    if right and not left:
        return _BINARY[name][0], b, a
    if left and not right and _BINARY[name][1] is not None:
        return _BINARY[name][1], a, b
    return None


def map_args(graph: Any, eqn: Any, step: tuple[str, Any, Any]) -> tuple | None:
    """The constant arguments of a `map_step` (`kfacx._helpers._elementwise.constant` values), or
    None if its constant cannot be computed."""
    name, const, _ = step
    if name == "integer_pow":
        return (int(eqn.params["y"]),)
    if const is None:
        return ()
    value = graph.constants.value(const)
    return None if value is None else (_elementwise.constant(value),)


def _is_float(var: Any) -> bool:
    return np.issubdtype(np.dtype(var.aval.dtype), np.floating)


def _is_softplus(eqn: Any) -> bool:
    """Whether ``eqn`` is `jax.nn.softplus`: a ``jit`` named so of one operand, or its body,
    ``logaddexp(x, 0)`` (a ``custom_jvp_call``). The matcher's numerical check confirms it."""
    name = eqn.primitive.name
    if name in ("jit", "pjit"):
        return eqn.params.get("name") == "softplus" and len(eqn.invars) == 1
    if name != "custom_jvp_call" or eqn.params.get("name") != "logaddexp":
        return False
    zero = eqn.invars[1] if len(eqn.invars) == 2 else None
    return isinstance(zero, jex.core.Literal) and float(np.asarray(zero.val)) == 0.0


def mapped(meta: dict) -> bool:
    """Whether a match's (or a tag's) views hold an elementwise map."""
    return views_meta.has_maps(views_meta.views_of(meta) or ())


def map_eqns(view_eqns: Sequence[Any]) -> list[Any]:
    """The elementwise maps among a view's equations (a match claims them, so that no
    later pattern reads ``w * mask`` as a layer of its own)."""
    return [e for e in view_eqns if e.primitive.name in _MAP_PRIMITIVES]


def prefer_unmapped(found: Sequence[list[Any]]) -> list[list[Any]]:
    """The matches of a group of patterns of one precedence, without the matches through an
    elementwise map that share equations or parameters with a match of the group that
    reads its parameters directly: ``(1 + g)`` is the offset pattern's scale ``g``
    (``scale_offset=1``), not the plain pattern's scale ``1 + g``."""
    direct = [m for ms in found for m in ms if not mapped(m.meta)]
    eqns = {id(e) for m in direct for e in m.eqns}
    leaves = {leaf for m in direct for leaf in m.param_leaves}

    def kept(m: Any) -> bool:
        clash = any(id(e) in eqns for e in m.eqns) or bool(leaves & set(m.param_leaves))
        return not (mapped(m.meta) and clash)

    return [[m for m in ms if kept(m)] for ms in found]
