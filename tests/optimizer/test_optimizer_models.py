"""kfacx.Optimizer on other model kinds and through its other interfaces: haiku state,
aux and rng, the sampled Fisher, data iterators and the unstaged step, value_and_grad
tracing, the pmap helpers, non-scalar losses, compiler options, blocks with their own
init.
"""

import warnings

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _optimizer_cases import (
    ADAPTIVE,
    DETERMINISTIC,
    assert_trees_close,
    make_batch,
    make_params,
    mlp_loss,
    run,
)

import kfacx

# ----------------------------------------------------------------------------- model kinds


def test_haiku_batchnorm_state_aux_and_rng():
    """value_func_has_state / has_aux / has_rng: BatchNorm statistics are threaded
    through the step and dropout gets a key."""

    def forward(x, is_training):
        x = hk.Linear(16)(x)
        x = hk.BatchNorm(True, True, 0.9)(x, is_training)
        x = jax.nn.relu(x)
        x = hk.dropout(hk.next_rng_key(), 0.1, x) if is_training else x
        return hk.Linear(3)(x)

    model = hk.transform_with_state(forward)

    def loss_fn(params, state, rng, batch):
        x, y = batch
        logits, new_state = model.apply(params, state, rng, x, True)
        kfacx.register_softmax_cross_entropy_loss(logits, y)
        loss = jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y))
        return loss, (new_state, dict(accuracy=jnp.mean(jnp.argmax(logits, -1) == y)))

    batch = make_batch(n=32)
    # one compilation instead of one per operation run eagerly
    params, func_state = jax.jit(model.init, static_argnums=2)(jax.random.key(0), batch[0], True)
    opt = kfacx.Optimizer(
        jax.value_and_grad(loss_fn, has_aux=True),
        l2_reg=1e-4,
        value_func_has_aux=True,
        value_func_has_state=True,
        value_func_has_rng=True,
        **ADAPTIVE,
        **DETERMINISTIC,
    )
    state = opt.init(params, jax.random.key(1), batch, func_state)
    report = opt.estimator.report
    assert report is not None and not report.unmatched
    losses = []
    for i in range(4):
        params, state, new_func_state, stats = opt.step(
            params, state, jax.random.key(i), batch, func_state
        )
        assert not jax.tree.all(
            jax.tree.map(
                lambda a, b: bool(np.all(np.asarray(a) == np.asarray(b))),
                new_func_state,
                func_state,
            )
        )
        func_state = new_func_state
        losses.append(float(stats["loss"]))
        assert 0.0 <= float(stats["aux"]["accuracy"]) <= 1.0
    assert losses[-1] < losses[0]
    with pytest.raises(ValueError, match="func_state"):
        opt.step(params, state, jax.random.key(0), batch)


def test_fisher_gradients_training_reduces_the_loss():
    params, batch = make_params(), make_batch(n=64)
    opt = kfacx.Optimizer(jax.value_and_grad(mlp_loss), l2_reg=1e-4, **ADAPTIVE, num_burnin_steps=2)
    _, _, history = run(opt, params, batch, 15)
    losses = [float(h["loss"]) for h in history]
    assert losses[-1] < 0.5 * losses[0]
    assert all(np.isfinite(losses))


def test_data_iterator_and_unstaged_step():
    params, batch = make_params(), make_batch()
    opt = kfacx.Optimizer(
        jax.value_and_grad(mlp_loss),
        learning_rate_schedule=0.1,
        initial_damping=1e-2,
        num_burnin_steps=2,
        estimation_mode="fisher_empirical",
    )
    state = opt.init(params, jax.random.key(0), batch)
    iterator = iter([batch] * 3)
    p_iter, s_iter, _ = opt.step(params, state, jax.random.key(1), data_iterator=iterator)
    with pytest.raises(StopIteration):
        next(iterator)  # 2 burn-in batches and 1 step batch were consumed
    with pytest.raises(ValueError, match="exactly one"):
        opt.step(params, state, jax.random.key(1))
    # The unstaged step is pure and can be staged by the user.
    p_u, s_u, _ = jax.jit(opt.unstaged_step)(params, s_iter, jax.random.key(2), batch)
    p_s, s_s, _ = opt.step(params, s_iter, jax.random.key(2), batch)
    assert_trees_close(p_u, p_s)
    del p_iter


