"""Stacked dense layers: one weight per slice, used through `jax.vmap` or a batched einsum.

An ensemble whose parameters carry a leading member axis, the model `jax.vmap`-ed
over it, and expert weights in ``einsum('ebd,edf->ebf')`` are ``M`` dense
layers: detection tags them as stacked dense layers (a batch dimension over the
weight's leading axis) and the estimator serves them with one Kronecker block
per slice (`kfacx.blocks.StackedBlock`), exactly as the same members written as
a `lax.scan` over their parameters.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _models import fixed_rate_run

import kfacx

M, B, I, H, O = 3, 4, 5, 6, 2
STACKED = (((2,), (1,)), ((0,), (0,)))


@pytest.fixture
def x64():
    with jax.enable_x64(True):
        yield


def _params(seed=0):
    rng = np.random.default_rng(seed)
    return dict(
        w1=rng.normal(size=(M, I, H)),
        b1=rng.normal(size=(M, H)),
        w2=rng.normal(size=(M, H, O)),
        b2=rng.normal(size=(M, O)),
    )


def _member(q, x):
    h = jnp.tanh(x @ q["w1"] + q["b1"][None, :])
    return h @ q["w2"] + q["b2"][None, :]


def _xent(logits, targets):
    logits = kfacx.register_softmax_cross_entropy_loss(logits, targets)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), targets[:, None], 1))


def _vmapped_loss(shared_input):
    def loss(p, batch):
        x, t = batch
        logits = jax.vmap(_member, in_axes=(0, None if shared_input else 0))(p, x)
        return _xent(logits.mean(0), t)

    return loss


def _scan_loss(shared_input):
    """The same members as a `lax.scan` over their parameters (a `StackedBlock` per layer)."""

    def loss(p, batch):
        x, t = batch
        xs = x if not shared_input else jnp.broadcast_to(x, (M, *x.shape))
        _, logits = jax.lax.scan(lambda c, qx: (c, _member(*qx)), 0.0, (p, xs))
        return _xent(logits.mean(0), t)

    return loss


def _manual_loss(shared_input):
    """Hand-tagged with register_dense and a batch dimension over the weights' leading axis."""

    def loss(p, batch):
        x, t = batch
        xs = x if not shared_input else jnp.broadcast_to(x, (M, *x.shape))
        pre = jax.lax.dot_general(xs, p["w1"], STACKED) + p["b1"][:, None, :]
        pre = kfacx.register_dense(pre, xs, p["w1"], p["b1"], dimension_numbers=STACKED)
        h = jnp.tanh(pre)
        out = jax.lax.dot_general(h, p["w2"], STACKED) + p["b2"][:, None, :]
        out = kfacx.register_dense(out, h, p["w2"], p["b2"], dimension_numbers=STACKED)
        return _xent(out.mean(0), t)

    return loss


def _batch(shared_input, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(B, I) if shared_input else (M, B, I))
    return jnp.asarray(x), jnp.asarray(rng.integers(0, O, (B,)))


