"""Tracing a tagged loss function: layer statistics and loss-output products.

`trace` turns ``func(*func_args)`` into a jaxpr once (per argument shapes) and
finds its layer and loss tags. `layer_tags_vjp` evaluates the jaxpr with a
zero perturbation added to every layer output; the vjp with respect to those
perturbations gives, for any cotangent of the registered losses' predictions,
the cotangent of every layer's outputs. `loss_tags_jvp` / `loss_tags_vjp`
give the Jacobian products of the loss predictions with respect to the
parameters (for Gauss-Newton-vector products).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from kfacx import _jaxpr, losses, tags
from kfacx._paths import check_float_params, path_to_str
from kfacx.blocks import TIED_TAG, LayerInfo


@dataclasses.dataclass(frozen=True)
class TracedFunction:
    """A traced loss function: its jaxpr and the layer and loss tags found in it.

    Attributes:
      closed_jaxpr: the jaxpr of ``func(*func_args)``.
      params_index: which positional argument holds the parameters.
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
        (`kfacx._jaxpr.tag_sites`), its use index, or None for a loss tag.
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


def _param_leaf_range(func_args: Sequence[Any], params_index: int) -> tuple[int, int]:
    before = sum(len(jax.tree_util.tree_leaves(a)) for a in func_args[:params_index])
    return before, before + len(jax.tree_util.tree_leaves(func_args[params_index]))


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
    specs = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), func_args
    )
    closed, out_shape = jax.make_jaxpr(func, return_shape=True)(*specs)
    closed = _jaxpr.dce(closed)
    in_tree = jax.tree_util.tree_structure(func_args)
    path_leaves, params_tree = jax.tree_util.tree_flatten_with_path(func_args[params_index])
    param_paths = tuple(path_to_str(p) for p, _ in path_leaves)
    check_float_params(param_paths, [leaf for _, leaf in path_leaves])
    start, stop = _param_leaf_range(func_args, params_index)
    origins = [i - start if start <= i < stop else None for i in range(len(closed.jaxpr.invars))]

    layers, leaves_of, use_to_layer, use_outputs, num_losses = [], [], [], [], 0
    use_roles: list[int] = []
    site_uses: list[int | None] = []
    scan_lengths: list[tuple[int, ...]] = []
    stacked_levels: list[int | None] = []
    owner: dict[int, int] = {}
    conditional: list[bool] = []
    for eqn, ins, scans, branches in _jaxpr.tag_sites(closed.jaxpr, origins):
        tag = tags.layer_tag_for(eqn.primitive)
        if tag is None:
            if scans or branches:
                raise _loss_in_loop_or_branch(eqn, "a `scan`" if scans else "a `cond` branch")
            num_losses += 1
            site_uses.append(None)
            continue
        conditional.append(bool(branches))
        info, leaf_ids = _layer_info(tag, eqn, ins, param_paths)
        info, lengths, level = _scan_layer_info(info, tag.split(ins)[2], scans)
        lead = lengths
        use_outputs.append(
            tuple((lead + v.aval.shape, v.aval.dtype) for v in tag.split(eqn.invars)[0])
        )
        site_uses.append(len(use_to_layer))
        scan_lengths.append(lengths)
        stacked_levels.append(level)
        shared = {owner[leaf] for leaf in leaf_ids if leaf in owner}
        if shared:
            index, role = _join_layer(shared, layers, leaves_of, info, leaf_ids)
            owner.update({leaf: index for leaf in leaf_ids})
            use_to_layer.append(index)
            use_roles.append(role)
            continue
        owner.update({leaf: len(layers) for leaf in leaf_ids})
        use_to_layer.append(len(layers))
        use_roles.append(0)
        layers.append(info)
        leaves_of.append(leaf_ids)
    if num_losses == 0:
        raise ValueError(
            "The function registers no loss. Call e.g. kfacx.register_softmax_cross_entropy_loss("
            "logits, labels) on the model output inside the loss function."
        )
    return TracedFunction(
        closed,
        in_tree,
        jax.tree_util.tree_structure(out_shape),
        params_index,
        params_tree,
        param_paths,
        tuple(layers),
        tuple(leaves_of),
        tuple(use_to_layer),
        tuple(use_outputs),
        num_losses,
        tuple(site_uses),
        tuple(scan_lengths),
        tuple(stacked_levels),
        tuple(use_roles),
        tuple(conditional),
    )


