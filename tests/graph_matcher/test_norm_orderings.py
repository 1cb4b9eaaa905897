"""Normalisations written in every ordering published code uses.

A normalisation's affine part is one scale-and-shift layer on ``x_hat = (x - m) / std``
however the code folds the scale in: ``x_hat * g + b``, ``(x - m) * (g * rsqrt(v + eps))
+ b`` (Flax, Haiku), ``(x - m) * ((1 + g) / sqrt(v + eps)) + b`` (lingvo, praxis),
``g * (x - m) / sqrt(v + eps) + b`` (the textbook formula), Keras 3's ``x * inv + (-m *
inv + b)``, T5's and Gemma's RMSNorms, with and without a shift, a layer norm over the
last axis, an RMSNorm, a batch norm over axis 0 (statistics without the batch axis, so
broadcasting happens inside the formula), in float64 (float32's jaxprs) and bfloat16.

For every form: the pattern that finds it, no unmatched parameter, no note, no warning,
and the curvature (``ggn_exact``, float64) of the hand-tagged model
(`kfacx.register_scale_and_shift` on ``x_hat``, ``scale_offset=1`` for ``1 + g``).
The forms are checked in one plain-JAX model per kind of statistics (one layer per form,
compiled once for all). Framework modules written these ways: a lingvo-style batch norm
in Haiku, a flaxformer ``center_scale_at_zero`` T5 norm in Flax linen (the offset added
in float32, then cast), a Keras-style layer norm in Flax NNX. `kfacx.Optimizer` steps on
a lingvo-style norm: ``test_broadcast_parameters.py``.
"""

from __future__ import annotations

import warnings

import flax.linen as nn
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kfacx

from . import _models as M
from ._hand_tagging import assert_curvature_equals_hand_tagging, random_params

B, D, EPS = 4, 5, 1e-5
SAS = "scale_and_shift_tag"


def _rsqrt(v):
    return jax.lax.rsqrt(v + EPS)


def _std(v):
    return jnp.sqrt(v + EPS)


def _c(x, m):
    return x if m is None else x - m


def _keras(x, m, v, g, b=None):
    inv = _rsqrt(v) * g
    res = -m * inv
    return x * inv + (res if b is None else res + b)


def _flaxformer(x, m, v, g, b):
    """flaxformer's T5LayerNorm(center_scale_at_zero): the offset added in float32, then
    cast to the compute dtype."""
    del b
    return _c(x, m) * _rsqrt(v) * (g.astype(jnp.float32) + 1.0).astype(x.dtype)


