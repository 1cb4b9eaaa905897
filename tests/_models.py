"""Small hand-tagged models and independent reference computations for the tests.

Parameters of the MLPs are lists of ``(w, b)`` tuples, so their pytree-leaf
order is ``w0, b0, w1, b1, ...`` (the order of `jax.flatten_util.ravel_pytree`).
The untagged forward passes here are written out explicitly so that reference
values never go through kfacx.
"""

from __future__ import annotations

import functools
import itertools
import warnings
from collections.abc import Sequence

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

import kfacx

LOSS_KINDS = ("softmax", "sigmoid", "squared")


def normal(rng: np.random.Generator, *shape: int, scale: float = 1.0) -> jax.Array:
    # Cast on the host: jnp.asarray's cast would compile a conversion per shape.
    return jnp.asarray(np.asarray(scale * rng.standard_normal(shape), np.float32), jnp.float32)


def init_mlp(sizes: Sequence[int], seed: int = 0) -> list[tuple[jax.Array, jax.Array]]:
    """Random ``(w, b)`` per layer for layer widths ``sizes``."""
    rng = np.random.default_rng(seed)
    return [
        (normal(rng, d_in, d_out, scale=1.0 / np.sqrt(d_in)), normal(rng, d_out, scale=0.5))
        for d_in, d_out in zip(sizes[:-1], sizes[1:], strict=True)
    ]


def add_bias(y: jax.Array, b: jax.Array) -> jax.Array:
    """``y + b`` with an explicit broadcast of ``b`` over the leading axes."""
    return y + b.reshape((1,) * (y.ndim - 1) + (-1,))


def dense(x: jax.Array, w: jax.Array, b: jax.Array) -> jax.Array:
    return add_bias(jnp.tensordot(x, w, axes=1), b)


def mlp_outputs(params, x, perturbations=None) -> list[jax.Array]:
    """Untagged forward pass; returns every layer's (pre-activation) output.

    ``perturbations[i]`` (if given) is added to layer ``i``'s output.
    """
    outs, h = [], x
    for i, (w, b) in enumerate(params):
        y = dense(h, w, b)
        if perturbations is not None:
            y = y + perturbations[i]
        outs.append(y)
        h = jnp.tanh(y)
    return outs


def mlp_logits(params, x) -> jax.Array:
    return mlp_outputs(params, x)[-1]


def register_loss(kind: str, z: jax.Array, t: jax.Array, weight: float) -> jax.Array:
    if kind == "softmax":
        return kfacx.register_softmax_cross_entropy_loss(z, t, weight=weight)
    if kind == "sigmoid":
        return kfacx.register_sigmoid_cross_entropy_loss(z, t, weight=weight)
    if kind == "squared":
        return kfacx.register_squared_error_loss(z, t, weight=weight)
    raise ValueError(kind)


def make_tagged_mlp(kind: str, weight: float = 1.0):
    """A tagged loss function ``f(params, (x, t))`` for a tanh MLP."""

    def loss_fn(params, batch):
        x, t = batch
        h = x
        for i, (w, b) in enumerate(params):
            y = kfacx.register_dense(dense(h, w, b), h, w, b)
            h = jnp.tanh(y) if i < len(params) - 1 else y
        register_loss(kind, h, t, weight)
        return per_example_loss_sum(kind, h, t, weight) / x.shape[0]

    return loss_fn


def per_example_loss_sum(kind: str, z: jax.Array, t: jax.Array, weight: float) -> jax.Array:
    """``weight * sum_b l_b(z_b)`` written out independently of kfacx."""
    if kind == "softmax":
        log_p = jax.nn.log_softmax(z, axis=-1)
        return -weight * jnp.sum(jnp.take_along_axis(log_p, t[..., None], axis=-1))
    if kind == "sigmoid":
        return weight * jnp.sum(jnp.logaddexp(0.0, z) - z * t)
    if kind == "squared":
        return weight * jnp.sum(jnp.square(z - t))
    raise ValueError(kind)


def make_targets(kind: str, rng: np.random.Generator, shape: Sequence[int]) -> jax.Array:
    """Targets for logits of shape ``shape``."""
    if kind == "softmax":
        return jnp.asarray(
            np.asarray(rng.integers(0, shape[-1], size=shape[:-1]), np.int32), jnp.int32
        )
    if kind == "sigmoid":
        return jnp.asarray(np.asarray(rng.integers(0, 2, size=shape), np.float32), jnp.float32)
    return normal(rng, *shape)


