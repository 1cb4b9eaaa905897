"""Tag primitives: identity JAX primitives that mark layers and losses in a jaxpr.

A tag takes some "marked" arrays plus extra operands that carry information (a
layer's inputs and parameters, a loss's targets) and returns the marked arrays
unchanged. Because it is a real primitive it survives `jax.make_jaxpr`, so the
tracer can find it; because it has jvp, batching and lowering rules, a tagged
function can be jit-ed, differentiated, vmap-ed and pmap-ed and evaluates to
exactly the untagged function.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.extend as jex
from jax.interpreters import ad, batching, mlir


class _IdentityTag:
    """Shared machinery of `LayerTag` and `LossTag`: an identity primitive.

    The primitive's operands are ``(*marked, *extra)``; it returns ``marked``.
    Only the marked operands carry tangents: the extra operands are information
    for the tracer, and the function's derivatives flow through the computation
    that produced the marked arrays, not through the tag.
    """

    def __init__(self, name: str, num_marked: int):
        if not isinstance(name, str) or not name:
            raise TypeError(f"A tag needs a non-empty string name, got {name!r}.")
        if num_marked < 1:
            raise ValueError(f"Tag {name!r} must mark at least one array, got {num_marked=}.")
        self._name = name
        self._num_marked = num_marked
        self._primitive = jex.core.Primitive(name)
        self._primitive.multiple_results = True
        self._primitive.def_impl(self._impl)
        self._primitive.def_abstract_eval(self._abstract_eval)
        ad.primitive_jvps[self._primitive] = self._jvp
        batching.primitive_batchers[self._primitive] = self._batch
        mlir.register_lowering(self._primitive, mlir.lower_fun(self._impl, multiple_results=True))

    @property
    def name(self) -> str:
        """The name of the tag (and of its primitive, as printed in jaxprs)."""
        return self._name

    @property
    def primitive(self) -> jex.core.Primitive:
        """The underlying JAX primitive."""
        return self._primitive

    def bind(self, *operands: Any, **params: Any) -> list[jax.Array]:
        """Binds the primitive; returns the marked operands as a list."""
        if len(operands) < self._num_marked:
            raise ValueError(
                f"Tag {self._name!r} needs at least {self._num_marked} operands, "
                f"got {len(operands)}."
            )
        return self._primitive.bind(*operands, **params)

    def split_operands(self, operands: Sequence[Any]) -> tuple[tuple, tuple]:
        """Splits the operands of an equation into (marked, extra)."""
        return tuple(operands[: self._num_marked]), tuple(operands[self._num_marked :])

    def _impl(self, *operands, **params):
        del params
        return list(operands[: self._num_marked])

    def _abstract_eval(self, *avals, **params):
        del params
        return list(avals[: self._num_marked])

    def _jvp(self, primals, tangents, **params):
        out = self._primitive.bind(*primals, **params)
        out_tangents = [
            ad.instantiate_zeros(t) if type(t) is ad.Zero else t
            for t in tangents[: self._num_marked]
        ]
        return out, out_tangents

    def _batch(self, batched_args, batch_dims, **params):
        # Tags are identities on their marked operands: under vmap they simply
        # carry the batched arrays through (the tag is kept, so a vmapped
        # tagged function can still be traced).
        out = self._primitive.bind(*batched_args, **params)
        return out, list(batch_dims[: self._num_marked])

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._name!r})"
