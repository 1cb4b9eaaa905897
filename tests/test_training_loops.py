"""K-FAC in each framework's own training loop: Flax linen's ``TrainState``, Flax NNX's
``nnx.Optimizer`` and Equinox's filtered loop. Each trains a tiny model a few steps and
takes the same steps as `kfacx.Optimizer` with a fixed learning rate and momentum (the
equivalent path); plus the errors on bad input, and the example script."""

from __future__ import annotations

import importlib.util
import inspect
import pathlib
import subprocess
import sys
from typing import Any

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state

import kfacx
import kfacx.flax

ROOT = pathlib.Path(__file__).resolve().parents[1]
KEY = jax.random.PRNGKey(0)
STEPS = 4
#: Fixed learning rate, momentum, damping and weight decay of both paths of each test.
LR, MOMENTUM, DAMPING, L2 = 0.25, 0.5, 1e-2, 2.0**-6
KFAC_KWARGS = dict(curvature_ema=0.75, inverse_update_period=2)


def _batch(n: int = 16, dim: int = 4):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, dim)).astype(np.float32)
    labels = ((x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 0)).astype(np.int32)
    return jnp.asarray(x), jnp.asarray(labels)


BATCH = _batch()


def _xent(logits, labels):
    logits = kfacx.register_softmax_cross_entropy_loss(logits, labels)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))


def _estimator(loss_fn):
    return kfacx.BlockDiagonalCurvature(loss_fn, default_estimation_mode="ggn_exact")


def _kfac_chain(estimator, func_args):
    """The optax chain that `kfacx.Optimizer` with `LR`, `MOMENTUM`, `DAMPING`, `L2` equals."""
    return optax.chain(
        optax.add_decayed_weights(L2),
        kfacx.scale_by_kfac(estimator, func_args, damping=DAMPING + L2, **KFAC_KWARGS),
        optax.scale(-LR),
        optax.trace(decay=MOMENTUM),
    )


def _reference_run(loss_fn, params, func_state=None, has_aux=False):
    """`kfacx.Optimizer` with a fixed learning rate and momentum: ``[(params, func_state,
    loss)]`` after each of `STEPS` steps."""
    opt = kfacx.Optimizer(
        jax.value_and_grad(loss_fn, has_aux=has_aux or func_state is not None),
        value_func_has_state=func_state is not None,
        l2_reg=L2,
        add_l2_reg=True,
        num_burnin_steps=0,
        estimation_mode="ggn_exact",
        learning_rate_schedule=LR,
        momentum_schedule=MOMENTUM,
        initial_damping=DAMPING,
        **KFAC_KWARGS,
    )
    state, out = opt.init(params, KEY, BATCH, func_state=func_state), []
    for i in range(STEPS):
        rng = jax.random.fold_in(KEY, i)
        if func_state is None:
            params, state, stats = opt.step(params, state, rng, BATCH)
        else:
            params, state, func_state, stats = opt.step(
                params, state, rng, BATCH, func_state=func_state
            )
        out.append((params, func_state, float(stats["loss"])))
    return out


def _assert_trees_close(got, want, rtol=1e-5, atol=1e-6):
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        if jnp.issubdtype(g.dtype, jax.dtypes.prng_key):  # an NNX RNG stream's key
            g, w = jax.random.key_data(g), jax.random.key_data(w)
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=rtol, atol=atol)


def _assert_falls(losses):
    assert np.all(np.isfinite(losses)) and losses[-1] < 0.8 * losses[0], losses


# ----------------------------------------------------------------------------- linen


