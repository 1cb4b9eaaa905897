"""Small models for the layer-detection tests, with what detection should find in them.

Every builder returns a `Case`: an *untagged* loss ``loss(params, batch)``
(only the loss is registered), example arguments, and the expected
registration of every parameter leaf. Builders named ``hand_*`` return the
same models with every layer tagged by hand (``kfacx.register_*``), for the
curvature-equivalence tests.

This module holds the hand-tagged models and re-exports the rest: the `Case` record and
the losses (tests/graph_matcher/_model_base.py), the haiku models
(tests/graph_matcher/_haiku_models.py) and the raw-parameter models
(tests/graph_matcher/_raw_models.py).

Model code broadcasts explicitly: the test suite runs with
``jax_numpy_rank_promotion="raise"``.
"""

from __future__ import annotations

import haiku as hk
import jax
import jax.numpy as jnp

import kfacx

from ._haiku_models import (
    IDS,
    FiLM,
    OffsetRMSNorm,
    _x,
    cnn_case,
    cnn_forward,
    embed_forward,
    film_forward,
    haiku_case,
    haiku_cases,
    haiku_model,
    jit_apply_case,
    ln_forward,
    mlp_case,
    offset_rms_forward,
    random_init,
    rms_forward,
    shared_forward,
    shared_linear_case,
)
from ._model_base import (
    CONV,
    DENSE,
    EMBED,
    GENERIC,
    NHWC,
    SAS,
    Case,
    _loss_on,
    layer,
    normal,
    softmax_loss,
    squared_loss,
)
from ._raw_models import (
    add_bias,
    dense,
    dense_custom_jvp,
    einsum_case,
    manual_plus_auto_case,
    raw_cases,
    tied_loss,
    tied_params,
    transposed_weight_loss,
    transposed_weight_params,
    two_layer_batch,
    two_layer_params,
    unmatched_loss,
    unmatched_params,
    wrapped_layer_case,
)

# The models of the other modules, re-exported: the tests use them as ``_models.X``.
__all__ = [
    "BLOCK_OF_TAG",
    "CONV",
    "Case",
    "DENSE",
    "EMBED",
    "FiLM",
    "GENERIC",
    "IDS",
    "NHWC",
    "OffsetRMSNorm",
    "SAS",
    "add_bias",
    "cnn_case",
    "cnn_forward",
    "dense",
    "dense_custom_jvp",
    "einsum_case",
    "embed_forward",
    "equivalence_models",
    "film_forward",
    "haiku_case",
    "haiku_cases",
    "haiku_model",
    "hand_cnn_logits",
    "hand_embed_out",
    "hand_film_out",
    "hand_ln_out",
    "hand_mlp_logits",
    "hand_offset_rms_out",
    "hand_rms_out",
    "hand_shared_logits",
    "jit_apply_case",
    "layer",
    "ln_forward",
    "manual_plus_auto_case",
    "mlp_case",
    "normal",
    "offset_rms_forward",
    "random_init",
    "raw_cases",
    "rms_forward",
    "shared_forward",
    "shared_linear_case",
    "softmax_loss",
    "squared_loss",
    "tied_loss",
    "tied_params",
    "transposed_weight_loss",
    "transposed_weight_params",
    "two_layer_batch",
    "two_layer_params",
    "unmatched_loss",
    "unmatched_params",
    "wrapped_layer_case",
]

# ----------------------------------------------------------------------------- hand-tagged models


def _ln_hand(h, scale, offset, eps=1e-5):
    mean = jnp.mean(h, axis=-1, keepdims=True)
    var = jnp.var(h, axis=-1, keepdims=True)
    x_hat = (h - mean) * jax.lax.rsqrt(var + eps)
    y = x_hat * scale[None, :] + offset[None, :]
    return kfacx.register_scale_and_shift(y, x_hat, scale, offset)


def _rms_hand(h, scale, eps=1e-5):
    x_hat = h * jax.lax.rsqrt(jnp.mean(jnp.square(h), axis=-1, keepdims=True) + eps)
    return kfacx.register_scale_and_shift(x_hat * scale[None, :], x_hat, scale)


def _dense_hand(x, p):
    return kfacx.register_dense(dense(x, p["w"], p["b"]), x, p["w"], p["b"])


