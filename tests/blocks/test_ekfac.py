"""`DenseEKFAC`, `ConvEKFAC` and `EmbeddingEKFAC` against the definition of EKFAC, in float64.

The reference never uses the blocks' statistics code: every example's gradient for
every sample, ``G[s, b]``, is the parameter gradient of the layer at that example
(`jax.vjp`, summing its positions by itself), put in the block's matrix layout with
`_cases.kronecker_positions`. With the eigenbasis ``U_A``, ``U_G`` of the block's
cache, the scaling is ``S = sum_{s, b} (U_A^T G[s, b] U_G)^2 / B`` and the curvature
``Q diag(S) Q^T`` with ``Q = U_A (x) U_G`` per group; the exact Fisher of the same
gradients is ``F = sum_{s, b} vec(G) vec(G)^T / B``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfacx
from kfacx import blocks

from . import _cases as C

F64 = jnp.float64
NHWC = ("NHWC", "HWIO", "NHWC")
DAMPING = 0.3
TOL = 1e-10

CASES = [
    C.dense_case("dense_bias", (6, 4), 3, True, blocks.DenseEKFAC),
    # Sequence positions and two output axes (einsum("btd,dhk->bthk")), no bias.
    C.dense_case(
        "dense_seq_multihead", (3, 2, 4), None, False, blocks.DenseEKFAC, w_shape=(4, 2, 3)
    ),
    # Bias, two feature groups, stride, SAME padding, channels last.
    C.conv_case(
        "conv2d_groups_bias_nhwc",
        (2, 4, 4, 4),
        (2, 2, 2, 4),
        True,
        blocks.ConvEKFAC,
        window_strides=(2, 1),
        padding="SAME",
        feature_group_count=2,
        dimension_numbers=NHWC,
    ),
]
IDS = [c.name for c in CASES]
KFAC_OF = {blocks.DenseEKFAC: blocks.DenseTwoKroneckerFactored, blocks.ConvEKFAC: C.CONV}


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


# ----------------------------------------------------------------------------- references


def layout_shape(block) -> tuple[int, int, int]:
    return block.num_groups, block.input_size, block.output_size


def example_gradients(case: C.Case, block, data) -> np.ndarray:
    """``G [samples, batch, groups, n, m]``: every example's gradient, in matrix layout."""
    (x,), params, (dy,) = data["inputs"], data["params"], data["outputs_tangent"]

    def grad(xb, dyb):
        _, vjp = jax.vjp(lambda p: case.tag.compute((xb[None],), p, **case.meta)[0], params)
        return blocks.flatten_params(vjp(dyb[None])[0])

    flat = np.asarray(C.fast_jit(jax.vmap(jax.vmap(grad), in_axes=(None, 0)))(x, dy))
    return (flat @ C.kronecker_positions(block)).reshape(*flat.shape[:2], *layout_shape(block))


def fisher(case: C.Case, g: np.ndarray) -> np.ndarray:
    """``sum_{s, b} vec(G) vec(G)^T / B`` over the flattened parameters."""
    flat = g.reshape(-1, g[0, 0].size) @ C.kronecker_positions(case.block(F64)).T
    return flat.T @ flat / case.batch_size


def rotated_scaling(g: np.ndarray, u_a: np.ndarray, u_g: np.ndarray, batch: int) -> np.ndarray:
    """``sum_{s, b} (U_A^T G U_G)^2 / B`` per group."""
    rotated = np.einsum("gia,sbgij,gjc->sbgac", u_a, g, u_g)
    return np.sum(rotated**2, axis=(0, 1)) / batch


def ekfac_dense(block, u_a: np.ndarray, u_g: np.ndarray, scaling: np.ndarray) -> np.ndarray:
    """``block_diag_g(Q diag(S) Q^T)`` over the flattened parameters."""
    per_group = []
    for a, g, s in zip(u_a, u_g, scaling, strict=True):
        q = np.kron(a, g)
        per_group.append((q * s.reshape(-1)) @ q.T)
    size = sum(p.shape[0] for p in per_group)
    big, o = np.zeros((size, size)), 0
    for p in per_group:
        big[o : o + p.shape[0], o : o + p.shape[0]] = p
        o += p.shape[0]
    pos = C.kronecker_positions(block)
    return pos @ big @ pos.T


