"""``kfac_jax.layers_and_loss_tags``: kfac-jax's layer registration, on kfacx's tags.

kfac-jax has one layer-tag primitive, ``layer_tag``, and tells layer kinds apart by a
``variant`` string in its metadata (``"dense"``, ``"conv2d"``, ``"scale_and_shift"``,
``"generic"``, and users' own, e.g. FermiNet's ``"repeated_dense"``); a block class is
chosen per variant. kfacx has one `kfacx.tags.LayerTag` per kind, and chooses blocks by
tag name. Here each variant is a kfacx tag (`variant_tag`): the four built-in ones are
kfacx's own (``dense_tag``, ``conv_tag``, ``scale_and_shift_tag``, ``generic_tag``),
and any other variant ``v`` gets a tag named ``"v_tag"`` with the dense layer's
computation, made on first use. `layer_tag` is kfac-jax's primitive's stand-in: graph
patterns name it, and binding it registers the variant in its metadata.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Generic, TypeVar

import jax

from kfacx import tags as _tags
from kfacx.tags import LossTag

T = TypeVar("T")

__all__ = [
    "LayerData",
    "LayerMetaData",
    "LayerTag",
    "LossTag",
    "kfacx_tag_name",
    "layer_tag",
    "register_conv2d",
    "register_dense",
    "register_generic",
    "register_repeated_dense",
    "register_scale_and_shift",
    "variant_of_tag",
    "variant_tag",
]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerData(Generic[T]):
    """A layer's ``inputs``, ``outputs`` and ``params`` (tuples), as kfac-jax's blocks get them."""

    inputs: tuple[T, ...]
    outputs: tuple[T, ...]
    params: tuple[T, ...]


@dataclasses.dataclass(kw_only=True, unsafe_hash=True)
class LayerMetaData:
    """kfac-jax's layer metadata: the variant, and where outputs, inputs and parameters
    sit among a tag's operands."""

    variant: str
    outputs_index: tuple[int, ...]
    inputs_index: tuple[int, ...]
    params_index: tuple[int, ...]
    name: str | None = None
    nesting: tuple[str, ...] = ()


#: kfac-jax's built-in variants, by the kfacx tag that serves each.
_BUILT_IN = {
    "dense": _tags.dense,
    "conv2d": _tags.conv,
    "scale_and_shift": _tags.scale_and_shift,
    "generic": _tags.generic,
}
_VARIANT_TAGS: dict[str, _tags.LayerTag] = dict(_BUILT_IN)


def _dense_like_compute(inputs, params, *, dimension_numbers=None, **extra):
    """A variant tag's computation: the dense layer, when the variant has its metadata."""
    del extra
    if dimension_numbers is None:
        raise ValueError(
            "This kfac-jax layer variant was registered on arrays that are not a dense "
            "layer, so kfacx cannot recompute it; give it a block that does not need the "
            "layer's computation (not kfacx.Diagonal or kfacx.Full)."
        )
    return _tags.dense.compute(inputs, params, dimension_numbers=dimension_numbers)


def kfacx_tag_name(variant: str) -> str:
    """The name of the kfacx tag serving kfac-jax's ``variant`` (the key of kfacx's
    ``layer_tag_to_block_ctor``): ``"dense"`` -> ``"dense_tag"``."""
    return _BUILT_IN[variant].name if variant in _BUILT_IN else f"{variant}_tag"


def variant_tag(variant: str) -> _tags.LayerTag:
    """The kfacx tag of kfac-jax's layer ``variant`` (made on first use for a new one).

    Raises:
      TypeError: if ``variant`` is not a string.
    """
    if not isinstance(variant, str):
        raise TypeError(f"A kfac-jax layer variant must be a string, got {variant!r}.")
    tag = _VARIANT_TAGS.get(variant)
    if tag is None:
        tag = _tags.LayerTag(
            kfacx_tag_name(variant), num_inputs=1, num_outputs=1, compute=_dense_like_compute
        )
        _VARIANT_TAGS[variant] = tag
    return tag


def variant_of_tag(tag_name: str) -> str:
    """kfac-jax's variant of a kfacx tag name (the tag name itself when it is no variant's)."""
    for variant, tag in _VARIANT_TAGS.items():
        if tag.name == tag_name:
            return variant
    return tag_name