def make_batch(kind: str, sizes: Sequence[int], batch: int, seed: int = 1, seq: int | None = None):
    rng = np.random.default_rng(seed)
    lead = (batch,) if seq is None else (batch, seq)
    x = normal(rng, *lead, sizes[0])
    return x, make_targets(kind, rng, lead + (sizes[-1],))


def output_hessian(kind: str, z: np.ndarray, weight: float) -> np.ndarray:
    """Explicit ``weight * H`` of one example's loss w.r.t. its logits ``z[K]``."""
    z = np.asarray(z, np.float64)
    if kind == "softmax":
        p = np.exp(z - z.max())
        p /= p.sum()
        return weight * (np.diag(p) - np.outer(p, p))
    if kind == "sigmoid":
        p = 1.0 / (1.0 + np.exp(-z))
        return weight * np.diag(p * (1 - p))
    if kind == "squared":
        return weight * 2.0 * np.eye(z.shape[-1])
    raise ValueError(kind)


@functools.partial(jax.jit, static_argnames=("kind",))
def _autodiff_output_hessian(z, t, weight, *, kind):
    return jax.hessian(lambda z_: per_example_loss_sum(kind, z_[None], t[None], weight))(z)


def autodiff_output_hessian(kind: str, z: jax.Array, t: jax.Array, weight: float) -> np.ndarray:
    """``weight * H`` of one example's loss by `jax.hessian` (cross-check)."""
    return np.asarray(_autodiff_output_hessian(z, t, weight, kind=kind), np.float64)


@jax.jit
def _logits_and_jacobian(params, x_row):
    """Logits ``[K]`` of one example and their Jacobian w.r.t. every parameter leaf."""
    return mlp_logits(params, x_row)[0], jax.jacfwd(lambda p: mlp_logits(p, x_row)[0])(params)


def logits_jacobian(params, x_row: jax.Array) -> tuple[np.ndarray, np.ndarray]:
    """``(z, J)`` with ``J = dz/dparams`` ``[K, P]`` by `jax.jacfwd` (ravel_pytree order)."""
    z, jac = _logits_and_jacobian(params, x_row)
    leaves = [np.asarray(j, np.float64).reshape(z.shape[0], -1) for j in jax.tree.leaves(jac)]
    return np.asarray(z, np.float64), np.concatenate(leaves, axis=1)


def exact_ggn(kind: str, params, x: jax.Array, weight: float) -> np.ndarray:
    """``(1/B) sum_b J_b^T (w H_b) J_b`` over all parameters (ravel_pytree order)."""
    total = 0.0
    for b in range(x.shape[0]):
        z, jac = logits_jacobian(params, x[b : b + 1])
        total = total + jac.T @ output_hessian(kind, z, weight) @ jac
    return total / x.shape[0]


@functools.partial(jax.jit, static_argnames=("kind",))
def _per_example_param_grad(params, x_b, t_b, *, kind):
    return jax.grad(lambda p: per_example_loss_sum(kind, mlp_logits(p, x_b[None]), t_b[None], 1.0))(
        params
    )


def per_example_param_grad(kind: str, params, x_b: jax.Array, t_b: jax.Array) -> np.ndarray:
    """Gradient of one example's unweighted loss w.r.t. the ravelled parameters."""
    grad = _per_example_param_grad(params, x_b, t_b, kind=kind)
    return np.asarray(ravel_pytree(grad)[0], np.float64)


def exact_fisher(kind: str, params, x: jax.Array, weight: float) -> np.ndarray:
    """``weight * E_{t ~ p(.|x)} [g g^T]`` by enumeration (B = 1), ravel_pytree order."""
    assert x.shape[0] == 1
    z = np.asarray(mlp_logits(params, x)[0], np.float64)
    k = z.shape[-1]
    if kind == "softmax":
        p = np.exp(z - z.max())
        p /= p.sum()
        outcomes = [(p[c], jnp.asarray(c, jnp.int32)) for c in range(k)]
    elif kind == "sigmoid":
        assert k <= 3
        q = 1.0 / (1.0 + np.exp(-z))
        outcomes = []
        for bits in itertools.product((0.0, 1.0), repeat=k):
            bits = np.asarray(bits)
            prob = float(np.prod(np.where(bits == 1.0, q, 1 - q)))
            outcomes.append((prob, jnp.asarray(bits, jnp.float32)))
    else:
        raise ValueError(kind)
    fisher = 0.0
    for prob, t in outcomes:
        g = per_example_param_grad(kind, params, x[0], t)
        fisher = fisher + prob * np.outer(g, g)
    return weight * fisher


