"""Raw-parameter models (plain JAX functions of a parameter dict) for the
layer-detection tests, each a `Case` with what detection should find in it (see
tests/graph_matcher/_models.py).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

import kfacx

from ._model_base import DENSE, Case, normal, squared_loss

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
