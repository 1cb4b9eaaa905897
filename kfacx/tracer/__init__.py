"""Tracing a tagged loss function: layer statistics and loss-output products.

`trace` turns ``func(*func_args)`` into a jaxpr once (per argument shapes) and
finds its layer and loss tags. `layer_tags_vjp` evaluates the jaxpr with a
zero perturbation added to every layer output; the vjp with respect to those
perturbations gives, for any cotangent of the registered losses' predictions,
the cotangent of every layer's outputs. `loss_tags_jvp` / `loss_tags_vjp`
give the Jacobian products of the loss predictions with respect to the
parameters (for Gauss-Newton-vector products).

Its wing: ``_layer_data`` (the layer inputs and output cotangents a block is
given), ``_layer_info`` (each tag's `kfacx.LayerInfo`), ``_tied_layers`` (tags
sharing parameters made one layer).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from kfacx import losses, tags
from kfacx._helpers import _jaxpr
from kfacx._helpers._paths import (
    checked_param_paths,
    param_leaf_range,
    param_origins,
    path_to_str,  # noqa: F401  (kfacx.tracer.path_to_str, as before)
)
from kfacx.blocks import LayerInfo
from kfacx.tracer import _layer_info, _tied_layers
from kfacx.tracer._layer_data import LayerTagsVjp


@dataclasses.dataclass(frozen=True, kw_only=True)
class TracedFunction:
    """A traced loss function: its jaxpr and the layer and loss tags found in it.

    Built by `trace`, with keywords only (no code depends on the order of the fields).

    Attributes:
      closed_jaxpr: the jaxpr of ``func(*func_args)``.
      in_tree: the pytree structure of ``func_args``.
      out_tree: the pytree structure of ``func``'s output.
      params_index: which positional argument holds the parameters.
      params_tree: the pytree structure of the parameters.
      param_paths: the path of every parameter leaf.
      layers: a `kfacx.blocks.LayerInfo` per layer tag, in evaluation order.
      layer_param_leaves: for every layer, the parameter-leaf indices of its params.
      use_to_layer: for every layer tag equation (a *use*), in evaluation order,
        the layer it belongs to. A layer whose parameters are shared (tied
        weights, the same layer applied twice) has several uses; its
        statistics fold the uses into the batch axis ("expand" K-FAC).
      use_outputs: for every use, ``(shape, dtype)`` of each output (for a use
        inside `lax.scan`s of lengths ``L1, L2...``: ``[L1, L2..., *per_iteration_shape]``).
      num_losses: number of loss tags.
      site_uses: for every tag equation (layer or loss) in evaluation order
        (`kfacx._helpers._jaxpr.tag_sites`), its use index, or None for a loss tag.
      use_scan_lengths: for every use, the lengths of the (nested) `lax.scan`s
        it sits in, outermost first (empty outside scans). A layer tag in scans
        is a *stacked* layer when one of them runs over its parameters
        (``LayerInfo.stack_size``), else a layer applied once per iteration with
        the same parameters; the iterations of the other scans are folded into
        the batch axis, as tied uses are.
      use_stacked_level: for every use, which of its scans runs over its
        parameters (an index into its ``use_scan_lengths``), or None.
      use_roles: for every use, its role in a tied layer (`LayerInfo.roles`:
        tags of different kinds that share parameters), else 0.
      use_conditional: for every use, whether it sits in a `lax.cond` /
        `lax.switch` branch (it runs only when the branch is taken).
    """

    closed_jaxpr: Any
    in_tree: Any
    out_tree: Any
    params_index: int
    params_tree: Any
    param_paths: tuple[str, ...]
    layers: tuple[LayerInfo, ...]
    layer_param_leaves: tuple[tuple[int, ...], ...]
    use_to_layer: tuple[int, ...]
    use_outputs: tuple[tuple[tuple[tuple[int, ...], Any], ...], ...]
    num_losses: int
    site_uses: tuple[int | None, ...] = ()
    use_scan_lengths: tuple[tuple[int, ...], ...] = ()
    use_stacked_level: tuple[int | None, ...] = ()
    use_roles: tuple[int, ...] = ()
    use_conditional: tuple[bool, ...] = ()

    @property
    def num_param_leaves(self) -> int:
        """Number of parameter leaves."""
        return len(self.param_paths)

    @property
    def conditional_layers(self) -> tuple[bool, ...]:
        """Per layer: whether every use of it sits in a cond branch, so that a batch
        may not run it (its statistics then carry a coverage, see `LayerTagsVjp`)."""
        out = [True] * len(self.layers)
        for layer, cond in zip(self.use_to_layer, self.use_conditional, strict=True):
            out[layer] = out[layer] and cond
        return tuple(out)

    def use_param_leaves(self, use: int) -> tuple[int, ...]:
        """The parameter leaves of one use (of its role, in a tied layer)."""
        layer = self.use_to_layer[use]
        leaves, info = self.layer_param_leaves[layer], self.layers[layer]
        if not info.roles:
            return leaves
        return tuple(leaves[i] for i in info.role_params[self.use_roles[use]])


def shape_key(func_args: Sequence[Any]) -> tuple:
    """A hashable key of the arguments' pytree structure, shapes and dtypes."""
    leaves, tree = jax.tree_util.tree_flatten(func_args)
    return tree, tuple((jnp.shape(x), jnp.result_type(x)) for x in leaves)


