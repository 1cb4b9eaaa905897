"""Parameters tiled or broadcast into the batch.

A learned query of an attention-pooling head (big_vision's MAP head:
``jnp.tile(probe, [B, 1, 1])`` as the query of ``nn.MultiHeadDotProductAttention``), a
class token concatenated to the tokens, a mask token put in place of masked tokens, a
learned initial state of an RNN: each is a parameter used as it is by every example.
Detection reads it as a shift-only scale-and-shift layer on zeros (``broadcast_parameter``):
its per-example gradient is the cotangent of its copy, its uses over the tiled axis sum
into one block. For each: the pattern finds it (``tile``, ``broadcast_to``,
``broadcast_in_dim``, ``repeat``), nothing is unmatched, noted or warned, and the
curvature (``ggn_exact``, float64) equals that of the model with the parameter tagged by
hand (``kfacx.register_scale_and_shift(tiled, zeros, shift=probe)``). A bias broadcast
before it is added stays its layer's; a parameter broadcast along another axis than the
batch is not a layer. A few `kfacx.Optimizer` steps train an attention-pooling head with
a lingvo-style layer norm.
"""

from __future__ import annotations

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kfacx
from kfacx.graph_matcher import GraphPattern

from . import _models as M
from ._hand_tagging import assert_curvature_equals_hand_tagging, random_params

B, T, D, C = 3, 4, 6, 3
SAS, PATTERN = "scale_and_shift_tag", "broadcast_parameter"

#: name -> (probe shape, the probe tiled to ``[B, 1, D]``).
TILINGS = {
    "tile": ((1, 1, D), lambda p: jnp.tile(p, [B, 1, 1])),
    "broadcast_to": ((1, 1, D), lambda p: jnp.broadcast_to(p, (B, 1, D))),
    "broadcast_in_dim": ((D,), lambda p: jax.lax.broadcast_in_dim(p, (B, 1, D), (2,))),
    "repeat": ((1, 1, D), lambda p: jnp.repeat(p, B, axis=0)),
}


def _wide(logits):
    """The logits in float32 (float64 ones kept)."""
    return logits if logits.dtype == jnp.float64 else logits.astype(jnp.float32)


def _shared(tag, tiled, param):
    """``tiled``, registered by hand as a shift on zeros if ``tag``."""
    if not tag:
        return tiled
    return kfacx.register_scale_and_shift(tiled, jnp.zeros_like(tiled), shift=param)


def _lingvo_layer_norm(h, g, b):
    m, v = jnp.mean(h, -1, keepdims=True), jnp.var(h, -1, keepdims=True)
    return (h - m) * ((1 + g[None, None]) / jnp.sqrt(v + 1e-6)) + b[None, None]


def pooling_loss(tiling, tag=False):
    """A single-head attention-pooling head on raw parameters: the tiled probe is the
    query (``q = tile(probe) @ wq``, no bias), the inputs the keys and values; a
    lingvo-style layer norm and a linear head."""
    tile = TILINGS[tiling][1]

    def loss(p, batch):
        x, labels = batch
        q = _shared(tag, tile(p["probe"].astype(x.dtype)), p["probe"]) @ p["wq"].astype(x.dtype)
        k, v = x @ p["wk"].astype(x.dtype), x @ p["wv"].astype(x.dtype)
        att = jax.nn.softmax(jnp.einsum("bqd,bkd->bqk", q, k) / np.sqrt(D), axis=-1)
        o = jnp.einsum("bqk,bkd->bqd", att, v) @ p["wo"].astype(x.dtype)
        h = _lingvo_layer_norm(o, p["ln_g"].astype(x.dtype), p["ln_b"].astype(x.dtype))
        return M.softmax_loss(_wide(h[:, 0] @ p["head"].astype(x.dtype)), labels)

    return loss


def pooling_args(tiling, dtype=np.float32):
    rng = np.random.default_rng(0)
    shapes = dict(
        probe=TILINGS[tiling][0], wq=(D, D), wk=(D, D), wv=(D, D), wo=(D, D), ln_g=(D,), ln_b=(D,)
    )
    p = {k: rng.standard_normal(s) / np.sqrt(s[0]) for k, s in shapes.items()}
    p["head"] = rng.standard_normal((D, C))
    param_dtype = np.float64 if dtype == np.float64 else np.float32
    p = {k: np.asarray(v, param_dtype) for k, v in p.items()}
    x = jnp.asarray(rng.standard_normal((B, T, D)), dtype)
    return p, (x, jnp.asarray(np.arange(B) % C, jnp.int32))


