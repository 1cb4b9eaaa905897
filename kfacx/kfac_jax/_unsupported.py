"""Stand-ins for the kfac-jax names that kfacx does not serve: each raises
`NotImplementedError` saying what to use in kfacx instead, when it is called,
instantiated or subclassed (not when it is imported, so a port imports cleanly and
fails only on the line that needs the missing piece)."""

from __future__ import annotations

from typing import Any


def _message(name: str, instead: str) -> str:
    return f"kfac_jax.{name} is not served by kfacx.kfac_jax: {instead}"


def unsupported(name: str, instead: str) -> Any:
    """A function that raises `NotImplementedError` naming ``instead``."""
    message = _message(name, instead)

    def stub(*args: Any, **kwargs: Any) -> Any:
        del args, kwargs
        raise NotImplementedError(message)

    stub.__name__ = stub.__qualname__ = name.rsplit(".", 1)[-1]
    stub.__doc__ = message
    stub.kfacx_unsupported = message  # type: ignore[attr-defined]
    return stub


def unsupported_class(name: str, instead: str) -> type:
    """A class that raises `NotImplementedError` naming ``instead`` when instantiated or
    subclassed. It can be subscripted (``CurvatureEstimator[StateType]`` in a
    signature, as kfac-jax's generic classes are), so that code merely naming it in an
    annotation imports."""
    message = _message(name, instead)

    def init_subclass(cls, **kwargs: Any) -> None:
        del cls, kwargs
        raise NotImplementedError(message)

    def new(cls, *args: Any, **kwargs: Any) -> Any:
        del cls, args, kwargs
        raise NotImplementedError(message)

    def class_getitem(cls, params: Any) -> type:
        del params
        return cls

    return type(
        name.rsplit(".", 1)[-1],
        (),
        {
            "__doc__": message,
            "__init_subclass__": classmethod(init_subclass),
            "__class_getitem__": classmethod(class_getitem),
            "__new__": new,
            "kfacx_unsupported": message,
        },
    )