#: name -> (``y(x, mean or None, var, g, b)``, pattern, scale stored as its offset from 1,
#: has a shift). In the code's own order of operations.
FORMS = {
    "flax": (lambda x, m, v, g, b: _c(x, m) * (_rsqrt(v) * g) + b, "normalization", 0, 1),
    "haiku_rms": (lambda x, m, v, g, b: _c(x, m) * g * _rsqrt(v), "normalization_scale", 0, 0),
    "scale_times_rsqrt": (
        lambda x, m, v, g, b: _c(x, m) * (g * _rsqrt(v)),
        "normalization_scale",
        0,
        0,
    ),
    "equinox": (lambda x, m, v, g, b: g * (_c(x, m) * _rsqrt(v)) + b, "scale_and_shift", 0, 1),
    "t5": (lambda x, m, v, g, b: _c(x, m) * _rsqrt(v) * g, "scale", 0, 0),
    "rms_with_bias": (lambda x, m, v, g, b: _c(x, m) * _rsqrt(v) * g + b, "scale_and_shift", 0, 1),
    "gemma": (lambda x, m, v, g, b: _c(x, m) * _rsqrt(v) * (1 + g), "offset_scale", 1, 0),
    "flaxformer_at_zero": (_flaxformer, "offset_scale", 1, 0),
    "praxis_layer_norm": (
        lambda x, m, v, g, b: _c(x, m) * _rsqrt(v) * (1 + g) + b,
        "offset_scale_and_shift",
        1,
        1,
    ),
    "offset_times_rsqrt": (
        lambda x, m, v, g, b: _c(x, m) * ((1 + g) * _rsqrt(v)) + b,
        "offset_normalization",
        1,
        1,
    ),
    "offset_times_rsqrt_no_bias": (
        lambda x, m, v, g, b: _c(x, m) * ((1 + g) * _rsqrt(v)),
        "offset_normalization_scale",
        1,
        0,
    ),
    "over_std": (lambda x, m, v, g, b: _c(x, m) * (g / _std(v)) + b, "std_normalization", 0, 1),
    "over_std_no_bias": (
        lambda x, m, v, g, b: _c(x, m) * (g / _std(v)),
        "std_normalization_scale",
        0,
        0,
    ),
    "lingvo": (
        lambda x, m, v, g, b: _c(x, m) * ((1 + g) / _std(v)) + b,
        "offset_std_normalization",
        1,
        1,
    ),
    "lingvo_no_bias": (
        lambda x, m, v, g, b: _c(x, m) * ((g + 1.0) / _std(v)),
        "offset_std_normalization_scale",
        1,
        0,
    ),
    "divide_then_scale": (
        lambda x, m, v, g, b: _c(x, m) / _std(v) * g + b,
        "scale_and_shift",
        0,
        1,
    ),
    "textbook": (
        lambda x, m, v, g, b: g * _c(x, m) / _std(v) + b,
        "scaled_std_normalization",
        0,
        1,
    ),
    "textbook_no_bias": (
        lambda x, m, v, g, b: g * _c(x, m) / _std(v),
        "scaled_std_normalization_scale",
        0,
        0,
    ),
    "textbook_offset": (
        lambda x, m, v, g, b: (1 + g) * _c(x, m) / _std(v) + b,
        "offset_scaled_std_normalization",
        1,
        1,
    ),
    "textbook_offset_no_bias": (
        lambda x, m, v, g, b: (1 + g) * _c(x, m) / _std(v),
        "offset_scaled_std_normalization_scale",
        1,
        0,
    ),
    "keras": (_keras, "keras_normalization", 0, 1),
    "keras_no_bias": (lambda x, m, v, g, b: _keras(x, m, v, g), "keras_normalization_scale", 0, 0),
}
#: Forms that need the mean (Keras's formula has no RMSNorm variant).
CENTERED_ONLY = ("keras", "keras_no_bias")
#: name -> (axis of the statistics, keepdims, centered).
STATISTICS = {"layer": (-1, True, True), "rms": (-1, True, False), "batch": (0, False, True)}


def _forms(statistics):
    return [f for f in FORMS if STATISTICS[statistics][2] or f not in CENTERED_ONLY]


def _stats(h, statistics):
    """``(mean or None, var)`` of ``h`` as the statistics' kind computes them."""
    axis, keepdims, centered = STATISTICS[statistics]
    if not centered:
        return None, jnp.mean(jnp.square(h), axis, keepdims=keepdims)
    return jnp.mean(h, axis, keepdims=keepdims), jnp.var(h, axis, keepdims=keepdims)


def _norm(form, p, h, statistics, tag):
    """One normalisation layer written as ``form`` (registered by hand if ``tag``)."""
    fn, _, offset, shift = FORMS[form]
    g, b = (p[k].astype(h.dtype) if k in p else None for k in ("g", "b"))
    m, v = _stats(h, statistics)
    y = fn(h, m, v, g, b)
    if not tag:
        return y
    x_hat = _c(h, m) * _rsqrt(v)
    return kfacx.register_scale_and_shift(y, x_hat, g, b, scale_offset=float(offset))


def forms_loss(statistics, tag=False):
    """A dense layer, then one normalisation per form (tanh between them), then a dense
    head; the broadcasting of user code (``jnp``'s default rank promotion)."""
    forms = _forms(statistics)

    def loss(p, batch):
        x, t = batch
        with jax.numpy_rank_promotion("allow"):
            h = x @ p["w_in"].astype(x.dtype)
            for form in forms:
                h = jnp.tanh(_norm(form, p[form], h, statistics, tag))
            out = h @ p["w_out"].astype(x.dtype)
        return M.squared_loss(out.astype(jnp.float32 if x.dtype != jnp.float64 else x.dtype), t)

    return loss


def forms_args(statistics, dtype=np.float32):
    rng = np.random.default_rng(0)
    p = {f: dict(g=0.3 * rng.standard_normal(D), b=0.3 * rng.standard_normal(D)) for f in FORMS}
    p = {f: p[f] if FORMS[f][3] else dict(g=p[f]["g"]) for f in _forms(statistics)}
    p |= dict(w_in=rng.standard_normal((3, D)), w_out=rng.standard_normal((D, 2)) / 3)
    batch = (rng.standard_normal((B, 3)), rng.standard_normal((B, 2)))
    p = jax.tree.map(lambda a: np.asarray(a, np.float32 if dtype == jnp.bfloat16 else dtype), p)
    x, t = batch
    return p, (jnp.asarray(x, dtype), np.asarray(t, np.float32 if dtype != np.float64 else dtype))