def trace(
    func: Callable[..., Any], func_args: Sequence[Any], params_index: int = 0
) -> TracedFunction:
    """Traces ``func(*func_args)`` and collects its tags.

    Args:
      func: the tagged loss function.
      func_args: its positional arguments (arrays or `jax.ShapeDtypeStruct`).
      params_index: the position of the parameters among ``func_args``.

    Returns:
      A `TracedFunction`.

    Raises:
      ValueError: if no loss is registered, a layer tag's parameter is not a
        leaf of the parameters, or a parameter is used by two layer tags.
    """
    func_args = tuple(func_args)
    if not 0 <= params_index < len(func_args):
        raise ValueError(
            f"params_index={params_index} is out of range for {len(func_args)} arguments."
        )
    closed, out_tree = _make_jaxpr(func, func_args)
    param_paths = checked_param_paths(func_args[params_index])
    uses = _Uses(param_paths)
    origins = param_origins(func_args, params_index, len(closed.jaxpr.invars))
    for site in _jaxpr.tag_sites(closed.jaxpr, origins):
        uses.add(site)
    if uses.num_losses == 0:
        raise ValueError(
            "The function registers no loss. Call e.g. kfacx.register_softmax_cross_entropy_loss("
            "logits, labels) on the model output inside the loss function."
        )
    return TracedFunction(
        closed_jaxpr=closed,
        in_tree=jax.tree_util.tree_structure(func_args),
        out_tree=out_tree,
        params_index=params_index,
        params_tree=jax.tree_util.tree_structure(func_args[params_index]),
        param_paths=param_paths,
        **uses.fields(),
    )


def _make_jaxpr(func: Callable[..., Any], func_args: tuple) -> tuple[Any, Any]:
    """``(closed jaxpr, output tree)`` of ``func`` on the shapes of ``func_args``, without
    the equations whose results are unused (`kfacx._helpers._jaxpr.dce`)."""
    specs = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), func_args
    )
    closed, out_shape = jax.make_jaxpr(func, return_shape=True)(*specs)
    return _jaxpr.dce(closed), jax.tree_util.tree_structure(out_shape)


