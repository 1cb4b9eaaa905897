"""`HostedBlock`: a block written against kfac-jax, run inside kfacx's estimator.

kfacx's estimator asks a block for a batch's *statistics* (`compute_statistics`), which
it averages over devices and micro-batches before folding them into the moving
averages (`update_from_statistics`); a kfac-jax block does both at once, mutating the
`kfacx.kfac_jax.utils.WeightedMovingAverage` s of its state in
``update_curvature_matrix_estimate(state, data, ema_old, ema_new, identity_weight,
batch_size)``. Moving averages are linear in what is folded in, so the host gets the
statistics by running that update on a zero state with ``ema_old=0, ema_new=1``: each
moving average then holds exactly its statistic. The host keeps the kfac-jax state's
moving averages as kfacx factors (``raw_value = value * weight``) and every other leaf
(the cache) as it is, and rebuilds the kfac-jax state from them (its tree structure is
static) for the block's ``update_cache``, ``multiply_matpower`` and
``to_dense_matrix``.

The estimation modes' output gradients arrive as kfac-jax's estimator hands them to
its blocks: one `LayerVjpData` per sampled or exact direction ``k`` of ``K``, scaled
by ``sqrt(K)``, averaged (so statistics of the gradients are summed over directions and
those of the inputs averaged). With a padding mask the inputs of padded examples are
zeroed before the block sees them (their output gradients are zero already); the block
gets the number of rows as its Python-int ``batch_size``, as kfac-jax passes it, and its
statistics are rescaled to kfacx's normalisation by the real examples.

Limits: state that the statistics update changes must be moving averages of arrays
(anything else is treated as cache and not updated by it); ``tangents.params`` and
``tangents.inputs`` of the `LayerVjpData` are empty.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from kfacx import blocks as _kfacx_blocks
from kfacx.kfac_jax._blocks._block import CurvatureBlock as KfacJaxBlock
from kfacx.kfac_jax.layers_and_loss_tags import LayerData
from kfacx.kfac_jax.tracer import LayerVjpData
from kfacx.kfac_jax.utils._state import WeightedMovingAverage as KfacJaxAverage


def _is_average(x: Any) -> bool:
    return isinstance(x, KfacJaxAverage)


#: The cache spec of the states a block makes without being given one (the zero state
#: its statistics are computed on, its factor shapes); a state's own spec is in its
#: `HostedCache`.
_NO_CACHE: tuple[tuple, tuple, bool] = ((), (), False)


@jax.tree_util.register_pytree_node_class
class HostedCache:
    """The leaves of a kfac-jax block state other than its moving averages (a kfacx
    `BlockState`'s cache), with the cache spec ``(exact_powers, approx_powers,
    eigenvalues)`` the state was made with as static data: the state says how to rebuild
    it, whichever `HostedBlock` instance reads it (kfacx's estimator builds new block
    objects when it traces the function again, and calls ``init`` on none of them)."""

    def __init__(self, leaves: tuple, spec: tuple):
        self.leaves = tuple(leaves)
        self.spec = spec

    def tree_flatten(self):
        return self.leaves, self.spec

    @classmethod
    def tree_unflatten(cls, spec, leaves):
        return cls(tuple(leaves), spec)

    def __repr__(self) -> str:
        return f"HostedCache({len(self.leaves)} leaves, spec={self.spec})"


class HostedBlock(_kfacx_blocks.CurvatureBlock):
    """A kfacx block serving a layer with a kfac-jax block (see the module docstring).

    Args:
      layer: the layer's `kfacx.blocks.LayerInfo`.
      block_ctor: the kfac-jax block class (or a `functools.partial` of one).
    """

    def __init__(self, layer: _kfacx_blocks.LayerInfo, block_ctor: Any):
        super().__init__(layer)
        self.hosted = block_ctor(layer)
        self._layouts: dict[tuple, tuple[Any, tuple[bool, ...], tuple, tuple]] = {}

    @property
    def block_name(self) -> str:
        return type(self.hosted).__name__

    def __repr__(self) -> str:
        return f"HostedBlock({type(self.hosted).__name__}, {self.layer.name})"

    # ------------------------------------------------------------------ state layout

    def _layout(self, spec: tuple) -> tuple[Any, tuple[bool, ...], tuple, tuple]:
        """``(treedef, which leaves are moving averages, their shapes, the other leaves'
        shapes and dtypes)`` of the kfac-jax state made with ``spec`` (computed
        abstractly, once per spec)."""
        if spec not in self._layouts:
            state = jax.eval_shape(lambda: self.hosted.init(jax.random.PRNGKey(0), *spec))
            leaves, treedef = jax.tree_util.tree_flatten(state, is_leaf=_is_average)
            shapes = []
            for leaf in leaves:
                if _is_average(leaf):
                    if not hasattr(leaf.value, "shape"):
                        raise TypeError(
                            f"{self!r}: kfacx hosts moving averages of single arrays; "
                            f"this block's state has one of {type(leaf.value).__name__}."
                        )
                    shapes.append(tuple(leaf.value.shape))
            others = tuple(x for x in leaves if not _is_average(x))
            is_average = tuple(_is_average(x) for x in leaves)
            self._layouts[spec] = (treedef, is_average, tuple(shapes), others)
        return self._layouts[spec]

    def _split(self, kj_state: Any, spec: tuple) -> tuple[tuple, HostedCache]:
        leaves = jax.tree_util.tree_leaves(kj_state, is_leaf=_is_average)
        factors = tuple(
            _kfacx_blocks.WeightedMovingAverage(
                jnp.asarray(x.weight, self.dtype), jnp.asarray(x.raw_value, self.dtype)
            )
            for x in leaves
            if _is_average(x)
        )
        return factors, HostedCache(tuple(x for x in leaves if not _is_average(x)), spec)

    def _join(self, state: _kfacx_blocks.BlockState) -> Any:
        treedef, is_average, _, _ = self._layout(state.cache.spec)
        factors, cache = iter(state.factors), iter(state.cache.leaves)
        leaves = [_to_kfac_jax(next(factors)) if average else next(cache) for average in is_average]
        return jax.tree_util.tree_unflatten(treedef, leaves)

    # ------------------------------------------------------------------ kfacx's protocol

    def factor_shapes(self) -> tuple[tuple[int, ...], ...]:
        return self._layout(_NO_CACHE)[2]

    def init(
        self, rng, exact_powers_to_cache=(), approx_powers_to_cache=(), cache_eigenvalues=False
    ) -> _kfacx_blocks.BlockState:
        """The kfac-jax block's initial state, as a kfacx `BlockState` (its moving
        averages as factors, the other leaves as the cache)."""
        spec = _cache_spec(exact_powers_to_cache, approx_powers_to_cache, cache_eigenvalues)
        self._layout(spec)
        factors, cache = self._split(self.hosted.init(rng, *spec), spec)
        return _kfacx_blocks.BlockState(factors, cache)

    def init_cache(self, exact_powers_to_cache, approx_powers_to_cache, cache_eigenvalues):
        spec = _cache_spec(exact_powers_to_cache, approx_powers_to_cache, cache_eigenvalues)
        return self._split(self.hosted.init(jax.random.PRNGKey(0), *spec), spec)[1]

    def compute_statistics(self, estimation_data, batch_size):
        """The kfac-jax block's update on a zero state, one per output-gradient direction
        (scaled by ``sqrt(K)``), averaged: each moving average holds its statistic."""
        inputs = tuple(estimation_data["inputs"])
        if "mask" in estimation_data:
            mask = estimation_data["mask"]
            inputs = tuple(x * mask.reshape(mask.shape + (1,) * (x.ndim - 1)) for x in inputs)
        primals = LayerData(
            inputs=inputs,
            outputs=tuple(estimation_data["outputs"]),
            params=tuple(estimation_data["params"]),
        )
        tangents = tuple(estimation_data["outputs_tangent"])
        num = tangents[0].shape[0]
        # kfac-jax hands its blocks the batch size as a Python int (blocks check shapes
        # against it): the rows per use of the layer. With padding kfacx normalises by the
        # real examples instead; the statistics (all over the batch size) are rescaled.
        rows = primals.outputs[0].shape[0] // max(1, self.layer.num_uses)
        rescale = None if "mask" not in estimation_data else rows / batch_size
        zero = _kfacx_blocks.BlockState(
            tuple(
                _kfacx_blocks.WeightedMovingAverage.zeros(s, self.dtype)
                for s in self.factor_shapes()
            ),
            HostedCache(
                tuple(jnp.zeros(c.shape, c.dtype) for c in self._layout(_NO_CACHE)[3]),
                _NO_CACHE,
            ),
        )

        def one(direction):
            data = LayerVjpData(
                primals=primals,
                tangents=LayerData(inputs=(), outputs=direction, params=()),
                example_mask=estimation_data.get("mask"),
            )
            state = self.hosted.update_curvature_matrix_estimate(
                self._join(zero), data, 0.0, 1.0, 0.0, rows
            )
            leaves = jax.tree_util.tree_leaves(state, is_leaf=_is_average)
            return tuple(jnp.asarray(x.value, self.dtype) for x in leaves if _is_average(x))

        scaled = tuple(t * jnp.sqrt(jnp.asarray(num, t.dtype)) for t in tangents)
        stats = tuple(jnp.mean(s, axis=0) for s in jax.vmap(one)(scaled))
        return stats if rescale is None else tuple(s * rescale.astype(s.dtype) for s in stats)

    def update_cache(self, state, identity_weight):
        identity_weight = jnp.asarray(identity_weight, self.dtype)
        spec = state.cache.spec
        kj = self.hosted.update_cache(self._join(state), identity_weight, *spec)
        return state._replace(cache=self._split(kj, spec)[1])

    def _multiply(self, state, vector, identity_weight):
        identity_weight = jnp.asarray(identity_weight, self.dtype)
        return tuple(
            self.hosted.multiply_matpower(
                self._join(state), vector, identity_weight, 1, exact_power=True, use_cached=False
            )
        )

    def _multiply_matpower(self, state, vector, identity_weight, power, exact_power, use_cached):
        identity_weight = jnp.asarray(identity_weight, self.dtype)
        return tuple(
            self.hosted.multiply_matpower(
                self._join(state), vector, identity_weight, power, exact_power, use_cached
            )
        )

    def to_dense_matrix(self, state):
        return self.hosted.to_dense_matrix(self._join(state))


def _cache_spec(exact_powers_to_cache, approx_powers_to_cache, cache_eigenvalues) -> tuple:
    return (
        tuple(exact_powers_to_cache or ()),
        tuple(approx_powers_to_cache or ()),
        bool(cache_eigenvalues),
    )


def _to_kfac_jax(average: _kfacx_blocks.WeightedMovingAverage) -> KfacJaxAverage:
    return KfacJaxAverage(weight=average.weight, value=average.value)


def hosted_ctor(ctor: Any) -> Any | None:
    """A kfacx block factory for a kfac-jax block class (or a `functools.partial` of one);
    None if ``ctor`` is not one."""
    cls = ctor.func if isinstance(ctor, functools.partial) else ctor
    if isinstance(cls, type) and issubclass(cls, KfacJaxBlock):
        return functools.partial(HostedBlock, block_ctor=ctor)
    return None
