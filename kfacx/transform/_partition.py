"""K-FAC on part of the parameters: `scale_by_kfac` inside `optax.masked` / `optax.partition`.

Inside ``optax.masked(inner, mask)`` (and so inside every group of
``optax.partition``) the inner transformation receives the gradient, the
parameters and ``init``'s parameters with every leaf outside the mask replaced
by an `optax.MaskedNode` (a whole masked subtree by a single node). The
statistics passed as the extra argument ``curvature_stats`` are not masked:
they are the whole model's.

`BlockSubset` serves such a masked tree: it holds only the blocks whose
parameters are all present, folds only their statistics in, refreshes and
multiplies only them. It offers the part of `kfacx.BlockDiagonalCurvature`'s
interface that `kfacx.transform.precondition` calls, so the preconditioning
step is the same code for the whole model and for a part of it. A block is
preconditioned jointly over its parameters (a dense layer's ``w`` and ``b``
share the input factor), so a mask that keeps some of a block's parameters and
drops others is an error; `block_labels` labels parameters block by block.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from typing import Any

import jax
import optax

from kfacx._helpers._paths import unbox
from kfacx.estimator import (
    BlockDiagonalCurvature,
    CurvatureStats,
    EstimatorState,
    _identity_weights,
    _refresh,
    _statistics,
)

__all__ = ["BlockSubset", "block_labels", "has_masked_nodes"]


def _is_masked(x: Any) -> bool:
    return isinstance(x, optax.MaskedNode)


def has_masked_nodes(tree: Any) -> bool:
    """Whether ``tree`` has an `optax.MaskedNode` (it comes from `optax.masked`)."""
    return any(_is_masked(x) for x in jax.tree_util.tree_leaves(tree, is_leaf=_is_masked))


def _index_tree(example_params: Any) -> Any:
    """The parameters' structure with each leaf replaced by its index."""
    treedef = jax.tree_util.tree_structure(example_params)
    return jax.tree_util.tree_unflatten(treedef, range(treedef.num_leaves))


def _present_indices(masked_tree: Any, index_tree: Any) -> list[int]:
    """The parameter-leaf index of every leaf of ``masked_tree`` that is not masked out."""

    def index(m, i):
        if _is_masked(m):
            return None
        if not isinstance(i, int):
            raise ValueError("a leaf stands where the parameters have a subtree")
        return i

    try:
        # Boxes aside (nnx.Optimizer's init passes nnx.Param-boxed parameters, its update
        # plain arrays), as `kfacx.BlockDiagonalCurvature.params_to_blocks` takes them.
        mapped = jax.tree_util.tree_map(
            index, unbox(masked_tree, _is_masked), unbox(index_tree), is_leaf=_is_masked
        )
    except ValueError as e:
        raise ValueError(
            "scale_by_kfac: the masked gradient's structure does not fit the parameters "
            f"scale_by_kfac was created with ({e}). Inside optax.masked / optax.partition the "
            "gradient must be the parameters' pytree with some subtrees replaced by "
            "optax.MaskedNode."
        ) from None
    return jax.tree_util.tree_leaves(mapped)


