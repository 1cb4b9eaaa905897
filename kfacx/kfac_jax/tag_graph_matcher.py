"""``kfac_jax.tag_graph_matcher``: kfac-jax's graph patterns, built as kfacx's.

`GraphPattern` takes kfac-jax's arguments and returns a `kfacx.GraphPattern`. A pattern
tagged with kfac-jax's ``layer_tag`` gets the kfacx tag of the layer variant its
extractor reports (`kfacx.kfac_jax.layers_and_loss_tags.variant_tag`); kfac-jax's
``functools.partial(_dense_parameter_extractor, variant=...)`` is read directly,
any other extractor is run once on the pattern's own equations to learn its variant.
The tag's metadata is then kfacx's (the contraction of the matched ``dot_general``),
and every structural match is verified numerically by kfacx's matcher, as kfacx's own
patterns are.

kfac-jax matches patterns in the order they are listed; kfacx by ``precedence``. The
kfac-jax `Optimizer` here gives the patterns listed before kfacx's defaults a
precedence above all of theirs, in list order (`ordered_patterns`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax.numpy as jnp

from kfacx import graph_matcher as _gm
from kfacx import tags as _tags
from kfacx.graph_matcher import DEFAULT_GRAPH_PATTERNS
from kfacx.graph_matcher._defaults import dense_parameters_extractor
from kfacx.kfac_jax._unsupported import unsupported, unsupported_class
from kfacx.kfac_jax.layers_and_loss_tags import LayerMetaData, LayerTag, variant_tag

__all__ = [
    "DEFAULT_GRAPH_PATTERNS",
    "GraphMatcherComparator",
    "GraphPattern",
    "auto_register_tags",
    "ordered_patterns",
]

#: The precedence of a kfac-jax pattern (above every kfacx default pattern).
USER_PRECEDENCE = 1000


def _dense(x: Any, params: Sequence[Any], axes: int = 1, with_reshape: bool = False) -> Any:
    """kfac-jax's example dense layer: ``tensordot(x, w, axes) + b``."""
    match list(params):
        case [w, b]:
            y = jnp.tensordot(x, w, axes=axes)
            if with_reshape:
                return y + b.reshape((1,) * (y.ndim - b.ndim) + b.shape)
            return y + b
        case [w]:
            return jnp.tensordot(x, w, axes=axes)
        case _:
            raise ValueError("_dense: expected [w] or [w, b] as parameters.")


def _dense_parameter_extractor(eqns: Sequence[Any], variant: str = "dense") -> dict[str, Any]:
    """kfac-jax's dense extractor: ``meta`` with the variant, and the ``dot_general``'s
    parameters."""
    for eqn in eqns:
        if eqn.primitive.name == "dot_general":
            n = len({id(v) for e in eqns for v in e.invars if hasattr(v, "count")})
            meta = LayerMetaData(
                variant=variant,
                outputs_index=(0,),
                inputs_index=(1,),
                params_index=tuple(range(2, max(n, 3))),
            )
            return dict(meta=meta, **eqn.params)
    raise ValueError("_dense_parameter_extractor: the match has no dot_general.")


def _variant_of(pattern: _gm.GraphPattern, extractor: Callable[..., Any]) -> str:
    if isinstance(extractor, functools.partial) and "variant" in extractor.keywords:
        return extractor.keywords["variant"]
    try:
        found = extractor(list(pattern.jaxpr.eqns))
    except Exception as e:  # noqa: BLE001 - the user's extractor on its own pattern
        raise ValueError(
            f"GraphPattern {pattern.name!r}: its parameters_extractor_func fails on the "
            f"pattern's own equations ({type(e).__name__}: {e}), so its layer variant is "
            "unknown."
        ) from e
    meta = (found or {}).get("meta") if isinstance(found, Mapping) else None
    if not isinstance(meta, LayerMetaData):
        raise ValueError(
            f"GraphPattern {pattern.name!r}: its parameters_extractor_func must return "
            "dict(meta=kfac_jax.LayerMetaData(variant=...), ...), as kfac-jax's do."
        )
    return meta.variant


def _contraction(eqns: Sequence[Any]) -> tuple:
    """The ranks and dimension numbers of the ``dot_general`` among ``eqns``."""
    dot = next(e for e in eqns if e.primitive.name == "dot_general")
    (lc, rc), (lb, rb) = dot.params["dimension_numbers"]
    ranks = tuple(len(v.aval.shape) for v in dot.invars)
    return ranks, tuple(map(tuple, (lc, rc, lb, rb)))


def _kfacx_extractor(
    variant: str, user: Callable[..., Any], pattern: _gm.GraphPattern
) -> Callable[..., Any]:
    """kfacx's extractor of a kfac-jax dense pattern. kfac-jax's matcher compares the
    operands' ranks and the contraction of the ``dot_general`` (kfacx's compares
    primitives only and leaves shapes to the extractor), so a match whose contraction
    differs from the pattern's is rejected here: FermiNet's vmapped dense pattern must
    not take the network's ordinary 2-D dense layers."""
    want = _contraction(pattern.jaxpr.eqns)

    def extract(eqns: Sequence[Any]) -> dict[str, Any]:
        if _contraction(eqns) != want:
            raise ValueError("the contraction differs from the pattern's")
        user(eqns)  # may reject the match by raising ValueError, as in kfac-jax
        return dense_parameters_extractor(eqns)

    extract.__name__ = f"{variant}_extractor"
    return extract


