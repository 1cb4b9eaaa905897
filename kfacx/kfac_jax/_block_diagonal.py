"""kfac-jax's block-diagonal estimator on kfacx's: the default block of each layer
variant, kfac-jax's signatures and its views (`kfacx.kfac_jax.curvature_estimator`
re-exports them).

kfac-jax keys blocks by layer *variant* (``"dense"``, ``"conv2d"``, ``"generic"``, ...)
and keeps a process-wide default table that extensions edit with
`set_default_tag_to_block_ctor` (FermiNet maps ``"repeated_dense"`` to its block
there). `kfacx_block_ctors` turns that table, with a user's ``layer_tag_to_block_ctor``
on top, into kfacx's (tag name -> kfacx block factory).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kfacx import blocks as _kfacx_blocks
from kfacx import estimator as _estimator
from kfacx.kfac_jax import curvature_blocks as _cb
from kfacx.kfac_jax._products import PowerProducts
from kfacx.kfac_jax.layers_and_loss_tags import kfacx_tag_name

_DEFAULT_TAG_TO_BLOCK_CTOR: dict[str, Any] = dict(
    dense=_cb.DenseTwoKroneckerFactored,
    conv2d=_cb.Conv2DTwoKroneckerFactored,
    generic=_cb.NaiveDiagonal,
    scale_and_shift=_cb.ScaleAndShiftDiagonal,
    repeated_dense=_cb.RepeatedDenseKroneckerFactored,
)


def _check_name(tag_name: str) -> None:
    if not isinstance(tag_name, str):
        raise TypeError(f"A layer variant must be a string, got {tag_name!r}.")
    if tag_name.endswith("_tag"):
        raise ValueError(
            f"{tag_name!r}: kfac-jax's default table is keyed by layer variant, without the "
            "'_tag' suffix (e.g. 'dense'); kfacx tag names go to kfacx.Optimizer's "
            "layer_tag_to_block_ctor."
        )


def get_default_tag_to_block_ctor(tag_name: str) -> Any:
    """The default block of a layer variant (None if it has none)."""
    _check_name(tag_name)
    return _DEFAULT_TAG_TO_BLOCK_CTOR.get(tag_name)


def set_default_tag_to_block_ctor(tag_name: str, block_ctor: Any) -> None:
    """Sets the default block of a layer variant, for every optimizer made afterwards.

    Raises:
      TypeError: if ``block_ctor`` is not callable.
    """
    _check_name(tag_name)
    if not callable(block_ctor):
        raise TypeError(
            f"set_default_tag_to_block_ctor({tag_name!r}, ...): the block must be a class or "
            f"factory, got {block_ctor!r}."
        )
    _DEFAULT_TAG_TO_BLOCK_CTOR[tag_name] = block_ctor


def set_multi_default_tag_to_block_ctor(tags_to_block_ctor: Mapping[str, Any]) -> None:
    """`set_default_tag_to_block_ctor` for several variants."""
    for name, ctor in tags_to_block_ctor.items():
        set_default_tag_to_block_ctor(name, ctor)


def kfacx_block_ctors(
    layer_tag_to_block_ctor: Mapping[str, Any] | None,
) -> dict[str, Callable[..., Any]]:
    """kfacx's ``layer_tag_to_block_ctor`` for the default table plus the given one (keyed
    by variant, or by kfacx tag name when a key ends with ``_tag``; a ``None`` entry, as
    kfac-jax's tests write for a variant the model does not use, keeps the default)."""
    given = {k: v for k, v in dict(layer_tag_to_block_ctor or {}).items() if v is not None}
    merged = {**_DEFAULT_TAG_TO_BLOCK_CTOR, **given}
    out = {}
    for name, ctor in merged.items():
        key = name if name.endswith("_tag") else kfacx_tag_name(name)
        out[key] = _cb.kfacx_block_ctor(ctor)
    return out


