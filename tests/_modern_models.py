"""The models of tests/test_modern_architectures.py, written in plain JAX the way people
write them, each with a hand-tagged twin (``tag=True``): a one-block decoder LM (GQA
attention, RMS qk-norm, SwiGLU, embeddings by `jnp.take` or one-hot, tied or untied
output), LoRA adapters, MoE routers and experts, NCHW convolutions; and the checks run
on them (detection report, a few `kfacx.Optimizer` steps, ``ggn_exact`` curvature
against hand tagging).
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np

import kfacx

B, T, D, V = 8, 6, 16, 12  # batch, sequence, width, vocabulary
HQ, HKV, K, F = 4, 2, 4, 16  # q heads, kv heads, head size, MLP width
E, TOPK, CAPACITY, FE = 4, 2, 16, 8  # experts, experts per token, capacity, expert width
R, LORA_SCALE = 2, 2.0  # LoRA rank and alpha / rank
STACKED = (((2,), (1,)), ((0,), (0,)))  # x [M, N, d] . w [M, d, f]: one layer per slice
DENSE, DENSE_WITH_BIAS = ("dense_tag", "dense"), ("dense_tag", "dense_with_bias")


def _normal(rng, *shape, fan_in=1.0):
    return rng.normal(size=shape) / np.sqrt(fan_in)


def _features(v, ndim):
    """A per-feature vector broadcast explicitly over the leading axes."""
    return v.reshape((1,) * (ndim - 1) + (-1,))


def _dense(tag, y, x, w, dimension_numbers=None):
    """``y``, registered as a dense layer if ``tag`` (the hand-tagged model)."""
    return kfacx.register_dense(y, x, w, None, dimension_numbers) if tag else y


def _tag(tag, register, y, *args, **kwargs):
    """``register(y, *args, **kwargs)`` for the hand-tagged model, else ``y``."""
    return register(y, *args, **kwargs) if tag else y


def _xent(logits, targets):
    logits = kfacx.register_softmax_cross_entropy_loss(logits, targets)
    log_p = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(log_p, targets[:, None], axis=1))


# ----------------------------------------------------------------------------- a modern LM


def _rms_norm(x, scale, style, tag):
    """RMSNorm with a learned scale, the statistics in float32; ``style="gemma"`` stores
    the scale as its offset from 1 (``x * (1 + scale)``)."""
    x32 = x.astype(jnp.float32)
    normed = (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6)).astype(x.dtype)
    if style == "gemma":  # As Gemma writes it: the scale broadcast first, then offset.
        y = normed * (1 + jnp.expand_dims(scale, axis=range(x.ndim - 1)))
        return _tag(tag, kfacx.register_scale_and_shift, y, normed, scale, scale_offset=1.0)
    return _tag(
        tag, kfacx.register_scale_and_shift, normed * _features(scale, x.ndim), normed, scale
    )


def _gqa(p, x, grouping, norm, upcast, tag):
    """Causal grouped-query attention with qk-norm. ``grouping``: "repeat" repeats the kv
    heads to the q heads; "reshape" splits the q heads into [kv head, group] instead."""
    b, t, _ = x.shape
    q = _dense(tag, jnp.einsum("btd,dhk->bthk", x, p["wq"]), x, p["wq"])
    k = _dense(tag, jnp.einsum("btd,dgk->btgk", x, p["wk"]), x, p["wk"])
    v = _dense(tag, jnp.einsum("btd,dgk->btgk", x, p["wv"]), x, p["wv"])
    q, k = _rms_norm(q, p["q_norm"], norm, tag), _rms_norm(k, p["k_norm"], norm, tag)
    # A NumPy scalar is not weakly typed: it promotes bfloat16 logits to float32 (and from
    # there the attention output and the residual stream), a common slip.
    inv_sqrt = 1 / np.sqrt(np.float32(K)) if upcast else K**-0.5
    causal = jnp.tril(jnp.ones((t, t), bool))
    if grouping == "repeat":
        k, v = jnp.repeat(k, HQ // HKV, axis=2), jnp.repeat(v, HQ // HKV, axis=2)
        logits = jnp.einsum("bthk,bshk->bhts", q, k) * inv_sqrt
        logits = jnp.where(causal[None, None], logits, jnp.finfo(logits.dtype).min)
        o = jnp.einsum("bhts,bshk->bthk", jax.nn.softmax(logits, axis=-1), v)
    else:
        qg = q.reshape(b, t, HKV, HQ // HKV, K)
        logits = jnp.einsum("btgrk,bsgk->bgrts", qg, k) * inv_sqrt
        logits = jnp.where(causal[None, None, None], logits, jnp.finfo(logits.dtype).min)
        o = jnp.einsum("bgrts,bsgk->btgrk", jax.nn.softmax(logits, axis=-1), v)
        o = o.reshape(b, t, HQ, K)
    out = jnp.einsum("bthk,hkd->btd", o, p["wo"])
    return _dense(tag, out, o, p["wo"], (((2, 3), (0, 1)), ((), ())))


def _swiglu(p, x, tag):
    gate = _dense(tag, x @ p["w_gate"], x, p["w_gate"])
    up = _dense(tag, x @ p["w_up"], x, p["w_up"])
    h = jax.nn.silu(gate) * up
    return _dense(tag, h @ p["w_down"], h, p["w_down"])


def lm_params(tied, seed=0):
    rng = np.random.default_rng(seed)
    p = dict(
        embed=_normal(rng, V, D, fan_in=D),
        attn_norm=1.0 + 0.1 * _normal(rng, D),
        attn=dict(
            wq=_normal(rng, D, HQ, K, fan_in=D),
            wk=_normal(rng, D, HKV, K, fan_in=D),
            wv=_normal(rng, D, HKV, K, fan_in=D),
            q_norm=1.0 + 0.1 * _normal(rng, K),
            k_norm=1.0 + 0.1 * _normal(rng, K),
            wo=_normal(rng, HQ, K, D, fan_in=HQ * K),
        ),
        mlp_norm=1.0 + 0.1 * _normal(rng, D),
        mlp=dict(
            w_gate=_normal(rng, D, F, fan_in=D),
            w_up=_normal(rng, D, F, fan_in=D),
            w_down=_normal(rng, F, D, fan_in=F),
        ),
        final_norm=1.0 + 0.1 * _normal(rng, D),
    )
    if not tied:
        p["unembed"] = _normal(rng, D, V, fan_in=D)
    return p


def lm_logits(p, ids, embed="take", grouping="repeat", norm="plain", precision="f32", tag=False):
    """One pre-norm decoder block: embedding, GQA attention and SwiGLU MLP with residuals,
    final RMSNorm, output projection (by the embedding table, transposed, if ``p`` has no
    ``unembed``). ``precision``: "f32"; "bf16" (parameters and activations cast to
    bfloat16, float32 logits); "bf16_upcast" (the same, with the attention promoted to
    float32 by a NumPy scalar: float32 activations meet bfloat16 weights)."""
    if precision != "f32":
        p = jax.tree.map(lambda a: a.astype(jnp.bfloat16), p)
    table = p["embed"]
    if embed == "take":
        x = _tag(tag, kfacx.register_embedding, jnp.take(table, ids, axis=0), ids, table)
    else:
        hot = jax.nn.one_hot(ids, V, dtype=table.dtype)
        x = _dense(tag, hot @ table, hot, table)
    h = _rms_norm(x, p["attn_norm"], norm, tag)
    x = x + _gqa(p["attn"], h, grouping, norm, precision == "bf16_upcast", tag)
    x = x + _swiglu(p["mlp"], _rms_norm(x, p["mlp_norm"], norm, tag), tag)
    h = _rms_norm(x, p["final_norm"], norm, tag)
    if "unembed" in p:
        logits = _dense(tag, h @ p["unembed"], h, p["unembed"])
    else:
        logits = _dense(tag, h @ table.T, h, table, (((2,), (1,)), ((), ())))
    return logits.astype(jnp.float32)


def lm_loss(**kwargs):
    def loss(p, batch):
        ids, targets = batch
        return _xent(lm_logits(p, ids, **kwargs).reshape(-1, V), targets.reshape(-1))

    return loss


def lm_batch(seed=1, dtype=jnp.int32):
    """Sequences of a fixed random permutation with 20 % noise: next-token targets."""
    rng = np.random.default_rng(seed)
    nxt = rng.permutation(V)
    seq = np.zeros((B, T + 1), np.int64)
    seq[:, 0] = rng.integers(0, V, B)
    for i in range(T):
        noise = rng.integers(0, V, B)
        seq[:, i + 1] = np.where(rng.random(B) < 0.2, noise, nxt[seq[:, i]])
    return np.asarray(seq[:, :-1], dtype), np.asarray(seq[:, 1:], dtype)


def _lm_expected(embed, tied, norm):
    """``path -> (tag, pattern)`` the LM's parameters must get."""
    scale = ("scale_and_shift_tag", "offset_scale" if norm == "gemma" else "scale")
    out = {p: DENSE for p in ("attn/wq", "attn/wk", "attn/wv", "attn/wo")}
    out |= {f"mlp/{p}": DENSE for p in ("w_gate", "w_up", "w_down")}
    out |= {p: scale for p in ("attn_norm", "mlp_norm", "final_norm", "attn/q_norm", "attn/k_norm")}
    lookup = ("embedding_tag", "embedding") if embed == "take" else DENSE
    if tied:
        out["embed"] = (f"tied({lookup[0]}, dense_tag)", f"transposed_weight_dense+{lookup[1]}")
    else:
        out |= {"embed": lookup, "unembed": DENSE}
    return out


