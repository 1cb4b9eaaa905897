"""Where values come from: origin labels flowing from a jaxpr's inputs into its bodies.

The caller labels the jaxpr's inputs (e.g. with the index of a parameter leaf, None
for other inputs). `eqns_with_origins` gives every equation with the labels of its
operands, and `bodies` says how labels flow into the jaxprs an equation runs (call
bodies, scan bodies, cond branches) and where those jaxprs sit (`Scope`). A value
computed inside the function has no label (None). `tag_sites` (the tracer) and the
matcher's plan (`kfacx.graph_matcher`) are both walks over these two functions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import jax.extend as jex

from kfacx._helpers._jaxpr._interpret import (
    Jaxpr,
    JaxprEqn,
    call_body,
    has_tagged_body,
    is_cond,
    is_scan,
    is_tag_eqn,
    scan_counts,
    unsupported_container,
)


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


class Body(NamedTuple):
    """A jaxpr an equation runs (`bodies`), with the origin labels of its inputs.

    Attributes:
      jaxpr: the body.
      origins: the label of each of its inputs.
      scan: the scan equation it is the body of, or None.
      branch: ``(cond equation, branch index)`` for a cond branch, or None.
    """

    jaxpr: Jaxpr
    origins: list[Any]
    scan: JaxprEqn | None = None
    branch: tuple[JaxprEqn, int] | None = None


class Scope(NamedTuple):
    """Where a (sub-)jaxpr sits in the function.

    Attributes:
      scans: the `lax.scan` equations around it, outermost first (it runs once per
        iteration of each).
      branches: the `lax.cond` equations around it, outermost first, each with the
        index of the branch it sits in (it runs only when they are taken).
    """

    scans: tuple[JaxprEqn, ...] = ()
    branches: tuple[tuple[JaxprEqn, int], ...] = ()

    def enter(self, body: Body) -> Scope:
        """The scope of ``body``, one of the `bodies` of an equation in this scope."""
        scans = self.scans if body.scan is None else (*self.scans, body.scan)
        branches = self.branches if body.branch is None else (*self.branches, body.branch)
        return Scope(scans, branches)


#: The scope of the function's own jaxpr: outside every scan and branch.
TOP = Scope()


def eqns_with_origins(jaxpr: Jaxpr, origins: Sequence[Any]) -> Iterator[tuple[JaxprEqn, list]]:
    """Every equation of ``jaxpr`` with the origin labels of its operands (``origins``
    labels ``jaxpr.invars``; literals and computed values are None)."""
    env = dict(zip(jaxpr.invars, origins, strict=True))
    for eqn in jaxpr.eqns:
        yield eqn, [None if isinstance(v, jex.core.Literal) else env.get(v) for v in eqn.invars]


def scan_body_origins(eqn: JaxprEqn, origins: Sequence[Any], level: int = 0) -> list[Any]:
    """Origin labels of a scan body's inputs from those of the scan's operands.

    Consts (closed over: the same value at every iteration) keep their label;
    the carry is computed (None); an ``xs`` operand labelled ``o`` gives
    ``ScanSlice(o, level)`` (``level``: the depth of this scan among nested ones).
    """
    nc, ncarry = scan_counts(eqn.params)
    xs = [None if o is None else ScanSlice(o, level) for o in origins[nc + ncarry :]]
    return [*origins[:nc], *([None] * ncarry), *xs]


def bodies(eqn: JaxprEqn, origins: Sequence[Any], level: int = 0) -> list[Body] | None:
    """The jaxprs an equation runs, each with the origin labels of its inputs.

    A call body (jit, checkpoint, custom_jvp / custom_vjp...) takes the labels of the
    call's operands; a scan body takes `scan_body_origins` (``level``: the number of
    scans around the equation); every branch of a cond, in branch order, takes the
    labels of the cond's operands after the index.

    Returns:
      The bodies, or None for a primitive without a body kfacx looks into (while...).
    """
    body = call_body(eqn)
    if body is not None:
        return [Body(body[0], list(origins))]
    if is_scan(eqn):
        return [Body(eqn.params["jaxpr"].jaxpr, scan_body_origins(eqn, origins, level), scan=eqn)]
    if is_cond(eqn):
        return [
            Body(branch.jaxpr, list(origins[1:]), branch=(eqn, b))
            for b, branch in enumerate(eqn.params["branches"])
        ]
    return None


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


def tag_sites(jaxpr: Jaxpr, origins: Sequence[Any], scope: Scope = TOP) -> Iterator[TagSite]:
    """Every tag equation, in evaluation order, with its operands' origins, scans and
    cond branches (labels flow into bodies by `bodies`; the sites of a cond are those
    of its branches, in branch order).

    Raises:
      ValueError: for tags inside other higher-order primitives (while...).
    """
    for eqn, ins in eqns_with_origins(jaxpr, origins):
        if is_tag_eqn(eqn):
            yield TagSite(eqn, ins, scope.scans, scope.branches)
        elif has_tagged_body(eqn):
            inner = bodies(eqn, ins, len(scope.scans))
            if inner is None:
                raise unsupported_container(eqn)
            for body in inner:
                yield from tag_sites(body.jaxpr, body.origins, scope.enter(body))


def count_tag_sites(jaxpr: Jaxpr) -> int:
    """The number of `tag_sites` of ``jaxpr``."""
    return sum(1 for _ in tag_sites(jaxpr, [None] * len(jaxpr.invars)))
