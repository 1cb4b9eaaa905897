"""The bad-input catalogue: each case is either a clear error (naming the argument or
the parameter path and saying how to fix it) or a finite, documented result, and in
every non-error case the parameters and every leaf of the `OptimizerState` stay finite.

docs/quickstart.md ("What happens with bad input") lists the same cases.
"""

import functools
import gc
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from _optimizer_cases import make_batch, make_params, mlp_loss

import kfacx
from kfacx._helpers import _checks

NAN, INF = float("nan"), float("inf")
FIXED = dict(
    learning_rate_schedule=0.1,
    initial_damping=1e-2,
    estimation_mode="fisher_empirical",
    num_burnin_steps=0,
)


def _opt(loss=mlp_loss, **kwargs):
    return kfacx.Optimizer(jax.value_and_grad(loss), **{**FIXED, **kwargs})


@functools.cache
def _shared():
    """One optimizer, compiled once for the 32-example batch, shared by the tests."""
    opt = _opt()
    params, batch = make_params(), make_batch()
    return opt, params, batch, opt.init(params, jax.random.key(0), batch)


def _leaves_finite(tree):
    # on the host: an eager jnp.isfinite compiles a program per leaf shape and dtype
    return all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(tree))


def _step(opt, params, state, batch, seed=1, **kwargs):
    return opt.step(params, state, jax.random.key(seed), batch, **kwargs)


def _assert_normal_step(params, state, new_params, new_state, stats):
    assert not bool(stats["skipped"])
    assert _leaves_finite((new_params, new_state)), "a normal step must leave everything finite"
    assert int(new_state.step_counter) == int(state.step_counter) + 1
    assert jax.tree.structure(new_params) == jax.tree.structure(params)


def _assert_skipped(params, state, new_params, new_state, stats):
    assert bool(stats["skipped"])
    jax.tree.map(np.testing.assert_array_equal, (new_params, new_state), (params, state))
    assert _leaves_finite((new_params, new_state))


# ----------------------------------------------------------------------------- the batch


@pytest.mark.parametrize("bad", [NAN, INF, -INF], ids=["nan", "inf", "-inf"])
def test_non_finite_batch_skips_the_step_and_the_next_batch_steps_normally(bad):
    opt, params, (x, y), state = _shared()
    p1, s1, stats = _step(opt, params, state, (x, y))
    _assert_normal_step(params, state, p1, s1, stats)
    x_bad = np.array(x)
    x_bad[3, 2] = bad
    p2, s2, stats = _step(opt, p1, s1, (jnp.asarray(x_bad), y), seed=2)
    _assert_skipped(p1, s1, p2, s2, stats)
    p3, s3, stats = _step(opt, p2, s2, (x, y), seed=3)
    _assert_normal_step(p2, s2, p3, s3, stats)
    assert int(s3.step_counter) == 2


def test_all_zero_inputs_give_a_finite_step():
    """Zero inputs: the first layer's input factor is zero but for the bias; logits are the
    (zero) output bias, so the loss is log(3)."""
    opt, params, (x, y), state = _shared()
    new_params, new_state, stats = _step(opt, params, state, (jnp.zeros_like(x), y))
    _assert_normal_step(params, state, new_params, new_state, stats)
    np.testing.assert_allclose(stats["loss"], np.log(3.0), rtol=1e-6)
    # w1 gets no gradient from zero inputs, so it (practically) does not move.
    np.testing.assert_allclose(new_params["w1"], params["w1"], atol=1e-6)


def test_empty_batch_is_a_clear_error_at_init_and_at_step():
    opt, params, (x, y), state = _shared()
    empty = (x[:0], y[:0])
    with pytest.raises(ValueError, match=r"batch\[0\] has shape \(0, 5\): the batch is empty"):
        _opt().init(params, jax.random.key(0), empty)
    with pytest.raises(ValueError, match="the batch is empty.*example_mask_extractor"):
        _step(opt, params, state, empty)


