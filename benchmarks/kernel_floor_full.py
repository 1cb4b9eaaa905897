"""The kernel floor of a *full* K-FAC step (adaptive learning rate, momentum and damping,
L2 term, periodic inverse refresh, non-finite guard) for the deep autoencoder, on the
backend that runs this script: how few XLA kernels can such a step be?

Everything is plain JAX: the 784-1000-500-250-30-250-500-1000-784 autoencoder (tanh
between layers, the 30-unit code layer linear; weights ``[in, out]``, biases ``[out]``,
haiku's initialisation), sigmoid cross-entropy summed over pixels and averaged over the
batch, L2 1e-5 in the loss, a batch of 1000 uniform [0, 1] images. One jitted
``step(params, state, rng, batch) -> (params, state, stats)`` does what kfac-jax's
adaptive K-FAC does (Martens & Grosse 2015):

1. loss, gradient and, per layer, its inputs ``a`` and the gradients ``g`` with respect
   to its pre-activations (zero perturbations added to them, one ``jax.vjp``);
2. targets sampled from the model (Bernoulli) on the first 1/8 of the batch (125
   examples), their loss backpropagated to the pre-activations;
3. the 16 Kronecker factors ``A = [a 1]^T [a 1] / m``, ``G = g^T g * m``;
4. their moving averages (decay 0.95);
5. every 5 steps, in a ``lax.cond``, the damped inverses ``(F + sqrt(damping + l2) I)^-1``
   by batched Cholesky per size bucket (785/784, 1001/1000, 501/500, 251/250, 31/30);
6. the preconditioned gradient ``A^-1 [dW; db] G^-1`` per layer;
7. the exact quadratic model along it and the previous update (one forward-mode pass
   for both directions, the sigmoid cross-entropy's Hessian), solved for the learning
   rate and the momentum;
8. the update and the new velocity;
9. every 5 steps, in a ``lax.cond``, the Levenberg-Marquardt damping update from the
   loss at the new parameters (``rho`` thresholds 0.25 / 0.75, factor 0.95**5, floor
   1e-4);
10. a guard: a non-finite loss, gradient norm or update norm keeps the old parameters
    and state.

Nothing of kfacx is used. Kernels are counted by the project's `kernels.count_kernels`
on the compiled module, as `kernels.py` counts kfacx's step (885 kernels with its refresh,
531 without, 352 for the refresh alone) and an Adam step (`kernels._adam`: optax, decayed
weights and Adam) on the same model and batch, in the same process. Rows go from the
step written plainly (the brief's) to the leanest, one trick at a time, each row adding
one (`Opts` names them; every variant computes the same mathematics, and the steps that
sample alike give the same numbers); then single changes to the leanest step, the steps
without their refresh, the refreshes alone, and the same programs compiled without
XLA:CPU's YNNPACK fusions. ``--breakdown`` prints the leanest step's kernels by part
(the ``jax.named_scope`` of each of the 10 parts above) and kind, and the YNN subgraphs.
A numerical check runs the leanest step (``--steps``, default 20) on the batch.

Two things this backend does that the figures depend on:

- A YNN fusion is one kernel to the counter but can be a whole YNNPACK subgraph: the
  loss at the new parameters (part 9: 8 products, the tanh, the cross-entropy and its
  sum) becomes one, and so do 14 of the forward-mode pass's products with the GGN's
  reduction (part 7). Compiled without YNN fusions (``NO_YNN``) those are ordinary
  kernels again, and Adam's count changes too (101 -> 109).
- The CPU backend fuses producers into consumers, never siblings into one kernel: every
  array a program writes (each new parameter, each state array) costs a kernel of its
  own, and returning an input unchanged costs a copy, so the state's layout decides much
  of the count.

Besides the leanest step, the script measures *a library's* leanest step (`LIBRARY`):
the same layout, guard and sampling, but the backward pass, the forward-mode pass and
the loss left to JAX's autodiff of the user's function, as a library that did not write
the model must leave them. That row, not the hand-written one, is the floor kfacx can
reach on this backend.

Run:  python benchmarks/kernel_floor_full.py [--steps 20] [--breakdown]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import time
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import kernels as K  # noqa: E402
import optax  # noqa: E402

SIZES = (784, 1000, 500, 250, 30, 250, 500, 1000, 784)
LAYERS = len(SIZES) - 1
LINEAR = (3, 7)  # layers with no tanh after them (the code layer, the logits)
BATCH, CURV = 1000, 125  # batch, curvature examples (its first 1/8)
L2, DECAY, PERIOD = 1e-5, 0.95, 5
THRESHOLDS, MIN_DAMPING = (0.25, 0.75), 1e-4
BUCKETS = (785, 1001, 501, 251, 31)
#: (kind, layer, size) of the 16 factors.
FACTORS = [("A", i, SIZES[i] + 1) for i in range(LAYERS)] + [
    ("G", i, SIZES[i + 1]) for i in range(LAYERS)
]
SIZE = {(t, i): n for t, i, n in FACTORS}
#: bucket size -> its factors: five buckets, or one padded to 1001 for all 16.
GROUPS = {
    "five": {b: [(t, i) for t, i, n in FACTORS if 0 <= b - n <= 1] for b in BUCKETS},
    "one": {1001: [f for f in SIZE]},
}
SLOTS = {k: {f: (b, j) for b, fs in g.items() for j, f in enumerate(fs)} for k, g in GROUPS.items()}
SHAPES = [(a + 1, b) for a, b in zip(SIZES[:-1], SIZES[1:], strict=True)]  # [W; b]
OFFSETS = [0]
for _r, _c in SHAPES:
    OFFSETS.append(OFFSETS[-1] + _r * _c)


@dataclasses.dataclass(frozen=True)
class Opts:
    """How the step is written (every choice computes the same mathematics)."""

    backward: str = "autodiff"  # autodiff: jax.vjp twice | manual: by hand, 125 rows sampled
    sampler: str = "threefry"  # threefry: jax.random.bernoulli | bits: lax.rng_bit_generator
    ema: str = "factor"  # factor: 16 arrays | bucket: 5 padded [k, n, n] stacks
    inverses: str = "factor"  # factor: 16 arrays | bucket: 5 padded stacks
    flat: bool = False  # velocity as one flat vector, all inner products in one pass
    jvp: str = "two"  # two: two jax.jvp | vmap: one vmapped jax.jvp | manual: by hand
    guard: str = "where"  # where: on every leaf at the end | fused: into the producers
    #                       | cond: lax.cond(ok, new, old)
    solve: str = "cho_solve"  # cho_solve | trsm_dot: L^-1 by one solve, then L^-T L^-1
    refresh: str = "cond"  # cond: inside the step | none: no refresh, and the state comes
    #                        back without its (unchanged) inverses: returning an input
    #                        costs a copy kernel per array on this backend
    ema_in_refresh: str = "recompute"  # with guard=fused: recompute the average in the
    #                                    refresh's kernel | read: read it back
    transposed: bool = False  # hand LAPACK the transposed (equal) matrices, take the
    #                           transposed (equal up to rounding) inverses back
    derivative: str = "shared"  # shared: 1 - h*h everywhere | distinct: written differently
    #                             per use, so that CSE does not make it a kernel of its own
    layout: str = "wb"  # wb | aug: with backward=manual, the step's own forward runs on
    #                     [a 1] and [W; b] (the bias gradient and the bias tangent ride
    #                     in the products)
    buckets: str = "five"  # five: by size | one: all 16 padded to 1001 (3x the refresh's
    #                        flops, 4x its memory)
    serial: bool = True  # the buckets' LAPACK calls one after the other (see `refresh`)
    scalars: str = "plain"  # plain | packed: all scalars of parts 7-10 in one vector
    xent: str = "optax"  # optax | direct: max(z, 0) - z t + log1p(exp(-|z|))


# --- the model --------------------------------------------------------------------


def init_params(key):
    """haiku's hk.Linear initialisation: truncated normal, stddev 1/sqrt(fan_in)."""
    keys = jax.random.split(key, LAYERS)
    return [
        (jax.random.truncated_normal(k, -2.0, 2.0, (a, b)) / jnp.sqrt(a), jnp.zeros((b,)))
        for k, a, b in zip(keys, SIZES[:-1], SIZES[1:], strict=True)
    ]


