"""Small random models for the detection fuzzer (tests/graph_matcher/test_fuzz.py).

A model is a `Model`: a tuple of `Op` descriptions run in order by one interpreter,
`logits`, on an activation ``h`` of shape ``[batch, features]`` (integer ids
``[batch, IDS]`` before an embedding). An op is a layer (dense, conv, norms,
embedding) whose weight passes through a *view* (`VIEWS`: reshapes, transposes,
slices, concatenations, broadcasts, elementwise maps, ``jax.lax`` primitives) before
use, a ``jax.lax`` operation on the activation (`ACTIVATION_OPS`), or a wrapper
(`WRAPPERS`: control flow, jit, remat, custom derivatives, vmap) that runs the ops of
its ``body``. Parameters live in a nested dict: op ``i`` of a sequence owns the key
``f"{kind}{i}"`` (a wrapper's key holds its body's parameters).

The strategies (tests/graph_matcher/_fuzz_runner.py) draw these descriptions;
hypothesis shrinks them to short, readable lists such as
``Model((Op("dense", 2, view="sort"),))``. This module needs no hypothesis: the
regression tests of shrunk failures run without it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import kfacx

B, D, K = 3, 4, 3  # batch, input features, outputs
IDS, VOCAB = 2, 5  # ids per example, embedding rows
LAYERS = ("dense", "dense_t", "conv", "ln", "rms", "scale", "embed")
#: How a layer's weight passes before use (the first is the plain weight).
VIEWS = (
    "plain", "T", "flat", "split", "rows", "pad", "tile", "twice", "scale", "exp", "tanh",
    "cast", "cumsum", "sort", "at_set", "where", "iota", "dyn", "gather", "rev", "stop",
    "select", "clip", "max",
)  # fmt: skip
BIASES = ("plain", "none", "row", "bcast", "iota")
ACTIVATION_OPS = (
    "tanh", "relu", "iota_add", "full_concat", "sort", "cumsum", "at_set", "at_add", "gather",
    "dyn", "where", "max_sub", "argmax", "top_k", "mean_sub", "rev", "pad", "clip", "select",
    "scatter", "convert", "expand", "reduce_prod", "sort2", "abs",
)  # fmt: skip
WRAPPERS = (
    "jit", "remat", "custom_jvp", "custom_vjp", "vmap", "cond", "scan", "fori", "while",
    "scan_stack",
)  # fmt: skip


class Op(NamedTuple):
    """One step of a model: ``kind`` (a layer, an activation op or a wrapper), the layer's
    output size, its weight's view, its bias, and a wrapper's body."""

    kind: str
    size: int = 2
    view: str = "plain"
    bias: str = "plain"
    body: tuple[Op, ...] = ()

    def __repr__(self) -> str:
        args = [repr(self.kind)] + ([str(self.size)] if self.kind in LAYERS else [])
        for field in ("view", "bias", "body"):
            if self.kind in LAYERS or field == "body":
                value = getattr(self, field)
                if value != Op._field_defaults[field]:
                    args.append(f"{field}={value!r}")
        return f"Op({', '.join(args)})"


@dataclasses.dataclass(frozen=True)
class Model:
    """A model: its ops, its loss (``"squared"`` or ``"softmax"``), its inputs
    (``"float"`` features or integer ``"ids"``) and its parameters' dtype."""

    ops: tuple[Op, ...]
    loss: str = "squared"
    inputs: str = "float"
    dtype: str = "float32"


# ----------------------------------------------------------------------------- parameters


class _Params:
    """Parameter access of one scope: reads ``tree`` or, with ``tree=None``, records the
    requested shapes (`init_params`: an abstract first run)."""

    def __init__(self, tree: dict | None, dtype: Any, stack: tuple[int, ...] = ()):
        self.tree, self.dtype, self.stack = tree, dtype, stack
        self.shapes: dict[str, Any] = {}

    @property
    def recording(self) -> bool:
        return self.tree is None

    def get(self, name: str, shape: tuple[int, ...]) -> jax.Array:
        if self.recording:
            self.shapes[name] = (*self.stack, *shape)
            return jnp.zeros(shape, self.dtype)
        return self.tree[name]

    def child(self, name: str, stack: int | None = None) -> _Params:
        if self.recording:
            child = _Params(None, self.dtype, (*self.stack, *([stack] if stack else [])))
            self.shapes[name] = child.shapes
            return child
        return _Params(self.tree[name], self.dtype)

    def at(self, tree: dict) -> _Params:
        """The same scope reading ``tree`` (a body's parameters, passed explicitly)."""
        return _Params(tree, self.dtype)


