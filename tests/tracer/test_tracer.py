"""Tests for `kfacx.tracer`: layer statistics, loss Jacobian products, errors, caching."""

from __future__ import annotations

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _models import HaikuTaggedMLP, add_bias, dense, init_mlp, normal

import kfacx
from kfacx import tracer

TOL = dict(rtol=1e-5, atol=1e-6)

D_IN, HIDDEN, N_CLASSES, N_REG = 3, 4, 3, 2
BATCH = 3


# ----------------------------------------------------------------------------- model


def _params(seed: int = 0):
    """Trunk layer plus two heads: [(w1, b1), (w2, b2), (w3, b3)]."""
    (trunk,) = init_mlp([D_IN, HIDDEN], seed)
    (head_cls,) = init_mlp([HIDDEN, N_CLASSES], seed + 1)
    (head_reg,) = init_mlp([HIDDEN, N_REG], seed + 2)
    return [trunk, head_cls, head_reg]


def _batch(seed: int = 1, batch: int = BATCH):
    rng = np.random.default_rng(seed)
    x = normal(rng, batch, D_IN)
    labels = jnp.asarray(rng.integers(0, N_CLASSES, size=batch), jnp.int32)
    targets = normal(rng, batch, N_REG)
    return x, labels, targets


def _identity(f):
    return f


def _tagged_dense(x, w, b):
    return kfacx.register_dense(dense(x, w, b), x, w, b)


def _make_two_head_loss(wrap=_identity):
    """Tagged loss: tanh trunk, a softmax CE head and a squared-error head (weight 0.5).

    ``wrap`` wraps the function computing one tagged dense layer (jit, checkpoint, ...).
    """
    layer = wrap(_tagged_dense)

    def loss_fn(params, batch):
        x, labels, targets = batch
        (w1, b1), (w2, b2), (w3, b3) = params
        h = jnp.tanh(layer(x, w1, b1))
        logits = layer(h, w2, b2)
        reg = layer(h, w3, b3)
        kfacx.register_softmax_cross_entropy_loss(logits, labels)
        kfacx.register_squared_error_loss(reg, targets, weight=0.5)
        log_p = jax.nn.log_softmax(logits, axis=-1)
        ce = -jnp.mean(jnp.take_along_axis(log_p, labels[:, None], axis=-1))
        return ce + 0.5 * jnp.mean(jnp.sum(jnp.square(reg - targets), axis=-1))

    return loss_fn


def _reference_layers(params, x, eps):
    """Untagged forward pass with ``eps[i]`` added to layer i's output.

    Returns ``(predictions, layer_inputs, layer_outputs)``.
    """
    (w1, b1), (w2, b2), (w3, b3) = params
    y1 = dense(x, w1, b1) + eps[0]
    h = jnp.tanh(y1)
    y2 = dense(h, w2, b2) + eps[1]
    y3 = dense(h, w3, b3) + eps[2]
    return (y2, y3), (x, h, h), (y1, y2, y3)


def _zero_eps(params, batch_size):
    return tuple(jnp.zeros((batch_size, w.shape[1]), jnp.float32) for w, _ in params)


def _reference_output_tangents(params, x, cotangents):
    eps = _zero_eps(params, x.shape[0])
    _, vjp = jax.vjp(lambda e: _reference_layers(params, x, e)[0], eps)
    (tangents,) = vjp(tuple(cotangents))
    return tangents


def _cotangents(seed: int, leading: tuple[int, ...] = ()):
    rng = np.random.default_rng(seed)
    return (normal(rng, *leading, BATCH, N_CLASSES), normal(rng, *leading, BATCH, N_REG))


# ----------------------------------------------------------------------------- layer_tags_vjp


def test_layer_tags_vjp_returns_one_loss_per_registration():
    params, batch = _params(), _batch()
    x, labels, targets = batch
    loss_fns, _ = kfacx.layer_tags_vjp(_make_two_head_loss(), (params, batch))
    assert len(loss_fns) == 2
    ce, se = loss_fns
    assert isinstance(ce, kfacx.SoftmaxCrossEntropyLoss)
    assert isinstance(se, kfacx.NormalPredictiveLoss)
    (logits, reg), _, _ = _reference_layers(params, x, _zero_eps(params, BATCH))
    np.testing.assert_allclose(ce.prediction, logits, **TOL)
    np.testing.assert_allclose(se.prediction, reg, **TOL)
    np.testing.assert_array_equal(ce.targets, labels)
    np.testing.assert_allclose(se.targets, targets)
    assert ce.weight == 1.0 and se.weight == 0.5
    assert se.variance == 0.5
    total = ce.evaluate() + se.evaluate()
    np.testing.assert_allclose(total, _make_two_head_loss()(params, batch), **TOL)