def close(actual, expected, what: str, tol: float = TOL) -> None:
    """``||actual - expected|| <= tol ||expected||`` (Frobenius), both float64."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.dtype == expected.dtype == np.float64, what
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    err, scale = np.linalg.norm(actual - expected), max(np.linalg.norm(expected), 1e-300)
    assert err <= tol * scale, f"{what}: relative error {err / scale:.3g} > {tol:.3g}"


@functools.cache
def jitted(block, batch_size: int | None = None):
    """The block's update, refresh, statistics and dense matrix, jitted once per block
    (``batch_size``: the normaliser, by default the cotangents' batch axis)."""

    def batch(data) -> int:
        return batch_size or data["outputs_tangent"][0].shape[1]

    def update(state, data, old, new):
        return block.update_curvature_matrix_estimate(state, data, old, new, batch(data))

    return dict(
        update=C.fast_jit(update),
        refresh=C.fast_jit(lambda s: block.update_cache(s, DAMPING)),
        stats=C.fast_jit(lambda d, s: block.compute_statistics(d, batch(d), state=s)),
        dense=C.fast_jit(block.to_dense_matrix),
    )


@functools.cache
def refreshed(case: C.Case):
    """``(block, state, data)``: one update with ``data`` (seed 1), then a refresh, so the
    basis is the eigenbasis of the K-FAC factors of ``data`` and the scaling is its
    statistic re-expressed in that basis."""
    block = case.block(F64)
    fns = jitted(block)
    data = case.data(seed=1, dtype=F64)
    state = fns["update"](block.init(jax.random.key(0)), data, 0.0, 1.0)
    return block, fns["refresh"](state), data


# ----------------------------------------------------------------------------- statistics


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_scaling_is_the_rotated_per_example_gradients_squared(case):
    """``S = sum (U_A^T G U_G)^2 / B`` for a new batch, in the basis of the cache (the
    eigenvectors of the factors), the per-example gradients summed over positions."""
    block, state, _ = refreshed(case)
    (a, g), cache = (f.value for f in state.factors), state.cache
    for factor, basis in ((a, cache.inputs_basis), (g, cache.outputs_basis)):
        rotated = np.einsum("gia,gij,gjb->gab", basis, factor, basis)
        diag = np.einsum("gii->gi", rotated)
        close(rotated, np.stack([np.diag(d) for d in diag]), "the basis diagonalises the factor")
    data = case.data(seed=2, dtype=F64)
    stats = jitted(block)["stats"](data, state)
    g = example_gradients(case, block, data)
    expected = rotated_scaling(
        g, np.asarray(cache.inputs_basis), np.asarray(cache.outputs_basis), case.batch_size
    )
    close(stats[2], expected, "scaling")
    kfac = KFAC_OF[type(block)](block.layer)
    for got, want in zip(stats[:2], C.jit_statistics(kfac)(data, case.batch_size), strict=True):
        close(got, want, "K-FAC's factors")


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_before_the_first_refresh_the_curvature_is_the_diagonal_fisher(case):
    """The basis starts as the identity: the scaling is the diagonal of the exact Fisher."""
    block = case.block(F64)
    data = case.data(seed=3, dtype=F64)
    state = jitted(block)["update"](block.init(jax.random.key(0)), data, 0.0, 1.0)
    exact = fisher(case, example_gradients(case, block, data))
    close(jitted(block)["dense"](state), np.diag(np.diag(exact)), "dense matrix")


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_with_exact_scaling_ekfac_is_at_least_as_close_to_the_fisher_as_kfac(case):
    """George et al.'s result: in K-FAC's eigenbasis, the scaling of the same batch is the
    Frobenius-optimal diagonal, so EKFAC is nearer to the exact Fisher than K-FAC."""
    block, state, data = refreshed(case)
    state = jitted(block)["update"](state, data, 0.0, 1.0)  # the scaling of this batch
    g = example_gradients(case, block, data)
    exact = fisher(case, g)
    u_a, u_g = np.asarray(state.cache.inputs_basis), np.asarray(state.cache.outputs_basis)
    expected = ekfac_dense(block, u_a, u_g, rotated_scaling(g, u_a, u_g, case.batch_size))
    ekfac = np.asarray(jitted(block)["dense"](state))
    close(ekfac, expected, "EKFAC's dense matrix")
    kfac_block = KFAC_OF[type(block)](block.layer)
    kfac = C.kronecker_dense(kfac_block, *(f.value for f in state.factors))
    err_ekfac, err_kfac = np.linalg.norm(ekfac - exact), np.linalg.norm(kfac - exact)
    assert err_ekfac < 0.99 * err_kfac, (err_ekfac, err_kfac)
    # Optimal among Q D Q^T: its diagonal in the basis is the Fisher's.
    q_pos = C.kronecker_positions(block)
    for i, (a, gg) in enumerate(zip(u_a, u_g, strict=True)):
        q = np.kron(a, gg)
        size = q.shape[0]
        rows = q_pos[:, i * size : (i + 1) * size]
        close(
            np.diag(q.T @ rows.T @ exact @ rows @ q),
            np.asarray(state.cache.scaling.value[i]).ravel(),
            "diag",
        )


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_a_refresh_re_expresses_the_scaling_in_the_new_basis(case):
    """After a refresh the scaling is the diagonal, in the new basis, of the curvature the
    old basis and scaling described; the moving average keeps its weight."""
    block, state, _ = refreshed(case)
    fns = jitted(block)
    state = fns["update"](state, case.data(seed=4, dtype=F64), 0.5, 0.5)
    before = np.asarray(fns["dense"](state))
    new = fns["refresh"](state)
    q_pos = C.kronecker_positions(block)
    u_a, u_g = np.asarray(new.cache.inputs_basis), np.asarray(new.cache.outputs_basis)
    in_layout = q_pos.T @ before @ q_pos
    size = u_a.shape[1] * u_g.shape[1]
    for i, (a, g) in enumerate(zip(u_a, u_g, strict=True)):
        q = np.kron(a, g)
        sub = in_layout[i * size : (i + 1) * size, i * size : (i + 1) * size]
        close(np.asarray(new.cache.scaling.value[i]).ravel(), np.diag(q.T @ sub @ q), "projected")
    assert float(new.cache.scaling.weight) == float(state.cache.scaling.weight)
    assert not np.allclose(u_a, np.asarray(state.cache.inputs_basis))


def test_padding_examples_add_nothing():
    """A masked example (zero cotangents) changes no statistic, whatever its inputs; a
    non-finite input stays out of the scaling."""
    case = CASES[1]
    block, state, _ = refreshed(case)
    data = case.data(seed=5, dtype=F64)
    (x,), (dy,) = data["inputs"], data["outputs_tangent"]
    stats = jitted(block, case.batch_size)["stats"]
    real = stats(data, state)
    for fill, checked in ((1e3, slice(None)), (jnp.nan, slice(2, 3))):
        padded = dict(
            data,
            inputs=(jnp.concatenate([x, jnp.full_like(x[:1], fill)]),),
            outputs_tangent=(jnp.concatenate([dy, jnp.zeros_like(dy[:, :1])], axis=1),),
            mask=jnp.array([1.0] * x.shape[0] + [0.0]),
        )
        got = stats(padded, state)
        for r, p in zip(real[checked], got[checked], strict=True):
            close(p, r, f"padded with {fill}")


def test_statistics_without_a_state_are_a_clear_error():
    block, _, data = refreshed(CASES[0])
    with pytest.raises(ValueError, match=r"DenseEKFAC\(.*eigenbasis.*state=block_state"):
        block.compute_statistics(data, 6)


# ----------------------------------------------------------------------------- products


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_powers_equal_the_dense_matrix_powers(case):
    """``(C + l I)^p v`` for p in (1, -1, -0.5), exact or not, cached or not: EKFAC's
    damped powers are exact in its basis."""
    block, state, _ = refreshed(case)
    dense = np.asarray(jitted(block)["dense"](state))
    vector = case.vector(dtype=F64)
    flat = np.asarray(C.flat(vector))
    configs = C.EXACT_CONFIGS + C.APPROX_CONFIGS
    run = C.fast_jit(lambda s, v: [block.multiply_matpower(s, v, DAMPING, *c) for c in configs])
    for config, out in zip(configs, run(state, vector), strict=True):
        expected = C.dense_matpower(dense, DAMPING, config[0]) @ flat
        close(C.flat(out), expected, str(config))


def test_block_norms_are_the_dense_matrix_norms():
    block, state, _ = refreshed(CASES[2])
    dense = np.asarray(jitted(block)["dense"](state))
    norms = C.fast_jit(lambda s: [blocks.block_norm(block, s, n) for n in ("trace", "fro")])
    trace, fro = norms(state)
    np.testing.assert_allclose(trace, np.trace(dense), rtol=1e-12)
    np.testing.assert_allclose(fro, np.linalg.norm(dense), rtol=1e-12)


# ----------------------------------------------------------------------------- embedding


def embedding_setup(ids_shape, uses=1):
    """An `EmbeddingEKFAC` of a ``[7, 3]`` table (``uses`` uses folded use-major into the
    batch axis), refreshed once, and a new batch."""
    vocab, width = 7, 3
    rng = np.random.default_rng(0)
    table = jnp.asarray(rng.standard_normal((vocab, width)))
    layer = blocks.LayerInfo.from_params(
        "embedding_tag",
        [table],
        input_shapes=(ids_shape,),
        output_shapes=(ids_shape + (width,),),
        num_uses=uses,
    )
    block = blocks.EmbeddingEKFAC(layer)

    def data(seed):
        r = np.random.default_rng(seed)
        ids = jnp.asarray(r.integers(0, 4, ids_shape))  # repeats within an example
        dy = jnp.asarray(r.standard_normal((2, *ids_shape, width)))
        return dict(inputs=(ids,), outputs=(table[ids],), params=(table,), outputs_tangent=(dy,))

    fns = jitted(block, ids_shape[0] // uses)
    state = fns["refresh"](fns["update"](block.init(jax.random.key(0)), data(1), 0.0, 1.0))
    return block, state, data(2), table


@pytest.mark.parametrize(
    "ids_shape, uses",
    [((5,), 1), ((4, 6), 1), ((6,), 2)],
    ids=["one_position", "sequence", "two_uses"],
)
def test_embedding_scaling_is_the_rotated_per_example_gradients_squared(ids_shape, uses):
    """The input basis is the identity (the factor is diagonal); an example's gradient
    of row ``v`` sums its positions and uses that look ``v`` up (`jax.vjp` of the lookup)."""
    block, state, data, table = embedding_setup(ids_shape, uses)
    examples = ids_shape[0] // uses
    assert state.cache.inputs_basis is None
    (ids,), (dy,) = data["inputs"], data["outputs_tangent"]

    def grad(idb, dyb):
        _, vjp = jax.vjp(lambda t: t[idb], table)
        return vjp(dyb)[0]

    g = C.fast_jit(jax.vmap(jax.vmap(grad), in_axes=(None, 0)))(ids, dy)  # [S, uses * B, V, D]
    g = np.asarray(g).reshape(g.shape[0], uses, examples, *g.shape[2:]).sum(axis=1)
    u_g = np.asarray(state.cache.outputs_basis[0])
    expected = np.sum((g @ u_g) ** 2, axis=(0, 1)) / examples
    fns = jitted(block, examples)
    stats = fns["stats"](data, state)
    close(stats[2][0], expected, "scaling")
    # Powers against the dense matrix Q diag(S) Q^T, Q = I (x) U_G.
    state = fns["update"](state, data, 0.0, 1.0)
    q = np.kron(np.eye(7), u_g)
    dense = (q * np.asarray(state.cache.scaling.value).ravel()) @ q.T
    close(fns["dense"](state), dense, "dense")
    vector = (jnp.asarray(np.random.default_rng(3).standard_normal((7, 3))),)
    powers = (1, -1, -0.5)
    run = C.fast_jit(  # one compilation instead of one per operation run eagerly
        lambda s, v: [block.multiply_matpower(s, v, DAMPING, p, use_cached=True) for p in powers]
    )
    for power, out in zip(powers, run(state, vector), strict=True):
        expected = C.dense_matpower(dense, DAMPING, power) @ np.asarray(vector[0]).ravel()
        close(np.asarray(out[0]).ravel(), expected, f"power {power}")


# ----------------------------------------------------------------------------- stacked


def test_stacked_ekfac_is_each_slice_s_ekfac():
    """A `StackedBlock` of `DenseEKFAC` passes each slice its own state."""
    case = CASES[0]
    stacked, data, slices = C.stacked_two(case, blocks.DenseEKFAC, F64)
    assert stacked.statistics_need_state
    fns = jitted(stacked, case.batch_size)
    state = fns["refresh"](fns["update"](stacked.init(jax.random.key(0)), data, 0.0, 1.0))
    state = fns["update"](state, data, 0.0, 1.0)
    one = case.block(F64)
    for i, d in enumerate(slices):
        s = jitted(one)["refresh"](jitted(one)["update"](one.init(jax.random.key(0)), d, 0.0, 1.0))
        s = jitted(one)["update"](s, d, 0.0, 1.0)
        close(state.cache.scaling.value[i], s.cache.scaling.value, f"slice {i}")


# ----------------------------------------------------------------------------- estimator


def _loss(params, batch):
    x, labels = batch
    h = jnp.tanh(x @ params["w1"])  # [batch, positions, hidden]
    logits = jnp.mean(h, axis=1) @ params["w2"]
    kfacx.register_softmax_cross_entropy_loss(logits, labels)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1))


