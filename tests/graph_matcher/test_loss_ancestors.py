"""Detection looks for layers among the equations the registered losses depend on, and
says when a layer sits inside a custom-derivative function whose rule it bypasses."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kfacx.graph_matcher import auto_register_tags

from . import _models as M


def _detect(loss, args):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tagged, report = auto_register_tags(loss, args)
    return tagged, report, [str(w.message) for w in caught]


def test_a_use_outside_the_registered_losses_is_no_layer():
    """A weight also used in a term of the loss that no registered loss depends on (a
    penalty computed through the same product) is one layer, where it feeds the loss."""

    def loss(p, batch):
        x, t = batch
        h = jnp.tanh(M.dense(x, p["w1"], p["b1"]))
        penalty = 0.1 * jnp.sum(jnp.square(jnp.ones_like(x) @ p["w1"]))
        return M.squared_loss(M.dense(h, p["w2"], p["b2"]), t) + penalty

    args = (M.two_layer_params(), M.two_layer_batch())
    tagged, report, caught = _detect(loss, args)
    assert caught == [] and report.unmatched == ()
    assert {(e.path, e.tag, e.uses) for e in report.entries if e.path.startswith("w")} == {
        ("w1", "dense_tag", 1),
        ("w2", "dense_tag", 1),
    }
    got, want = (jax.jit(jax.value_and_grad(f))(*args) for f in (tagged, loss))
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def _rescaled(f):
    g = jax.custom_jvp(f)
    g.defjvp(lambda primals, tangents: (g(*primals), 2.0 * jax.jvp(f, primals, tangents)[1]))
    return g


def _exact(f):
    g = jax.custom_jvp(f)
    g.defjvp(lambda primals, tangents: jax.jvp(f, primals, tangents))
    return g


@pytest.mark.parametrize("wrap, warned", [(_rescaled, True), (_exact, False)])
def test_layers_inside_a_custom_rule_that_differs_are_reported(wrap, warned):
    first = wrap(M.dense)

    def loss(p, batch):
        x, t = batch
        return M.squared_loss(M.dense(jnp.tanh(first(x, p["w1"], p["b1"])), p["w2"], p["b2"]), t)

    args = (M.two_layer_params(), M.two_layer_batch())
    tagged, _, caught = _detect(loss, args)
    with warnings.catch_warnings(record=True) as caught_at_trace:
        warnings.simplefilter("always")
        jax.make_jaxpr(tagged)(*args)
    messages = caught + [str(w.message) for w in caught_at_trace]
    assert any("derivative rule differs" in m for m in messages) == warned
