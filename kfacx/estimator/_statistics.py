"""One batch's curvature statistics, and what the estimator does with them.

`kfacx.BlockDiagonalCurvature` builds on the pieces here:

* `loss_cotangents`: the cotangents of the registered losses per estimation mode
  (`ESTIMATION_MODES`: sampled, empirical, curvature propagation or exact), which the
  tracer's vjp pulls back to every layer (``fisher_empirical_direct`` takes the
  layers' cotangents from the gradient of the function's value instead);
* `curvature_stats`: all blocks' statistics of one batch, per estimation mode;
* `block_statistics`: a block's statistics of one batch (`CurvatureStats` holds all
  blocks'), with the coverage of a layer used only in `lax.cond` branches;
* `weighted_mean_stats`: their average over a device axis;
* `update_block`: one block's moving-average update, weighted by that coverage;
* `ggn_gram_upper`: exact curvature products ``v_i^T C v_j`` of the linearized losses
  (`kfacx.BlockDiagonalCurvature.linearized_losses`), for the quadratic model of
  `kfacx.Optimizer`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from kfacx._helpers._tree import wide
from kfacx.blocks._base import statistics_of
from kfacx.losses import LossFunction
from kfacx.parallel import _reductions

#: Estimation modes understood by `BlockDiagonalCurvature` (kfac-jax's names): the
#: Fisher from sampled targets (``fisher_gradients``), the empirical Fisher from the
#: observed targets of the registered losses (``fisher_empirical``), curvature
#: propagation with random signs (``fisher_curvature_prop``, ``ggn_curvature_prop``),
#: the exact Fisher / Gauss-Newton from all output directions (``fisher_exact``,
#: ``ggn_exact``), and the empirical Fisher of the per-example gradients of the
#: function's own value, from the backward pass of its gradient
#: (``fisher_empirical_direct``).
ESTIMATION_MODES = (
    "fisher_gradients",
    "fisher_empirical",
    "fisher_curvature_prop",
    "ggn_curvature_prop",
    "fisher_exact",
    "ggn_exact",
    "fisher_empirical_direct",
)

#: The estimation mode whose layer cotangents are the per-example gradients of the
#: function's value itself (from the backward pass of its gradient), not of the
#: registered losses.
DIRECT_MODE = "fisher_empirical_direct"


class CurvatureStats(NamedTuple):
    """One batch's curvature statistics, before they enter the moving averages.

    Attributes:
      blocks: per block, the tuple `kfacx.blocks.CurvatureBlock.compute_statistics`
        returns (batch averages). The block of a layer used only inside
        `lax.cond` / `lax.switch` branches has one more, last entry: its
        *coverage*, 1 if the layer ran on this batch, 0 if its branch was not
        taken (per slice ``[L]`` for a stacked layer), its statistics being
        zero then. Averaged over micro-batches or devices like the other
        entries, it becomes the fraction of the examples the layer ran on;
        the moving averages then move by that fraction of a step towards the
        statistics of those examples (not at all for a coverage of 0).
      batch_size: the number of (real, unmasked) examples they average over;
        averages of several batches or devices are weighted by it.
    """

    blocks: tuple[tuple[jax.Array, ...], ...]
    batch_size: jax.Array


def zero_stats(
    blocks: Sequence[Any], coverage_shapes: Sequence[tuple[int, ...] | None]
) -> CurvatureStats:
    """Statistics of zero batches (zeros shaped like every block's factors)."""
    stats = tuple(
        tuple(jnp.zeros(s, b.dtype) for s in b.statistics_shapes())
        + (() if c is None else (jnp.zeros(c, jnp.float32),))
        for b, c in zip(blocks, coverage_shapes, strict=True)
    )
    return CurvatureStats(stats, jnp.zeros((), jnp.float32))


def weighted_mean_stats(stats: CurvatureStats, axis_name: str) -> CurvatureStats:
    """The average of ``stats`` over a device axis, weighted by their batch sizes
    (`kfacx.parallel._reductions.weighted_mean`)."""
    return CurvatureStats(*_reductions.weighted_mean(stats.blocks, stats.batch_size, axis_name))


def check_mode(mode: str) -> str:
    """``mode``, checked to be one of `ESTIMATION_MODES`.

    Raises:
      ValueError: naming the mode and the choices.
    """
    if mode not in ESTIMATION_MODES:
        raise ValueError(f"Unknown estimation_mode={mode!r}; choose one of {ESTIMATION_MODES}.")
    return mode


def curvature_stats(
    blocks: Sequence[Any],
    coverage_shapes: Sequence[tuple[int, ...] | None],
    losses: Sequence[LossFunction],
    vjp: Any,
    mode: str,
    rng: jax.Array,
    num_samples: int,
    batch_size: Any,
    example_mask: jax.Array | None,
    states: Sequence[Any] | None = None,
) -> CurvatureStats:
    """Every block's statistics of one batch (see `kfacx.BlockDiagonalCurvature`).

    Args:
      blocks, coverage_shapes: the estimator's blocks and their coverage shapes.
      losses, vjp: the registered losses and the tracer's `LayerTagsVjp`.
      mode: one of `ESTIMATION_MODES`. In `DIRECT_MODE` the cotangents of every
        layer's outputs are ``batch_size`` times the gradient of the function's value
        (``vjp.value_gradient``): each example's row is the gradient of its own term
        when the value is the mean over the (real) examples.
      rng, num_samples: for the sampling modes.
      batch_size: the normaliser; None: the mask's sum, else the registered losses'.
      example_mask: ``[batch]`` weights of the examples, or None.
      states: the blocks' states, for the blocks whose statistics need them
        (``statistics_need_state``), or None.
    """
    if mode == DIRECT_MODE:
        if example_mask is not None:
            example_mask = check_mask(example_mask, losses)
        batch_size = _batch_size(batch_size, losses, example_mask)
        data = vjp.value_gradient(jnp.asarray(batch_size, jnp.float32), example_mask)
    else:
        cotangents = _per_loss_normalised(losses, loss_cotangents(losses, mode, rng, num_samples))
        if example_mask is not None:
            example_mask = check_mask(example_mask, losses)
            cotangents = tuple(mask_leading(c, example_mask, axis=1) for c in cotangents)
        batch_size = _batch_size(batch_size, losses, example_mask)
        data = vjp.sampled(cotangents, example_mask)
    safe = jnp.maximum(jnp.asarray(batch_size, jnp.float32), 1e-12)
    states = (None,) * len(blocks) if states is None else states
    stats = tuple(
        block_statistics(block, d, safe, c, s)
        for block, d, c, s in zip(blocks, data, coverage_shapes, states, strict=True)
    )
    return CurvatureStats(stats, jnp.asarray(batch_size, jnp.float32))


def _per_loss_normalised(
    losses: Sequence[LossFunction], cotangents: Sequence[jax.Array]
) -> tuple[jax.Array, ...]:
    """``cotangents`` of losses with different row counts, rescaled so that each loss
    counts as the mean over its own rows once the statistics divide by the first
    loss's: loss ``i``'s by ``sqrt(B_0 / B_i)`` (they enter the statistics squared)."""
    first = losses[0].batch_size
    return tuple(
        c if loss.batch_size == first else c * jnp.sqrt(first / loss.batch_size).astype(c.dtype)
        for loss, c in zip(losses, cotangents, strict=True)
    )


def _batch_size(batch_size: Any, losses: Sequence[LossFunction], mask: jax.Array | None) -> Any:
    if batch_size is None and mask is not None:
        batch_size = jnp.sum(mask)
    return losses[0].batch_size if batch_size is None else batch_size


def loss_cotangents(
    losses: Sequence[LossFunction], mode: str, rng: jax.Array, num_samples: int
) -> tuple[jax.Array, ...]:
    """Cotangents ``[samples, *prediction_shape]`` per loss, per estimation mode."""
    if mode == "fisher_empirical":
        return tuple(loss.empirical_fisher_cotangent()[None] for loss in losses)
    if mode in ("fisher_exact", "ggn_exact"):
        return _exact_cotangents(losses)
    n = num_samples
    # One loss, one sample: the key itself (a split is a threefry loop to compile).
    keys = [rng] if len(losses) == 1 else jax.random.split(rng, len(losses))

    def draw(loss: LossFunction, key):
        sample_keys = key[None] if n == 1 else jax.random.split(key, n)
        if mode == "fisher_gradients":
            cts = jax.vmap(loss.sampled_fisher_cotangent)(sample_keys)
        else:
            shape = loss.prediction.shape
            signs = jax.vmap(
                lambda k: jax.random.rademacher(k, shape, dtype=loss.prediction.dtype)
            )(sample_keys)
            factor = (
                loss.multiply_fisher_factor
                if mode.startswith("fisher")
                else loss.multiply_ggn_factor
            )
            cts = jax.vmap(factor)(signs)
        return cts / jnp.sqrt(jnp.asarray(n, cts.dtype))

    return tuple(draw(loss, k) for loss, k in zip(losses, keys, strict=True))


def _exact_cotangents(losses: Sequence[LossFunction]) -> tuple[jax.Array, ...]:
    """All factor columns of every loss, each loss's columns zero for the others."""
    columns = [loss.ggn_factor_columns() for loss in losses]
    counts = [c.shape[0] for c in columns]
    out = []
    for i, c in enumerate(columns):
        before, after = sum(counts[:i]), sum(counts[i + 1 :])
        out.append(jnp.pad(c, [(before, after)] + [(0, 0)] * (c.ndim - 1)))
    return tuple(out)


def check_mask(mask: Any, losses: Sequence[LossFunction]) -> jax.Array:
    mask = jnp.asarray(mask)
    sizes = {loss.batch_size for loss in losses}
    if mask.ndim != 1 or sizes != {mask.shape[0]}:
        raise ValueError(
            f"example_mask must have shape [batch] matching the registered losses' batch sizes "
            f"{sorted(sizes)}; got shape {mask.shape}."
        )
    return mask


def mask_leading(x: jax.Array, mask: jax.Array, axis: int) -> jax.Array:
    """``x`` times ``mask`` along axis ``axis``."""
    shape = [1] * x.ndim
    shape[axis] = mask.shape[0]
    return x * mask.reshape(shape).astype(x.dtype)


def block_states(blocks: Sequence[Any], estimator_state: Any) -> tuple[Any, ...] | None:
    """The block states that the statistics of ``blocks`` need (``statistics_need_state``),
    from an `kfacx.EstimatorState`; None if no block needs its state.

    Raises:
      ValueError: if a block needs its state and there is none, or the state is not
        of these blocks.
    """
    needing = [b for b in blocks if getattr(b, "statistics_need_state", False)]
    if not needing:
        return None
    if estimator_state is None:
        more = f" (and {len(needing) - 1} more blocks)" if len(needing) > 1 else ""
        raise ValueError(
            f"The statistics of {needing[0]!r}{more} are taken in the basis kept in the "
            "estimator state: pass estimator_state=... (with kfacx.scale_by_kfac: "
            "kfacx.estimator_state(opt_state))."
        )
    if len(estimator_state.blocks) != len(blocks):
        raise ValueError(
            f"estimator_state has {len(estimator_state.blocks)} block states but the "
            f"estimator has {len(blocks)} blocks; pass the state of the whole model's "
            "estimator (blocks whose statistics need their state, such as EKFAC's, are not "
            "supported inside optax.masked / optax.partition yet)."
        )
    return estimator_state.blocks


def block_statistics(
    block: Any,
    data: Any,
    batch_size: jax.Array,
    coverage_shape: tuple[int, ...] | None,
    state: Any = None,
) -> tuple[jax.Array, ...]:
    """``block``'s statistics of one batch from its estimation data (and its ``state``
    if its statistics need it), followed by its coverage (see `CurvatureStats`) when
    ``coverage_shape`` is not None."""
    data = dict(data)
    coverage = data.pop("coverage", None)
    stats = statistics_of(block, data, batch_size, state)
    if coverage_shape is None:
        return stats
    return (*stats, jnp.broadcast_to(coverage, coverage_shape).astype(jnp.float32))


def update_block(block, state, stats, ema_old, ema_new, has_coverage: bool):
    """One block's moving-average update; for a block with a coverage ``c`` (see
    `CurvatureStats`), ``c`` of a step towards the statistics of the examples it ran
    on: ``ema_old`` becomes ``1 - c (1 - ema_old)``, ``ema_new`` ``c ema_new`` and the
    statistics ``stats / c`` (``c = 0`` leaves the averages as they are)."""
    if not has_coverage:
        return block.update_from_statistics(state, stats, ema_old, ema_new)
    *stats, c = stats
    c = c.astype(block.dtype)
    safe = jnp.where(c > 0, c, 1.0)

    def per_example(s):
        return s / safe.reshape(safe.shape + (1,) * (s.ndim - safe.ndim)).astype(s.dtype)

    ema_old, ema_new = (jnp.asarray(w, block.dtype) for w in (ema_old, ema_new))
    # Exact for c = 1 (a plain update) and c = 0 (ema_old 1, ema_new 0: no change).
    old = jnp.where(c < 1, 1 - c * (1 - ema_old), ema_old)
    return block.update_from_statistics(state, tuple(map(per_example, stats)), old, c * ema_new)


def ggn_gram_upper(
    losses: Sequence[LossFunction],
    jvp: Callable[[Any], Sequence[jax.Array]],
    vectors: Sequence[Any],
    mask: jax.Array | None,
) -> jax.Array:
    """The upper triangle (row-major) of ``v_i^T C v_j`` for the exact curvature ``C`` of
    the registered losses.

    A loss registered on a prediction with ``B`` rows is the mean of its ``B`` terms (the
    convention of `kfacx.register_softmax_cross_entropy_loss`), so its curvature is
    ``(1/B) sum_b (J v_i)_b^T H_b (J v_j)_b``: ``H_b`` is the Gauss-Newton matrix of row
    ``b`` (`kfacx.LossFunction.multiply_ggn`, the loss's weight included) and ``J`` the
    Jacobian of the predictions with respect to the parameters. Each loss is averaged
    over its own rows, whatever the batch's leading size: logits of a sequence model
    flattened to ``[batch * positions, vocab]`` are averaged over all their rows, exactly
    as the loss function does. With ``mask`` (``[B]`` weights of the examples, the same
    ``B`` for every loss) the padding rows are left out and the average is over the
    mask's sum. `gram_from_upper` makes the ``[k, k]`` matrix of it.

    Args:
      losses, jvp: the linearized losses
        (`kfacx.BlockDiagonalCurvature.linearized_losses`).
      vectors: ``k`` parameter-shaped pytrees.
      mask: ``[batch]`` weights of the examples, or None.

    Returns:
      The ``k (k + 1) / 2`` entries ``G[0, 0], G[0, 1], ..., G[k - 1, k - 1]``.
    """
    # One jvp per vector: on CPU this is about twice as fast as a vmapped jvp.
    tangents = [jax.tree.map(wide, jvp(v)) for v in vectors]
    if mask is None:
        norms = [jnp.asarray(loss.batch_size, jnp.float32) for loss in losses]
    else:
        mask = check_mask(mask, losses)
        norms = [jnp.maximum(jnp.sum(mask), 1e-12)] * len(losses)
    k = len(vectors)
    rows = []
    for i in range(k):
        for j in range(i, k):
            total = jnp.zeros(())
            for loss, norm, ti, tj in zip(losses, norms, tangents[i], tangents[j], strict=True):
                prod = ti * loss.multiply_ggn(tj)
                if mask is not None:
                    prod = prod * mask.reshape((-1,) + (1,) * (prod.ndim - 1)).astype(prod.dtype)
                total = total + jnp.sum(prod) / norm.astype(prod.dtype)
            rows.append(total)
    return jnp.stack(rows)


def gram_from_upper(upper: jax.Array, k: int) -> jax.Array:
    """The symmetric ``[k, k]`` matrix of a row-major upper triangle (`ggn_gram_upper`)."""
    gram = jnp.zeros((k, k), upper.dtype)
    index = 0
    for i in range(k):
        for j in range(i, k):
            gram = gram.at[i, j].set(upper[index]).at[j, i].set(upper[index])
            index += 1
    return gram


def ema_weights(curvature_ema: Any, update_curvature: Any = True) -> tuple[Any, Any]:
    """``(ema_old, ema_new)``: the weights of the old moving average and of the new
    statistics; ``(1, 0)`` where ``update_curvature`` (a bool or a traced bool) is
    False, which leaves the averages as they are."""
    if update_curvature is True:
        return curvature_ema, 1.0 - curvature_ema
    return (
        jnp.where(update_curvature, curvature_ema, 1.0),
        jnp.where(update_curvature, 1.0 - curvature_ema, 0.0),
    )
