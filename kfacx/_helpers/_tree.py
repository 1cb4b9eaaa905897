"""Pytree algebra of the optimizer's step: inner products, axpy, and keeping a whole
state or its previous value (the non-finite guard), each compiled as few kernels."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kfacx._helpers import _checks

#: Leaves with fewer entries than this (biases, scales, counters) are "small": in
#: `tree_dot` they take part as one concatenated vector, so XLA compiles one small
#: reduction instead of one per leaf (small reductions are the expensive ones to compile
#: on the CPU: the deep autoencoder's step has 76 fewer kernels and compiles 0.1-0.5 s
#: faster, depending on the machine's load) and runs it no slower; `keep_unless`
#: guards them with one `jax.lax.cond` instead of a select each.
SMALL_LEAF = 4096


def wide(x: jax.Array) -> jax.Array:
    """``x`` in float32 or wider (bfloat16 / float16 sums overflow or lose digits)."""
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def tree_dot(a: Any, b: Any) -> jax.Array:
    """``sum(x * y)`` over all leaves, in float32 or wider (an operand with a
    ``dot_with`` method, e.g. a gradient split over devices, computes it itself)."""
    for x, y in ((a, b), (b, a)):
        if hasattr(x, "dot_with"):
            return x.dot_with(y)
    pairs = [
        (wide(x), wide(y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    ]
    parts = [jnp.sum(x * y) for x, y in pairs if x.size >= SMALL_LEAF]
    small = [(x, y) for x, y in pairs if x.size < SMALL_LEAF]
    if len(small) == 1:
        parts.append(jnp.sum(small[0][0] * small[0][1]))
    elif small:
        dtype = jnp.result_type(*(v for pair in small for v in pair))
        xs = jnp.concatenate([x.astype(dtype).ravel() for x, _ in small])
        ys = jnp.concatenate([y.astype(dtype).ravel() for _, y in small])
        parts.append(jnp.sum(xs * ys))
    return sum(parts, jnp.zeros((), jnp.float32))


def tree_gram(vectors: Sequence[Any]) -> jax.Array:
    """``[k, k]`` inner products ``sum(x_i * x_j)`` of ``k`` pytrees of one structure,
    in float32 or wider, in one pass over the leaves.

    Every product ``x_i * x_j`` (``i <= j``) of a leaf is summed by one variadic
    reduction, so XLA compiles one kernel per large leaf (and one for all the small
    leaves, concatenated) for the whole matrix, where `tree_dot` for each pair would
    compile one per pair and leaf: on the deep autoencoder's step the quadratic model's
    inner products of the gradient, the preconditioned gradient and the previous update
    go from 48 reduction kernels to 8 (and their sums over the leaves with them). Operands
    with a ``dot_with`` method (gradients split over devices) take `tree_dot` per pair.
    """
    vectors = list(vectors)
    k = len(vectors)
    pairs = [(i, j) for i in range(k) for j in range(i, k)]
    if any(hasattr(v, "dot_with") for v in vectors):
        values = [tree_dot(vectors[i], vectors[j]) for i, j in pairs]
    else:
        leaves = [[wide(x) for x in jax.tree.leaves(v)] for v in vectors]
        if any(len(ls) != len(leaves[0]) for ls in leaves):
            raise ValueError("tree_gram: the pytrees have different numbers of leaves.")
        per_leaf = list(zip(*leaves, strict=True))
        groups = [group for group in per_leaf if group[0].size >= SMALL_LEAF]
        small = [group for group in per_leaf if group[0].size < SMALL_LEAF]
        if small:
            dtype = jnp.result_type(*(x for group in small for x in group))
            groups.append(
                tuple(
                    jnp.concatenate([group[i].astype(dtype).ravel() for group in small])
                    for i in range(k)
                )
            )
        sums = [_pair_sums(group, pairs) for group in groups]
        values = [sum((s[n] for s in sums), jnp.zeros((), jnp.float32)) for n in range(len(pairs))]
    gram = [[None] * k for _ in range(k)]
    for (i, j), value in zip(pairs, values, strict=True):
        gram[i][j] = gram[j][i] = value
    return jnp.stack([jnp.stack(row) for row in gram])


def _pair_sums(group: Sequence[jax.Array], pairs: Sequence[tuple[int, int]]) -> list[jax.Array]:
    """``sum(group[i] * group[j])`` for every pair, by one variadic reduction."""
    dtype = jnp.result_type(*group)
    group = [x.astype(dtype) for x in group]
    products = tuple(group[i] * group[j] for i, j in pairs)
    zeros = tuple(jnp.zeros((), dtype) for _ in pairs)
    dims = tuple(range(group[0].ndim))

    def add(xs, ys):
        return tuple(a + b for a, b in zip(xs, ys, strict=True))

    return list(jax.lax.reduce(products, zeros, add, dims))


def tree_axpy(a: Any, x: Any, y: Any) -> Any:
    """``a * x + y`` for pytrees."""
    return jax.tree.map(lambda u, v: (a * u + v).astype(v.dtype), x, y)


def tree_scale(a: Any, x: Any) -> Any:
    """``a * x`` for a pytree ``x``, keeping each leaf's dtype."""
    return jax.tree.map(lambda u: (a * u).astype(u.dtype), x)


