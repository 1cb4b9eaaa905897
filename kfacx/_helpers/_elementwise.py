"""Elementwise maps a parameter passes through before its layer: the ``"map"`` step of a
parameter view (`kfacx._helpers._views`).

A learned per-feature query scaler ``x * (c * softplus(s))``, a log-scale
``x * exp(log_scale)``, a masked weight ``h @ (w * mask)`` or a weight scaled by a
constant ``h @ (2.0 * w)``: the layer's parameter is ``w = f(theta)`` for an elementwise
``f`` from a small closed set (`MAPS`) whose arguments besides ``theta`` are constants.
A view expression ``("map", name, args, e)`` applies the map ``name`` with the constant
``args`` to the array ``e`` builds. Its Jacobian is diagonal, ``D = diag(f'(theta))``,
which the blocks get with `jax.jvp` (`kfacx.blocks.MappedBlock`).

Constants must be static and hashable (they sit in a layer tag's metadata): Python
numbers, or arrays wrapped in `Const`. Nothing here imports the rest of kfacx.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def _integer_pow(x: Any, y: int) -> Any:
    return jax.lax.integer_pow(x, int(y))


#: The maps: ``name -> (function of the operand and the constant args, report label)``.
#: ``"sub"`` is ``x - c`` and ``"rsub"`` is ``c - x``; ``"integer_pow"`` takes its
#: exponent as its one argument.
MAPS: dict[str, tuple[Callable[..., Any], str]] = {
    "mul": (lambda x, c: x * c, "scaled"),
    "div": (lambda x, c: x / c, "scaled"),
    "neg": (lambda x: -x, "scaled"),
    "add": (lambda x, c: x + c, "shifted"),
    "sub": (lambda x, c: x - c, "shifted"),
    "rsub": (lambda x, c: c - x, "shifted"),
    "exp": (jnp.exp, "exp"),
    "logistic": (jax.nn.sigmoid, "sigmoid"),
    "softplus": (jax.nn.softplus, "softplus"),
    "square": (jnp.square, "squared"),
    "integer_pow": (_integer_pow, "power"),
}


class Const:
    """A constant array in a view expression: hashable (by its dtype, shape and bytes)
    and immutable, as tag metadata must be.

    Args:
      value: the array (copied, read-only).

    Example::

      Const(np.tril(np.ones((4, 4), np.float32)))
    """

    def __init__(self, value: Any):
        array = np.array(value)
        array.setflags(write=False)
        self.value = array
        digest = hashlib.sha1(array.tobytes())
        digest.update(f"{array.dtype.str}{array.shape}".encode())
        self._digest = digest.hexdigest()

    def __hash__(self) -> int:
        return hash(self._digest)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Const) and other._digest == self._digest

    def __repr__(self) -> str:
        return f"Const({self.value.dtype}{list(self.value.shape)}, {self._digest[:10]})"

    @property
    def has_zeros(self) -> bool:
        """Whether some entry is zero (a mask)."""
        return not bool(np.all(self.value != 0))


def constant(value: Any) -> Any:
    """``value`` as a view constant: a Python number for a scalar, else a `Const`."""
    array = np.asarray(value)
    if array.ndim == 0:
        return array.item()
    return Const(array)


def apply(name: str, args: tuple, x: Any) -> Any:
    """The map ``name`` with constant ``args`` applied to ``x`` (a JAX or NumPy array).

    Raises:
      ValueError: for a map that is not one of `MAPS`.
    """
    if name not in MAPS:
        raise ValueError(
            f"Unknown elementwise map {name!r} in a parameter view; known: {list(MAPS)}."
        )
    values = [a.value if isinstance(a, Const) else a for a in args]
    return MAPS[name][0](x, *values)


def label(name: str, args: tuple) -> str:
    """The report's word for a map: ``"masked"`` for a product with an array holding zeros,
    else `MAPS`'s label (``"scaled"``, ``"softplus"``, ...)."""
    if name == "mul" and any(isinstance(a, Const) and a.has_zeros for a in args):
        return "masked"
    return MAPS[name][1]


def describe(name: str, args: tuple, inner: str) -> str:
    """A readable form of the map applied to ``inner``, e.g. ``"softplus(s)"``,
    ``"w * 2.0"``."""
    shown = ["mask" if isinstance(a, Const) else f"{a:.6g}" for a in args]
    infix = {"mul": "*", "div": "/", "add": "+", "sub": "-"}
    if name in infix:
        return f"{inner} {infix[name]} {shown[0]}"
    if name == "rsub":
        return f"{shown[0]} - {inner}"
    if name == "neg":
        return f"-{inner}"
    if name == "integer_pow":
        return f"{inner}**{shown[0]}"
    return f"{name}({inner})"
