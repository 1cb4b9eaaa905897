"""Sharded curvature state (``shard_curvature_state=True``): each block's factors and
cached inverses live on one owner device of the mesh's data axis; the steps equal those
of the replicated state (float64), under the sharded jit, under shard_map, and for
`kfacx.scale_by_kfac` inside a user's shard_map."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _optimizer_cases import ADAPTIVE, make_batch
from jax.sharding import PartitionSpec as P

import kfacx
from kfacx.estimator import _sharded_curvature
from kfacx.parallel import _sharded_state

N = 4  # conftest.py gives 4 CPU devices.

KWARGS = dict(
    l2_reg=1e-3,
    estimation_mode="ggn_exact",  # No sampling, so the layouts can agree exactly.
    inverse_update_period=3,
    curvature_update_period=2,  # statistics every other step (reduced in that branch)
    num_burnin_steps=2,
    **ADAPTIVE,
)


def _loss(params, batch):
    """Blocks of three kinds: Kronecker (dense), diagonal (scale and shift, generic)."""
    x, y = batch
    h = jnp.tanh(x @ params["w1"] + params["b1"][None, :])
    h = kfacx.register_scale_and_shift(
        h * params["scale"][None, :] + params["shift"][None, :], h, params["scale"], params["shift"]
    )
    bias = kfacx.register_generic(params["c"])
    logits = h @ params["w2"] + params["b2"][None, :] + bias[None, :]
    kfacx.register_softmax_cross_entropy_loss(logits, y)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y))


def _params(din=5, dh=8, dout=3):
    k = jax.random.split(jax.random.key(0), 2)
    return dict(
        w1=jax.random.normal(k[0], (din, dh)) * 0.5,
        b1=jnp.zeros(dh),
        scale=jnp.ones(dh),
        shift=jnp.zeros(dh),
        w2=jax.random.normal(k[1], (dh, dout)) * 0.5,
        b2=jnp.zeros(dout),
        c=jnp.zeros(dout),
    )


def _x64(tree):
    return jax.tree.map(
        lambda x: jnp.asarray(x, jnp.float64) if jnp.issubdtype(x.dtype, jnp.floating) else x,
        tree,
    )


def _mesh():
    return jax.make_mesh((N,), ("data",), devices=jax.devices()[:N])


def _run(steps, **kwargs):
    """``steps`` Optimizer steps in float64: ``(optimizer, params, state, stats)``."""
    with jax.enable_x64(True):
        params, batch = _x64((_params(), make_batch(n=32)))
        opt = kfacx.Optimizer(jax.value_and_grad(_loss), **{**KWARGS, **kwargs})
        state, stats = opt.init(params, jax.random.key(7), batch), None
        for i in range(steps):
            params, state, stats = opt.step(params, state, jax.random.key(100 + i), batch)
        return opt, params, state, stats


@functools.lru_cache
def _replicated_run(use_shard_map):
    return _run(10, mesh=_mesh(), use_shard_map=use_shard_map)


def _replicated(use_shard_map):
    return jax.device_get(_replicated_run(use_shard_map)[1:])


@functools.lru_cache
def _sharded(use_shard_map):
    opt, params, state, stats = _run(
        10, mesh=_mesh(), use_shard_map=use_shard_map, shard_curvature_state=True
    )
    with jax.enable_x64(True):
        est = kfacx.gather_estimator_state(opt.estimator, state.estimator_state)
    return opt, params, state, stats, est


# ----------------------------------------------------------------------------- layout


def test_owners_are_balanced_by_bytes_with_refresh_cost_breaking_ties():
    sizes = [100, 800, 300, 700, 500, 200]
    owners = _sharded_state.assign_owners_by_bytes(sizes, [0.0] * 6, 3)
    # Largest first to the least loaded: 800->0, 700->1, 500->2, 300->2, 200->1, 100->0.
    assert owners == (0, 0, 2, 1, 2, 1)
    loads = [sum(s for s, o in zip(sizes, owners, strict=True) if o == d) for d in range(3)]
    assert loads == [900, 900, 800]
    # Equal bytes: 5.0 -> 0, 3.0 -> 1, then 1.0 -> 0 (equal loads: the lower device).
    assert _sharded_state.assign_owners_by_bytes([8, 8, 8], [1.0, 5.0, 3.0], 2) == (0, 0, 1)
    assert _sharded_state.assign_owners_by_bytes([], [], 4) == ()
    with pytest.raises(ValueError, match="num_devices"):
        _sharded_state.assign_owners_by_bytes([1], [1.0], 0)


def test_pack_and_unpack_round_trip_the_state_exactly():
    opt, *_ = _sharded(True)
    plan = _sharded_curvature.ShardedCurvature(opt.estimator, N, None)
    with jax.enable_x64(True):
        layout = plan.state_layout
    shapes = plan.state_shapes
    assert {s.dtype for s in jax.tree.leaves(shapes)} == {np.dtype("float64")}
    rng = np.random.default_rng(0)
    states = [jax.tree.map(lambda s: rng.normal(size=s.shape).astype(s.dtype), st) for st in shapes]
    with jax.enable_x64(True):
        buffers = layout.pack(states)
        jax.tree.map(np.testing.assert_array_equal, layout.unpack(buffers), states)
    assert [b.shape for b in buffers] == [(N, n) for n in layout.lengths]
    # Each owner's row holds its blocks' entries and zeros after them.
    assert sorted(i for d in range(N) for i in layout.owned[d]) == list(range(len(states)))
    for d in range(N):
        used = int(layout.used[d, 0])
        assert not np.any(np.asarray(buffers[0][d, used:]))


def test_state_lives_on_its_owner_only():
    opt, _, state, _, est = _sharded(False)
    plan = _sharded_curvature.plan_for(opt.estimator, N)
    # Owners hold blocks of different kinds and shapes: Kronecker, scale and shift, generic.
    kinds = {type(b).__name__ for b in opt.estimator.blocks}
    assert kinds == {"DenseTwoKroneckerFactored", "ScaleAndShiftDiagonal", "Diagonal"}
    assert len(set(plan.owners)) == len(plan.owners)  # 4 blocks, 4 devices: one each
    packed = 0
    for buffer in state.estimator_state.buffers:
        assert not buffer.sharding.is_fully_replicated
        shards = buffer.addressable_shards
        assert len({s.device for s in shards}) == N
        assert all(s.data.shape == (1, buffer.shape[1]) for s in shards)
        assert sum(s.data.size for s in shards) == buffer.size
        packed += buffer.size * buffer.dtype.itemsize
    state_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(est))
    owner_bytes = plan.state_layout.owner_bytes()
    assert sum(owner_bytes) == state_bytes
    # Each device stores one row: the longest owner's, per buffer (moving averages and
    # caches have buffers of their own).
    assert packed == N * plan.state_layout.row_bytes() >= N * max(owner_bytes)
    for leaf in jax.tree.leaves((state.velocities, state.damping)):
        assert leaf.sharding.is_fully_replicated


# ----------------------------------------------------------------------------- steps


@pytest.mark.parametrize("use_shard_map", [False, True], ids=["mesh", "shard_map"])
def test_sharded_steps_equal_replicated_steps_float64(use_shard_map):
    # The same placement with the replicated state (the placements themselves differ
    # here: the generic block's statistics are squared gradients of each device's mean).
    want_params, want_state, want_stats = _replicated(use_shard_map)
    _, params, state, stats, est = _sharded(use_shard_map)
    assert params["w1"].dtype == jnp.float64
    close = functools.partial(np.testing.assert_allclose, rtol=1e-10, atol=1e-12)
    jax.tree.map(close, (want_params, want_state.estimator_state), (params, est))
    jax.tree.map(close, want_state.velocities, state.velocities)
    for key in ("loss", "learning_rate", "momentum", "damping", "rho"):
        close(stats[key], want_stats[key])
    assert int(state.step_counter) == 10
    moved = float(jnp.max(jnp.abs(want_params["w1"] - _params()["w1"])))
    assert moved > 0.1  # the comparison is not vacuous


def _reduced_outside_conds(jaxpr) -> int:
    """Elements summed over devices by ``jaxpr`` outside any `jax.lax.cond`, in every
    step: those a ``psum`` returns and those a ``psum_scatter`` hands each device."""
    total = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "cond":
            continue
        if eqn.primitive.name in ("psum", "reduce_scatter"):
            total += sum(int(np.prod(v.aval.shape)) for v in eqn.outvars)
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else (value,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    total += _reduced_outside_conds(sub)
    return total


@functools.lru_cache
def _step_jaxpr(shard):
    """The jaxpr of the shard_map step of the 10-step runs (``curvature_update_period=2``)."""
    opt, params, state, _ = (_sharded if shard else _replicated_run)(True)[:4]
    with jax.enable_x64(True):
        batch = _x64(make_batch(n=32))
        b, p, s, r, _ = opt.placement.put(batch, params, state, jax.random.key(0), None)
        return opt, jax.make_jaxpr(opt._stage())(p, s, r, b, *[None] * 5).jaxpr


@pytest.mark.parametrize("shard", [False, True], ids=["replicated", "sharded"])
def test_statistics_are_reduced_only_on_the_steps_that_update_the_curvature(shard):
    """With ``curvature_update_period=2`` the statistics' reduction runs inside the
    update's branch: every step sums the gradients (sharded: each device receives its
    own blocks' part) and a few scalars only. (The 10-step runs compared above have
    this period.)"""
    opt, jaxpr = _step_jaxpr(shard)
    num_params = sum(x.size for x in jax.tree.leaves(_params()))
    with jax.enable_x64(True):
        stats = opt.estimator.zero_curvature_stats().blocks
    assert sum(x.size for x in jax.tree.leaves(stats)) > num_params  # told apart below
    reduced = _reduced_outside_conds(jaxpr)
    assert reduced < num_params + 16
    if shard:  # The gradient is reduce-scattered: each device gets about 1/N of it.
        assert reduced < num_params
    else:
        assert reduced >= num_params


def test_fixed_rate_with_norm_constraint_reads_the_scattered_gradient_as_replicated():
    """Without the quadratic model the gradient's dot products come from the norm
    constraint and the step's norms: the owners' parts, summed over the devices."""
    fixed = dict(
        learning_rate_schedule=0.3, momentum_schedule=0.5, damping_schedule=1e-2,
        norm_constraint=1e-3, use_adaptive_learning_rate=False, use_adaptive_momentum=False,
        use_adaptive_damping=False, estimation_mode="ggn_exact", num_burnin_steps=0,
    )  # fmt: skip
    runs = []
    for shard in (False, True):
        opt = kfacx.Optimizer(
            jax.value_and_grad(_loss), mesh=_mesh(), use_shard_map=True,
            shard_curvature_state=shard, **fixed,
        )  # fmt: skip
        with jax.enable_x64(True):
            params, batch = _x64((_params(), make_batch(n=32)))
            state = opt.init(params, jax.random.key(7), batch)
            for i in range(3):
                params, state, stats = opt.step(params, state, jax.random.key(i), batch)
        runs.append(jax.device_get((params, stats["grad_norm"], stats["update_norm"])))
    jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-10), *runs)
    assert float(runs[0][1]) > 0


def test_a_non_finite_step_keeps_the_sharded_state_bit_for_bit():
    opt, params, state, _, _ = _sharded(True)
    with jax.enable_x64(True):
        x, y = _x64(make_batch(n=32))
        bad = (x.at[3, 0].set(jnp.nan), y)
        _, new_state, stats = opt.step(params, state, jax.random.key(0), bad)
    assert bool(stats["skipped"])
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(state), jax.device_get(new_state))


# ----------------------------------------------------------------------------- optax


def _optax_run(shard):
    auto = (jax.sharding.AxisType.Auto,)
    mesh = jax.make_mesh((N,), ("d",), axis_types=auto, devices=jax.devices()[:N])
    with jax.enable_x64(True):
        params, batch = _x64((_params(), make_batch(n=32)))
        est = kfacx.BlockDiagonalCurvature(_loss, default_estimation_mode="ggn_exact")
        local = jax.tree.map(lambda x: x[: 32 // N], batch)
        extra = dict(shard_curvature_state=True, mesh=mesh) if shard else {}
        kfac = kfacx.scale_by_kfac(
            est, (params, local), damping=1e-2, inverse_update_period=2, pmap_axis_name="d", **extra
        )
        tx = optax.chain(kfac, optax.sgd(0.1, momentum=0.5))
        opt_state = tx.init(params)
        specs = kfacx.parallel.sharded_state_specs(opt_state, "d")

        def step(params, opt_state, batch):
            loss, grads, stats = est.value_grads_and_curvature_stats(
                None, (params, batch), estimator_state=kfacx.estimator_state(opt_state)
            )
            grads = jax.lax.pmean(grads, "d")
            updates, opt_state = tx.update(grads, opt_state, params, curvature_stats=stats)
            return optax.apply_updates(params, updates), opt_state

        mapped = jax.jit(
            jax.shard_map(
                step,
                mesh=mesh,
                in_specs=(P(), specs, P("d")),
                out_specs=(P(), specs),
                check_vma=False,
            )
        )
        for _ in range(3):
            params, opt_state = mapped(params, opt_state, batch)
        state = kfacx.estimator_state(opt_state)
        assert state is opt_state[0].estimator_state
        if shard:
            state = kfacx.gather_estimator_state(est, state)
        return jax.device_get((params, state))


def test_scale_by_kfac_with_sharded_state_in_a_shard_map_equals_replicated():
    want, got = _optax_run(False), _optax_run(True)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12), want, got)


# ----------------------------------------------------------------------------- bad inputs


def test_bad_options_say_what_to_use():
    value_and_grad = jax.value_and_grad(_loss)
    with pytest.raises(ValueError, match="shard_curvature_state=True .* pass mesh=.* or multi"):
        kfacx.Optimizer(value_and_grad, shard_curvature_state=True)
    params, batch = _params(), make_batch(n=32)
    est = kfacx.BlockDiagonalCurvature(_loss)
    with pytest.raises(ValueError, match="needs pmap_axis_name= .* and mesh="):
        kfacx.scale_by_kfac(est, (params, batch), shard_curvature_state=True)
    with pytest.raises(ValueError, match="mesh= is only used with shard_curvature_state"):
        kfacx.scale_by_kfac(est, (params, batch), mesh=_mesh())
    ekfac = kfacx.Optimizer(
        value_and_grad, mesh=_mesh(), shard_curvature_state=True, curvature_block="ekfac"
    )
    with pytest.raises(ValueError, match="curvature_block='ekfac'"):
        ekfac.init(params, jax.random.key(0), batch)
    with pytest.raises(TypeError, match="gather_estimator_state takes"):
        kfacx.gather_estimator_state(est, est.init(jax.random.key(0), (params, batch)))


# ----------------------------------------------------------------------------- stacked


def _stacked_loss(params, batch):
    """Four dense layers of width 8 in a `lax.scan` over their stacked parameters (one
    `StackedBlock` holding most of the curvature state) between two dense layers."""
    x, y = batch
    h = jnp.tanh(x @ params["w_in"] + params["b_in"][None, :])

    def layer(h, p):
        return jnp.tanh(h @ p["w"] + p["b"][None, :]), None

    h, _ = jax.lax.scan(layer, h, params["stack"])
    logits = h @ params["w_out"] + params["b_out"][None, :]
    kfacx.register_softmax_cross_entropy_loss(logits, y)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y))


def _stacked_params(din=5, width=8, layers=4, dout=3):
    rng = np.random.default_rng(0)
    return dict(
        w_in=rng.normal(size=(din, width)) * 0.5,
        b_in=np.zeros(width),
        stack=dict(w=rng.normal(size=(layers, width, width)) * 0.4, b=np.zeros((layers, width))),
        w_out=rng.normal(size=(width, dout)) * 0.5,
        b_out=np.zeros(dout),
    )


def _stacked_run(shard):
    with jax.enable_x64(True):
        params, batch = _x64((_stacked_params(), make_batch(n=32)))
        params = jax.tree.map(jnp.asarray, params)
        opt = kfacx.Optimizer(
            jax.value_and_grad(_stacked_loss),
            mesh=_mesh(),
            use_shard_map=True,
            shard_curvature_state=shard,
            **KWARGS,
        )
        state = opt.init(params, jax.random.key(7), batch)
        for i in range(10):
            params, state, _ = opt.step(params, state, jax.random.key(100 + i), batch)
        if shard:
            est = kfacx.gather_estimator_state(opt.estimator, state.estimator_state)
        else:
            est = state.estimator_state
        return opt, jax.device_get((params, est))


def test_a_large_stacked_block_is_cut_into_runs_of_slices_on_several_owners():
    opt, (params, est) = _stacked_run(True)
    _, want = _stacked_run(False)
    stacked = [
        i for i, b in enumerate(opt.estimator.blocks) if type(b) is kfacx.blocks.StackedBlock
    ]
    assert len(stacked) == 1
    plan = _sharded_curvature.plan_for(opt.estimator, N)
    cut = [(u.lo, u.hi) for u in plan.units.units if u.block == stacked[0]]
    assert cut == [(0, 1), (1, 2), (2, 3), (3, 4)]  # one slice each: 83 % of the bytes
    owners = [o for u, o in zip(plan.units.units, plan.owners, strict=True) if u.lo is not None]
    assert sorted(owners) == list(range(N))
    close = functools.partial(np.testing.assert_allclose, rtol=1e-10, atol=1e-12)
    jax.tree.map(close, want, (params, est))
    # Repacked for 2 devices (runs of at most half a device's share: one slice each
    # again, two per device) and read back: the same state.
    with jax.enable_x64(True):
        two = kfacx.shard_estimator_state(opt.estimator, est, 2)
        plan2 = _sharded_curvature.plan_for(opt.estimator, 2)
        runs = [o for u, o in zip(plan2.units.units, plan2.owners, strict=True) if u.lo is not None]
        assert sorted(runs) == [0, 0, 1, 1]
        again = kfacx.gather_estimator_state(opt.estimator, two)
    jax.tree.map(np.testing.assert_array_equal, est, jax.device_get(again))


# ----------------------------------------------------------------------------- pmap


def test_pmap_with_sharded_state_equals_replicated_and_keeps_one_row_per_device():
    """Under pmap each device keeps its own rows; the 10 steps equal those of the
    replicated state under shard_map (the same per-device batches and reductions)."""
    want_params, want_state, _ = _replicated(True)
    with jax.enable_x64(True):
        params, batch = _x64((_params(), make_batch(n=32)))
        opt = kfacx.Optimizer(
            jax.value_and_grad(_loss), multi_device=True, shard_curvature_state=True, **KWARGS
        )
        rep = kfacx.parallel.replicate_all_local_devices
        p, batch = rep(params), kfacx.parallel.shard_batch(batch)
        state = opt.init(p, rep(jax.random.key(7)), batch)
        for i in range(10):
            p, state, _ = opt.step(p, state, rep(jax.random.key(100 + i)), batch)
        est = kfacx.gather_estimator_state(opt.estimator, state.estimator_state)
    close = functools.partial(np.testing.assert_allclose, rtol=1e-10, atol=1e-12)
    first = jax.device_get(jax.tree.map(lambda x: x[0], p))
    jax.tree.map(close, (want_params, want_state.estimator_state), (first, jax.device_get(est)))
    # Each device holds its own row: [devices, 1, length], no copy of the others'.
    for buffer in state.estimator_state.buffers:
        assert buffer.shape[:2] == (N, 1)


def test_pack_layout_groups_leaves_one_by_one():
    """``front`` as a group per leaf: a refresh-only leaf between two rewritten ones keeps
    its rows when group 0 is packed again."""
    item = dict(a=jnp.arange(2.0), b=jnp.arange(3.0) + 10, c=jnp.arange(1.0) + 20)
    layout = _sharded_state.PackLayout([item], [0], 1, front=[[0, 1, 0]])
    assert [g for g, _ in layout.keys] == [0, 1]
    rows = layout.pack_owner(0, {0: item})
    new = jax.tree.map(lambda x: -x, item)
    again = layout.unpack_owner(0, layout.pack_owner(0, {0: new}, rows, group=0))[0]
    np.testing.assert_array_equal(again["a"], new["a"])
    np.testing.assert_array_equal(again["b"], item["b"])
    np.testing.assert_array_equal(again["c"], new["c"])
    with pytest.raises(ValueError, match=r"front\[0\] = \[0, 2, 0\]"):
        _sharded_state.PackLayout([item], [0], 1, front=[[0, 2, 0]])


def _masked_loss(params, batch):
    """A dense layer whose weight is masked (`MappedBlock` in a `ViewBlock`), a plain one."""
    x, y = batch
    mask = np.tril(np.ones(params["w1"].shape))
    h = jnp.tanh(x @ (params["w1"] * mask))
    logits = h @ params["w2"]
    kfacx.register_softmax_cross_entropy_loss(logits, y)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y))


def test_cache_entries_the_statistics_update_writes_go_with_the_moving_averages():
    """A masked weight's block keeps its map's derivative (``scales``) in its cache and
    its statistics update writes it: the sharded layout rewrites it with the moving
    averages every step (group 0), and the inverses only at refreshes (group 1)."""
    params = dict(w1=np.ones((5, 4)), w2=np.ones((4, 3)))
    est = kfacx.BlockDiagonalCurvature(_masked_loss)
    est.init(jax.random.key(0), (params, make_batch(n=8)))
    plan = _sharded_curvature.plan_for(est, 2)
    layout = plan.state_layout
    group = {
        (e.item, e.leaf): layout.keys[k][0]
        for rows in layout.entries
        for k, entries in enumerate(rows)
        for e in entries
    }
    for item, state in enumerate(plan.state_shapes):
        for leaf, (path, _) in enumerate(jax.tree_util.tree_flatten_with_path(state)[0]):
            name = jax.tree_util.keystr(path)
            want = 0 if ".factors" in name or ".scales" in name else 1
            assert group[item, leaf] == want, (type(plan.units.blocks[item]).__name__, name)
    names = [
        jax.tree_util.keystr(p)
        for p, _ in jax.tree_util.tree_flatten_with_path(plan.state_shapes[0])[0]
    ]
    assert any(".scales" in n for n in names), names
    assert not plan._refresh_writes_front