def squared_error_fisher(params, x: jax.Array, weight: float) -> np.ndarray:
    """Fisher of the squared error (Gaussian, variance 0.5): ``2 w J^T J`` (B = 1)."""
    _, jac = logits_jacobian(params, x)
    return 2.0 * weight * jac.T @ jac


def leaf_slices(params) -> list[slice]:
    """Slices of every parameter leaf in the ravelled vector."""
    sizes = [int(np.prod(leaf.shape)) for leaf in jax.tree_util.tree_leaves(params)]
    offsets = np.cumsum([0] + sizes)
    return [slice(int(a), int(b)) for a, b in zip(offsets[:-1], offsets[1:], strict=True)]


def mlp_layer_index(params) -> list[np.ndarray]:
    """Ravelled indices of each layer's (w, b) (contiguous for the list-of-tuples MLPs)."""
    slices = leaf_slices(params)
    return [np.arange(slices[2 * i].start, slices[2 * i + 1].stop) for i in range(len(params))]


def block_mask(index_sets: Sequence[np.ndarray], dim: int) -> np.ndarray:
    """Boolean mask of the block-diagonal pattern given by ``index_sets``."""
    mask = np.zeros((dim, dim), bool)
    for idx in index_sets:
        mask[np.ix_(idx, idx)] = True
    return mask


def rest_of_network(params, layer: int, y: jax.Array) -> jax.Array:
    """The logits as a function of layer ``layer``'s output ``y`` (one row)."""
    h = y
    for w, b in params[layer + 1 :]:
        h = dense(jnp.tanh(h), w, b)
    return h


@functools.partial(jax.jit, static_argnames=("layer",))
def _rest_jacobians(params, ys, *, layer):
    """Per row ``r``: the Jacobian of the logits w.r.t. layer ``layer``'s output ``ys[r]``."""
    return jax.vmap(jax.jacfwd(lambda y: rest_of_network(params, layer, y)))(ys)


def hand_kfac_factors(kind: str, params, x: jax.Array, weight: float):
    """Per layer ``(A, G)`` computed by hand (float64).

    ``A = sum_rows [x, 1][x, 1]^T / num_rows`` and
    ``G = (1/B) sum_rows J_r^T (w H_r) J_r`` with ``J_r`` the Jacobian of the
    row's logits w.r.t. the row's layer output (rows: examples, or example x
    position for sequence inputs, whose positions are independent).
    """
    outs = mlp_outputs(params, x)
    inputs = [x] + [jnp.tanh(o) for o in outs[:-1]]
    batch = x.shape[0]
    logits = np.asarray(outs[-1]).reshape(-1, outs[-1].shape[-1])
    factors = []
    for layer, (w, _) in enumerate(params):
        rows = np.asarray(inputs[layer], np.float64).reshape(-1, w.shape[0])
        rows = np.concatenate([rows, np.ones((rows.shape[0], 1))], axis=1)
        a = rows.T @ rows / rows.shape[0]
        ys = outs[layer].reshape(-1, w.shape[1])
        jacs = np.asarray(_rest_jacobians(params, ys, layer=layer), np.float64)
        g = np.zeros((w.shape[1], w.shape[1]))
        for r in range(ys.shape[0]):
            g += jacs[r].T @ output_hessian(kind, logits[r], weight) @ jacs[r]
        factors.append((a, g / batch))
    return factors


def block_diag(*blocks: np.ndarray) -> np.ndarray:
    n = sum(b.shape[0] for b in blocks)
    out = np.zeros((n, n))
    i = 0
    for b in blocks:
        out[i : i + b.shape[0], i : i + b.shape[0]] = b
        i += b.shape[0]
    return out