def test_empty_batch_per_device_is_a_clear_error_at_init():
    opt = _opt(multi_device=True)
    params = kfacx.parallel.replicate_all_local_devices(make_params())
    batch = (jnp.zeros((4, 0, 5)), jnp.zeros((4, 0), jnp.int32))
    with pytest.raises(ValueError, match=r"no examples along axis 1"):
        opt.init(params, jax.random.key(0), batch)


def test_batch_of_one_example_gives_a_finite_step_with_rank_one_factors(monkeypatch):
    """Also: a batch shaped unlike init's just compiles the step again, and the state
    check runs when the step is traced, not at every step."""
    calls = []
    check = _checks.check_state
    monkeypatch.setattr(_checks, "check_state", lambda *a: calls.append(1) or check(*a))
    opt, params, (x, y), state = _shared()
    one = (x[:1], y[:1])
    new_params, new_state, stats = _step(opt, params, state, one)
    _assert_normal_step(params, state, new_params, new_state, stats)
    assert int(new_state.data_seen) == 1
    for block in new_state.estimator_state.blocks:  # one step: the factors are x x^T, g g^T
        for factor in block.factors:
            assert np.linalg.matrix_rank(np.asarray(factor.value[0]), tol=1e-6) == 1
    for i in range(2):
        new_params, new_state, stats = _step(opt, new_params, new_state, one, seed=i)
        assert not bool(stats["skipped"]) and _leaves_finite((new_params, new_state))
    assert len(calls) == 1


# ----------------------------------------------------------------------------- parameters


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.bool_])
def test_integer_parameters_are_a_type_error_naming_the_path(dtype):
    params, batch = make_params(), make_batch()
    params = dict(params, b1=params["b1"].astype(dtype))
    with pytest.raises(TypeError, match=r"Parameter 'b1' has dtype .*floating-point.*batch"):
        _opt().init(params, jax.random.key(0), batch)


def test_bf16_parameters_stay_bf16_and_finite():
    params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), make_params())
    batch = make_batch()
    opt = _opt()
    state = opt.init(params, jax.random.key(0), batch)
    p = params
    for i in range(3):
        new_p, new_state, stats = _step(opt, p, state, batch, seed=i)
        _assert_normal_step(p, state, new_p, new_state, stats)
        p, state = new_p, new_state
    assert {a.dtype for a in jax.tree.leaves((p, state.velocities))} == {jnp.dtype(jnp.bfloat16)}
    assert not jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.all(a == b)), p, params))


@pytest.mark.filterwarnings("ignore:kfacx. no layer pattern matched")
@pytest.mark.parametrize("l2_reg,added", [(0.0, False), (1e-2, False), (1e-2, True)])
def test_parameter_not_used_by_the_loss_warns_and_is_left_unchanged(l2_reg, added):
    """It gets a zero gradient and a zero-curvature diagonal block, so its update is zero;
    with an added l2_reg term, weight decay still applies: p -= lr * l2 p / (damping + l2)."""
    params = dict(make_params(), extra=jnp.arange(3.0))
    batch = make_batch()
    opt = _opt(l2_reg=l2_reg, add_l2_reg=added)  # mlp_loss reads w1, b1, w2, b2 only
    with pytest.warns(UserWarning, match=r"\['extra'\] are not used by the loss"):
        state = opt.init(params, jax.random.key(0), batch)
    new_params, new_state, stats = _step(opt, params, state, batch)
    _assert_normal_step(params, state, new_params, new_state, stats)
    assert not np.allclose(new_params["w1"], params["w1"])
    decay = l2_reg if added else 0.0
    want = params["extra"] * (1.0 - 0.1 * decay / (1e-2 + l2_reg))
    np.testing.assert_allclose(new_params["extra"], want, rtol=1e-6)
    if not added:
        np.testing.assert_array_equal(new_params["extra"], params["extra"])


def test_parameters_used_by_the_loss_do_not_warn():
    params, batch = make_params(), make_batch()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _opt().init(params, jax.random.key(0), batch)
    assert _checks.unused_params(mlp_loss, (params, batch)) == []


def _relu_loss(params, batch):
    x, y = batch
    h = jax.nn.relu(x @ params["w1"] + params["b1"][None, :])
    logits = h @ params["w2"] + params["b2"][None, :]
    kfacx.register_softmax_cross_entropy_loss(logits, y)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y))