def _same_kind(first: LayerInfo, first_leaves, info: LayerInfo, leaf_ids) -> bool:
    """Whether two tags are the same layer applied twice (one block folds their uses)."""
    k = 1 if info.stack_size is None else 2  # per-example shapes: after [batch] or [L, batch]
    return (
        tuple(first_leaves) == tuple(leaf_ids)
        and first.tag_name == info.tag_name
        and first.stack_size == info.stack_size
        and dict(first.meta) == dict(info.meta)
        and [s[k:] for s in first.input_shapes] == [s[k:] for s in info.input_shapes]
        and [s[k:] for s in first.output_shapes] == [s[k:] for s in info.output_shapes]
    )


def _join_layer(shared: set[int], layers, leaves_of, info: LayerInfo, leaf_ids) -> tuple[int, int]:
    """Adds a tag that shares parameters with an earlier layer: ``(layer, role)``.

    The same kind of layer on the same parameters is one more use of it (tied
    weights of one kind); another kind makes the layer a tied one (pseudo tag
    ``"tied"``, one role per kind, served by `kfacx.blocks.TiedKroneckerFactored`
    by default), updated in ``layers`` and ``leaves_of``.
    """
    if len(shared) > 1:
        paths = [p for i in sorted(shared) for p in layers[i].parameter_paths]
        raise ValueError(
            f"Layer {info.name} shares parameters with several other layer tags ({paths}); "
            "one block serves one group of shared parameters. Tag the shared parameters once, "
            "or with kfacx.register_generic."
        )
    (index,) = shared
    first = layers[index]
    roles = first.roles or (first,)
    role_params = first.role_params or (tuple(range(len(leaves_of[index]))),)
    for r, (role, positions) in enumerate(zip(roles, role_params, strict=True)):
        if _same_kind(role, [leaves_of[index][i] for i in positions], info, leaf_ids):
            role = dataclasses.replace(role, num_uses=role.num_uses + info.num_uses)
            roles = roles[:r] + (role,) + roles[r + 1 :]
            if first.roles:
                layers[index] = dataclasses.replace(first, roles=roles)
            else:
                layers[index] = role
            return index, r
    leaves = list(leaves_of[index]) + [i for i in leaf_ids if i not in leaves_of[index]]
    roles += (info,)
    role_params += (tuple(leaves.index(i) for i in leaf_ids),)
    shapes, paths, dtypes = {}, {}, {}
    for role, positions in zip(roles, role_params, strict=True):
        for j, pos in enumerate(positions):
            shapes[pos] = tuple(role.parameter_shapes[j])
            paths[pos] = role.parameter_paths[j]
            dtypes[pos] = role.parameter_dtypes[j]
    layers[index] = LayerInfo(
        tag_name=TIED_TAG,
        parameter_paths=tuple(paths[i] for i in range(len(leaves))),
        parameter_shapes=tuple(shapes[i] for i in range(len(leaves))),
        parameter_dtypes=tuple(dtypes[i] for i in range(len(leaves))),
        roles=roles,
        role_params=role_params,
    )
    leaves_of[index] = tuple(leaves)
    return index, len(roles) - 1


def _layer_info(tag, eqn, ins, param_paths) -> tuple[LayerInfo, tuple[int, ...]]:
    outputs, inputs, params = tag.split(eqn.invars)
    _, _, param_origins = tag.split(ins)
    bad = [i for i, o in enumerate(param_origins) if o is None]
    if bad:
        raise ValueError(
            f"Layer tag {tag.name!r}: parameter operand {bad[0]} is computed inside the function "
            "(or is a constant), not a leaf of the parameters. Pass the parameter array itself "
            "to the register_* call."
        )
    leaf_ids = tuple(_jaxpr.leaf_origin(o) for o in param_origins)
    info = LayerInfo(
        tag_name=tag.name,
        parameter_paths=tuple(param_paths[i] for i in leaf_ids),
        parameter_shapes=tuple(tuple(v.aval.shape) for v in params),
        parameter_dtypes=tuple(v.aval.dtype for v in params),
        input_shapes=tuple(tuple(v.aval.shape) for v in inputs),
        output_shapes=tuple(tuple(v.aval.shape) for v in outputs),
        meta=dict(eqn.params),
        compute=tag.compute,
    )
    axis = tags.stacked_input_axis(tag.name, eqn.params, info.parameter_shapes)
    if axis is not None:
        # A stacked dense layer (a batch dimension over the weight's leading axis): the
        # slices are separate layers, described like those of a scan over parameters.
        (x_shape,) = info.input_shapes
        moved = (x_shape[axis],) + x_shape[:axis] + x_shape[axis + 1 :]
        info = dataclasses.replace(
            info,
            input_shapes=(moved,),
            meta=tags.dense_slice_meta(eqn.params["dimension_numbers"]),
            stack_size=int(info.parameter_shapes[0][0]),
        )
    return info, leaf_ids