class HaikuTaggedDense(hk.Module):
    """A Haiku dense layer tagged by hand with `kfacx.register_dense`."""

    def __init__(self, size, name=None):
        super().__init__(name=name)
        self.size = size

    def __call__(self, x):
        init = hk.initializers.RandomNormal(0.5)
        w = hk.get_parameter("w", [x.shape[-1], self.size], init=init)
        b = hk.get_parameter("b", [self.size], init=init)
        return kfacx.register_dense(dense(x, w, b), x, w, b)


class HaikuTaggedMLP(hk.Module):
    """tanh MLP of `HaikuTaggedDense` layers; parameters are "<name>/~/linear_i/{w,b}"."""

    def __init__(self, sizes, name=None):
        super().__init__(name=name)
        self.layers = [HaikuTaggedDense(s, name=f"linear_{i}") for i, s in enumerate(sizes)]

    def __call__(self, x):
        for layer in self.layers[:-1]:
            x = jnp.tanh(layer(x))
        return self.layers[-1](x)


# ----------------------------------------------------------------------------- scan models
# Layers inside `lax.scan`, and the same models unrolled with Python loops (which kfacx
# serves as separate layers for stacked parameters, or as tied uses for parameters shared
# by all iterations). ``tag=True`` registers every layer by hand.

#: How the scan is written: plain, reversed, its body under jax.jit or jax.checkpoint.
SCAN_VARIANTS = ("plain", "reverse", "jit", "checkpoint")


def scan_with(variant: str, body, init, xs):
    """``jax.lax.scan(body, init, xs)`` written as ``variant`` (see `SCAN_VARIANTS`)."""
    if variant == "jit":
        body = jax.jit(body)
    elif variant == "checkpoint":
        body = jax.checkpoint(body)
    return jax.lax.scan(body, init, xs, reverse=variant == "reverse")


def loop_order(variant: str, length: int) -> range:
    """The iteration order of `scan_with` (slice indices)."""
    return range(length - 1, -1, -1) if variant == "reverse" else range(length)


def _maybe_tag_dense(tag: bool, y, x, w, b=None):
    return kfacx.register_dense(y, x, w, b) if tag else y


def init_stacked_mlp(d_in: int, width: int, depth: int, d_out: int, seed: int = 0) -> dict:
    """``inp`` and ``out`` dense layers around ``depth`` hidden layers stacked in ``hidden``."""
    rng = np.random.default_rng(seed)

    def layer(*lead, d_i, d_o):
        w = normal(rng, *lead, d_i, d_o, scale=1.0 / np.sqrt(d_i))
        return dict(w=w, b=normal(rng, *lead, d_o, scale=0.5))

    return dict(
        inp=layer(d_i=d_in, d_o=width),
        hidden=layer(depth, d_i=width, d_o=width),
        out=layer(d_i=width, d_o=d_out),
    )


def _mlp_edge(p, x, tag):
    return _maybe_tag_dense(tag, dense(x, p["w"], p["b"]), x, p["w"], p["b"])


def stacked_mlp_logits(params, x, variant: str = "plain", tag: bool = False):
    """tanh MLP whose hidden layers run in a `lax.scan` over the stacked parameters."""

    def body(h, p):
        return jnp.tanh(_mlp_edge(p, h, tag)), None

    h = jnp.tanh(_mlp_edge(params["inp"], x, tag))
    h, _ = scan_with(variant, body, h, params["hidden"])
    return _mlp_edge(params["out"], h, tag)


def unstack_mlp(params, key: str = "hidden") -> dict:
    """``params[key]`` stacked ``[L, ...]`` -> a list of ``L`` layers (any array type)."""
    depth = jax.tree_util.tree_leaves(params[key])[0].shape[0]
    hidden = [jax.tree_util.tree_map(lambda a, i=i: a[i], params[key]) for i in range(depth)]
    return dict(params, **{key: hidden})


def unrolled_mlp_logits(params, x, variant: str = "plain", tag: bool = False):
    """`stacked_mlp_logits` with a Python loop over ``unstack_mlp(params)["hidden"]``."""
    h = jnp.tanh(_mlp_edge(params["inp"], x, tag))
    for i in loop_order(variant, len(params["hidden"])):
        h = jnp.tanh(_mlp_edge(params["hidden"][i], h, tag))
    return _mlp_edge(params["out"], h, tag)