@pytest.mark.parametrize("exact", [False, True], ids=["pi_damping", "exact_inverses"])
def test_exactly_zero_factors_give_a_finite_step(exact):
    """All ReLU units dead (the first layer's output factor and the second layer's input
    factor are zero but for the bias) and an input feature that is always 0."""
    params = dict(make_params(), b1=jnp.full(8, -1e3))
    x, y = make_batch()
    batch = (x.at[:, 2].set(0.0), y)
    opt = _opt(_relu_loss, use_exact_inverses=exact)
    state = opt.init(params, jax.random.key(0), batch)
    new_params, new_state, stats = _step(opt, params, state, batch)
    _assert_normal_step(params, state, new_params, new_state, stats)
    first = new_state.estimator_state.blocks[0]
    np.testing.assert_array_equal(first.factors[1].value, 0.0)  # dead units: no cotangent
    # Dead units: no gradient, no move; the output layer learns its bias.
    np.testing.assert_array_equal(new_params["w1"], params["w1"])
    np.testing.assert_array_equal(new_params["b1"], params["b1"])
    assert not np.allclose(new_params["b2"], params["b2"])


# ----------------------------------------------------------------------------- damping


@pytest.mark.parametrize("value", [0.0, -1.0, NAN])
def test_bad_initial_damping_is_a_clear_error(value):
    with pytest.raises(ValueError, match="initial_damping must be positive"):
        _opt(initial_damping=value)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(damping=0.0), r"step\(damping=0.0\): the damping must be finite and > 0"),
        (dict(damping=-1.0), r"step\(damping=-1.0\): the damping must be finite and > 0"),
        (dict(damping=NAN), r"step\(damping=nan\)"),
        (dict(damping=np.float32(INF)), r"step\(damping=.*inf.*must be finite"),
        (dict(learning_rate=NAN), r"step\(learning_rate=nan\): learning_rate must be finite"),
        (dict(momentum=INF), r"step\(momentum=inf\): momentum must be finite"),
    ],
)
def test_bad_concrete_step_values_are_clear_errors(kwargs, match):
    opt, params, batch, state = _shared()
    with pytest.raises(ValueError, match=match):
        _step(opt, params, state, batch, **kwargs)


def _lookup(values, step):
    return values[step]


@functools.cache
def _scheduled():
    """Schedules read a table at the global step, so one compiled step covers every value."""
    table = dict(
        damping=[1e-2, 0.0, -1.0, NAN, 1e-2, 1e-2, 1e-2, 1e-2],
        learning_rate=[0.1, 0.1, 0.1, 0.1, NAN, INF, 0.1, 0.1],
        momentum=[0.5, 0.5, 0.5, 0.5, 0.5, 0.5, NAN, 0.5],
    )
    at = {k: functools.partial(_lookup, jnp.asarray(v)) for k, v in table.items()}
    opt = _opt(
        initial_damping=None,
        damping_schedule=at["damping"],
        learning_rate_schedule=at["learning_rate"],
        momentum_schedule=at["momentum"],
    )
    params, batch = make_params(), make_batch()
    state = opt.init(params, jax.random.key(0), batch)
    # One good step first, so the velocity (momentum direction) is not zero.
    params, state, stats = _step(opt, params, state, batch, global_step_int=0)
    assert not bool(stats["skipped"])
    return opt, params, batch, state


@pytest.mark.parametrize(
    "global_step",
    [1, 2, 3, 4, 5, 6],
    ids=[
        "damping_0",
        "damping_negative",
        "damping_nan",
        "learning_rate_nan",
        "learning_rate_inf",
        "momentum_nan",
    ],
)
def test_schedule_with_a_bad_value_skips_the_step(global_step):
    opt, params, batch, state = _scheduled()
    new_params, new_state, stats = _step(opt, params, state, batch, global_step_int=global_step)
    _assert_skipped(params, state, new_params, new_state, stats)
    # And the next good value steps normally.
    new_params, new_state, stats = _step(opt, new_params, new_state, batch, global_step_int=7)
    _assert_normal_step(params, state, new_params, new_state, stats)