def test_layer_tags_vjp_layer_data_and_output_tangents():
    params, batch = _params(), _batch()
    x = batch[0]
    _, vjp = kfacx.layer_tags_vjp(_make_two_head_loss(), (params, batch))
    cts = _cotangents(seed=3)
    data = vjp(cts)
    assert len(data) == 3
    _, inputs, outputs = _reference_layers(params, x, _zero_eps(params, BATCH))
    ref_tangents = _reference_output_tangents(params, x, cts)
    for i, layer in enumerate(data):
        assert set(layer) == {"inputs", "outputs", "params", "outputs_tangent"}
        (layer_in,) = layer["inputs"]
        (layer_out,) = layer["outputs"]
        (tangent,) = layer["outputs_tangent"]
        np.testing.assert_allclose(layer_in, inputs[i], **TOL)
        np.testing.assert_allclose(layer_out, outputs[i], **TOL)
        assert len(layer["params"]) == 2
        for got, want in zip(layer["params"], params[i], strict=True):
            np.testing.assert_array_equal(got, want)
        np.testing.assert_allclose(tangent, ref_tangents[i], **TOL)
    # The heads only see their own loss's cotangent.
    np.testing.assert_allclose(data[1]["outputs_tangent"][0], cts[0], **TOL)
    np.testing.assert_allclose(data[2]["outputs_tangent"][0], cts[1], **TOL)


def test_layer_tags_vjp_tangents_are_linear_and_zero_for_zero_cotangents():
    params, batch = _params(), _batch()
    _, vjp = kfacx.layer_tags_vjp(_make_two_head_loss(), (params, batch))
    zeros = vjp(tuple(jnp.zeros_like(c) for c in _cotangents(0)))
    for layer in zeros:
        np.testing.assert_array_equal(layer["outputs_tangent"][0], 0.0)
    a, b = _cotangents(1), _cotangents(2)
    ta, tb = vjp(a), vjp(b)
    tab = vjp(tuple(2.0 * u - v for u, v in zip(a, b, strict=True)))
    for la, lb, lab in zip(ta, tb, tab, strict=True):
        np.testing.assert_allclose(
            lab["outputs_tangent"][0],
            2.0 * la["outputs_tangent"][0] - lb["outputs_tangent"][0],
            rtol=1e-5,
            atol=1e-5,
        )


def test_layer_tags_vjp_sampled_stacks_per_sample_calls():
    params, batch = _params(), _batch()
    _, vjp = kfacx.layer_tags_vjp(_make_two_head_loss(), (params, batch))
    num_samples = 4
    cts = _cotangents(seed=5, leading=(num_samples,))
    sampled = vjp.sampled(cts)
    singles = [vjp(tuple(c[s] for c in cts)) for s in range(num_samples)]
    for i, layer in enumerate(sampled):
        (tangent,) = layer["outputs_tangent"]
        assert tangent.shape == (num_samples, BATCH, params[i][0].shape[1])
        want = jnp.stack([single[i]["outputs_tangent"][0] for single in singles])
        np.testing.assert_allclose(tangent, want, **TOL)
        # The layer data itself has no samples axis.
        np.testing.assert_allclose(layer["inputs"][0], singles[0][i]["inputs"][0], **TOL)


def test_layer_tags_vjp_params_index_and_closure_constants():
    """Parameters need not be the first argument; closed-over arrays are constants."""
    params, (x, labels, targets) = _params(), _batch()
    scale = jnp.asarray(1.0, jnp.float32)

    def loss_fn(batch, params):
        return _make_two_head_loss()(params, (batch[0] * scale, *batch[1:]))

    loss_fns, vjp = kfacx.layer_tags_vjp(loss_fn, ((x, labels, targets), params), params_index=1)
    cts = _cotangents(seed=7)
    ref = _reference_output_tangents(params, x, cts)
    for layer, want in zip(vjp(cts), ref, strict=True):
        np.testing.assert_allclose(layer["outputs_tangent"][0], want, **TOL)
    assert len(loss_fns) == 2