class BlockSubset:
    """The blocks of an estimator that serve the parameters a mask keeps.

    It has the methods of `kfacx.BlockDiagonalCurvature` that
    `kfacx.transform.precondition` calls; its state is an
    `kfacx.EstimatorState` of the kept blocks only, and its vectors are masked
    trees (the parameters' pytree with `optax.MaskedNode` subtrees).

    Args:
      estimator: the set-up estimator of the whole model.
      example_params: parameters of the whole model (shapes only).
      masked_tree: a masked tree (gradient or parameters) from `optax.masked`.

    Raises:
      ValueError: if the tree does not fit the parameters, or keeps only some
        of a block's parameters.
    """

    def __init__(self, estimator: BlockDiagonalCurvature, example_params: Any, masked_tree: Any):
        self.estimator = estimator
        self.index_tree = _index_tree(example_params)
        present = set(_present_indices(masked_tree, self.index_tree))
        self.leaf_ids = estimator.params_to_blocks(self.index_tree)
        kept = [b for b, ids in enumerate(self.leaf_ids) if set(ids) <= present]
        for b, ids in enumerate(self.leaf_ids):
            if present & set(ids) and b not in kept:
                _raise_partial_block(estimator.blocks[b], ids, present)
        self.block_ids = tuple(kept)
        self.blocks = tuple(estimator.blocks[b] for b in kept)
        self.has_coverage = tuple(estimator._coverage_shapes[b] is not None for b in kept)

    def select(self, state: EstimatorState) -> EstimatorState:
        """The kept blocks' part of a whole-model estimator state."""
        return EstimatorState(tuple(state.blocks[b] for b in self.block_ids))

    def check_state(self, state: EstimatorState) -> None:
        """Raises a ValueError if ``state`` was made for another mask."""
        if len(state.blocks) != len(self.block_ids):
            raise ValueError(
                f"scale_by_kfac: the gradient's mask keeps {len(self.block_ids)} curvature "
                f"blocks, but the state was initialised for {len(state.blocks)}. Use the same "
                "mask (or labels) for init and update."
            )

    def update_curvature_estimate_from_stats(
        self,
        state: EstimatorState,
        stats: CurvatureStats,
        ema_old: Any,
        ema_new: Any,
        pmap_axis_name: str | None = None,
    ) -> EstimatorState:
        """Folds the kept blocks' part of the whole model's statistics in."""
        if len(stats.blocks) != len(self.leaf_ids):
            raise ValueError(
                f"scale_by_kfac: curvature_stats has {len(stats.blocks)} blocks, the estimator "
                f"{len(self.leaf_ids)}: pass the statistics of this estimator's whole model."
            )
        stats = CurvatureStats(tuple(stats.blocks[b] for b in self.block_ids), stats.batch_size)
        if pmap_axis_name is not None:
            stats = _statistics.weighted_mean_stats(stats, pmap_axis_name)
        return EstimatorState(
            tuple(
                _statistics.update_block(b, st, s, ema_old, ema_new, c)
                for b, st, s, c in zip(
                    self.blocks, state.blocks, stats.blocks, self.has_coverage, strict=True
                )
            )
        )

    def _weights(self, state: EstimatorState, identity_weight: Any) -> tuple[Any, ...]:
        """One identity weight per kept block, scaled as the estimator scales them
        (``norm_to_scale_identity_weight_per_block``)."""
        norm = self.estimator.norm_to_scale_identity_weight_per_block
        weights = _identity_weights.scaled(self.blocks, state.blocks, identity_weight, norm)
        return _identity_weights.per_block(weights, len(self.blocks))

    def update_cache(
        self, state: EstimatorState, identity_weight: Any, pmap_axis_name: str | None = None
    ) -> EstimatorState:
        """Refreshes the kept blocks' caches (as `kfacx.BlockDiagonalCurvature.update_cache`)."""
        _identity_weights.check(identity_weight, "update_cache", allow_zero=False)
        weights = self._weights(state, identity_weight)
        return EstimatorState(_refresh.refresh(self.blocks, state.blocks, weights, pmap_axis_name))

    def multiply_matpower(
        self,
        state: EstimatorState,
        vector: Any,
        identity_weight: Any,
        power: float,
        exact_power: bool = False,
        use_cached: bool = False,
    ) -> Any:
        """``(C + identity_weight I)^power v`` on the kept blocks, for a masked tree ``v``
        (as `kfacx.BlockDiagonalCurvature.multiply_matpower`)."""
        if power != 1:
            _identity_weights.check(identity_weight, "multiply_matpower", allow_zero=False)
        leaves = jax.tree_util.tree_leaves(vector, is_leaf=_is_masked)
        values = [x for x in leaves if not _is_masked(x)]
        by_index = dict(zip(_present_indices(vector, self.index_tree), values, strict=True))
        weights = self._weights(state, identity_weight)
        for b, block, block_state, weight in zip(
            self.block_ids, self.blocks, state.blocks, weights, strict=True
        ):
            ids = self.leaf_ids[b]
            vec = tuple(by_index[i] for i in ids)
            out = block.multiply_matpower(block_state, vec, weight, power, exact_power, use_cached)
            by_index.update(zip(ids, out, strict=True))
        flat, treedef = jax.tree_util.tree_flatten(vector, is_leaf=_is_masked)
        present = iter(_present_indices(vector, self.index_tree))
        out = [m if _is_masked(m) else by_index[next(present)] for m in flat]
        return jax.tree_util.tree_unflatten(treedef, out)


