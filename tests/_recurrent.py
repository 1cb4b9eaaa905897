"""Recurrent cells whose gates share one matrix product: fused-gate LSTMs written with
per-gate parameter leaves (Flax's ``OptimizedLSTMCell``, a Haiku module, plain JAX), and
the same cells written with one fused weight leaf (the reference kfacx serves as an
ordinary dense layer).

A *form* is ``(loss, params, to_fused)``: the model's loss on a batch ``(xs [B, T, D],
targets [B, T, H'])``, its parameters, and the map from its parameters to those of its
fused reference (`fused_loss`), whose loss is the same function.
"""

from __future__ import annotations

import functools
import warnings

import flax.linen as nn
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

import kfacx

B, T, D, H = 3, 3, 2, 3
DAMPING = 0.1
GATES = ("i", "f", "g", "o")


def cat(arrays, axis=-1):
    return jnp.concatenate(list(arrays), axis=axis)


def gates(z, c):
    """The LSTM update from the gates' pre-activations ``z [..., 4H]`` (i, f, g, o)."""
    i, f, g, o = jnp.split(z, 4, axis=-1)
    c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
    return c, jax.nn.sigmoid(o) * jnp.tanh(c)


def squared_loss(out, targets):
    kfacx.register_squared_error_loss(out, targets)
    return 0.5 * jnp.sum((out - targets) ** 2) / out.shape[0]


def normal(rng, *shape, scale=0.6):
    return jnp.asarray(scale * rng.standard_normal(shape))


def batch(seed: int = 1, out: int = H):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.standard_normal((B, T, D))), jnp.asarray(
        0.5 * rng.standard_normal((B, T, out))
    )


# ----------------------------------------------------------------------------- references


def fused_cell(w, carry, x):
    """One step of the fused LSTM: ``w = (wx [D, 4H], wh [H, 4H], b [4H])``."""
    wx, wh, b = w
    c, h = carry
    c, h = gates((h @ wh + b[None]) + x @ wx, c)
    return (c, h), h


def run_fused(w, xs, reverse=False):
    """The fused LSTM over ``xs [B, T, D]`` by `lax.scan`: hidden states ``[B, T, H]``."""
    zeros = jnp.zeros((xs.shape[0], w[1].shape[0]), xs.dtype)
    _, hs = jax.lax.scan(
        lambda carry, x: fused_cell(w, carry, x),
        (zeros, zeros),
        jnp.swapaxes(xs, 0, 1),
        reverse=reverse,
    )
    return jnp.swapaxes(hs, 0, 1)


def fused_loss(p, data):
    """The reference of every form but `concat_inputs`: ``{"wx", "wh", "b"}`` (and a
    second direction ``"back"`` for the bidirectional one)."""
    xs, targets = data
    out = run_fused((p["wx"], p["wh"], p["b"]), xs)
    if "back" in p:
        q = p["back"]
        out = cat([out, run_fused((q["wx"], q["wh"], q["b"]), xs, reverse=True)])
    return squared_loss(out, targets)


def init_fused(seed: int = 0):
    rng = np.random.default_rng(seed)
    return dict(wx=normal(rng, D, 4 * H), wh=normal(rng, H, 4 * H), b=normal(rng, 4 * H))


def unpermuted(like, perm, reference):
    """The tree shaped like ``like`` whose entries, permuted by ``perm`` (`positions`), are
    ``reference``'s (flattened in pytree-leaf order)."""
    flat = np.empty(len(perm))
    flat[perm] = np.concatenate([np.ravel(a) for a in jax.tree_util.tree_leaves(reference)])
    leaves, tree = jax.tree_util.tree_flatten(like)
    offsets = np.cumsum([0] + [np.size(a) for a in leaves])
    parts = [
        jnp.asarray(flat[o : o + np.size(a)].reshape(np.shape(a)))
        for o, a in zip(offsets, leaves, strict=False)
    ]
    return jax.tree_util.tree_unflatten(tree, parts)