def init_params(model: Model, seed: int = 0) -> dict:
    """Random parameters of ``model`` (shapes from an abstract run of `logits`)."""
    scope = _Params(None, jnp.dtype(model.dtype))
    jax.eval_shape(lambda x: logits(model, scope, x), jax.ShapeDtypeStruct(*_x_spec(model)))
    rng = np.random.default_rng(seed)

    def make(shapes):
        if isinstance(shapes, dict):
            return {k: make(v) for k, v in shapes.items()}
        return jnp.asarray(0.5 * rng.standard_normal(shapes), model.dtype)

    return make(scope.shapes)


def _x_spec(model: Model):
    if model.inputs == "ids":
        return (B, IDS), jnp.int32
    return (B, D), jnp.dtype(model.dtype)


def make_batch(model: Model, seed: int = 1):
    """``(x, targets)`` for ``model``."""
    rng = np.random.default_rng(seed)
    shape, dtype = _x_spec(model)
    if model.inputs == "ids":
        x = jnp.asarray(rng.integers(0, VOCAB, shape), dtype)
    else:
        x = jnp.asarray(rng.standard_normal(shape), dtype)
    if model.loss == "softmax":
        return x, jnp.asarray(rng.integers(0, K, (B,)), jnp.int32)
    return x, jnp.asarray(rng.standard_normal((B, K)), model.dtype)


def loss_fn(model: Model):
    """The loss ``f(params, (x, targets))``, its loss registered."""

    def loss(params, batch):
        x, t = batch
        z = logits(model, _Params(params, jnp.dtype(model.dtype)), x)
        if model.loss == "softmax":
            z = kfacx.register_softmax_cross_entropy_loss(z, t)
            log_p = jax.nn.log_softmax(z.astype(jnp.float32), axis=-1)
            return -jnp.mean(jnp.take_along_axis(log_p, t[:, None], axis=-1))
        z = kfacx.register_squared_error_loss(z, t)
        return jnp.mean(jnp.sum(jnp.square(z - t).astype(jnp.float32), axis=-1))

    return loss


# ----------------------------------------------------------------------------- interpreter


def logits(model: Model, scope: _Params, x: jax.Array) -> jax.Array:
    """The model's ``[B, K]`` outputs."""
    h = run(model.ops, x, scope)
    return fit(_floating(h, scope.dtype), K)


def run(ops: tuple[Op, ...], h: jax.Array, scope: _Params) -> jax.Array:
    for i, op in enumerate(ops):
        name = f"{op.kind}{i}"
        if op.kind in WRAPPERS:
            h = _wrapper(op, h, scope, name)
        elif op.kind in LAYERS:
            h = _layer(op, h if op.kind == "embed" else _floating(h, scope.dtype), scope, name)
        else:
            h = _activation(op.kind, _floating(h, scope.dtype))
    return h


def _floating(h: jax.Array, dtype: Any) -> jax.Array:
    """Ids (before an embedding) as features."""
    if jnp.issubdtype(h.dtype, jnp.integer):
        return h.astype(dtype)
    return h


def fit(h: jax.Array, n: int) -> jax.Array:
    """``h`` cut or zero-padded to ``n`` features."""
    if h.shape[1] >= n:
        return h[:, :n]
    return jnp.pad(h, ((0, 0), (0, n - h.shape[1])))