def _scan_layer_info(
    info: LayerInfo, param_origins, scans
) -> tuple[LayerInfo, tuple[int, ...], int | None]:
    """A layer tag inside (nested) `lax.scan`s: ``(LayerInfo, scan lengths, stacked level)``.

    Parameters a scan runs over (``xs``, e.g. `hk.layer_stack`) make a stacked
    layer (shapes with the leading layer axis, ``stack_size`` set; the level is
    that scan's index among ``scans``); the iterations of the other scans, which
    close over the parameters (``consts``), are uses of one layer (``num_uses``
    = the product of their lengths). Outside scans: ``(info, (), None)``.

    Raises:
      ValueError: for parameters stacked by two scans, by different scans, or
        stacked and shared in one layer.
    """
    if not scans:
        return info, (), None
    if info.stack_size is not None:
        raise ValueError(
            f"Layer {info.name} is a stacked dense layer (a batch dimension over its weight's "
            "leading axis) inside a `scan`; kfacx serves one level of stacking. Move the "
            "layer out of the scan, or scan over the slices instead of batching them."
        )
    lengths = tuple(int(scan.params["length"]) for scan in scans)
    levels = [_jaxpr.slice_levels(o) for o in param_origins]
    if any(len(lv) > 1 for lv in levels):
        raise ValueError(
            f"Layer {info.name} sits in nested `scan`s that both run over its parameters (two "
            "levels of stacking); kfacx serves one. Flatten the two stacked axes into one "
            "scan, or unroll one of the loops."
        )
    stacked = [bool(lv) for lv in levels]
    if any(stacked) and not all(stacked) or len(set(levels)) > 1:
        sliced = [p for p, s in zip(info.parameter_paths, stacked, strict=True) if s]
        closed = [p for p, s in zip(info.parameter_paths, stacked, strict=True) if not s]
        raise ValueError(
            f"Layer {info.name} inside a `scan` takes parameters {sliced} as scanned-over inputs "
            f"(xs: one slice per iteration) and {closed} as closed-over constants (the same at "
            "every iteration), or slices of different scans. kfacx serves a layer in a scan "
            "when all its parameters are stacked by one scan (like hk.layer_stack) or all are "
            "shared: scan over all of them, or close over all of them (or split the layer into "
            "two registered layers)."
        )
    level = levels[0][0] if levels and levels[0] else None
    folded = math.prod(n for i, n in enumerate(lengths) if i != level)
    info = dataclasses.replace(info, num_uses=info.num_uses * folded)
    if level is None:
        return info, lengths, None
    size = lengths[level]

    def stack(shapes):
        return tuple((size, *s) for s in shapes)

    return (
        dataclasses.replace(
            info,
            parameter_shapes=stack(info.parameter_shapes),
            input_shapes=stack(info.input_shapes),
            output_shapes=stack(info.output_shapes),
            stack_size=size,
        ),
        lengths,
        level,
    )


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


