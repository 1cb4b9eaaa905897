"""Shared block cases and independent numpy references for the block tests.

A `Case` describes one tagged layer (tag, parameter shapes, input shape and
metadata) and the block class that covers it. `Case.data` builds random
estimation data; the ``reference_*`` functions recompute what a block should
hold without using the block's own statistics code.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kfacx import blocks, tags

HIGHEST = jax.lax.Precision.HIGHEST


# ----------------------------------------------------------------------------- cases


@dataclasses.dataclass(frozen=True, eq=False)
class Case:
    """One layer covered by one block class.

    Attributes:
      name: test id.
      block_cls: the curvature block class under test.
      tag: the layer tag (its ``compute`` recomputes the layer).
      param_shapes: shapes of the parameters, in the tag's order.
      x_shape: shape of the layer input (``None`` for the generic tag).
      meta: the tag's static metadata.
      num_samples: number of output-cotangent samples ``S``.
      batch_size: batch size for the generic tag (otherwise ``x_shape[0]``).
      zero_inputs / zero_tangents: use all-zero inputs / cotangents.
    """

    name: str
    block_cls: type
    tag: tags.LayerTag
    param_shapes: tuple[tuple[int, ...], ...]
    x_shape: tuple[int, ...] | None
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)
    num_samples: int = 2
    generic_batch_size: int = 3
    zero_inputs: bool = False
    zero_tangents: bool = False

    def __repr__(self) -> str:
        return self.name

    # -- kinds

    @property
    def is_kronecker(self) -> bool:
        return issubclass(self.block_cls, blocks.TwoKroneckerFactored)

    @property
    def is_conv(self) -> bool:
        return issubclass(self.block_cls, blocks.ConvTwoKroneckerFactored)

    @property
    def is_dense_kronecker(self) -> bool:
        return issubclass(self.block_cls, blocks.DenseTwoKroneckerFactored)

    @property
    def is_full(self) -> bool:
        return issubclass(self.block_cls, (blocks.Full, blocks.ScaleAndShiftFull))

    @property
    def is_generic(self) -> bool:
        return self.x_shape is None

    @property
    def batch_size(self) -> int:
        return self.generic_batch_size if self.is_generic else self.x_shape[0]

    @property
    def dim(self) -> int:
        return sum(math.prod(s) for s in self.param_shapes)

    # -- construction

    def output_shape(self) -> tuple[int, ...]:
        if self.is_generic:
            return self.param_shapes[0]
        x = jax.ShapeDtypeStruct(self.x_shape, jnp.float32)
        ps = tuple(jax.ShapeDtypeStruct(s, jnp.float32) for s in self.param_shapes)
        out = jax.eval_shape(lambda x_, p_: self.tag.compute((x_,), p_, **self.meta)[0], x, ps)
        return tuple(out.shape)

    def layer(self, dtype: Any = jnp.float32) -> blocks.LayerInfo:
        params = [jax.ShapeDtypeStruct(s, dtype) for s in self.param_shapes]
        if self.is_generic:
            return blocks.LayerInfo.from_params(
                self.tag.name, params, meta=dict(self.meta), compute=None,
                output_shapes=(self.param_shapes[0],),
            )
        return blocks.LayerInfo.from_params(
            self.tag.name, params, meta=dict(self.meta), compute=self.tag.compute,
            input_shapes=(self.x_shape,), output_shapes=(self.output_shape(),),
        )

    def block(self, dtype: Any = jnp.float32) -> blocks.CurvatureBlock:
        return self.block_cls(self.layer(dtype))

    def params(self, seed: int = 0, dtype: Any = jnp.float32) -> tuple[jax.Array, ...]:
        rng = np.random.default_rng(seed)
        return tuple(jnp.asarray(_normal(rng, s), dtype) for s in self.param_shapes)

    def data(self, seed: int = 0, dtype: Any = jnp.float32) -> dict[str, tuple[jax.Array, ...]]:
        """Random estimation data: ``inputs``, ``outputs``, ``params``, ``outputs_tangent``."""
        rng = np.random.default_rng(1000 + seed)
        params = self.params(seed, dtype)
        if self.is_generic:
            x_in: tuple[jax.Array, ...] = ()
            y = params[0]
        else:
            x = _normal(rng, self.x_shape)
            if self.zero_inputs:
                x = np.zeros_like(x)
            x_in = (jnp.asarray(x, dtype),)
            y = self.tag.compute(x_in, params, **self.meta)[0]
        dy = _normal(rng, (self.num_samples, *y.shape))
        if self.zero_tangents:
            dy = np.zeros_like(dy)
        return dict(
            inputs=x_in, outputs=(y,), params=params, outputs_tangent=(jnp.asarray(dy, dtype),)
        )

    def vector(self, seed: int = 0, dtype: Any = jnp.float32) -> tuple[jax.Array, ...]:
        rng = np.random.default_rng(2000 + seed)
        return tuple(jnp.asarray(_normal(rng, s), dtype) for s in self.param_shapes)

    def fitted(self, seed: int = 0, dtype: Any = jnp.float32, **init_kwargs: Any):
        """``(block, state, data)`` after one update with ``ema_old=0, ema_new=1``."""
        block = self.block(dtype)
        data = self.data(seed, dtype)
        state = block.init(jax.random.key(0), **init_kwargs)
        state = block.update_curvature_matrix_estimate(state, data, 0.0, 1.0, self.batch_size)
        return block, state, data


def _normal(rng: np.random.Generator, shape: Sequence[int]) -> np.ndarray:
    return rng.standard_normal(tuple(shape)).astype(np.float32)


def dense_case(
    name: str, x_shape: tuple[int, ...], d_out: int, bias: bool,
    block_cls: type = blocks.DenseTwoKroneckerFactored, **kwargs: Any,
) -> Case:
    shapes = ((x_shape[-1], d_out),) + (((d_out,),) if bias else ())
    return Case(name, block_cls, tags.dense, shapes, x_shape, **kwargs)


def conv_case(
    name: str, x_shape: tuple[int, ...], w_shape: tuple[int, ...], bias: bool,
    block_cls: type = blocks.ConvTwoKroneckerFactored, case_kwargs: dict | None = None,
    **conv_kwargs: Any,
) -> Case:
    meta = tags.conv_meta(x_shape, w_shape, **conv_kwargs)
    out_features = w_shape[meta["dimension_numbers"].rhs_spec[0]]
    shapes = (tuple(w_shape),) + (((out_features,),) if bias else ())
    return Case(name, block_cls, tags.conv, shapes, x_shape, meta, **(case_kwargs or {}))


def scale_and_shift_case(
    name: str, x_shape: tuple[int, ...], scale_shape: tuple[int, ...] | None,
    shift_shape: tuple[int, ...] | None, block_cls: type,
) -> Case:
    shapes = tuple(s for s in (scale_shape, shift_shape) if s is not None)
    meta = dict(has_scale=scale_shape is not None, has_shift=shift_shape is not None)
    return Case(name, block_cls, tags.scale_and_shift, shapes, x_shape, meta)


def generic_case(name: str, shape: tuple[int, ...], block_cls: type) -> Case:
    return Case(name, block_cls, tags.generic, (shape,), None)


# ----------------------------------------------------------------------------- references


def kronecker_positions(block: blocks.TwoKroneckerFactored) -> np.ndarray:
    """``P[i] = vec(params_to_matrix(e_i))``: flattened parameters -> matrix layout."""
    eye = jnp.eye(block.dim, dtype=jnp.float32)
    mats = jax.vmap(
        lambda e: block.params_to_matrix(blocks.unflatten_params(e, block.parameters_shapes))
    )(eye)
    return np.asarray(mats, np.float64).reshape(block.dim, -1)


def kronecker_dense(block, a: np.ndarray, g: np.ndarray) -> np.ndarray:
    """The dense ``[dim, dim]`` matrix of ``block_diag_g(A[g] (x) G[g])`` over the parameters."""
    a, g = np.asarray(a, np.float64), np.asarray(g, np.float64)
    per_group = [np.kron(ai, gi) for ai, gi in zip(a, g, strict=True)]
    big = np.zeros((sum(p.shape[0] for p in per_group),) * 2)
    o = 0
    for p in per_group:
        big[o : o + p.shape[0], o : o + p.shape[0]] = p
        o += p.shape[0]
    pos = kronecker_positions(block)
    return pos @ big @ pos.T


def conv_patches_reference(block: blocks.ConvTwoKroneckerFactored, x: jax.Array) -> np.ndarray:
    """Input patches ``[batch * positions, groups, in_per_group * kernel]``, in the layout of
    `params_to_matrix`, from kernel gradients of `jax.lax.conv_general_dilated`.

    The gradient of ``y[b, o, t]`` with respect to the kernel is the input patch at
    output position ``t`` (zero outside output feature ``o``). One-hot cotangents at
    ``(b, t)`` and the first output feature of every group give all groups' patches.
    """
    meta = block.layer.meta
    dn = meta["dimension_numbers"]
    w_shape = block.parameters_shapes[0]
    groups = meta["feature_group_count"]
    x = jnp.asarray(x, jnp.float32)

    def conv(w):
        return jax.lax.conv_general_dilated(
            x, w, meta["window_strides"], meta["padding"], meta["lhs_dilation"],
            meta["rhs_dilation"], dn, groups, precision=HIGHEST,
        )

    y, vjp = jax.vjp(conv, jnp.zeros(w_shape, jnp.float32))
    ch = dn.out_spec[1]
    out_features = y.shape[ch]
    per_group = out_features // groups
    positions = [s for i, s in enumerate(y.shape) if i != ch]
    count = math.prod(positions)
    cot = np.zeros((count, *positions, out_features), np.float32)
    idx = np.unravel_index(np.arange(count), positions)
    for g in range(groups):
        cot[(np.arange(count), *idx, np.full(count, g * per_group))] = 1.0
    cot = np.moveaxis(cot, -1, ch + 1)
    (grads,) = jax.vmap(vjp)(jnp.asarray(cot))
    extra = () if not block.has_bias else (jnp.zeros((count, out_features), jnp.float32),)
    mats = jax.vmap(lambda *p: block.params_to_matrix(p))(grads, *extra)
    mats = np.asarray(mats, np.float64)
    if block.has_bias:
        mats = mats[:, :, :-1]
    return mats[..., 0]  # Column 0: the first output feature of every group.


def reference_kronecker_factors(case: Case, block, data, batch_size: int):
    """``(A, G)`` stacks ``[groups, n, n]`` and ``[groups, m, m]`` computed in float64."""
    (x,) = data["inputs"]
    (dy,) = data["outputs_tangent"]
    dy = np.asarray(jnp.asarray(dy, jnp.float32), np.float64)
    if case.is_conv:
        rows = conv_patches_reference(block, x)
        dn = case.meta["dimension_numbers"]
        groups = case.meta["feature_group_count"]
        dy = np.moveaxis(dy, dn.out_spec[1] + 1, -1)
        dy = dy.reshape(-1, groups, dy.shape[-1] // groups)
    else:
        x = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
        rows = x.reshape(-1, 1, x.shape[-1])
        dy = dy.reshape(-1, 1, dy.shape[-1])
    if block.has_bias:
        rows = np.concatenate([rows, np.ones(rows.shape[:-1] + (1,))], axis=-1)
    a = np.einsum("rgi,rgj->gij", rows, rows) / rows.shape[0]
    g = np.einsum("rgi,rgj->gij", dy, dy) / batch_size
    return a, g


def reference_per_example_gradients(case: Case, data) -> np.ndarray:
    """``[samples * examples, dim]`` per-example gradients by `jax.grad` of ``<y_b, dy_sb>``."""
    (dy,) = data["outputs_tangent"]
    params = tuple(jnp.asarray(p, jnp.float32) for p in data["params"])
    dy = jnp.asarray(dy, jnp.float32)
    if case.is_generic:
        return np.asarray(dy, np.float64).reshape(dy.shape[0], -1)
    (x,) = data["inputs"]
    x = jnp.asarray(x, jnp.float32)

    def grad(xb, dyb):
        def inner(p):
            (y,) = case.tag.compute((xb[None],), p, **case.meta)
            return jnp.sum(y * dyb[None])

        return blocks.flatten_params(jax.grad(inner)(params))

    per_example = jax.vmap(jax.vmap(grad), in_axes=(None, 0))(x, dy)
    return np.asarray(per_example, np.float64).reshape(-1, case.dim)


def reference_dense_matrix(case: Case, block, data) -> np.ndarray:
    """The block's expected dense matrix, computed without the block's statistics code."""
    if case.is_kronecker:
        a, g = reference_kronecker_factors(case, block, data, case.batch_size)
        return kronecker_dense(block, a, g)
    rows = reference_per_example_gradients(case, data)
    full = rows.T @ rows / case.batch_size
    return full if case.is_full else np.diag(np.diag(full))


def dense_matpower(matrix: np.ndarray, identity_weight: float, power: float) -> np.ndarray:
    """``(matrix + identity_weight I)^power`` by a float64 eigendecomposition."""
    m = np.asarray(matrix, np.float64)
    vals, vecs = np.linalg.eigh((m + m.T) / 2 + identity_weight * np.eye(m.shape[0]))
    return (vecs * vals**power) @ vecs.T


def pi_damped_reference(block, state, vector, identity_weight: float, power: float) -> np.ndarray:
    """``(A + pi sqrt(l) I)^p (x) (G + sqrt(l)/pi I)^p`` applied per group, in float64,
    returned in `params_to_matrix` layout ``[groups, n, m]``."""
    v = np.asarray(block.params_to_matrix(vector), np.float64)
    a_all = np.asarray(state.factors[0].value, np.float64)
    g_all = np.asarray(state.factors[1].value, np.float64)
    out = []
    for a, g, vg in zip(a_all, g_all, v, strict=True):
        n, m = a.shape[0], g.shape[0]
        ta, tg = np.trace(a) / n, np.trace(g) / m
        pi = np.sqrt(ta / tg) if ta > 0 and tg > 0 else 1.0
        root = np.sqrt(identity_weight)
        ma = dense_matpower(a, pi * root, power)
        mg = dense_matpower(g, root / pi, power)
        out.append((np.kron(ma, mg) @ vg.reshape(-1)).reshape(n, m))
    return np.stack(out)


def assert_close_rel(actual: Any, expected: Any, tol: float, what: str = "") -> None:
    """``||actual - expected|| <= tol * max(||expected||, tiny)`` (Frobenius norms)."""
    actual = np.asarray(jnp.asarray(actual, jnp.float32), np.float64)
    expected = np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    assert np.all(np.isfinite(actual)), f"{what}: non-finite values"
    err = np.linalg.norm(actual - expected)
    scale = max(np.linalg.norm(expected), 1e-30)
    assert err <= tol * scale, f"{what}: relative error {err / scale:.3g} > {tol:.3g}"