# ----------------------------------------------------------------------------- plain JAX


def init_gates(seed: int = 0):
    """Per-gate leaves: ``{"wx": {gate: [D, H]}, "wh": {gate: [H, H]}, "b": {gate: [H]}}``."""
    rng = np.random.default_rng(seed)
    return {
        "wx": {g: normal(rng, D, H) for g in GATES},
        "wh": {g: normal(rng, H, H) for g in GATES},
        "b": {g: normal(rng, H) for g in GATES},
    }


def gates_to_fused(p):
    return {k: cat([p[k][g] for g in GATES]) for k in ("wx", "wh", "b")}


def concat_gates_loss(where: str):
    """``x @ concatenate([w_i, w_f, w_g, w_o], -1)`` and the same for ``h`` and the bias,
    concatenated ``where``: in the body of the `lax.scan`, ``"outside"`` it (the scan
    closes over the concatenations), or ``"unrolled"``: a Python loop over time."""

    def fused(p):
        return tuple(cat([p[k][g] for g in GATES]) for k in ("wx", "wh", "b"))

    def loss(p, data):
        xs, targets = data
        zeros = jnp.zeros((xs.shape[0], H), xs.dtype)
        if where == "unrolled":
            w, carry, hs = fused(p), (zeros, zeros), []
            for t in range(xs.shape[1]):
                carry, h = fused_cell(w, carry, xs[:, t])
                hs.append(h)
            return squared_loss(jnp.stack(hs, 1), targets)
        w = fused(p)

        def step(carry, x):
            return fused_cell(fused(p) if where == "inside" else w, carry, x)

        _, hs = jax.lax.scan(step, (zeros, zeros), jnp.swapaxes(xs, 0, 1))
        return squared_loss(jnp.swapaxes(hs, 0, 1), targets)

    return loss


def init_concat_inputs(seed: int = 0):
    rng = np.random.default_rng(seed)
    return dict(w_x=normal(rng, D, 4 * H), w_h=normal(rng, H, 4 * H), b=normal(rng, 4 * H))


def concat_inputs_loss(p, data):
    """``concatenate([x, h]) @ concatenate([w_x, w_h], 0) + b`` under `lax.scan`."""
    return _concat_inputs(lambda: cat([p["w_x"], p["w_h"]], 0), p["b"], data)


def concat_inputs_reference(p, data):
    """`concat_inputs_loss` with one weight leaf ``w [D + H, 4H]``."""
    return _concat_inputs(lambda: p["w"], p["b"], data)


def _concat_inputs(weight, b, data):
    xs, targets = data

    def step(carry, x):
        c, h = carry
        c, h = gates(cat([x, h]) @ weight() + b[None], c)
        return (c, h), h

    zeros = jnp.zeros((xs.shape[0], H), xs.dtype)
    _, hs = jax.lax.scan(step, (zeros, zeros), jnp.swapaxes(xs, 0, 1))
    return squared_loss(jnp.swapaxes(hs, 0, 1), targets)


def init_concat_inputs_fused(seed: int = 0):
    rng = np.random.default_rng(seed)
    return dict(w=normal(rng, D + H, 4 * H), b=normal(rng, 4 * H))


def concat_inputs_to_fused(p):
    return dict(w=cat([p["w_x"], p["w_h"]], 0), b=p["b"])


# ----------------------------------------------------------------------------- Haiku


