"""Layers inside `lax.cond` / `lax.switch` branches (stochastic depth, a branch chosen by
a flag or an index): detection tags them, their statistics come from the branch
taken, and a layer whose branch was not taken keeps its moving averages.

References are the same models with the branch taken written inline (Python
``if``), for the exact Gauss-Newton statistics in float64.
"""

from __future__ import annotations

import warnings

import equinox as eqx
import flax.linen as nn
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kfacx

B, I, W, O, L = 6, 4, 5, 3, 3
KEY = jax.random.PRNGKey(0)


@pytest.fixture
def x64():
    with jax.enable_x64(True):
        yield


def _dense_params(rng, d_in, d_out, lead=()):
    w = rng.normal(size=(*lead, d_in, d_out)) / np.sqrt(d_in)
    return dict(w=w, b=0.1 * rng.normal(size=(*lead, d_out)))


def _params(seed=0, **extra):
    rng = np.random.default_rng(seed)
    out = dict(inp=_dense_params(rng, I, W), out=_dense_params(rng, W, O))
    out.update({k: _dense_params(rng, W, W, lead) for k, lead in extra.items()})
    return out


def _batch(seed=1, *flags):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.normal(size=(B, I))), jnp.asarray(rng.integers(0, O, (B,))), *flags)


def _dense(p, x):
    return x @ p["w"] + p["b"][None, :]


def _block(p, h):
    return h + jnp.tanh(_dense(p, h))


def _xent(logits, targets):
    logits = kfacx.register_softmax_cross_entropy_loss(logits, targets)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), targets[:, None], 1))


def _loss(body):
    """``loss(params, (x, targets, *flags))`` with ``body(params, h, *flags)`` between the
    input and output layers."""

    def loss(p, batch):
        x, t, *flags = batch
        h = body(p, jnp.tanh(_dense(p["inp"], x)), *flags)
        return _xent(_dense(p["out"], h), t)

    return loss


def _stochastic_depth(p, h, keep):
    return jax.lax.cond(keep, lambda h: _block(p["mid"], h), lambda h: h, h)


def _inlined(keep):
    return _loss(lambda p, h, *_: _block(p["mid"], h) if keep else h)


def _estimator(loss, args, **kwargs):
    est = kfacx.BlockDiagonalCurvature(loss, default_estimation_mode="ggn_exact", **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state = est.init(KEY, args)
    return est, state


def _stats(loss, args, **kwargs):
    est, _ = _estimator(loss, args, **kwargs)
    # one compilation instead of one per operation run eagerly
    stats = jax.jit(est.compute_curvature_stats)(KEY, args).blocks
    return est, jax.tree.map(np.asarray, stats)


def _assert_trees_equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)


def _assert_stats_close(got, want):
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-13)


# ----------------------------------------------------------------------------- statistics


@pytest.mark.parametrize("keep", [True, False], ids=["taken", "skipped"])
def test_statistics_come_from_the_branch_taken(x64, keep):
    params = _params(mid=())
    args = (params, _batch(1, keep))
    est, stats = _stats(_loss(_stochastic_depth), args)
    report = est.report
    assert report.notes == () and report.unmatched == ()
    assert {e.path: (e.tag, e.in_branch) for e in report.entries} == {
        f"{k}/{leaf}": ("dense_tag", k == "mid") for k in ("inp", "mid", "out") for leaf in "bw"
    }
    assert "1 (in branch)" in str(report)
    inp, mid, out = stats
    *mid, coverage = mid  # the layer inside the branch carries its coverage
    assert coverage.shape == () and float(coverage) == float(keep)
    reference_params = params if keep else dict(inp=params["inp"], out=params["out"])
    _, want = _stats(_inlined(keep), (reference_params, args[1]))
    _assert_stats_close(inp, want[0])
    _assert_stats_close(out, want[-1])
    if keep:
        _assert_stats_close(mid, want[1])
    else:
        assert all(not np.any(s) for s in mid)