def forward(params, x, eps=None):
    """The logits and the inputs of every layer (``eps``: added to the pre-activations)."""
    h, inputs = x, []
    for i, (w, b) in enumerate(params):
        inputs.append(h)
        s = h @ w + b if eps is None else h @ w + b + eps[i]
        h = s if i in LINEAR else jnp.tanh(s)
    return h, inputs


def forward_aug(waug, x):
    """`forward` on ``[x 1]`` with ``[W; b]``: the inputs come back with their ones column."""
    a, inputs = jnp.concatenate([x, jnp.ones((x.shape[0], 1))], 1), []
    for i, m in enumerate(waug):
        inputs.append(a)
        s = a @ m
        if i < LAYERS - 1:
            a = jnp.concatenate([s if i in LINEAR else jnp.tanh(s), jnp.ones((x.shape[0], 1))], 1)
    return s, inputs


def xent(logits, targets, o=None):
    """Sigmoid cross-entropy summed over pixels and examples (``o.xent == "direct"``: the
    stable formula written out, one kernel; optax's takes three on the CPU)."""
    if o is None or o.xent == "optax":
        return jnp.sum(optax.sigmoid_binary_cross_entropy(logits, targets))
    z = logits
    return jnp.sum(jnp.maximum(z, 0) - z * targets + jnp.log1p(jnp.exp(-jnp.abs(z))))