class LayerTagsVjp:
    """The vjp returned by `layer_tags_vjp`: loss cotangents -> per-layer estimation data."""

    def __init__(self, tangents_fn, records, use_to_layer, use_scans=None, roles=None):
        self._tangents_fn = tangents_fn
        self._records = records
        self._use_to_layer = use_to_layer
        # Per use: (lengths of the scans it sits in, the level of the one stacking it or None).
        self._use_scans = tuple(use_scans or (((), None),) * len(records))
        # Per use: its role in a tied layer, or None for an ordinary layer.
        self._roles = tuple(roles or (None,) * len(records))

    def tangents(self, loss_cotangents: Sequence[jax.Array]) -> tuple[tuple[jax.Array, ...], ...]:
        """The cotangents of every layer's outputs (without the layer data)."""
        return self._tangents_fn(tuple(loss_cotangents))

    def _data(self, tangents, batch_axis: int, example_mask) -> tuple[dict, ...]:
        uses: dict[int, dict[int | None, list[dict]]] = {}
        stacked: dict[int, bool] = {}
        coverage: dict[int, list] = {}  # layer -> how much of the batch each use ran on
        for rec, t, layer, (lengths, level), role in zip(
            self._records, tangents, self._use_to_layer, self._use_scans, self._roles, strict=True
        ):
            use, ran = _fold_scans(
                dict(rec, outputs_tangent=tuple(t)), batch_axis, lengths, level, example_mask
            )
            coverage.setdefault(layer, []).append(ran)
            uses.setdefault(layer, {}).setdefault(role, []).append(use)
            stacked[layer] = level is not None

        def layer_data(i):
            folded = {
                role: _fold_uses(role_uses, batch_axis, lead=int(stacked[i]))
                for role, role_uses in sorted(uses[i].items(), key=lambda kv: kv[0] or 0)
            }
            data = folded[None] if None in folded else dict(roles=tuple(folded.values()))
            if all(c is not None for c in coverage[i]):
                data = dict(data, coverage=functools.reduce(jnp.maximum, coverage[i]))
            return data

        return tuple(layer_data(i) for i in range(len(uses)))

    def __call__(
        self, loss_cotangents: Sequence[jax.Array], example_mask: jax.Array | None = None
    ) -> tuple[dict, ...]:
        """Per layer: ``inputs``, ``outputs``, ``params`` and ``outputs_tangent``.

        A layer applied at every iteration of a `lax.scan` with the same
        parameters has its iterations folded into the batch axis. A stacked
        layer (`kfacx.blocks.LayerInfo.stack_size`) keeps the layer axis in
        front: ``inputs`` / ``outputs`` / ``params`` ``[L, ...]``,
        ``outputs_tangent`` ``[L, ...]`` (``[samples, L, ...]`` in `sampled`).

        A layer used only inside `lax.cond` / `lax.switch` branches runs only
        when its branch is taken. Its uses that did not run have zero data and
        a zero ``"mask"`` (so they count as padding), and its data has a
        ``"coverage"``: 1 if any use ran, else 0 (per slice ``[L]`` for a
        stacked layer, e.g. stochastic depth inside `hk.layer_stack`). The
        estimator leaves the moving averages of a layer that did not run as
        they are (see `kfacx.CurvatureStats`).

        Args:
          loss_cotangents: one array per registered loss, shaped like its prediction.
          example_mask: optional per-example weights ``[batch]``; passed on to
            the blocks as ``"mask"`` (the caller masks the cotangents).
        """
        return self._data(self.tangents(loss_cotangents), 0, example_mask)

    def sampled(
        self, loss_cotangents: Sequence[jax.Array], example_mask: jax.Array | None = None
    ) -> tuple[dict, ...]:
        """As `__call__`, for cotangents with a leading samples axis; every
        ``outputs_tangent`` then has that leading axis too."""
        loss_cotangents = tuple(loss_cotangents)
        if all(c.shape[0] == 1 for c in loss_cotangents):
            # One sample: a plain backward pass (a vmap of size 1 turns every matmul
            # into a batched one, which is much slower on CPU).
            single = self.tangents(tuple(c[0] for c in loss_cotangents))
            tangents = jax.tree_util.tree_map(lambda t: t[None], single)
        else:
            tangents = jax.vmap(self.tangents)(loss_cotangents)
        return self._data(tangents, 1, example_mask)


