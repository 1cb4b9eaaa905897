"""``kfac_jax.curvature_blocks``: kfac-jax's block classes.

Two kinds of names live here:

* **the protocol** (`CurvatureBlock`, `KroneckerFactored`, `DenseTwoKroneckerFactored`,
  `RepeatedDenseKroneckerFactored`): kfac-jax's abstract block and its Kronecker
  family, to subclass. A subclass runs inside kfacx's estimator through
  `kfacx.kfac_jax._blocks._hosting.HostedBlock`.
* **built-in blocks used as they are** in ``layer_tag_to_block_ctor``
  (`DenseTwoKroneckerFactored`, `Conv2DTwoKroneckerFactored`, the diagonal, full and
  TNT blocks, ...): kfacx serves those with its own block
  (`kfacx.DenseTwoKroneckerFactored`, ...), which batches the inverse refresh across
  layers. Those without a protocol implementation here cannot be subclassed: the
  error says which kfacx block to subclass instead.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from kfacx import blocks as _kfacx_blocks
from kfacx.kfac_jax._blocks._block import CurvatureBlock
from kfacx.kfac_jax._blocks._hosting import HostedBlock, hosted_ctor
from kfacx.kfac_jax._blocks._kronecker import (
    DenseTwoKroneckerFactored,
    KroneckerFactored,
    RepeatedDenseKroneckerFactored,
)
from kfacx.kfac_jax._unsupported import unsupported_class

__all__ = [
    "Conv2DDiagonal",
    "Conv2DFull",
    "Conv2DTNT",
    "Conv2DTwoKroneckerFactored",
    "CurvatureBlock",
    "DenseDiagonal",
    "DenseFull",
    "DenseTNT",
    "DenseTwoKroneckerFactored",
    "Diagonal",
    "Full",
    "HostedBlock",
    "KroneckerFactored",
    "NaiveDiagonal",
    "NaiveFull",
    "NaiveTNT",
    "RepeatedDenseKroneckerFactored",
    "ScaleAndShiftDiagonal",
    "ScaleAndShiftFull",
    "ScaledIdentity",
    "get_default_eigen_decomposition_threshold",
    "get_max_parallel_elements",
    "kfacx_block_ctor",
    "set_default_eigen_decomposition_threshold",
    "set_max_parallel_elements",
]

#: kfac-jax block classes served, when used as they are, by a kfacx block.
NATIVE: dict[type, Any] = {DenseTwoKroneckerFactored: _kfacx_blocks.DenseTwoKroneckerFactored}


def _native(name: str, kfacx_block: Any) -> type:
    """A kfac-jax block name served by ``kfacx_block`` (not subclassable here)."""
    message = (
        f"kfac_jax.{name} cannot be subclassed in kfacx.kfac_jax: kfacx serves it with "
        f"kfacx.blocks.{kfacx_block.__name__}. Subclass that (see docs/extending.md), or "
        "kfac_jax.KroneckerFactored / DenseTwoKroneckerFactored for a kfac-jax style block."
    )

    def init_subclass(cls, **kwargs: Any) -> None:
        del cls, kwargs
        raise NotImplementedError(message)

    def new(cls, layer_tag_eq: Any, *args: Any, **kwargs: Any) -> Any:
        del cls, args, kwargs
        return kfacx_block(layer_tag_eq)

    cls = type(
        name,
        (),
        {
            "__doc__": f"kfac-jax's ``{name}``, served by `kfacx.blocks.{kfacx_block.__name__}`.",
            "__init_subclass__": classmethod(init_subclass),
            "__new__": new,
        },
    )
    NATIVE[cls] = kfacx_block
    return cls


Diagonal = _native("Diagonal", _kfacx_blocks.Diagonal)
NaiveDiagonal = _native("NaiveDiagonal", _kfacx_blocks.Diagonal)
DenseDiagonal = _native("DenseDiagonal", _kfacx_blocks.Diagonal)
Conv2DDiagonal = _native("Conv2DDiagonal", _kfacx_blocks.Diagonal)
Full = _native("Full", _kfacx_blocks.Full)
NaiveFull = _native("NaiveFull", _kfacx_blocks.Full)
DenseFull = _native("DenseFull", _kfacx_blocks.Full)
Conv2DFull = _native("Conv2DFull", _kfacx_blocks.Full)
ScaleAndShiftDiagonal = _native("ScaleAndShiftDiagonal", _kfacx_blocks.ScaleAndShiftDiagonal)
ScaleAndShiftFull = _native("ScaleAndShiftFull", _kfacx_blocks.ScaleAndShiftFull)
Conv2DTwoKroneckerFactored = _native(
    "Conv2DTwoKroneckerFactored", _kfacx_blocks.ConvTwoKroneckerFactored
)
DenseTNT = _native("DenseTNT", _kfacx_blocks.DenseTNT)
Conv2DTNT = _native("Conv2DTNT", _kfacx_blocks.ConvTNT)
NaiveTNT = unsupported_class(
    "NaiveTNT", "kfacx serves TNT for dense and convolution layers (kfacx.DenseTNT, kfacx.ConvTNT)"
)


class ScaledIdentity(CurvatureBlock):
    """kfac-jax's block that takes a layer's curvature to be ``scale * I``: it keeps no
    statistics, and its products are ``(scale + identity_weight)^power v``. It runs
    hosted, as any kfac-jax block subclass does."""

    def __init__(self, layer_tag_eq: Any, scale: Any = 1.0):
        self._scale = scale
        super().__init__(layer_tag_eq)

    def fixed_scale(self) -> Any:
        return self._scale

    def _init(self, rng, exact_powers_to_cache, approx_powers_to_cache, cache_eigenvalues):
        del rng, exact_powers_to_cache, approx_powers_to_cache, cache_eigenvalues
        return CurvatureBlock.State(cache=None)

    def update_curvature_matrix_estimate(
        self, state, estimation_data, ema_old, ema_new, identity_weight, batch_size
    ):
        del estimation_data, ema_old, ema_new, identity_weight, batch_size
        return state

    def _multiply_matpower_unscaled(
        self, state, vector, identity_weight, power, exact_power, use_cached
    ):
        del exact_power
        factor = (self.state_dependent_scale(state) if use_cached else 1.0) + identity_weight
        factor = factor if power == 1 else 1.0 / factor if power == -1 else factor**power
        return tuple(factor * v for v in vector)

    def _eigenvalues_unscaled(self, state, use_cached):
        del state, use_cached
        return jnp.ones([self.dim], self.dtype)

    def _to_dense_unscaled(self, state):
        del state
        return jnp.eye(self.dim, dtype=self.dtype)

    def _norm_unscaled(self, state, norm_type):
        del state, norm_type
        return 1.0


def kfacx_block_ctor(ctor: Any) -> Any:
    """The kfacx block factory for a ``layer_tag_to_block_ctor`` value given in kfac-jax's
    terms: kfacx's own block for a built-in kfac-jax block used as it is, a
    `HostedBlock` for a kfac-jax block subclass, anything else unchanged (a kfacx block
    class or factory)."""
    if isinstance(ctor, type) and ctor in NATIVE:
        return NATIVE[ctor]
    return hosted_ctor(ctor) or ctor


_SETTINGS = {"max_parallel_elements": 2**23, "eigen_decomposition_threshold": 5}


def set_max_parallel_elements(value: int) -> None:
    """Taken for kfac-jax's API (kfacx vectorises per-example gradients as it needs)."""
    _SETTINGS["max_parallel_elements"] = int(value)


def get_max_parallel_elements() -> int:
    return _SETTINGS["max_parallel_elements"]


def set_default_eigen_decomposition_threshold(value: int) -> None:
    """Taken for kfac-jax's API (kfacx's blocks choose their decompositions themselves)."""
    _SETTINGS["eigen_decomposition_threshold"] = int(value)


def get_default_eigen_decomposition_threshold() -> int:
    return _SETTINGS["eigen_decomposition_threshold"]