class _BNMLP(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.BatchNorm(use_running_average=not train)(nn.Dense(6)(x))
        return nn.Dense(3)(jnp.tanh(x))


_LINEN_MODEL = _BNMLP()


def _linen_loss(params, batch_stats, batch):
    logits, updates = _LINEN_MODEL.apply(
        {"params": params, "batch_stats": batch_stats},
        batch[0],
        train=True,
        mutable=["batch_stats"],
    )
    return _xent(logits, batch[1]), updates["batch_stats"]


class _LinenState(kfacx.flax.TrainState):
    batch_stats: Any


@pytest.fixture(scope="module")
def linen_state():
    """A `kfacx.flax.TrainState` with ``batch_stats`` and K-FAC in ``tx``, and its estimator."""
    variables = _LINEN_MODEL.init(KEY, BATCH[0][:1], train=False)
    params, batch_stats = variables["params"], variables["batch_stats"]
    estimator = _estimator(_linen_loss)
    state = _LinenState.create(
        apply_fn=_LINEN_MODEL.apply,
        params=params,
        tx=_kfac_chain(estimator, (params, batch_stats, BATCH)),
        batch_stats=batch_stats,
    )
    return state, estimator


def test_linen_trainstate_with_batch_stats_equals_optimizer(linen_state):
    """``state.apply_gradients(grads=..., curvature_stats=..., batch_stats=...)`` in a jitted
    step takes the same steps as `kfacx.Optimizer` with ``value_func_has_state``: the
    same parameters and batch statistics after every step."""
    state, estimator = linen_state

    @jax.jit
    def train_step(state, rng):
        (loss, batch_stats), grads, stats = estimator.value_grads_and_curvature_stats(
            rng, (state.params, state.batch_stats, BATCH), has_aux=True
        )
        state = state.apply_gradients(grads=grads, curvature_stats=stats, batch_stats=batch_stats)
        return state, loss

    want = _reference_run(_linen_loss, state.params, func_state=state.batch_stats)
    losses = []
    for i, (params, batch_stats, loss) in enumerate(want):
        state, got_loss = train_step(state, jax.random.fold_in(KEY, i))
        np.testing.assert_allclose(float(got_loss), loss, rtol=1e-5)
        _assert_trees_close((state.params, state.batch_stats), (params, batch_stats))
        losses.append(loss)
    assert int(state.step) == STEPS and isinstance(state, _LinenState)
    assert int(state.opt_state[1].count) == STEPS
    _assert_falls(losses)


def test_trainstate_without_kfac_is_flax_trainstate():
    """With a ``tx`` without K-FAC and no statistics: Flax's own update, bit for bit."""
    params, grads, tx = {"w": jnp.ones(2)}, {"w": jnp.asarray([1.0, -2.0])}, optax.sgd(0.1, 0.5)
    ours = kfacx.flax.TrainState.create(apply_fn=None, params=params, tx=tx)
    flax_state = train_state.TrainState.create(apply_fn=None, params=params, tx=tx)
    ours, flax_state = ours.apply_gradients(grads=grads), flax_state.apply_gradients(grads=grads)
    _assert_trees_close((ours.params, ours.opt_state), (flax_state.params, flax_state.opt_state), 0)
    assert int(ours.step) == 1 and type(ours) is kfacx.flax.TrainState


def test_trainstate_passes_extra_args_to_tx_update():
    def update(updates, state, params=None, *, scale, **extra):
        return jax.tree_util.tree_map(lambda g: -scale * g, updates), state

    tx = optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update)
    state = kfacx.flax.TrainState.create(apply_fn=None, params={"w": jnp.ones(2)}, tx=tx)
    state = state.apply_gradients(grads={"w": jnp.ones(2)}, extra_args={"scale": 0.25})
    np.testing.assert_array_equal(state.params["w"], [0.75, 0.75])
    assert state.tx is tx


def test_trainstate_errors(linen_state):
    state, estimator = linen_state
    grads, batch_stats, stats = state.params, state.batch_stats, estimator.zero_curvature_stats()
    with pytest.raises(TypeError, match=r"tx contains kfacx.scale_by_kfac.*curvature_stats=stats"):
        state.apply_gradients(grads=grads, batch_stats=batch_stats)
    with pytest.raises(TypeError, match="must be the kfacx.CurvatureStats.*got tuple"):
        state.apply_gradients(grads=grads, curvature_stats=tuple(stats))
    with pytest.raises(TypeError, match="pass curvature_stats=stats directly"):
        state.apply_gradients(grads=grads, extra_args={"curvature_stats": stats})
    with pytest.raises(TypeError, match="extra_args must be a mapping"):
        state.apply_gradients(grads=grads, curvature_stats=stats, extra_args=[1])
    adam = kfacx.flax.TrainState.create(apply_fn=None, params=state.params, tx=optax.adam(0.1))
    with pytest.raises(TypeError, match="tx contains no kfacx.scale_by_kfac"):
        adam.apply_gradients(grads=grads, curvature_stats=stats)
    flax_state = train_state.TrainState.create(apply_fn=None, params=state.params, tx=state.tx)
    with pytest.raises(TypeError, match="needs the keyword argument curvature_stats"):
        flax_state.apply_gradients(grads=grads)  # why kfacx.flax.TrainState exists
    with pytest.raises(TypeError, match="batch_stat"):  # a misspelt field, as in Flax
        jax.jit(
            lambda s: s.apply_gradients(grads=grads, curvature_stats=stats, batch_stat=batch_stats)
        ).trace(state)


# ----------------------------------------------------------------------------- NNX


class _NNXMLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, dropout: float = 0.0):
        self.hidden = nnx.Linear(4, 6, rngs=rngs)
        self.norm = nnx.BatchNorm(6, rngs=rngs)
        self.drop = nnx.Dropout(dropout, rngs=rngs)
        self.out = nnx.Linear(6, 3, rngs=rngs)

    def __call__(self, x):
        return self.out(self.drop(jnp.tanh(self.norm(self.hidden(x)))))