class HaikuFusedLSTM(hk.RNNCore):
    """An LSTM with a parameter per gate, multiplied once: ``x @ concatenate(w, -1)``."""

    def __init__(self, hidden: int, name: str | None = None):
        super().__init__(name=name)
        self.hidden = hidden

    def _weights(self, prefix: str, rows: int):
        init = hk.initializers.RandomNormal(0.6)
        return cat(
            [hk.get_parameter(f"{prefix}_{g}", (rows, self.hidden), init=init) for g in GATES]
        )

    def __call__(self, x, state):
        c, h = state
        wx, wh = self._weights("wx", x.shape[-1]), self._weights("wh", self.hidden)
        b = cat([hk.get_parameter(f"b_{g}", (self.hidden,), init=jnp.zeros) for g in GATES])
        c, h = gates((h @ wh + b[None]) + x @ wx, c)
        return h, (c, h)

    def initial_state(self, batch_size):
        zeros = jnp.zeros((batch_size, self.hidden))
        return zeros, zeros


def haiku_model():
    def forward(xs):
        core = HaikuFusedLSTM(H, name="lstm")
        zeros = jnp.zeros((xs.shape[0], H), xs.dtype)
        hs, _ = hk.dynamic_unroll(core, jnp.swapaxes(xs, 0, 1), (zeros, zeros))
        return jnp.swapaxes(hs, 0, 1)

    return hk.without_apply_rng(hk.transform(forward))


def haiku_to_fused(p):
    q = p["lstm"]
    return {k: cat([q[f"{k}_{g}"] for g in GATES]) for k in ("wx", "wh", "b")}


# ----------------------------------------------------------------------------- Flax


def flax_to_fused(p):
    """``OptimizedLSTMCell``'s leaves ``{i,h}{i,f,g,o}/kernel``, ``h*/bias`` -> fused."""
    cell = p.get("params", p)["cell"]
    return dict(
        wx=cat([cell[f"i{g}"]["kernel"] for g in GATES]),
        wh=cat([cell[f"h{g}"]["kernel"] for g in GATES]),
        b=cat([cell[f"h{g}"]["bias"] for g in GATES]),
    )


def flax_bidirectional_to_fused(p):
    p = p["params"]
    return dict(flax_to_fused(p["forward_rnn"]), back=flax_to_fused(p["backward_rnn"]))


def flax_model(bidirectional: bool = False):
    def rnn():
        cell = nn.OptimizedLSTMCell(
            H, kernel_init=nn.initializers.normal(0.6), param_dtype=jnp.float64
        )
        return nn.RNN(cell)

    if bidirectional:
        return nn.Bidirectional(rnn(), rnn())
    return rnn()


def flax_loss(model):
    def loss(p, data):
        xs, targets = data
        return squared_loss(model.apply(p, xs), targets)

    return loss


def flax_params(model, seed: int = 0):
    params = model.init(jax.random.PRNGKey(seed), batch()[0])
    rng = np.random.default_rng(seed + 7)  # nonzero biases
    return jax.tree_util.tree_map(
        lambda a: jnp.asarray(a) + normal(rng, *a.shape, scale=0.3), params
    )


def flax_scanned(cell_cls):
    """``cell_cls`` under ``nn.scan`` (over axis 1), returning the hidden states."""

    class Scanned(nn.Module):
        @nn.compact
        def __call__(self, xs):
            scan = nn.scan(
                cell_cls,
                variable_broadcast="params",
                split_rngs={"params": False},
                in_axes=1,
                out_axes=1,
            )
            carry = cell_cls(H, parent=None).initialize_carry(KEY, xs[:, 0].shape)
            return scan(H)(carry, xs)[1]

    return Scanned()


KEY = jax.random.PRNGKey(0)

#: Flax recurrent models already served per gate (and ``OptimizedLSTMCell`` under
#: ``nn.scan``): name -> (model, output features).
FLAX_CELLS = {
    "lstm_rnn": (lambda: nn.RNN(nn.LSTMCell(H)), H),
    "gru_rnn": (lambda: nn.RNN(nn.GRUCell(H)), H),
    "lstm_scan": (lambda: flax_scanned(nn.LSTMCell), H),
    "gru_scan": (lambda: flax_scanned(nn.GRUCell), H),
    "optimized_lstm_scan": (lambda: flax_scanned(nn.OptimizedLSTMCell), H),
    "bidirectional_lstm": (
        lambda: nn.Bidirectional(nn.RNN(nn.LSTMCell(H)), nn.RNN(nn.LSTMCell(H))),
        2 * H,
    ),
}


