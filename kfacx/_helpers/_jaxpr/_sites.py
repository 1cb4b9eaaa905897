"""Evaluating a jaxpr with a hook at every tag *site* (the tracer's forward pass)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from kfacx._helpers._jaxpr._interpret import (
    Jaxpr,
    JaxprEqn,
    bind_eqn,
    call_body,
    eval_jaxpr,
    has_tagged_body,
    is_cond,
    is_scan,
    is_tag_eqn,
    scan_counts,
    unsupported_container,
)
from kfacx._helpers._jaxpr._origins import count_tag_sites

#: ``on_tag(eqn, invals, site_input) -> (outvals, site_output)``, at every tag site.
OnTag = Callable[[JaxprEqn, list[Any], Any], tuple[list[Any], Any]]


def eval_jaxpr_sites(
    jaxpr: Jaxpr,
    consts: Sequence[Any],
    args: Sequence[Any],
    on_tag: OnTag,
    site_inputs: Sequence[Any],
) -> tuple[list[Any], list[Any], list[Any]]:
    """Evaluates ``jaxpr`` functionally, tag *sites* included, also inside `lax.scan`
    bodies and `lax.cond` / `lax.switch` branches.

    The sites are the tag equations in the order of `kfacx._helpers._jaxpr.tag_sites`. At each,
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


def _eval(jaxpr, consts, args, on_tag: OnTag, site_inputs: Iterator, sites: list) -> list[Any]:
    """Evaluates ``jaxpr``; appends ``(site_output, active)`` to ``sites`` per tag site."""

    def eval_eqn(eqn, invals):
        if is_tag_eqn(eqn):
            outvals, site_output = on_tag(eqn, invals, next(site_inputs))
            sites.append((site_output, None))
            return outvals
        if not has_tagged_body(eqn):
            return bind_eqn(eqn, invals)
        body = call_body(eqn)
        if body is not None:
            return _eval(body[0], body[1], invals, on_tag, site_inputs, sites)
        if is_scan(eqn):
            return _eval_scan(eqn, invals, on_tag, site_inputs, sites)
        if is_cond(eqn):
            return _eval_cond(eqn, invals, on_tag, site_inputs, sites)
        raise unsupported_container(eqn)

    return eval_jaxpr(jaxpr, consts, args, eval_eqn)


def _eval_scan(eqn, invals, on_tag: OnTag, site_inputs: Iterator, sites: list) -> list[Any]:
    """A scan whose body holds tags, by `jax.lax.scan` (see `eval_jaxpr_sites`)."""
    params = eqn.params
    body = params["jaxpr"]
    nc, ncarry = scan_counts(params)
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


def _eval_cond(eqn, invals, on_tag: OnTag, site_inputs: Iterator, sites: list) -> list[Any]:
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
