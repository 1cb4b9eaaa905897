"""Validation of what users hand to kfacx: options and schedules (of `kfacx.Optimizer`,
its configs and `kfacx.scale_by_kfac`), parameters, batches, step values and optimizer
states. Every check runs in Python or at trace time, never per compiled step; the
per-step guard is the finite check of the step (`kfacx.optimizer._step.guard_non_finite`).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.extend as jex
import jax.numpy as jnp
import numpy as np

from kfacx._helpers import _jaxpr
from kfacx._helpers._paths import check_float_params, path_to_str

Schedule = Callable[[jax.Array], Any]


def check_int(value: Any, name: str, minimum: int) -> int:
    """Returns ``value`` if it is an int (not a bool) ``>= minimum``.

    Raises:
      ValueError: naming the option and the value.
    """
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}.")
    return value


def check_ema(value: Any) -> float:
    """Returns the moving-average weight ``curvature_ema`` as a float in ``[0, 1)``.

    Raises:
      ValueError: naming the value.
    """
    if not 0.0 <= float(value) < 1.0:
        raise ValueError(f"curvature_ema must be in [0, 1), got {value!r}.")
    return float(value)


def as_schedule(value: float | Schedule | None, name: str) -> Schedule | None:
    """A schedule ``step -> value`` from a number or a schedule (None stays None).

    Raises:
      TypeError: naming the option, if ``value`` is neither a number nor callable.
    """
    if value is None or callable(value):
        return value
    try:
        constant = float(value)
    except (TypeError, ValueError):
        raise TypeError(
            f"{name} must be a number or a schedule (step -> value), got {value!r}."
        ) from None
    return lambda step: constant


def check_damping(value: Any, what: str, allow_zero: bool) -> None:
    """Rejects a concrete non-finite or non-positive damping (traced values pass)."""
    if isinstance(value, jax.core.Tracer):
        return
    arr = np.asarray(value)
    if arr.size != 1:
        raise ValueError(f"{what}: identity_weight must be a scalar, got shape {arr.shape}.")
    v = float(arr)
    if not math.isfinite(v) or v < 0 or (v == 0 and not allow_zero):
        raise ValueError(
            f"{what}: identity_weight (damping) must be finite and positive for inverse powers, "
            f"got {v}. Use a damping such as 1e-3."
        )


def block_ctors(ctors: Mapping[str, Any] | None) -> dict[str, Any]:
    """``layer_tag_to_block_ctor`` as a dict, every value checked to be callable.

    Raises:
      TypeError: naming the tag whose value is not a block class or factory.
    """
    for name, ctor in (ctors or {}).items():
        if not callable(ctor):
            raise TypeError(
                f"layer_tag_to_block_ctor[{name!r}] must be a block class or factory, got {ctor!r}."
            )
    return dict(ctors or {})


def auto_register_kwargs(kwargs: Mapping[str, Any] | None, on_unmatched: Sequence[str]) -> dict:
    """``auto_register_kwargs`` as a dict, checked: only ``graph_patterns`` and
    ``on_unmatched`` (one of ``on_unmatched``).

    Raises:
      ValueError: naming an unknown key or a bad ``on_unmatched``.
    """
    kwargs = dict(kwargs or {})
    unknown = set(kwargs) - {"graph_patterns", "on_unmatched"}
    if unknown:
        raise ValueError(
            f"auto_register_kwargs has unknown keys {sorted(unknown)}; "
            "expected graph_patterns and/or on_unmatched."
        )
    if kwargs.get("on_unmatched", "warn") not in on_unmatched:
        raise ValueError(
            f"auto_register_kwargs: on_unmatched={kwargs['on_unmatched']!r}; choose one of "
            f"{on_unmatched}."
        )
    return kwargs


def all_finite(tree: Any) -> jax.Array:
    """Whether every floating-point leaf of ``tree`` is finite (other leaves pass), as one
    boolean scalar.

    Each leaf is checked as ``sum(x * 0)`` (NaN exactly when an entry is NaN or
    infinite), which XLA compiles much faster than ``all(isfinite(x))``. The flag is
    ``isfinite(exp(total))``: ``exp`` is among the operations XLA will not duplicate
    into several kernels, so the flag is computed once. Without it XLA fuses the
    whole scalar sum (one parameter per leaf) into every kernel that reads the flag:
    the optimizer's guard selects each large state leaf with it, and the deep
    autoencoder's step held 24 such selects of up to 40 parameters each (9 % of the
    step's LLVM IR).
    """
    sums = [
        jnp.sum(x * jnp.zeros((), x.dtype)).astype(jnp.float32)
        for x in jax.tree.leaves(tree)
        if jnp.issubdtype(jnp.result_type(x), jnp.inexact)
    ]
    if not sums:
        return jnp.asarray(True)
    return jnp.isfinite(jnp.exp(sum(sums)))


def check_init_args(params: Any, batch: Any, example_axis: int) -> None:
    """Rejects non-float parameters and empty batches before anything is traced.

    Args:
      params: the parameters.
      batch: the batch.
      example_axis: the axis of the examples (1 with a leading device axis).

    Raises:
      TypeError: naming the first parameter that is not floating-point.
      ValueError: naming the first batch array with no examples.
    """
    path_leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    check_float_params([path_to_str(p) for p, _ in path_leaves], [x for _, x in path_leaves])
    check_batch(batch, example_axis)


def check_batch(batch: Any, example_axis: int = 0) -> None:
    """Rejects a batch with an array whose example axis has length 0.

    Raises:
      ValueError: naming the array, e.g. ``batch[0]``.
    """
    for path, leaf in jax.tree_util.tree_flatten_with_path(batch)[0]:
        shape = np.shape(leaf)
        if len(shape) > example_axis and shape[example_axis] == 0:
            raise ValueError(
                f"batch{jax.tree_util.keystr(path)} has shape {shape}: the batch is empty (no "
                "examples along axis "
                f"{example_axis}), so there is no loss, gradient or curvature to estimate. Skip "
                "empty batches, or pad them with examples masked out by example_mask_extractor."
            )


def check_step_values(**values: Any) -> None:
    """Rejects concrete non-finite step values and a damping that is not positive.

    Only Python and NumPy numbers are checked (reading a `jax.Array` would wait
    for the device); a step with a bad `jax.Array` or traced value is skipped.

    Raises:
      ValueError: naming the argument and the value; also for a value that is not a
        scalar (one value serves every device of a ``multi_device`` step).
    """
    for name, value in values.items():
        if value is not None and np.ndim(value) != 0:
            raise ValueError(
                f"step({name}=...): {name} must be a scalar, got shape {np.shape(value)}. With "
                "multi_device=True one value serves every device: pass it once, not replicated."
            )
        if not isinstance(value, (int, float, np.ndarray, np.generic)):
            continue
        arr = np.asarray(value, np.float64)
        if name == "damping" and not np.all(arr > 0):  # also catches NaN
            raise ValueError(
                f"step(damping={value!r}): the damping must be finite and > 0; it is added to "
                "the curvature before the inversion. Use e.g. damping=1e-3."
            )
        if not np.all(np.isfinite(arr)):
            raise ValueError(f"step({name}={value!r}): {name} must be finite.")


def unused_params(loss_fn: Callable[..., Any], args: Sequence[Any]) -> list[str]:
    """Paths of the parameters (``args[0]``) the value of ``loss_fn(*args)`` does not use."""
    path_leaves, tree = jax.tree_util.tree_flatten_with_path(args[0])

    def of_leaves(leaves, rest):
        return loss_fn(jax.tree_util.tree_unflatten(tree, leaves), *rest)

    # The other arguments are traced too (not closed over): they may be shapes only
    # (`jax.ShapeDtypeStruct`); the parameters' leaves come first among the inputs.
    leaves = [x for _, x in path_leaves]
    closed = _jaxpr.dce(jax.make_jaxpr(of_leaves)(leaves, tuple(args[1:])))
    used = {v for e in closed.jaxpr.eqns for v in e.invars if isinstance(v, jex.core.Var)}
    used |= {v for v in closed.jaxpr.outvars if isinstance(v, jex.core.Var)}
    return [
        path_to_str(p)
        for (p, _), v in zip(path_leaves, closed.jaxpr.invars[: len(leaves)], strict=True)
        if v not in used
    ]


def warn_unused_params(loss_fn: Callable[..., Any], args: Sequence[Any]) -> None:
    """Warns, naming them, about parameters the loss does not use."""
    unused = unused_params(loss_fn, args)
    if unused:
        warnings.warn(
            f"kfacx: parameters {unused} are not used by the loss: their gradient is zero and "
            "the optimizer leaves them unchanged (except for the l2_reg term with "
            "add_l2_reg=True). Remove them from the parameters if this is not intended.",
            stacklevel=4,
        )


def check_state(state: Any, expected: Any, block_names: Sequence[str]) -> None:
    """Rejects an optimizer state whose structure, shapes or dtypes differ from
    ``expected`` (`jax.eval_shape` of the state `init` makes for these arguments).

    Raises:
      ValueError: naming the first mismatching state leaf (and its block), saying
        that the state belongs to another model.
    """
    if type(state) is not type(expected):
        raise ValueError(
            f"state is a {type(state).__name__}, not the {type(expected).__name__} that "
            "optimizer.init returns. A checkpoint restored without a template gives plain dicts: "
            "restore it into one, e.g. checkpointer.restore(path, optimizer.init(params, rng, "
            "batch))."
        )
    got = dict(jax.tree_util.tree_flatten_with_path(state)[0])
    want = jax.tree_util.tree_flatten_with_path(expected)[0]
    for path, spec in want:
        name = _leaf_name(path, block_names)
        if path not in got:
            raise _state_error(f"{name} is missing")
        leaf = got.pop(path)
        shape, dtype = np.shape(leaf), jnp.result_type(leaf)
        if shape != spec.shape or dtype != spec.dtype:
            raise _state_error(
                f"{name} has shape {shape} and dtype {dtype}, but this model needs "
                f"{spec.shape} and {spec.dtype}"
            )
    if got:
        raise _state_error(f"{_leaf_name(next(iter(got)), block_names)} is not in this model")


def _leaf_name(path: Any, block_names: Sequence[str]) -> str:
    name = "state" + jax.tree_util.keystr(path)
    if len(path) > 2 and getattr(path[0], "name", None) == "estimator_state":
        index = getattr(path[2], "idx", None)
        if index is not None and index < len(block_names):
            name += f" (block {index}: {block_names[index]})"
    return name


def _state_error(what: str) -> ValueError:
    return ValueError(
        f"The optimizer state does not belong to this model: {what}. It was made for another "
        "model (other layers or widths), other params or another optimizer configuration. "
        "Create the state with optimizer.init(params, rng, batch) for these params, or restore "
        "this model's checkpoint into a template made by optimizer.init."
    )


def is_number(value: Any) -> bool:
    """A real Python or NumPy number (not a bool, not an array)."""
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


def is_traced(value: Any) -> bool:
    """Whether ``value`` is traced (e.g. a hyperparameter of `optax.inject_hyperparams`)."""
    return isinstance(value, jax.core.Tracer)


def is_eager() -> bool:
    """Whether JAX operations run eagerly here (no `jax.jit`, `jax.vmap`, ... around):
    each operation then compiles a program of its own for every new shape."""
    return type(jex.core.find_top_trace(())).__name__ == "EvalTrace"
