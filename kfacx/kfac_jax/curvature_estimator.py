"""``kfac_jax.curvature_estimator``: the default block of each layer variant, and the
estimator, in kfac-jax's terms.

kfac-jax keys blocks by layer *variant* (``"dense"``, ``"conv2d"``, ``"generic"``, ...)
and keeps a process-wide default table that extensions edit with
`set_default_tag_to_block_ctor` (FermiNet maps ``"repeated_dense"`` to its block
there). `kfacx_block_ctors` turns that table, with a user's ``layer_tag_to_block_ctor``
on top, into kfacx's (tag name -> kfacx block factory).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import jax

from kfacx import estimator as _estimator
from kfacx.kfac_jax import curvature_blocks as _cb
from kfacx.kfac_jax._unsupported import unsupported_class
from kfacx.kfac_jax.layers_and_loss_tags import kfacx_tag_name

__all__ = [
    "BlockDiagonalCurvature",
    "CurvatureEstimator",
    "ExplicitExactCurvature",
    "ImplicitExactCurvature",
    "OptaxPreconditionState",
    "OptaxPreconditioner",
    "get_default_tag_to_block_ctor",
    "kfacx_block_ctors",
    "set_default_tag_to_block_ctor",
    "set_multi_default_tag_to_block_ctor",
]

#: kfac-jax's type variable of an estimator's state (tests and extensions annotate with it).
StateType = TypeVar("StateType")

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


class BlockDiagonalCurvature(_estimator.BlockDiagonalCurvature):
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
        **auto_register_kwargs: Any,
    ):
        from kfacx.kfac_jax.tag_graph_matcher import detection_kwargs

        for name in ("index_to_block_ctor", "distributed_multiplies", "distributed_cache_updates"):
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
        """Each block's dense matrix, in the order of ``self.blocks`` (kfac-jax's)."""
        return tuple(b.to_dense_matrix(s) for b, s in zip(self.blocks, state.blocks, strict=True))

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
        """Refreshes what `init` asked to cache (kfac-jax's powers arguments are taken for
        its signature; the cached powers are `init`'s)."""
        del exact_powers, approx_powers, eigenvalues, norm_to_scale_identity_weight_per_block
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

    def multiply(
        self,
        state,
        parameter_structured_vector,
        identity_weight,
        exact_power=False,
        use_cached=False,
        pmap_axis_name=None,
        norm_to_scale_identity_weight_per_block=None,
    ):
        """``(C + identity_weight I) v``."""
        return self.multiply_matpower(
            state, parameter_structured_vector, identity_weight, 1, exact_power, use_cached
        )

    def multiply_inverse(
        self,
        state,
        parameter_structured_vector,
        identity_weight,
        exact_power=False,
        use_cached=False,
        pmap_axis_name=None,
        norm_to_scale_identity_weight_per_block=None,
    ):
        """``(C + identity_weight I)^-1 v``."""
        return self.multiply_matpower(
            state, parameter_structured_vector, identity_weight, -1, exact_power, use_cached
        )


_ESTIMATOR = "use kfacx.BlockDiagonalCurvature (kfacx.kfac_jax.BlockDiagonalCurvature)"
CurvatureEstimator = unsupported_class("CurvatureEstimator", _ESTIMATOR)
ExplicitExactCurvature = unsupported_class(
    "ExplicitExactCurvature",
    "kfacx.BlockDiagonalCurvature with estimation_mode='ggn_exact' and kfacx.Full blocks "
    "(layer_tag_to_block_ctor) gives the exact block-diagonal curvature; jax.hessian the "
    "whole matrix",
)
ImplicitExactCurvature = unsupported_class(
    "ImplicitExactCurvature",
    "kfacx.BlockDiagonalCurvature.linearized_losses gives the exact Gauss-Newton products "
    "(jvp of the network, the loss's Hessian, vjp)",
)
OptaxPreconditioner = unsupported_class(
    "OptaxPreconditioner", "use kfacx.scale_by_kfac, an optax transformation"
)
OptaxPreconditionState = unsupported_class(
    "OptaxPreconditionState", "kfacx.scale_by_kfac's state is kfacx.ScaleByKfacState"
)