def _expected(statistics):
    """``path -> (tag, pattern)`` of the forms model."""
    out = {"w_in": ("dense_tag", "dense"), "w_out": ("dense_tag", "dense")}
    for form in _forms(statistics):
        _, pattern, _, shift = FORMS[form]
        out |= {f"{form}/{k}": (SAS, pattern) for k in ("gb" if shift else "g")}
    return out


def _detect(loss, args):
    """The report of `kfacx.auto_register_tags`, which must warn nothing."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return kfacx.auto_register_tags(loss, args)[1]


def _assert_every_form_is_one_layer(report, statistics):
    assert report.notes == () and report.unmatched == (), str(report)
    assert {e.path: (e.tag, e.source) for e in report.entries} == _expected(statistics), str(report)
    layers = {e.layer for e in report.entries if e.tag == SAS}
    assert len(layers) == len(_forms(statistics)), str(report)


@pytest.mark.parametrize("statistics", sorted(STATISTICS))
def test_every_form_is_one_scale_and_shift_layer(statistics):
    """Each form's scale and shift are one layer, found by its pattern; nothing is left
    unmatched and nothing is noted. In bfloat16 here (the looser check of the matches);
    in float64, the same jaxprs as float32 (a cast to the dtype they already have is no
    operation), in the curvature test below."""
    _assert_every_form_is_one_layer(
        _detect(forms_loss(statistics), forms_args(statistics, jnp.bfloat16)), statistics
    )


# ----------------------------------------------------------------------------- curvature


@pytest.mark.parametrize("statistics", sorted(STATISTICS))
def test_every_form_has_the_hand_tagged_curvature(statistics, x64):
    args = forms_args(statistics, np.float64)
    report, hand = assert_curvature_equals_hand_tagging(
        forms_loss(statistics), forms_loss(statistics, tag=True), args, jit=False
    )
    _assert_every_form_is_one_layer(report, statistics)  # (the detection test, in float64)
    hand_sources = {e.path: e.source for e in hand.entries}
    for form in _forms(statistics):
        assert hand_sources[f"{form}/g"] == "manual"


# ----------------------------------------------------------------------------- frameworks


class LingvoBatchNorm(hk.Module):
    """lingvo's / praxis's batch norm: statistics over every axis but the features, the
    scale stored as its offset from 1 and folded into the inverse deviation."""

    def __init__(self, tag=False, name=None):
        super().__init__(name=name)
        self.tag = tag

    def __call__(self, x):
        init = hk.initializers.RandomNormal(0.3)
        gamma = hk.get_parameter("gamma", x.shape[-1:], x.dtype, init)
        beta = hk.get_parameter("beta", x.shape[-1:], x.dtype, init)
        mean, var = jnp.mean(x, 0), jnp.var(x, 0)
        inv = (gamma + 1.0) / jnp.sqrt(var + 1e-3)
        y = (x - mean[None]) * inv[None] + beta[None]
        if not self.tag:
            return y
        x_hat = (x - mean[None]) / jnp.sqrt(var + 1e-3)[None]
        return kfacx.register_scale_and_shift(y, x_hat, gamma, beta, scale_offset=1.0)


def _haiku_forward(tag):
    def forward(x):
        h = hk.Linear(D, name="inner")(x)
        return hk.Linear(2, name="head")(jnp.tanh(LingvoBatchNorm(tag, name="bn")(h)))

    return forward


class T5LayerNorm(nn.Module):
    """flaxformer's T5 layer norm with ``center_scale_at_zero``: float32 statistics, the
    scale's offset added in float32, the product in the compute dtype."""

    dtype: jnp.dtype = jnp.float32
    tag: bool = False

    @nn.compact
    def __call__(self, x):
        x32 = jnp.asarray(x, jnp.float32)
        y = jnp.asarray(
            x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), -1, keepdims=True) + 1e-6), self.dtype
        )
        scale = self.param("scale", nn.initializers.normal(0.3), x.shape[-1:], jnp.float32)
        out = y * jnp.asarray(scale + 1.0, self.dtype)[None]
        return kfacx.register_scale_and_shift(out, y, scale, scale_offset=1.0) if self.tag else out


class T5Net(nn.Module):
    dtype: jnp.dtype = jnp.float32
    tag: bool = False

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(D, dtype=self.dtype)(x)
        return nn.Dense(2, dtype=self.dtype)(T5LayerNorm(self.dtype, self.tag)(h))