# ----------------------------------------------------------------------------- LoRA


def lora_params(frozen, seed=0):
    """A LoRA-adapted projection and a head; ``frozen``: ``(trained, base)`` with the base
    weight and bias apart (closed over by the loss, not trained), else one dict."""
    rng = np.random.default_rng(seed)
    trained = dict(
        lora_a=_normal(rng, D, R, fan_in=D),
        lora_b=np.zeros((R, D)),  # the usual initialisation: the adapter starts at 0
        head=_normal(rng, D, 3, fan_in=D),
        head_b=np.zeros(3),
    )
    base = dict(w=_normal(rng, D, D, fan_in=D), b=0.1 * _normal(rng, D))
    return (trained, base) if frozen else ({**trained, **base}, None)


def lora_loss(base=None):
    def loss(p, batch):
        x, labels = batch
        q = p if base is None else base
        y = x @ q["w"] + _features(q["b"], x.ndim) + (x @ p["lora_a"]) @ p["lora_b"] * LORA_SCALE
        logits = jnp.tanh(y) @ p["head"] + _features(p["head_b"], x.ndim)
        return _xent(logits.reshape(-1, 3), labels.reshape(-1))

    return loss


def token_batch(seed=2):
    """Features ``[B, T, D]`` and a 3-class label per position."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(B, T, D))
    return x.astype(np.float32), ((x[..., 0] > 0) + (x[..., 1] > 0)).astype(np.int32)


# ----------------------------------------------------------------------------- MoE


def moe_params(seed=0):
    rng = np.random.default_rng(seed)
    return dict(
        router=_normal(rng, D, E, fan_in=D),
        w_gate=_normal(rng, E, D, FE, fan_in=D),
        w_up=_normal(rng, E, D, FE, fan_in=D),
        w_down=_normal(rng, E, FE, D, fan_in=FE),
        head=_normal(rng, D, 3, fan_in=D),
    )


def _topk_moe(p, x, tag):
    """Mixtral-style: softmax over the top-k router logits; every expert (a SwiGLU) runs on
    every token, ``einsum('nd,edf->enf')``; outputs combined by the gates."""
    router = _dense(tag, x @ p["router"], x, p["router"])
    top, chosen = jax.lax.top_k(router, TOPK)
    gates = jnp.sum(jax.nn.one_hot(chosen, E) * jax.nn.softmax(top)[..., None], axis=1)
    xs = jnp.broadcast_to(x, (E, *x.shape))  # what the hand-tagged layers see

    def expert_in(w):
        return _dense(tag, jnp.einsum("nd,edf->enf", x, w), xs, w, STACKED)

    h = jax.nn.silu(expert_in(p["w_gate"])) * expert_in(p["w_up"])
    y = _dense(tag, jnp.einsum("enf,efd->end", h, p["w_down"]), h, p["w_down"], STACKED)
    return jnp.einsum("ne,end->nd", gates, y)


def _dispatch_moe(p, x, tag):
    """Switch-style: top-1 routing with an expert capacity, a one-hot dispatch tensor
    ``[token, expert, slot]``, experts as ``einsum('ecd,edf->ecf')``, combined by the
    router probability."""
    probs = jax.nn.softmax(_dense(tag, x @ p["router"], x, p["router"]))
    mask = jax.nn.one_hot(jnp.argmax(probs, axis=-1), E)
    slot = ((jnp.cumsum(mask, axis=0) - 1.0) * mask).astype(jnp.int32)
    dispatch = mask[..., None] * jax.nn.one_hot(slot, CAPACITY)  # over capacity: dropped
    combine = dispatch * jnp.max(probs, axis=-1)[:, None, None]
    xe = jnp.einsum("nec,nd->ecd", dispatch, x)

    def expert(w, h):
        return _dense(tag, jnp.einsum("ecd,edf->ecf", h, w), h, w, STACKED)

    h = jax.nn.silu(expert(p["w_gate"], xe)) * expert(p["w_up"], xe)
    return jnp.einsum("nec,ecd->nd", combine, expert(p["w_down"], h))


def moe_loss(kind, tag=False):
    moe = _topk_moe if kind == "topk" else _dispatch_moe

    def loss(p, batch):
        x, labels = batch
        h = x.reshape(-1, D)
        h = h + moe(p, h, tag)
        logits = _dense(tag, h @ p["head"], h, p["head"])
        return _xent(logits, labels.reshape(-1))

    return loss


# ----------------------------------------------------------------------------- NCHW conv

CONV_ARGS = [
    dict(window_strides=(1, 1), padding="SAME"),
    dict(window_strides=(2, 2), padding=((1, 1), (1, 1))),
]
NCHW = ("NCHW", "OIHW", "NCHW")


def conv_params(seed=0):
    rng = np.random.default_rng(seed)
    return dict(
        w1=_normal(rng, 4, 3, 3, 3, fan_in=27),
        b1=0.1 * _normal(rng, 4),
        w2=_normal(rng, 6, 4, 3, 3, fan_in=36),
        b2=0.1 * _normal(rng, 6),
        head=_normal(rng, 6, 3, fan_in=6),
    )


def conv_loss(tag=False):
    def loss(p, batch):
        h, labels = batch
        for i, kw in enumerate(CONV_ARGS, start=1):
            w, b = p[f"w{i}"], p[f"b{i}"]
            y = jax.lax.conv_general_dilated(h, w, **kw, dimension_numbers=NCHW)
            y = y + b[None, :, None, None]
            h = jax.nn.relu(
                _tag(tag, kfacx.register_conv, y, h, w, b, **kw, dimension_numbers=NCHW)
            )
        h = jnp.mean(h, axis=(2, 3))
        return _xent(_dense(tag, h @ p["head"], h, p["head"]), labels)

    return loss


def conv_batch(seed=3):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(B, 3, 6, 6))
    return x.astype(np.float32), ((x[:, 0].mean((1, 2)) > 0) * 2).astype(np.int32)


# ----------------------------------------------------------------------------- checks


def _f32(tree):
    return jax.tree.map(lambda a: np.asarray(a, np.float32), tree)  # (NumPy: no compilation)


def _detect(loss, params, batch):
    """The registration report; detection must warn nothing."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, report = kfacx.auto_register_tags(loss, (params, batch))
    return report


