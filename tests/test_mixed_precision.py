"""Mixed precision: bfloat16 / float16 parameters with float32 curvature.

The policy (``docs/numerics.md``): statistics, factors, caches and inverses are
float32 (`kfacx.blocks.CurvatureBlock.dtype` promotes the parameters' dtype);
products are cast back to the dtype of the vector (the parameters'), so updates
and parameters keep their dtype.
"""

from __future__ import annotations

import functools

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from blocks import _cases as C

import kfacx
from kfacx import blocks

LOW = [jnp.bfloat16, jnp.float16]

# ----------------------------------------------------------------------------- Optimizer

_net = hk.without_apply_rng(hk.transform(lambda x: hk.nets.MLP([16, 3])(x)))


def _loss_fn(params, batch):
    x, labels = batch
    logits = kfacx.register_softmax_cross_entropy_loss(_net.apply(params, x), labels)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))


def _batch(dtype):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 8)).astype(np.float32)
    labels = ((x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 0)).astype(np.int32)
    return jnp.asarray(x, dtype), jnp.asarray(labels)


def _finite(tree) -> bool:
    return all(
        bool(np.all(np.isfinite(np.asarray(x, np.float32))))
        for x in jax.tree.leaves(tree)
        if jnp.issubdtype(x.dtype, jnp.floating)
    )


@functools.cache
def _train(dtype, exact: bool, steps: int = 6):
    """``(params, state, losses)`` after ``steps`` Optimizer steps on a [16, 3] MLP whose
    parameters and inputs are ``dtype``."""
    batch = _batch(dtype)
    if exact:  # Fixed learning rate, momentum and damping: a smaller program to compile.
        options = dict(learning_rate_schedule=0.3, momentum_schedule=0.5, damping_schedule=0.1)
    else:
        options = dict(
            use_adaptive_learning_rate=True,
            use_adaptive_momentum=True,
            use_adaptive_damping=True,
            initial_damping=1.0,
        )
    optimizer = kfacx.Optimizer(
        jax.value_and_grad(_loss_fn),
        l2_reg=1e-5,
        curvature=kfacx.CurvatureConfig(inverse_update_period=1, use_exact_inverses=exact),
        **options,
    )
    key = jax.random.key(0)
    params = jax.tree.map(lambda p: p.astype(dtype), _net.init(key, batch[0][:1]))
    state = optimizer.init(params, key, batch)
    losses = []
    for _ in range(steps):
        key, step_key = jax.random.split(key)
        params, state, stats = optimizer.step(params, state, step_key, batch)
        # By design rho is NaN on the steps without damping adaptation, and the quadratic
        # model change without an adaptive learning rate.
        nan_by_design = {"rho", "quad_model_change"}
        assert _finite({k: v for k, v in stats.items() if k not in nan_by_design}), stats
        assert not bool(stats["skipped"]), stats
        losses.append(float(stats["loss"]))
    return params, state, losses


@pytest.mark.parametrize(
    ("dtype", "exact"), [(jnp.bfloat16, False), (jnp.float16, True)], ids=["bf16", "f16_exact"]
)
def test_optimizer_low_precision_params(dtype, exact):
    """The Optimizer on a low-precision MLP: the curvature state is float32, the parameters
    (and the velocities) keep their dtype, everything is finite, and the loss decreases."""
    params, state, losses = _train(dtype, exact)
    assert {p.dtype for p in jax.tree.leaves(params)} == {jnp.dtype(dtype)}
    assert {v.dtype for v in jax.tree.leaves(state.velocities)} == {jnp.dtype(dtype)}
    curvature = [
        x for x in jax.tree.leaves(state.estimator_state) if jnp.issubdtype(x.dtype, jnp.floating)
    ]
    assert curvature and {x.dtype for x in curvature} == {jnp.dtype(jnp.float32)}
    assert _finite(params) and _finite(state)
    assert losses[-1] < 0.8 * losses[0], losses


# ----------------------------------------------------------------------------- blocks

CONFIGS = [(p, e, u) for e in (True, False) for p in (-1.0, -0.5) for u in (False, True)]
BLOCK_CASES = [
    C.dense_case("dense_kf", (2, 6), 3, True),  # Rank-deficient: 2 rows, 7 inputs.
    C.conv_case("conv_kf", (1, 2, 5), (3, 2, 3), True),
    C.scale_and_shift_case("ss_full", (2, 4), (4,), (4,), blocks.ScaleAndShiftFull),
    C.dense_case("diag", (2, 4), 3, True, blocks.Diagonal),
]
TOL = {jnp.bfloat16: 3e-2, jnp.float16: 5e-3}