@dataclasses.dataclass
class _Uses:
    """The layers and uses of the tag sites seen so far, as `TracedFunction` lists them."""

    param_paths: tuple[str, ...]
    layers: list[LayerInfo] = dataclasses.field(default_factory=list)
    layer_param_leaves: list[tuple[int, ...]] = dataclasses.field(default_factory=list)
    use_to_layer: list[int] = dataclasses.field(default_factory=list)
    use_outputs: list[tuple] = dataclasses.field(default_factory=list)
    num_losses: int = 0
    site_uses: list[int | None] = dataclasses.field(default_factory=list)
    use_scan_lengths: list[tuple[int, ...]] = dataclasses.field(default_factory=list)
    use_stacked_level: list[int | None] = dataclasses.field(default_factory=list)
    use_roles: list[int] = dataclasses.field(default_factory=list)
    use_conditional: list[bool] = dataclasses.field(default_factory=list)
    owner: dict[int, int] = dataclasses.field(default_factory=dict)  # parameter leaf -> layer

    def add(self, site: _jaxpr.TagSite) -> None:
        """Adds the next tag site (in evaluation order)."""
        tag = tags.layer_tag_for(site.eqn.primitive)
        if tag is not None:
            self._add_use(tag, site)
            return
        if site.scans or site.branches:
            where = "a `scan`" if site.scans else "a `cond` branch"
            raise _loss_in_loop_or_branch(site.eqn, where)
        self.num_losses += 1
        self.site_uses.append(None)

    def _add_use(self, tag: tags.LayerTag, site: _jaxpr.TagSite) -> None:
        eqn, ins = site.eqn, site.origins
        self.use_conditional.append(bool(site.branches))
        info, leaf_ids = _layer_info.layer_info(tag, eqn, ins, self.param_paths)
        info, lengths, level = _layer_info.scan_layer_info(info, tag.split(ins)[2], site.scans)
        outputs = tag.split(eqn.invars)[0]
        self.use_outputs.append(tuple((lengths + v.aval.shape, v.aval.dtype) for v in outputs))
        self.site_uses.append(len(self.use_to_layer))
        self.use_scan_lengths.append(lengths)
        self.use_stacked_level.append(level)
        layer, role = self._layer_of(info, leaf_ids)
        self.owner.update({leaf: layer for leaf in leaf_ids})
        self.use_to_layer.append(layer)
        self.use_roles.append(role)

    def _layer_of(self, info: LayerInfo, leaf_ids: tuple[int, ...]) -> tuple[int, int]:
        """``(layer, role)`` of a new use: the earlier layer it shares parameters with
        (`kfacx.tracer._tied_layers.join_layer`), else a new layer."""
        shared = {self.owner[leaf] for leaf in leaf_ids if leaf in self.owner}
        if shared:
            leaves_of = self.layer_param_leaves
            return _tied_layers.join_layer(shared, self.layers, leaves_of, info, leaf_ids)
        self.layers.append(info)
        self.layer_param_leaves.append(leaf_ids)
        return len(self.layers) - 1, 0

    def fields(self) -> dict[str, Any]:
        """The `TracedFunction` fields collected here."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        lists = {name: tuple(v) for name, v in values.items() if isinstance(v, list)}
        return dict(lists, num_losses=self.num_losses)


def _loss_in_loop_or_branch(eqn, where: str) -> ValueError:
    return ValueError(
        f"A loss tag ({eqn.primitive.name}) sits inside {where}; kfacx reads losses "
        "registered outside loops and branches only (layers may sit inside them). Register the "
        "loss on the outputs of the scan or cond, e.g. on the stacked per-step predictions or "
        "on the output of the branch taken."
    )


_TRACE_CACHE: collections.OrderedDict = collections.OrderedDict()
_TRACE_CACHE_SIZE = 64


def trace_cached(
    func: Callable[..., Any], func_args: Sequence[Any], params_index: int = 0
) -> TracedFunction:
    """`trace`, memoised on the function and the arguments' shapes and dtypes."""
    key = (func, params_index, shape_key(tuple(func_args)))
    if key not in _TRACE_CACHE:
        _TRACE_CACHE[key] = trace(func, func_args, params_index)
        while len(_TRACE_CACHE) > _TRACE_CACHE_SIZE:
            _TRACE_CACHE.popitem(last=False)
    _TRACE_CACHE.move_to_end(key)
    return _TRACE_CACHE[key]


# ----------------------------------------------------------------------------- evaluation


def _forward(traced: TracedFunction, flat_args: Sequence[Any], perturbations: Sequence[tuple]):
    """Evaluates the jaxpr; returns the loss predictions and, as aux, the tag data.

    Every layer use's outputs get ``perturbations[use]`` added (stacked ``[L, ...]``
    for a use inside a scan of length ``L``: iteration ``l`` adds slice ``l``);
    its record has the use's ``inputs`` and ``outputs`` (stacked likewise) and
    the layer's ``params`` (whole parameter leaves). A use inside a cond branch
    also has ``active``: 1 if its branch ran, else 0 (its data are then zeros).
    """

    def on_tag(eqn, invals, perturbation):
        layer_tag = tags.layer_tag_for(eqn.primitive)
        if layer_tag is None:
            return invals[:1], (eqn, tuple(invals))
        outputs, inputs, params = layer_tag.split(invals)
        axis = tags.stacked_input_axis(layer_tag.name, eqn.params, [jnp.shape(p) for p in params])
        if axis is not None:  # the slices' axis first, as for a layer stacked by a scan
            inputs = [jnp.moveaxis(inputs[0], axis, 0)]
        perturbed = [o + p for o, p in zip(outputs, perturbation, strict=True)]
        return perturbed, dict(inputs=inputs, outputs=outputs)

    closed = traced.closed_jaxpr
    site_inputs = [None if use is None else perturbations[use] for use in traced.site_uses]
    outputs, site_outputs, site_active = _jaxpr.eval_jaxpr_sites(
        closed.jaxpr, closed.consts, flat_args, on_tag, site_inputs
    )
    start = sum(c.num_leaves for c in traced.in_tree.children()[: traced.params_index])
    params = flat_args[start : start + traced.num_param_leaves]
    records: list[dict] = []
    loss_operands: list[tuple] = []
    for use, out, active in zip(traced.site_uses, site_outputs, site_active, strict=True):
        if use is None:
            loss_operands.append(out)
            continue
        leaves = traced.use_param_leaves(use)
        record = dict(out, params=tuple(params[i] for i in leaves))
        if active is not None:
            record["active"] = active
        records.append(record)
    predictions = tuple(ops[0] for _, ops in loss_operands)
    return predictions, (records, loss_operands, outputs)