# ----------------------------------------------------------------------------- language model

#: A character language model: vocabulary, hidden size, sequences, length.
V, LM_HIDDEN, LM_BATCH, LM_LEN = 4, 6, 16, 6


def lm_text(seed: int = 0):
    """One-hot inputs ``[LM_BATCH, LM_LEN, V]`` and next characters of a deterministic
    grammar: each character is the sum of the two before it, modulo ``V`` (the model
    must remember two steps)."""
    rng = np.random.default_rng(seed)
    s = np.zeros((LM_BATCH, LM_LEN + 1), np.int32)
    s[:, :2] = rng.integers(0, V, (LM_BATCH, 2))
    for t in range(2, LM_LEN + 1):
        s[:, t] = (s[:, t - 1] + s[:, t - 2]) % V
    return jax.nn.one_hot(s[:, :-1], V), jnp.asarray(s[:, 1:])


def lm_params(seed: int = 0):
    rng = np.random.default_rng(seed)

    def w(*shape, scale):
        return jnp.asarray(scale * rng.standard_normal(shape), jnp.float32)

    return {
        "wx": {g: w(V, LM_HIDDEN, scale=0.5) for g in GATES},
        "wh": {g: w(LM_HIDDEN, LM_HIDDEN, scale=0.3) for g in GATES},
        "b": {g: jnp.zeros(LM_HIDDEN) for g in GATES},
        "wo": w(LM_HIDDEN, V, scale=0.3),
        "bo": jnp.zeros(V),
    }


def lm_loss(p, data):
    """The fused-gate LSTM (`concat_gates_loss`'s cell) and a softmax readout."""
    xs, ys = data
    w = tuple(cat([p[k][g] for g in GATES]) for k in ("wx", "wh", "b"))
    zeros = jnp.zeros((xs.shape[0], LM_HIDDEN))
    _, hs = jax.lax.scan(lambda c, x: fused_cell(w, c, x), (zeros, zeros), jnp.swapaxes(xs, 0, 1))
    logits = jnp.swapaxes(hs, 0, 1) @ p["wo"] + p["bo"][None, None]
    kfacx.register_softmax_cross_entropy_loss(logits, ys)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), ys[..., None], -1))


# ----------------------------------------------------------------------------- sliced weights


def haiku_gru():
    """``hk.GRU``: ``w_h`` and ``b`` split into the update/reset and candidate slices."""

    def forward(xs):
        core = hk.GRU(H, w_h_init=hk.initializers.RandomNormal(0.6))
        hs, _ = hk.dynamic_unroll(core, jnp.swapaxes(xs, 0, 1), core.initial_state(xs.shape[0]))
        return jnp.swapaxes(hs, 0, 1)

    return hk.without_apply_rng(hk.transform(forward))


def gru_reference_loss(p, data):
    """`haiku_gru` with a leaf per slice: ``w_h_zr``, ``w_h_a``, ``b_zr``, ``b_a``."""
    xs, targets = data

    def step(state, x):
        zr_x, a_x = jnp.split(x @ p["w_i"], [2 * H], axis=-1)
        zr_h = state @ p["w_h_zr"]
        zr = zr_x + zr_h + jnp.broadcast_to(p["b_zr"], zr_h.shape)
        z, r = jnp.split(jax.nn.sigmoid(zr), 2, axis=-1)
        a_h = (r * state) @ p["w_h_a"]
        a = jnp.tanh(a_x + a_h + jnp.broadcast_to(p["b_a"], a_h.shape))
        state = (1 - z) * state + z * a
        return state, state

    zeros = jnp.zeros((xs.shape[0], H), xs.dtype)
    _, hs = jax.lax.scan(step, zeros, jnp.swapaxes(xs, 0, 1))
    return squared_loss(jnp.swapaxes(hs, 0, 1), targets)