def _curvature(loss, args, **kwargs):
    est = kfacx.BlockDiagonalCurvature(loss, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state = est.init(jax.random.PRNGKey(0), args)

    @jax.jit  # one compilation instead of one per operation run eagerly
    def dense_curvature(state, args):
        state = est.update_curvature_matrix_estimate(
            state, 0.0, 1.0, None, jax.random.PRNGKey(1), args, estimation_mode="ggn_exact"
        )
        return est.to_dense_matrix(state)

    return est, np.asarray(dense_curvature(state, args))


@pytest.mark.parametrize("shared_input", [False, True], ids=["own_inputs", "shared_input"])
def test_vmapped_ensemble_is_stacked_and_equals_the_scan_and_hand_tagging(x64, shared_input):
    args = (_params(), _batch(shared_input))
    est, auto = _curvature(_vmapped_loss(shared_input), args)
    report = est.report
    assert report.notes == () and report.unmatched == ()
    assert {(e.path, e.layer, e.stack_size, e.block) for e in report.entries} == {
        (p, int(p[1]) - 1, M, "StackedBlock(DenseTwoKroneckerFactored)")
        for p in ("b1", "b2", "w1", "w2")
    }
    _, scan = _curvature(_scan_loss(shared_input), args)
    _, manual = _curvature(_manual_loss(shared_input), args, auto_register_tags=False)
    np.testing.assert_allclose(auto, scan, rtol=1e-10, atol=1e-14)
    np.testing.assert_allclose(auto, manual, rtol=1e-10, atol=1e-14)
    assert np.abs(auto).max() > 1e-3


@pytest.mark.parametrize("spec", ["ebd,edf->ebf", "bed,edf->ebf"])
def test_expert_weights_in_a_batched_einsum_are_one_block_per_expert(x64, spec):
    rng = np.random.default_rng(2)
    params = dict(w=rng.normal(size=(M, I, O)))
    x = jnp.asarray(rng.normal(size=(M, B, I)))
    t = jnp.asarray(rng.integers(0, O, (B,)))

    def loss(p, batch):
        x, t = batch
        x_in = x if spec.startswith("e") else jnp.swapaxes(x, 0, 1)  # experts on axis 1
        return _xent(jnp.einsum(spec, x_in, p["w"]).sum(0), t)

    def manual(p, batch):
        x, t = batch
        y = jax.lax.dot_general(x, p["w"], STACKED)
        return _xent(kfacx.register_dense(y, x, p["w"], dimension_numbers=STACKED).sum(0), t)

    est, auto = _curvature(loss, (params, (x, t)))
    ((entry),) = est.report.entries
    assert (entry.stack_size, entry.block) == (M, "StackedBlock(DenseTwoKroneckerFactored)")
    _, hand = _curvature(manual, (params, (x, t)), auto_register_tags=False)
    np.testing.assert_allclose(auto, hand, rtol=1e-10, atol=1e-14)
    # One Kronecker block per expert: no curvature between experts.
    n = I * O
    assert not auto[:n, n:].any()


PER_HEAD = (((3,), (1,)), ((2,), (0,)))  # x [b, t, h, d] . w [h, d, e] over the heads


def _per_head_loss(tag):
    """A per-head projection ``einsum('bthd,hde->bthe') + b[h, e]`` (the head axis sits
    between the positions and the features), then a readout."""

    def loss(p, batch):
        x, t = batch
        if tag:
            y = jax.lax.dot_general(x, p["w"], PER_HEAD) + p["b"][:, None, None, :]
            y = kfacx.register_dense(y, x, p["w"], p["b"], dimension_numbers=PER_HEAD)
            y = jnp.transpose(y, (1, 2, 0, 3))  # [h, b, t, e] -> [b, t, h, e]
        else:
            y = jnp.einsum("bthd,hde->bthe", x, p["w"]) + p["b"][None, None]
        h = jnp.tanh(y).reshape(x.shape[0], -1)
        out = h @ p["out"]
        return _xent(kfacx.register_dense(out, h, p["out"]) if tag else out, t)

    return loss


def _per_head_problem(seed=5, dtype=None):
    rng = np.random.default_rng(seed)
    T, D, E = 2, 3, 4
    params = dict(
        w=rng.normal(size=(M, D, E)) / np.sqrt(D),
        b=0.3 * rng.normal(size=(M, E)),
        out=rng.normal(size=(T * M * E, O)) / np.sqrt(T * M * E),
    )
    batch = (jnp.asarray(rng.normal(size=(B, T, M, D)), dtype), jnp.asarray(np.arange(B) % O))
    return jax.tree.map(lambda a: jnp.asarray(a, dtype), params), batch


def test_per_head_weights_in_an_einsum_are_one_block_per_head(x64):
    args = _per_head_problem()
    est, auto = _curvature(_per_head_loss(False), args)
    report = est.report
    assert report.notes == () and report.unmatched == ()
    assert {e.path: (e.source, e.stack_size) for e in report.entries} == {
        "w": ("weight_first_dense_with_bias", M),
        "b": ("weight_first_dense_with_bias", M),
        "out": ("dense", None),
    }
    _, manual = _curvature(_per_head_loss(True), args, auto_register_tags=False)
    np.testing.assert_allclose(auto, manual, rtol=1e-10, atol=1e-14)
    assert np.abs(auto).max() > 1e-3


def test_per_head_weights_train():
    _, losses = fixed_rate_run(_per_head_loss(False), *_per_head_problem(dtype=jnp.float32), 5)
    assert np.all(np.isfinite(losses)) and losses[-1] < 0.7 * losses[0], losses


def test_register_dense_with_a_batch_dimension_computes_the_stacked_layer():
    rng = np.random.default_rng(5)
    x, w, b = rng.normal(size=(M, B, I)), rng.normal(size=(M, I, O)), rng.normal(size=(M, O))
    y = jnp.einsum("mbi,mio->mbo", x, w) + b[:, None, :]
    (got,) = kfacx.tags.dense.compute((x,), (w, b), dimension_numbers=STACKED)
    np.testing.assert_allclose(got, y, rtol=1e-5)
    np.testing.assert_allclose(
        kfacx.register_dense(y, x, w, b, dimension_numbers=STACKED), y, rtol=1e-6
    )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(dimension_numbers=(((2,), (2,)), ((0,), (1,)))), "weight's leading axis"),
        (dict(dimension_numbers=(((2,), (1,)), ((0,), (0,))), bias=(O,)), "stack axis"),
    ],
    ids=["batch_not_leading", "unstacked_bias"],
)
def test_register_dense_rejects_bad_stacking(kwargs, match):
    rng = np.random.default_rng(6)
    x, w = rng.normal(size=(M, B, I)), rng.normal(size=(M, I, O))
    if kwargs["dimension_numbers"][1][1] == (1,):
        w = rng.normal(size=(I, M, O))
    b = rng.normal(size=kwargs["bias"]) if "bias" in kwargs else None
    y = np.zeros((M, B, O))
    with pytest.raises(ValueError, match=match):
        kfacx.register_dense(y, x, w, b, dimension_numbers=kwargs["dimension_numbers"])