# ----------------------------------------------------------------------------- wrappers


def _custom_jvp_layer(x, w, b):
    @jax.custom_jvp
    def layer(x, w, b):
        return _tagged_dense(x, w, b)

    @layer.defjvp
    def layer_jvp(primals, tangents):
        x_, w_, b_ = primals
        dx, dw, db = tangents
        return layer(x_, w_, b_), add_bias(dx @ w_ + x_ @ dw, db)

    return layer(x, w, b)


def _custom_vjp_layer(x, w, b):
    @jax.custom_vjp
    def layer(x, w, b):
        return _tagged_dense(x, w, b)

    def fwd(x_, w_, b_):
        return layer(x_, w_, b_), (x_, w_)

    def bwd(res, g):
        x_, w_ = res
        return g @ w_.T, x_.T @ g, jnp.sum(g, axis=0)

    layer.defvjp(fwd, bwd)
    return layer(x, w, b)


WRAPPERS = {
    "jit": jax.jit,
    "nested_jit": lambda f: jax.jit(jax.jit(f)),
    "checkpoint": jax.checkpoint,
    "custom_jvp": lambda f: _custom_jvp_layer,
    "custom_vjp": lambda f: _custom_vjp_layer,
}


@pytest.mark.parametrize("wrapper", sorted(WRAPPERS))
def test_tags_inside_call_wrappers_are_found(wrapper):
    params, batch = _params(), _batch()
    plain_losses, plain_vjp = kfacx.layer_tags_vjp(_make_two_head_loss(), (params, batch))
    wrapped = _make_two_head_loss(WRAPPERS[wrapper])
    traced = tracer.trace(wrapped, (params, batch))
    assert len(traced.layers) == 3 and traced.num_losses == 2
    assert traced.layer_param_leaves == ((0, 1), (2, 3), (4, 5))
    loss_fns, vjp = kfacx.layer_tags_vjp(wrapped, (params, batch))
    for got, want in zip(loss_fns, plain_losses, strict=True):
        np.testing.assert_allclose(got.prediction, want.prediction, **TOL)
    cts = _cotangents(seed=11)
    for got, want in zip(vjp(cts), plain_vjp(cts), strict=True):
        for key in ("inputs", "outputs", "outputs_tangent", "params"):
            for g, w in zip(got[key], want[key], strict=True):
                np.testing.assert_allclose(g, w, **TOL)


def test_whole_loss_function_under_jit_wrapper_is_traced():
    params, batch = _params(), _batch()
    jitted = jax.jit(_make_two_head_loss())
    traced = tracer.trace(jitted, (params, batch))
    assert len(traced.layers) == 3 and traced.num_losses == 2
    cts = _cotangents(seed=4)
    _, vjp = kfacx.layer_tags_vjp(jitted, (params, batch))
    ref = _reference_output_tangents(params, batch[0], cts)
    for layer, want in zip(vjp(cts), ref, strict=True):
        np.testing.assert_allclose(layer["outputs_tangent"][0], want, **TOL)


def test_tag_inside_while_loop_raises():
    # Tags inside lax.scan and lax.cond are read (tests/graph_matcher/test_scan.py,
    # tests/tracer/test_control_flow.py); inside a while loop (unknown trip count) they are not.
    params, batch = _params(), _batch()

    def loss_fn(params, batch):
        x, labels, _ = batch
        (w1, b1), (w2, b2), _ = params
        h0 = jnp.zeros((x.shape[0], w1.shape[1]), x.dtype)
        _, h = jax.lax.while_loop(
            lambda c: c[0] < 1, lambda c: (c[0] + 1, jnp.tanh(_tagged_dense(x, w1, b1))), (0, h0)
        )
        logits = _tagged_dense(h, w2, b2)
        return kfacx.register_softmax_cross_entropy_loss(logits, labels).sum()

    with pytest.raises(ValueError, match=r"inside a `while` primitive.*not inside `while`"):
        kfacx.layer_tags_vjp(loss_fn, (params, batch))


# ----------------------------------------------------------------------------- loss jvp / vjp


def _predictions(params, x):
    (y2, y3), _, _ = _reference_layers(params, x, _zero_eps(params, x.shape[0]))
    return y2, y3