POOLING_EXPECTED = {
    "probe": (SAS, PATTERN),
    **{w: ("dense_tag", "dense") for w in ("wq", "wk", "wv", "wo", "head")},
    "ln_b": (SAS, "offset_std_normalization"),
    "ln_g": (SAS, "offset_std_normalization"),
}


def _detect(loss, args):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return kfacx.auto_register_tags(loss, args)[1]


def _assert_found(report, expected):
    assert report.notes == () and report.unmatched == (), str(report)
    got = {e.path: (e.tag, e.source) for e in report.entries if e.path in expected}
    assert got == expected, str(report)


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("tiling", sorted(TILINGS))
def test_a_tiled_query_is_a_broadcast_parameter_layer(tiling, dtype):
    _assert_found(_detect(pooling_loss(tiling), pooling_args(tiling, dtype)), POOLING_EXPECTED)


@pytest.mark.parametrize("tiling", sorted(TILINGS))
def test_a_tiled_query_has_the_hand_tagged_curvature(tiling, x64):
    args = pooling_args(tiling, np.float64)
    report, hand = assert_curvature_equals_hand_tagging(
        pooling_loss(tiling), pooling_loss(tiling, tag=True), args
    )
    assert {e.path: e.source for e in hand.entries}["probe"] == "manual"
    assert {e.path: e.block for e in report.entries}["probe"] == "ScaleAndShiftDiagonal"


# ----------------------------------------------------------------------------- Flax MAP head


class MAPHead(nn.Module):
    """big_vision's multi-head attention-pooling head."""

    tag: bool = False

    @nn.compact
    def __call__(self, x):
        n, _, d = x.shape
        probe = self.param("probe", nn.initializers.normal(0.5), (1, 1, d), x.dtype)
        x = nn.MultiHeadDotProductAttention(num_heads=2)(
            _shared(self.tag, jnp.tile(probe, [n, 1, 1]), probe), x
        )
        y = nn.LayerNorm()(x)
        x = x + nn.Dense(d)(nn.gelu(nn.Dense(2 * d)(y)))
        return nn.Dense(C)(x[:, 0])


def _map_head_case(dtype, tag=False):
    net = MAPHead(tag)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((B, T, D)), dtype)
    params = random_params(net.init, x, dtype)

    def loss(p, batch):
        return M.softmax_loss(_wide(net.apply(p, batch[0])), batch[1])

    return loss, params, (x, jnp.asarray(np.arange(B) % C, jnp.int32))


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_flax_map_head_probe_is_a_broadcast_parameter_layer(dtype):
    loss, params, batch = _map_head_case(dtype)
    report = _detect(loss, (params, batch))
    attention = "params/MultiHeadDotProductAttention_0"
    expected = {
        "params/probe": (SAS, PATTERN),
        f"{attention}/query/bias": ("dense_tag", "dense_with_bias"),
        "params/LayerNorm_0/bias": (SAS, "normalization"),
    }
    _assert_found(report, expected)


def test_flax_map_head_has_the_hand_tagged_curvature(x64):
    loss, params, batch = _map_head_case(np.float64)
    hand_loss = _map_head_case(np.float64, tag=True)[0]
    _, hand = assert_curvature_equals_hand_tagging(loss, hand_loss, (params, batch))
    assert {e.path: e.source for e in hand.entries}["params/probe"] == "manual"


# ----------------------------------------------------------------------------- other uses


def _class_token(p, x):
    """ViT's class token, tiled and put before the tokens."""
    tokens = jnp.concatenate([jnp.tile(p["token"], [x.shape[0], 1, 1]), x @ p["w"]], axis=1)
    return jnp.mean(jnp.tanh(tokens), axis=1)


def _mask_token(p, x):
    """A mask token in place of every other token (BERT, MAE)."""
    h = x @ p["w"]
    masked = jnp.broadcast_to((jnp.arange(T) % 2 == 0)[None, :, None], h.shape)
    return jnp.mean(jnp.tanh(jnp.where(masked, jnp.broadcast_to(p["token"], h.shape), h)), axis=1)


def _initial_state(p, x):
    """A learned initial state of an RNN, broadcast to the batch (the scan's carry)."""

    def step(h, x_t):
        return jnp.tanh(x_t @ p["w"] + h @ p["wh"]), None

    h0 = jnp.broadcast_to(p["token"][None], (x.shape[0], D))
    return jax.lax.scan(step, h0, jnp.swapaxes(x, 0, 1))[0]