class KerasLayerNorm(nnx.Module):
    """Keras 3's LayerNormalization: ``x * inv + (-mean * inv + beta)``."""

    def __init__(self, dim, rngs):
        self.gamma = nnx.Param(1.0 + 0.3 * jax.random.normal(rngs.params(), (dim,)))
        self.beta = nnx.Param(0.3 * jax.random.normal(rngs.params(), (dim,)))

    def __call__(self, x, tag=False):
        mean, var = jnp.mean(x, -1, keepdims=True), jnp.var(x, -1, keepdims=True)
        gamma, beta = self.gamma[...][None], self.beta[...][None]
        inv = jax.lax.rsqrt(var + 1e-3) * gamma
        y = x * inv + (-mean * inv + beta)
        if not tag:
            return y
        x_hat = (x - mean) * jax.lax.rsqrt(var + 1e-3)
        return kfacx.register_scale_and_shift(y, x_hat, self.gamma[...], self.beta[...])


class NNXNet(nnx.Module):
    def __init__(self, rngs):
        self.inner = nnx.Linear(3, D, rngs=rngs)
        self.norm = KerasLayerNorm(D, rngs)
        self.head = nnx.Linear(D, 2, rngs=rngs)

    def __call__(self, x, tag=False):
        return self.head(jnp.tanh(self.norm(self.inner(x), tag)))


def _batch(dtype):
    rng = np.random.default_rng(3)
    return jnp.asarray(rng.standard_normal((B, 3)), dtype), jnp.asarray(
        rng.standard_normal((B, 2)), jnp.float32 if dtype != np.float64 else dtype
    )


def _haiku_case(dtype, tag=False):
    net = hk.without_apply_rng(hk.transform(_haiku_forward(tag)))
    batch = _batch(dtype)
    params = random_params(net.init, batch[0], dtype)

    def loss(p, batch):
        return M.squared_loss(net.apply(p, batch[0]).astype(batch[1].dtype), batch[1])

    return loss, params, batch


def _linen_case(dtype, tag=False):
    compute = jnp.bfloat16 if dtype == jnp.bfloat16 else dtype
    net = T5Net(compute, tag)
    batch = _batch(dtype)
    params = random_params(net.init, batch[0], np.float64 if dtype == np.float64 else np.float32)

    def loss(p, batch):
        return M.squared_loss(net.apply(p, batch[0]).astype(batch[1].dtype), batch[1])

    return loss, params, batch


def _nnx_case(dtype, tag=False):
    graphdef, params = nnx.split(NNXNet(nnx.Rngs(0)), nnx.Param)
    params = jax.tree.map(lambda a: jnp.asarray(a, dtype), params)
    batch = _batch(dtype)

    def loss(p, batch):
        return M.squared_loss(nnx.merge(graphdef, p)(batch[0], tag), batch[1])

    return loss, params, batch


#: name -> (case builder, the normalisation's parameters' paths, their pattern).
FRAMEWORK_CASES = {
    "haiku_lingvo_batch_norm": (_haiku_case, ("bn/beta", "bn/gamma"), "offset_std_normalization"),
    "linen_t5_center_scale_at_zero": (_linen_case, ("params/T5LayerNorm_0/scale",), "offset_scale"),
    "nnx_keras_layer_norm": (
        _nnx_case,
        ("norm/beta/value", "norm/gamma/value"),
        "keras_normalization",
    ),
}


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", sorted(FRAMEWORK_CASES))
def test_framework_norms_are_found(name, dtype):
    build, paths, pattern = FRAMEWORK_CASES[name]
    loss, params, batch = build(dtype)
    report = _detect(loss, (params, batch))
    assert report.unmatched == () and report.notes == (), str(report)
    sources = {e.path: e.source for e in report.entries}
    assert {p: sources[p] for p in paths} == dict.fromkeys(paths, pattern), str(report)


@pytest.mark.parametrize("name", sorted(FRAMEWORK_CASES))
def test_framework_norms_have_the_hand_tagged_curvature(name, x64):
    build, paths, _ = FRAMEWORK_CASES[name]
    loss, params, batch = build(np.float64)
    hand_loss = build(np.float64, tag=True)[0]
    _, hand = assert_curvature_equals_hand_tagging(loss, hand_loss, (params, batch))
    assert {e.path: e.source for e in hand.entries if e.path in paths} == dict.fromkeys(
        paths, "manual"
    )