def test_loss_tags_jvp_matches_jax_jvp():
    params, batch = _params(), _batch()
    rng = np.random.default_rng(9)
    tangent = jax.tree_util.tree_map(lambda p: normal(rng, *p.shape), params)
    loss_fns, tangents = kfacx.loss_tags_jvp(_make_two_head_loss(), (params, batch), tangent)
    preds, want = jax.jvp(lambda p: _predictions(p, batch[0]), (params,), (tangent,))
    assert len(loss_fns) == len(tangents) == 2
    for lf, pred in zip(loss_fns, preds, strict=True):
        np.testing.assert_allclose(lf.prediction, pred, **TOL)
    for got, w in zip(tangents, want, strict=True):
        np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-5)


def test_loss_tags_vjp_matches_jax_vjp():
    params, batch = _params(), _batch()
    loss_fns, vjp = kfacx.loss_tags_vjp(_make_two_head_loss(), (params, batch))
    preds, ref_vjp = jax.vjp(lambda p: _predictions(p, batch[0]), params)
    for lf, pred in zip(loss_fns, preds, strict=True):
        np.testing.assert_allclose(lf.prediction, pred, **TOL)
    cts = _cotangents(seed=13)
    got = vjp(cts)
    (want,) = ref_vjp(cts)
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(params)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_loss_tags_jvp_vjp_are_adjoint():
    params, batch = _params(), _batch()
    rng = np.random.default_rng(21)
    tangent = jax.tree_util.tree_map(lambda p: normal(rng, *p.shape), params)
    _, jv = kfacx.loss_tags_jvp(_make_two_head_loss(), (params, batch), tangent)
    _, vjp = kfacx.loss_tags_vjp(_make_two_head_loss(), (params, batch))
    cts = _cotangents(seed=22)
    lhs = sum(jnp.vdot(u, t) for u, t in zip(cts, jv, strict=True))
    grads = vjp(cts)
    rhs = sum(
        jnp.vdot(g, t)
        for g, t in zip(
            jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(tangent), strict=True
        )
    )
    np.testing.assert_allclose(lhs, rhs, rtol=1e-4)


# ----------------------------------------------------------------------------- errors


def test_function_without_loss_raises():
    params, batch = _params(), _batch()

    def loss_fn(params, batch):
        x = batch[0]
        (w1, b1) = params[0]
        return jnp.sum(_tagged_dense(x, w1, b1))

    with pytest.raises(ValueError, match="registers no loss"):
        kfacx.layer_tags_vjp(loss_fn, (params, batch))


def test_computed_parameter_raises():
    params, batch = _params(), _batch()

    def loss_fn(params, batch):
        x, labels, _ = batch
        (w1, b1), (w2, b2), _ = params
        h = kfacx.register_dense(dense(x, 2 * w1, b1), x, 2 * w1, b1)
        logits = kfacx.register_dense(dense(h, w2, b2), h, w2, b2)
        return kfacx.register_softmax_cross_entropy_loss(logits, labels).sum()

    with pytest.raises(ValueError, match="computed"):
        tracer.trace(loss_fn, (params, batch))


def test_parameter_shared_by_two_different_layers_makes_a_tied_layer():
    """(w1, b1) and (w1,) overlap but are not the same layer: one tied layer, a role each."""
    params, batch = _params(), _batch()

    def loss_fn(params, batch):
        x, labels, _ = batch
        (w1, b1), (w2, b2), _ = params
        h = kfacx.register_dense(dense(x, w1, b1), x, w1, b1)
        h2 = kfacx.register_dense(x @ w1, x, w1)
        h3 = kfacx.register_dense(x @ w1, x, w1)
        logits = _tagged_dense(jnp.tanh(h + h2 + h3), w2, b2)
        return kfacx.register_softmax_cross_entropy_loss(logits, labels).sum()

    traced = tracer.trace(loss_fn, (params, batch))
    tied = traced.layers[0]
    assert tied.tag_name == "tied" and tied.parameter_paths == ("0/0", "0/1")
    assert [r.parameter_paths for r in tied.roles] == [("0/0", "0/1"), ("0/0",)]
    assert [r.num_uses for r in tied.roles] == [1, 2]
    assert tied.role_params == ((0, 1), (0,))
    assert traced.use_to_layer[:3] == (0, 0, 0) and traced.use_roles[:3] == (0, 1, 1)
    assert [traced.use_param_leaves(u) for u in range(3)] == [(0, 1), (0,), (0,)]


