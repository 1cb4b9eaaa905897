"""kfac-jax's state classes: `State`, `register_state_class` and the mutable
`WeightedMovingAverage` that kfac-jax blocks update in place.

kfacx keeps its own state as immutable NamedTuples (`kfacx.blocks.BlockState`); the
classes here exist so that blocks written against kfac-jax, which build and mutate
these dataclasses inside a pure function, run unchanged. `kfacx.kfac_jax` converts them
to and from kfacx's state at the block boundary (`kfacx.kfac_jax._hosting`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp

StateType = TypeVar("StateType", bound="State")

#: Every class made with `register_state_class`, by qualified name (kfac-jax's
#: deserialisation looks classes up here).
STATE_CLASSES_SERIALIZATION_DICT: dict[str, type] = {}


class State:
    """Base of kfac-jax's state dataclasses (a pytree whose children are its fields)."""

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """The dataclass field names, in order."""
        return tuple(f.name for f in dataclasses.fields(cls))  # type: ignore[arg-type]

    @classmethod
    def field_types(cls) -> dict[str, Any]:
        """The dataclass field types, by name."""
        return {f.name: f.type for f in dataclasses.fields(cls)}  # type: ignore[arg-type]

    @property
    def field_values(self) -> tuple[Any, ...]:
        """The field values, in order."""
        return tuple(getattr(self, name) for name in self.field_names())

    def copy(self: StateType) -> StateType:
        """A copy of the pytree structure (the arrays are shared, not copied)."""
        leaves, treedef = jax.tree_util.tree_flatten(self)
        return jax.tree_util.tree_unflatten(treedef, leaves)

    def tree_flatten(self) -> tuple[tuple[Any, ...], tuple[str, ...]]:
        return self.field_values, self.field_names()

    @classmethod
    def tree_unflatten(cls, names: tuple[str, ...], children: tuple[Any, ...]):
        return cls(**dict(zip(names, children, strict=True)))

    def to_dict(self) -> dict[str, Any]:
        """The fields as a dict (nested states stay objects)."""
        return dict(zip(self.field_names(), self.field_values, strict=True))


def register_state_class(class_type: type) -> type:
    """`dataclasses.dataclass` that also registers the class as a pytree (kfac-jax's).

    Raises:
      TypeError: if the class does not derive from `State`.
    """
    if not (isinstance(class_type, type) and issubclass(class_type, State)):
        raise TypeError(f"register_state_class: {class_type!r} must subclass kfac_jax.utils.State.")
    class_type = dataclasses.dataclass(class_type)
    class_type = jax.tree_util.register_pytree_node_class(class_type)
    STATE_CLASSES_SERIALIZATION_DICT[f"{class_type.__module__}.{class_type.__qualname__}"] = (
        class_type
    )
    return class_type


def default_add_function(obj1: Any, obj2: Any, coeff1: Any, coeff2: Any) -> Any:
    """``coeff1 * obj1 + coeff2 * obj2`` leaf by leaf."""
    return jax.tree_util.tree_map(lambda x, y: coeff1 * x + coeff2 * y, obj1, obj2)


@register_state_class
class WeightedMovingAverage(State):
    """kfac-jax's moving average: ``value`` is the average itself (bias-corrected),
    ``weight`` the total weight folded in so far. `update` mutates the object in place,
    as kfac-jax's does (blocks call it and ignore the result).

    It is the same average as `kfacx.blocks.WeightedMovingAverage`, which keeps the
    unnormalised sum instead: ``raw_value == value * weight``.
    """

    weight: Any
    value: Any

    @property
    def ndim(self) -> int:
        return self.value.ndim

    @property
    def shape(self) -> tuple[int, ...]:
        return self.value.shape

    @property
    def dtype(self) -> Any:
        return self.value.dtype

    @property
    def raw_value(self) -> Any:
        """``value * weight`` (kfacx's representation)."""
        return jax.tree_util.tree_map(lambda v: v * self.weight, self.value)

    def update(
        self,
        value: Any,
        old_weight_multiplier: Any,
        new_weight: Any,
        add_function: Callable[..., Any] = default_add_function,
    ) -> None:
        """Folds ``value`` in with weight ``new_weight`` after multiplying the old weight by
        ``old_weight_multiplier``. A negative ``new_weight`` adds ``-new_weight * value``
        without counting it in the weight (a sum rather than an average), as kfac-jax."""
        self.weight = old_weight_multiplier * self.weight + jax.nn.relu(new_weight)
        safe = jnp.where(self.weight == 0, 1.0, self.weight)
        eta_old = jax.nn.relu(new_weight) / safe
        eta_new = jnp.abs(new_weight) / safe
        self.value = add_function(self.value, value, 1.0 - eta_old, eta_new)

    def sync(self, pmap_axis_name: str | None) -> None:
        """Averages the value over ``pmap_axis_name`` (when inside that pmap)."""
        from kfacx.kfac_jax.utils._parallel import pmean_if_pmap

        self.value = pmean_if_pmap(self.value, pmap_axis_name)

    def clear(self, value_to_none: bool = False) -> None:
        """Resets the average to zero weight (and zero or None value)."""
        self.weight = jnp.zeros_like(self.weight)
        self.value = None if value_to_none else jax.tree_util.tree_map(jnp.zeros_like, self.value)

    def value_and_clear(self) -> Any:
        """The value, then `clear`."""
        value = self.value
        self.clear()
        return value

    @classmethod
    def zeros_array(cls, shape: Any, dtype: Any = None) -> WeightedMovingAverage:
        """An average of one array of zeros."""
        return cls(weight=jnp.zeros([], dtype=dtype), value=jnp.zeros(shape, dtype=dtype))

    @classmethod
    def zeros_like(cls, value: Any) -> WeightedMovingAverage:
        """An average of zeros shaped like the pytree ``value``."""
        leaves = jax.tree_util.tree_leaves(value)
        dtype = leaves[0].dtype if leaves else jnp.float32
        return cls(
            weight=jnp.zeros([], dtype=dtype), value=jax.tree_util.tree_map(jnp.zeros_like, value)
        )