def _conv_hand(x, p, stride):
    kw = dict(window_strides=(stride, stride), padding="SAME", dimension_numbers=NHWC)
    y = jax.lax.conv_general_dilated(x, p["w"], **kw)
    return kfacx.register_conv(add_bias(y, p["b"]), x, p["w"], p["b"], **kw)


def hand_shared_logits(params, x):
    h = jnp.tanh(_dense_hand(x, params["shared"]))
    h = jnp.tanh(_dense_hand(h, params["shared"]))
    return _dense_hand(h, params["head"])


def hand_embed_out(params, ids):
    table = params["embed"]["embeddings"]
    return kfacx.register_embedding(jnp.take(table, ids, axis=0), ids, table)


def hand_mlp_logits(params, x):
    h = x
    for i in range(3):
        h = _dense_hand(h, params[f"mlp/~/linear_{i}"])
        if i < 2:
            h = jax.nn.relu(h)
    return h


def hand_cnn_logits(params, x):
    h = jax.nn.relu(_conv_hand(x, params["conv_a"], 1))
    h = _conv_hand(h, params["conv_b"], 2)
    return _dense_hand(h.reshape(h.shape[0], -1), params["head"])


def hand_ln_out(params, x):
    h = _dense_hand(x, params["inner"])
    h = _ln_hand(h, params["norm"]["scale"], params["norm"]["offset"])
    return _dense_hand(jnp.tanh(h), params["head"])


def hand_rms_out(params, x):
    h = _dense_hand(x, params["inner"])
    h = _rms_hand(h, params["norm"]["scale"])
    return _dense_hand(jnp.tanh(h), params["head"])


def hand_offset_rms_out(params, x):
    h = _dense_hand(x, params["inner"])
    scale = params["norm"]["scale"]
    x_hat = h * jax.lax.rsqrt(jnp.mean(jnp.square(h), axis=-1, keepdims=True) + 1e-6)
    y = x_hat * jnp.broadcast_to(1 + scale, x_hat.shape)
    h = kfacx.register_scale_and_shift(y, x_hat, scale, scale_offset=1.0)
    return _dense_hand(jnp.tanh(h), params["head"])


def hand_film_out(params, x):
    h = _dense_hand(x, params["inner"])
    gamma, beta = params["norm"]["gamma"], params["norm"]["beta"]
    y = h * (1 + gamma)[None, :] + beta[None, :]
    h = kfacx.register_scale_and_shift(y, h, gamma, beta, scale_offset=1.0)
    return _dense_hand(jnp.tanh(h), params["head"])


def equivalence_models() -> dict[str, tuple]:
    """name -> ``(auto_loss, hand_loss, params, batch, expected block per path)``."""
    out = {}
    specs = [
        ("mlp", lambda x: hk.nets.MLP([8, 8, 3])(x), hand_mlp_logits, _x(3, 5), "softmax"),
        ("cnn", cnn_forward, hand_cnn_logits, _x(2, 6, 6, 2), "softmax"),
        ("layer_norm", ln_forward, hand_ln_out, _x(3, 4), "squared"),
        ("rms_norm", rms_forward, hand_rms_out, _x(3, 4), "squared"),
        ("offset_rms_norm", offset_rms_forward, hand_offset_rms_out, _x(3, 4), "squared"),
        ("film", film_forward, hand_film_out, _x(3, 4), "squared"),
        ("shared_linear", shared_forward, hand_shared_logits, _x(3, 4), "softmax"),
        ("embed", embed_forward, hand_embed_out, IDS, "squared"),
    ]
    for name, forward, hand_out, x, kind in specs:
        loss, params, batch = haiku_model(forward, x, kind, seed=7)

        def hand_loss(params, batch, hand_out=hand_out, kind=kind):
            x, t = batch
            return _loss_on(kind, hand_out(params, x), t)

        out[name] = (loss, hand_loss, params, batch)
    return out


BLOCK_OF_TAG = {
    DENSE: "DenseTwoKroneckerFactored",
    CONV: "ConvTwoKroneckerFactored",
    SAS: "ScaleAndShiftDiagonal",
    EMBED: "EmbeddingKroneckerFactored",
    GENERIC: "Diagonal",
}