def test_parameter_shared_by_layers_no_block_serves_raises_naming_it():
    params, batch = tuple(_params()[:2]), _batch()

    def loss_fn(params, batch):
        x, labels, _ = batch
        (w1, b1), (w2, b2) = params
        h = kfacx.register_dense(dense(x, w1, b1), x, w1, b1)
        h = kfacx.register_scale_and_shift(h * b1[None, :], h, scale=b1)
        logits = _tagged_dense(jnp.tanh(h), w2, b2)
        return kfacx.register_softmax_cross_entropy_loss(logits, labels).sum()

    est = kfacx.BlockDiagonalCurvature(loss_fn, auto_register_tags=False)
    with pytest.raises(ValueError, match=r"TiedKroneckerFactored\(tied\[0/0, 0/1\]\).*scale_and"):
        est.init(jax.random.PRNGKey(0), (params, batch))


def test_params_index_out_of_range_raises():
    with pytest.raises(ValueError, match="params_index"):
        tracer.trace(_make_two_head_loss(), (_params(), _batch()), params_index=2)


# ----------------------------------------------------------------------------- paths


def test_path_to_str_on_haiku_params():
    def forward(x, labels):
        logits = HaikuTaggedMLP([HIDDEN, N_CLASSES], name="mlp")(x)
        return kfacx.register_softmax_cross_entropy_loss(logits, labels).sum()

    model = hk.without_apply_rng(hk.transform(forward))
    x, labels, _ = _batch()
    # Shapes suffice for both the paths and the trace.
    params = jax.eval_shape(model.init, jax.random.PRNGKey(0), x, labels)
    paths = [tracer.path_to_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    assert paths == [
        "mlp/~/linear_0/b",
        "mlp/~/linear_0/w",
        "mlp/~/linear_1/b",
        "mlp/~/linear_1/w",
    ]
    traced = tracer.trace(model.apply, (params, x, labels))
    assert traced.param_paths == tuple(paths)
    assert [layer.parameter_paths for layer in traced.layers] == [
        ("mlp/~/linear_0/w", "mlp/~/linear_0/b"),
        ("mlp/~/linear_1/w", "mlp/~/linear_1/b"),
    ]
    assert traced.layer_param_leaves == ((1, 0), (3, 2))
    assert traced.layers[0].name == "dense_tag[mlp/~/linear_0/w, mlp/~/linear_0/b]"


def test_path_to_str_lists_and_attributes():
    tree = [{"a": (np.zeros(1), np.zeros(2))}]
    paths = [tracer.path_to_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    assert paths == ["0/a/0", "0/a/1"]


# ----------------------------------------------------------------------------- caching


def test_trace_cached_reuses_trace_for_same_shapes():
    loss_fn = _make_two_head_loss()
    params = _params()
    first = tracer.trace_cached(loss_fn, (params, _batch(seed=1)))
    # Different values, same shapes and dtypes: the same trace.
    second = tracer.trace_cached(loss_fn, (_params(seed=5), _batch(seed=2)))
    assert second is first
    # A different batch size: a new trace.
    third = tracer.trace_cached(loss_fn, (params, _batch(batch=BATCH + 1)))
    assert third is not first
    assert third.layers[0].input_shapes == ((BATCH + 1, D_IN),)
    assert tracer.trace_cached(loss_fn, (params, _batch(batch=BATCH + 1))) is third
    # A different function: a new trace.
    assert tracer.trace_cached(_make_two_head_loss(), (params, _batch())) is not first


def test_trace_collects_layer_info():
    traced = tracer.trace(_make_two_head_loss(), (_params(), _batch()))
    assert traced.num_param_leaves == 6
    assert traced.param_paths == ("0/0", "0/1", "1/0", "1/1", "2/0", "2/1")
    first = traced.layers[0]
    assert first.tag_name == "dense_tag"
    assert first.parameter_shapes == ((D_IN, HIDDEN), (HIDDEN,))
    assert first.input_shapes == ((BATCH, D_IN),)
    assert first.output_shapes == ((BATCH, HIDDEN),)
    assert traced.layers[2].output_shapes == ((BATCH, N_REG),)
