"""Many matrices at once: size buckets, padded stacks inverted in one loop per
bucket, and one shared fallback for those whose Cholesky inverse failed (the rules:
`kfacx.linalg`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kfacx.linalg._common import (
    _check_dampings,
    _check_stacks,
    _retry_dtype,
    _working_dtype,
    symmetrize,
)
from kfacx.linalg._damping import _diagonal_sums_flat, floored_dampings
from kfacx.linalg._inverse import (
    _block_inverse,
    _finite_inverse,
    _floored_power,
    _unblocked_inverse,
)

# ----------------------------------------------------------------------------- batched inverses


def size_buckets(
    sizes: Sequence[int], max_growth: float = 1.05, min_size: int = 64
) -> list[tuple[int, list[int]]]:
    """Groups matrix sizes for `psd_inverse_padded`: ``[(bucket size, indices)]``.

    Sizes are taken from the largest down; a size joins the current bucket when
    padding it to the bucket's size grows it by at most ``max_growth`` (so that
    a layer's ``n`` and ``n + 1`` (bias) factors share one bucket), else it
    starts a new bucket. Sizes up to ``min_size`` share one bucket of that size:
    XLA on the CPU compiles kernels for small matrices several times slower than
    for large ones, and their factorisations cost next to nothing. Fewer buckets
    mean fewer distinct factorisations to compile; ``max_growth`` bounds the
    extra work (``1.05**3 = 1.16``).

    Example::

      >>> size_buckets([785, 1000, 31, 1001, 30])
      [(1001, [3, 1]), (785, [0]), (64, [2, 4])]
    """
    buckets: list[tuple[int, list[int]]] = []
    for i in sorted(range(len(sizes)), key=lambda i: (-int(sizes[i]), i)):
        size = max(int(sizes[i]), min_size)
        if buckets and size * max_growth >= buckets[-1][0]:
            buckets[-1][1].append(i)
        else:
            buckets.append((size, [i]))
    return buckets


class PaddedStack(NamedTuple):
    """Matrices of several sizes in one stack (see `pad_stack`).

    Attributes:
      matrices: ``[K, size, size]``, each zero-padded below and right.
      floors: ``[K]`` floored dampings.
      sizes: ``[K]`` int32 unpadded sizes.
    """

    matrices: jax.Array
    floors: jax.Array
    sizes: jax.Array


def pad_stack(
    matrices: Sequence[jax.Array], floors: Sequence[jax.Array] | jax.Array, size: int
) -> PaddedStack:
    """Stacks ``matrices`` (``[..., n_i, n_i]``, ``n_i <= size``, one dtype) and their floored
    dampings (`floored_dampings`, or one flat ``[K]`` vector) into one `PaddedStack` in
    the working dtype."""
    if not matrices:
        raise ValueError("pad_stack: no matrices to stack.")
    _check_stacks(matrices, "pad_stack", size)
    count = sum(math.prod(np.shape(m)[:-2]) for m in matrices)
    if isinstance(floors, jax.Array):
        if floors.shape != (count,):
            raise ValueError(
                f"pad_stack: floors has shape {floors.shape}; a flat vector must have one "
                f"entry per matrix, shape ({count},)."
            )
    else:
        _check_dampings(matrices, floors, "pad_stack")
    work = _working_dtype(jnp.result_type(*matrices))
    if isinstance(floors, jax.Array):
        flat_floors = floors.astype(work)
    else:
        flat_floors = jnp.concatenate(
            [
                jnp.broadcast_to(jnp.asarray(f, work), m.shape[:-2]).reshape(-1)
                for f, m in zip(floors, matrices, strict=True)
            ]
        )
    return PaddedStack(stack_padded(matrices, size), flat_floors, stack_sizes(matrices))


def stack_padded(matrices: Sequence[jax.Array], size: int) -> jax.Array:
    """``matrices`` (``[..., n_i, n_i]``, ``n_i <= size``) zero-padded below and right and
    stacked: ``[K, size, size]`` in the working dtype (one fused kernel)."""
    _check_stacks(matrices, "stack_padded", size)
    work = _working_dtype(jnp.result_type(*matrices))
    padded = []
    for m in matrices:
        n = m.shape[-1]
        m = m.astype(work).reshape((-1, n, n))
        padded.append(jnp.pad(m, ((0, 0), (0, size - n), (0, size - n))))
    return padded[0] if len(padded) == 1 else jnp.concatenate(padded)


def stack_sizes(matrices: Sequence[jax.Array]) -> jax.Array:
    """``[K]`` int32: the size of each matrix of `stack_padded` ``(matrices)``."""
    counts = [math.prod(m.shape[:-2]) for m in matrices]
    return jnp.asarray(np.repeat([m.shape[-1] for m in matrices], counts).astype(np.int32))


def padded_diagonal_sums(stacks: Sequence[jax.Array]) -> jax.Array:
    """``[2, K]``: the traces and the sums of ``|diag|`` of the matrices of zero-padded
    ``[K_i, n_i, n_i]`` stacks (`stack_padded`; the padding adds nothing), in order."""
    return _diagonal_sums_flat(stacks)


def _unpadded(m: jax.Array, d: jax.Array, n: jax.Array) -> jax.Array:
    """``m + diag(d on the first n entries, 1 on the padding)``: the damped matrix with an
    identity block on the padding (which leaves the inverse of the top-left block alone).
    Works on one matrix or on a stack (``d`` and ``n`` then ``[K]``)."""
    size, lead = m.shape[-1], (1,) * (m.ndim - 2)
    d, n = jnp.asarray(d, m.dtype)[..., None], jnp.asarray(n)[..., None]
    index = jnp.arange(size).reshape(lead + (size,))
    diagonal = jnp.where(index < n, d, jnp.ones((), m.dtype))  # [..., size]
    eye = (jnp.arange(size)[:, None] == jnp.arange(size)[None, :]).reshape(lead + (size, size))
    return m + jnp.where(eye, diagonal[..., None, :], jnp.zeros((), m.dtype))


def cholesky_inverse_padded(stack: PaddedStack) -> tuple[jax.Array, jax.Array]:
    """The fast path of `psd_inverse` for a `PaddedStack`: Cholesky inverses, no fallback.

    Returns:
      ``(inverses [K, size, size], ok [K])``: ``ok`` (0 or 1, in the working
      dtype) says where the factorisation succeeded; elsewhere the inverse is NaN.
      Repair those with `repair_padded`, crop the rest with `crop_padded`.
    """
    if not isinstance(stack, PaddedStack):
        raise TypeError(
            f"cholesky_inverse_padded takes a PaddedStack (from pad_stack), got {type(stack)}."
        )

    # The damping is added to the whole stack at once (one fused kernel). On the CPU the
    # matrices are then inverted one at a time (a loop, compiled once): batched LAPACK
    # calls can deadlock when several run at once. Elsewhere the stack is factorised in
    # one batched call (a loop of kernel launches per matrix would cost more than the
    # work). Success is read from the diagonals of the inverses (`_finite_inverse`).
    inverses = jax.lax.platform_dependent(
        _unpadded(*stack),
        cpu=lambda damped: jax.lax.map(_block_inverse, damped),
        default=_unblocked_inverse,
    )
    return inverses, _finite_inverse(inverses).astype(inverses.dtype)


def repair_padded(
    stacks: Callable[[], Sequence[PaddedStack]],
    inverses: Sequence[jax.Array],
    oks: Sequence[jax.Array],
) -> list[jax.Array]:
    """The fallback of `psd_inverse` for the matrices whose Cholesky inverse failed.

    All stacks share one fallback, compiled once: if any ``ok`` is 0, the stacks
    (built by calling ``stacks``) are padded to the largest size and the failed
    matrices go through the eigendecomposition path of `psd_inverse` one after
    the other (in float64 under ``jax_enable_x64``); when all are ok (the usual
    case) this costs one branch.

    Args:
      stacks: builds the `PaddedStack` of each group (only when needed).
      inverses: per group, the ``[K, n, n]`` result of `cholesky_inverse_padded`.
      oks: per group, its ``[K]`` success flags.

    Returns:
      The inverses with the failed ones replaced.
    """
    size = max(x.shape[-1] for x in inverses)
    good = [ok > 0 for ok in oks]

    def repair(inverses):
        built = stacks()
        padded = [
            jnp.pad(b.matrices, ((0, 0), (0, size - n), (0, size - n)))
            for b, n in ((b, b.matrices.shape[-1]) for b in built)
        ]
        all_good = jnp.concatenate(good)
        stack = jnp.concatenate(padded)
        floors = jnp.concatenate([b.floors for b in built])
        sizes = jnp.concatenate([b.sizes for b in built])
        retry = _retry_dtype(stack.dtype)

        def one(args):
            m, d, n, ok = args

            def fallback(m):
                m = symmetrize(_unpadded(m, jnp.zeros((), m.dtype), n).astype(retry))
                return _floored_power(m, d.astype(retry), -1.0).astype(stack.dtype)

            return jax.lax.cond(ok, lambda m: m, fallback, m)

        fixed = jax.lax.map(one, (stack, floors, sizes, all_good))
        out, start = [], 0
        for inverse, keep in zip(inverses, good, strict=True):
            k, n = inverse.shape[0], inverse.shape[-1]
            alt = fixed[start : start + k, :n, :n].astype(inverse.dtype)
            out.append(jnp.where(keep[:, None, None], inverse, alt))
            start += k
        return out

    return jax.lax.cond(jnp.all(jnp.concatenate(good)), list, repair, list(inverses))


def psd_inverse_padded(
    matrices: Sequence[jax.Array], dampings: Sequence[Any], size: int
) -> jax.Array:
    """`psd_inverse` of several stacks of matrices at once, padded to one size.

    Each ``matrices[i]`` (``[..., n_i, n_i]`` with ``n_i <= size``, all of one
    dtype) is padded to ``[size, size]`` with an identity block (which does not
    change the inverse of the top-left block) and all are inverted one after the
    other in a loop over the ``[K, size, size]`` stack, each with its own
    ``dampings[i]`` floored as `psd_inverse` floors it (from the unpadded
    diagonal): one factorisation (and one fallback) to compile for the whole
    group. Crop the results with `crop_padded`.

    Returns:
      ``[K, size, size]`` in the working dtype (float32 or wider), where ``K``
      is the total number of matrices.
    """
    _check_stacks(matrices, "psd_inverse_padded", size)
    floors = floored_dampings(matrices, dampings)
    stack = pad_stack(matrices, floors, size)
    inverses, ok = cholesky_inverse_padded(stack)
    return repair_padded(lambda: [stack], [inverses], [ok])[0]


def crop_padded(inverses: jax.Array, like: Sequence[jax.Array]) -> list[jax.Array]:
    """Splits the result of `psd_inverse_padded` into arrays shaped and typed like ``like``."""
    out, start = [], 0
    for m in like:
        n, count = m.shape[-1], math.prod(m.shape[:-2])
        block = inverses[start : start + count, :n, :n]
        out.append(block.reshape(m.shape).astype(m.dtype))
        start += count
    return out