def _make_losses(loss_operands, predictions) -> tuple[losses.LossFunction, ...]:
    return tuple(
        losses.loss_from_tag(tags.loss_tag_for(eqn.primitive), (pred, *ops[1:]), eqn.params)
        for (eqn, ops), pred in zip(loss_operands, predictions, strict=True)
    )


def _zero_perturbations(traced: TracedFunction) -> tuple:
    return tuple(tuple(jnp.zeros(s, d) for s, d in outs) for outs in traced.use_outputs)


def _use_roles(traced: TracedFunction) -> tuple[int | None, ...]:
    """Per use: its role if its layer is a tied one, else None."""
    return tuple(
        role if traced.layers[layer].roles else None
        for layer, role in zip(traced.use_to_layer, traced.use_roles, strict=True)
    )


def _use_scans(traced: TracedFunction) -> tuple[tuple[tuple[int, ...], int | None], ...]:
    """Per use: the lengths of the scans it sits in and the level of the one stacking it."""
    return tuple(zip(traced.use_scan_lengths, traced.use_stacked_level, strict=True))


def layer_tags_vjp(
    func: Callable[..., Any], func_args: Sequence[Any], params_index: int = 0
) -> tuple[tuple[losses.LossFunction, ...], LayerTagsVjp]:
    """Evaluates a tagged function; returns its losses and a vjp to the layer outputs.

    Args:
      func: a loss function with registered losses and layer tags.
      func_args: its positional arguments.
      params_index: the position of the parameters among ``func_args``.

    Returns:
      ``(losses, vjp)``: a `kfacx.losses.LossFunction` per registered loss (with
      its prediction and targets), and a `LayerTagsVjp` that maps cotangents of
      the loss predictions to every layer's ``inputs``, ``outputs``, ``params``
      and ``outputs_tangent``.

    Raises:
      ValueError: as `trace`.

    Example::

      losses, vjp = kfacx.layer_tags_vjp(loss_fn, (params, batch))
      data = vjp([losses[0].per_example_gradient()])
    """
    traced = trace_cached(func, func_args, params_index)
    # Only what the tags depend on: the statistics need nothing else of the function.
    traced = dataclasses.replace(traced, closed_jaxpr=_jaxpr.tag_ancestors(traced.closed_jaxpr))
    flat_args = jax.tree_util.tree_leaves(tuple(func_args))
    predictions, vjp_fn, (records, loss_operands, _) = jax.vjp(
        lambda p: _forward(traced, flat_args, p), _zero_perturbations(traced), has_aux=True
    )
    vjp = LayerTagsVjp(
        lambda cts: vjp_fn(cts)[0],
        records,
        traced.use_to_layer,
        _use_scans(traced),
        _use_roles(traced),
    )
    return _make_losses(loss_operands, predictions), vjp