def _weight(scope: _Params, name: str, shape: tuple[int, ...], view: str) -> jax.Array:
    """A weight of ``shape``, passed through ``view`` (stored in another shape for some)."""
    last, first = shape[-1], shape[0]
    if view == "T":
        return jnp.transpose(scope.get(name, shape[::-1]))
    if view == "flat":
        return scope.get(name, (math.prod(shape),)).reshape(shape)
    if view == "split" and last > 1:
        a, b = scope.get(name + "_a", (*shape[:-1], 1)), scope.get(name, (*shape[:-1], last - 1))
        return jnp.concatenate([a, b], axis=-1)
    if view == "rows" and first > 1:
        a, b = scope.get(name + "_a", (1, *shape[1:])), scope.get(name, (first - 1, *shape[1:]))
        return jnp.concatenate([b, a], axis=0)
    if view in ("pad", "dyn"):
        w = scope.get(name, (first + 1, *shape[1:]))
        if view == "pad":
            return w[1:]
        return jax.lax.dynamic_slice_in_dim(w, 1, first, axis=0)
    if view == "tile":
        return jnp.broadcast_to(scope.get(name, (*shape[:-1], 1)), shape)
    if view == "twice":
        w = scope.get(name, (*shape[:-1], (last + 1) // 2))
        return jnp.concatenate([w, w], axis=-1)[..., :last]
    w = scope.get(name, shape)
    return _map(view, w)


def _map(view: str, w: jax.Array) -> jax.Array:
    """``w`` through an elementwise or ``jax.lax`` map (same shape)."""
    maps = {
        "scale": lambda: 0.5 * w,
        "exp": lambda: jnp.exp(w),
        "tanh": lambda: jnp.tanh(w),
        "cast": lambda: _round_trip(w),
        "cumsum": lambda: jnp.cumsum(w, axis=0),
        "sort": lambda: jnp.sort(w, axis=0),
        "at_set": lambda: w.at[0].set(0.0),
        "where": lambda: jnp.where(w > 0, w, 0.1 * w),
        "iota": lambda: w + jax.lax.broadcasted_iota(w.dtype, w.shape, w.ndim - 1),
        "gather": lambda: w[np.arange(w.shape[0])[::-1]],
        "rev": lambda: jax.lax.rev(w, (0,)),
        "stop": lambda: jax.lax.stop_gradient(w),
        "select": lambda: jax.lax.select_n(w > 0, -w, w),
        "clip": lambda: jnp.clip(w, -1.0, 1.0),
        "max": lambda: w - jnp.max(w, axis=0, keepdims=True),
    }
    return maps[view]() if view in maps else w


def _round_trip(x: jax.Array) -> jax.Array:
    """``x`` cast to a narrower float and back: bfloat16, or float32 for float64 (the
    product check's exact reference differentiates through the cast, which rounds the
    cotangent; kfacx reads a cast as shape-only)."""
    narrow = jnp.float32 if x.dtype == jnp.float64 else jnp.bfloat16
    return x.astype(narrow).astype(x.dtype)


def _bias(scope: _Params, name: str, n: int, kind: str) -> jax.Array | None:
    """A bias ``[1, n]`` (None: no bias)."""
    if kind == "none":
        return None
    if kind == "row":
        return scope.get(name, (1, n))
    if kind == "bcast":
        return jnp.broadcast_to(scope.get(name, (1,))[None], (1, n))
    b = scope.get(name, (n,))[None]
    return b + jnp.arange(n, dtype=b.dtype)[None] if kind == "iota" else b


def _layer(op: Op, h: jax.Array, scope: _Params, name: str) -> jax.Array:
    p = scope.child(name)
    n, m = h.shape[1], op.size
    if op.kind in ("dense", "dense_t"):
        w = _weight(p, "w", (n, m), op.view)
        y = h @ w if op.kind == "dense" else jnp.transpose(jnp.transpose(w) @ jnp.transpose(h))
        b = _bias(p, "b", m, op.bias)
        return y if b is None else y + b
    if op.kind == "conv":
        w = _weight(p, "w", (2, 1, m), op.view)  # kernel width 2, one input channel
        y = jax.lax.conv_general_dilated(
            h[:, :, None], w, (1,), "SAME", (1,), (1,), ("NWC", "WIO", "NWC")
        )
        b = _bias(p, "b", m, op.bias)
        y = y if b is None else y + b[None]
        return y.reshape(y.shape[0], -1)
    if op.kind == "embed":
        w = _weight(p, "w", (VOCAB, m), op.view)
        if jnp.issubdtype(h.dtype, jnp.integer):
            return w[h].reshape(h.shape[0], -1)
        ids = jnp.argmax(h, axis=-1) % VOCAB
        return jnp.concatenate([h, w[ids].astype(h.dtype)], axis=1)
    return _norm(op, h, p, n)


def _norm(op: Op, h: jax.Array, p: _Params, n: int) -> jax.Array:
    if op.kind == "ln":
        c = h - jnp.mean(h, axis=-1, keepdims=True)
        h = c * jax.lax.rsqrt(jnp.mean(c * c, axis=-1, keepdims=True) + 1e-5)
    elif op.kind == "rms":
        h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1e-5)
    y = h * _weight(p, "scale", (n,), op.view)[None]
    b = _bias(p, "offset", n, op.bias)
    return y if b is None else y + b


def _activation(kind: str, h: jax.Array) -> jax.Array:
    """A parameter-free op on the features of ``h`` (never across the batch)."""
    n = h.shape[1]
    ops = {
        "tanh": lambda: jnp.tanh(h),
        "relu": lambda: jax.nn.relu(h),
        "abs": lambda: jnp.abs(h),
        "iota_add": lambda: h + jnp.arange(n, dtype=h.dtype)[None],
        "full_concat": lambda: jnp.concatenate([h, jnp.full((h.shape[0], 1), 2.0, h.dtype)], 1),
        "sort": lambda: jnp.sort(h, axis=-1),
        "sort2": lambda: jax.lax.sort((h, -h), dimension=1, num_keys=1)[1],
        "cumsum": lambda: jnp.cumsum(h, axis=-1),
        "at_set": lambda: h.at[:, 0].set(1.0),
        "at_add": lambda: h.at[:, n - 1].add(h[:, 0]),
        "gather": lambda: h[:, np.arange(n)[::-1]],
        "dyn": lambda: jax.lax.dynamic_slice_in_dim(h, n // 2, n - n // 2, axis=1),
        "where": lambda: jnp.where(h > 0, h, 0.1 * h),
        "select": lambda: jax.lax.select_n(h > 0, 0.5 * h, h),
        "max_sub": lambda: h - jnp.max(h, axis=-1, keepdims=True),
        "argmax": lambda: h * (jnp.arange(n)[None] == jnp.argmax(h, axis=-1)[:, None]),
        "top_k": lambda: jax.lax.top_k(h, max(1, n - 1))[0],
        "mean_sub": lambda: h - jnp.mean(h, axis=-1, keepdims=True),
        "rev": lambda: h[:, ::-1],
        "pad": lambda: jnp.pad(h, ((0, 0), (1, 0))),
        "clip": lambda: jnp.clip(h, -1.0, 1.0),
        "scatter": lambda: jnp.zeros((h.shape[0], n + 1), h.dtype).at[:, 1:].set(h),
        "convert": lambda: _round_trip(h),
        "expand": lambda: (h[:, :, None] * jnp.ones((1, 1, 2), h.dtype)).reshape(h.shape[0], -1),
        "reduce_prod": lambda: h * jnp.prod(jnp.tanh(h), axis=-1, keepdims=True),
    }
    return ops[kind]()


def _wrapper(op: Op, h: jax.Array, scope: _Params, name: str) -> jax.Array:
    """``op.body`` under ``op.kind``; loops keep the activation's shape (`_same`)."""
    stack = 2 if op.kind == "scan_stack" else None
    p = scope.child(name, stack)
    if p.recording:  # shapes only: every body runs once, as written
        return (
            _same(lambda c, q: run(op.body, c, q), h, p)
            if stack or op.kind in _LOOPS
            else run(op.body, h, p)
        )
    body = lambda c, tree: run(op.body, c, p.at(tree))  # noqa: E731
    same = lambda c, tree: _same(body, c, tree)  # noqa: E731
    kind, tree = op.kind, p.tree
    if kind == "jit":
        return jax.jit(body)(h, tree)
    if kind == "remat":
        return jax.checkpoint(body)(h, tree)
    if kind == "custom_jvp":
        f = jax.custom_jvp(body)
        f.defjvp(lambda primals, tangents: jax.jvp(body, primals, tangents))
        return f(h, tree)
    if kind == "custom_vjp":
        f = jax.custom_vjp(body)
        f.defvjp(lambda c, t: jax.vjp(body, c, t), lambda vjp, ct: vjp(ct))
        return f(h, tree)
    if kind == "vmap":
        return jax.vmap(lambda row: body(row[None], tree)[0])(h)
    if kind == "cond":
        pred = jnp.sum(_floating(h, jnp.float32)) > 0
        return jax.lax.cond(pred, lambda c: same(c, tree), lambda c: -same(c, tree), h)
    if kind == "scan":
        return jax.lax.scan(lambda c, _: (same(c, tree), None), h, None, length=2)[0]
    if kind == "scan_stack":
        return jax.lax.scan(lambda c, t: (same(c, t), None), h, tree, length=2)[0]
    if kind == "fori":
        return jax.lax.fori_loop(0, 2, lambda i, c: same(c, tree), h)
    cond_fn = lambda s: s[0] < 2  # noqa: E731
    return jax.lax.while_loop(cond_fn, lambda s: (s[0] + 1, same(s[1], tree)), (0, h))[1]


_LOOPS = ("cond", "scan", "fori", "while")


def _same(body, h: jax.Array, tree) -> jax.Array:
    """``body(h, tree)`` with ``h``'s shape and dtype (cut or padded)."""
    out = body(h, tree)
    if jnp.issubdtype(h.dtype, jnp.integer):
        return h + jnp.sum(out).astype(h.dtype) * 0  # ids stay ids (the body is still traced)
    return fit(_floating(out, h.dtype), h.shape[1]).astype(h.dtype)