def guard_non_finite(
    checked: Any, new: Any, old: Any, select_small: bool = False
) -> tuple[jax.Array, Any]:
    """``(finite, new if finite else old)``, ``finite`` telling whether every
    floating-point leaf of ``checked`` is finite (`kfacx._helpers._checks.all_finite`);
    ``select_small`` as in `keep_unless`."""
    finite = _checks.all_finite(checked)
    return finite, keep_unless(finite, new, old, select_small)


def keep_unless(ok: jax.Array, new: Any, old: Any, select_small: bool = False) -> Any:
    """``new`` if ``ok`` else ``old`` (bit for bit), for pytrees of one structure.

    The large leaves are chosen by ``jnp.where``, which XLA fuses into the kernels that
    compute them (the parameter update, the moving averages). One `jax.lax.cond` over
    everything would make XLA copy every leaf into the conditional's result: on the deep
    autoencoder that is about 70 MB and 24 ms (11 %) of every step.

    The small ones (scalars, counters, biases) are chosen by ``jnp.where`` too where
    ``select_small`` (fused like the large ones: the one-device step of the deep
    autoencoder has 42 fewer kernels on the CPU, 885 against 843), else by one
    `jax.lax.cond`. The multi-device steps keep the conditional: without it, jaxlib
    0.10's CPU runtime can run the all-reduce inside the curvature update's conditional
    (``curvature_update_period > 1``) concurrently with another all-reduce of the step,
    and the devices then pair different all-reduces and abort the process
    (tests/parallel/test_distributed.py, the ``shard_map`` step on a mesh).
    """
    new_leaves, treedef = jax.tree.flatten(new)
    old_leaves = treedef.flatten_up_to(old)
    small = [] if select_small else [i for i, x in enumerate(new_leaves) if np.size(x) < SMALL_LEAF]
    by_cond = set(small)
    out = [
        leaf if i in by_cond else jnp.where(ok, leaf, before)
        for i, (leaf, before) in enumerate(zip(new_leaves, old_leaves, strict=True))
    ]
    if small:
        kept = jax.lax.cond(
            ok, lambda: [new_leaves[i] for i in small], lambda: [old_leaves[i] for i in small]
        )
        for i, leaf in zip(small, kept, strict=True):
            out[i] = leaf
    return jax.tree.unflatten(treedef, out)


def leaves_changed(fn: Any, tree: Any, *rest: Any) -> list[bool]:
    """Per leaf of ``tree`` (arrays or `jax.ShapeDtypeStruct`), whether ``fn(tree,
    *rest)``, which returns a pytree of ``tree``'s structure, may change it: ``False``
    only where the output leaf is the input leaf itself, passed on untouched (read from
    ``fn``'s jaxpr, without running it)."""
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(tree, *rest)
    if jax.tree.structure(out_shape) != jax.tree.structure(tree):
        raise ValueError(
            f"{fn!r} returned a pytree of structure {jax.tree.structure(out_shape)}; expected "
            f"that of its first argument, {jax.tree.structure(tree)}."
        )
    ins = closed.jaxpr.invars[: len(jax.tree.leaves(tree))]
    return [out is not x for out, x in zip(closed.jaxpr.outvars, ins, strict=True)]
