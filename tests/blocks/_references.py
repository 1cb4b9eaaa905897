"""Independent numpy references for the block tests, and the host-side helpers they and
the cases share (`fast_jit`, casts and flattening on the host).

The ``reference_*`` functions recompute what a block should hold without using the
block's own statistics code. Re-exported by tests/blocks/_cases.py.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from kfacx import blocks

if TYPE_CHECKING:
    from ._cases import Case


HIGHEST = jax.lax.Precision.HIGHEST


def fast_jit(fun, **kwargs):
    """`jax.jit` with cheap XLA backend optimisation: the tests compile many small
    programs once each, so compile time dominates (the computation is the same)."""
    return jax.jit(fun, compiler_options={"xla_backend_optimization_level": 0}, **kwargs)


def _cast(x: Any, dtype: Any) -> jax.Array:
    """``x`` as a ``dtype`` device array, cast on the host (numpy rounds to nearest even,
    like XLA): an eager cast would compile a conversion per shape and dtype (and so
    would ``jnp.asarray`` of the NumPy array without its dtype, in JAX 0.10)."""
    host = np.asarray(np.asarray(x), dtype)
    return jnp.asarray(host, dtype=host.dtype)


def _host(x: Any) -> np.ndarray:
    """A (possibly low-precision) array rounded to float32, in float64 numpy."""
    return np.asarray(np.asarray(np.asarray(x), np.float32), np.float64)


def flat(vector: Sequence[Any]) -> np.ndarray:
    """`blocks.flatten_params` on the host (eagerly it compiles a program per shape)."""
    return np.concatenate([np.ravel(np.asarray(v)) for v in vector])


def _normal(rng: np.random.Generator, shape: Sequence[int]) -> np.ndarray:
    return rng.standard_normal(tuple(shape)).astype(np.float32)


# ----------------------------------------------------------------------------- references


@functools.cache
def kronecker_positions(block: blocks.TwoKroneckerFactored) -> np.ndarray:
    """``P[i] = vec(params_to_matrix(e_i))``: flattened parameters -> matrix layout."""
    eye = np.eye(block.dim, dtype=np.float32)  # jnp.eye would compile a program per size
    mats = fast_jit(
        jax.vmap(
            lambda e: block.params_to_matrix(blocks.unflatten_params(e, block.parameters_shapes))
        )
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


def factor_value(factor: blocks.WeightedMovingAverage) -> np.ndarray:
    """The bias-corrected value of a moving average, in float64 numpy."""
    weight = float(factor.weight)
    raw = np.asarray(factor.raw_value, np.float64)
    return raw / weight if weight > 0 else np.zeros_like(raw)


def state_dense(block, state) -> np.ndarray:
    """The dense matrix a state represents, assembled in numpy from its factors
    (independent of `to_dense_matrix`)."""
    values = [factor_value(f) for f in state.factors]
    if isinstance(block, blocks.TwoKroneckerFactored):
        return kronecker_dense(block, *values)
    if len(values) == 1 and values[0].shape == (block.dim, block.dim):
        return values[0]  # Full.
    return np.diag(np.concatenate([v.reshape(-1) for v in values]))  # Diagonal.


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
    x = _cast(x, jnp.float32)

    def conv(w):
        return jax.lax.conv_general_dilated(
            x,
            w,
            meta["window_strides"],
            meta["padding"],
            meta["lhs_dilation"],
            meta["rhs_dilation"],
            dn,
            groups,
            precision=HIGHEST,
        )

    zeros = jnp.zeros(w_shape, jnp.float32)
    y = jax.eval_shape(conv, zeros)  # the conv runs in `to_matrices` only (one compilation)
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

    @fast_jit
    def to_matrices(cot):
        (grads,) = jax.vmap(jax.vjp(conv, zeros)[1])(cot)
        extra = () if not block.has_bias else (jnp.zeros((count, out_features), jnp.float32),)
        return jax.vmap(lambda *p: block.params_to_matrix(p))(grads, *extra)

    mats = np.asarray(to_matrices(jnp.asarray(cot, dtype=cot.dtype)), np.float64)
    if block.has_bias:
        mats = mats[:, :, :-1]
    return mats[..., 0]  # Column 0: the first output feature of every group.


def reference_kronecker_factors(case: Case, block, data, batch_size: int):
    """``(A, G)`` stacks ``[groups, n, n]`` and ``[groups, m, m]`` computed in float64."""
    (x,) = data["inputs"]
    (dy,) = data["outputs_tangent"]
    dy = _host(dy)
    if case.is_conv:
        rows = conv_patches_reference(block, x)
        dn = case.meta["dimension_numbers"]
        groups = case.meta["feature_group_count"]
        dy = np.moveaxis(dy, dn.out_spec[1] + 1, -1)
        dy = dy.reshape(-1, groups, dy.shape[-1] // groups)
    else:
        # Rows: every free position of x; features: its contracted axes (in the order of
        # the contraction); outputs: the weight's free axes, which end y.
        x = _host(x)
        (x_axes, w_axes), _ = case.meta["dimension_numbers"]
        w_shape = case.param_shapes[0]
        n_in = math.prod(w_shape[a] for a in w_axes)
        n_out = math.prod(w_shape) // n_in
        rows = np.moveaxis(x, x_axes, range(x.ndim - len(x_axes), x.ndim))
        rows = rows.reshape(-1, 1, n_in)
        dy = dy.reshape(-1, 1, n_out)
    if block.has_bias:
        rows = np.concatenate([rows, np.ones(rows.shape[:-1] + (1,))], axis=-1)
    a = np.einsum("rgi,rgj->gij", rows, rows) / rows.shape[0]
    g = np.einsum("rgi,rgj->gij", dy, dy) / batch_size
    return a, g


def reference_per_example_gradients(case: Case, data) -> np.ndarray:
    """``[samples * examples, dim]`` per-example gradients by `jax.grad` of ``<y_b, dy_sb>``."""
    (dy,) = data["outputs_tangent"]
    params = tuple(_cast(p, jnp.float32) for p in data["params"])
    dy = _cast(dy, jnp.float32)
    if case.is_generic:
        return np.asarray(dy, np.float64).reshape(dy.shape[0], -1)
    (x,) = data["inputs"]
    x = _cast(x, jnp.float32)

    def grad(xb, dyb):
        def inner(p):
            (y,) = case.tag.compute((xb[None],), p, **case.meta)
            return jnp.sum(y * dyb[None])

        return blocks.flatten_params(jax.grad(inner)(params))

    per_example = fast_jit(jax.vmap(jax.vmap(grad), in_axes=(None, 0)))(x, dy)
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


def to_matrix_layout(block, vector) -> np.ndarray:
    """``block.params_to_matrix(vector)`` in float64, through `kronecker_positions`."""
    shape = (block.num_groups, block.input_size, block.output_size)
    return (kronecker_positions(block).T @ _host(flat(vector))).reshape(shape)


def pi_damped_reference(block, state, vector, identity_weight: float, power: float) -> np.ndarray:
    """``(A + pi sqrt(l) I)^p (x) (G + sqrt(l)/pi I)^p`` applied per group, in float64,
    returned in `params_to_matrix` layout ``[groups, n, m]``."""
    v = to_matrix_layout(block, vector)
    a_all, g_all = (factor_value(f) for f in state.factors)
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
    actual = _host(actual)
    expected = np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    assert np.all(np.isfinite(actual)), f"{what}: non-finite values"
    err = np.linalg.norm(actual - expected)
    scale = max(np.linalg.norm(expected), 1e-30)
    assert err <= tol * scale, f"{what}: relative error {err / scale:.3g} > {tol:.3g}"


def stacked_two(case: Case, block_cls: type, dtype: Any, seeds=(5, 6)):
    """``(StackedBlock of two slices of case's layer, their stacked data, the slices' data)``:
    the data of seed ``seeds[i]`` is slice ``i`` (cotangents: layer axis after the samples)."""
    info = case.layer(dtype)
    fields = ("parameter_shapes", "input_shapes", "output_shapes")
    stacked = blocks.StackedBlock(
        dataclasses.replace(
            info, **{f: tuple((2, *s) for s in getattr(info, f)) for f in fields}, stack_size=2
        ),
        block_cls,
    )
    slices = [case.data(seed=s, dtype=dtype) for s in seeds]
    data = {
        k: tuple(jnp.stack(xs, axis=int(k == "outputs_tangent")) for xs in zip(*vs, strict=True))
        for k, vs in ((k, [d[k] for d in slices]) for k in slices[0])
    }
    return stacked, data, slices
