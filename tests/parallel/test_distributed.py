"""Scaling out: pmap, sharded jit over a Mesh, shard_map and one device give the same
steps; distributed inverse refreshes (cost-balanced owners) are bit-identical to
serial ones and each block is refreshed on one device only."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _optimizer_cases import ADAPTIVE, make_batch, make_params, mlp_loss
from jax.sharding import PartitionSpec as P

import kfacx
from kfacx.parallel import _distributed

N = 4  # conftest.py gives 4 CPU devices.


def _mesh(n=N, names=("data",)):
    shape = (n,) + (1,) * (len(names) - 1)
    return jax.make_mesh(shape, names, devices=jax.devices()[:n])


# ----------------------------------------------------------------------------- owners


def test_assign_owners_is_longest_processing_time_first():
    costs = [1.0, 8.0, 3.0, 7.0, 5.0, 2.0]
    owners = _distributed.assign_owners(costs, 3)
    # By hand (cost -> device, then loads): 8->0 (8,0,0), 7->1 (8,7,0), 5->2 (8,7,5),
    # 3->2 (8,7,8), 2->1 (8,9,8), 1->0 (9,9,8).
    assert owners == (0, 0, 2, 1, 2, 1)
    assert _distributed.device_loads(costs, owners, 3) == [9.0, 9.0, 8.0]


def test_assign_owners_balances_better_than_round_robin():
    costs = [1000.0, 1.0, 1.0, 1.0, 1000.0, 1.0, 1.0, 1.0]
    owners = _distributed.assign_owners(costs, 4)
    assert max(_distributed.device_loads(costs, owners, 4)) == 1000.0
    round_robin = [i % 4 for i in range(len(costs))]
    assert max(_distributed.device_loads(costs, round_robin, 4)) == 2000.0


def test_assign_owners_edge_cases():
    assert _distributed.assign_owners([3.0, 2.0], 1) == (0, 0)
    assert _distributed.assign_owners([], 4) == ()
    # More devices than blocks: one block each, the rest idle.
    assert sorted(_distributed.assign_owners([1.0, 1.0], 4)) == [0, 1]
    with pytest.raises(ValueError, match="num_devices"):
        _distributed.assign_owners([1.0], 0)


def _wide_and_narrow_loss(params, batch):
    x, y = batch
    h = jnp.tanh(x @ params["big"]["w"] + params["big"]["b"][None, :])
    h = jnp.tanh(h @ params["mid"]["w"] + params["mid"]["b"][None, :])
    logits = h @ params["out"]["w"] + params["out"]["b"][None, :]
    kfacx.register_softmax_cross_entropy_loss(logits, y)
    return jnp.mean(
        jax.nn.logsumexp(logits, axis=-1) - jnp.take_along_axis(logits, y[:, None], axis=-1)[:, 0]
    )


def _wide_params(din=40, d1=30, d2=6, dout=3):
    k = jax.random.split(jax.random.key(0), 3)
    dense = lambda key, i, o: dict(  # noqa: E731
        w=jax.random.normal(key, (i, o)) / np.sqrt(i), b=jnp.zeros(o)
    )
    return dict(big=dense(k[0], din, d1), mid=dense(k[1], d1, d2), out=dense(k[2], d2, dout))


def _estimator_and_state(num_updates=2, exact=False):
    params = _wide_params()
    x = jax.random.normal(jax.random.key(1), (16, 40))
    batch = (x, (x[:, 0] > 0).astype(jnp.int32))
    powers = dict(exact_powers_to_cache=(-1,), approx_powers_to_cache=()) if exact else {}
    est = kfacx.BlockDiagonalCurvature(_wide_and_narrow_loss, **powers)
    args = (params, batch)
    state = est.init(jax.random.key(0), args)
    # one compilation instead of one per operation run eagerly
    update = jax.jit(
        lambda state, rng, args: est.update_curvature_matrix_estimate(
            state, 0.5, 0.5, 16, rng, args
        )
    )
    for i in range(num_updates):
        state = update(state, jax.random.key(i), args)
    return est, state


def test_refresh_cost_and_block_owners_follow_the_factor_sizes(monkeypatch):
    est, _ = _estimator_and_state(0)
    costs = [_distributed.refresh_cost(b) for b in est.blocks]
    # Dense blocks: (in + 1)^3 + out^3 (bias folded into the input factor).
    assert costs == [41.0**3 + 30.0**3, 31.0**3 + 6.0**3, 7.0**3 + 3.0**3]
    # Bucketed, all six factors (at most 41 x 41) share one 64 x 64 bucket, largest first
    # (blocks 0 1 0 2 1 2): one unit, too small to cut.
    plan = kfacx.estimator._refresh.abstract_plan(est.blocks, est._cache_spec)
    assert plan.unit_blocks == ((0, 1, 0, 2, 1, 2),)
    whole = [kfacx.estimator._refresh.Piece(0, None, None, 6 * 64.0**3)]
    assert kfacx.estimator._refresh.pieces(plan, 4) == whole
    assert est.block_owners(2) == (0, 0, 0)
    # Were it large, it would be cut into pieces of at most half a device's share: on two
    # devices 2, 1, 1, 2 factors (owners 0, 0, 1, 1), on four one each (owners 0, 1, 2,
    # 3, 0, 1). A block in several pieces shows the owner of its largest.
    monkeypatch.setattr(kfacx.estimator._refresh, "MIN_CUT_SIZE", 64)
    assert [(p.lo, p.hi) for p in kfacx.estimator._refresh.pieces(plan, 2)] == [
        (0, 2), (2, 3), (3, 4), (4, 6)
    ]  # fmt: skip
    assert len(kfacx.estimator._refresh.pieces(plan, 4)) == 6
    assert kfacx.estimator._refresh.pieces(plan, 1) == whole
    assert est.block_owners(2) == (0, 0, 1)
    assert est.block_owners(4) == (0, 1, 3)
    # Each block refreshing itself: the largest block alone, the two others together.
    monkeypatch.setattr(kfacx.estimator._refresh, "BATCH_INVERSES", False)
    assert est.block_owners(2) == (0, 1, 1)
    assert est.block_owners(1) == (0, 0, 0)


# ----------------------------------------------------------------------------- refresh


@pytest.mark.parametrize("exact", [False, True])
def test_distributed_refresh_is_bit_identical_to_serial(exact, monkeypatch):
    # The bucket of all six factors is cut into one piece per factor (as large ones are).
    monkeypatch.setattr(kfacx.estimator._refresh, "MIN_CUT_SIZE", 1)
    est, state = _estimator_and_state(exact=exact)
    serial = jax.jit(est.update_cache)(state, 1e-2)
    replicated = kfacx.parallel.replicate_all_local_devices(state)
    distributed = jax.pmap(lambda s: est.update_cache(s, 1e-2, pmap_axis_name="i"), axis_name="i")(
        replicated
    )
    for d in range(N):
        on_device = jax.tree.map(lambda x, d=d: np.asarray(x)[d], distributed)
        jax.tree.map(np.testing.assert_array_equal, serial, on_device)
    # The caches were really computed (not zeros).
    assert all(np.abs(leaf).max() > 0 for leaf in jax.tree.leaves(serial.blocks[0].cache))


def test_bucketed_refresh_equals_each_block_refreshing_itself(monkeypatch):
    """`update_cache` inverts the factors of all blocks in size buckets (here all six, at
    most 41 x 41, are padded into one 64 x 64 bucket); each block's cache equals its own
    `update_cache`."""
    est, state = _estimator_and_state()
    batched = jax.jit(est.update_cache)(state, 1e-2)
    for block, before, after in zip(est.blocks, state.blocks, batched.blocks, strict=True):
        alone = jax.jit(block.update_cache)(before, 1e-2)
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * np.abs(b).max()),
            after,
            alone,
        )
    sizes = [m.shape[-1] for b in batched.blocks for m in b.cache.inverse]
    assert sizes == [41, 30, 31, 6, 7, 3]


def test_bucketed_refresh_repairs_a_failed_factor_the_same_way_on_every_device():
    """An indefinite factor fails its Cholesky inverse inside the bucket; the shared eigh
    fallback repairs it, equal to the block's own refresh (`psd_inverse`), and the
    distributed refresh still equals the serial one bit for bit."""
    est, state = _estimator_and_state()
    blocks = list(state.blocks)
    first = blocks[1].factors[0]
    value = first.value  # [1, 31, 31]
    mean_diagonal = jnp.trace(value, axis1=-2, axis2=-1)[..., None, None] / value.shape[-1]
    bad = value - 2.0 * mean_diagonal * jnp.eye(value.shape[-1])[None]
    factors = (first._replace(raw_value=bad * first.weight),) + blocks[1].factors[1:]
    blocks[1] = blocks[1]._replace(factors=factors)
    state = state._replace(blocks=tuple(blocks))
    serial = jax.jit(est.update_cache)(state, 1e-2)
    alone = jax.jit(est.blocks[1].update_cache)(state.blocks[1], 1e-2)
    repaired = serial.blocks[1].cache.inverse[0]
    assert bool(jnp.all(jnp.isfinite(repaired)))
    # Both are float32 eigendecompositions (of the matrix padded to 64, and alone).
    expected = alone.cache.inverse[0]
    np.testing.assert_allclose(repaired, expected, rtol=1e-3, atol=1e-5 * np.abs(expected).max())
    replicated = kfacx.parallel.replicate_all_local_devices(state)
    distributed = jax.pmap(lambda s: est.update_cache(s, 1e-2, pmap_axis_name="i"), axis_name="i")(
        replicated
    )
    for d in range(N):
        jax.tree.map(
            np.testing.assert_array_equal,
            serial,
            jax.tree.map(lambda x, d=d: np.asarray(x)[d], distributed),
        )


class _CountingDiagonal(kfacx.blocks.Diagonal):
    """A diagonal block that reports (device, block) each time its cache is refreshed."""

    calls: list = []

    def update_cache(self, state, identity_weight):
        jax.debug.callback(
            lambda d, n=self.layer.name: self.calls.append((int(d), n)),
            jax.lax.axis_index("i"),
        )
        return super().update_cache(state, identity_weight)


def test_each_block_is_refreshed_on_its_owner_device_only():
    est = kfacx.BlockDiagonalCurvature(
        _wide_and_narrow_loss, layer_tag_to_block_ctor={"dense_tag": _CountingDiagonal}
    )
    params = _wide_params()
    x = jnp.ones((8, 40))
    state = est.init(jax.random.key(0), (params, (x, jnp.zeros(8, jnp.int32))))
    owners = est.block_owners(N)
    _CountingDiagonal.calls.clear()
    jax.pmap(lambda s: est.update_cache(s, 1.0, pmap_axis_name="i"), axis_name="i")(
        kfacx.parallel.replicate_all_local_devices(state)
    )
    jax.effects_barrier()
    names = [b.layer.name for b in est.blocks]
    assert sorted(_CountingDiagonal.calls) == sorted(
        (owner, name) for owner, name in zip(owners, names, strict=True)
    )
    _CountingDiagonal.calls.clear()
    jax.pmap(lambda s: est.update_cache(s, 1.0), axis_name="i")(
        kfacx.parallel.replicate_all_local_devices(state)
    )
    jax.effects_barrier()
    assert len(_CountingDiagonal.calls) == N * len(names)  # Serial: every device, every block.


# ----------------------------------------------------------------------------- placements


KWARGS = dict(
    l2_reg=1e-3,
    estimation_mode="ggn_exact",  # No sampling, so the placements can agree exactly.
    inverse_update_period=3,
    # Statistics on every other step: their reduction over the devices runs in the
    # update's branch only, and the placements must still equal one device.
    curvature_update_period=2,
    num_burnin_steps=2,
    **ADAPTIVE,
)


#: XLA compilations so far in this process (`jax.monitoring`'s compile events).
_COMPILES = [0]
jax.monitoring.register_event_duration_secs_listener(
    lambda event, *_, **__: _COMPILES.__setitem__(
        0, _COMPILES[0] + event.endswith("backend_compile_duration")
    )
)


def _compiles_after_the_first_step(i, before):
    """Once the first step (with its burn-in) has compiled its programs, a step compiles
    nothing: the inputs the user passed and the step's own outputs have the same types
    (under pmap, step 2 used to compile the whole step again)."""
    if i == 1:
        return _COMPILES[0]
    if i > 1:
        assert _COMPILES[0] == before, f"step {i} compiled {_COMPILES[0] - before} programs"
    return before


def _run_single(params, batch, steps, **kwargs):
    opt = kfacx.Optimizer(jax.value_and_grad(mlp_loss), **{**KWARGS, **kwargs})
    state = opt.init(params, jax.random.key(7), batch)
    compiled = None
    for i in range(steps):
        compiled = _compiles_after_the_first_step(i, compiled)
        params, state, stats = opt.step(params, state, jax.random.key(100 + i), batch)
    return params, state, stats


def _run_pmap(params, batch, steps, **kwargs):
    opt = kfacx.Optimizer(jax.value_and_grad(mlp_loss), multi_device=True, **{**KWARGS, **kwargs})
    rep = kfacx.parallel.replicate_all_local_devices
    sharded = kfacx.parallel.shard_batch(batch)
    p = rep(params)
    state = opt.init(p, rep(jax.random.key(7)), sharded)
    compiled = None
    for i in range(steps):
        compiled = _compiles_after_the_first_step(i, compiled)
        p, state, stats = opt.step(p, state, rep(jax.random.key(100 + i)), sharded)
    for leaf in map(np.asarray, jax.tree.leaves((p, state))):
        np.testing.assert_array_equal(leaf[0], leaf[-1])
    return kfacx.parallel.get_first((p, state, stats))


def _run_mesh(params, batch, steps, **kwargs):
    return _run_single(params, batch, steps, mesh=_mesh(), **kwargs)


def _run_shard_map(params, batch, steps, **kwargs):
    return _run_single(params, batch, steps, mesh=_mesh(), use_shard_map=True, **kwargs)


RUNS = dict(pmap=_run_pmap, mesh=_run_mesh, shard_map=_run_shard_map)


def _x64(tree):
    return jax.tree.map(
        lambda x: jnp.asarray(x, jnp.float64) if jnp.issubdtype(x.dtype, jnp.floating) else x,
        tree,
    )


@functools.lru_cache
def _single_reference_x64():
    with jax.enable_x64(True):
        params, batch = _x64((make_params(), make_batch(n=32)))
        return jax.device_get(_run_single(params, batch, 10))


@pytest.mark.parametrize("placement", sorted(RUNS))
def test_placements_equal_single_device_after_10_steps_float64(placement):
    want_params, want_state, want_stats = _single_reference_x64()
    with jax.enable_x64(True):
        params, batch = _x64((make_params(), make_batch(n=32)))
        got_params, got_state, got_stats = RUNS[placement](params, batch, 10)
    assert got_params["w1"].dtype == jnp.float64
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12),
        (want_params, want_state),
        (got_params, got_state),
    )
    for key in ("loss", "learning_rate", "momentum", "damping"):
        # float32 stats (learning rate, momentum, damping) to about one rounding.
        rtol = 1e-9 if want_stats[key].dtype == np.float64 else 2e-7
        np.testing.assert_allclose(got_stats[key], want_stats[key], rtol=rtol)
    assert int(got_state.data_seen) == 10 * 32
    # The step moved the parameters a fair way (the comparison is not vacuous).
    moved = float(jnp.max(jnp.abs(want_params["w1"] - make_params()["w1"])))
    assert moved > 0.1


# A cheaper step (fixed learning rate and momentum) for the float32 comparisons.
SIMPLE = dict(
    KWARGS,
    use_adaptive_learning_rate=False,
    use_adaptive_momentum=False,
    use_adaptive_damping=False,
    learning_rate_schedule=0.3,
    momentum_schedule=0.5,
    initial_damping=1e-2,
    inverse_update_period=2,
    num_burnin_steps=0,
)


@functools.lru_cache
def _simple_run(placement, distributed_inverses=True):
    params, batch = make_params(), make_batch(n=32)
    run = _run_single if placement == "single" else RUNS[placement]
    return jax.device_get(
        run(params, batch, 5, distributed_inverses=distributed_inverses, **SIMPLE)[:2]
    )


@pytest.mark.parametrize("placement", sorted(RUNS))
def test_distributed_inverses_do_not_change_the_step_float32(placement):
    on, off = _simple_run(placement), _simple_run(placement, False)
    jax.tree.map(np.testing.assert_array_equal, on, off)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5),
        _simple_run("single"),
        on,
    )


@pytest.mark.parametrize(
    "placement,axis_type",
    [("mesh", "Explicit"), ("shard_map", "Explicit"), ("shard_map", "Auto")],
)
def test_a_batch_placed_on_the_mesh_steps_as_an_unplaced_one(placement, axis_type):
    """The documented way to feed a mesh: each process's rows placed with
    `jax.make_array_from_process_local_data` on a mesh from `jax.make_mesh`, whose axes are
    Explicit by default (or Auto). Init and step take the batch as it lives there."""
    axis_types = (getattr(jax.sharding.AxisType, axis_type),)
    mesh = jax.make_mesh((N,), ("data",), axis_types=axis_types, devices=jax.devices()[:N])
    params, (x, y) = make_params(), make_batch(n=32)
    rows = jax.sharding.NamedSharding(mesh, P("data"))
    batch = tuple(jax.make_array_from_process_local_data(rows, np.asarray(a)) for a in (x, y))
    got = _run_single(params, batch, 5, mesh=mesh, use_shard_map=placement == "shard_map", **SIMPLE)
    jax.tree.map(np.testing.assert_array_equal, _simple_run(placement), jax.device_get(got[:2]))


def test_mesh_step_keeps_outputs_replicated_on_the_mesh():
    p, state, _ = _run_mesh(make_params(), make_batch(n=32), 2, **SIMPLE)
    for leaf in jax.tree.leaves((p, state)):
        assert leaf.sharding.is_fully_replicated
        assert len(leaf.sharding.device_set) == N


def test_two_axis_mesh_uses_the_named_data_axis():
    params, batch = make_params(), make_batch(n=32)
    want = _simple_run("single")
    mesh = jax.make_mesh((2, 2), ("data", "model"))
    for use_shard_map in (False, True):
        got = _run_single(
            params,
            batch,
            5,
            mesh=mesh,
            data_axis_name="data",
            use_shard_map=use_shard_map,
            **SIMPLE,
        )
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5), want, got[:2]
        )
    with pytest.raises(ValueError, match="pass data_axis_name"):
        kfacx.Optimizer(jax.value_and_grad(mlp_loss), mesh=mesh, **KWARGS)
    with pytest.raises(ValueError, match="'batch' is not an axis"):
        kfacx.Optimizer(jax.value_and_grad(mlp_loss), mesh=mesh, data_axis_name="batch", **KWARGS)


@pytest.mark.parametrize("use_shard_map", [False, True])
def test_mesh_batch_must_divide_over_the_data_axis(use_shard_map):
    opt = kfacx.Optimizer(
        jax.value_and_grad(mlp_loss), mesh=_mesh(), use_shard_map=use_shard_map, **KWARGS
    )
    with pytest.raises(ValueError, match="divisible by the 4 devices of the mesh axis 'data'"):
        opt.init(make_params(), jax.random.key(0), make_batch(n=30))


def test_mesh_and_multi_device_are_exclusive():
    with pytest.raises(ValueError, match="not both"):
        kfacx.Optimizer(jax.value_and_grad(mlp_loss), mesh=_mesh(), multi_device=True)


def _aux_loss(params, batch):
    loss = mlp_loss(params, batch)
    return loss, dict(first=batch[0][0, 0], loss=loss)


def test_shard_map_returns_per_device_aux_like_pmap():
    params, batch = make_params(), make_batch(n=32)
    kwargs = dict(value_func_has_aux=True, learning_rate_schedule=0.1, initial_damping=1e-2)
    pmapped = kfacx.Optimizer(
        jax.value_and_grad(_aux_loss, has_aux=True), multi_device=True, **kwargs
    )
    rep = kfacx.parallel.replicate_all_local_devices
    sharded = kfacx.parallel.shard_batch(batch)
    state = pmapped.init(rep(params), rep(jax.random.key(0)), sharded)
    _, _, want = pmapped.step(rep(params), state, rep(jax.random.key(1)), sharded)

    mapped = kfacx.Optimizer(
        jax.value_and_grad(_aux_loss, has_aux=True), mesh=_mesh(), use_shard_map=True, **kwargs
    )
    state = mapped.init(params, jax.random.key(0), batch)
    _, _, got = mapped.step(params, state, jax.random.key(1), batch)
    assert got["aux"]["first"].shape == (N,)
    np.testing.assert_array_equal(got["aux"]["first"], batch[0][::8, 0])
    np.testing.assert_allclose(got["aux"]["loss"], want["aux"]["loss"], rtol=1e-6)
    np.testing.assert_allclose(got["loss"], want["loss"][0], rtol=1e-6)


def test_unstaged_step_under_a_user_shard_map():
    """Users can shard_map `unstaged_step` themselves with the pmap axis name."""
    params, batch = make_params(), make_batch(n=32)
    kwargs = dict(
        learning_rate_schedule=0.1,
        initial_damping=1e-2,
        num_burnin_steps=0,
        estimation_mode="ggn_exact",
    )
    single = kfacx.Optimizer(jax.value_and_grad(mlp_loss), **kwargs)
    want = single.step(
        params, single.init(params, jax.random.key(7), batch), jax.random.key(100), batch
    )
    opt = kfacx.Optimizer(
        jax.value_and_grad(mlp_loss), multi_device=True, pmap_axis_name="d", **kwargs
    )
    local = jax.tree.map(lambda x: x[:8], batch)
    opt.estimator.set_up((params, local))
    state = opt.unstaged_init(params, jax.random.key(7), local)
    step = jax.jit(
        jax.shard_map(
            lambda p, s, r, b: opt.unstaged_step(p, s, r, b)[:2],
            mesh=jax.make_mesh((N,), ("d",), axis_types=(jax.sharding.AxisType.Auto,)),
            in_specs=(P(), P(), P(), P("d")),
            out_specs=P(),
            check_vma=False,
        )
    )
    got = step(params, state, jax.random.key(100), batch)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), want[:2], got)


def test_ekfac_on_devices_takes_the_single_device_steps():
    """EKFAC's statistics (in the basis every device holds) average over the devices,
    and its refresh (eigendecompositions, a unit of its own) is shared: `pmap` takes the
    single-device steps."""
    kwargs = dict(SIMPLE, curvature_block="ekfac", inverse_update_period=1)
    with jax.enable_x64(True):  # eigenvectors of close eigenvalues: compare in float64
        params, batch = _x64((make_params(), make_batch(n=32)))
        want = jax.device_get(_run_single(params, batch, 3, **kwargs)[:2])
        got = jax.device_get(_run_pmap(params, batch, 3, **kwargs)[:2])
    assert isinstance(got[1].estimator_state.blocks[0].cache, kfacx.blocks.EKFACCache)
    assert got[0]["w1"].dtype == np.float64
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-8, atol=1e-11), want, got)