def _fold_scans(use: dict, batch_axis: int, lengths, level, example_mask) -> tuple[dict, Any]:
    """A use's data with the iterations of the scans it sits in folded: ``(use, ran)``.

    Inputs and outputs are ``[*lengths, batch, ...]`` (the cotangents have
    ``batch_axis`` axes before). The axis of the scan at ``level`` (the one
    running over the parameters of a stacked layer) moves in front; the other
    iterations are folded into the batch axis that follows, iteration-major,
    with the example mask repeated for every iteration. For a generic tag (its
    cotangent is the parameter gradient) the folded iterations are summed.

    A use inside cond branches has an ``"active"`` flag (per iteration): its
    mask is the example mask (ones without one) times the flag, so that the
    iterations that did not run count as padding, and ``ran`` is the flag's
    maximum (per slice ``[L]`` for a stacked layer), else None.
    """
    use = dict(use)
    active = use.pop("active", None)
    ran = None
    if active is not None:
        active = jnp.broadcast_to(jnp.asarray(active, jnp.float32), lengths)
        others = tuple(i for i in range(len(lengths)) if i != level)
        ran = jnp.max(active, axis=others) if others else active
    folded = [i for i in range(len(lengths)) if i != level]

    def fold(a, offset):
        if level is not None:
            a = jnp.moveaxis(a, offset + level, offset)
        start = offset + (level is not None)
        count = len(folded) + 1  # the folded iterations and the batch axis
        merged = math.prod(a.shape[start : start + count])
        return a.reshape(a.shape[:start] + (merged,) + a.shape[start + count :])

    if not use["inputs"]:
        # A generic tag: sum the folded iterations' cotangents (parameter gradients).
        # (What remains of the scan axes is the stacked one, right after the samples axis.)
        axes = tuple(batch_axis + i for i in folded)
        tangents = tuple(jnp.sum(t, axis=axes) for t in use["outputs_tangent"])
        if example_mask is not None:
            use["mask"] = example_mask
        return dict(use, outputs=use["params"], outputs_tangent=tangents), ran
    batch = use["outputs"][0].shape[len(lengths)]
    repeats = math.prod(lengths[i] for i in folded)
    if active is not None:
        base = jnp.ones((batch,), jnp.float32) if example_mask is None else example_mask
        base = jnp.asarray(base, jnp.float32).reshape((1,) * len(lengths) + (batch,))
        mask = fold(active[..., None] * base, 0)
    elif example_mask is not None:
        mask = jnp.tile(example_mask, repeats) if repeats > 1 else example_mask
    else:
        mask = None
    out = dict(
        use,
        inputs=tuple(fold(a, 0) for a in use["inputs"]),
        outputs=tuple(fold(a, 0) for a in use["outputs"]),
        outputs_tangent=tuple(fold(a, batch_axis) for a in use["outputs_tangent"]),
    )
    if mask is not None:
        out["mask"] = mask
    return out, ran


def _fold_uses(uses: list[dict], batch_axis: int, lead: int = 0) -> dict:
    """Merges the data of a layer's uses: inputs, outputs, cotangents (and masks) are
    concatenated along the batch axis (for a generic tag, whose cotangent is the
    parameter gradient, the cotangents of the uses are summed). ``lead`` axes
    (the layer axis of a stacked layer) come before the batch axis."""
    if len(uses) == 1:
        return uses[0]

    def cat(key, axis):
        return tuple(
            jnp.concatenate(arrays, axis) for arrays in zip(*(u[key] for u in uses), strict=True)
        )

    if not uses[0]["inputs"]:
        tangents = tuple(sum(ts) for ts in zip(*(u["outputs_tangent"] for u in uses), strict=True))
        return dict(uses[0], outputs_tangent=tangents)
    folded = dict(
        inputs=cat("inputs", lead),
        outputs=cat("outputs", lead),
        params=uses[0]["params"],
        outputs_tangent=cat("outputs_tangent", batch_axis + lead),
    )
    if any("mask" in u for u in uses):
        folded["mask"] = _fold_masks(uses, lead)
    return folded


def _fold_masks(uses: list[dict], lead: int) -> jax.Array:
    """The masks of a layer's uses, concatenated along the batch axis (ones for a use
    without one; per-slice ``[L, batch]`` if one use has per-slice masks)."""
    per_slice = any(u.get("mask") is not None and u["mask"].ndim == 2 for u in uses)
    masks = []
    for u in uses:
        shape = u["outputs"][0].shape[: lead + 1]
        mask = u.get("mask")
        mask = jnp.ones(shape[-1:], jnp.float32) if mask is None else mask
        masks.append(jnp.broadcast_to(mask, shape) if per_slice else mask)
    return jnp.concatenate(masks, axis=-1)


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
    start, stop = _param_leaf_range(func_args, params_index)

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
    grad_leaves, _ = vjp_fn((jnp.ones_like(loss), zero_predictions))
    grads = jax.tree_util.tree_unflatten(traced.params_tree, grad_leaves)

    def tangents(cotangents):
        return vjp_fn((jnp.zeros_like(loss), tuple(cotangents)))[1]

    vjp = LayerTagsVjp(
        tangents, records, traced.use_to_layer, _use_scans(traced), _use_roles(traced)
    )
    return value, grads, _make_losses(loss_operands, predictions), vjp


def _predictions_of_params(traced: TracedFunction, func_args: Sequence[Any]):
    flat_args = jax.tree_util.tree_leaves(tuple(func_args))
    start, stop = _param_leaf_range(func_args, traced.params_index)
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