def data_loss(params, x, o=None):
    return xent(forward(params, x)[0], x, o) / x.shape[0]


def backward(params, inputs, ct, rows=None, distinct=None, aug=False):
    """dL/ds of every layer by hand, from the logits' cotangent ``ct`` (on the first
    ``rows`` examples when given; ``aug``: the inputs have their ones column)."""
    gs, g = [None] * LAYERS, ct
    for i in reversed(range(LAYERS)):
        gs[i] = g
        if i:
            g = g @ params[i][0].T
            if i - 1 not in LINEAR:
                h = inputs[i] if rows is None else inputs[i][:rows]
                h = h[:, :-1] if aug else h
                g = g * (1 - h * h) if distinct is None else g * distinct(h)
    return gs


def jvp_both(params, inputs, tangents, aug=False):
    """The logits' derivative along two directions at once, by hand: ``tangents[i]`` is
    layer i's pair (``[in, 2, out]`` weights, ``[2, out]`` biases) of both directions, or
    with ``aug`` its ``[in+1, 2, out]`` stack (the inputs having their ones column);
    returns ``[n, 2, 784]``."""
    n, dh = inputs[0].shape[0], None
    for i, ((w, _), t) in enumerate(zip(params, tangents, strict=True)):
        if aug:
            ds = jnp.einsum("ni,ido->ndo", inputs[i], t)
        else:
            ds = jnp.einsum("ni,ido->ndo", inputs[i], t[0]) + t[1]
        if dh is not None:
            ds = ds + (dh.reshape(2 * n, -1) @ w).reshape(ds.shape)
        if i not in LINEAR:
            h = inputs[i + 1][:, :-1] if aug else inputs[i + 1]
            ds = ds * (1 - h * h)[:, None, :]
        dh = ds
    return dh


# --- the state --------------------------------------------------------------------


def init_state(o: Opts):
    if o.ema == "bucket":
        ema = {b: jnp.zeros((len(fs), b, b)) for b, fs in GROUPS[o.buckets].items()}
    else:
        ema = {f: jnp.zeros((n, n)) for f, n in SIZE.items()}
    if o.inverses == "bucket":
        inv = {
            b: jnp.broadcast_to(jnp.eye(b), (len(fs), b, b)) for b, fs in GROUPS[o.buckets].items()
        }
    else:
        inv = {f: jnp.eye(n) for f, n in SIZE.items()}
    vel = jnp.zeros((OFFSETS[-1],)) if o.flat else [jnp.zeros(s) for s in SHAPES]
    return dict(step=jnp.int32(0), damping=jnp.float32(1.0), ema=ema, inv=inv, vel=vel)


def _pad(m, n):
    return jnp.pad(m, ((0, n - m.shape[0]), (0, n - m.shape[1])))


def _stacked(per_factor, b, o: Opts, scaled=False):
    """Bucket ``b``'s factors as one padded stack (``scaled``: raw statistics times
    1/m for A, m for G)."""
    scale = {"A": 1 / CURV, "G": float(CURV)} if scaled else {"A": 1.0, "G": 1.0}
    return jnp.stack([_pad(per_factor[f] * scale[f[0]], b) for f in GROUPS[o.buckets][b]])


def refresh(ema, damping, o: Opts, stats=None):
    """Damped inverses of the 16 factors: batched Cholesky per bucket (padding gives the
    damping's identity block, harmless). With ``stats`` the moving average is taken here
    (fused into the damping's kernel) instead of being read back."""
    d = jnp.sqrt(damping + L2)
    out = {}
    for b in GROUPS[o.buckets]:
        stack = ema[b] if o.ema == "bucket" else _stacked(ema, b, o)
        if stats is not None:
            stack = DECAY * stack + (1 - DECAY) * _stacked(stats, b, o, scaled=True)
        damped = stack + d * jnp.eye(b)
        if out and o.serial:
            # Each bucket waits for the previous one's inverses, through a zero that XLA
            # may not fold away, read inside the damping's kernel (no kernel of its own):
            # on jax 0.10.2's CPU backend, batched LAPACK calls that run at the same time
            # can deadlock (docs/performance_notes.md, "The CPU refresh loops over
            # matrices"); without this the step hangs.
            damped = damped + 0.0 * out[list(out)[-1]][0, 0, 0]
        if o.transposed:  # LAPACK's column-major layout is a free transpose of row-major
            damped = jnp.swapaxes(damped, 1, 2)  # the same matrices: they are symmetric
        chol = jax.lax.linalg.cholesky(damped, symmetrize_input=False)
        eye = jnp.broadcast_to(jnp.eye(b), stack.shape)
        if o.solve == "cho_solve":
            inv = jax.scipy.linalg.cho_solve((chol, True), eye)
        else:
            linv = jax.lax.linalg.triangular_solve(chol, eye, left_side=True, lower=True)
            inv = jnp.einsum("kji,kjl->kil", linv, linv)
        out[b] = jnp.swapaxes(inv, 1, 2) if o.transposed else inv
    if o.inverses == "bucket":
        return out
    slot = SLOTS[o.buckets]
    return {f: out[slot[f][0]][slot[f][1], :n, :n] for f, n in SIZE.items()}