@functools.cache
def _block_run(case, dtype):
    """``(fit, program)`` of the block of ``case`` with ``dtype`` parameters, jitted."""
    block = case.block(dtype)

    def fit(data):
        state = block.init(jax.random.key(0), (-1.0, -0.5), (-1.0, -0.5))
        return block.update_curvature_matrix_estimate(state, data, 0.0, 1.0, case.batch_size)

    def program(state, vector, damping):
        state = block.update_cache(state, damping)
        return state, [block.multiply_matpower(state, vector, damping, *c) for c in CONFIGS]

    return C.fast_jit(fit), C.fast_jit(program)


def _reference(case, block, state, vector, damping, config) -> tuple[np.ndarray, bool]:
    """``(product, in matrix layout)``: the float64 product of a float32 block's state
    (pi-damped factors for the Kronecker approximate powers, else exact)."""
    power, exact, _ = config
    if case.is_kronecker and not exact:
        return C.pi_damped_reference(block, state, vector, damping, power), True
    flat = np.asarray(np.asarray(C.flat(vector), np.float32), np.float64)
    return C.dense_matpower(C.state_dense(block, state), damping, power) @ flat, False


@pytest.mark.parametrize("dtype", LOW, ids=["bf16", "f16"])
@pytest.mark.parametrize("case", BLOCK_CASES, ids=[c.name for c in BLOCK_CASES])
def test_block_dtypes(case, dtype):
    """Low-precision parameters and data: float32 factors and cache, products in the
    parameters' dtype equal to the float64 products of a float32 block's statistics of
    the same (rounded) data; with damping 1e-12 the products are finite (float16
    saturates at 65504, no Inf)."""
    block = case.block(dtype)
    assert block.dtype == jnp.float32
    data, vector = case.data(dtype=dtype), case.vector(dtype=dtype)
    fit, program = _block_run(case, dtype)
    state = fit(data)
    assert {x.dtype for x in jax.tree.leaves(state)} == {jnp.dtype(jnp.float32)}

    # Cast on the host: an eager astype compiles a conversion per shape.
    up = functools.partial(jax.tree.map, lambda x: jnp.asarray(np.asarray(x, np.float32)))
    block32 = case.block(jnp.float32)
    state32 = _block_run(case, jnp.float32)[0](up(data))
    for damping in (0.1, 1e-12):
        new, outs = program(state, vector, damping)
        assert {x.dtype for x in jax.tree.leaves(new.cache)} <= {jnp.dtype(jnp.float32)}
        assert _finite(new.cache)
        for config, out in zip(CONFIGS, outs, strict=True):
            assert {o.dtype for o in out} == {jnp.dtype(dtype)}, config
            assert _finite(out), (damping, config)
        if damping == 0.1:
            for config, out in zip(CONFIGS, outs, strict=True):
                want, matrix = _reference(case, block32, state32, vector, damping, config)
                got = C.to_matrix_layout(block32, out) if matrix else C.flat(out)
                C.assert_close_rel(got, want, TOL[dtype], f"{config}")
        elif dtype == jnp.float16 and case.name != "diag":
            # Null-space directions get ~1 / floor >> 65504: saturated, not Inf.
            big = max(float(np.abs(np.asarray(o, np.float32)).max()) for o in outs[0])
            assert big == float(jnp.finfo(jnp.float16).max)


def test_optimizer_float16_quadratic_model_does_not_overflow():
    """float16 parameters with a loss of size ~300: the quadratic model's curvature sums
    exceed 65504, but the adaptive learning rate of the first step is still finite and
    positive (as with float32 parameters)."""
    dtype = jnp.float16
    batch = _batch(dtype)

    def loss_fn(params, batch):
        return 300.0 * _loss_fn(params, batch)

    optimizer = kfacx.Optimizer(
        jax.value_and_grad(loss_fn),
        use_adaptive_learning_rate=True,
        use_adaptive_momentum=True,
        use_adaptive_damping=True,
        initial_damping=1.0,
    )
    key = jax.random.key(0)
    params = jax.tree.map(lambda p: p.astype(dtype), _net.init(key, batch[0][:1]))
    state = optimizer.init(params, key, batch)
    _, _, stats = optimizer.step(params, state, key, batch)
    assert np.isfinite(float(stats["quad_model_change"])), stats
    assert float(stats["learning_rate"]) > 0, stats