def _nnx_loss(model, batch):
    return _xent(model(batch[0]), batch[1])


def _nnx_loss_with_aux(model, batch):
    logits = model(batch[0])
    return _xent(logits, batch[1]), jnp.argmax(logits, -1)


def test_nnx_value_grads_and_curvature_stats_equals_nnx_value_and_grad():
    """The loss and aux, the gradient (an `nnx.State` of `nnx.Param`) and the model's updated
    batch statistics and dropout RNG count are those of ``nnx.value_and_grad``; the
    `NNXLoss` itself returns ``(loss, (new_rest, aux))``."""
    model = _NNXMLP(nnx.Rngs(0, dropout=1), dropout=0.25)
    twin = nnx.clone(model)
    loss = kfacx.flax.NNXLoss(_nnx_loss_with_aux, model, has_aux=True)
    estimator = _estimator(loss)

    @nnx.jit
    def ours(model):
        func_out = loss(*loss.func_args(model, BATCH))
        return func_out, kfacx.flax.nnx_value_grads_and_curvature_stats(
            estimator, KEY, model, BATCH
        )

    (value, (rest, aux)), ((got_loss, got_aux), grads, stats) = ours(model)
    (want_loss, want_aux), want_grads = nnx.jit(
        nnx.value_and_grad(_nnx_loss_with_aux, has_aux=True)
    )(twin, BATCH)
    np.testing.assert_allclose([value, got_loss], [want_loss, want_loss], rtol=1e-6)
    np.testing.assert_array_equal(aux, want_aux)
    np.testing.assert_array_equal(got_aux, want_aux)
    assert jax.tree_util.tree_structure(grads) == jax.tree_util.tree_structure(want_grads)
    assert isinstance(grads["out"]["kernel"], nnx.Param)
    _assert_trees_close(grads, want_grads)
    _assert_trees_close(nnx.state(model), nnx.state(twin))  # batch stats, RNG count
    _assert_trees_close(loss.split(model)[1], rest)
    assert int(model.drop.rngs.count[...]) == 1
    assert isinstance(stats, kfacx.CurvatureStats)


def test_nnx_optimizer_equals_kfacx_optimizer():
    """``nnx.Optimizer(model, chain(scale_by_kfac...))`` with
    ``optimizer.update(model, grads, curvature_stats=stats)`` takes the steps of
    `kfacx.Optimizer` on the same `NNXLoss` with its state (the batch statistics)."""
    model = _NNXMLP(nnx.Rngs(0))
    loss = kfacx.flax.NNXLoss(_nnx_loss, model)
    params, rest = loss.split(model)
    want = _reference_run(loss, params, func_state=rest)

    estimator = _estimator(loss)
    optimizer = nnx.Optimizer(
        model, _kfac_chain(estimator, loss.func_args(model, BATCH)), wrt=nnx.Param
    )

    @nnx.jit
    def train_step(model, optimizer, rng):
        value, grads, stats = kfacx.flax.nnx_value_grads_and_curvature_stats(
            estimator, rng, model, BATCH
        )
        optimizer.update(model, grads, curvature_stats=stats)
        return value

    losses = []
    for i, (want_params, want_rest, want_loss) in enumerate(want):
        got_loss = train_step(model, optimizer, jax.random.fold_in(KEY, i))
        np.testing.assert_allclose(float(got_loss), want_loss, rtol=1e-5)
        _assert_trees_close(loss.split(model), (want_params, want_rest))
        losses.append(want_loss)
    assert int(optimizer.step[...]) == STEPS
    _assert_falls(losses)
    with pytest.raises(TypeError, match="needs the keyword argument curvature_stats"):
        optimizer.update(model, nnx.state(model, nnx.Param))