class LayerTag:
    """kfac-jax's single layer-tag primitive, as a stand-in: `GraphPattern` s name it
    (``tag_primitive=layer_tag``) and `bind` registers a layer of the variant given in
    ``meta``. kfacx's own tags are `kfacx.tags.LayerTag`."""

    name = "layer_tag"

    def bind(self, *operands: Any, meta: LayerMetaData, **params: Any) -> Any:
        """Registers the layer ``operands`` (kfac-jax's order: outputs, inputs, params)."""
        ops = list(operands)
        y, x = ops[meta.outputs_index[0]], ops[meta.inputs_index[0]]
        w, *b = [ops[i] for i in meta.params_index]
        return _register_variant(meta.variant, y, x, w, b[0] if b else None, params)

    def __repr__(self) -> str:
        return "kfacx.kfac_jax.layers_and_loss_tags.layer_tag"


layer_tag = LayerTag()


def _hashable_meta(variant: str, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    for k, v in kwargs.items():
        try:
            hash(v)
        except TypeError:
            raise TypeError(
                f"register_dense(variant={variant!r}): the extra argument {k}={v!r} must be "
                "hashable (it is kept as the tag's static metadata)."
            ) from None
    return dict(kwargs)


def _register_variant(variant, y, x, w, b, kwargs):
    tag = variant_tag(variant)
    try:
        meta = _tags.dense_meta(x.shape, w.shape)
    except ValueError:
        meta = {}  # not a dense contraction (e.g. FermiNet's "qmc" envelope)
    meta.update(_hashable_meta(variant, kwargs))
    operands = (y, x, w) if b is None else (y, x, w, b)
    return tag.bind(*operands, **meta)[0]


def register_dense(y, x, w, b=None, variant: str = "dense", **kwargs: Any) -> jax.Array:
    """Registers a dense layer ``y = x @ w + b`` (kfac-jax's signature).

    ``variant="dense"`` is `kfacx.register_dense`. Any other variant registers the layer
    under that variant's tag (`variant_tag`), for a block mapped to the variant with
    ``layer_tag_to_block_ctor`` or `set_default_tag_to_block_ctor`; extra keyword
    arguments become the tag's static metadata (read by the block as
    ``layer_tag_extra_params``).
    """
    if variant == "dense" and not kwargs:
        return _tags.register_dense(y, x, w, b)
    return _register_variant(variant, y, x, w, b, kwargs)


def register_repeated_dense(y, x, w, b=None, **kwargs: Any) -> jax.Array:
    """`register_dense` with ``variant="repeated_dense"``."""
    return register_dense(y, x, w, b, variant="repeated_dense", **kwargs)


def register_conv2d(y, x, w, b=None, variant: str = "conv2d", **kwargs: Any) -> jax.Array:
    """Registers a 2-D convolution (`kfacx.register_conv2d`; ``kwargs`` are
    `jax.lax.conv_general_dilated`'s).

    Raises:
      NotImplementedError: for a variant other than ``"conv2d"``.
    """
    if variant != "conv2d":
        raise NotImplementedError(
            f"register_conv2d(variant={variant!r}): kfacx.kfac_jax serves custom variants of "
            "dense layers only; register the layer with a kfacx.tags.LayerTag of your own."
        )
    # kfac-jax passes the convolution equation's parameters along; those that only say
    # how XLA computes it (precision, result type) are not layer metadata in kfacx.
    for name in ("precision", "preferred_element_type", "out_sharding"):
        kwargs.pop(name, None)
    return _tags.register_conv2d(y, x, w, b, **kwargs)


def register_scale_and_shift(y, x, scale=None, shift=None, **kwargs: Any) -> jax.Array:
    """Registers ``y = x * scale + shift`` (`kfacx.register_scale_and_shift`)."""
    kwargs.pop("has_scale", None)
    kwargs.pop("has_shift", None)
    return _tags.register_scale_and_shift(y, x, scale, shift, **kwargs)


def register_generic(*args: jax.Array) -> Any:
    """Registers parameters that belong to no known layer (each `kfacx.register_generic`)."""
    out = tuple(_tags.register_generic(a) for a in args)
    return out[0] if len(out) == 1 else out