def inverse(inv, f, o: Opts):
    if o.inverses == "bucket":
        b, k = SLOTS[o.buckets][f]
        return inv[b][k, : SIZE[f], : SIZE[f]]
    return inv[f]


def _scalars(gram, ggn, lam, loss_data):
    """Learning rate, momentum, quadratic-model change, loss, |delta|^2, theta.delta and
    the guard's flag (1.0 when all finite) from the Gram matrix of (g, p, theta, v) and
    the 2x2 GGN Gram matrix of (p, v)."""
    G, P, T, V = range(4)
    q00 = ggn[0, 0] + (lam + L2) * gram[P, P]
    q01 = ggn[0, 1] + (lam + L2) * gram[P, V]
    q11 = ggn[1, 1] + (lam + L2) * gram[V, V]
    b0, b1 = gram[G, P], gram[G, V]
    det = q00 * q11 - q01 * q01
    has_v = gram[V, V] > 0  # no velocity yet: learning rate only
    alpha = jnp.where(has_v, (q01 * b1 - q11 * b0) / det, -b0 / q00)
    mu = jnp.where(has_v, (q01 * b0 - q00 * b1) / det, 0.0)
    quad_change = 0.5 * (b0 * alpha + b1 * mu)  # the model's value at its minimiser
    loss = loss_data + 0.5 * L2 * gram[T, T]
    dd = alpha * alpha * gram[P, P] + 2 * alpha * mu * gram[P, V] + mu * mu * gram[V, V]
    td = alpha * gram[P, T] + mu * gram[T, V]
    finite = jnp.isfinite(loss) & jnp.isfinite(gram[G, G]) & jnp.isfinite(dd)
    return alpha, mu, quad_change, loss, dd, td, finite.astype(loss.dtype)


# --- the step ---------------------------------------------------------------------


def sample(rng, prob, o: Opts):
    """Bernoulli(prob) targets."""
    if o.sampler == "threefry":
        return jax.random.bernoulli(rng, prob).astype(prob.dtype)
    key = jnp.tile(jax.random.key_data(rng), 2)
    _, bits = jax.lax.rng_bit_generator(key, prob.shape, jnp.uint32)
    uniform = jax.lax.bitcast_convert_type(bits >> 9 | 0x3F800000, jnp.float32) - 1.0
    return (uniform < prob).astype(prob.dtype)


