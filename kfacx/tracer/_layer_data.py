"""Per-layer estimation data: `LayerTagsVjp` maps loss cotangents to every layer's inputs,
outputs, parameters and output cotangents.

The forward pass records one entry per *use* of a layer (a tag equation); `fold_scans`
folds a use's `lax.scan` iterations into the batch axis (the axis of a scan over the
parameters, for a stacked layer, moves in front) and `fold_uses` concatenates the uses
of one layer (tied weights, repeated applications) along it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp


class LayerTagsVjp:
    """The vjp returned by `layer_tags_vjp`: loss cotangents -> per-layer estimation data."""

    def __init__(
        self, tangents_fn, records, use_to_layer, use_scans=None, roles=None, value_tangents=None
    ):
        self._tangents_fn = tangents_fn
        # Per use: the cotangents of its outputs in the gradient of the function's value
        # (from `value_and_grad_and_layer_tags_vjp`), or None.
        self._value_tangents = value_tangents
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
            use, ran = fold_scans(
                dict(rec, outputs_tangent=tuple(t)), batch_axis, lengths, level, example_mask
            )
            coverage.setdefault(layer, []).append(ran)
            uses.setdefault(layer, {}).setdefault(role, []).append(use)
            stacked[layer] = level is not None

        def layer_data(i):
            folded = {
                role: fold_uses(role_uses, batch_axis, lead=int(stacked[i]))
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

    def value_gradient(self, scale: Any, example_mask: jax.Array | None = None) -> tuple[dict, ...]:
        """As `sampled` with one sample, the cotangents of every layer's outputs being
        ``scale`` times their cotangents in the gradient of the function's value (the
        ``fisher_empirical_direct`` estimation mode; ``scale`` the batch size, each
        example's row is then the gradient of its own term of a mean loss).

        Raises:
          ValueError: if this vjp was not made by `value_and_grad_and_layer_tags_vjp`.
        """
        if self._value_tangents is None:
            raise ValueError(
                "This LayerTagsVjp has no gradient of the function's value; the "
                "fisher_empirical_direct mode needs value_and_grad_and_layer_tags_vjp."
            )
        tangents = jax.tree_util.tree_map(
            lambda t: (scale * t).astype(t.dtype)[None], self._value_tangents
        )
        return self._data(tangents, 1, example_mask)


def fold_scans(use: dict, batch_axis: int, lengths, level, example_mask) -> tuple[dict, Any]:
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


def fold_uses(uses: list[dict], batch_axis: int, lead: int = 0) -> dict:
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
        folded["mask"] = fold_masks(uses, lead)
    return folded


def fold_masks(uses: list[dict], lead: int) -> jax.Array:
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