def gru_to_reference(p):
    q = p["gru"]
    return dict(
        w_i=q["w_i"],
        w_h_zr=q["w_h"][:, : 2 * H],
        w_h_a=q["w_h"][:, 2 * H :],
        b_zr=q["b"][: 2 * H],
        b_a=q["b"][2 * H :],
    )


def init_sliced(seed: int = 0):
    rng = np.random.default_rng(seed)
    return dict(w=normal(rng, D + H, 4 * H), v=normal(rng, H, 3 * H))


def sliced_loss(p, data):
    """Slices of leaves read by different layers, in a scan: ``w``'s rows by the input
    and the recurrent product (``w[:D]``, ``w[D:]``: ``slice``), ``v``'s columns
    (``jnp.split``) by one layer, and by another as ``concatenate([v_b, v_c], 0)``."""
    return _sliced(lambda: (p["w"][:D], p["w"][D:]), lambda: jnp.split(p["v"], 3, axis=1), data)


def sliced_reference(p, data):
    return _sliced(lambda: (p["w_x"], p["w_h"]), lambda: (p["v_a"], p["v_b"], p["v_c"]), data)


def sliced_to_reference(p):
    w, v = p["w"], p["v"]
    return dict(w_x=w[:D], w_h=w[D:], v_a=v[:, :H], v_b=v[:, H : 2 * H], v_c=v[:, 2 * H :])


def _sliced(w_parts, v_parts, data):
    xs, targets = data

    def step(h, x):
        (w_x, w_h), (v_a, v_b, v_c) = w_parts(), v_parts()
        g = jnp.tanh(x @ w_x + h @ w_h)
        h = jnp.tanh(g[:, :H] @ v_a + cat([g[:, H : 2 * H], h]) @ cat([v_b, v_c], 0))
        return h + 0.1 * g[:, 3 * H :], h

    zeros = jnp.zeros((xs.shape[0], H), xs.dtype)
    _, hs = jax.lax.scan(step, zeros, jnp.swapaxes(xs, 0, 1))
    return squared_loss(jnp.swapaxes(hs, 0, 1), targets)


# ----------------------------------------------------------------------------- comparisons


def positions(params, to_fused) -> np.ndarray:
    """``perm`` with ``reference_flat = flat[perm]`` (pytree-leaf order, row-major)."""
    leaves, tree = jax.tree_util.tree_flatten(params)
    offsets = np.cumsum([0] + [np.size(leaf) for leaf in leaves])
    index = [
        np.arange(o, o + np.size(a)).reshape(np.shape(a))
        for o, a in zip(offsets, leaves, strict=False)
    ]
    fused = to_fused(jax.tree_util.tree_unflatten(tree, index))
    return np.concatenate([np.ravel(a) for a in jax.tree_util.tree_leaves(fused)])


def estimate(loss, args, vector):
    """One jitted program: one ``ggn_exact`` update, the dense matrix, and the damped
    inverse products of ``vector`` (exact and factored damping). No warning allowed."""
    est = kfacx.BlockDiagonalCurvature(
        loss, default_estimation_mode="ggn_exact", exact_powers_to_cache=(-1.0,)
    )

    def run(args, vector):
        state = est.init(KEY, args)
        state = est.update_curvature_matrix_estimate(state, 0.0, 1.0, None, KEY, args)
        state = est.update_cache(state, DAMPING)
        inverse = functools.partial(est.multiply_inverse, state, vector, DAMPING)
        return est.to_dense_matrix(state), inverse(exact_power=True, use_cached=True), inverse()

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dense, exact, approx = jax.jit(run)(args, vector)
    return est, np.asarray(dense), exact, approx


def assert_close(got, want, rtol=1e-9):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape and np.abs(want).max() > 0
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * np.abs(want).max())