def make_step(o: Opts):
    def step(params, state, rng, x):
        n, lam = x.shape[0], state["damping"]
        with jax.named_scope("part1"):
            aug = [jnp.concatenate([w, b[None]]) for w, b in params]  # theta as [W; b]
            if o.backward == "autodiff":
                eps = [jnp.zeros((n, w.shape[1])) for w, _ in params]
                logits, vjp_fn, inputs = jax.vjp(
                    lambda p, e: forward(p, x, e), params, eps, has_aux=True
                )
            elif o.layout == "aug":
                logits, inputs = forward_aug(aug, x)
            else:
                logits, inputs = forward(params, x)
            prob = jax.nn.sigmoid(logits)
            loss_data = xent(logits, x, o) / n
        with jax.named_scope("part2"):
            ct_sampled = (prob[:CURV] - sample(rng, prob[:CURV], o)) / CURV
        with jax.named_scope("part1"):
            if o.backward == "autodiff":
                (grads, _) = vjp_fn((prob - x) / n)
                _, geps = vjp_fn(jnp.pad(ct_sampled, ((0, n - CURV), (0, 0))))
                gs = [g[:CURV] for g in geps]
            else:
                d1 = d2 = None
                if o.derivative == "distinct":
                    d1, d2 = (lambda h: (1 - h) * (1 + h)), (lambda h: 1 - h**2)
                ax = o.layout == "aug"
                g_true = backward(params, inputs, (prob - x) / n, distinct=d1, aug=ax)
                if ax:  # [dW; db] in one product
                    grads = [a.T @ g for a, g in zip(inputs, g_true, strict=True)]
                else:
                    grads = [(a.T @ g, g.sum(0)) for a, g in zip(inputs, g_true, strict=True)]
                gs = backward(params, inputs, ct_sampled, rows=CURV, distinct=d2, aug=ax)
        with jax.named_scope("part3"):
            stats = {}
            for i in range(LAYERS):
                if o.layout == "aug":
                    a1 = inputs[i][:CURV]
                else:
                    a1 = jnp.concatenate([inputs[i][:CURV], jnp.ones((CURV, 1))], 1)
                # the scales 1/m and m are applied in the moving average's kernel
                stats[("A", i)] = a1.T @ a1
                stats[("G", i)] = gs[i].T @ gs[i]
        with jax.named_scope("part4"):
            if o.ema == "bucket":
                ema = {
                    b: DECAY * state["ema"][b] + (1 - DECAY) * _stacked(stats, b, o, scaled=True)
                    for b in GROUPS[o.buckets]
                }
            else:
                scale = {"A": 1 / CURV, "G": float(CURV)}
                ema = {
                    f: DECAY * state["ema"][f] + (1 - DECAY) * scale[f[0]] * stats[f] for f in SIZE
                }
        with jax.named_scope("part5"):
            if o.refresh == "cond":
                if o.guard == "fused" and o.ema_in_refresh == "recompute":
                    fresh = lambda: refresh(state["ema"], lam, o, stats)  # noqa: E731
                else:
                    fresh = lambda: refresh(ema, lam, o)  # noqa: E731
                is_refresh = state["step"] % PERIOD == 0
                inv = jax.lax.cond(is_refresh, fresh, lambda: state["inv"])
            else:
                inv = state["inv"]
        with jax.named_scope("part6"):
            if o.layout == "aug" and o.backward == "manual":
                g_aug = [g + L2 * m for g, m in zip(grads, aug, strict=True)]
            else:
                g_aug = [
                    jnp.concatenate([gw + L2 * w, (gb + L2 * b)[None]])
                    for (gw, gb), (w, b) in zip(grads, params, strict=True)
                ]
            p_aug = [
                inverse(inv, ("A", i), o) @ g @ inverse(inv, ("G", i), o)
                for i, g in enumerate(g_aug)
            ]
        with jax.named_scope("part7"):
            if o.flat:
                v_flat = state["vel"]
                v_aug = [
                    v_flat[a:e].reshape(s)
                    for a, e, s in zip(OFFSETS, OFFSETS[1:], SHAPES, strict=False)
                ]
            else:
                v_aug = state["vel"]
            # The exact (GGN) curvature along p and v: J p, J v at the logits.
            if o.jvp == "manual":
                ax = o.layout == "aug" and o.backward == "manual"
                if ax:
                    tangents = [jnp.stack([p, v], 1) for p, v in zip(p_aug, v_aug, strict=True)]
                else:
                    tangents = [
                        (jnp.stack([p[:-1], v[:-1]], 1), jnp.stack([p[-1], v[-1]]))
                        for p, v in zip(p_aug, v_aug, strict=True)
                    ]
                jpv = jvp_both(params, inputs, tangents, aug=ax)  # [n, 2, 784]
            else:
                tree = [[(t[:-1], t[-1]) for t in d] for d in (p_aug, v_aug)]
                f = lambda p: forward(p, x)[0]  # noqa: E731
                if o.jvp == "vmap":
                    both = jax.tree.map(lambda a, b: jnp.stack([a, b]), *tree)
                    jpv = jax.vmap(lambda t: jax.jvp(f, (params,), (t,))[1])(both)
                else:
                    jpv = jnp.stack([jax.jvp(f, (params,), (t,))[1] for t in tree])
                jpv = jnp.moveaxis(jpv, 0, 1)  # [n, 2, 784]
            hess = prob * (1 - prob) / n
            ggn = jnp.sum(jpv[:, :, None] * jpv[:, None] * hess[:, None, None], axis=(0, 3))
            # Inner products of (g, p, theta, v): one Gram matrix.
            if o.flat:
                flats = [jnp.concatenate([m.ravel() for m in ms]) for ms in (g_aug, p_aug, aug)]
                X = jnp.stack([*flats, v_flat])
                gram = X @ X.T
            else:
                gram = sum(
                    (lambda s: s @ s.T)(jnp.stack([m.ravel() for m in ms]))
                    for ms in zip(g_aug, p_aug, aug, v_aug, strict=True)
                )
            G, P, T, V = range(4)
            sc = _scalars(gram, ggn, lam, loss_data)
            if o.scalars == "packed":  # one kernel computes them all
                sc = jnp.stack(sc)
            alpha, mu, quad_change, loss, dd, td, finite = (sc[k] for k in range(7))
        with jax.named_scope("part10"):
            ok = finite > 0
            keep = (lambda new, old: jnp.where(ok, new, old)) if o.guard == "fused" else None
        with jax.named_scope("part8"):
            if o.flat:
                new_vel = alpha * X[P] + mu * X[V]
                delta = [
                    new_vel[a:e].reshape(s)
                    for a, e, s in zip(OFFSETS, OFFSETS[1:], SHAPES, strict=False)
                ]
            else:
                new_vel = delta = [alpha * p + mu * v for p, v in zip(p_aug, v_aug, strict=True)]
            if keep:
                new_vel = jax.tree.map(keep, new_vel, state["vel"])
                delta = [jnp.where(ok, d, 0.0) for d in delta]
            new_params = [(w + d[:-1], b + d[-1]) for (w, b), d in zip(params, delta, strict=True)]
        with jax.named_scope("part9"):

            def adapt():
                new_loss = data_loss(new_params, x, o) + 0.5 * L2 * (gram[T, T] + 2 * td + dd)
                rho = (new_loss - loss) / quad_change
                lo, hi = THRESHOLDS
                factor = jnp.where(
                    rho > hi, DECAY**PERIOD, jnp.where(rho < lo, 1 / DECAY**PERIOD, 1)
                )
                return jnp.maximum(lam * factor, MIN_DAMPING)

            new_lam = jax.lax.cond(state["step"] % PERIOD == 0, adapt, lambda: lam)
        with jax.named_scope("part10"):
            new_state = dict(step=state["step"] + 1, damping=new_lam, ema=ema, inv=inv, vel=new_vel)
            old_state = dict(state)
            if o.refresh == "none":  # unchanged, so not returned (see Opts.refresh)
                del new_state["inv"], old_state["inv"]
            if o.guard == "where":
                new_params, new_state = jax.tree.map(
                    lambda a, b: jnp.where(ok, a, b), (new_params, new_state), (params, old_state)
                )
            elif o.guard == "cond":
                new_params, new_state = jax.lax.cond(
                    ok, lambda: (new_params, new_state), lambda: (params, old_state)
                )
            else:  # params and velocity are guarded above; the rest fuses here
                for k in ("step", "damping", "ema", "inv"):
                    if k in new_state:
                        new_state[k] = jax.tree.map(keep, new_state[k], state[k])
        stats_out = dict(loss=loss, lr=alpha, momentum=mu, damping=lam)
        return new_params, new_state, stats_out

    return step


