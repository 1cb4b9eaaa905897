"""Kronecker-factored blocks: ``C = A (x) G`` per group, for dense and conv layers.

Parameters are laid out as a stack of matrices ``V[g]`` of shape ``[n, m]``
(``n`` inputs, bias row last; ``m`` outputs; ``g`` a feature group, one for
dense layers). The block acts as ``V[g] -> A[g] V[g] G[g]``, i.e. as
``block_diag_g(A[g] (x) G[g])`` on the row-major flattening of ``V``.

Statistics ("expand" K-FAC for shared positions):
``A = sum over rows of x x^T / (number of rows)`` where a row is one example
at one position (sequence step or output pixel), and
``G = sum over rows of dy dy^T / batch_size``.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kfacx import linalg
from kfacx.blocks._base import (
    BlockState,
    CurvatureBlock,
    InverseRefresh,
    LayerInfo,
    Params,
    cast_to,
    row_mask,
    zeros,
)
from kfacx.blocks._eigenbasis import (
    change_basis,
    identity_stack,
    missing_cached_eigenbasis,
    rotate,
)


class KroneckerEigen(NamedTuple):
    """Eigendecompositions of both factors (eigenvalues clipped at zero)."""

    inputs_eigenvalues: jax.Array
    inputs_eigenvectors: jax.Array
    outputs_eigenvalues: jax.Array
    outputs_eigenvectors: jax.Array


class KroneckerPair(NamedTuple):
    """A damped power of each factor, ``(A + d_a I)^p`` and ``(G + d_g I)^p``."""

    inputs: jax.Array
    outputs: jax.Array


class KroneckerCache(NamedTuple):
    """What `TwoKroneckerFactored.update_cache` keeps; absent entries are None."""

    eigen: KroneckerEigen | None
    inverse: KroneckerPair | None
    inverse_sqrt: KroneckerPair | None


class TwoKroneckerFactored(CurvatureBlock):
    """Abstract base of two-factor blocks ``A (x) G`` (with feature groups).

    Subclasses give the factor sizes, the parameter <-> matrix layout and the
    factor statistics. Exact powers use the eigendecompositions of both
    factors, ``(A (x) G + l I)^p = (U_A (x) U_G) diag((a_i g_j + l)^p) (U_A (x) U_G)^T``;
    approximate powers use factored ("pi") damping,
    ``(A + pi sqrt(l) I)^p (x) (G + sqrt(l)/pi I)^p``.
    """

    @property
    @abc.abstractmethod
    def num_groups(self) -> int:
        """Number of independent feature groups (1 for dense layers)."""

    @property
    @abc.abstractmethod
    def input_size(self) -> int:
        """Size ``n`` of the input factor of one group (bias included)."""

    @property
    @abc.abstractmethod
    def output_size(self) -> int:
        """Size ``m`` of the output factor of one group."""

    @abc.abstractmethod
    def params_to_matrix(self, params: Sequence[jax.Array]) -> jax.Array:
        """Parameters -> ``[num_groups, input_size, output_size]``."""

    @abc.abstractmethod
    def matrix_to_params(self, matrix: jax.Array) -> Params:
        """Inverse of `params_to_matrix`."""

    def factor_shapes(self):
        g, n, m = self.num_groups, self.input_size, self.output_size
        return ((g, n, n), (g, m, m))

    def factor_values(self, state: BlockState) -> tuple[jax.Array, jax.Array]:
        """The two factors ``(A, G)`` of the curvature ``A (x) G``: the moving averages
        here; blocks that scale them (TNT) override this, and every product, refresh
        and norm goes through it."""
        a, g = state.factors
        return a.value, g.value

    # ---------------------------------------------------------------- cache

    def init_cache(self, exact_powers_to_cache, approx_powers_to_cache, cache_eigenvalues):
        (g, n, _), (_, m, _) = self.factor_shapes()
        dt = self.dtype
        pairs = self._approx_cache_fields(
            approx_powers_to_cache,
            lambda: KroneckerPair(zeros((g, n, n), dt), zeros((g, m, m), dt)),
        )
        eigen = None
        if exact_powers_to_cache or cache_eigenvalues:
            # The eigendecomposition of the zero factors, until the first refresh.
            eigen = KroneckerEigen(
                zeros((g, n), dt),
                identity_stack(n, dt, (g,)),
                zeros((g, m), dt),
                identity_stack(m, dt, (g,)),
            )
        return KroneckerCache(eigen=eigen, **pairs)

    def update_cache(self, state: BlockState, identity_weight: Any) -> BlockState:
        a, g = self.factor_values(state)
        cache: KroneckerCache = state.cache
        if cache.eigen is not None:
            cache = cache._replace(eigen=KroneckerEigen(*linalg.safe_eigh(a), *linalg.safe_eigh(g)))
        cache = self._refresh_approx_cache(
            cache, lambda power: self._approx_factors(a, g, identity_weight, power)
        )
        return state._replace(cache=cache)

    def inverse_refresh(self, state: BlockState, identity_weight: Any) -> InverseRefresh | None:
        cache: KroneckerCache = state.cache
        if not self._inverse_only(cache):
            return None
        a, g = self.factor_values(state)

        def finish(inverses):
            return state._replace(cache=cache._replace(inverse=KroneckerPair(*inverses)))

        return InverseRefresh((a, g), linalg.PiDamping(identity_weight), finish)

    @staticmethod
    def _approx_factors(a, g, identity_weight, power) -> KroneckerPair:
        d_a, d_g = linalg.pi_adjusted_damping(a, g, identity_weight)
        if power == -1.0:
            return KroneckerPair(linalg.psd_inverse(a, d_a), linalg.psd_inverse(g, d_g))
        return KroneckerPair(linalg.psd_matpower(a, power, d_a), linalg.psd_matpower(g, power, d_g))

    # ---------------------------------------------------------------- products

    def _multiply(self, state, vector, identity_weight):
        a, g = self.factor_values(state)
        v = self.params_to_matrix(vector).astype(self.dtype)
        out = a @ v @ g + jnp.asarray(identity_weight, self.dtype) * v
        return self._to_params(out, vector)

    def _multiply_matpower(self, state, vector, identity_weight, power, exact_power, use_cached):
        v = self.params_to_matrix(vector).astype(self.dtype)
        if exact_power:
            out = self._exact_matpower(self._eigen(state, use_cached), v, identity_weight, power)
        else:
            pair = self._approx_pair(state, identity_weight, power, use_cached)
            out = pair.inputs @ v @ pair.outputs
        return self._to_params(out, vector)

    def _eigen(self, state: BlockState, use_cached: bool) -> KroneckerEigen:
        if not use_cached:
            a, g = self.factor_values(state)
            return KroneckerEigen(*linalg.safe_eigh(a), *linalg.safe_eigh(g))
        if state.cache.eigen is None:
            raise self._missing_cache("an eigendecomposition", "exact_powers_to_cache=(power,)")
        return state.cache.eigen

    def _approx_pair(self, state, identity_weight, power, use_cached) -> KroneckerPair:
        a, g = self.factor_values(state)
        return self._approx_cached_or_now(
            state, power, use_cached, lambda: self._approx_factors(a, g, identity_weight, power)
        )

    @staticmethod
    def _exact_matpower(eigen: KroneckerEigen, v, identity_weight, power):
        """``(A (x) G + l I)^p v`` per group, with ``l`` floored at the group's
        ``eps * tr(A) tr(G)`` (`kfacx.linalg.floor_damping`)."""
        u_a, u_g = eigen.inputs_eigenvectors, eigen.outputs_eigenvectors
        rotated = jnp.swapaxes(u_a, -1, -2) @ v @ u_g
        vals_a = linalg.clip_eigenvalues(eigen.inputs_eigenvalues)
        vals_g = linalg.clip_eigenvalues(eigen.outputs_eigenvalues)
        trace = jnp.sum(vals_a, axis=-1) * jnp.sum(vals_g, axis=-1)
        damping = linalg.floor_damping(identity_weight, trace, v.dtype)[..., None, None]
        scale = jnp.power(vals_a[..., :, None] * vals_g[..., None, :] + damping, power)
        return u_a @ (rotated * scale) @ jnp.swapaxes(u_g, -1, -2)

    # ---------------------------------------------------------------- eigenbasis

    def to_eigenbasis(self, state: BlockState, vector: Sequence[jax.Array]) -> jax.Array:
        """``U_A^T V U_G [groups, n, m]`` with the factors' eigenvectors of the last refresh
        (the cache must hold them: ``cache_eigenvalues=True``)."""
        v = self.params_to_matrix(self._check_vector(vector)).astype(self.dtype)
        return rotate(v, *self._eigenbases(state))

    def from_eigenbasis(self, state: BlockState, coordinates: jax.Array) -> Params:
        """``U_A C U_G^T`` per group, as parameters."""
        return self.matrix_to_params(rotate(coordinates, *self._eigenbases(state), inverse=True))

    def eigenbasis_change(self, old_state, new_state, diagonal: jax.Array) -> jax.Array:
        """``(R_A o R_A) D (R_G o R_G)^T`` with ``R = U_new^T U_old`` per group."""
        return change_basis(diagonal, self._eigenbases(old_state), self._eigenbases(new_state))

    def _eigenbases(self, state: BlockState) -> tuple[jax.Array, jax.Array]:
        if state.cache.eigen is None:
            raise missing_cached_eigenbasis(self)
        return state.cache.eigen.inputs_eigenvectors, state.cache.eigen.outputs_eigenvectors

    def _to_params(self, matrix, like: Params) -> Params:
        return tuple(
            cast_to(p, v.dtype) for p, v in zip(self.matrix_to_params(matrix), like, strict=True)
        )

    # ---------------------------------------------------------------- dense matrix

    def to_dense_matrix(self, state: BlockState) -> jax.Array:
        a, g = self.factor_values(state)
        per_group = jax.vmap(jnp.kron)(a, g)
        blocks = jax.scipy.linalg.block_diag(*per_group)
        # Position of every parameter entry in the (group, row, column) layout.
        index = self._parameter_positions()
        dense = jnp.zeros((self.dim, self.dim), blocks.dtype)
        return dense.at[index[:, None], index[None, :]].set(blocks)

    def _parameter_positions(self) -> np.ndarray:
        sizes = [math.prod(s) for s in self.parameters_shapes]
        offsets = np.cumsum([0] + sizes[:-1])
        index_params = [
            np.arange(o, o + n).reshape(s)
            for o, n, s in zip(offsets, sizes, self.parameters_shapes, strict=True)
        ]
        # Static index arithmetic: evaluate eagerly even under jit / pmap.
        with jax.ensure_compile_time_eval():
            return np.asarray(self.params_to_matrix(index_params)).reshape(-1)


def _with_ones(rows: jax.Array) -> jax.Array:
    return jnp.concatenate([rows, jnp.ones(rows.shape[:-1] + (1,), rows.dtype)], axis=-1)


def _second_moment(rows: jax.Array, normalizer: Any, weighted: jax.Array | None = None):
    """``sum_r weighted[r, g]^T rows[r, g] / normalizer`` for rows ``[R, G, n]``
    (``weighted`` defaults to ``rows``)."""
    weighted = rows if weighted is None else weighted
    if rows.shape[1] == 1:
        # One group: a plain matmul (a batched one with a batch of 1 is slower on CPU).
        return (weighted[:, 0].T @ rows[:, 0])[None] / normalizer
    return jnp.einsum("rgi,rgj->gij", weighted, rows) / normalizer


def _input_second_moment(rows: jax.Array, estimation_data) -> jax.Array:
    """The mean of ``rows[r, g]^T rows[r, g]`` over the rows of real (unmasked) examples."""
    mask = row_mask(estimation_data, rows.shape[0])
    if mask is None:
        return _second_moment(rows, rows.shape[0])
    mask = mask.astype(rows.dtype)
    total = jnp.maximum(jnp.sum(mask), 1.0)
    return _second_moment(rows, total, rows * mask[:, None, None])


def _strip_leading_ones(shape: Sequence[int]) -> tuple[int, ...]:
    shape = tuple(shape)
    while shape and shape[0] == 1:
        shape = shape[1:]
    return shape


class DenseTwoKroneckerFactored(TwoKroneckerFactored):
    """K-FAC block of a dense layer ``y = dot_general(x, w) + b``.

    The weight's contracted axes form the input factor and its free axes the
    output factor, so ``x @ w``, ``x @ w.T`` and multi-axis contractions such as
    ``einsum('btd,dhk->bthk')`` are all served exactly; every free axis of ``x``
    (batch, sequence...) is a row of the statistics.

    Raises:
      ValueError: if the parameters do not fit the tag's contraction.
    """

    def __init__(self, layer: LayerInfo):
        super().__init__(layer)
        shapes = layer.parameter_shapes
        w_shape = shapes[0] if shapes else ()
        # Without metadata: x's last axis contracts with w's first (``x @ w``).
        dnums = layer.meta.get("dimension_numbers", (((-1,), (0,)), ((), ())))
        (self.x_axes, self.w_axes), _ = dnums
        self.w_free = tuple(i for i in range(len(w_shape)) if i not in self.w_axes)
        out_shape = tuple(w_shape[i] for i in self.w_free)
        ok = len(shapes) in (1, 2) and len(w_shape) >= 2 and bool(self.w_free)
        if ok and len(shapes) == 2:
            ok = _strip_leading_ones(shapes[1]) == _strip_leading_ones(out_shape)
        if not ok:
            raise ValueError(
                f"DenseTwoKroneckerFactored({layer.name}): expected parameters (w) or (w, b) with "
                f"b shaped like w's output axes, got shapes {shapes} for contraction {dnums}."
            )
        self.has_bias = len(shapes) == 2
        self._in = math.prod(w_shape[i] for i in self.w_axes)
        self._out = math.prod(out_shape)

    @property
    def num_groups(self):
        return 1

    @property
    def input_size(self):
        return self._in + int(self.has_bias)

    @property
    def output_size(self):
        return self._out

    def params_to_matrix(self, params):
        w, *b = params
        m = jnp.transpose(w, self.w_axes + self.w_free).reshape(self._in, self._out)
        if b:
            m = jnp.concatenate([m, b[0].reshape(1, self._out)], axis=0)
        return m[None]

    def matrix_to_params(self, matrix):
        w_shape = self.parameters_shapes[0]
        m = matrix[0]
        order = self.w_axes + self.w_free
        w = m[: self._in].reshape(tuple(w_shape[i] for i in order))
        w = jnp.transpose(w, np.argsort(order))
        return (w, m[-1].reshape(self.parameters_shapes[1])) if self.has_bias else (w,)

    def input_rows(self, x: jax.Array) -> jax.Array:
        """The inputs as rows ``[rows, 1, input_size]``: one per example and position
        (every free axis of ``x``), the contracted axes flattened, a 1 for the bias."""
        x_axes = tuple(a % x.ndim for a in self.x_axes)
        x = jnp.moveaxis(x, x_axes, tuple(range(x.ndim - len(x_axes), x.ndim)))
        x = x.reshape(-1, 1, self._in).astype(self.dtype)
        return _with_ones(x) if self.has_bias else x

    def cotangent_rows(self, dy: jax.Array) -> jax.Array:
        """The output cotangents ``[samples, *output_shape]`` as rows ``[samples, rows, 1,
        output_size]``, in the order of `input_rows`."""
        return dy.astype(self.dtype).reshape(dy.shape[0], -1, 1, self._out)

    def compute_statistics(self, estimation_data: Mapping[str, Sequence[jax.Array]], batch_size):
        (x,) = estimation_data["inputs"]
        (dy,) = estimation_data["outputs_tangent"]
        x = self.input_rows(x)
        dy = dy.reshape(-1, 1, self._out).astype(self.dtype)
        return _input_second_moment(x, estimation_data), _second_moment(dy, batch_size)


class ConvTwoKroneckerFactored(TwoKroneckerFactored):
    """K-FAC block (KFC) of a convolution with any number of spatial dimensions.

    The input factor is the second moment of the input patches that the
    convolution really sees (strides, padding, input and kernel dilation), one
    per feature group; the output factor the second moment of the output
    cotangents over output positions.

    Raises:
      ValueError: if the layer's metadata does not describe a convolution.
    """

    def __init__(self, layer: LayerInfo):
        super().__init__(layer)
        meta = layer.meta
        missing = {"window_strides", "padding", "dimension_numbers"} - set(meta)
        if missing:
            raise ValueError(
                f"ConvTwoKroneckerFactored({layer.name}): the tag has no {sorted(missing)} "
                "metadata; register the layer with kfacx.register_conv."
            )
        self.dnums = meta["dimension_numbers"]
        w_shape = layer.parameter_shapes[0]
        self.groups = int(meta.get("feature_group_count", 1))
        self.kernel_spatial = tuple(w_shape[d] for d in self.dnums.rhs_spec[2:])
        self.in_per_group = w_shape[self.dnums.rhs_spec[1]]
        out = w_shape[self.dnums.rhs_spec[0]]
        if out % self.groups:
            raise ValueError(
                f"ConvTwoKroneckerFactored({layer.name}): {out} output features are not divisible "
                f"by feature_group_count={self.groups}."
            )
        self.out_per_group = out // self.groups
        self.has_bias = len(layer.parameter_shapes) == 2

    @property
    def num_groups(self):
        return self.groups

    @property
    def input_size(self):
        return self.in_per_group * math.prod(self.kernel_spatial) + int(self.has_bias)

    @property
    def output_size(self):
        return self.out_per_group

    def params_to_matrix(self, params):
        w, *b = params
        o, i, *spatial = self.dnums.rhs_spec
        # [in, *spatial, out]: in-channel major, matching the patch feature order.
        w = jnp.transpose(w, (i, *spatial, o)).reshape(-1, self.groups, self.out_per_group)
        m = jnp.transpose(w, (1, 0, 2))
        if b:
            m = jnp.concatenate([m, b[0].reshape(self.groups, 1, self.out_per_group)], axis=1)
        return m

    def matrix_to_params(self, matrix):
        o, i, *spatial = self.dnums.rhs_spec
        if self.has_bias:
            matrix, b = matrix[:, :-1], matrix[:, -1]
        w = jnp.transpose(matrix, (1, 0, 2))
        w = w.reshape((self.in_per_group, *self.kernel_spatial, self.groups * self.out_per_group))
        w = jnp.transpose(w, np.argsort((i, *spatial, o)))
        # The bias in its parameter's shape ([out] or, e.g., a row [1, out] added to the
        # output): reshape(-1) would return [out] for a [1, out] bias, and the optimizer's
        # jvp of the update would fail on the mismatched tangent (a case the detection
        # fuzzer draws).
        return (w, b.reshape(self.parameters_shapes[1])) if self.has_bias else (w,)

    def patches(self, x: jax.Array) -> jax.Array:
        """Input patches as rows ``[batch * positions, groups, in_per_group * kernel_size]``."""
        meta = self.layer.meta
        p = jax.lax.conv_general_dilated_patches(
            x,
            self.kernel_spatial,
            meta["window_strides"],
            meta["padding"],
            lhs_dilation=meta.get("lhs_dilation"),
            rhs_dilation=meta.get("rhs_dilation"),
            dimension_numbers=self.dnums,
            precision=jax.lax.Precision.HIGHEST,
        )
        # Example-major rows (the batch axis first, as `row_mask` expects), features last.
        p = jnp.moveaxis(p, self.dnums.out_spec[:2], (0, -1))
        return p.reshape(-1, self.groups, p.shape[-1] // self.groups)

    def input_rows(self, x: jax.Array) -> jax.Array:
        """The input patches as rows ``[rows, groups, input_size]`` (`patches`, with a 1
        for the bias)."""
        rows = self.patches(x.astype(self.dtype))
        return _with_ones(rows) if self.has_bias else rows

    def cotangent_rows(self, dy: jax.Array) -> jax.Array:
        """The output cotangents ``[samples, *output_shape]`` as rows ``[samples, rows,
        groups, out_per_group]``, one per example and output position, in the order of
        `input_rows` (example-major)."""
        out_batch, out_feature = self.dnums.out_spec[:2]
        dy = jnp.moveaxis(dy.astype(self.dtype), (out_batch + 1, out_feature + 1), (1, -1))
        return dy.reshape(dy.shape[0], -1, self.groups, self.out_per_group)

    def compute_statistics(self, estimation_data, batch_size):
        (x,) = estimation_data["inputs"]
        (dy,) = estimation_data["outputs_tangent"]
        rows = self.input_rows(x)
        # dy: [samples, *output_shape]; the feature axis shifts by one.
        dy = jnp.moveaxis(dy.astype(self.dtype), self.dnums.out_spec[1] + 1, -1)
        dy = dy.reshape(-1, self.groups, self.out_per_group)
        return _input_second_moment(rows, estimation_data), _second_moment(dy, batch_size)
