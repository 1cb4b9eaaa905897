"""Extending kfacx: a custom layer tag, graph pattern and curvature block, end to end.

The layer is a dense layer divided by a learned temperature (as a softmax
temperature divides the logits), ``y = (x @ w) / exp(log_scale)``. The default
patterns find the ``x @ w`` but not ``log_scale`` (it divides the layer's output,
and no default pattern has a parameter there): it would get the diagonal fallback
block with a warning. This script

1. declares a `kfacx.tags.LayerTag` for the layer, with its compute function;
2. writes a `kfacx.GraphPattern` (the layer as a small JAX function, example
   arguments and a parameters extractor) so detection finds it;
3. writes a curvature block for it: a Kronecker-factored block for ``w`` and
   a scalar block for ``log_scale``, subclassing `kfacx.CurvatureBlock`;
4. checks on one example that the block equals the exact Gauss-Newton block;
5. trains a small model with `kfacx.Optimizer`, passing the pattern through
   ``auto_register_kwargs`` and the block through ``layer_tag_to_block_ctor``.

Run:  python examples/custom_layer.py [--steps 30]
"""

from __future__ import annotations

import argparse
import functools
import warnings

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

import kfacx

# [tag]
# Step 1: a layer tag. ``compute(inputs, params, **meta) -> outputs`` recomputes the
# layer; detection uses it to verify every match numerically.


def scaled_dense_compute(inputs, params):
    (x,) = inputs
    w, log_scale = params
    return ((x @ w) / jnp.exp(log_scale),)


scaled_dense_tag = kfacx.LayerTag(
    "scaled_dense_tag", num_inputs=1, num_outputs=1, compute=scaled_dense_compute
)


def register_scaled_dense(y, x, w, log_scale):
    """Marks ``y = (x @ w) / exp(log_scale)`` by hand; returns ``y`` unchanged."""
    return scaled_dense_tag.bind(y, x, w, log_scale)[0]


# [/tag]


# [pattern]
# Step 2: a graph pattern. ``compute_func(*inputs, params)`` is the layer as JAX
# code; it is traced with ``example_args`` (only the structure matters, not the
# shapes), and the extractor reads the tag's static metadata from the matched
# equations, or rejects the match by raising ValueError.


def scaled_dense_parameters(eqns):
    """Accepts only ``x @ w`` (last axis of x with the first axis of a 2-D w)."""
    (dot,) = [e for e in eqns if e.primitive.name == "dot_general"]
    x, w = (v.aval for v in dot.invars)
    if w.ndim != 2 or dot.params["dimension_numbers"] != (((x.ndim - 1,), (0,)), ((), ())):
        raise ValueError("not x @ w")
    return {}  # no static metadata: scaled_dense_compute takes none


scaled_dense_pattern = kfacx.GraphPattern(
    name="scaled_dense",
    tag_primitive=scaled_dense_tag,
    compute_func=lambda x, params: (x @ params[0]) / jnp.exp(params[1]),
    parameters_extractor_func=scaled_dense_parameters,
    example_args=[np.zeros((2, 3), np.float32), [np.zeros((3, 4), np.float32), np.float32(0)]],
    precedence=50,  # above the default "dense" pattern, which would claim w first
)
# [/pattern]


# [block]
# Step 3: a curvature block. The gradient of one example is ``x^T (dy / t)`` for w
# (t = exp(log_scale), dy the output cotangent) and ``-sum(y * dy)`` for log_scale.
# The block is block-diagonal over (w, log_scale): ``A (x) G`` with
# A = E[x x^T], G = E[(dy / t)(dy / t)^T] for w, and E[sum(y * dy)^2] for log_scale.


