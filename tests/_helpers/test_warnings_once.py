"""kfacx's warnings are said once, at the user's line, even when a compiled step traces
the model again (here: running statistics that change shape after the first update)."""

import warnings

import jax
import jax.numpy as jnp

import kfacx


def _loss(params, state, batch):
    x, y = batch
    h = x @ params["w"] + params["b"][None]
    mean = 0.9 * state["mean"] + 0.1 * jnp.mean(h, 0)  # shape (1,) -> (4,) after one update
    out = (h - mean[None]) * jnp.sin(params["s"])[None]  # "s" matches no pattern: a warning
    kfacx.register_squared_error_loss(out, y)
    return 0.5 * jnp.mean(jnp.sum((out - y) ** 2, -1)), {"mean": mean}


def _kfacx_warnings(record):
    return [w for w in record if str(w.message).startswith("kfacx:")]


def test_a_second_trace_repeats_no_warning_and_each_points_at_the_users_line():
    params = {"w": jnp.ones((3, 4)), "b": jnp.zeros(4), "s": jnp.zeros(4)}
    batch = (jnp.ones((8, 3)), jnp.zeros((8, 4)))
    opt = kfacx.Optimizer(
        jax.value_and_grad(_loss, has_aux=True),
        value_func_has_state=True,
        learning_rate_schedule=0.1,
        momentum_schedule=0.0,
        initial_damping=1.0,
    )
    func_state = {"mean": jnp.zeros((1,))}
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        state = opt.init(params, jax.random.key(0), batch, func_state)
        for i in range(3):
            params, state, func_state, _ = opt.step(
                params, state, jax.random.key(i), batch, func_state
            )
    assert func_state["mean"].shape == (4,)  # the step was traced again for the new shape
    said = _kfacx_warnings(record)
    assert len(said) == 1, [str(w.message) for w in said]
    assert "['s']" in str(said[0].message)
    assert said[0].filename == __file__


def test_a_warning_raised_while_jax_traces_points_at_the_users_line():
    """Detection run under `jax.jit` (inside JAX's tracing machinery) still warns at the
    line that called the jitted function."""
    params = {"w": jnp.ones((3, 4)), "b": jnp.zeros(4), "s": jnp.zeros(4)}
    batch = (jnp.ones((8, 3)), jnp.zeros((8, 4)))

    def detect(p, b):
        tagged, _ = kfacx.auto_register_tags(
            lambda p, b: _loss(p, {"mean": jnp.zeros(4)}, b)[0], (p, b)
        )
        return tagged(p, b)

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        jax.jit(detect)(params, batch)
    said = _kfacx_warnings(record)
    assert len(said) == 1 and said[0].filename == __file__