#: name -> (features ``f(p, x)`` of shape [B, D], token shape).
USES = {
    "class_token": (_class_token, (1, 1, D)),
    "mask_token": (_mask_token, (D,)),
    "initial_state": (_initial_state, (D,)),
}


def _use_case(name):
    features, token_shape = USES[name]
    rng = np.random.default_rng(2)
    p = dict(
        token=rng.standard_normal(token_shape),
        w=rng.standard_normal((D, D)) / 3,
        wh=rng.standard_normal((D, D)) / 3,
        head=rng.standard_normal((D, C)),
    )
    if name != "initial_state":
        del p["wh"]
    p = {k: jnp.asarray(v, jnp.float32) for k, v in p.items()}
    x = jnp.asarray(rng.standard_normal((B, T, D)), jnp.float32)

    def loss(p, batch):
        return M.softmax_loss(features(p, batch[0]) @ p["head"], batch[1])

    return loss, p, (x, jnp.asarray(np.arange(B) % C, jnp.int32))


@pytest.mark.parametrize("name", sorted(USES))
def test_tokens_and_states_shared_by_every_example_are_broadcast_parameter_layers(name):
    loss, params, batch = _use_case(name)
    _assert_found(_detect(loss, (params, batch)), {"token": (SAS, PATTERN)})


def test_a_parameter_broadcast_along_another_axis_is_no_layer():
    """Broadcast to ``[T, D]`` (T is no batch size): not a layer of its own; the
    parameter is unmatched, with the usual warning."""

    def loss(p, batch):
        x, t = batch
        offset = jnp.sum(jnp.sin(jnp.broadcast_to(p["p"], (T + 1, D))), axis=0)
        return M.squared_loss(x @ p["w"] + offset[None], t)

    params = dict(p=jnp.ones(D), w=jnp.ones((3, D)))
    batch = (jnp.ones((B, 3)), jnp.ones((B, D)))
    with pytest.warns(UserWarning, match=r"\['p'\]"):
        _, report = kfacx.auto_register_tags(loss, (params, batch))
    assert report.unmatched == ("p",)


def test_a_parameter_with_a_leading_axis_of_its_own_is_no_broadcast_layer():
    """A ``[B, D]`` parameter (its leading size that of the batch) reshaped to ``[B, 1, D]``
    is not shared by the examples: not a broadcast parameter."""

    def loss(p, batch):
        x, t = batch
        return M.squared_loss(x @ p["w"] + jnp.sin(p["p"].reshape(B, 1, D))[:, 0], t)

    params = dict(p=jnp.ones((B, D)), w=jnp.ones((3, D)))
    batch = (jnp.ones((B, 3)), jnp.ones((B, D)))
    with pytest.warns(UserWarning, match=r"\['p'\]"):
        _, report = kfacx.auto_register_tags(loss, (params, batch))
    assert report.unmatched == ("p",)


def test_a_pattern_without_inputs_has_one_parameter():
    with pytest.raises(ValueError, match="without inputs"):
        GraphPattern(
            name="two_broadcast_parameters",
            tag_primitive=kfacx.tags.scale_and_shift,
            compute_func=lambda p: p[0] + p[1],
            parameters_extractor_func=lambda eqns: {},
            example_args=[[np.zeros(3), np.zeros(3)]],
        )


# ----------------------------------------------------------------------------- training


def test_attention_pooling_with_a_lingvo_norm_trains():
    """A few `kfacx.Optimizer` steps on the tiled-query head (with its lingvo-style layer
    norm, `test_norm_orderings`) lower the loss; nothing warns, no step is skipped."""
    loss = pooling_loss("tile")
    params, batch = pooling_args("tile")
    opt = kfacx.Optimizer(
        jax.value_and_grad(loss),
        learning_rate_schedule=0.05,
        momentum_schedule=0.5,
        initial_damping=1e-2,
        num_burnin_steps=0,
    )
    losses = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state = opt.init(params, jax.random.PRNGKey(0), batch)
        for i in range(4):
            params, state, stats = opt.step(params, state, jax.random.PRNGKey(1 + i), batch=batch)
            assert not bool(stats["skipped"]), stats
            losses.append(float(stats["loss"]))
    assert opt.estimator.report.unmatched == (), str(opt.estimator.report)
    assert np.all(np.isfinite(losses)) and losses[-1] < 0.3 * losses[0], losses