# --- measuring --------------------------------------------------------------------

#: Instructions that only move data (a fusion of nothing else is a copy in effect).
MOVES = {
    "parameter",
    "constant",
    "bitcast",
    "broadcast",
    "slice",
    "concatenate",
    "pad",
    "copy",
    "transpose",
    "reshape",
    "iota",
    "tuple",
    "get-tuple-element",
}


def _scope(line, default):
    m = re.search(r'op_name="([^"]*)"', line)
    found = re.search(r"part\d+", m.group(1)) if m else None
    return found.group(0) if found else default


def breakdown(hlo: str) -> list[tuple[str, str, Counter]]:
    """(part, kind, ops inside) of every instruction `count_kernels` counts in ``hlo``,
    walked as it walks them; instructions without a part get their caller's."""
    bodies, entry, current = {}, None, None
    for line in hlo.splitlines():
        m = K._COMPUTATION.match(line)
        if m and not line.startswith(" "):
            current, bodies[m.group(2)] = m.group(2), []
            entry = current if m.group(1) else entry
        elif current is not None and line.startswith(" "):
            bodies[current].append(line)

    def ops(name):
        found = (K._INSTRUCTION.match(line) for line in bodies.get(name, []))
        return Counter(m.group(1) for m in found if m)

    out = []

    def walk(name, seen, default):
        for line in bodies.get(name, []):
            m = K._INSTRUCTION.match(line)
            if m is None or m.group(1) in K.FREE:
                continue
            op = m.group(1)
            if op in ("while", "conditional", "call"):
                for single, several in K._CALLEES.findall(line):
                    callees = [single] if single else [c.strip(" %") for c in several.split(",")]
                    for c in callees:
                        if c and c not in seen:
                            walk(c, seen | {c}, _scope(line, default))
                continue
            inside = Counter({op: 1})
            if op == "fusion":
                inside = ops(re.search(r"calls=%?([\w.\-]+)", line).group(1))
                work = Counter({k: v for k, v in inside.items() if k not in MOVES})
                if "__ynn_fusion" in line:
                    main = "dot" if "dot" in work else "reduce" if "reduce" in work else "eltwise"
                    op = "ynn " + main if sum(work.values()) <= 1 else "ynn subgraph"
                else:
                    op = "fusion: data movement" if not work else "fusion: arithmetic"
            elif op == "custom-call":
                op = re.search(r'custom_call_target="([^"]*)"', line).group(1)
            out.append((_scope(line, default), op, inside))

    walk(entry, frozenset({entry}), "other")
    return out


#: XLA:CPU compiled without its YNNPACK fusions (dots, reductions and the elementwise
#: chains around them then become plain XLA kernels).
NO_YNN = {"xla_cpu_experimental_ynn_fusion_type": ""}


def measure_without_ynn(fn, args) -> dict:
    """Kernels and first-compile seconds of ``jax.jit(fn)`` compiled with `NO_YNN`."""
    t0 = time.perf_counter()
    compiled = jax.jit(fn).trace(*args).lower().compile(compiler_options=NO_YNN)
    hlo = compiled.as_text()
    assert "__ynn_fusion" not in hlo
    return dict(kernels=K.count_kernels(hlo), first_compile=time.perf_counter() - t0)


