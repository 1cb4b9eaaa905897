"""Small models for the layer-detection tests, with what detection should find in them.

Every builder returns a `Case`: an *untagged* loss ``loss(params, batch)``
(only the loss is registered), example arguments, and the expected
registration of every parameter leaf. Builders named ``hand_*`` return the
same models with every layer tagged by hand (``kfacx.register_*``), for the
curvature-equivalence tests.

Model code broadcasts explicitly: the test suite runs with
``jax_numpy_rank_promotion="raise"``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

import kfacx

DENSE, CONV, SAS, GENERIC = "dense_tag", "conv_tag", "scale_and_shift_tag", "generic_tag"
EMBED = "embedding_tag"
NHWC = ("NHWC", "HWIO", "NHWC")


@dataclasses.dataclass(frozen=True)
class Case:
    """A loss, example arguments and the registration detection should produce.

    Attributes:
      name: test id.
      loss: the untagged loss ``loss(params, batch)``.
      params: the parameters (the first argument of ``loss``).
      batch: the second argument of ``loss``.
      expected: path -> ``(tag, source, layer)``; ``layer`` is any label, the
        parameters with equal labels must share one layer tag.
      tag_counts: layer-tag primitive name -> number of equations in the
        tagged jaxpr.
      tag_meta: layer-tag primitive name -> one dict per equation (evaluation
        order) of params the equation must have.
      unmatched: the paths detection cannot match.
    """

    name: str
    loss: Callable[..., jax.Array]
    params: Any
    batch: tuple
    expected: Mapping[str, tuple[str, str, str]]
    tag_counts: Mapping[str, int]
    tag_meta: Mapping[str, Sequence[Mapping[str, Any]]] = dataclasses.field(default_factory=dict)
    unmatched: tuple[str, ...] = ()
    uses: Mapping[str, int] = dataclasses.field(default_factory=dict)

    @property
    def args(self) -> tuple:
        return (self.params, self.batch)


def normal(rng: np.random.Generator, *shape: int, scale: float = 1.0) -> jax.Array:
    # Cast on the host: jnp.asarray's cast would compile a conversion per shape.
    return jnp.asarray(np.asarray(scale * rng.standard_normal(shape), np.float32), jnp.float32)


def layer(module: str, tag: str, source: str, leaves: Sequence[str] = ("b", "w")) -> dict:
    """Expected entries of one module's parameters ``module/leaf``."""
    return {f"{module}/{leaf}": (tag, source, module) for leaf in leaves}


# ----------------------------------------------------------------------------- losses