def value_and_grad_and_layer_tags_vjp(
    func: Callable[..., Any],
    func_args: Sequence[Any],
    params_index: int = 0,
    has_aux: bool = False,
) -> tuple[Any, Any, tuple[losses.LossFunction, ...], LayerTagsVjp]:
    """One forward pass for the loss value, its gradient and the layer statistics.

    Args:
      func: a tagged loss function returning a scalar loss, or ``(loss, aux)``
        with ``has_aux=True``.
      func_args: its positional arguments.
      params_index: the position of the parameters among ``func_args``.
      has_aux: whether ``func`` returns ``(loss, aux)``.

    Returns:
      ``(value, grads, losses, vjp)``: ``func``'s output, the gradient of the
      loss with respect to the parameters, and what `layer_tags_vjp` returns.
      Both backward passes share the forward pass.

    Raises:
      ValueError: as `trace`, or if the loss is not a scalar.
    """
    traced = trace_cached(func, func_args, params_index)
    flat_args = jax.tree_util.tree_leaves(tuple(func_args))
    start, stop = param_leaf_range(func_args, params_index)

    def forward(param_leaves, perturbations):
        args = [*flat_args[:start], *param_leaves, *flat_args[stop:]]
        predictions, (records, loss_operands, outputs) = _forward(traced, args, perturbations)
        value = jax.tree_util.tree_unflatten(traced.out_tree, outputs)
        loss = value[0] if has_aux else value
        if jnp.shape(loss) != () or not jnp.issubdtype(jnp.result_type(loss), jnp.floating):
            raise ValueError(
                "The loss function must return a scalar float loss (or (loss, aux) with "
                f"has_aux=True / value_func_has_aux=True); got {jax.typeof(loss)}."
            )
        return (loss, predictions), (records, loss_operands, value)

    (loss, predictions), vjp_fn, (records, loss_operands, value) = jax.vjp(
        forward, list(flat_args[start:stop]), _zero_perturbations(traced), has_aux=True
    )
    zero_predictions = tuple(jnp.zeros_like(p) for p in predictions)
    # One backward pass: the gradient, and the cotangents of every layer's outputs (the
    # statistics of the fisher_empirical_direct estimation mode).
    grad_leaves, value_tangents = vjp_fn((jnp.ones_like(loss), zero_predictions))
    grads = jax.tree_util.tree_unflatten(traced.params_tree, grad_leaves)

    def tangents(cotangents):
        return vjp_fn((jnp.zeros_like(loss), tuple(cotangents)))[1]

    vjp = LayerTagsVjp(
        tangents,
        records,
        traced.use_to_layer,
        _use_scans(traced),
        _use_roles(traced),
        value_tangents=value_tangents,
    )
    return value, grads, _make_losses(loss_operands, predictions), vjp


def _predictions_of_params(traced: TracedFunction, func_args: Sequence[Any]):
    flat_args = jax.tree_util.tree_leaves(tuple(func_args))
    start, stop = param_leaf_range(func_args, traced.params_index)
    zeros = _zero_perturbations(traced)

    def predictions(params):
        leaves = jax.tree_util.tree_leaves(params)
        args = list(flat_args[:start]) + list(leaves) + list(flat_args[stop:])
        preds, (_, loss_operands, _) = _forward(traced, args, zeros)
        return preds, loss_operands

    return predictions


def loss_tags_jvp(
    func: Callable[..., Any], func_args: Sequence[Any], params_tangent: Any, params_index: int = 0
) -> tuple[tuple[losses.LossFunction, ...], tuple[jax.Array, ...]]:
    """Jacobian-vector product of the loss predictions with respect to the parameters.

    Returns:
      ``(losses, prediction_tangents)``: one tangent per registered loss.
    """
    traced = trace_cached(func, func_args, params_index)
    f = _predictions_of_params(traced, func_args)
    preds, tangents, ops = jax.jvp(f, (func_args[params_index],), (params_tangent,), has_aux=True)
    return _make_losses(ops, preds), tangents


def loss_tags_vjp(
    func: Callable[..., Any], func_args: Sequence[Any], params_index: int = 0
) -> tuple[tuple[losses.LossFunction, ...], Callable[[Sequence[jax.Array]], Any]]:
    """Vector-Jacobian product of the loss predictions with respect to the parameters.

    Returns:
      ``(losses, vjp)`` where ``vjp(prediction_cotangents)`` is a parameter pytree.
    """
    traced = trace_cached(func, func_args, params_index)
    f = _predictions_of_params(traced, func_args)
    preds, vjp_fn, ops = jax.vjp(f, func_args[params_index], has_aux=True)

    def vjp(cotangents):
        (grads,) = vjp_fn(tuple(cotangents))
        return grads

    return _make_losses(ops, preds), vjp


def loss_tags_linearize(
    func: Callable[..., Any], func_args: Sequence[Any], params_index: int = 0
) -> tuple[tuple[losses.LossFunction, ...], Callable[[Any], tuple[jax.Array, ...]]]:
    """Linearises the loss predictions in the parameters (one forward pass for many
    Jacobian-vector products).

    Returns:
      ``(losses, jvp)`` where ``jvp(params_tangent)`` is a tuple with one
      prediction tangent per registered loss.
    """
    traced = trace_cached(func, func_args, params_index)
    f = _predictions_of_params(traced, func_args)
    preds, jvp, ops = jax.linearize(f, func_args[params_index], has_aux=True)
    return _make_losses(ops, preds), jvp
