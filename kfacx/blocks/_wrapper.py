"""`WrapperBlock`: the base of the blocks that serve a layer through another block.

`kfacx.blocks.MappedBlock`, `kfacx.blocks.StackedBlock` and `kfacx.blocks.ViewBlock`
each hold an ``inner`` block and change how its state, statistics or products reach the
layer. What they share is here: the shapes and the need for the state are the inner
block's unless a wrapper says otherwise, and ``init`` / ``init_cache`` take the cache
spec once, in the protocol's signature, and hand it to `inner_init` /
`inner_init_cache`, which a wrapper overrides to wrap the inner block's state.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from kfacx.blocks._base import BlockState, CurvatureBlock


class WrapperBlock(CurvatureBlock):
    """A block serving its layer through ``self.inner`` (set by the subclass's
    constructor)."""

    inner: CurvatureBlock

    def factor_shapes(self):
        return self.inner.factor_shapes()

    def statistics_shapes(self):
        return self.inner.statistics_shapes()

    @property
    def statistics_need_state(self) -> bool:  # type: ignore[override]
        """The inner block's."""
        return self.inner.statistics_need_state

    def init(
        self,
        rng: jax.Array,
        exact_powers_to_cache: Sequence[float] = (),
        approx_powers_to_cache: Sequence[float] = (),
        cache_eigenvalues: bool = False,
    ) -> BlockState:
        """A fresh state: `inner_init` with the cache spec as tuples."""
        exact, approx = tuple(exact_powers_to_cache or ()), tuple(approx_powers_to_cache or ())
        return self.inner_init(rng, exact, approx, cache_eigenvalues)

    def init_cache(self, exact_powers_to_cache, approx_powers_to_cache, cache_eigenvalues):
        exact, approx = tuple(exact_powers_to_cache or ()), tuple(approx_powers_to_cache or ())
        return self.inner_init_cache(exact, approx, cache_eigenvalues)

    def inner_init(
        self, rng: jax.Array, exact: tuple, approx: tuple, cache_eigenvalues: bool
    ) -> BlockState:
        """The wrapper's fresh state from the inner block's (default: the inner block's)."""
        return self.inner.init(rng, exact, approx, cache_eigenvalues)

    def inner_init_cache(self, exact: tuple, approx: tuple, cache_eigenvalues: bool) -> Any:
        """The wrapper's fresh cache (default: the inner block's)."""
        return self.inner.init_cache(exact, approx, cache_eigenvalues)
