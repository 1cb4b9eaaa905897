"""``kfac_jax.curvature_estimator``: kfac-jax's estimators, on kfacx's.

* `BlockDiagonalCurvature` and the default block of each layer variant
  (`get_default_tag_to_block_ctor`, `set_default_tag_to_block_ctor`, ...):
  `kfacx.kfac_jax._block_diagonal`;
* `ImplicitExactCurvature` and `ExplicitExactCurvature`: `kfacx.kfac_jax._exact`;
* `OptaxPreconditioner`: `kfacx.kfac_jax._optax`.
"""

from __future__ import annotations

from typing import TypeVar

from kfacx.kfac_jax._block_diagonal import (
    BlockDiagonalCurvature,
    get_default_tag_to_block_ctor,
    kfacx_block_ctors,
    set_default_tag_to_block_ctor,
    set_multi_default_tag_to_block_ctor,
)
from kfacx.kfac_jax._exact import ExplicitExactCurvature, ImplicitExactCurvature
from kfacx.kfac_jax._optax import OptaxPreconditioner, OptaxPreconditionState
from kfacx.kfac_jax._unsupported import unsupported_class

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

_ESTIMATOR = "use kfacx.BlockDiagonalCurvature (kfacx.kfac_jax.BlockDiagonalCurvature)"
CurvatureEstimator = unsupported_class("CurvatureEstimator", _ESTIMATOR)