def _raise_partial_block(block: Any, ids: tuple[int, ...], present: set[int]) -> None:
    paths = block.layer.parameter_paths
    kept = [p for p, i in zip(paths, ids, strict=True) if i in present]
    dropped = [p for p, i in zip(paths, ids, strict=True) if i not in present]
    raise ValueError(
        f"scale_by_kfac: the mask (optax.masked / optax.partition labels) keeps {kept} but "
        f"drops {dropped}, which the same curvature block {block!r} serves. A K-FAC block "
        "preconditions its parameters jointly: give all of them the same label, e.g. with "
        "kfacx.block_labels(estimator, {'dense_tag': 'kfac'}, default='adam')."
    )


def block_labels(
    estimator: BlockDiagonalCurvature,
    labels: Mapping[str, Hashable] | Callable[[Any], Hashable],
    default: Hashable | None = None,
) -> Callable[[Any], Any]:
    """Labels every parameter by the curvature block that serves it, for `optax.partition`.

    The parameters of one block (a dense layer's ``w`` and ``b``, a norm's
    scale and offset) always get the same label, as `kfacx.scale_by_kfac`
    inside `optax.partition` needs. The labels are computed when optax asks for
    them, from the estimator's blocks (the registration report's ``tag`` and
    ``block`` columns), so the estimator must be set up by then: creating
    `kfacx.scale_by_kfac` sets it up.

    Args:
      estimator: the curvature estimator of the whole model.
      labels: a mapping from layer tag name (``"dense_tag"``, ``"conv_tag"``,
        ``"embedding_tag"``, ``"scale_and_shift_tag"``, ``"generic_tag"``...; the
        pseudo tags ``"tied"`` for parameters several layers share and ``"sliced"``
        for parameters whose slices feed different layers, e.g. a fused QKV weight)
        to label, or a function ``block -> label`` of the `kfacx.CurvatureBlock`
        (its ``layer`` has ``tag_name`` and ``parameter_paths``).
      default: the label of parameters whose tag ``labels`` does not name;
        None makes such a parameter an error.

    Returns:
      ``params -> labels``: a pytree of labels shaped like the parameters, to
      pass as ``param_labels`` to `optax.partition` / `optax.multi_transform`.

    Raises:
      ValueError: (when called) if a tag has no label and there is no default,
        or the pytree is not the parameters' structure.

    Example::

      tx = optax.partition(
          {"kfac": optax.chain(kfacx.scale_by_kfac(estimator, (params, batch)),
                               optax.sgd(0.1, momentum=0.9)),
           "adam": optax.adam(1e-3)},
          kfacx.block_labels(estimator, {"dense_tag": "kfac", "conv_tag": "kfac"},
                             default="adam"),
      )
    """
    if not (callable(labels) or isinstance(labels, Mapping)):
        raise TypeError(
            f"block_labels: labels must be a mapping tag name -> label or a function "
            f"block -> label, got {labels!r}."
        )

    def label_of(block):
        if callable(labels):
            return labels(block)
        tag = block.layer.tag_name
        if tag in labels:
            return labels[tag]
        if default is None:
            raise ValueError(
                f"block_labels: no label for layer tag {tag!r} ({block!r}): add it to "
                f"labels or pass default=..."
            )
        return default

    def param_labels(params: Any) -> Any:
        per_block = [[label_of(b)] * len(b.parameters_shapes) for b in estimator.blocks]
        index_tree = _index_tree(params)
        leaf_ids = estimator.params_to_blocks(index_tree)
        flat: list[Any] = [None] * len(jax.tree_util.tree_leaves(index_tree))
        for ids, block_labels_ in zip(leaf_ids, per_block, strict=True):
            for i, label in zip(ids, block_labels_, strict=True):
                flat[i] = label
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(params), flat)

    return param_labels