def haiku_layer_stack_mlp(width: int, depth: int, d_out: int):
    """A Haiku MLP with ``depth`` `hk.Linear` + tanh layers in `hk.layer_stack`; its
    parameters map to `unrolled_mlp_logits`'s with `haiku_stack_to_unrolled`."""

    def forward(x):
        x = jnp.tanh(hk.Linear(width, name="inp")(x))
        x = hk.layer_stack(depth)(lambda h: jnp.tanh(hk.Linear(width, name="hidden")(h)))(x)
        return hk.Linear(d_out, name="out")(x)

    return hk.without_apply_rng(hk.transform(forward))


def haiku_stack_to_unrolled(params) -> dict:
    """Haiku layer-stack parameters -> the parameters of `unrolled_mlp_logits`."""
    stacked = params["__layer_stack_no_per_layer/hidden"]
    return unstack_mlp(dict(inp=params["inp"], hidden=stacked, out=params["out"]))


def init_rnn(d_in: int, hidden: int, d_out: int, seed: int = 0) -> dict:
    """An Elman RNN ``h = tanh(x_t @ wx + h @ wh + b)`` and a readout ``(wo, bo)``."""
    rng = np.random.default_rng(seed)
    return dict(
        wx=normal(rng, d_in, hidden, scale=1.0 / np.sqrt(d_in)),
        wh=normal(rng, hidden, hidden, scale=1.0 / np.sqrt(hidden)),
        b=normal(rng, hidden, scale=0.5),
        wo=normal(rng, hidden, d_out, scale=1.0 / np.sqrt(hidden)),
        bo=normal(rng, d_out, scale=0.5),
    )


def _rnn_cell(p, h, x, tag):
    a = _maybe_tag_dense(tag, jnp.tensordot(x, p["wx"], axes=1), x, p["wx"])
    r = _maybe_tag_dense(tag, dense(h, p["wh"], p["b"]), h, p["wh"], p["b"])
    return jnp.tanh(a + r)


def rnn_logits(params, xs, variant: str = "plain", tag: bool = False):
    """The RNN over ``xs [batch, time, d_in]`` by `lax.scan` (weights shared by all steps)."""
    h0 = jnp.zeros((xs.shape[0], params["wh"].shape[0]), xs.dtype)
    h, _ = scan_with(
        variant, lambda h, x: (_rnn_cell(params, h, x, tag), None), h0, jnp.swapaxes(xs, 0, 1)
    )
    return _maybe_tag_dense(
        tag, dense(h, params["wo"], params["bo"]), h, params["wo"], params["bo"]
    )


def unrolled_rnn_logits(params, xs, variant: str = "plain", tag: bool = False):
    """`rnn_logits` with a Python loop over time (tied weights)."""
    h = jnp.zeros((xs.shape[0], params["wh"].shape[0]), xs.dtype)
    for t in loop_order(variant, xs.shape[1]):
        h = _rnn_cell(params, h, xs[:, t], tag)
    return _maybe_tag_dense(
        tag, dense(h, params["wo"], params["bo"]), h, params["wo"], params["bo"]
    )


def loss_of_logits(logits_fn, kind: str = "squared", **kwargs):
    """``loss(params, (x, t))`` with loss ``kind`` on ``logits_fn(params, x, **kwargs)``."""

    def loss(params, batch):
        x, t = batch
        z = logits_fn(params, x, **kwargs)
        register_loss(kind, z, t, 1.0)
        return per_example_loss_sum(kind, z, t, 1.0) / x.shape[0]

    return loss


# ----------------------------------------------------------------------------- short runs


def fixed_rate_run(loss, params, batch, steps, learning_rate=0.3, momentum=0.5, seed=0, **kwargs):
    """``(optimizer, losses)``: ``steps`` steps of a `kfacx.Optimizer` with a fixed learning
    rate and momentum, damping 0.01 and ``kwargs``; its ``init`` must warn nothing (every
    parameter matched, no report note)."""
    opt = kfacx.Optimizer(
        jax.value_and_grad(loss),
        learning_rate_schedule=learning_rate,
        momentum_schedule=momentum,
        initial_damping=1e-2,
        num_burnin_steps=0,
        **kwargs,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state = opt.init(params, jax.random.PRNGKey(seed), batch)
    losses = []
    for i in range(steps):
        key = jax.random.PRNGKey(seed + 1 + i)
        params, state, stats = opt.step(params, state, key, batch=batch)
        losses.append(float(stats["loss"]))
    return opt, losses