class ScaledDenseBlock(kfacx.CurvatureBlock):
    """K-FAC block of ``(x @ w) / exp(log_scale)``: Kronecker for w, scalar for log_scale.

    Powers are always exact (eigendecompositions of A and G, cached by
    `update_cache`), whatever ``exact_power`` says.
    """

    def factor_shapes(self):
        n, m = self.parameters_shapes[0]
        return ((n, n), (m, m), ())

    def compute_statistics(self, estimation_data, batch_size):
        (x,), (y,) = estimation_data["inputs"], estimation_data["outputs"]
        (dy,) = estimation_data["outputs_tangent"]  # [samples, *y.shape]
        _, log_scale = estimation_data["params"]
        n, m = self.parameters_shapes[0]
        rows = x.reshape(-1, n).astype(self.dtype)  # one row per example and position
        mask = estimation_data.get("mask")  # 0 for padding examples, if any
        weights = jnp.ones(rows.shape[:1], self.dtype)
        if mask is not None:
            weights = jnp.repeat(mask.astype(self.dtype), rows.shape[0] // mask.shape[0])
        a = (rows * weights[:, None]).T @ rows / jnp.maximum(jnp.sum(weights), 1.0)
        scaled_dy = (dy / jnp.exp(log_scale)).reshape(-1, m).astype(self.dtype)
        g = scaled_dy.T @ scaled_dy / batch_size
        per_example = jnp.sum((y[None] * dy).reshape(dy.shape[0], dy.shape[1], -1), axis=-1)
        s = jnp.sum(jnp.square(per_example.astype(self.dtype))) / batch_size
        return a, g, s

    def init_cache(self, exact_powers_to_cache, approx_powers_to_cache, cache_eigenvalues):
        del exact_powers_to_cache, approx_powers_to_cache, cache_eigenvalues  # always cached
        (n, m), dtype = self.parameters_shapes[0], self.dtype
        return kfacx.blocks.KroneckerEigen(
            jnp.zeros(n, dtype),
            jnp.zeros((n, n), dtype),
            jnp.zeros(m, dtype),
            jnp.zeros((m, m), dtype),
        )

    def update_cache(self, state, identity_weight):
        return state._replace(cache=self._eigen(state))

    def _eigen(self, state):
        a, g, _ = (f.value for f in state.factors)
        return kfacx.blocks.KroneckerEigen(*kfacx.linalg.safe_eigh(a), *kfacx.linalg.safe_eigh(g))

    def _multiply(self, state, vector, identity_weight):
        a, g, s = (f.value for f in state.factors)
        w, log_scale = (v.astype(self.dtype) for v in vector)
        damping = jnp.asarray(identity_weight, self.dtype)
        out = (a @ w @ g + damping * w, (s + damping) * log_scale)
        return tuple(o.astype(v.dtype) for o, v in zip(out, vector, strict=True))

    def _multiply_matpower(self, state, vector, identity_weight, power, exact_power, use_cached):
        eigen = state.cache if use_cached else self._eigen(state)
        u_a, u_g = eigen.inputs_eigenvectors, eigen.outputs_eigenvectors
        w, log_scale = (v.astype(self.dtype) for v in vector)
        damping = jnp.asarray(identity_weight, self.dtype)
        eigenvalues = eigen.inputs_eigenvalues[:, None] * eigen.outputs_eigenvalues[None, :]
        w_out = u_a @ ((u_a.T @ w @ u_g) * jnp.power(eigenvalues + damping, power)) @ u_g.T
        s_out = jnp.power(state.factors[2].value + damping, power) * log_scale
        return tuple(o.astype(v.dtype) for o, v in zip((w_out, s_out), vector, strict=True))

    def to_dense_matrix(self, state):
        a, g, s = (f.value for f in state.factors)
        return jax.scipy.linalg.block_diag(jnp.kron(a, g), s.reshape(1, 1))


# [/block]


# [model]
class ScaledDense(hk.Module):
    """``(x @ w) / exp(log_scale)``: a dense layer with a learned log-temperature."""

    def __init__(self, output_size: int, tag_by_hand: bool = False, name: str | None = None):
        super().__init__(name=name)
        self.output_size = output_size
        self.tag_by_hand = tag_by_hand

    def __call__(self, x):
        init = hk.initializers.VarianceScaling(1.0, "fan_avg", "uniform")
        w = hk.get_parameter("w", (x.shape[-1], self.output_size), x.dtype, init)
        log_scale = hk.get_parameter("log_scale", (), x.dtype, jnp.zeros)
        y = (x @ w) / jnp.exp(log_scale)
        return register_scaled_dense(y, x, w, log_scale) if self.tag_by_hand else y


def forward(x, tag_by_hand: bool = False):
    return hk.Linear(4)(jnp.tanh(ScaledDense(32, tag_by_hand)(x)))


def cross_entropy(logits, labels):
    logits = kfacx.register_softmax_cross_entropy_loss(logits, labels)
    log_probs = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(log_probs, labels[:, None], axis=1))


net = hk.without_apply_rng(hk.transform(forward))


def loss_fn(params, batch):
    x, labels = batch
    return cross_entropy(net.apply(params, x), labels)


# [/model]


def make_data(seed: int, n: int = 256, dim: int = 16, classes: int = 4):
    """Inputs and the labels a random teacher network gives them."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, dim)).astype(np.float32)
    teacher = rng.standard_normal((dim, classes)).astype(np.float32)
    labels = np.argmax(np.tanh(x @ teacher) + 0.1 * rng.standard_normal((n, classes)), axis=1)
    return x, labels.astype(np.int32)


def default_detection(params, batch) -> kfacx.RegistrationReport:
    """The registration without the custom pattern: log_scale is unmatched."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, report = kfacx.auto_register_tags(loss_fn, (params, batch))
    assert report.unmatched == ("scaled_dense/log_scale",), report
    assert any("log_scale" in str(w.message) for w in caught)
    return report


# [optimizer]
def make_optimizer() -> kfacx.Optimizer:
    return kfacx.Optimizer(
        jax.value_and_grad(loss_fn),
        l2_reg=1e-5,
        add_l2_reg=True,
        use_adaptive_learning_rate=True,
        use_adaptive_momentum=True,
        use_adaptive_damping=True,
        initial_damping=1.0,
        auto_register_kwargs=dict(
            graph_patterns=(scaled_dense_pattern, *kfacx.DEFAULT_GRAPH_PATTERNS),
            on_unmatched="error",
        ),
        layer_tag_to_block_ctor={"scaled_dense_tag": ScaledDenseBlock},
    )