def test_hand_tagged_stacked_dense_layer_inside_a_scan_raises(x64):
    params = _params()

    def loss(p, batch):
        x, t = batch

        def body(c, _):
            y = jax.lax.dot_general(x, p["w1"], STACKED)
            return c, kfacx.register_dense(y, x, p["w1"], dimension_numbers=STACKED)

        _, ys = jax.lax.scan(body, 0.0, None, length=2)
        return _xent(ys.sum((0, 1, 3))[:, None] * jnp.ones((1, O)), t)

    est = kfacx.BlockDiagonalCurvature(loss, auto_register_tags=False)
    with pytest.raises(ValueError, match="stacked dense layer .* inside a `scan`"):
        est.init(jax.random.PRNGKey(0), (params, _batch(False)))


def _flax_ensemble():
    nn = pytest.importorskip("flax.linen")

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(O, name="out")(jnp.tanh(nn.Dense(H, name="hidden")(x)))

    ensemble = nn.vmap(
        MLP,
        variable_axes={"params": 0},
        split_rngs={"params": True},
        in_axes=None,
        out_axes=0,
        axis_size=M,
    )()
    x, t = _batch(True)
    x = x.astype(jnp.float32)
    params = ensemble.init(jax.random.PRNGKey(0), x)

    def loss(p, batch):
        return _xent(ensemble.apply(p, batch[0]).mean(0), batch[1])

    return loss, params, (x, t)


def _equinox_ensemble():
    eqx = pytest.importorskip("equinox")
    keys = jax.random.split(jax.random.PRNGKey(0), M)
    models = eqx.filter_vmap(lambda k: eqx.nn.MLP(I, O, H, 1, activation=jnp.tanh, key=k))(keys)
    params, static = eqx.partition(models, eqx.is_array)
    x, t = _batch(True)
    x = x.astype(jnp.float32)

    def loss(p, batch):
        members = eqx.combine(p, static)
        logits = eqx.filter_vmap(lambda m: jax.vmap(m)(batch[0]))(members)
        return _xent(logits.mean(0), batch[1])

    return loss, params, (x, t)


def _nnx_ensemble():
    nnx = pytest.importorskip("flax.nnx")

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.hidden = nnx.Linear(I, H, rngs=rngs)
            self.out = nnx.Linear(H, O, rngs=rngs)

        def __call__(self, x):
            return self.out(jnp.tanh(self.hidden(x)))

    members = nnx.vmap(lambda key: MLP(nnx.Rngs(key)))(jax.random.split(jax.random.PRNGKey(0), M))
    graphdef, params = nnx.split(members)
    x, t = _batch(True)
    x = x.astype(jnp.float32)

    def loss(p, batch):
        ensemble = nnx.merge(graphdef, p)
        logits = nnx.vmap(lambda m, x: m(x), in_axes=(0, None))(ensemble, batch[0])
        return _xent(logits.mean(0), batch[1])

    return loss, params, (x, t)


@pytest.mark.parametrize(
    "make",
    [_flax_ensemble, _nnx_ensemble, _equinox_ensemble],
    ids=["flax_linen", "flax_nnx", "equinox"],
)
def test_framework_ensembles_are_stacked_layers_and_train(make):
    """Ensembles vmapped over their members with a shared input by Flax linen, Flax NNX and
    Equinox (each a `jax.vmap`, as ``_vmapped_loss(True)``): stacked layers, and a few
    optimizer steps lower the loss by 30 % or more (the training of the plain `jax.vmap`
    ensemble is theirs)."""
    loss, params, batch = make()
    opt, losses = fixed_rate_run(loss, params, batch, 4)
    report = opt.estimator.report
    assert report.notes == () and report.unmatched == ()
    assert {e.stack_size for e in report.entries} == {M}
    assert {e.block for e in report.entries} == {"StackedBlock(DenseTwoKroneckerFactored)"}
    assert np.all(np.isfinite(losses)) and losses[-1] < 0.7 * losses[0], losses


def test_detected_stacked_dense_inside_a_scan_falls_back_with_a_note(x64):
    """Experts inside a layer stack are two levels of stacking: detection leaves them to
    the fallback block and says so, instead of failing at init."""
    rng = np.random.default_rng(7)
    params = dict(w=rng.normal(size=(2, M, I, I)))
    x = jnp.asarray(rng.normal(size=(M, B, I)))
    t = jnp.asarray(rng.integers(0, O, (B,)))

    def loss(p, batch):
        x, t = batch
        h, _ = jax.lax.scan(
            lambda h, w: (jnp.tanh(jnp.einsum("ebd,edf->ebf", h, w)), None), x, p["w"]
        )
        return _xent(h.sum((0, 2))[:, None] * jnp.ones((1, O)), t)

    est = kfacx.BlockDiagonalCurvature(loss)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        est.init(jax.random.PRNGKey(0), (params, (x, t)))
    messages = [str(w.message) for w in caught]
    assert any("stacked dense layer" in m and "inside a `scan`" in m for m in messages), messages
    assert any("no layer pattern matched parameters ['w']" in m for m in messages), messages
    assert est.report.unmatched == ("w",)