class BlockDiagonalCurvature(PowerProducts, _estimator.BlockDiagonalCurvature):
    """`kfacx.BlockDiagonalCurvature` with kfac-jax's signatures: the block table keyed by
    variant (kfac-jax block classes), the cached powers given to `init`, and the
    ``identity_weight`` / ``pmap_axis_name`` arguments kfac-jax's methods take."""

    def __init__(
        self,
        func: Callable[..., Any],
        default_estimation_mode: str = "fisher_gradients",
        params_index: int = 0,
        layer_tag_to_block_ctor: Mapping[str, Any] | None = None,
        auto_register_tags: bool = True,
        num_samples: int = 1,
        norm_to_scale_identity_weight_per_block: str | None = None,
        index_to_block_ctor: Mapping[tuple[int, ...], Any] | None = None,
        **auto_register_kwargs: Any,
    ):
        from kfacx.kfac_jax.tag_graph_matcher import detection_kwargs

        self._index_to_block_ctor = _index_ctors(index_to_block_ctor)
        for name in ("distributed_multiplies", "distributed_cache_updates"):
            auto_register_kwargs.pop(name, None)
        auto_register_kwargs.pop("should_vmap_samples", None)
        super().__init__(
            func,
            params_index=params_index,
            layer_tag_to_block_ctor=kfacx_block_ctors(layer_tag_to_block_ctor),
            default_estimation_mode=default_estimation_mode,
            num_samples=num_samples,
            auto_register_tags=auto_register_tags,
            auto_register_kwargs=detection_kwargs(auto_register_kwargs),
            norm_to_scale_identity_weight_per_block=norm_to_scale_identity_weight_per_block,
        )

    def _make_block(self, layer, param_leaves):
        """The block of ``index_to_block_ctor`` for this layer's parameter leaves (in the
        tag's order, or in any order), else the block of its variant."""
        ctor = self._index_to_block_ctor.get(tuple(param_leaves))
        if ctor is None:
            ctor = self._index_to_block_ctor.get(tuple(sorted(param_leaves)))
        if ctor is None:
            return super()._make_block(layer, param_leaves)
        return _kfacx_blocks.layer_block(layer, {layer.tag_name: _cb.kfacx_block_ctor(ctor)})

    def _set_up(self, func_args):
        traced = super()._set_up(func_args)
        layers = [tuple(leaves) for leaves in traced.layer_param_leaves]
        known = set(layers) | {tuple(sorted(leaves)) for leaves in layers}
        unknown = [key for key in self._index_to_block_ctor if key not in known]
        if unknown:
            raise ValueError(
                f"index_to_block_ctor has keys {unknown} that are no layer's parameter indices; "
                f"the layers' indices (leaves of the parameter pytree, in the tag's order) are "
                f"{layers}."
            )
        return traced

    # ------------------------------------------------------------------ kfac-jax's views

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def dim(self) -> int:
        """The number of parameters."""
        return sum(b.dim for b in self.blocks)

    @property
    def param_order(self) -> np.ndarray:
        """For each parameter leaf (pytree order), its position among the parameters
        listed block after block (kfac-jax's ``param_order``)."""
        order = [leaf for leaves in self._require_set_up().layer_param_leaves for leaf in leaves]
        return np.argsort(order)

    def params_vector_to_blocks_vectors(self, parameter_structured_vector: Any) -> tuple:
        """`params_to_blocks` (kfac-jax's name)."""
        return self.params_to_blocks(parameter_structured_vector)

    def blocks_vectors_to_params_vector(self, blocks_vectors: Any) -> Any:
        """`blocks_to_params` (kfac-jax's name)."""
        return self.blocks_to_params(blocks_vectors)

    def block_eigenvalues(self, state: Any, use_cached: bool) -> tuple[Any, ...]:
        """The eigenvalues of each block, in the order of ``self.blocks``: a Kronecker
        block's as ``[groups,] outputs x inputs`` products of its factors' eigenvalues
        (kfac-jax's layout), a diagonal block's diagonal, any other block's (ascending)
        eigenvalues of its dense matrix. ``use_cached`` is kfac-jax's: kfacx computes them
        from the current moving averages either way."""
        del use_cached
        return tuple(
            _block_eigenvalues(b, s) for b, s in zip(self.blocks, state.blocks, strict=True)
        )

    def eigenvalues(self, state: Any, use_cached: bool) -> Any:
        """`block_eigenvalues`, flattened and concatenated."""
        return jnp.concatenate([e.reshape(-1) for e in self.block_eigenvalues(state, use_cached)])

    def init(
        self,
        rng: Any,
        func_args: Any,
        exact_powers_to_cache: Any = None,
        approx_powers_to_cache: Any = None,
        cache_eigenvalues: bool = False,
    ) -> Any:
        """kfac-jax's ``init``: the powers to cache are given here."""
        from kfacx.kfac_jax._blocks._block import to_real_set

        self._cache_spec = (
            tuple(sorted(to_real_set(exact_powers_to_cache))),
            tuple(sorted(to_real_set(approx_powers_to_cache))),
            bool(cache_eigenvalues),
        )
        return super().init(rng, func_args)

    def update_curvature_matrix_estimate(
        self,
        state: Any,
        ema_old: Any,
        ema_new: Any,
        identity_weight: Any,
        batch_size: Any,
        rng: Any,
        func_args: Any,
        estimation_mode: str | None = None,
        pmap_axis_name: str | None = None,
    ) -> Any:
        """kfac-jax's argument order (``identity_weight`` is not used by the statistics)."""
        del identity_weight
        return super().update_curvature_matrix_estimate(
            state, ema_old, ema_new, batch_size, rng, func_args, estimation_mode, pmap_axis_name
        )

    def to_diagonal_block_dense_matrix(self, state: Any) -> tuple[Any, ...]:
        """Each block's dense matrix, in the order of ``self.blocks``, over its parameters
        in pytree-leaf order (kfac-jax's "canonical order"; kfacx's own
        `to_dense_matrix` follows the tag's order)."""
        leaves = self._require_set_up().layer_param_leaves
        return tuple(
            _in_leaf_order(b, idx, b.to_dense_matrix(s))
            for b, idx, s in zip(self.blocks, leaves, state.blocks, strict=True)
        )

    def sync(self, state: Any, pmap_axis_name: str | None) -> Any:
        """kfac-jax's ``sync``: the moving averages averaged over ``pmap_axis_name`` when
        inside a pmap binding it, else ``state`` (kfacx averages the statistics over the
        devices already when `update_curvature_matrix_estimate` gets ``pmap_axis_name``)."""
        from kfacx.kfac_jax.utils import in_pmap

        if not in_pmap(pmap_axis_name):
            return state
        blocks = tuple(
            b._replace(factors=jax.lax.pmean(b.factors, pmap_axis_name)) for b in state.blocks
        )
        return state._replace(blocks=blocks)

    def update_cache(
        self,
        state: Any,
        identity_weight: Any,
        exact_powers: Any = None,
        approx_powers: Any = None,
        eigenvalues: bool = False,
        pmap_axis_name: str | None = None,
        norm_to_scale_identity_weight_per_block: str | None = None,
    ) -> Any:
        """Refreshes the cache. Powers and eigenvalues asked for here that `init` did not
        cache are added to the cache first (its structure grows, as kfac-jax's does), and
        stay in it for later states of this estimator."""
        from kfacx.kfac_jax._blocks._block import to_real_set

        del norm_to_scale_identity_weight_per_block
        exact, approx, eig = self._cache_spec
        spec = (
            tuple(sorted(set(exact) | to_real_set(exact_powers))),
            tuple(sorted(set(approx) | to_real_set(approx_powers))),
            bool(eig or eigenvalues),
        )
        if spec != self._cache_spec:
            self._cache_spec = spec
            blocks = tuple(
                s._replace(cache=b.init_cache(*spec))
                for b, s in zip(self.blocks, state.blocks, strict=True)
            )
            state = state._replace(blocks=blocks)
        return super().update_cache(state, identity_weight, pmap_axis_name)

    def multiply_matpower(
        self,
        state: Any,
        parameter_structured_vector: Any,
        identity_weight: Any,
        power: Any,
        exact_power: bool = False,
        use_cached: bool = False,
        pmap_axis_name: str | None = None,
        norm_to_scale_identity_weight_per_block: str | None = None,
    ) -> Any:
        """``(C + identity_weight I)^power v`` (kfac-jax's signature)."""
        del pmap_axis_name, norm_to_scale_identity_weight_per_block
        return super().multiply_matpower(
            state, parameter_structured_vector, identity_weight, power, exact_power, use_cached
        )