# [/optimizer]


def check_hand_registration(params, batch) -> None:
    """A layer tagged by hand is kept (found by "manual"), without any custom pattern."""
    hand_net = hk.without_apply_rng(hk.transform(functools.partial(forward, tag_by_hand=True)))

    def hand_tagged_loss(params, batch):
        x, labels = batch
        return cross_entropy(hand_net.apply(params, x), labels)

    _, report = kfacx.auto_register_tags(hand_tagged_loss, (params, batch), on_unmatched="error")
    found = {e.path: (e.tag, e.source) for e in report.entries}
    assert found["scaled_dense/log_scale"] == ("scaled_dense_tag", "manual"), found


def check_detection(optimizer: kfacx.Optimizer) -> None:
    """The custom pattern found the layer and the custom block serves it."""
    found = {e.path: (e.tag, e.source, e.block) for e in optimizer.estimator.report.entries}
    for leaf in ("w", "log_scale"):
        assert found[f"scaled_dense/{leaf}"] == (
            "scaled_dense_tag",
            "scaled_dense",
            "ScaledDenseBlock",
        ), found
    served = [b for b in optimizer.estimator.blocks if isinstance(b, ScaledDenseBlock)]
    assert len(served) == 1 and served[0].parameters_shapes == ((16, 32), ()), served


def check_block_is_exact(params, batch) -> float:
    """On one example the block's (w, w) and (log_scale, log_scale) parts are exact.

    With ``estimation_mode="ggn_exact"`` and a batch of one example, K-FAC's
    ``A (x) G`` is the exact Gauss-Newton block of w; compare both parts with
    ``J^T H J`` computed densely. Returns the largest difference.
    """
    one = jax.tree.map(lambda a: a[:1], batch)
    estimator = kfacx.BlockDiagonalCurvature(
        loss_fn,
        auto_register_kwargs=dict(
            graph_patterns=(scaled_dense_pattern, *kfacx.DEFAULT_GRAPH_PATTERNS)
        ),
        layer_tag_to_block_ctor={"scaled_dense_tag": ScaledDenseBlock},
    )
    state = estimator.init(jax.random.key(0), (params, one))
    (index,) = [i for i, b in enumerate(estimator.blocks) if isinstance(b, ScaledDenseBlock)]

    @jax.jit
    def block_matrix(state):
        state = estimator.update_curvature_matrix_estimate(
            state, 0.0, 1.0, None, jax.random.key(1), (params, one), estimation_mode="ggn_exact"
        )
        return estimator.blocks[index].to_dense_matrix(state.blocks[index])

    block = block_matrix(state)

    layer = params["scaled_dense"]
    flat, unravel = ravel_pytree((layer["w"], layer["log_scale"]))

    def logits(flat):
        w, log_scale = unravel(flat)
        p = dict(params, scaled_dense=dict(w=w, log_scale=log_scale))
        return net.apply(p, one[0])[0]

    @jax.jit
    def exact_ggn(flat):
        jac, probs = jax.jacfwd(logits)(flat), jax.nn.softmax(logits(flat))
        return jac.T @ (jnp.diag(probs) - jnp.outer(probs, probs)) @ jac

    exact = exact_ggn(flat)
    n = layer["w"].size
    diffs = [
        jnp.max(jnp.abs(block[:n, :n] - exact[:n, :n])),
        jnp.abs(block[n, n] - exact[n, n]),
    ]
    error = float(max(diffs))
    assert error < 1e-4 * float(jnp.max(jnp.abs(exact))), error
    return error


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=30, help="training steps (default 30)")
    parser.add_argument("--seed", type=int, default=0, help="data and initialisation seed")
    args = parser.parse_args()

    batch = make_data(args.seed)
    rng = jax.random.key(args.seed)
    params = net.init(rng, batch[0][:1])

    print("Default patterns only:")
    print(default_detection(params, batch), end="\n\n")

    optimizer = make_optimizer()
    state = optimizer.init(params, rng, batch)
    print("With the scaled_dense pattern and ScaledDenseBlock:")
    print(optimizer.estimator.report, end="\n\n")
    check_detection(optimizer)
    check_hand_registration(params, batch)

    error = check_block_is_exact(params, batch)
    print(f"ScaledDenseBlock vs the exact Gauss-Newton block on one example: max diff {error:.1e}")

    losses = []
    for _ in range(args.steps):
        rng, key = jax.random.split(rng)
        params, state, stats = optimizer.step(params, state, key, batch)
        losses.append(float(stats["loss"]))
    log_scale = float(params["scaled_dense"]["log_scale"])
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} in {args.steps} steps")
    print(f"learned log_scale {log_scale:.3f}")
    assert np.isfinite(losses).all() and losses[-1] < 0.5 * losses[0], losses
    print("OK: detection found the custom layer, ScaledDenseBlock served it, training converged")


if __name__ == "__main__":
    main()
