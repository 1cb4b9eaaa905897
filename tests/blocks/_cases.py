"""Shared block cases and independent numpy references for the block tests.

A `Case` describes one tagged layer (tag, parameter shapes, input shape and
metadata) and the block class that covers it. `Case.data` builds random
estimation data; the ``reference_*`` functions recompute what a block should
hold without using the block's own statistics code.

The references and the host-side helpers live in tests/blocks/_references.py and are
re-exported here (the tests use them as ``_cases.X``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kfacx import blocks, tags

from ._references import (
    HIGHEST,
    _cast,
    _normal,
    assert_close_rel,
    conv_patches_reference,
    dense_matpower,
    factor_value,
    fast_jit,
    flat,
    kronecker_dense,
    kronecker_positions,
    pi_damped_reference,
    reference_dense_matrix,
    reference_kronecker_factors,
    reference_per_example_gradients,
    stacked_two,
    state_dense,
    to_matrix_layout,
)

# The references re-exported: the tests use them as ``_cases.X``.
__all__ = [
    "APPROX_CONFIGS",
    "CONV",
    "Case",
    "EXACT_CONFIGS",
    "HIGHEST",
    "all_products",
    "assert_close_rel",
    "conv_case",
    "conv_patches_reference",
    "dense_case",
    "dense_matpower",
    "factor_value",
    "fast_jit",
    "flat",
    "generic_case",
    "jit_statistics",
    "jit_to_dense",
    "jit_update",
    "kronecker_dense",
    "kronecker_positions",
    "pi_damped_reference",
    "products",
    "reference_dense_matrix",
    "reference_kronecker_factors",
    "reference_per_example_gradients",
    "scale_and_shift_case",
    "stacked_two",
    "state_dense",
    "to_matrix_layout",
]

CONV = blocks.ConvTwoKroneckerFactored


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
      generic_batch_size: batch size for the generic tag (otherwise ``x_shape[0]``).
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
                self.tag.name,
                params,
                meta=dict(self.meta),
                compute=None,
                output_shapes=(self.param_shapes[0],),
            )
        return blocks.LayerInfo.from_params(
            self.tag.name,
            params,
            meta=dict(self.meta),
            compute=self.tag.compute,
            input_shapes=(self.x_shape,),
            output_shapes=(self.output_shape(),),
        )

    def block(self, dtype: Any = jnp.float32) -> blocks.CurvatureBlock:
        """The block (one instance per case and dtype, so jitted helpers are reused)."""
        return _block(self, jnp.dtype(dtype))

    def params(self, seed: int = 0, dtype: Any = jnp.float32) -> tuple[jax.Array, ...]:
        rng = np.random.default_rng(seed)
        return tuple(_cast(_normal(rng, s), dtype) for s in self.param_shapes)

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
            x_in = (_cast(x, dtype),)
            y = self.tag.compute(x_in, params, **self.meta)[0]
        dy = _normal(rng, (self.num_samples, *y.shape))
        if self.zero_tangents:
            dy = np.zeros_like(dy)
        return dict(inputs=x_in, outputs=(y,), params=params, outputs_tangent=(_cast(dy, dtype),))

    def vector(self, seed: int = 0, dtype: Any = jnp.float32) -> tuple[jax.Array, ...]:
        rng = np.random.default_rng(2000 + seed)
        return tuple(_cast(_normal(rng, s), dtype) for s in self.param_shapes)

    def fitted(self, seed: int = 0, dtype: Any = jnp.float32, **init_kwargs: Any):
        """``(block, state, data)`` after one update with ``ema_old=0, ema_new=1``.

        The state's cache has the structure requested by ``init_kwargs`` (not yet
        computed: call ``update_cache``).
        """
        block = self.block(dtype)
        factors, data = _fitted(self, seed, jnp.dtype(dtype))
        state = block.init(jax.random.key(0), **init_kwargs)._replace(factors=factors)
        return block, state, data


@functools.cache
def _block(case: Case, dtype: np.dtype) -> blocks.CurvatureBlock:
    return case.block_cls(case.layer(dtype))


@functools.cache
def _fitted(case: Case, seed: int, dtype: np.dtype):
    block = case.block(dtype)
    data = case.data(seed, dtype)
    state = block.init(jax.random.key(0))
    return jit_update(block)(state, data, 0.0, 1.0, case.batch_size).factors, data


@functools.cache
def jit_update(block: blocks.CurvatureBlock):
    """``block.update_curvature_matrix_estimate`` jitted (``batch_size`` static).

    Used for speed in setup code; eager and jitted updates are compared in the jit tests.
    """
    return fast_jit(block.update_curvature_matrix_estimate, static_argnums=(4,))


@functools.cache
def jit_to_dense(block: blocks.CurvatureBlock):
    """``block.to_dense_matrix`` jitted (compared with eager calls in the jit tests)."""
    return fast_jit(block.to_dense_matrix)


@functools.cache
def jit_statistics(block: blocks.CurvatureBlock):
    """``block.compute_statistics`` jitted (``batch_size`` static)."""
    return fast_jit(block.compute_statistics, static_argnums=(1,))


# (power, exact_power, use_cached) of the products checked for every case.
EXACT_CONFIGS = [
    (1.0, True, False),
    (-1.0, True, False),
    (-0.5, True, False),
    (-1.0, True, True),
    (-0.5, True, True),
]
APPROX_CONFIGS = [
    (-1.0, False, False),
    (-1.0, False, True),
    (-0.5, False, False),
    (-0.5, False, True),
]


def products(case: Case, identity_weight: float, exact_power: bool):
    """``(block, state, vector, outputs)`` for the exact or the approximate products.

    The state's cache (exact and approximate powers -1 and -0.5) is computed by
    ``update_cache(state, identity_weight)``; ``outputs[(power, exact_power, use_cached)]``
    is ``multiply_matpower(state, vector, identity_weight, ...)`` for the configurations
    of `EXACT_CONFIGS` or `APPROX_CONFIGS`.

    Everything is computed by one jitted program per case (compiling each eager op for
    every case would dominate the test time; eager calls are compared with it in the
    jit tests). If that program fails, each group is computed on its own, so that a
    failure in one group does not hide the other.
    """
    both = _products(case, identity_weight, (True, False), catch=True)
    if both is None:
        return _products(case, identity_weight, (exact_power,), catch=False)
    block, state, vector, outputs = both
    return block, state, vector, {c: o for c, o in outputs.items() if c[1] == exact_power}


@functools.cache
def _products(case: Case, identity_weight: float, groups: tuple[bool, ...], catch: bool):
    powers = (-1.0, -0.5)
    block, state, _ = case.fitted(
        exact_powers_to_cache=powers if True in groups else (),
        approx_powers_to_cache=powers if False in groups else (),
    )
    configs = [c for c in EXACT_CONFIGS + APPROX_CONFIGS if c[1] in groups]
    vector = case.vector()

    @fast_jit
    def run(state, vector, weight):
        state = block.update_cache(state, weight)
        outs = [block.multiply_matpower(state, vector, weight, *c) for c in configs]
        return state, outs

    try:
        state, outs = run(state, vector, identity_weight)
    except Exception:
        if catch:
            return None
        raise
    return block, state, vector, dict(zip(configs, outs, strict=True))


def all_products(case: Case, identity_weight: float):
    """`products` of both groups: ``[(block, state, vector, outputs), ...]`` (the state is
    the same unless the combined program failed)."""
    return [products(case, identity_weight, exact) for exact in (True, False)]


def dense_case(
    name: str,
    x_shape: tuple[int, ...],
    d_out: int | None,
    bias: bool,
    block_cls: type = blocks.DenseTwoKroneckerFactored,
    *,
    w_shape: tuple[int, ...] | None = None,
    dimension_numbers: Any = None,
    **kwargs: Any,
) -> Case:
    """A dense layer: ``x @ w`` with ``w [x_shape[-1], d_out]``, or any ``dot_general``
    contraction of ``x`` with ``w [*w_shape]`` (the bias has ``w``'s free axes)."""
    w_shape = tuple(w_shape or (x_shape[-1], d_out))
    meta = tags.dense_meta(x_shape, w_shape, dimension_numbers)
    (_, w_axes), _ = meta["dimension_numbers"]
    b_shape = tuple(d for i, d in enumerate(w_shape) if i not in w_axes)
    shapes = (w_shape,) + ((b_shape,) if bias else ())
    return Case(name, block_cls, tags.dense, shapes, x_shape, meta, **kwargs)


def conv_case(
    name: str,
    x_shape: tuple[int, ...],
    w_shape: tuple[int, ...],
    bias: bool,
    block_cls: type = blocks.ConvTwoKroneckerFactored,
    case_kwargs: dict | None = None,
    **conv_kwargs: Any,
) -> Case:
    meta = tags.conv_meta(x_shape, w_shape, **conv_kwargs)
    out_features = w_shape[meta["dimension_numbers"].rhs_spec[0]]
    shapes = (tuple(w_shape),) + (((out_features,),) if bias else ())
    return Case(name, block_cls, tags.conv, shapes, x_shape, meta, **(case_kwargs or {}))


def scale_and_shift_case(
    name: str,
    x_shape: tuple[int, ...],
    scale_shape: tuple[int, ...] | None,
    shift_shape: tuple[int, ...] | None,
    block_cls: type,
) -> Case:
    shapes = tuple(s for s in (scale_shape, shift_shape) if s is not None)
    meta = dict(has_scale=scale_shape is not None, has_shift=shift_shape is not None)
    return Case(name, block_cls, tags.scale_and_shift, shapes, x_shape, meta)


def generic_case(name: str, shape: tuple[int, ...], block_cls: type) -> Case:
    return Case(name, block_cls, tags.generic, (shape,), None)
