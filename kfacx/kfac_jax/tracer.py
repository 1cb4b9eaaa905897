"""``kfac_jax.tracer``: `LayerVjpData`, and kfac-jax's tracer transformations on kfacx's
tracer.

kfac-jax's functions are curried: ``loss_tags_vjp(func)`` returns
``(transformed, get_jaxpr)`` and ``transformed(func_args)`` does the work. Here:

* ``loss_tags_vjp(func)``: ``transformed(func_args) -> (losses, vjp)``, ``vjp`` mapping
  one cotangent per loss to a parameter pytree;
* ``loss_tags_jvp(func)``: ``transformed(func_args, params_tangent) -> (losses,
  tangents)``;
* ``loss_tags_hvp(func)``: ``transformed(func_args, params_tangent) -> (hvp, losses)``,
  the Hessian of the summed losses times the tangent;
* ``layer_tags_vjp(func)``: ``transformed(func_args) -> (losses, vjp)``, ``vjp`` giving
  one `LayerVjpData` per layer (in kfacx's layer order, the order of the estimator's
  blocks), with the layer's inputs, outputs and parameters and the cotangents of its
  outputs and parameters;
* ``compute_all_losses(func)``: ``transformed(func_args) -> losses``.

The losses are kfacx's (`kfacx.losses`) seen through kfac-jax's loss API
(`kfacx.kfac_jax.loss_functions.KfacJaxLoss`: ``evaluate`` gives every example's loss). A
loss's cotangent or tangent is a tuple with one array (kfac-jax's losses can have several
inputs; kfacx's have one prediction).
``get_jaxpr(func_args)`` gives kfacx's traced function (`kfacx.tracer.trace`), not
kfac-jax's ``ProcessedJaxpr``.

Called as kfacx's functions are, with the function's arguments given
(``loss_tags_vjp(func, func_args)``), these are kfacx's own (`kfacx.tracer`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import jax
import jax.numpy as jnp

from kfacx import tracer as _tracer
from kfacx.kfac_jax._unsupported import unsupported_class
from kfacx.kfac_jax.layers_and_loss_tags import LayerData
from kfacx.kfac_jax.loss_functions import KfacJaxLoss

T = TypeVar("T")

__all__ = [
    "LayerVjpData",
    "ProcessedJaxpr",
    "compute_all_losses",
    "layer_tags_vjp",
    "loss_tags_hvp",
    "loss_tags_jvp",
    "loss_tags_vjp",
]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerVjpData(Generic[T]):
    """A layer's primal values (``primals.inputs``, ``.outputs``, ``.params``) and the
    gradients of its outputs (``tangents.outputs``), as a kfac-jax block receives them.

    ``example_mask`` (kfacx's addition; None without padding) weighs the examples, 0 for
    padding: the inputs of padded examples are zero already, and kfac-jax's dense blocks
    here also weigh the bias's column of ones by it."""

    primals: LayerData[T]
    tangents: LayerData[T]
    example_mask: Any = None


ProcessedJaxpr = unsupported_class(
    "tracer.ProcessedJaxpr", "kfacx.tracer.trace gives kfacx's traced function"
)


def _is_kfacx_call(args: tuple, kwargs: dict) -> bool:
    """Whether the function's arguments were given (kfacx's form) rather than
    ``params_index`` (kfac-jax's curried form)."""
    if "func_args" in kwargs:
        return True
    return bool(args) and not isinstance(args[0], int)


def _loss_vectors(vectors: Sequence[Any], what: str) -> tuple[jax.Array, ...]:
    """One array per loss, from kfac-jax's tuple per loss (or a bare array)."""
    out = []
    for i, v in enumerate(vectors):
        if isinstance(v, tuple | list):
            if len(v) != 1:
                raise ValueError(
                    f"{what}: loss {i} was given {len(v)} arrays; kfacx's losses take one "
                    "(the cotangent of their prediction)."
                )
            v = v[0]
        out.append(v)
    return tuple(out)


def _get_jaxpr(func: Callable[..., Any], params_index: int) -> Callable[[Any], Any]:
    def get_jaxpr(func_args: Sequence[Any]) -> Any:
        return _tracer.trace_cached(func, tuple(func_args), params_index)

    return get_jaxpr


def compute_all_losses(func: Callable[..., Any], params_index: int = 0):
    """kfac-jax's ``compute_all_losses``: ``(transformed, get_jaxpr)`` with
    ``transformed(func_args)`` the registered losses."""

    def transformed(func_args):
        zeros = jax.tree_util.tree_map(jnp.zeros_like, func_args[params_index])
        return _wrap(_tracer.loss_tags_jvp(func, tuple(func_args), zeros, params_index)[0])

    return transformed, _get_jaxpr(func, params_index)


def loss_tags_vjp(func: Callable[..., Any], *args: Any, **kwargs: Any):
    """kfac-jax's curried ``loss_tags_vjp(func, params_index=0)`` (see the module), or
    kfacx's ``loss_tags_vjp(func, func_args, params_index=0)``."""
    if _is_kfacx_call(args, kwargs):
        return _tracer.loss_tags_vjp(func, *args, **kwargs)
    params_index = _params_index(args, kwargs)

    def transformed(func_args):
        losses, vjp = _tracer.loss_tags_vjp(func, tuple(func_args), params_index)
        return _wrap(losses), lambda cotangents: vjp(_loss_vectors(cotangents, "loss_tags_vjp"))

    return transformed, _get_jaxpr(func, params_index)


def loss_tags_jvp(func: Callable[..., Any], *args: Any, **kwargs: Any):
    """kfac-jax's curried ``loss_tags_jvp(func, params_index=0)`` (see the module), or
    kfacx's ``loss_tags_jvp(func, func_args, params_tangent, params_index=0)``."""
    if _is_kfacx_call(args, kwargs):
        return _tracer.loss_tags_jvp(func, *args, **kwargs)
    params_index = _params_index(args, kwargs)

    def transformed(func_args, params_tangent):
        losses, tangents = _tracer.loss_tags_jvp(
            func, tuple(func_args), params_tangent, params_index
        )
        return _wrap(losses), tuple((t,) for t in tangents)

    return transformed, _get_jaxpr(func, params_index)


def loss_tags_hvp(func: Callable[..., Any], params_index: int = 0):
    """kfac-jax's ``loss_tags_hvp``: ``transformed(func_args, params_tangent) -> (hvp,
    losses)``, with ``hvp`` the Hessian of the sum of the registered losses
    (``sum(loss.evaluate())``) in the parameters, times ``params_tangent``."""

    def transformed(func_args, params_tangent):
        func_args = tuple(func_args)

        def summed(params):
            args = func_args[:params_index] + (params,) + func_args[params_index + 1 :]
            zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
            losses, _ = _tracer.loss_tags_jvp(func, args, zeros, params_index)
            return sum(jnp.sum(loss.evaluate()) for loss in _wrap(losses))

        def directional(params):
            return jax.jvp(summed, (params,), (params_tangent,))[1]

        hvp = jax.grad(directional)(func_args[params_index])
        return hvp, compute_all_losses(func, params_index)[0](func_args)

    return transformed, _get_jaxpr(func, params_index)


def layer_tags_vjp(func: Callable[..., Any], *args: Any, **kwargs: Any):
    """kfac-jax's curried ``layer_tags_vjp(func, params_index=0, auto_register_tags=True,
    raise_error_on_diff_jaxpr=True, **auto_registration_kwargs)`` (see the module), or
    kfacx's ``layer_tags_vjp(func, func_args, params_index=0)``."""
    if _is_kfacx_call(args, kwargs):
        return _tracer.layer_tags_vjp(func, *args, **kwargs)
    from kfacx import graph_matcher as _gm
    from kfacx.kfac_jax.tag_graph_matcher import detection_kwargs

    params_index = _params_index(args, kwargs)
    auto_register = kwargs.pop("auto_register_tags", args[1] if len(args) > 1 else True)
    kwargs.pop("raise_error_on_diff_jaxpr", None)
    detection = detection_kwargs(kwargs)
    detection.pop("on_unmatched", None)
    tagged_cache: dict[Any, Callable[..., Any]] = {}

    def tagged(func_args):
        if not auto_register:
            return func
        key = _tracer.shape_key(func_args)
        if key not in tagged_cache:
            patterns = detection["graph_patterns"]
            tagged_cache[key] = _gm.auto_register_tags(func, func_args, patterns, params_index)[0]
        return tagged_cache[key]

    def transformed(func_args):
        func_args = tuple(func_args)
        tagged_func = tagged(func_args)
        traced = _tracer.trace_cached(tagged_func, func_args, params_index)
        losses, layers_vjp = _tracer.layer_tags_vjp(tagged_func, func_args, params_index)
        _, params_vjp = _tracer.loss_tags_vjp(tagged_func, func_args, params_index)

        def vjp(cotangents):
            cotangents = _loss_vectors(cotangents, "layer_tags_vjp")
            data = layers_vjp(cotangents)
            grads = jax.tree_util.tree_leaves(params_vjp(cotangents))
            return tuple(
                LayerVjpData(
                    primals=LayerData(
                        inputs=tuple(d["inputs"]),
                        outputs=tuple(d["outputs"]),
                        params=tuple(d["params"]),
                    ),
                    tangents=LayerData(
                        inputs=(),
                        outputs=tuple(d["outputs_tangent"]),
                        params=tuple(grads[i] for i in leaves),
                    ),
                )
                for d, leaves in zip(data, traced.layer_param_leaves, strict=True)
            )

        return _wrap(losses), vjp

    return transformed, _get_jaxpr(func, params_index)


def _wrap(losses: Sequence[Any]) -> tuple[KfacJaxLoss, ...]:
    return tuple(KfacJaxLoss(loss) for loss in losses)


def _params_index(args: tuple, kwargs: dict) -> int:
    return int(kwargs.pop("params_index", args[0] if args else 0))