def test_estimator_needs_the_state_and_optax_finds_it():
    """The statistics need the estimator state (a clear error without it);
    `kfacx.estimator_state` finds it in an optax chain, and the chain trains."""
    rng = np.random.default_rng(0)
    params = {k: jnp.asarray(rng.standard_normal(s)) for k, s in (("w1", (3, 4)), ("w2", (4, 2)))}
    batch = (jnp.asarray(rng.standard_normal((6, 5, 3))), jnp.asarray(rng.integers(0, 2, 6)))
    est = kfacx.BlockDiagonalCurvature(_loss, curvature_block="ekfac")
    tx = optax.chain(kfacx.scale_by_kfac(est, (params, batch), damping=1e-2), optax.sgd(0.1))
    opt_state = tx.init(params)
    with pytest.raises(ValueError, match=r"DenseEKFAC.*\(and 1 more blocks\).*estimator_state"):
        est.value_grads_and_curvature_stats(jax.random.key(0), (params, batch))
    with pytest.raises(ValueError, match="holds 0 scale_by_kfac states"):
        kfacx.estimator_state(optax.sgd(0.1).init(params))

    @jax.jit
    def step(params, opt_state, key):
        state = kfacx.estimator_state(opt_state)
        loss, grads, stats = est.value_grads_and_curvature_stats(
            key, (params, batch), estimator_state=state
        )
        updates, opt_state = tx.update(grads, opt_state, params, curvature_stats=stats)
        return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    for i in range(6):
        params, opt_state, loss = step(params, opt_state, jax.random.key(i))
        losses.append(float(loss))
    assert losses[-1] < losses[0], losses
    assert isinstance(kfacx.estimator_state(opt_state).blocks[0].cache, blocks.EKFACCache)


