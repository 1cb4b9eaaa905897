"""The built-in graph patterns: dense, convolution and embedding layers, and the
scale-and-shift ones of `kfacx.graph_matcher._scale_patterns`, in one precedence order."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kfacx import tags
from kfacx.graph_matcher import _scale_patterns as S
from kfacx.graph_matcher._pattern import OUTPUT_PERMUTATION, GraphPattern


def _find(eqns: Sequence[Any], primitive: str) -> Any:
    for eqn in eqns:
        if eqn.primitive.name == primitive:
            return eqn
    raise ValueError(f"no {primitive} equation in the match")


def dense_parameters_extractor(eqns: Sequence[Any]) -> dict[str, Any]:
    """Reads the contraction of the matched ``dot_general``.

    Raises:
      ValueError: for batched contractions (not a dense layer).
    """
    eqn = _find(eqns, "dot_general")
    x, w = (v.aval for v in eqn.invars)
    return tags.dense_meta(x.shape, w.shape, eqn.params["dimension_numbers"])


def weight_first_dense_parameters_extractor(eqns: Sequence[Any]) -> dict[str, Any]:
    """Reads the contraction of ``dot_general(w, x)`` followed by a transpose (as
    in ``jax.vmap`` of ``w @ x``, e.g. Equinox's Linear) as a dense layer ``x . w``;
    with a batch dimension over ``w``'s leading axis (Equinox under `jax.vmap` over
    stacked members, per-head weights in ``einsum('bthd,hde->bthe')``), a stacked one.

    For a stacked layer, a transpose to another layout than the dense one (batch,
    x's free axes, w's free axes), e.g. the head axis between the positions and the
    features of ``'bthd,hde->bthe'``, is read as the dense layer's output transposed
    (`OUTPUT_PERMUTATION`).

    Raises:
      ValueError: for an unstacked layer whose transpose does not give the dense
        layout (a weight-first contraction of a stacked weight on a shared input is
        `weight_first_shared_input_parameters_extractor`'s), or for other batched
        contractions.
    """
    eqn, transpose = _find(eqns, "dot_general"), _find(eqns, "transpose")
    w, x = (v.aval for v in eqn.invars)
    (w_axes, x_axes), (w_batch, x_batch) = eqn.params["dimension_numbers"]
    nb = len(w_batch)
    w_free, x_free = w.ndim - len(w_axes) - nb, x.ndim - len(x_axes) - nb
    # dot_general(w, x) is [batch, w free, x free]; the layer's output [batch, x free, w free].
    want = (*range(nb), *range(nb + w_free, nb + w_free + x_free), *range(nb, nb + w_free))
    meta = tags.dense_meta(x.shape, w.shape, ((x_axes, w_axes), (x_batch, w_batch)))
    perm = tuple(transpose.params["permutation"])
    if perm == want:
        return meta
    if not nb:
        raise ValueError("not the dense layout")
    # The matched output is the layer's, transposed: final[i] = layer[position of perm[i]].
    return {**meta, OUTPUT_PERMUTATION: tuple(want.index(p) for p in perm)}


def weight_first_shared_input_parameters_extractor(eqns: Sequence[Any]) -> dict[str, Any]:
    """Reads ``transpose(dot_general(w, x)) + b`` with ``w [M, ...]`` (Equinox's Linear
    under `jax.vmap` over stacked members, on an input shared by all of them) as a stacked
    dense layer on ``x`` broadcast to ``[M, *x.shape]``.

    Raises:
      ValueError: when ``w``'s leading axis is contracted or does not come first.
    """
    eqn, transpose = _find(eqns, "dot_general"), _find(eqns, "transpose")
    w, x = (v.aval for v in eqn.invars)
    (w_axes, x_axes), batch = eqn.params["dimension_numbers"]
    if batch[0] or batch[1] or 0 in w_axes:
        raise ValueError("not a contraction over a stacked weight")
    w_free, x_free = w.ndim - len(w_axes), x.ndim - len(x_axes)
    want = (0, *range(w_free, w_free + x_free), *range(1, w_free))
    if tuple(transpose.params["permutation"]) != want:
        raise ValueError("the stack axis does not come first")
    stacked = ((tuple(a + 1 for a in x_axes), tuple(w_axes)), ((0,), (0,)))
    return tags.dense_meta((w.shape[0], *x.shape), w.shape, stacked)


def transposed_weight_dense_parameters_extractor(eqns: Sequence[Any]) -> dict[str, Any]:
    """Reads ``x @ transpose(w)`` as a dense layer on the stored weight ``w``.

    Raises:
      ValueError: for batched contractions.
    """
    transpose, dot = _find(eqns, "transpose"), _find(eqns, "dot_general")
    perm = transpose.params["permutation"]
    x, w_t = (v.aval for v in dot.invars)
    (x_axes, wt_axes), batch = dot.params["dimension_numbers"]
    if batch[0] or batch[1]:
        raise ValueError("batched contraction of a transposed weight")
    w_shape = transpose.invars[0].aval.shape
    w_axes = tuple(perm[a] for a in wt_axes)
    meta = tags.dense_meta(x.shape, w_shape, ((x_axes, w_axes), batch))
    # The output keeps the transposed weight's free-axis order: it must be the stored one.
    free_t = [perm[a] for a in range(w_t.ndim) if a not in wt_axes]
    if free_t != sorted(free_t):
        raise ValueError("transposed free axes")
    return meta


def shared_input_stacked_dense_parameters_extractor(eqns: Sequence[Any]) -> dict[str, Any]:
    """Reads ``transpose(dot_general(x, w)) + b`` with ``w [M, ...]`` whose leading axis is
    moved to the front (``jax.vmap`` over the weights of an input shared by every slice,
    e.g. ensemble members) as a stacked dense layer on ``x`` broadcast to ``[M, *x.shape]``.

    Raises:
      ValueError: when the leading weight axis is contracted or not moved to the front.
    """
    transpose, dot = _find(eqns, "transpose"), _find(eqns, "dot_general")
    x, w = (v.aval for v in dot.invars)
    (x_axes, w_axes), batch = dot.params["dimension_numbers"]
    if batch[0] or batch[1] or 0 in w_axes:
        raise ValueError("not a contraction over a stacked weight")
    x_free = x.ndim - len(x_axes)
    perm = tuple(transpose.params["permutation"])
    out_ndim = x_free + w.ndim - len(w_axes)
    if perm != (x_free, *range(x_free), *range(x_free + 1, out_ndim)):
        raise ValueError("the stack axis is not moved to the front")
    stacked = ((tuple(a + 1 for a in x_axes), tuple(w_axes)), ((0,), (0,)))
    return tags.dense_meta((w.shape[0], *x.shape), w.shape, stacked)


def _broadcast_to_stack(x, params):
    return (jnp.broadcast_to(x, (params[0].shape[0], *x.shape)),)


def conv_parameters_extractor(eqns: Sequence[Any]) -> dict[str, Any]:
    """Reads strides, padding, dilations, layout and groups of the matched convolution.

    Raises:
      ValueError: for ``batch_group_count != 1`` (a weight-gradient convolution).
    """
    eqn = _find(eqns, "conv_general_dilated")
    p = eqn.params
    x, w = (v.aval for v in eqn.invars)
    dn = p["dimension_numbers"]
    names = (dn.lhs_spec, dn.rhs_spec, dn.out_spec)
    return tags.conv_meta(
        x.shape,
        w.shape,
        window_strides=p["window_strides"],
        padding=p["padding"],
        lhs_dilation=p["lhs_dilation"],
        rhs_dilation=p["rhs_dilation"],
        dimension_numbers=jax.lax.ConvDimensionNumbers(*names),
        feature_group_count=p["feature_group_count"],
        batch_group_count=p["batch_group_count"],
    )


def embedding_parameters_extractor(eqns: Sequence[Any]) -> dict[str, Any]:
    """Checks that the matched ``gather`` is a row lookup ``table[ids]``.

    Raises:
      ValueError: for any other gather (slices, multi-axis indexing).
    """
    eqn = _find(eqns, "gather")
    table, indices = (v.aval for v in eqn.invars)
    dn = eqn.params["dimension_numbers"]
    lookup = (
        table.ndim == 2
        and indices.shape[-1:] == (1,)
        and tuple(dn.collapsed_slice_dims) == (0,)
        and tuple(dn.start_index_map) == (0,)
        and tuple(dn.offset_dims) == (indices.ndim - 1,)
        and tuple(eqn.params["slice_sizes"]) == (1, table.shape[1])
        and not tuple(getattr(dn, "operand_batching_dims", ()))
    )
    if not lookup:
        raise ValueError("not a row lookup")
    return {}


def _lookup(indices, params):
    dn = jax.lax.GatherDimensionNumbers(
        offset_dims=(indices.ndim - 1,), collapsed_slice_dims=(0,), start_index_map=(0,)
    )
    table = params[0]
    return jax.lax.gather(table, indices, dn, (1, table.shape[1]), mode="promise_in_bounds")


def _z(*shape):
    return np.zeros(shape, np.float32)


def _conv(x, w):
    return jax.lax.conv_general_dilated(
        x, w, (1, 1), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )


DENSE_WITH_BIAS = GraphPattern(
    name="dense_with_bias",
    tag_primitive=tags.dense,
    compute_func=lambda x, p: jnp.matmul(x, p[0]) + p[1],
    parameters_extractor_func=dense_parameters_extractor,
    example_args=[_z(2, 3), [_z(3, 4), _z(4)]],
    precedence=30,
)


def _weight_first(x, w):
    return jax.lax.dot_general(w, x, (((1,), (1,)), ((), ()))).T


WEIGHT_FIRST_DENSE_WITH_BIAS = GraphPattern(
    name="weight_first_dense_with_bias",
    tag_primitive=tags.dense,
    compute_func=lambda x, p: _weight_first(x, p[0]) + p[1],
    parameters_extractor_func=weight_first_dense_parameters_extractor,
    example_args=[_z(2, 3), [_z(4, 3), _z(4)]],
    precedence=30,
)
WEIGHT_FIRST_DENSE = GraphPattern(
    name="weight_first_dense",
    tag_primitive=tags.dense,
    compute_func=lambda x, p: _weight_first(x, p[0]),
    parameters_extractor_func=weight_first_dense_parameters_extractor,
    example_args=[_z(2, 3), [_z(4, 3)]],
    precedence=12,
)
TRANSPOSED_WEIGHT_DENSE_WITH_BIAS = GraphPattern(
    name="transposed_weight_dense_with_bias",
    tag_primitive=tags.dense,
    compute_func=lambda x, p: jnp.matmul(x, p[0].T) + p[1],
    parameters_extractor_func=transposed_weight_dense_parameters_extractor,
    example_args=[_z(2, 3), [_z(4, 3), _z(4)]],
    precedence=30,
)
TRANSPOSED_WEIGHT_DENSE = GraphPattern(
    name="transposed_weight_dense",
    tag_primitive=tags.dense,
    compute_func=lambda x, p: jnp.matmul(x, p[0].T),
    parameters_extractor_func=transposed_weight_dense_parameters_extractor,
    example_args=[_z(2, 3), [_z(4, 3)]],
    precedence=12,
)
WEIGHT_FIRST_SHARED_INPUT_STACKED_DENSE_WITH_BIAS = GraphPattern(
    name="weight_first_shared_input_stacked_dense_with_bias",
    tag_primitive=tags.dense,
    compute_func=lambda x, p: (
        jnp.transpose(jax.lax.dot_general(p[0], x, (((2,), (1,)), ((), ()))), (0, 2, 1))
        + p[1][:, None, :]
    ),
    parameters_extractor_func=weight_first_shared_input_parameters_extractor,
    example_args=[_z(2, 3), [_z(4, 5, 3), _z(4, 5)]],
    precedence=30,
    tag_inputs_func=_broadcast_to_stack,
    tag_inputs_from_params=True,
)
#: ``einsum('nd,edf->enf', x, w)``: every slice of a stacked weight (MoE experts) on one
#: shared input, no bias; `jnp.einsum` emits ``dot_general(w, x)`` and a transpose that
#: moves the stack axis first.
WEIGHT_FIRST_SHARED_INPUT_STACKED_DENSE = GraphPattern(
    name="weight_first_shared_input_stacked_dense",
    tag_primitive=tags.dense,
    compute_func=lambda x, p: jnp.transpose(
        jax.lax.dot_general(p[0], x, (((2,), (1,)), ((), ()))), (0, 2, 1)
    ),
    parameters_extractor_func=weight_first_shared_input_parameters_extractor,
    example_args=[_z(2, 3), [_z(4, 5, 3)]],
    precedence=12,
    tag_inputs_func=_broadcast_to_stack,
    tag_inputs_from_params=True,
)
SHARED_INPUT_STACKED_DENSE_WITH_BIAS = GraphPattern(
    name="shared_input_stacked_dense_with_bias",
    tag_primitive=tags.dense,
    compute_func=lambda x, p: (
        jnp.transpose(jax.lax.dot_general(x, p[0], (((1,), (1,)), ((), ()))), (1, 0, 2))
        + p[1][:, None, :]
    ),
    parameters_extractor_func=shared_input_stacked_dense_parameters_extractor,
    example_args=[_z(2, 3), [_z(4, 3, 5), _z(4, 5)]],
    precedence=30,
    tag_inputs_func=_broadcast_to_stack,
    tag_inputs_from_params=True,
)
CONV_WITH_BIAS = GraphPattern(
    name="conv_with_bias",
    tag_primitive=tags.conv,
    compute_func=lambda x, p: _conv(x, p[0]) + p[1],
    parameters_extractor_func=conv_parameters_extractor,
    example_args=[_z(2, 5, 5, 3), [_z(3, 3, 3, 4), _z(4)]],
    precedence=30,
)
DENSE = GraphPattern(
    name="dense",
    tag_primitive=tags.dense,
    compute_func=lambda x, p: jnp.matmul(x, p[0]),
    parameters_extractor_func=dense_parameters_extractor,
    example_args=[_z(2, 3), [_z(3, 4)]],
    precedence=10,
)
CONV = GraphPattern(
    name="conv",
    tag_primitive=tags.conv,
    compute_func=lambda x, p: _conv(x, p[0]),
    parameters_extractor_func=conv_parameters_extractor,
    example_args=[_z(2, 5, 5, 3), [_z(3, 3, 3, 4)]],
    precedence=10,
)
EMBEDDING = GraphPattern(
    name="embedding",
    tag_primitive=tags.embedding,
    compute_func=_lookup,
    parameters_extractor_func=embedding_parameters_extractor,
    example_args=[np.zeros((2, 3, 1), np.int32), [_z(5, 4)]],
    precedence=10,
    tag_inputs_func=lambda indices: (indices[..., 0],),
)

#: The built-in patterns, in precedence order.
DEFAULT_GRAPH_PATTERNS: tuple[GraphPattern, ...] = (
    DENSE_WITH_BIAS,
    WEIGHT_FIRST_DENSE_WITH_BIAS,
    TRANSPOSED_WEIGHT_DENSE_WITH_BIAS,
    SHARED_INPUT_STACKED_DENSE_WITH_BIAS,
    WEIGHT_FIRST_SHARED_INPUT_STACKED_DENSE_WITH_BIAS,
    CONV_WITH_BIAS,
    S.NORMALIZATION,
    S.OFFSET_NORMALIZATION,
    S.STD_NORMALIZATION,
    S.OFFSET_STD_NORMALIZATION,
    S.SCALED_STD_NORMALIZATION,
    S.OFFSET_SCALED_STD_NORMALIZATION,
    S.KERAS_NORMALIZATION,
    S.OFFSET_SCALE_AND_SHIFT,
    S.SCALE_AND_SHIFT,
    S.NORMALIZATION_SCALE,
    S.OFFSET_NORMALIZATION_SCALE,
    S.STD_NORMALIZATION_SCALE,
    S.OFFSET_STD_NORMALIZATION_SCALE,
    S.SCALED_STD_NORMALIZATION_SCALE,
    S.OFFSET_SCALED_STD_NORMALIZATION_SCALE,
    S.KERAS_NORMALIZATION_SCALE,
    WEIGHT_FIRST_DENSE,
    WEIGHT_FIRST_SHARED_INPUT_STACKED_DENSE,
    TRANSPOSED_WEIGHT_DENSE,
    DENSE,
    CONV,
    EMBEDDING,
    S.OFFSET_SCALE,
    S.SCALE,
    S.SHIFT,
    S.BROADCAST_PARAMETER,
)