def test_a_layer_whose_branch_is_not_taken_keeps_its_moving_averages(x64):
    params = _params(mid=())
    est, state = _estimator(_loss(_stochastic_depth), (params, _batch(1, True)))
    ref, ref_state = _estimator(_inlined(True), (params, _batch(1)))
    # one compilation each instead of one per operation run eagerly
    update, ref_update = (
        jax.jit(
            lambda state, args, e=e: e.update_curvature_matrix_estimate(
                state, 0.7, 0.3, None, KEY, args
            )
        )
        for e in (est, ref)
    )
    history = []
    for seed, keep in [(1, True), (2, False), (3, True)]:
        args = (params, _batch(seed, keep))
        state = update(state, args)
        history.append(state)
        if keep:  # the reference sees only the batches that ran the branch
            ref_state = ref_update(ref_state, (params, _batch(seed)))
    # The skipped batch leaves the branch's block as it was, bit for bit...
    _assert_trees_equal(history[0].blocks[1], history[1].blocks[1])
    # ...and the block ends where the batches that ran it lead.
    _assert_stats_close(jax.tree.leaves(state.blocks[1]), jax.tree.leaves(ref_state.blocks[1]))
    # The layers outside the branch take every batch.
    np.testing.assert_allclose(state.blocks[0].factors[0].weight, 1 - 0.7**3)
    np.testing.assert_allclose(state.blocks[1].factors[0].weight, 1 - 0.7**2)


def _branches(p, tag):
    """Three branches: a residual layer ``a`` (on ``h`` in branch 0, on ``2 h`` in branch
    1: one layer used in two branches) and a layer ``c`` in branch 2."""

    def dense(q, x):
        y = _dense(q, x)
        return kfacx.register_dense(y, x, q["w"], q["b"]) if tag else y

    return [
        lambda h: h + jnp.tanh(dense(p["a"], h)),
        lambda h: h + jnp.tanh(dense(p["a"], 2.0 * h)),
        lambda h: jnp.sin(dense(p["c"], h)),
    ]


def _switch_body(tag):
    return lambda p, h, index: jax.lax.switch(index, _branches(p, tag), h)


def _hand_tagged(body):
    def loss(p, batch):
        x, t, *flags = batch
        h = jnp.tanh(kfacx.register_dense(_dense(p["inp"], x), x, p["inp"]["w"], p["inp"]["b"]))
        h = body(p, h, *flags)
        out = kfacx.register_dense(_dense(p["out"], h), h, p["out"]["w"], p["out"]["b"])
        return _xent(out, t)

    return loss


@pytest.mark.parametrize("index", [0, 1, 2])
def test_switch_detection_equals_hand_tagging_and_the_inlined_branch(x64, index):
    params = _params(a=(), c=())
    args = (params, _batch(1, index))
    est, auto = _stats(_loss(_switch_body(False)), args)
    assert est.report.notes == () and est.report.unmatched == ()
    assert {e.path: (e.uses, e.in_branch) for e in est.report.entries} == {
        f"{k}/{leaf}": ({"a": 2}.get(k, 1), k in ("a", "c"))
        for k in ("inp", "a", "c", "out")
        for leaf in "bw"
    }
    assert [b.layer.parameter_paths for b in est.blocks] == [
        ("inp/w", "inp/b"),
        ("a/w", "a/b"),
        ("c/w", "c/b"),
        ("out/w", "out/b"),
    ]
    _, manual = _stats(_hand_tagged(_switch_body(True)), args, auto_register_tags=False)
    for got, want in zip(auto, manual, strict=True):
        _assert_stats_close(got, want)
    assert [float(auto[i][-1]) for i in (1, 2)] == [float(index < 2), float(index == 2)]
    # The branch taken, written inline.
    used = "a" if index < 2 else "c"
    inline = dict(inp=params["inp"], out=params["out"], **{used: params[used]})
    _, want = _stats(_loss(lambda p, h: _branches(p, False)[index](h)), (inline, args[1][:2]))
    _assert_stats_close(auto[1 if index < 2 else 2][:-1], want[1])


def _layer_stack(shared):
    """Stochastic depth in a scan: layer ``l`` runs only when ``keep[l]``; its parameters
    are slice ``l`` of ``stack`` (``hk.layer_stack``-like) or ``mid`` for every layer."""

    def body(p, h, keep):
        def step(h, xs):
            q, k = (p["mid"], xs) if shared else xs
            return jax.lax.cond(k, lambda h: _block(q, h), lambda h: h, h), None

        h, _ = jax.lax.scan(step, h, keep if shared else (p["stack"], keep))
        return h

    return body


def _unrolled(keep, shared):
    def body(p, h, *_):
        for layer, k in enumerate(keep):
            if k:
                h = _block(p["mid"] if shared else p[f"layer{layer}"], h)
        return h

    return _loss(body)