def test_nnx_errors():
    model = _NNXMLP(nnx.Rngs(0))
    with pytest.raises(TypeError, match="loss_fn must be callable"):
        kfacx.flax.NNXLoss(None, model)
    with pytest.raises(TypeError, match="model must be an nnx.Module, got dict"):
        kfacx.flax.NNXLoss(_nnx_loss, {"w": 1})
    loss = kfacx.flax.NNXLoss(_nnx_loss, model, has_aux=True)
    with pytest.raises(TypeError, match=r"has_aux=True: return the loss alone, or \(loss, aux\)"):
        loss(*loss.func_args(model, BATCH))
    with pytest.raises(ValueError, match="structure differs .* make a new NNXLoss"):
        loss.split(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
    plain = kfacx.BlockDiagonalCurvature(lambda params, batch: _nnx_loss(params, batch))
    with pytest.raises(TypeError, match="BlockDiagonalCurvature of a kfacx.flax.NNXLoss"):
        kfacx.flax.nnx_value_grads_and_curvature_stats(plain, KEY, model, BATCH)


# ----------------------------------------------------------------------------- Equinox


def test_equinox_filtered_loop_equals_kfacx_optimizer():
    """The Equinox recipe: ``eqx.partition`` the model, a loss of the parameters that
    ``eqx.combine``-s them back. Its gradient is ``eqx.filter_value_and_grad``'s; an
    ``eqx.filter_jit`` loop with ``scale_by_kfac`` in optax and `kfacx.Optimizer` on the
    parameters take the same steps."""
    model = eqx.nn.MLP(4, 3, width_size=6, depth=1, activation=jnp.tanh, key=KEY)

    def loss_fn(model, batch):
        return _xent(jax.vmap(model)(batch[0]), batch[1])

    params, static = eqx.partition(model, eqx.is_inexact_array)

    def params_loss(params, batch):
        return loss_fn(eqx.combine(params, static), batch)

    want = _reference_run(params_loss, params)
    estimator = _estimator(params_loss)
    tx = _kfac_chain(estimator, (params, BATCH))
    opt_state = tx.init(params)

    @eqx.filter_jit
    def train_step(model, opt_state, rng):
        params = eqx.filter(model, eqx.is_inexact_array)
        loss, grads, stats = estimator.value_grads_and_curvature_stats(rng, (params, BATCH))
        updates, opt_state = tx.update(grads, opt_state, params, curvature_stats=stats)
        return eqx.apply_updates(model, updates), opt_state, loss, grads

    losses = []
    for i, (want_params, _, want_loss) in enumerate(want):
        if i == 0:
            eqx_loss, eqx_grads = eqx.filter_jit(eqx.filter_value_and_grad(loss_fn))(model, BATCH)
        model, opt_state, loss, grads = train_step(model, opt_state, jax.random.fold_in(KEY, i))
        if i == 0:
            np.testing.assert_allclose(float(loss), float(eqx_loss), rtol=1e-6)
            _assert_trees_close(grads, eqx_grads)
        np.testing.assert_allclose(float(loss), want_loss, rtol=1e-5)
        _assert_trees_close(eqx.filter(model, eqx.is_inexact_array), want_params)
        losses.append(want_loss)
    _assert_falls(losses)


# ----------------------------------------------------------------------------- glue


def test_flax_module_documents_its_public_names():
    documented = [getattr(kfacx.flax, name) for name in kfacx.flax.__all__]
    documented += [kfacx.flax.TrainState.apply_gradients, kfacx.flax.NNXLoss.split]
    documented += [kfacx.flax.NNXLoss.func_args, kfacx.flax.NNXLoss.__call__]
    assert all(inspect.getdoc(obj) for obj in documented)
    assert {"Args:", "Returns:", "Raises:"} <= set(
        inspect.getdoc(kfacx.flax.nnx_value_grads_and_curvature_stats).split()
    )


def test_importing_kfacx_imports_neither_flax_nor_equinox():
    code = "import sys, kfacx; print([m for m in ('flax', 'equinox') if m in sys.modules])"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def _run_example(name: str, args: list[str]) -> Any:
    """``main(args)`` of ``examples/<name>``, imported in this process (no second JAX
    start-up); the example's helper modules are removed from `sys.modules` afterwards."""
    before = set(sys.modules)
    spec = importlib.util.spec_from_file_location(f"_example_{name[:-3]}", ROOT / "examples" / name)
    example = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = example  # dataclasses look their module up
    try:
        spec.loader.exec_module(example)
        return example.main(args)
    finally:
        sys.path.remove(str(ROOT / "examples"))
        for module in set(sys.modules) - before:
            if module in (spec.name, "common", "datasets"):
                del sys.modules[module]


def test_flax_trainstate_example_trains(capsys):
    """examples/flax_trainstate.py at a tiny size: every parameter of the CNN (convs,
    batch norms, dense) is matched, K-FAC's training loss falls, both runs finish."""
    args = ["--steps", "10", "--batch-size", "32", "--channels", "4", "--print-every", "1"]
    results = _run_example("flax_trainstate.py", args)
    out = capsys.readouterr().out
    assert "8/8 parameters matched to a layer tag." in out, out
    assert set(results) == {"K-FAC", "Adam"}, out
    for loss, accuracy, curve in results.values():
        assert np.isfinite(loss) and 0 <= accuracy <= 1 and curve.steps[-1] == 10, out
    _assert_falls(results["K-FAC"][2].losses)