def test_uses_of_a_layer_count_as_positions_of_the_example():
    """A layer applied 3 times with the same weights (uses folded use-major into the
    batch axis, as the tracer does for a scan closing over them): an example's gradient
    sums its uses, and the scaling is taken from those sums."""
    case = C.dense_case("uses", (12, 4), 3, True, blocks.DenseEKFAC)
    block = blocks.DenseEKFAC(dataclasses.replace(case.layer(F64), num_uses=3))
    fns = jitted(block, 4)
    state = fns["refresh"](fns["update"](block.init(jax.random.key(0)), case.data(1, F64), 0, 1))
    data = case.data(seed=2, dtype=F64)
    g = example_gradients(case, block, data)  # [S, uses * examples, ...]
    g = g.reshape(g.shape[0], 3, 4, *g.shape[2:]).sum(axis=1)
    u_a, u_g = np.asarray(state.cache.inputs_basis), np.asarray(state.cache.outputs_basis)
    close(fns["stats"](data, state)[2], rotated_scaling(g, u_a, u_g, 4), "scaling")


def test_statistics_average_over_devices_and_micro_batches_like_the_full_batch():
    """The scaling is a mean over examples, in the basis all devices share: statistics
    of two halves (micro-batches) average to the full batch's, and a `pmap` update over
    4 devices gives every device the full batch's state (``ggn_exact``: no sampling)."""
    rng = np.random.default_rng(1)
    params = {k: jnp.asarray(rng.standard_normal(s)) for k, s in (("w1", (3, 4)), ("w2", (4, 2)))}
    x, t = jnp.asarray(rng.standard_normal((8, 5, 3))), jnp.asarray(rng.integers(0, 2, 8))
    est = kfacx.BlockDiagonalCurvature(
        _loss, curvature_block="ekfac", default_estimation_mode="ggn_exact"
    )
    key = jax.random.key(0)
    state = est.init(key, (params, (x[:2], t[:2])))

    @jax.jit
    def single_update(state):
        return est.update_curvature_matrix_estimate(state, 0.0, 1.0, None, key, (params, (x, t)))

    # A non-trivial basis: one update and a refresh.
    state = jax.jit(est.update_cache)(single_update(state), 0.1)

    @jax.jit
    def stats(x, t):
        return est.compute_curvature_stats(key, (params, (x, t)), estimator_state=state).blocks

    full = stats(x, t)
    halves = [stats(x[i : i + 4], t[i : i + 4]) for i in (0, 4)]
    for f, a, b in zip(jax.tree.leaves(full), *map(jax.tree.leaves, halves), strict=True):
        close((a + b) / 2, f, "micro-batches")

    def update(x, t):
        return est.update_curvature_matrix_estimate(
            state, 0.0, 1.0, None, key, (params, (x, t)), pmap_axis_name="i"
        )

    states = jax.pmap(update, axis_name="i")(x.reshape(4, 2, 5, 3), t.reshape(4, 2))
    dense = jax.jit(est.to_dense_matrix)
    want = dense(single_update(state))
    for d in (0, 3):
        close(dense(jax.tree.map(lambda leaf, d=d: leaf[d], states)), want, f"device {d}")