@pytest.mark.parametrize("shared", [False, True], ids=["stacked", "shared"])
def test_stochastic_depth_inside_a_scan(x64, shared):
    keep = (True, False, True)
    params = _params(**({"mid": ()} if shared else {"stack": (L,)}))
    args = (params, _batch(1, jnp.asarray(keep)))
    est, stats = _stats(_loss(_layer_stack(shared)), args)
    assert est.report.notes == () and est.report.unmatched == ()
    *block, coverage = stats[1]
    inline = dict(inp=params["inp"], out=params["out"])
    if shared:
        inline["mid"] = params["mid"]
        assert float(coverage) == 1.0
        _, want = _stats(_unrolled(keep, True), (inline, args[1]))
        _assert_stats_close(block, want[1])
        return
    assert type(est.blocks[1]).__name__ == "StackedBlock"
    np.testing.assert_array_equal(coverage, np.asarray(keep, float))
    for layer, k in enumerate(keep):
        if k:
            inline[f"layer{layer}"] = jax.tree.map(lambda a, i=layer: a[i], params["stack"])
    _, want = _stats(_unrolled(keep, False), (inline, args[1]))
    kept = iter(want[1:-1])
    for layer, k in enumerate(keep):
        got = [s[layer] for s in block]
        if k:
            _assert_stats_close(got, next(kept))
        else:
            assert all(not np.any(s) for s in got)
    # The dropped slice keeps its (zero) moving averages; the others move.
    # one compilation instead of one per operation run eagerly
    update = jax.jit(
        lambda state, args: est.update_curvature_matrix_estimate(state, 0.5, 0.5, None, KEY, args)
    )
    state = update(est.init(KEY, args), args)
    np.testing.assert_array_equal(state.blocks[1].factors[0].weight, 0.5 * np.asarray(keep))


def test_coverage_is_averaged_over_devices(x64):
    """With the branch taken on one device and not on the other, the layer's averages
    take half a step towards the statistics of the device that ran it."""
    params = _params(mid=())
    devices = jax.devices()[:2]
    est, state = _estimator(_loss(_stochastic_depth), (params, _batch(1, True)))
    batches = [_batch(1, True), _batch(2, False)]
    stacked = jax.tree.map(lambda *a: np.stack([np.asarray(x) for x in a]), *batches)

    def update(state, batch):
        stats = est.compute_curvature_stats(KEY, (params, batch))
        return est.update_curvature_estimate_from_stats(state, stats, 0.0, 1.0, "d")

    update = jax.pmap(update, axis_name="d", devices=devices, in_axes=(None, 0))
    new = jax.tree.map(
        lambda a: np.asarray(a)[0], update(state, stacked)
    )  # (NumPy: no compilation)
    _, alone = _stats(_loss(_stochastic_depth), (params, batches[0]))
    mid = new.blocks[1].factors
    np.testing.assert_allclose([float(f.weight) for f in mid], [0.5, 0.5])
    for f, s in zip(mid, alone[1][:-1], strict=True):
        np.testing.assert_allclose(f.value, s, rtol=1e-10, atol=1e-13)
    np.testing.assert_allclose(new.blocks[0].factors[0].weight, 1.0)


# ----------------------------------------------------------------------------- training