def softmax_loss(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Registers the softmax cross-entropy on ``logits`` and returns its value."""
    logits = kfacx.register_softmax_cross_entropy_loss(logits, labels)
    log_p = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(log_p, labels[:, None], axis=1))


def squared_loss(prediction: jax.Array, targets: jax.Array) -> jax.Array:
    """Registers the squared error on ``prediction`` and returns its value."""
    prediction = kfacx.register_squared_error_loss(prediction, targets)
    return jnp.mean(jnp.sum(jnp.square(prediction - targets), axis=-1))


def _targets(kind: str, rng: np.random.Generator, batch: int, dim: int) -> jax.Array:
    if kind == "softmax":
        return jnp.asarray(np.asarray(rng.integers(0, dim, size=batch), np.int32), jnp.int32)
    return normal(rng, batch, dim)


def _loss_on(kind: str, y: jax.Array, t: jax.Array) -> jax.Array:
    y = y.reshape(y.shape[0], -1)
    return softmax_loss(y, t) if kind == "softmax" else squared_loss(y, t)


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


# ----------------------------------------------------------------------------- raw-parameter models


def add_bias(y: jax.Array, b: jax.Array) -> jax.Array:
    """``y + b`` with ``b`` broadcast explicitly over ``y``'s leading axes."""
    return y + b.reshape((1,) * (y.ndim - b.ndim) + b.shape)


def dense(x, w, b=None):
    y = x @ w
    return y if b is None else add_bias(y, b)


def two_layer_params(seed: int = 0, d_in: int = 4, hidden: int = 6, d_out: int = 3) -> dict:
    rng = np.random.default_rng(seed)
    return dict(
        w1=normal(rng, d_in, hidden, scale=0.5),
        b1=normal(rng, hidden, scale=0.5),
        w2=normal(rng, hidden, d_out, scale=0.5),
        b2=normal(rng, d_out, scale=0.5),
    )


def two_layer_batch(seed: int = 1, batch: int = 3, d_in: int = 4, d_out: int = 3) -> tuple:
    rng = np.random.default_rng(seed)
    return normal(rng, batch, d_in), normal(rng, batch, d_out)


_TWO_LAYER_EXPECTED = {
    "b1": (DENSE, "dense_with_bias", "1"),
    "w1": (DENSE, "dense_with_bias", "1"),
    "b2": (DENSE, "dense_with_bias", "2"),
    "w2": (DENSE, "dense_with_bias", "2"),
}


def _dense_cjvp_impl(x, w, b):
    return dense(x, w, b)


dense_custom_jvp = jax.custom_jvp(_dense_cjvp_impl)


@dense_custom_jvp.defjvp
def _dense_custom_jvp_rule(primals, tangents):
    x, w, b = primals
    dx, dw, db = tangents
    return dense_custom_jvp(x, w, b), dx @ w + x @ dw + add_bias(jnp.zeros_like(x @ w), db)


#: Wrappers around the first layer of `wrapped_layer_case` (all keep its derivative).
LAYER_WRAPPERS: dict[str, Callable[[Callable], Callable]] = {
    "jit": jax.jit,
    "checkpoint": jax.checkpoint,
    "jit_of_checkpoint": lambda f: jax.jit(jax.checkpoint(f)),
    "custom_jvp": lambda f: dense_custom_jvp,
}


def wrapped_layer_case(wrapper: str) -> Case:
    """A two-layer tanh MLP whose first layer sits inside ``LAYER_WRAPPERS[wrapper]``."""
    first = LAYER_WRAPPERS[wrapper](dense)

    def loss(p, batch):
        x, t = batch
        h = jnp.tanh(first(x, p["w1"], p["b1"]))
        return squared_loss(dense(h, p["w2"], p["b2"]), t)

    return Case(
        f"inside_{wrapper}",
        loss,
        two_layer_params(),
        two_layer_batch(),
        _TWO_LAYER_EXPECTED,
        {DENSE: 2},
    )


def einsum_case() -> Case:
    """Attention-style projections written with einsum on raw parameters."""
    rng = np.random.default_rng(3)
    b, t, d, h, k, o = 2, 3, 4, 2, 3, 5
    params = dict(
        wq=normal(rng, d, h, k, scale=0.5), bq=normal(rng, h, k), wo=normal(rng, h, k, o, scale=0.5)
    )
    batch = (normal(rng, b, t, d), normal(rng, b, t * o))

    def loss(p, batch):
        x, y = batch
        q = add_bias(jnp.einsum("btd,dhk->bthk", x, p["wq"]), p["bq"])
        out = jnp.einsum("bthk,hko->bto", jnp.tanh(q), p["wo"])
        return squared_loss(out.reshape(out.shape[0], -1), y)

    expected = {
        "bq": (DENSE, "dense_with_bias", "q"),
        "wq": (DENSE, "dense_with_bias", "q"),
        "wo": (DENSE, "dense", "o"),
    }
    meta = {
        DENSE: [
            dict(dimension_numbers=(((2,), (0,)), ((), ()))),
            dict(dimension_numbers=(((2, 3), (0, 1)), ((), ()))),
        ]
    }
    return Case("einsum_projections", loss, params, batch, expected, {DENSE: 2}, meta)


def manual_plus_auto_case() -> Case:
    """First layer tagged by hand with `kfacx.register_dense`, the second found automatically."""

    def loss(p, batch):
        x, t = batch
        h = kfacx.register_dense(dense(x, p["w1"], p["b1"]), x, p["w1"], p["b1"])
        return squared_loss(dense(jnp.tanh(h), p["w2"], p["b2"]), t)

    expected = dict(_TWO_LAYER_EXPECTED)
    expected["b1"] = expected["w1"] = (DENSE, "manual", "1")
    return Case(
        "manual_plus_auto", loss, two_layer_params(), two_layer_batch(), expected, {DENSE: 2}
    )


def transposed_weight_loss(p, batch):
    """``x @ w.T + b`` with ``w: [d_out, d_in]`` (the PyTorch layout)."""
    x, t = batch
    return squared_loss(add_bias(x @ p["w"].T, p["b"]), t)


def transposed_weight_params() -> dict:
    rng = np.random.default_rng(4)
    return dict(w=normal(rng, 3, 4), b=normal(rng, 3))


def tied_loss(p, batch):
    """An autoencoder whose decoder reuses the encoder weight (``w`` and ``w.T``)."""
    x, _ = batch
    h = jnp.tanh(x @ p["tied_w"])
    return squared_loss(h @ p["tied_w"].T, x)


def tied_params() -> dict:
    return dict(tied_w=normal(np.random.default_rng(5), 4, 3, scale=0.5))


def raw_cases() -> list[Case]:
    """The raw-parameter models of the detection tests."""
    return [
        einsum_case(),
        *(wrapped_layer_case(w) for w in LAYER_WRAPPERS),
        manual_plus_auto_case(),
    ]


def unmatched_loss(kind: str) -> Callable[..., jax.Array]:
    """A dense layer and a parameter ``p`` no pattern matches (``sin(p) * y`` or ``tanh``)."""
    fn = {"sin": jnp.sin, "tanh": jnp.tanh}[kind]

    def loss(params, batch):
        x, t = batch
        y = x @ params["w"]
        return squared_loss(y * fn(params["p"])[None, :], t)

    return loss


def unmatched_params() -> dict:
    rng = np.random.default_rng(6)
    return dict(p=normal(rng, 3, scale=0.3), w=normal(rng, 4, 3, scale=0.5))


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