def measure(fn, args, show=False, **jit_kwargs) -> dict:
    """`kernels.measure`, plus the breakdown (checked against its count) when ``show``."""
    r = K.measure(fn, args, **jit_kwargs)
    if show:
        hlo = jax.jit(fn, **jit_kwargs).lower(*args).compile().as_text()
        r["breakdown"] = breakdown(hlo)
        assert len(r["breakdown"]) == r["kernels"] == K.count_kernels(hlo)
    return r


def adam_step():
    """`kernels._adam`'s Adam step (optax: decayed weights 1e-5, Adam 1e-3) on the model."""
    tx, step = K._adam(data_loss, False)
    return tx, step


BRIEF = Opts()  # the brief's step written plainly
#: (label, options): the tricks, each added to the row above it.
CUMULATIVE = [
    ("brief's step: jax.vjp twice, 16 factor arrays, two jvps, where on every leaf", BRIEF),
    ("+ averages in 5 padded bucket stacks", dict(ema="bucket")),
    ("+ flat velocity, one Gram matrix for all inner products", dict(flat=True)),
    ("+ one vmapped jvp for both directions", dict(jvp="vmap")),
    ("+ guard fused into its producers, average recomputed in the refresh", dict(guard="fused")),
    ("+ cross-entropy written out (1 kernel, not 3)", dict(xent="direct")),
    ("+ Bernoulli bits by lax.rng_bit_generator", dict(sampler="bits")),
    ("+ backward by hand (sampled pass on its 125 rows)", dict(backward="manual")),
    ("+ jvp by hand (both directions in each product)", dict(jvp="manual")),
    ("+ inverses in the 5 bucket stacks", dict(inverses="bucket")),
    ("+ the step's forward on [a 1] and [W; b]", dict(layout="aug")),
]
#: The leanest step a *library* can compile for a model it did not write: the backward
#: pass and the jvp stay JAX's autodiff of the user's function and the loss stays the
#: user's (optax); the layout, the guard and the sampling are the library's to choose.
LIBRARY = Opts(
    ema="bucket", flat=True, jvp="vmap", guard="fused", sampler="bits", inverses="bucket"
)
#: Single changes to the library's leanest step.
LIBRARY_ALTERNATIVES = [
    ("cross-entropy written out (the user's loss rewritten)", dict(xent="direct")),
    ("inverses as 16 factor arrays", dict(inverses="factor")),
    ("averages as 16 factor arrays", dict(ema="factor")),
    ("guard: where on every leaf at the end", dict(guard="where")),
]
#: Single changes to the leanest step, kept out of it (each costs kernels or is even).
ALTERNATIVES = [
    ("guard: where on every leaf at the end", dict(guard="where")),
    ("guard: lax.cond(ok, new, old)", dict(guard="cond")),
    ("average read back by the refresh, not recomputed", dict(ema_in_refresh="read")),
    ("averages as 16 factor arrays", dict(ema="factor")),
    ("inverses as 16 factor arrays", dict(inverses="factor")),
    ("inverse: L^-1 by one solve, then L^-T L^-1", dict(solve="trsm_dot")),
    ("LAPACK handed the transposed (equal) matrices", dict(transposed=True)),
    ("tanh' written differently per use (no CSE)", dict(derivative="distinct")),
    ("the scalars of parts 7-10 packed in one vector", dict(scalars="packed")),
    ("one bucket of 16 padded to 1001 (3x the refresh flops)", dict(buckets="one")),
]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=20, help="steps of the numerical check")
    parser.add_argument("--breakdown", action="store_true", help="kernels by part and kind")
    args = parser.parse_args(argv)
    jax.config.update("jax_enable_compilation_cache", False)
    device = jax.devices()[0]
    print(f"backend: {device.platform} ({device.device_kind}), jax {jax.__version__}")

    params = init_params(jax.random.key(42))
    batch = jax.random.uniform(jax.random.key(1), (BATCH, SIZES[0]))
    rng = jax.random.key(0)
    tx, adam = adam_step()
    base = measure(adam, (params, tx.init(params), batch))
    rows = [("Adam (optax, kernels._adam)", base)]

    def step_row(label, o, show=False, **jit_kwargs):
        r = measure(make_step(o), (params, init_state(o), rng, batch), show, **jit_kwargs)
        rows.append((label, r))
        return r

    def refresh_row(label, o):
        state = init_state(o)
        rows.append((label, measure(lambda e, d: refresh(e, d, o), (state["ema"], 1.0))))

    o = BRIEF
    for label, change in CUMULATIVE:
        o = dataclasses.replace(o, **change) if isinstance(change, dict) else change
        best = step_row(label, o, show=o == dataclasses.replace(o, **CUMULATIVE[-1][1]))
    best_opts = o
    for label, change in ALTERNATIVES:
        step_row(f"  leanest, but {label}", dataclasses.replace(best_opts, **change))
    step_row("  leanest, params and state donated", best_opts, donate_argnums=(0, 1))
    step_row("a library's leanest step (autodiff of the user's model and loss)", LIBRARY)
    for label, change in LIBRARY_ALTERNATIVES:
        step_row(f"  library's leanest, but {label}", dataclasses.replace(LIBRARY, **change))
    step_row(
        "  library's leanest without the refresh",
        dataclasses.replace(LIBRARY, refresh="none", inverses="factor"),
    )
    step_row("brief's step without the refresh", dataclasses.replace(BRIEF, refresh="none"))
    refresh_row("brief's refresh alone (cho_solve, 16 arrays out)", BRIEF)
    step_row("leanest without the refresh", dataclasses.replace(best_opts, refresh="none"))
    lean_nr = dataclasses.replace(best_opts, refresh="none", inverses="factor")
    step_row("  same, inverses as 16 factor arrays", lean_nr)
    refresh_row("leanest refresh alone (5 stacks out)", best_opts)
    refresh_row("  same, 16 factor arrays out", dataclasses.replace(best_opts, inverses="factor"))
    # The same programs compiled without XLA:CPU's YNNPACK fusions (which can make a chain
    # of products, elementwise ops and a reduction one kernel): ratios to Adam, also so.
    no_ynn = measure_without_ynn(adam, (params, tx.init(params), batch))
    rows.append(("without YNN fusions: Adam", no_ynn))
    for label, o in [
        ("without YNN fusions: brief's step", BRIEF),
        ("without YNN fusions: leanest step", best_opts),
        ("without YNN fusions: leanest without the refresh (16 inverse arrays)", lean_nr),
    ]:
        r = measure_without_ynn(make_step(o), (params, init_state(o), rng, batch))
        rows.append((label, dict(r, base=no_ynn["kernels"])))

    print(f"\n{'program':<82}{'kernels':>8}{'x Adam':>8}{'compile s':>10}")
    for label, r in rows:
        ratio = r["kernels"] / r.get("base", base["kernels"])
        print(f"{label:<82}{r['kernels']:>8d}{ratio:>8.2f}{r['first_compile']:>10.2f}")

    if args.breakdown:
        print_breakdown(best["breakdown"])

    if args.steps:
        check(best_opts, params, batch, args.steps)
    return dict(rows=[(label, r["kernels"]) for label, r in rows])


