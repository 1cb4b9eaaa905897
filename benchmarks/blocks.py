"""Benchmark: the curvature blocks K-FAC, K-FAC-reduce, TNT and EKFAC on three problems.

`kfacx.Optimizer` runs once per ``curvature_block`` (``"kfac"``, ``"kfac_reduce"``,
``"tnt"``, ``"ekfac"``), every other option as in the other benchmarks: ``l2_reg``, adaptive
learning rate, momentum and damping, ``initial_damping=1.0``, everything else at
kfacx's defaults (curvature on 1/8 of the batch but at least 128 examples,
inverses every 5 steps, 10 burn-in steps). Every block starts from the same
parameters and sees the same batches in the same order with the same keys.

Problems:

- ``autoencoder``: the deep autoencoder of `examples/autoencoder_mnist.py` on
  the 5,000 MNIST images (batch 1000). Its dense layers see one row per example
  (no shared positions), where K-FAC-reduce *is* K-FAC: the two curves must
  agree up to rounding (the script prints the largest difference).
- ``mnist1d``: the 1-D CNN of `examples/classifier_mnist1d.py` on MNIST-1D's
  4,000 training sequences (batch 128). Its convolutions share their kernels
  over 40, 20 and 10 output positions, where reduce differs.
- ``lm``: a small Transformer language model (pre-norm, causal multi-head
  attention, GELU MLP, sinusoidal positions, untied embedding and output
  layer) on tokens from a random second-order Markov chain generated here
  (each pair of previous tokens allows two next tokens; 10 % of the tokens are
  uniform noise). Its dense layers run over the sequence positions, with a loss
  at every position. The loss is measured on 1,024 held-out sequences; the
  chain's entropy (the lowest reachable loss) is printed.

"Loss" is the mean loss on the problem's whole evaluation set (the data term,
without L2), after every ``--eval-every`` steps (not timed). "Seconds" are the
summed wall time of the burn-in and the steps, each blocked until done;
compilation is excluded (each optimizer's burn-in and step are compiled on
throwaway calls first, and that time is reported as "compile s"). The target of
a problem is the loss the first block (K-FAC) has reached after
``--target-fraction`` of its steps: K-FAC reaches it by construction, the
others may be faster, slower or never.

Step times are measured after training, in ``--timing-rounds`` rounds (after
one warm-up round): each round runs every block for one inverse-refresh period
(5 steps) in turn, so slow drifts of a shared machine hit all blocks alike.
"median" is the median step (a step without a refresh), "amortised" the mean
over whole periods (refreshes included), both as ratios to K-FAC's. "XLA
flops" is XLA's static count for the lowered step (a conditional counts as its
costliest branch, so the refresh is in it; a loop body once), as a ratio to
K-FAC's: the statistics, where the blocks differ, are outside both.

Run:  python benchmarks/blocks.py [--out benchmarks/blocks.json]
      python benchmarks/blocks.py --problems lm --lm-steps 600 --lm-width 32  (one problem)
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

import autoencoder_mnist as ae  # noqa: E402
import classifier_mnist1d as cnn  # noqa: E402
import common  # noqa: E402
import datasets  # noqa: E402

import kfacx  # noqa: E402

BLOCKS = tuple(kfacx.blocks.CURVATURE_BLOCKS)
NAMES = {"kfac": "K-FAC", "kfac_reduce": "K-FAC-reduce", "tnt": "TNT", "ekfac": "EKFAC"}
L2_REG = 1e-5


@dataclasses.dataclass
class Problem:
    """One training problem: the loss, the initial parameters, the batches, the
    evaluation."""

    name: str
    description: str
    loss_fn: Callable[[Any, Any], jax.Array]
    params: Any
    batch: Callable[[int], Any]  # step index -> batch
    evaluate: Callable[[Any], jax.Array]  # params -> mean loss on the evaluation set
    steps: int
    info: dict = dataclasses.field(default_factory=dict)


# ----------------------------------------------------------------------------- problems


def autoencoder_problem(args) -> Problem:
    (images, _), _ = datasets.mnist()
    images = jnp.asarray(images)
    order = common.batch_order(len(images), args.autoencoder_batch, args.autoencoder_steps, seed=0)

    @jax.jit
    def full_loss(params):
        logits = ae.net.apply(params, images)
        return jnp.mean(jnp.sum(optax.sigmoid_binary_cross_entropy(logits, images), axis=-1))

    return Problem(
        "autoencoder",
        f"deep autoencoder, 5,000 MNIST images, batch {args.autoencoder_batch}; loss on all images",
        ae.loss_fn,
        ae.net.init(jax.random.key(42), images[:1]),
        lambda i: images[order[i % len(order)]],
        full_loss,
        args.autoencoder_steps,
    )


def mnist1d_problem(args) -> Problem:
    (x, y), _ = datasets.mnist1d()
    x, y = jnp.asarray(x), jnp.asarray(y)
    order = common.batch_order(len(x), args.mnist1d_batch, args.mnist1d_steps, seed=0)
    return Problem(
        "mnist1d",
        f"1-D CNN, MNIST-1D ({len(x)} training sequences), batch {args.mnist1d_batch}; "
        "loss on all training sequences",
        cnn.loss_fn,
        cnn.net.init(jax.random.key(0), x[:1]),
        lambda i: (x[order[i % len(order)]], y[order[i % len(order)]]),
        jax.jit(lambda params: cnn.evaluate(params, x, y)[0]),
        args.mnist1d_steps,
    )


class MarkovChain:
    """A random second-order Markov chain over ``vocab`` tokens: after the tokens
    ``(a, b)`` the next is one of two tokens ``succ[a, b]`` (probabilities
    ``prob[a, b]``), or with probability ``noise`` a uniform token."""

    def __init__(self, vocab: int, noise: float = 0.1, seed: int = 1234):
        rng = np.random.default_rng(seed)
        self.vocab, self.noise = vocab, noise
        self.succ = rng.integers(0, vocab, (vocab, vocab, 2))
        self.prob = rng.dirichlet(np.ones(2), (vocab, vocab))

    def next_token_probs(self) -> np.ndarray:
        """``[vocab, vocab, vocab]``: the distribution of the next token after each pair."""
        v = self.vocab
        probs = np.full((v, v, v), self.noise / v)
        a, b = np.meshgrid(np.arange(v), np.arange(v), indexing="ij")
        for k in range(2):
            np.add.at(probs, (a, b, self.succ[..., k]), (1 - self.noise) * self.prob[..., k])
        return probs

    def entropy(self) -> float:
        """The mean entropy (nats) of the next token, over uniformly distributed pairs (the
        pairs' stationary distribution is close to uniform: the noise mixes them)."""
        p = self.next_token_probs()
        return float(-np.sum(p * np.log(p)) / self.vocab**2)

    def sample(self, n: int, length: int, seed: int) -> np.ndarray:
        """``[n, length]`` token sequences, the first two tokens uniform."""
        rng = np.random.default_rng(seed)
        seq = np.zeros((n, length), np.int32)
        seq[:, :2] = rng.integers(0, self.vocab, (n, 2))
        for t in range(2, length):
            a, b = seq[:, t - 2], seq[:, t - 1]
            second = rng.random(n) >= self.prob[a, b, 0]
            nxt = self.succ[a, b, second.astype(int)]
            noise = rng.random(n) < self.noise
            seq[:, t] = np.where(noise, rng.integers(0, self.vocab, n), nxt)
        return seq


def sinusoidal_positions(length: int, width: int) -> np.ndarray:
    """The fixed position encodings of Vaswani et al. (no parameters)."""
    angles = np.arange(length)[:, None] / 10000 ** (2 * np.arange(width // 2)[None] / width)
    return np.concatenate([np.sin(angles), np.cos(angles)], axis=-1).astype(np.float32)


def lm_problem(args) -> Problem:
    vocab, length, width = args.lm_vocab, args.lm_length, args.lm_width
    positions = sinusoidal_positions(length, width)

    def forward(tokens):
        h = hk.Embed(vocab, width, name="embed")(tokens) + positions[: tokens.shape[1]]
        causal = jnp.tril(jnp.ones((tokens.shape[1],) * 2, bool))[None, None]
        for i in range(args.lm_layers):
            a = hk.LayerNorm(-1, True, True, name=f"ln_attn_{i}")(h)
            attention = hk.MultiHeadAttention(
                args.lm_heads,
                width // args.lm_heads,
                w_init=hk.initializers.VarianceScaling(),
                name=f"attn_{i}",
            )
            h = h + attention(a, a, a, mask=causal)
            m = hk.LayerNorm(-1, True, True, name=f"ln_mlp_{i}")(h)
            h = h + hk.nets.MLP([4 * width, width], activation=jax.nn.gelu, name=f"mlp_{i}")(m)
        h = hk.LayerNorm(-1, True, True, name="ln_final")(h)
        return hk.Linear(vocab, name="unembed")(h)

    net = hk.without_apply_rng(hk.transform(forward))

    def loss_fn(params, seq, register=True):
        """Next-token cross-entropy, mean over all positions of all sequences."""
        logits = net.apply(params, seq[:, :-1]).reshape(-1, vocab)
        targets = seq[:, 1:].reshape(-1)
        if register:
            logits = kfacx.register_softmax_cross_entropy_loss(logits, targets)
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, targets))

    chain = MarkovChain(vocab)
    train = jnp.asarray(chain.sample(args.lm_sequences, length + 1, seed=1))
    held_out = jnp.asarray(chain.sample(1024, length + 1, seed=2))
    order = common.batch_order(len(train), args.lm_batch, args.lm_steps, seed=0)
    params = net.init(jax.random.key(0), train[:1, :-1])
    n_params = sum(p.size for p in jax.tree.leaves(params))
    entropy = chain.entropy()
    return Problem(
        "lm",
        f"Transformer LM, {args.lm_layers} layers, width {width}, {args.lm_heads} heads, "
        f"vocabulary {vocab}, length {length}, {n_params:,} parameters; "
        f"{args.lm_sequences} sequences, batch {args.lm_batch}; loss on 1,024 held-out "
        f"sequences (chain entropy {entropy:.3f}, uniform {math.log(vocab):.3f})",
        loss_fn,
        params,
        lambda i: train[order[i % len(order)]],
        jax.jit(lambda params: loss_fn(params, held_out, register=False)),
        args.lm_steps,
        info=dict(entropy=entropy, uniform=math.log(vocab), parameters=n_params),
    )


PROBLEMS = {"autoencoder": autoencoder_problem, "mnist1d": mnist1d_problem, "lm": lm_problem}


# ----------------------------------------------------------------------------- runs


def _timed(fn, *args):
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    return out, time.perf_counter() - t0


def make_optimizer(problem: Problem, block: str, **extra) -> kfacx.Optimizer:
    """`kfacx.Optimizer` as the other benchmarks use it, with ``curvature_block=block``."""
    return kfacx.Optimizer(
        jax.value_and_grad(problem.loss_fn),
        l2_reg=L2_REG,
        add_l2_reg=True,
        use_adaptive_learning_rate=True,
        use_adaptive_momentum=True,
        use_adaptive_damping=True,
        initial_damping=1.0,
        curvature_block=block,
        **extra,
    )


def train(problem: Problem, block: str, eval_every: int) -> tuple[dict, Any]:
    """Burn-in and ``problem.steps`` steps with ``block``; returns the record and
    ``(optimizer, params, state)`` for the step timing."""
    burnin = kfacx.CurvatureConfig().num_burnin_steps
    # The burn-in is run (and timed) explicitly, so the optimizer itself runs none.
    opt = make_optimizer(problem, block, num_burnin_steps=0)
    params, rng = problem.params, jax.random.key(1)
    first = jax.block_until_ready(problem.batch(0))
    state = opt.init(params, jax.random.key(0), first)
    flops = jax.jit(opt.unstaged_step).lower(params, state, rng, first).cost_analysis()["flops"]
    # Compile the burn-in and the step on throwaway calls.
    t0 = time.perf_counter()
    warm, _ = opt.burnin(1, params, state, rng, iter([first]))
    jax.block_until_ready(opt.step(params, warm, rng, first))
    first_calls = time.perf_counter() - t0

    batches = (jax.block_until_ready(problem.batch(i)) for i in range(burnin))
    (state, _), burnin_s = _timed(opt.burnin, burnin, params, state, rng, batches)
    steps, seconds, losses = [0], [burnin_s], [float(problem.evaluate(params))]
    step_times, skipped, elapsed = [], 0, burnin_s
    for i in range(problem.steps):
        batch = jax.block_until_ready(problem.batch(i))
        (params, state, stats), dt = _timed(
            opt.step, params, state, jax.random.fold_in(rng, i), batch
        )
        step_times.append(dt)
        elapsed += dt
        skipped += int(stats["skipped"])
        if (i + 1) % eval_every == 0 or i + 1 == problem.steps:
            loss = float(problem.evaluate(params))
            steps.append(i + 1)
            seconds.append(elapsed)
            losses.append(loss if math.isfinite(loss) else float("inf"))
    record = dict(
        block=block,
        name=NAMES.get(block, block),
        steps=steps,
        seconds=seconds,
        losses=losses,
        final_loss=losses[-1],
        burnin_s=burnin_s,
        training_step_median_s=float(np.median(step_times)),
        # The first calls compile, then run one burn-in step and one step.
        compile_s=first_calls - burnin_s / burnin - float(np.median(step_times)),
        xla_flops=float(flops),
        skipped_steps=skipped,
        final_damping=float(stats["damping"]),
        final_learning_rate=float(stats["learning_rate"]),
    )
    return record, (opt, params, state)


def time_steps(runs: dict, batch, rounds: int) -> dict[str, list[float]]:
    """Step times of every block, ``rounds`` rounds of one inverse-refresh period each
    (the blocks in turn within a round); the first round is a warm-up."""
    times: dict[str, list[float]] = {block: [] for block in runs}
    states = {block: (params, state) for block, (_, params, state) in runs.items()}
    rng = jax.random.key(2)
    for r in range(rounds + 1):
        for block, (opt, _, _) in runs.items():
            params, state = states[block]
            for i in range(opt.curvature.inverse_update_period):
                key = jax.random.fold_in(rng, 1000 * r + i)
                (params, state, _), dt = _timed(opt.step, params, state, key, batch)
                if r:
                    times[block].append(dt)
            states[block] = (params, state)
    return times


def first_hit(record: dict, target: float) -> tuple[int | None, float | None]:
    """Steps and seconds at the first evaluation with a loss at most ``target``."""
    hits = np.flatnonzero(np.asarray(record["losses"]) <= target)
    if not hits.size:
        return None, None
    return record["steps"][hits[0]], record["seconds"][hits[0]]


def target_of(record: dict, fraction: float) -> float:
    """The lowest loss ``record`` reached within ``fraction`` of its steps."""
    last = fraction * record["steps"][-1]
    pairs = zip(record["steps"], record["losses"], strict=True)
    return min(loss for step, loss in pairs if step <= last)


def run_problem(problem: Problem, args) -> dict:
    print(f"\n== {problem.name}: {problem.description}", flush=True)
    records, runs = {}, {}
    for block in args.blocks:
        records[block], runs[block] = train(problem, block, args.eval_every)
        r = records[block]
        print(
            f"  {r['name']}: loss {r['losses'][0]:.4g} -> {r['final_loss']:.4g} in "
            f"{problem.steps} steps, {r['seconds'][-1]:.1f} s (burn-in {r['burnin_s']:.1f} s), "
            f"compile {r['compile_s']:.1f} s, {r['skipped_steps']} skipped",
            flush=True,
        )
    target = target_of(records[args.blocks[0]], args.target_fraction)
    times = time_steps(runs, jax.block_until_ready(problem.batch(0)), args.timing_rounds)
    ref = args.blocks[0]
    ref_median, ref_mean = np.median(times[ref]), np.mean(times[ref])
    print(
        f"  target: {target:.4g}, the loss {NAMES.get(ref, ref)} reached within "
        f"{args.target_fraction:g} of its {problem.steps} steps"
    )
    head = f"  {'block':<14}{'steps to':>9}{'s to':>7}{'final':>11}{'median':>8}{'/ ' + ref:>9}"
    head += f"{'amortised':>11}{'/ ' + ref:>9}{'XLA flops':>11}{'compile':>9}"
    print(head + f"\n  {'':<14}{'target':>9}{'target':>7}{'loss':>11}{'ms':>8}{'':>9}{'ms':>11}")
    for block, r in records.items():
        steps_to, seconds_to = first_hit(r, target)
        median, mean = float(np.median(times[block])), float(np.mean(times[block]))
        r.update(
            steps_to_target=steps_to,
            seconds_to_target=seconds_to,
            step_median_s=median,
            step_amortised_s=mean,
            median_ratio=median / ref_median,
            amortised_ratio=mean / ref_mean,
            flops_ratio=r["xla_flops"] / records[ref]["xla_flops"],
            step_times_s=times[block],
        )
        print(
            f"  {r['name']:<14}{'-' if steps_to is None else steps_to:>9}"
            f"{'-' if seconds_to is None else f'{seconds_to:.1f}':>7}{r['final_loss']:>11.4g}"
            f"{1e3 * median:>8.1f}{r['median_ratio']:>9.2f}{1e3 * mean:>11.1f}"
            f"{r['amortised_ratio']:>9.2f}{r['flops_ratio']:>11.2f}{r['compile_s']:>8.1f}s"
        )
    if "kfac" in records and "kfac_reduce" in records:
        a, b = (np.asarray(records[k]["losses"]) for k in ("kfac", "kfac_reduce"))
        diff = float(np.max(np.abs(a - b) / np.abs(a)))
        print(f"  K-FAC-reduce vs K-FAC: largest relative difference of the losses {diff:.2g}")
    else:
        diff = None
    return dict(
        description=problem.description,
        steps=problem.steps,
        target=target,
        reduce_vs_kfac_max_relative_difference=diff,
        blocks=records,
        **problem.info,
    )


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--problems", nargs="+", default=list(PROBLEMS), choices=list(PROBLEMS))
    parser.add_argument(
        "--blocks",
        nargs="+",
        default=list(BLOCKS),
        choices=BLOCKS,
        help="curvature_block values; the first sets the target and is the reference of "
        "the ratios (default: %(default)s)",
    )
    parser.add_argument("--autoencoder-steps", type=int, default=120)
    parser.add_argument("--autoencoder-batch", type=int, default=1000)
    parser.add_argument("--mnist1d-steps", type=int, default=400)
    parser.add_argument("--mnist1d-batch", type=int, default=128)
    parser.add_argument("--lm-steps", type=int, default=400)
    parser.add_argument("--lm-batch", type=int, default=64, help="sequences per batch")
    parser.add_argument("--lm-sequences", type=int, default=8192, help="training sequences")
    parser.add_argument("--lm-layers", type=int, default=2)
    parser.add_argument("--lm-width", type=int, default=64)
    parser.add_argument("--lm-heads", type=int, default=4)
    parser.add_argument("--lm-length", type=int, default=32)
    parser.add_argument("--lm-vocab", type=int, default=32)
    parser.add_argument("--eval-every", type=int, default=4, help="steps between evaluations")
    parser.add_argument(
        "--target-fraction",
        type=float,
        default=0.5,
        help="the target is the first block's best loss within this fraction of its steps",
    )
    parser.add_argument(
        "--timing-rounds", type=int, default=12, help="rounds of step timing (5 steps each)"
    )
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    if not 0 < args.target_fraction <= 1:
        parser.error("--target-fraction must be in (0, 1]")
    if args.lm_width % args.lm_heads or args.lm_width % 2:
        parser.error("--lm-width must be even and a multiple of --lm-heads")

    start = time.perf_counter()
    results: dict = dict(
        machine=dict(
            platform=platform.platform(),
            cpu_count=__import__("os").cpu_count(),
            jax=jax.__version__,
            devices=[str(d) for d in jax.devices()],
        ),
        args=vars(args),
        problems={},
    )
    for name in args.problems:
        results["problems"][name] = run_problem(PROBLEMS[name](args), args)
    results["total_s"] = time.perf_counter() - start
    print(f"\ntotal {results['total_s']:.0f} s")
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(results, indent=1))
        print(f"results written to {args.out}")
    return results


if __name__ == "__main__":
    main()
