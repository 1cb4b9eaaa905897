"""Per-example parameter gradients from a layer's inputs and output cotangents.

Diagonal and full blocks estimate ``E[g g^T]`` from per-example gradients
``g``. Each function returns, for every parameter, an array
``[num_rows, *param_shape]`` whose rows' second moments are summed (rows are
samples x examples).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp

from kfacx.blocks._base import LayerInfo, Params


def generic_per_example_gradients(
    layer: LayerInfo, data: Mapping[str, Sequence[jax.Array]]
) -> Params:
    """Per-example gradients of any layer, by a vmapped vjp of ``layer.compute``.

    For a layer without ``compute`` (the generic tag, whose output is the
    parameter itself) the output cotangent *is* the gradient of the whole
    batch; each sample then gives one row.
    """
    tangents = tuple(data["outputs_tangent"])
    if layer.compute is None:
        return tangents
    inputs, params = tuple(data["inputs"]), tuple(data["params"])

    def one_example(example_inputs, example_tangents):
        def outputs(p):
            return layer.compute(tuple(a[None] for a in example_inputs), p, **layer.meta)

        _, vjp = jax.vjp(outputs, params)
        return vjp(tuple(t[None] for t in example_tangents))[0]

    per_sample = jax.vmap(jax.vmap(one_example), in_axes=(None, 0))(inputs, tangents)
    return tuple(g.reshape((-1,) + g.shape[2:]) for g in per_sample)


def _reduce_to(per_example: jax.Array, param_shape: tuple[int, ...]) -> jax.Array:
    """Sums ``[rows, *example_shape]`` over the axes a parameter is broadcast along."""
    example_shape = per_example.shape[1:]
    shape = param_shape[1:] if len(param_shape) == len(example_shape) + 1 else param_shape
    shape = (1,) * (len(example_shape) - len(shape)) + tuple(shape)
    axes = tuple(
        i + 1
        for i, (p, e) in enumerate(zip(shape, example_shape, strict=True))
        if p == 1 and e != 1
    )
    reduced = jnp.sum(per_example, axis=axes, keepdims=True)
    return reduced.reshape((per_example.shape[0],) + tuple(param_shape))


def scale_and_shift_per_example_gradients(
    layer: LayerInfo, data: Mapping[str, Sequence[jax.Array]]
) -> Params:
    """Closed-form per-example gradients of ``y = x * scale + shift``."""
    (x,) = data["inputs"]
    (dy,) = data["outputs_tangent"]
    dy = dy.reshape((-1,) + dy.shape[2:])
    x = jnp.broadcast_to(x[None], (dy.shape[0] // x.shape[0],) + x.shape).reshape(dy.shape)
    grads = []
    shapes = iter(layer.parameter_shapes)
    if layer.meta.get("has_scale", True):
        grads.append(_reduce_to(x * dy, next(shapes)))
    if layer.meta.get("has_shift", False):
        grads.append(_reduce_to(dy, next(shapes)))
    return tuple(grads)