def print_breakdown(lines):
    """The leanest step's kernels by part and kind, and its multi-op YNN subgraphs."""
    parts = sorted({p for p, _, _ in lines}, key=lambda p: (len(p), p))
    kinds = sorted({k for _, k, _ in lines})
    counts = Counter((p, k) for p, k, _ in lines)
    print("\nthe leanest step's kernels by part (columns) and kind (rows)")
    print(f"{'':<24}" + "".join(f"{p.replace('part', 'p'):>6}" for p in parts) + f"{'all':>6}")
    for k in kinds:
        print(
            f"{k:<24}"
            + "".join(f"{counts[p, k]:>6}" for p in parts)
            + f"{sum(counts[p, k] for p in parts):>6}"
        )
    print(
        f"{'all':<24}"
        + "".join(f"{sum(counts[p, k] for k in kinds):>6}" for p in parts)
        + f"{len(lines):>6}"
    )
    for p, k, inside in lines:
        if k == "ynn subgraph":
            work = {op: c for op, c in inside.items() if op not in MOVES}
            print(f"  {p}: one YNN subgraph of {sum(work.values())} ops: {dict(work)}")


def check(o, params, batch, steps):
    """Runs the step ``steps`` times on one batch (new sampling key each step)."""
    step = jax.jit(make_step(o))
    state = init_state(o)
    print(f"\nthe leanest step, {steps} steps on one batch:")
    t0 = time.perf_counter()
    for k in range(steps):
        params, state, stats = step(params, state, jax.random.fold_in(jax.random.key(1), k), batch)
        if k in (0, 1, steps - 1) or k % 5 == 4:
            print(
                f"  step {k:>3}: loss {float(stats['loss']):8.3f}  lr {float(stats['lr']):+.4f}"
                f"  momentum {float(stats['momentum']):.4f}  damping {float(stats['damping']):.4f}"
            )
    loss = float(data_loss(params, batch)) + float(l2_loss(params))
    print(f"  loss after {steps} steps: {loss:.3f} ({time.perf_counter() - t0:.1f} s)")


def l2_loss(params):
    return 0.5 * L2 * sum(jnp.sum(w * w) + jnp.sum(b * b) for w, b in params)


if __name__ == "__main__":
    main()
