"""kfac-jax's small helpers and type aliases (``kfac_jax.utils.first_dim_is_size``, ...)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import jax

T = TypeVar("T")

Array = jax.Array
PRNGKey = jax.Array
Scalar = float | int
Numeric = Array | Scalar
Shape = tuple[int, ...]
DType = Any
PyTree = Any
ArrayTree = Any
TArrayTree = TypeVar("TArrayTree")
Params = Any
Batch = Any
FuncState = Any
FuncAux = Any
PyTreeDef = Any
FuncArgs = Sequence[Any]
FuncOuts = Any
Func = Callable[..., Any]
ValueFunc = Callable[..., Any]
ValueAndGradFunc = Callable[..., Any]
AssumedFuncOutput = Any
ScheduleType = Callable[[Any], Any] | Callable[[Any, Any], Any]


def tree_is_empty(obj: Any) -> bool:
    """Whether the pytree has no leaves."""
    return not jax.tree_util.tree_leaves(obj)


def first_dim_is_size(size: int, *args: Array) -> bool:
    """Whether every array's leading axis has length ``size``."""
    return all(arg.shape[0] == size for arg in args)


def default_batch_size_extractor(batch: Any) -> int:
    """The leading size of the batch's first leaf."""
    return jax.tree_util.tree_leaves(batch)[0].shape[0]


def to_tuple_or_repeat(x: Any, length: int) -> tuple[Any, ...]:
    """``x`` as a tuple of ``length`` (a scalar repeated).

    Raises:
      ValueError: for a sequence of another length.
    """
    if isinstance(x, (list, tuple)):
        if len(x) != length:
            raise ValueError(f"to_tuple_or_repeat: expected {length} values, got {len(x)}.")
        return tuple(x)
    return tuple(x for _ in range(length))


def filter_sequence(sequence: Sequence[T], remove: Sequence[T]) -> list[T]:
    """The elements of ``sequence`` not in ``remove``."""
    return [x for x in sequence if x not in remove]


def auto_scope_method(method: Callable[..., T]) -> Callable[..., T]:
    """Names the method's operations after the class and method in the jaxpr / profile
    (`jax.named_scope`)."""

    @functools.wraps(method)
    def wrapped(self, *args, **kwargs):
        with jax.named_scope(f"{type(self).__name__}_{method.__name__}"):
            return method(self, *args, **kwargs)

    return wrapped


def auto_scope_function(func: Callable[..., T]) -> Callable[..., T]:
    """Names the function's operations after it (`jax.named_scope`)."""

    @functools.wraps(func)
    def wrapped(*args, **kwargs):
        with jax.named_scope(func.__name__):
            return func(*args, **kwargs)

    return wrapped


def replace_char(original: str, new_str: str, index: int) -> str:
    """``original`` with the character at ``index`` replaced by ``new_str``."""
    return original[:index] + new_str + original[index + 1 :]


def call_func_with_conditional_kwargs(func: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``func(*args, **kwargs)`` with only the keyword arguments ``func`` accepts."""
    import inspect

    params = inspect.signature(func).parameters
    if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
        kwargs = {k: v for k, v in kwargs.items() if k in params}
    return func(*args, **kwargs)


def fake_element_from_iterator(iterator: Any) -> tuple[Any, Any]:
    """``(the first element, an iterator that yields it again then the rest)``."""
    import itertools

    first = next(iterator)
    return first, itertools.chain([first], iterator)


class Finalizable:
    """kfac-jax's base of objects set up once (``finalize``); kfacx objects set themselves
    up on first use, so `finalize` only records that it was called."""

    def __init__(
        self,
        forbid_setting_attributes_after_finalize: bool = True,
        excluded_attribute_names: Sequence[str] = (),
    ):
        del forbid_setting_attributes_after_finalize, excluded_attribute_names
        self._finalized = False

    @property
    def finalized(self) -> bool:
        return getattr(self, "_finalized", False)

    def finalize(self, *args: Any, **kwargs: Any) -> None:
        """Calls ``_finalize`` once."""
        if not self.finalized:
            self._finalize(*args, **kwargs)
        self._finalized = True

    def _finalize(self, *args: Any, **kwargs: Any) -> None:
        del args, kwargs
