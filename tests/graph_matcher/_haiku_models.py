"""Haiku models for the layer-detection tests, each a `Case` with what detection should
find in it (see tests/graph_matcher/_models.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

from ._model_base import (
    CONV,
    DENSE,
    EMBED,
    SAS,
    Case,
    _loss_on,
    _targets,
    layer,
    normal,
    softmax_loss,
)

# ----------------------------------------------------------------------------- haiku models


def random_init(init: Callable[..., Any], x: jax.Array, rng: np.random.Generator) -> Any:
    """Random values shaped like ``init(key, x)`` (cheaper than running haiku's initializers)."""
    shapes = jax.eval_shape(init, jax.random.PRNGKey(0), x)

    def fill(s):
        if not np.issubdtype(s.dtype, np.floating):
            return jnp.zeros(s.shape, s.dtype)
        return normal(rng, *s.shape, scale=0.5)

    return jax.tree_util.tree_map(fill, shapes)


def haiku_model(
    forward: Callable[[jax.Array], jax.Array],
    x: jax.Array,
    kind: str = "squared",
    seed: int = 0,
    with_state: bool = False,
) -> tuple[Callable[..., jax.Array], Any, tuple]:
    """``(loss, params, batch)`` for a haiku forward function (flattened output)."""
    rng = np.random.default_rng(seed)
    if with_state:
        model = hk.transform_with_state(forward)
        params, state = random_init(model.init, x, rng)

        def apply(params, x):
            return model.apply(params, state, None, x)[0]

    else:
        model = hk.without_apply_rng(hk.transform(forward))
        params = random_init(model.init, x, rng)
        apply = model.apply
    out = jax.eval_shape(apply, params, x)
    dim = int(np.prod(out.shape[1:]))
    batch = (x, _targets(kind, rng, x.shape[0], dim))

    def loss(params, batch):
        x, t = batch
        return _loss_on(kind, apply(params, x), t)

    return loss, params, batch


def haiku_case(name, forward, x, expected, tag_counts, kind="squared", **kw) -> Case:
    extra = {k: kw.pop(k) for k in ("tag_meta", "unmatched", "uses") if k in kw}
    loss, params, batch = haiku_model(forward, x, kind, **kw)
    return Case(name, loss, params, batch, expected, tag_counts, **extra)


def _x(*shape: int, seed: int = 1) -> jax.Array:
    return normal(np.random.default_rng(seed), *shape)


def mlp_case(with_bias: bool = True) -> Case:
    leaves, source = (("b", "w"), "dense_with_bias") if with_bias else (("w",), "dense")
    expected = {}
    for i in range(3):
        expected.update(layer(f"mlp/~/linear_{i}", DENSE, source, leaves))
    return haiku_case(
        "mlp" if with_bias else "mlp_no_bias",
        lambda x: hk.nets.MLP([8, 8, 3], with_bias=with_bias)(x),
        _x(3, 5),
        expected,
        {DENSE: 3},
        kind="softmax",
    )


def cnn_forward(x: jax.Array) -> jax.Array:
    """conv - relu - conv (stride 2) - flatten - linear."""
    h = jax.nn.relu(hk.Conv2D(4, 3, name="conv_a")(x))
    h = hk.Conv2D(3, 3, stride=2, name="conv_b")(h)
    return hk.Linear(3, name="head")(h.reshape(h.shape[0], -1))


def cnn_case() -> Case:
    expected = {
        **layer("conv_a", CONV, "conv_with_bias"),
        **layer("conv_b", CONV, "conv_with_bias"),
        **layer("head", DENSE, "dense_with_bias"),
    }
    meta = {CONV: [dict(window_strides=(1, 1)), dict(window_strides=(2, 2))]}
    return haiku_case(
        "cnn", cnn_forward, _x(2, 6, 6, 2), expected, {CONV: 2, DENSE: 1}, "softmax", tag_meta=meta
    )


def ln_forward(x: jax.Array) -> jax.Array:
    """linear - layer norm - tanh - linear."""
    h = hk.Linear(6, name="inner")(x)
    h = hk.LayerNorm(axis=-1, create_scale=True, create_offset=True, name="norm")(h)
    return hk.Linear(3, name="head")(jnp.tanh(h))


def rms_forward(x: jax.Array) -> jax.Array:
    """linear - RMS norm - tanh - linear."""
    h = hk.Linear(6, name="inner")(x)
    h = hk.RMSNorm(axis=-1, name="norm")(h)
    return hk.Linear(3, name="head")(jnp.tanh(h))


class OffsetRMSNorm(hk.Module):
    """Gemma's RMSNorm: the scale is stored as its offset from 1, ``x_hat * (1 + scale)``."""

    def __call__(self, h):
        scale = hk.get_parameter("scale", h.shape[-1:], init=hk.initializers.RandomNormal(0.3))
        x_hat = h * jax.lax.rsqrt(jnp.mean(jnp.square(h), axis=-1, keepdims=True) + 1e-6)
        return x_hat * jnp.broadcast_to(1 + scale, h.shape)


class FiLM(hk.Module):
    """Learned feature-wise affine map with the scale stored as its offset from 1."""

    def __call__(self, h):
        init = hk.initializers.RandomNormal(0.3)
        gamma = hk.get_parameter("gamma", h.shape[-1:], init=init)
        beta = hk.get_parameter("beta", h.shape[-1:], init=init)
        # Operands in the other order on purpose.
        return jnp.broadcast_to(beta, h.shape) + jnp.broadcast_to(gamma + 1.0, h.shape) * h


def offset_rms_forward(x: jax.Array) -> jax.Array:
    """linear - Gemma-style RMS norm - tanh - linear."""
    h = OffsetRMSNorm(name="norm")(hk.Linear(6, name="inner")(x))
    return hk.Linear(3, name="head")(jnp.tanh(h))


def film_forward(x: jax.Array) -> jax.Array:
    """linear - FiLM - tanh - linear."""
    h = FiLM(name="norm")(hk.Linear(6, name="inner")(x))
    return hk.Linear(3, name="head")(jnp.tanh(h))


def _norm_case(name, norm, source, leaves) -> Case:
    def forward(x):
        # A linear layer first, so the normalized value depends on parameters.
        return norm()(hk.Linear(5, name="inner")(x))

    expected = {**layer("inner", DENSE, "dense_with_bias"), **layer("norm", SAS, source, leaves)}
    return haiku_case(name, forward, _x(3, 4), expected, {DENSE: 1, SAS: 1})


def _conv_case(name, module, x, meta, source="conv_with_bias") -> Case:
    return haiku_case(
        name,
        lambda x: module()(x),
        x,
        layer("conv", CONV, source),
        {CONV: 1},
        tag_meta={CONV: [meta]},
    )


IDS = jnp.asarray([[1, 2, 3], [4, 5, 1]], jnp.int32)


def embed_forward(ids: jax.Array) -> jax.Array:
    return hk.Embed(6, 3, name="embed")(ids)


def haiku_cases() -> list[Case]:
    """The haiku models of the detection tests."""
    x4 = _x(2, 6, 6, 4)
    cases = [
        mlp_case(True),
        mlp_case(False),
        haiku_case(
            "linear_on_3d_input",
            lambda x: hk.Linear(4)(x),
            _x(2, 3, 5),
            layer("linear", DENSE, "dense_with_bias"),
            {DENSE: 1},
            tag_meta={DENSE: [dict(dimension_numbers=(((2,), (0,)), ((), ())))]},
        ),
        _conv_case(
            "conv1d",
            lambda: hk.Conv1D(3, 3, name="conv"),
            _x(2, 7, 2),
            dict(window_strides=(1,), feature_group_count=1),
        ),
        _conv_case(
            "conv2d_stride2_same",
            lambda: hk.Conv2D(3, 3, stride=2, padding="SAME", name="conv"),
            x4,
            dict(window_strides=(2, 2), padding=((0, 1), (0, 1))),
        ),
        _conv_case(
            "conv2d_dilated",
            lambda: hk.Conv2D(3, 3, rate=2, name="conv"),
            x4,
            dict(rhs_dilation=(2, 2), window_strides=(1, 1)),
        ),
        _conv_case(
            "conv2d_grouped",
            lambda: hk.Conv2D(4, 3, feature_group_count=2, name="conv"),
            x4,
            dict(feature_group_count=2),
        ),
        _conv_case(
            "conv3d",
            lambda: hk.Conv3D(2, 2, name="conv"),
            _x(2, 3, 3, 3, 2),
            dict(window_strides=(1, 1, 1)),
        ),
        _conv_case(
            "depthwise_conv2d",
            lambda: hk.DepthwiseConv2D(channel_multiplier=2, kernel_shape=3, name="conv"),
            x4,
            dict(feature_group_count=4),
        ),
        _conv_case(
            "conv2d_transpose",
            lambda: hk.Conv2DTranspose(3, 3, stride=2, name="conv"),
            _x(2, 3, 3, 2),
            dict(lhs_dilation=(2, 2), window_strides=(1, 1)),
        ),
        _norm_case(
            "layer_norm",
            lambda: hk.LayerNorm(-1, create_scale=True, create_offset=True, name="norm"),
            "normalization",
            ("offset", "scale"),
        ),
        _norm_case(
            "layer_norm_scale_only",
            lambda: hk.LayerNorm(-1, create_scale=True, create_offset=False, name="norm"),
            "normalization_scale",
            ("scale",),
        ),
        _norm_case(
            "layer_norm_offset_only",
            lambda: hk.LayerNorm(-1, create_scale=False, create_offset=True, name="norm"),
            "shift",
            ("offset",),
        ),
        _norm_case(
            "rms_norm", lambda: hk.RMSNorm(-1, name="norm"), "normalization_scale", ("scale",)
        ),
        _norm_case(
            "offset_rms_norm", lambda: OffsetRMSNorm(name="norm"), "offset_scale", ("scale",)
        ),
        _norm_case("film", lambda: FiLM(name="norm"), "offset_scale_and_shift", ("beta", "gamma")),
        haiku_case(
            "batch_norm_with_state",
            lambda x: hk.BatchNorm(True, True, 0.9, name="norm")(
                hk.Linear(5, name="inner")(x), is_training=True
            ),
            _x(4, 3),
            {
                **layer("inner", DENSE, "dense_with_bias"),
                **layer("norm", SAS, "normalization", ("offset", "scale")),
            },
            {DENSE: 1, SAS: 1},
            with_state=True,
        ),
        cnn_case(),
        jit_apply_case(),
        haiku_case(
            "embed",
            embed_forward,
            IDS,
            {"embed/embeddings": (EMBED, "embedding", "embed")},
            {EMBED: 1},
        ),
        shared_linear_case(),
    ]
    return cases


def shared_forward(x: jax.Array) -> jax.Array:
    """One ``hk.Linear`` applied twice (tied weights of the same kind of layer), then a head."""
    shared = hk.Linear(4, name="shared")
    h = jnp.tanh(shared(x))
    h = jnp.tanh(shared(h))
    return hk.Linear(3, name="head")(h)


def shared_linear_case() -> Case:
    expected = {
        **layer("shared", DENSE, "dense_with_bias"),
        **layer("head", DENSE, "dense_with_bias"),
    }
    uses = {"shared/b": 2, "shared/w": 2}
    return haiku_case(
        "shared_linear", shared_forward, _x(3, 4), expected, {DENSE: 3}, "softmax", uses=uses
    )


def jit_apply_case() -> Case:
    """The whole ``model.apply`` wrapped in `jax.jit`."""
    model = hk.without_apply_rng(hk.transform(lambda x: hk.nets.MLP([8, 3])(x)))
    x = _x(3, 5)
    params = random_init(model.init, x, np.random.default_rng(0))
    apply = jax.jit(model.apply)
    t = jnp.asarray([0, 2, 1], jnp.int32)

    def loss(params, batch):
        x, t = batch
        return softmax_loss(apply(params, x), t)

    expected = {
        **layer("mlp/~/linear_0", DENSE, "dense_with_bias"),
        **layer("mlp/~/linear_1", DENSE, "dense_with_bias"),
    }
    return Case("jit_apply", loss, params, (x, t), expected, {DENSE: 2})
