"""Adam's second moment in the Kronecker eigenbasis (SOAP), as an optax transformation.

For a curvature block with Kronecker factors ``A`` (inputs) and ``G`` (outputs),
`scale_by_kfac_eigen_adam` takes the eigenvectors ``U_A``, ``U_G`` cached at the
block's last refresh, rotates the block's gradient matrix ``V`` (per feature group, as
`kfacx.TwoKroneckerFactored.params_to_matrix` lays it out) into that basis,
``V' = U_A^T V U_G``, keeps Adam's second moment there,
``nu <- b2 nu + (1 - b2) V'^2`` (elementwise), and returns
``U_A (V' / (sqrt(nu / (1 - b2^t)) + eps)) U_G^T``. This is SOAP (Vyas et al., 2024)
without its first moment (chain `optax.trace` or `optax.ema` for momentum), and an
EKFAC (George et al., 2018) whose scaling is the moving average of the *mini-batch*
gradients' squares in the eigenbasis, not of the per-example ones: no per-example
gradients, nothing but four matmuls per block and step besides the curvature update.

Every block says what its eigenbasis is (`kfacx.CurvatureBlock.to_eigenbasis`):
Kronecker blocks (dense, convolution, TNT, K-FAC-reduce) rotate both sides, an
embedding only its output side (its input factor is diagonal), a full block by the
eigenvectors of its matrix, EKFAC blocks by the basis of their own cache, a tied
weight by its fitted factors'; diagonal blocks (`kfacx.Diagonal`,
`kfacx.ScaleAndShiftDiagonal`) have the identity basis, so there it is plain Adam
(with ``b1 = 0``). A `kfacx.blocks.StackedBlock` rotates each slice by its own basis.

The refresh (every ``inverse_update_period`` updates, the first one included) replaces
the bases by the eigenvectors of the current factors. The second moment is then
re-expressed in the new basis as EKFAC re-expresses its scaling,
``nu' = (R_A o R_A) nu (R_G o R_G)^T`` with ``R = U_new^T U_old`` (the diagonal, in the
new basis, of the matrix that ``nu`` described in the old one); with
``rotate_second_moment=False`` it is kept as it is, as SOAP does.

References:
  N. Vyas, D. Morwani, R. Zhao, I. Shapira, D. Brandfonbrener, L. Janson and S. Kakade,
  "SOAP: Improving and Stabilizing Shampoo using Adam", arXiv:2409.11321 (2024).
  T. George, C. Laurent, X. Bouthillier, N. Ballas and P. Vincent, "Fast Approximate
  Natural Gradient Descent in a Kronecker-factored Eigenbasis", NeurIPS 2018.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from kfacx._helpers._checks import is_traced
from kfacx.blocks._base import cast_to, zeros
from kfacx.estimator import BlockDiagonalCurvature, EstimatorState, _refresh
from kfacx.estimator._refresh import refresh_on_schedule
from kfacx.transform import _partition
from kfacx.transform._transform_parts import (
    check_curvature_stats,
    checked_ema,
    checked_period,
    fold_statistics,
    reject_multi_steps,
    replace_params,
)

_NAME = "scale_by_kfac_eigen_adam"

#: What the blocks cache here (`kfacx.blocks.CurvatureBlock.init`'s arguments after the
#: key): eigendecompositions only, no damped inverses.
CACHE_SPEC = ((), (), True)


class ScaleByKfacEigenAdamState(NamedTuple):
    """State of `scale_by_kfac_eigen_adam`.

    Attributes:
      count: number of updates so far.
      estimator_state: the curvature blocks' moving averages and cached eigenbases.
      nu: per block, the second moment of the gradients in the block's eigenbasis
        (shaped as `kfacx.CurvatureBlock.to_eigenbasis` returns coordinates, e.g.
        ``[groups, n, m]`` for a Kronecker block).
    """

    count: jax.Array
    estimator_state: EstimatorState
    nu: tuple[Any, ...]


def to_eigenbasis(
    estimator: BlockDiagonalCurvature, estimator_state: EstimatorState, vector: Any
) -> tuple[Any, ...]:
    """Per block, a parameter-shaped pytree's coordinates in the block's eigenbasis
    (`kfacx.CurvatureBlock.to_eigenbasis`).

    Raises:
      ValueError: if ``vector`` is not shaped like the parameters, or a block's cache
        holds no eigenbasis.
      NotImplementedError: if a block defines no eigenbasis.
    """
    vectors = estimator.params_to_blocks(vector)
    pairs = zip(estimator.blocks, estimator_state.blocks, vectors, strict=True)
    return tuple(b.to_eigenbasis(s, v) for b, s, v in pairs)


def from_eigenbasis(
    estimator: BlockDiagonalCurvature,
    estimator_state: EstimatorState,
    coordinates: Sequence,
    like: Any = None,
) -> Any:
    """The inverse of `to_eigenbasis`: a parameter-shaped pytree (in the blocks' dtypes;
    with ``like``'s structure if given, see `kfacx.BlockDiagonalCurvature.blocks_to_params`)."""
    pairs = zip(estimator.blocks, estimator_state.blocks, coordinates, strict=True)
    return estimator.blocks_to_params(tuple(b.from_eigenbasis(s, c) for b, s, c in pairs), like)


def eigenbasis_change(
    estimator: BlockDiagonalCurvature,
    old: EstimatorState,
    new: EstimatorState,
    diagonals: Sequence,
) -> tuple[Any, ...]:
    """Per block, a diagonal in the eigenbasis of ``old`` re-expressed in that of ``new``
    (`kfacx.CurvatureBlock.eigenbasis_change`)."""
    pairs = zip(estimator.blocks, old.blocks, new.blocks, diagonals, strict=True)
    return tuple(b.eigenbasis_change(o, n, d) for b, o, n, d in pairs)


def _init_estimator_state(estimator: BlockDiagonalCurvature) -> EstimatorState:
    key = jax.random.key(0)
    return EstimatorState(tuple(b.init(key, *CACHE_SPEC) for b in estimator.blocks))


def _checked(name: str, value: Any, ok: Callable[[float], bool], requirement: str) -> Any:
    """``value`` if it is traced or a number (not a bool) that passes ``ok``.

    Raises:
      ValueError: naming ``name``, the ``requirement`` and the value.
    """
    if is_traced(value):
        return value
    try:
        good = not isinstance(value, bool) and ok(float(value))
    except (TypeError, ValueError):
        good = False
    if not good:
        raise ValueError(f"{_NAME}: {name} must be {requirement}, got {name}={value!r}.")
    return value


def _reject_masks(tree: Any) -> None:
    if _partition.has_masked_nodes(tree):
        raise ValueError(
            f"{_NAME} does not run inside optax.masked / optax.partition yet (it received "
            "a gradient with optax.MaskedNode leaves): use it on the whole model, e.g. "
            "optax.chain(kfacx.scale_by_kfac_eigen_adam(estimator, (params, batch)), ...), "
            "and serve the layers it should treat as plain Adam with kfacx.Diagonal blocks "
            "(layer_tag_to_block_ctor={'embedding_tag': kfacx.Diagonal}, ...)."
        )


def scale_by_kfac_eigen_adam(
    estimator: BlockDiagonalCurvature,
    func_args: Sequence[Any],
    b2: float = 0.999,
    eps: float = 1e-8,
    curvature_ema: float = 0.95,
    inverse_update_period: int = 10,
    rotate_second_moment: bool = True,
    pmap_axis_name: str | None = None,
    distributed_refresh: bool = True,
) -> optax.GradientTransformationExtraArgs:
    """Scales gradients by Adam's second moment kept in each block's Kronecker eigenbasis.

    Each update folds the ``curvature_stats`` extra argument into the curvature blocks'
    moving averages (weight ``curvature_ema`` for the old average), every
    ``inverse_update_period`` updates (the first included) refreshes the eigenbases of
    the factors, then rotates each block's gradient into its eigenbasis,
    ``V' = U_A^T V U_G``, updates the second moment ``nu <- b2 nu + (1 - b2) V'^2``, and
    returns ``U_A (V' / (sqrt(nu_hat) + eps)) U_G^T`` with Adam's bias correction
    ``nu_hat = nu / (1 - b2^t)`` (the module docstring has the details). A block whose
    basis is the identity (`kfacx.Diagonal`, `kfacx.ScaleAndShiftDiagonal`) gets plain
    Adam's scaling, ``optax.scale_by_adam(b1=0, b2=b2, eps=eps)``'s.

    It returns the scaled direction only: chain momentum and the learning rate after it
    (SOAP is this with `optax.trace` or `optax.ema` momentum). Between refreshes a step
    costs, besides the curvature statistics, four matmuls per block (into the basis and
    back; K-FAC's preconditioning costs two); the refresh is an eigendecomposition of
    every factor (the blocks cache eigenvectors here, whatever the estimator's own
    ``*_powers_to_cache``: no damping is involved).

    Args:
      estimator: the curvature estimator of the loss function.
      func_args: example arguments of the loss function, e.g. ``(params, batch)`` (only
        shapes and dtypes matter); the estimator is set up from them now.
      b2: the decay of the second moment, in [0, 1).
      eps: added to the root of the (bias-corrected) second moment, > 0.
      curvature_ema: weight of the old moving average of the curvature factors.
      inverse_update_period: refresh the eigenbases every this many updates.
      rotate_second_moment: at a refresh, re-express the second moment in the new
        basis (EKFAC's rule); False keeps it as it is (SOAP's).
      pmap_axis_name: average the statistics over this device axis (weighted by each
        device's batch size), inside `jax.pmap` or `jax.shard_map`.
      distributed_refresh: with ``pmap_axis_name``, compute each block's refresh on one
        owner device and share it (as `kfacx.BlockDiagonalCurvature.update_cache`).

    Returns:
      An `optax.GradientTransformationExtraArgs` whose ``update`` requires the keyword
      argument ``curvature_stats`` (a `kfacx.CurvatureStats`); its state is a
      `kfacx.ScaleByKfacEigenAdamState`, found by `kfacx.estimator_state`.

    Raises:
      TypeError: if ``estimator`` is not a `kfacx.BlockDiagonalCurvature`, or
        ``rotate_second_moment`` is not a bool; (in ``update``) without
        ``curvature_stats``.
      ValueError: on ``b2`` outside [0, 1), ``eps <= 0``, a bad moving-average weight
        or period; inside `optax.masked` / `optax.partition` or `optax.MultiSteps`.
      NotImplementedError: if a block of the model defines no eigenbasis.

    Example::

      estimator = kfacx.BlockDiagonalCurvature(loss_fn)
      tx = optax.chain(
          kfacx.scale_by_kfac_eigen_adam(estimator, (params, batch)),
          optax.trace(decay=0.9),
          optax.scale_by_learning_rate(1e-3),
      )
      opt_state = tx.init(params)
      loss, grads, stats = estimator.value_grads_and_curvature_stats(rng, (params, batch))
      updates, opt_state = tx.update(grads, opt_state, params, curvature_stats=stats)
    """
    if not isinstance(estimator, BlockDiagonalCurvature):
        raise TypeError(
            f"{_NAME}: estimator must be a kfacx.BlockDiagonalCurvature, got {estimator!r}."
        )
    if not isinstance(rotate_second_moment, bool):
        raise TypeError(
            f"{_NAME}: rotate_second_moment must be True (re-express the second moment in "
            f"each new basis) or False (keep it), got {rotate_second_moment!r}."
        )
    b2 = _checked(
        "b2",
        b2,
        lambda x: 0.0 <= x < 1.0,
        "a number in [0, 1), the decay of the second moment per update (Adam's default: b2=0.999)",
    )
    eps = _checked(
        "eps",
        eps,
        lambda x: 0.0 < x < math.inf,
        "a finite number > 0, added to the root of the second moment so that directions "
        "without curvature stay finite (e.g. eps=1e-8)",
    )
    ema = checked_ema(curvature_ema)
    period = checked_period(inverse_update_period)
    func_args = tuple(func_args)
    estimator.set_up(func_args)
    example_params = func_args[estimator.params_index]
    _reject_masks(example_params)
    # Abstractly (nothing is computed): every block must define its eigenbasis.
    jax.eval_shape(
        lambda p: to_eigenbasis(estimator, _init_estimator_state(estimator), p), example_params
    )
    refresh_axis = pmap_axis_name if distributed_refresh else None

    def refresh(carry):
        old, nu = carry
        # The damping is unused: the caches hold eigendecompositions only.
        new = EstimatorState(_refresh.refresh(estimator.blocks, old.blocks, 1.0, refresh_axis))
        if rotate_second_moment:
            nu = eigenbasis_change(estimator, old, new, nu)
        return new, nu

    def init_fn(params):
        reject_multi_steps(_NAME)
        _reject_masks(params)
        estimator.set_up(replace_params(func_args, params, estimator.params_index))
        state = _init_estimator_state(estimator)
        shapes = jax.eval_shape(lambda p: to_eigenbasis(estimator, state, p), params)
        nu = jax.tree_util.tree_map(lambda s: zeros(s.shape, s.dtype), shapes)
        return ScaleByKfacEigenAdamState(zeros((), jnp.int32), state, nu)

    def update_fn(updates, state, params=None, *, curvature_stats=None, **extra_args):
        del params, extra_args
        reject_multi_steps(_NAME)
        check_curvature_stats(curvature_stats, f"{_NAME}.update")
        _reject_masks(updates)
        est = fold_statistics(
            estimator, state.estimator_state, curvature_stats, ema, stats_axis_name=pmap_axis_name
        )
        est, nu = refresh_on_schedule(state.count, period, refresh, (est, state.nu))
        coordinates = to_eigenbasis(estimator, est, updates)
        nu = optax.tree.update_moment_per_elem_norm(coordinates, nu, b2, 2)
        count = optax.safe_increment(state.count)
        nu_hat = optax.tree.bias_correction(nu, b2, count)
        scaled = jax.tree_util.tree_map(lambda c, n: c / (jnp.sqrt(n) + eps), coordinates, nu_hat)
        out = from_eigenbasis(estimator, est, scaled, like=updates)
        out = jax.tree_util.tree_map(lambda o, u: cast_to(o, u.dtype), out, updates)
        return out, ScaleByKfacEigenAdamState(count, est, nu)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
