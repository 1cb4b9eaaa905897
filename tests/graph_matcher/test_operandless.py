"""Detection next to equations without operands (``iota``, ``full``, random bits).

Regression: the JAX Conformer of the training-algorithms benchmark adds a position
ramp to a layer's output; resolving that sum as a possible parameter view read the
first operand of an ``iota`` and raised an internal ``IndexError``.
"""

from __future__ import annotations

import warnings

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfacx

B, D, H, C = 4, 3, 6, 5


def _haiku_loss(head):
    net = hk.without_apply_rng(
        hk.transform(lambda x: head(hk.Linear(C)(jax.nn.relu(hk.Linear(H)(x)))))
    )

    def loss(params, batch):
        x, y = batch
        logits = kfacx.register_softmax_cross_entropy_loss(net.apply(params, x), y)
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y))

    return net, loss


def _batch():
    rng = np.random.default_rng(0)
    return jnp.asarray(rng.standard_normal((B, D)), jnp.float32), jnp.arange(B) % C


def test_output_plus_arange_trains():
    # The smallest case: ``hk.Linear(C)(x) + jnp.arange(C)``.
    net, loss = _haiku_loss(lambda logits: logits + jnp.arange(C)[None])
    batch = _batch()
    params = net.init(jax.random.PRNGKey(0), batch[0])
    opt = kfacx.Optimizer(
        jax.value_and_grad(loss),
        l2_reg=0.0,
        use_adaptive_learning_rate=True,
        use_adaptive_momentum=True,
        use_adaptive_damping=True,
        initial_damping=1.0,
    )
    state = opt.init(params, jax.random.PRNGKey(1), batch)
    report = opt.estimator.report
    assert report.unmatched == ()
    assert sorted(e.tag for e in report.entries) == ["dense_tag"] * 4
    new_params, _, stats = opt.step(params, state, jax.random.PRNGKey(2), batch)
    assert all(bool(jnp.all(jnp.isfinite(v))) for v in jax.tree.leaves(new_params))
    assert bool(jnp.isfinite(stats["loss"]))


def _detect(logits_fn, params):
    def loss(p, data):
        x, t = data
        out = kfacx.register_squared_error_loss(logits_fn(p, x), t)
        return 0.5 * jnp.sum((out - t) ** 2)

    data = (jnp.ones((B, D)), jnp.zeros((B, H)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, report = kfacx.auto_register_tags(loss, (params, data))
    return report, [str(w.message) for w in caught]


_W = {"w": jnp.ones((D, H)), "b": jnp.ones((H,))}


@pytest.mark.parametrize(
    "logits",
    [
        # a ramp added after the layer, through a broadcast
        lambda p, x: x @ p["w"] + p["b"][None] + jnp.arange(H, dtype=jnp.float32)[None],
        # a weight scaled by a ramp (an elementwise map with a non-constant operand)
        lambda p, x: x @ (p["w"] * jnp.arange(H, dtype=jnp.float32)[None]) + p["b"][None],
        # a weight concatenated with a constant block made by ``full``
        lambda p, x: (
            jnp.concatenate([x, jnp.ones((B, 1))], 1)
            @ jnp.concatenate([p["w"], jnp.full((1, H), 2.0)], 0)
            + p["b"][None]
        ),
        # a weight masked by random bits
        lambda p, x: (
            x @ (p["w"] * jax.random.bernoulli(jax.random.key(0), 0.5, (D, H))) + p["b"][None]
        ),
        # a bias built next to a ramp: slice of a concatenation with an iota
        lambda p, x: x @ p["w"] + jnp.concatenate([p["b"], jnp.arange(2.0)])[None, :H],
    ],
    ids=["ramp_after", "ramp_scaled_weight", "full_concat", "random_mask", "iota_concat_bias"],
)
def test_operandless_equations_next_to_parameters(logits):
    report, caught = _detect(logits, _W)
    # every parameter reported exactly once, on a layer or on the fallback block
    assert sorted(e.path for e in report.entries) == ["b", "w"], (report, caught)
