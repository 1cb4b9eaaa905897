"""``kfac_jax.optimizer``: kfac-jax's `Optimizer`, served by `kfacx.Optimizer`.

The loss and gradient are ``value_and_grad_func``'s own, as in kfac-jax
(``use_func_gradients=True``: a custom derivative rule such as FermiNet's energy
gradient is used as it is), and the curvature statistics come from a pass of their own.

The constructor takes kfac-jax's arguments: the block table and graph patterns in
kfac-jax's terms (`kfacx.kfac_jax.curvature_estimator.kfacx_block_ctors`,
`kfacx.kfac_jax.tag_graph_matcher.detection_kwargs`), ``use_automatic_registration``,
``register_only_generic`` and ``patterns_to_skip``; the rest is `kfacx.Optimizer`'s,
which takes kfac-jax's names (and says what to do instead for the few it does not
take). `Optimizer.step` takes kfac-jax's positional order
``(params, state, rng, data_iterator, batch, ...)`` and returns kfac-jax's stats on
top of kfacx's: ``step`` counts the steps taken (kfacx's counts those before),
``batch_size``, ``aux`` averaged over the devices, and with
``include_norms_in_stats=True`` ``param_norm`` (of the new parameters).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp

from kfacx import optimizer as _kfacx_optimizer
from kfacx.kfac_jax._block_diagonal import kfacx_block_ctors
from kfacx.kfac_jax.tag_graph_matcher import detection_kwargs
from kfacx.kfac_jax.utils import _math
from kfacx.kfac_jax.utils._parallel import pmap_mean

__all__ = ["HAIKU_BIASES", "HAIKU_BIASES_AND_NORMS", "Optimizer"]

#: kfac-jax's regexes of Haiku's bias and norm parameter paths (for
#: ``regularized_parameters_path_exclusions``).
HAIKU_BIASES = (r"^.*[/]b$",)
HAIKU_BIASES_AND_NORMS = (r"^.*[/]b$", r"^.*[/](scale|offset)$")

#: kfac-jax's type of the function arguments a step takes (params, [state,] [rng,] batch).
FuncArgsVariants = tuple[Any, ...]

#: kfac-jax options about its own object model, which kfacx has no use for.
_IGNORED = ("forbid_setting_attributes_after_finalize", "modifiable_attribute_exceptions")


class Optimizer(_kfacx_optimizer.Optimizer):
    """kfac-jax's optimizer (see the module docstring); everything else is
    `kfacx.Optimizer`."""

    State = _kfacx_optimizer.OptimizerState

    def __init__(
        self,
        value_and_grad_func: Callable[..., Any],
        l2_reg: float = 0.0,
        *,
        layer_tag_to_block_ctor: Any = None,
        auto_register_kwargs: Any = None,
        use_automatic_registration: bool = True,
        register_only_generic: bool = False,
        patterns_to_skip: Any = (),
        include_norms_in_stats: bool = False,
        use_func_gradients: bool = True,
        **kwargs: Any,
    ):
        for name in _IGNORED:
            kwargs.pop(name, None)
        detection = dict(auto_register_kwargs or {})
        detection.setdefault("patterns_to_skip", patterns_to_skip)
        detection.setdefault("register_only_generic", register_only_generic)
        super().__init__(
            value_and_grad_func,
            l2_reg,
            layer_tag_to_block_ctor=kfacx_block_ctors(layer_tag_to_block_ctor),
            auto_register_kwargs=detection_kwargs(detection),
            auto_register_tags=use_automatic_registration,
            use_func_gradients=use_func_gradients,
            **kwargs,
        )
        self._include_norms_in_stats = bool(include_norms_in_stats)
        self._param_norm = jax.jit(jax.vmap(_math.norm) if self.multi_device else _math.norm)

    def step(
        self,
        params: Any,
        state: Any,
        rng: jax.Array,
        data_iterator: Iterator[Any] | None = None,
        batch: Any = None,
        func_state: Any = None,
        learning_rate: Any = None,
        momentum: Any = None,
        damping: Any = None,
        global_step_int: int | None = None,
    ):
        """One step, with kfac-jax's argument order and stats (see the module docstring).

        Raises:
          ValueError: unless exactly one of ``data_iterator`` and ``batch`` is given.
        """
        if (data_iterator is None) == (batch is None):
            raise ValueError("Optimizer.step: pass exactly one of data_iterator and batch.")
        learning_rate, momentum, damping = (
            self._per_step_value(v) for v in (learning_rate, momentum, damping)
        )
        out = super().step(
            params,
            state,
            rng,
            batch=batch,
            func_state=func_state,
            learning_rate=learning_rate,
            momentum=momentum,
            damping=damping,
            global_step_int=global_step_int,
            data_iterator=data_iterator,
        )
        *rest, stats = out
        return (*rest, self._kfac_jax_stats(stats, rest[0], batch))

    def _per_step_value(self, value: Any) -> Any:
        """kfac-jax takes a step's learning rate, momentum and damping replicated over the
        local devices with ``multi_device``; kfacx broadcasts one value to them."""
        if value is None or not self.multi_device or jnp.ndim(value) == 0:
            return value
        if jnp.shape(value)[0] != jax.local_device_count():
            raise ValueError(
                f"Optimizer.step: with multi_device=True a learning rate, momentum or damping "
                f"is a scalar or replicated over the {jax.local_device_count()} local devices "
                f"(kfac_jax.utils.replicate_all_local_devices); got shape {jnp.shape(value)}."
            )
        return value[0]

    def _kfac_jax_stats(self, stats: dict, new_params: Any, batch: Any) -> dict:
        stats = dict(stats)
        stats["step"] = stats["step"] + 1
        if batch is not None:
            leaf = jax.tree_util.tree_leaves(batch)[0]
            size = leaf.shape[0] * (leaf.shape[1] * jax.process_count() if self.multi_device else 1)
            stats["batch_size"] = jnp.full(jnp.shape(stats["loss"]), size, jnp.int32)
        if "aux" in stats and self.multi_device:
            stats["aux"] = pmap_mean(stats["aux"])
        if self._include_norms_in_stats:
            stats["param_norm"] = self._param_norm(new_params)
        else:
            for key in ("grad_norm", "precon_grad_norm", "update_norm"):
                stats.pop(key, None)
        return stats