def test_bad_damping_as_a_jax_array_skips_the_step():
    """A `jax.Array` is not read on the host (that would wait for the device): a bad one
    is caught by the step's guard instead."""
    opt, params, batch, state = _shared()
    for value in (0.0, -1.0, NAN):
        new = _step(opt, params, state, batch, damping=jnp.asarray(value))
        _assert_skipped(params, state, *new)
    new = _step(opt, params, state, batch, damping=jnp.asarray(1e-2))
    _assert_normal_step(params, state, *new)


def test_missing_learning_rate_is_a_clear_error():
    params, batch = make_params(), make_batch()
    opt = _opt(learning_rate_schedule=None)
    state = opt.init(params, jax.random.key(0), batch)
    with pytest.raises(ValueError, match="No learning rate: pass learning_rate= to step"):
        _step(opt, params, state, batch)


# ----------------------------------------------------------------------------- the state


@functools.cache
def _other_state(dh=6):
    """A state made by init for an MLP with another hidden width (made once: three tests
    use it)."""
    return _opt().init(make_params(dh=dh), jax.random.key(0), make_batch())


def test_state_of_another_model_is_a_clear_error_naming_the_leaf():
    opt, params, batch, _ = _shared()
    with pytest.raises(
        ValueError,
        match=r"does not belong to this model: state\.velocities\['b1'\] has shape \(6,\) .* "
        r"needs \(8,\).*optimizer\.init\(params, rng, batch\)",
    ):
        _step(opt, params, _other_state(), batch)


def test_curvature_state_of_another_model_is_a_clear_error_naming_the_block():
    opt, params, batch, state = _shared()
    mixed = _other_state()._replace(velocities=state.velocities)
    with pytest.raises(
        ValueError,
        match=r"state\.estimator_state\.blocks\[0\]\.factors\[1\]\.raw_value "
        r"\(block 0: DenseTwoKroneckerFactored\(dense_tag\[w1, b1\]\)\) has shape \(1, 6, 6\)",
    ):
        _step(opt, params, mixed, batch)


def test_state_of_another_configuration_is_a_clear_error():
    """Exact inverses cache eigendecompositions, not inverses: another state layout."""
    opt, params, batch, _ = _shared()
    exact = _opt(use_exact_inverses=True).init(params, jax.random.key(0), batch)
    with pytest.raises(ValueError, match=r"state\.estimator_state\.blocks\[0\]\.cache\..*block 0"):
        _step(opt, params, exact, batch)


def test_params_unlike_init_params_are_a_clear_error():
    """Params given to step with another structure or dtype than those given to init."""
    opt, params, batch, state = _shared()
    with pytest.raises(ValueError, match=r"state\.velocities\['b1'\] has .* dtype float32, but"):
        _step(opt, jax.tree.map(lambda a: a.astype(jnp.bfloat16), params), state, batch)
    extra = dict(params, extra=jnp.zeros(3))
    with (
        pytest.warns(UserWarning, match=r"no layer pattern matched parameters \['extra'\]"),
        pytest.raises(ValueError, match=r"state\.velocities\['extra'\] is missing"),
    ):
        _step(opt, extra, state, batch)


# orbax leaves the failed reads' futures behind; their errors surface when they are collected.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_orbax_restore_into_another_models_template(tmp_path):
    """What orbax users see: restoring into another model's template fails inside orbax with
    its own ValueError (it names the shapes, not the leaf; do NOT follow its advice to allow
    truncation/padding, which would restore garbage of the right shape). Restoring without a
    template gives plain dicts, which step rejects with an explanation."""
    opt, params, batch, state = _shared()
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "ckpt", {"state": _other_state()})
    checkpointer.wait_until_finished()
    with pytest.raises(ValueError, match=r"Requested shape: .* is not compatible with the stored"):
        checkpointer.restore(tmp_path / "ckpt", {"state": state})
    gc.collect()  # Here, where the warning filter applies.
    raw = checkpointer.restore(tmp_path / "ckpt")["state"]
    with pytest.raises(ValueError, match="state is a dict, not the OptimizerState.*template"):
        _step(opt, params, raw, batch)
