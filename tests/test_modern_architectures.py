"""Modern architectures under automatic detection: what works today keeps working.

Small models written in plain JAX the way people write them: a one-block decoder
with GQA attention (einsum projections on raw parameters, fewer kv heads than q
heads, RMS qk-norm, a causal softmax), a SwiGLU MLP, embeddings by `jnp.take` or
by a one-hot product, tied or untied output; LoRA adapters; MoE routers and
experts (top-k gates over all-token experts, and a capacity-limited dispatch
tensor); NCHW convolutions written with `lax.conv_general_dilated`; bfloat16
compute on float32 parameters. For each model: every parameter gets the layer it
should (never the fallback block), the report has no note and kfacx warns
nothing, a few `kfacx.Optimizer` steps lower the loss with finite curvature
statistics, and where hand tagging is easy the curvature equals the hand-tagged
model's (float64, ``ggn_exact``).

A parameter cast to bfloat16 *before* it enters a `jit` body (`jnp.take` is one, so
Flax's ``nn.Embed(dtype=jnp.bfloat16)``) or a `jax.checkpoint` body is recognised inside
it (`kfacx._helpers._jaxpr.sink_invariants` moves the cast into the body).

The models and the checks live in tests/_modern_models.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _modern_models import (
    DENSE,
    DENSE_WITH_BIAS,
    D,
    E,
    V,
    _assert_curvature_equals_hand_tagging,
    _assert_matched,
    _detect,
    _f32,
    _lm_expected,
    _normal,
    _swiglu,
    _train,
    _xent,
    conv_batch,
    conv_loss,
    conv_params,
    lm_batch,
    lm_loss,
    lm_params,
    lora_loss,
    lora_params,
    moe_loss,
    moe_params,
    token_batch,
)


@pytest.fixture
def x64():
    with jax.enable_x64(True):
        yield


# ----------------------------------------------------------------------------- tests

#: name -> (lm_logits options, tied output)
LM_CONFIGS = {
    "take": (dict(), False),
    "take_tied_gemma": (dict(norm="gemma"), True),
    "one_hot_tied_grouped_gemma": (dict(embed="one_hot", grouping="reshape", norm="gemma"), True),
    "bf16_one_hot": (dict(embed="one_hot", precision="bf16"), False),
    "bf16_upcast_one_hot_tied": (dict(embed="one_hot", precision="bf16_upcast"), True),
    # The table is cast to bfloat16 before `jnp.take` (a jit): the cast is moved into it.
    "bf16_take": (dict(precision="bf16"), False),
    # Tied: both uses are seen (before the move, the lookup was missed silently).
    "bf16_take_tied": (dict(precision="bf16"), True),
}


def _lm_case(config):
    kwargs, tied = LM_CONFIGS[config]
    expected = _lm_expected(kwargs.get("embed", "take"), tied, kwargs.get("norm", "plain"))
    return kwargs, tied, expected


@pytest.mark.parametrize("config", LM_CONFIGS)
def test_lm_every_parameter_gets_its_layer(config):
    """Dense projections (einsum q/k/v/o, SwiGLU, output), scale layers (RMSNorms and
    qk-norms), the lookup (embedding) or one-hot product (dense), a tied table one layer of
    both its uses; no fallback, no note, no warning."""
    kwargs, tied, expected = _lm_case(config)
    _assert_matched(_detect(lm_loss(**kwargs), _f32(lm_params(tied)), lm_batch()), expected)


@pytest.mark.parametrize("config", ["take", "bf16_take_tied"])
def test_lm_trains(config):
    kwargs, tied, expected = _lm_case(config)
    report, losses = _train(lm_loss(**kwargs), _f32(lm_params(tied)), lm_batch(), 4, 0.05)
    _assert_matched(report, expected)
    assert losses[-1] < 0.7 * losses[0], losses


@pytest.mark.parametrize("config", ["take", "one_hot_tied_grouped_gemma"])
def test_lm_curvature_equals_hand_tagging(x64, config):
    kwargs, tied, expected = _lm_case(config)
    args = (lm_params(tied), lm_batch(dtype=jnp.int64))
    report = _assert_curvature_equals_hand_tagging(
        lm_loss(**kwargs), lm_loss(tag=True, **kwargs), args
    )
    _assert_matched(report, expected)


@pytest.mark.parametrize("frozen", [False, True], ids=["trained_base", "frozen_base"])
def test_lora_adapters_are_two_dense_layers(frozen):
    """``x @ w + b + (x @ a) @ b_lora * s``: the base projection (if trained) is a dense
    layer with its bias, each factor of the adapter a dense layer; with the base frozen
    (closed over by the loss) only the adapter and the head are parameters."""
    params, base = lora_params(frozen)
    loss = lora_loss(None if base is None else _f32(base))
    report = _detect(loss, _f32(params), token_batch())
    expected = dict(lora_a=DENSE, lora_b=DENSE, head=DENSE_WITH_BIAS, head_b=DENSE_WITH_BIAS)
    if not frozen:
        expected |= dict(w=DENSE_WITH_BIAS, b=DENSE_WITH_BIAS)
    _assert_matched(report, expected)
    layers = {e.path: e.layer for e in report.entries}
    assert len(set(layers.values())) == (3 if frozen else 4), str(report)


def test_lora_with_a_frozen_base_trains():
    """The adapter's second factor starts at zero (so the first gets no gradient and no
    output-side curvature at the first step), as LoRA initialises it."""
    params, base = lora_params(frozen=True)
    _, losses = _train(lora_loss(_f32(base)), _f32(params), token_batch(), 4, 0.1)
    assert losses[-1] < 0.7 * losses[0], losses


def _moe_expected(kind):
    shared_input = ("dense_tag", "weight_first_shared_input_stacked_dense")
    expert_in = shared_input if kind == "topk" else DENSE
    return dict(router=DENSE, head=DENSE, w_gate=expert_in, w_up=expert_in, w_down=DENSE)


@pytest.mark.parametrize("kind", ["topk", "dispatch"])
def test_moe_router_and_experts_are_matched_and_train(kind):
    """The router is a dense layer; each expert weight ``[E, ...]`` is ``E`` dense layers
    (one block per expert), whether every expert sees every token
    (``einsum('nd,edf->enf')``) or its slots of a dispatch tensor
    (``einsum('ecd,edf->ecf')``)."""
    report, losses = _train(moe_loss(kind), _f32(moe_params()), token_batch(), 4, 0.1)
    _assert_matched(report, _moe_expected(kind))
    stacks = {e.path: e.stack_size for e in report.entries}
    assert stacks == dict(router=None, head=None, w_gate=E, w_up=E, w_down=E), str(report)
    assert losses[-1] < 0.7 * losses[0], losses


def test_moe_experts_on_all_tokens_equal_hand_tagging(x64):
    """``einsum('nd,edf->enf')`` (`jnp.einsum` emits ``dot_general(w, x)`` and a
    transpose) is the stacked dense layer on ``x`` broadcast to the experts."""
    x, labels = token_batch()
    args = (moe_params(), (np.asarray(x, np.float64), labels))
    report = _assert_curvature_equals_hand_tagging(
        moe_loss("topk"), moe_loss("topk", tag=True), args
    )
    _assert_matched(report, _moe_expected("topk"))


CONV_EXPECTED = dict(
    w1=("conv_tag", "conv_with_bias"),
    b1=("conv_tag", "conv_with_bias"),
    w2=("conv_tag", "conv_with_bias"),
    b2=("conv_tag", "conv_with_bias"),
    head=DENSE,
)


def test_nchw_conv_with_broadcast_bias_is_matched_and_trains():
    report, losses = _train(conv_loss(), _f32(conv_params()), conv_batch(), 4, 0.05)
    _assert_matched(report, CONV_EXPECTED)
    assert losses[-1] < 0.7 * losses[0], losses


def test_nchw_conv_curvature_equals_hand_tagging(x64):
    x, labels = conv_batch()
    args = (conv_params(), (np.asarray(x, np.float64), labels))
    report = _assert_curvature_equals_hand_tagging(conv_loss(), conv_loss(tag=True), args)
    _assert_matched(report, CONV_EXPECTED)


def _flax_embed(dtype):
    """A Flax linen LM computing in ``dtype`` (float32 parameters): `nn.Embed` casts its
    table to ``dtype``, then looks it up with `jnp.take`."""
    nn = pytest.importorskip("flax.linen")

    class Model(nn.Module):
        @nn.compact
        def __call__(self, ids):
            h = nn.Embed(V, D, dtype=dtype, name="embed")(ids)
            h = jnp.tanh(nn.Dense(D, dtype=dtype, name="hidden")(h))
            return nn.Dense(V, dtype=dtype, name="out")(h).astype(jnp.float32)

    model, rng = Model(), np.random.default_rng(0)
    layers = dict(
        embed=dict(embedding=_normal(rng, V, D, fan_in=D)),
        hidden=dict(kernel=_normal(rng, D, D, fan_in=D), bias=np.zeros(D)),
        out=dict(kernel=_normal(rng, D, V, fan_in=D), bias=np.zeros(V)),
    )

    def loss(p, batch):
        return _xent(model.apply(p, batch[0]).reshape(-1, V), batch[1].reshape(-1))

    expected = {
        f"params/{n}/{k}": DENSE_WITH_BIAS for n in ("hidden", "out") for k in ("bias", "kernel")
    }
    expected["params/embed/embedding"] = ("embedding_tag", "embedding")
    return loss, _f32(dict(params=layers)), lm_batch(), expected


def _checkpointed_block(dtype):
    """Parameters cast to ``dtype`` once, then a SwiGLU block under `jax.checkpoint`
    (rematerialisation)."""

    def loss(p, batch):
        x, labels = batch
        p = jax.tree.map(lambda a: a.astype(dtype), p)
        h = x.astype(dtype)
        h = h + jax.checkpoint(_swiglu, static_argnums=2)(p["mlp"], h, False)
        return _xent((h @ p["head"]).astype(jnp.float32).reshape(-1, 3), labels.reshape(-1))

    params = _f32(dict(mlp=lm_params(True)["mlp"], head=lora_params(False)[0]["head"]))
    expected = {f"mlp/{k}": DENSE for k in ("w_gate", "w_up", "w_down")} | dict(head=DENSE)
    return loss, params, token_batch(), expected


@pytest.mark.parametrize(
    ("make", "dtype"),
    [
        pytest.param(_flax_embed, jnp.float32, id="flax_embed_f32"),
        pytest.param(_flax_embed, jnp.bfloat16, id="flax_embed_bf16"),
        pytest.param(_checkpointed_block, jnp.float32, id="checkpoint_f32"),
        pytest.param(_checkpointed_block, jnp.bfloat16, id="checkpoint_bf16"),
    ],
)
def test_parameters_cast_before_a_call_boundary(make, dtype):
    """Parameters cast to bfloat16 before a call: Flax's `nn.Embed(dtype=jnp.bfloat16)`
    (the cast table enters `jnp.take`) and a `jax.checkpoint`-ed block; and the same
    models in float32."""
    loss, params, batch, expected = make(dtype)
    _assert_matched(_detect(loss, params, batch), expected)