def _index_ctors(index_to_block_ctor: Mapping[Any, Any] | None) -> dict[tuple[int, ...], Any]:
    """``index_to_block_ctor`` checked: tuples of parameter-leaf indices to block classes."""
    out = {}
    for key, ctor in dict(index_to_block_ctor or {}).items():
        if not isinstance(key, tuple) or not all(isinstance(i, int) for i in key):
            raise TypeError(
                f"index_to_block_ctor key {key!r}: give a tuple of parameter-leaf indices "
                "(positions in jax.tree_util.tree_leaves(params)), e.g. (1, 0)."
            )
        if not callable(ctor):
            raise TypeError(f"index_to_block_ctor[{key!r}] must be a block class, got {ctor!r}.")
        out[key] = ctor
    return out


def _in_leaf_order(block: Any, leaves: Any, dense: Any) -> Any:
    """``dense`` (over the block's parameters in the tag's order) with its rows and columns
    in the order of the parameters' pytree leaves."""
    order = np.argsort(leaves)
    if (order == np.arange(len(order))).all():
        return dense
    sizes = [math.prod(s) for s in block.parameters_shapes]
    offsets = np.cumsum([0, *sizes[:-1]])
    index = np.concatenate([np.arange(offsets[i], offsets[i] + sizes[i]) for i in order])
    return dense[index[:, None], index[None, :]]


def _block_eigenvalues(block: Any, state: Any) -> Any:
    from kfacx.kfac_jax._blocks._hosting import HostedBlock

    if isinstance(block, HostedBlock):
        return block.hosted.eigenvalues(block._join(state), use_cached=False)
    if isinstance(block, _kfacx_blocks.TwoKroneckerFactored):
        a, g = block.factor_values(state)
        vals = jnp.einsum("...i,...j->...ij", jnp.linalg.eigvalsh(g), jnp.linalg.eigvalsh(a))
        return vals[0] if vals.shape[0] == 1 else vals
    dense = block.to_dense_matrix(state)
    if isinstance(block, _kfacx_blocks.Diagonal | _kfacx_blocks.ScaleAndShiftDiagonal):
        return jnp.diagonal(dense)
    return jnp.linalg.eigvalsh(dense)