def _assert_matched(report, expected):
    """No note, no unmatched parameter, and ``path -> (tag, pattern)`` as ``expected``."""
    assert report.notes == () and report.unmatched == (), str(report)
    assert {e.path: (e.tag, e.source) for e in report.entries} == expected, str(report)


def _train(loss, params, batch, steps, learning_rate, momentum=0.5):
    """``(report, losses)`` of ``steps`` `kfacx.Optimizer` steps (fixed learning rate and
    momentum, damping 0.01) that warn nothing, skip no step and keep finite statistics."""
    opt = kfacx.Optimizer(
        jax.value_and_grad(loss),
        learning_rate_schedule=learning_rate,
        momentum_schedule=momentum,
        initial_damping=1e-2,
        num_burnin_steps=0,
    )
    losses = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state = opt.init(params, jax.random.PRNGKey(0), batch)
        for i in range(steps):
            params, state, stats = opt.step(params, state, jax.random.PRNGKey(1 + i), batch=batch)
            assert not bool(stats["skipped"]), stats
            losses.append(float(stats["loss"]))
    curvature = [
        np.asarray(x, np.float32)
        for x in jax.tree.leaves(state.estimator_state)
        if jnp.issubdtype(x.dtype, jnp.floating)
    ]
    assert curvature and all(np.all(np.isfinite(x)) for x in curvature)
    assert np.all(np.isfinite(losses)), losses
    return opt.estimator.report, losses


def _ggn_state(loss, args, **kwargs):
    """``(estimator, state)`` after one ``ggn_exact`` update (nothing warned)."""
    est = kfacx.BlockDiagonalCurvature(loss, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state = est.init(jax.random.PRNGKey(0), args)

    @jax.jit  # One program: much faster than running the update op by op.
    def update(state, args):
        return est.update_curvature_matrix_estimate(
            state, 0.0, 1.0, None, jax.random.PRNGKey(1), args, estimation_mode="ggn_exact"
        )

    return est, update(state, args)


def _assert_curvature_equals_hand_tagging(loss, hand_tagged_loss, args):
    """The detected model's curvature blocks, factor by factor, equal the hand-tagged
    model's; returns the detected model's report."""
    est, got = _ggn_state(loss, args)
    hand_est, want = _ggn_state(hand_tagged_loss, args, auto_register_tags=False)
    assert [type(b) for b in est.blocks] == [type(b) for b in hand_est.blocks], str(est.report)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-14)
    assert max(float(np.abs(a).max()) for a in jax.tree.leaves(got)) > 1e-3
    return est.report
