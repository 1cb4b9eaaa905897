"""Weight decay in `kfacx.Optimizer`'s step: ``l2_reg`` and the parameters it leaves out
(``regularized_parameters_path_exclusions``).

``l2_reg`` is the coefficient of a regularizer ``0.5 * l2_reg * |theta_R|^2``,
``theta_R`` the *regularized* parameters: all of them, or those whose path (as kfacx
writes it in messages and reports, e.g. ``"mlp/~/linear_0/b"``,
``"params/Dense_0/bias"``) no exclusion pattern matches (`re.search`).

As in kfac-jax, the user's loss contains the regularizer (``added=False``): ``l2_reg``
tells the optimizer its curvature, which enters the quadratic model (`masked_norms`)
and the preconditioner's damping of the blocks with a regularized parameter
(`block_flags`). With ``added=True`` (``add_l2_reg``) the optimizer adds the term
itself: to the gradient (`add_to_gradient`) and to the actual change of the objective
behind the reduction ratio (`penalty_change`) as well.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kfacx._helpers import _checks
from kfacx._helpers._paths import path_to_str
from kfacx._helpers._tree import tree_axpy, tree_dot
from kfacx.optimizer._quadratic_model import direction_norms


@dataclasses.dataclass(frozen=True)
class Regularization:
    """``l2_reg`` and its exclusion patterns.

    Attributes:
      l2_reg: the regularizer's coefficient.
      exclusions: regular expressions; a parameter whose path one of them matches
        (`re.search`) is not regularized.
      added: whether the optimizer adds the regularizer to the loss (else the loss
        already contains it).

    Raises:
      TypeError: if ``l2_reg`` is not a number, ``added`` not a bool, or
        ``exclusions`` is a string or holds a non-string.
      ValueError: for a negative or non-finite ``l2_reg``, or a pattern that is not a
        regular expression.
    """

    l2_reg: float
    exclusions: tuple[str, ...] = ()
    added: bool = False

    def __post_init__(self):
        if not _checks.is_number(self.l2_reg):
            raise TypeError(f"l2_reg must be a number, e.g. 1e-5; got {self.l2_reg!r}.")
        if not 0 <= float(self.l2_reg) < math.inf:
            raise ValueError(f"l2_reg must be >= 0 and finite, got {self.l2_reg}.")
        object.__setattr__(self, "l2_reg", float(self.l2_reg))
        if not isinstance(self.added, (bool, np.bool_)):
            raise TypeError(
                f"add_l2_reg must be True or False, got {self.added!r} (True: the optimizer "
                "adds l2_reg's term to the loss; False: the loss already has it)."
            )
        patterns = self.exclusions
        if isinstance(patterns, (str, bytes)) or not isinstance(patterns, Sequence):
            raise TypeError(
                "regularized_parameters_path_exclusions must be a sequence of regular "
                f"expressions, e.g. (r'/b$', 'norm'); got {patterns!r}."
            )
        for p in patterns:
            if not isinstance(p, str):
                raise TypeError(
                    f"regularized_parameters_path_exclusions: {p!r} is not a string (a regular "
                    "expression matched against parameter paths)."
                )
            try:
                re.compile(p)
            except re.error as e:
                raise ValueError(
                    f"regularized_parameters_path_exclusions: {p!r} is not a regular "
                    f"expression ({e})."
                ) from None
        object.__setattr__(self, "exclusions", tuple(patterns))

    def leaf_mask(self, params: Any) -> tuple[bool, ...] | None:
        """Per leaf of ``params``: whether it is regularized; None when all are (no
        exclusions, or no ``l2_reg``).

        Raises:
          ValueError: for a pattern that matches no parameter path (naming the paths).
        """
        if not self.exclusions:
            return None
        paths = [path_to_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
        for pattern in self.exclusions:
            if not any(re.search(pattern, path) for path in paths):
                raise ValueError(
                    f"regularized_parameters_path_exclusions: {pattern!r} matches no parameter "
                    f"(re.search on the paths {paths}). Fix the pattern or remove it."
                )
        if not self.l2_reg:
            return None
        return tuple(not any(re.search(p, path) for p in self.exclusions) for path in paths)

    def add_to_gradient(self, grads: Any, params: Any, mask: tuple[bool, ...] | None) -> Any:
        """``grads + l2_reg * theta_R`` when the term is ``added`` (else ``grads``)."""
        if not (self.l2_reg and self.added):
            return grads
        if mask is None:
            return tree_axpy(self.l2_reg, params, grads)
        g, treedef = jax.tree.flatten(grads)
        p = treedef.flatten_up_to(params)
        out = [
            (self.l2_reg * x + y).astype(y.dtype) if m else y
            for x, y, m in zip(p, g, mask, strict=True)
        ]
        return jax.tree.unflatten(treedef, out)

    def penalty_change(self, new: Any, old: Any, mask: tuple[bool, ...] | None) -> jax.Array:
        """``0.5 l2_reg (|new_R|^2 - |old_R|^2)`` when the term is ``added`` (else 0: the
        loss already contains it)."""
        if not (self.l2_reg and self.added):
            return jnp.zeros((), jnp.float32)
        new, old = _regularized(new, mask), _regularized(old, mask)
        return 0.5 * self.l2_reg * (tree_dot(new, new) - tree_dot(old, old))

    def masked_norms(self, precon: Any, velocity: Any, mask: tuple[bool, ...]) -> jax.Array:
        """``l2_reg`` times `kfacx.optimizer._quadratic_model.direction_norms` of the directions'
        regularized leaves: the regularizer's curvature in the quadratic model."""
        regularized = _regularized(precon, mask), _regularized(velocity, mask)
        if not regularized[0]:
            return jnp.zeros((2, 2), jnp.float32)
        return self.l2_reg * direction_norms(*regularized)

    def block_flags(self, estimator: Any, params: Any, mask: tuple[bool, ...]) -> tuple[bool, ...]:
        """Per curvature block of ``estimator``: whether it has a regularized parameter."""
        tree = jax.tree.unflatten(jax.tree.structure(params), list(mask))
        return tuple(any(flags) for flags in estimator.params_to_blocks(tree))


def _regularized(tree: Any, mask: tuple[bool, ...] | None) -> list[Any]:
    leaves = jax.tree.leaves(tree)
    return leaves if mask is None else [x for x, m in zip(leaves, mask, strict=True) if m]