@pytest.mark.parametrize("wrap", ["value_and_grad", "jit(value_and_grad)"])
def test_backward_pass_of_value_and_grad_is_not_mistaken_for_layers(wrap):
    """The optimizer traces the value output of value_and_grad_func; the backward pass
    (dy @ w.T ...) is dropped before detection, also inside jit."""
    value_and_grad = jax.value_and_grad(mlp_loss)
    if wrap == "jit(value_and_grad)":
        value_and_grad = jax.jit(value_and_grad)
    params, batch = make_params(), make_batch()
    opt = kfacx.Optimizer(
        value_and_grad, learning_rate_schedule=0.1, initial_damping=1e-2, **DETERMINISTIC
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.init(params, jax.random.key(0), batch)
    report = opt.estimator.report
    assert not report.unmatched and not report.notes
    assert {e.source for e in report.entries} == {"dense_with_bias"}
    assert [type(b).__name__ for b in opt.estimator.blocks] == ["DenseTwoKroneckerFactored"] * 2
    reference = kfacx.Optimizer(
        jax.value_and_grad(mlp_loss),
        learning_rate_schedule=0.1,
        initial_damping=1e-2,
        **DETERMINISTIC,
    )
    assert_trees_close(run(opt, params, batch, 2)[0], run(reference, params, batch, 2)[0])


def test_replicate_accepts_pmap_outputs_and_keys():
    step = jax.pmap(lambda x, k: (2 * x, jax.random.normal(k, ())), axis_name="i")
    x = kfacx.parallel.replicate_all_local_devices(jnp.ones(3))
    keys = kfacx.parallel.replicate_all_local_devices(jax.random.key(0))
    y, r = step(x, keys)
    np.testing.assert_array_equal(r, r[0])  # the same key on every device
    again = kfacx.parallel.replicate_all_local_devices(kfacx.parallel.get_first(y))
    np.testing.assert_array_equal(step(again, keys)[0], 4 * np.ones((jax.local_device_count(), 3)))
    different = kfacx.parallel.make_different_rng_key_on_all_devices(jax.random.key(0))
    r = step(x, different)[1]
    assert len(set(np.asarray(r).tolist())) == jax.local_device_count()


def test_non_scalar_loss_is_a_clear_error():
    def vector_loss(params, batch):
        x, y = batch
        logits = x @ params["w1"] @ params["w2"]
        kfacx.register_softmax_cross_entropy_loss(logits, y)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y)  # per example

    params, batch = make_params(), make_batch()
    params = {k: params[k] for k in ("w1", "w2")}
    estimator = kfacx.BlockDiagonalCurvature(vector_loss)
    estimator.init(jax.random.key(0), (params, batch))
    with pytest.raises(ValueError, match="scalar float loss"):
        # raised while tracing (jitted: no operation is compiled on the way there)
        jax.jit(estimator.value_grads_and_curvature_stats)(jax.random.key(0), (params, batch))


def test_fast_compile_options_reach_the_step_and_change_nothing_but_rounding():
    """The options are handed to XLA (an unknown one is rejected at compilation), and
    the step they compile equals the default one to float32 rounding."""
    from kfacx._helpers import _compile

    assert kfacx.fast_compile_options("gpu") == {}
    if not _compile.cpu_accepts((("xla_cpu_use_fusion_emitters", False),)):
        assert kfacx.fast_compile_options() == {}
        pytest.skip("this jaxlib has no classic CPU emitters (jaxlib >= 0.12)")
    options = kfacx.fast_compile_options()
    assert options == {"xla_cpu_use_fusion_emitters": False, "xla_backend_optimization_level": 1}
    params, batch = make_params(), make_batch()
    kwargs = dict(learning_rate_schedule=0.1, momentum_schedule=0.5, damping_schedule=1e-2)

    def make(**extra):
        return kfacx.Optimizer(jax.value_and_grad(mlp_loss), **DETERMINISTIC, **kwargs, **extra)

    # XLA's defaults spelled out: tests/conftest.py compiles everything else with the
    # fast options.
    xla_defaults = {"xla_cpu_use_fusion_emitters": True, "xla_backend_optimization_level": 2}
    default = run(make(compiler_options=xla_defaults), params, batch, 3)
    fast = run(make(compiler_options=options), params, batch, 3)
    assert_trees_close(fast[:2], default[:2], rtol=1e-5, atol=1e-6)
    with pytest.raises(jax.errors.JaxRuntimeError, match="xla_no_such_option"):
        run(make(compiler_options={"xla_no_such_option": 1}), params, batch, 1)


def test_compile_options_are_probed_before_use():
    """jaxlib 0.12 rejects ``xla_cpu_use_fusion_emitters`` (its classic emitters are
    gone): the options kfacx passes on its own are probed first, and an unknown one is
    left out, never a compilation error."""
    from kfacx._helpers import _compile

    assert not _compile.cpu_accepts((("xla_no_such_option", 1),))
    assert _compile.cpu_accepts((("xla_backend_optimization_level", 0),))
    options = _compile.one_off_compile_options()
    assert _compile.cpu_accepts(tuple(options.items())), options
    assert _compile.cpu_accepts(tuple(kfacx.fast_compile_options().items()))


def test_blocks_with_their_own_init_get_distinct_keys():
    """Built-in blocks ignore their init key (the eager split is skipped for them); a block
    class that overrides `init` gets one key per block, split from the estimator's."""
    seen = []

    class KeyedBlock(kfacx.blocks.DenseTwoKroneckerFactored):
        def init(self, rng, *args, **kwargs):
            seen.append(np.asarray(jax.random.key_data(rng)))
            return super().init(rng, *args, **kwargs)

    params, batch = make_params(), make_batch()
    est = kfacx.BlockDiagonalCurvature(mlp_loss, layer_tag_to_block_ctor={"dense_tag": KeyedBlock})
    rng = jax.random.key(3)
    est.init(rng, (params, batch))
    want = [np.asarray(jax.random.key_data(k)) for k in jax.random.split(rng, 2)]
    assert len(seen) == 2
    for got, expected in zip(seen, want, strict=True):
        np.testing.assert_array_equal(got, expected)