def test_optimizer_trains_with_stochastic_depth_and_skips_the_layer_it_did_not_run():
    """Stochastic depth as users write it: the branch is drawn from the step's rng key."""
    body = _loss(_stochastic_depth)

    def loss(p, rng, batch):
        keep = jax.random.bernoulli(rng, 0.5)
        return body(p, (*batch, keep)), keep

    opt = kfacx.Optimizer(
        jax.value_and_grad(loss, has_aux=True),
        value_func_has_aux=True,
        value_func_has_rng=True,
        use_adaptive_learning_rate=True,
        use_adaptive_momentum=True,
        initial_damping=1e-2,
        num_burnin_steps=0,
    )
    params, batch = jax.tree.map(jnp.asarray, _params(mid=())), _batch(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state = opt.init(params, KEY, batch)
    assert opt.estimator.report.notes == () and opt.estimator.report.unmatched == ()
    losses, kept = [], []
    for i in range(12):
        before = state.estimator_state.blocks[1].factors
        params, state, stats = opt.step(params, state, jax.random.PRNGKey(i), batch=batch)
        losses.append(float(stats["loss"]))
        kept.append(bool(stats["aux"]))
        after = state.estimator_state.blocks[1].factors  # (the cache follows the damping)
        if not kept[-1]:
            _assert_trees_equal(before, after)
    assert 0 < sum(kept) < len(kept), kept  # both branches ran
    for flag in (True, False):
        run = [value for value, k in zip(losses, kept, strict=True) if k == flag]
        assert run[-1] < 0.5 * run[0], ([round(v, 3) for v in losses], kept)


# ----------------------------------------------------------------------------- frameworks
#
# A branch chosen per batch: every batch comes from one task (``task[0]``) and the
# model has a head per task; or a residual block that runs only for some tasks.


def _task_batch(task, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(B, I)).astype(np.float32)
    return x, rng.integers(0, O, (B,)), np.full((B,), task, np.int32)


def _haiku_forward(x, task):
    h = jnp.tanh(hk.Linear(W)(x))
    block = hk.Linear(W, name="block")
    if hk.running_init():  # create the branch's parameters outside it
        block(h)
    h = hk.cond(task[0] == 0, lambda h: h + jnp.tanh(block(h)), lambda h: h, h)
    heads = [hk.Linear(O, name=f"head{i}") for i in range(2)]
    if hk.running_init():  # create both heads' parameters
        return heads[0](h) + heads[1](h)
    return hk.switch(task[0], heads, h)


def _haiku_problem():
    net = hk.without_apply_rng(hk.transform(_haiku_forward))
    x, _, task = _task_batch(0)
    return (lambda p, b: _xent(net.apply(p, b[0], b[2]), b[1])), net.init(KEY, x, task)


class _FlaxModel(nn.Module):
    @nn.compact
    def __call__(self, x, task):
        h = jnp.tanh(nn.Dense(W)(x))
        block = nn.Dense(W, name="block")
        if self.is_initializing():
            block(h)
        h = nn.cond(task[0] == 0, lambda m, h: h + jnp.tanh(block(h)), lambda m, h: h, self, h)
        return nn.Dense(O)(h)


def _flax_problem():
    module = _FlaxModel()
    x, _, task = _task_batch(0)
    return (lambda p, b: _xent(module.apply(p, b[0], b[2]), b[1])), module.init(KEY, x, task)


class _NNXModel(nnx.Module):
    def __init__(self, rngs):
        self.inp = nnx.Linear(I, W, rngs=rngs)
        self.heads = nnx.List([nnx.Linear(W, O, rngs=rngs) for _ in range(3)])

    def __call__(self, x, task):
        h = jnp.tanh(self.inp(x))
        return jax.lax.switch(task[0], [lambda h, m=m: m(h) for m in self.heads], h)


def _nnx_problem():
    graphdef, params = nnx.split(_NNXModel(nnx.Rngs(0)))

    def loss(p, b):
        return _xent(nnx.merge(graphdef, p)(b[0], b[2]), b[1])

    return loss, params


class _EquinoxModel(eqx.Module):
    inp: eqx.nn.Linear
    heads: tuple

    def __init__(self, key):
        keys = jax.random.split(key, 4)
        self.inp = eqx.nn.Linear(I, W, key=keys[0])
        self.heads = tuple(eqx.nn.Linear(W, O, key=k) for k in keys[1:])

    def __call__(self, x, task):
        h = jnp.tanh(self.inp(x))
        return jax.lax.switch(task, [lambda h, m=m: m(h) for m in self.heads], h)


def _equinox_problem():
    params, static = eqx.partition(_EquinoxModel(KEY), eqx.is_array)

    def loss(p, b):
        model = eqx.combine(p, static)
        return _xent(jax.vmap(model, in_axes=(0, None))(b[0], b[2][0]), b[1])

    return loss, params


@pytest.mark.parametrize(
    "problem",
    [_haiku_problem, _flax_problem, _nnx_problem, _equinox_problem],
    ids=["haiku", "flax_linen", "flax_nnx", "equinox"],
)
def test_frameworks_train_through_branches(problem):
    """Four steps from the same parameters on the batches of each task; one optimizer (one
    compiled step) for both runs, as `_models.fixed_rate_run` configures it."""
    loss, params = problem()
    opt = kfacx.Optimizer(
        jax.value_and_grad(loss),
        learning_rate_schedule=0.1,
        momentum_schedule=0.5,
        initial_damping=1e-2,
        num_burnin_steps=0,
    )
    for task in (0, 1):
        batch, p = _task_batch(task), params
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            state = opt.init(p, KEY, batch)
        report = opt.estimator.report
        assert report.notes == () and report.unmatched == (), str(report)
        assert {e.tag for e in report.entries} == {"dense_tag"}, str(report)
        losses = []
        for i in range(4):
            p, state, stats = opt.step(p, state, jax.random.PRNGKey(1 + i), batch=batch)
            losses.append(float(stats["loss"]))
        assert np.isfinite(losses).all() and losses[-1] < 0.8 * losses[0], losses