def GraphPattern(  # noqa: N802 - kfac-jax's class name; it returns a kfacx.GraphPattern
    name: str,
    tag_primitive: Any,
    compute_func: Callable[..., Any],
    parameters_extractor_func: Callable[..., Any],
    example_args: Sequence[Any],
    in_values_preprocessor: Callable[..., Any] | None = None,
) -> _gm.GraphPattern:
    """kfac-jax's pattern constructor: a `kfacx.GraphPattern` (see the module docstring).

    Raises:
      NotImplementedError: with ``in_values_preprocessor``, or for a ``layer_tag``
        pattern whose layer is not a dense contraction.
      ValueError: when the extractor does not tell the variant.
    """
    if in_values_preprocessor is not None:
        raise NotImplementedError(
            f"GraphPattern {name!r}: in_values_preprocessor is not served by "
            "kfacx.kfac_jax; build a kfacx.GraphPattern with tag_inputs_func instead."
        )
    if isinstance(tag_primitive, _tags.LayerTag):
        return _gm.GraphPattern(
            name,
            tag_primitive,
            compute_func,
            parameters_extractor_func,
            example_args,
            precedence=USER_PRECEDENCE,
        )
    if not isinstance(tag_primitive, LayerTag):
        raise TypeError(
            f"GraphPattern {name!r}: tag_primitive must be kfac_jax.layers_and_loss_tags."
            f"layer_tag or a kfacx.tags.LayerTag, got {tag_primitive!r}."
        )
    probe = _gm.GraphPattern(name, _tags.dense, compute_func, lambda e: {}, example_args)
    if not any(e.primitive.name == "dot_general" for e in probe.jaxpr.eqns):
        raise NotImplementedError(
            f"GraphPattern {name!r}: kfacx.kfac_jax serves kfac-jax patterns of dense layers "
            "(a dot_general); for other layers build a kfacx.GraphPattern with a "
            "kfacx.tags.LayerTag (docs/extending.md)."
        )
    variant = _variant_of(probe, parameters_extractor_func)
    return dataclasses.replace(
        probe,
        tag_primitive=variant_tag(variant),
        parameters_extractor_func=_kfacx_extractor(variant, parameters_extractor_func, probe),
        precedence=USER_PRECEDENCE,
    )


def ordered_patterns(patterns: Sequence[_gm.GraphPattern]) -> tuple[_gm.GraphPattern, ...]:
    """kfac-jax's list order as kfacx precedences: each pattern that is not one of kfacx's
    defaults gets a precedence above all defaults, higher the earlier it is listed."""
    defaults = {id(p) for p in DEFAULT_GRAPH_PATTERNS}
    n = len(patterns)
    return tuple(
        p if id(p) in defaults else dataclasses.replace(p, precedence=USER_PRECEDENCE + n - i)
        for i, p in enumerate(patterns)
    )


def auto_register_tags(
    func: Callable[..., Any],
    func_args: Sequence[Any],
    params_index: int = 0,
    register_only_generic: bool = False,
    compute_only_loss_tags: bool = True,
    patterns_to_skip: Sequence[str] = (),
    graph_matcher_rules: Any = None,
    graph_patterns: Sequence[_gm.GraphPattern] = DEFAULT_GRAPH_PATTERNS,
) -> Callable[..., Any]:
    """kfac-jax's detection: `kfacx.auto_register_tags`, returning the tagged function
    (its `kfacx.RegistrationReport` is its ``report`` attribute)."""
    del compute_only_loss_tags, graph_matcher_rules
    patterns = (
        ()
        if register_only_generic
        else tuple(
            p for p in ordered_patterns(graph_patterns) if p.name not in set(patterns_to_skip)
        )
    )
    tagged, report = _gm.auto_register_tags(func, func_args, patterns, params_index)

    def tagged_func(*args: Any) -> Any:
        return tagged(*args)

    tagged_func.report = report  # type: ignore[attr-defined]
    return tagged_func


GraphMatcherComparator = unsupported_class(
    "tag_graph_matcher.GraphMatcherComparator",
    "kfacx's matcher compares primitives and verifies every match numerically; it takes "
    "no comparison rules",
)
make_jax_graph = unsupported(
    "tag_graph_matcher.make_jax_graph", "use jax.make_jaxpr, or kfacx.tracer.trace"
)


def detection_kwargs(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """kfacx's ``auto_register_kwargs`` for kfac-jax's: ``graph_patterns`` in kfac-jax's
    list order (`ordered_patterns`), less ``patterns_to_skip``; ``register_only_generic``
    as no patterns at all (every parameter not tagged by hand on the fallback block).

    Raises:
      TypeError: for a keyword kfacx's detection does not take.
    """
    kwargs = dict(kwargs)
    patterns = kwargs.pop("graph_patterns", DEFAULT_GRAPH_PATTERNS)
    skip = set(kwargs.pop("patterns_to_skip", ()))
    if kwargs.pop("register_only_generic", False):
        patterns = ()
    kwargs.pop("compute_only_loss_tags", None)
    if kwargs.pop("graph_matcher_rules", None) is not None:
        raise TypeError(GraphMatcherComparator.kfacx_unsupported)
    unknown = set(kwargs) - {"on_unmatched"}
    if unknown:
        raise TypeError(
            f"auto_register_kwargs: {sorted(unknown)} are not taken by kfacx's detection; it "
            "takes graph_patterns, patterns_to_skip, register_only_generic and on_unmatched."
        )
    kwargs["graph_patterns"] = tuple(p for p in ordered_patterns(patterns) if p.name not in skip)
    return kwargs
