"""Layers inside `lax.scan`: detection, tracing and curvature blocks.

Two kinds of layers live in scans. A scan over the parameters (stacked ``[L, ...]``,
e.g. `hk.layer_stack`) holds ``L`` separate layers, served by a
`kfacx.blocks.StackedBlock`; a scan that closes over its parameters (an RNN cell)
applies one layer at every step, whose steps are folded into the batch axis like tied
weights. Every model is compared, in float64, with the same model unrolled by a Python
loop (separate layers, or tied uses), which kfacx serves without any scan: the tagged
function, the report, the dense curvature and its inverse products must agree.
"""

from __future__ import annotations

import functools
import re
import warnings

import _models as TM
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

import kfacx

D_IN, WIDTH, DEPTH, D_OUT, BATCH, TIME = 3, 5, 3, 2, 4, 4
KEY = jax.random.PRNGKey(0)
DAMPING = 0.1
DENSE_KF = "DenseTwoKroneckerFactored"


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


def f64(tree):
    return jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float64), tree)


def assert_close(got, want, rtol=1e-9):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape
    assert np.abs(want).max() > 0
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * np.abs(want).max())


def assert_trees_close(a, b, rtol=1e-9):
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        assert_close(x, y, rtol)


# ----------------------------------------------------------------------------- problems


def stacked_problem(seed: int = 0):
    params = f64(TM.init_stacked_mlp(D_IN, WIDTH, DEPTH, D_OUT, seed))
    rng = np.random.default_rng(seed + 1)
    batch = (rng.standard_normal((BATCH, D_IN)), rng.standard_normal((BATCH, D_OUT)))
    return params, f64(batch)


def rnn_problem(seed: int = 0):
    params = f64(TM.init_rnn(D_IN, WIDTH, D_OUT, seed))
    rng = np.random.default_rng(seed + 1)
    batch = (rng.standard_normal((BATCH, TIME, D_IN)), rng.standard_normal((BATCH, D_OUT)))
    return params, f64(batch)


def haiku_problem(seed: int = 0):
    model = TM.haiku_layer_stack_mlp(WIDTH, DEPTH, D_OUT)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((BATCH, D_IN))
    shapes = jax.eval_shape(model.init, KEY, x)
    params = jax.tree_util.tree_map(lambda s: 0.5 * rng.standard_normal(s.shape), shapes)
    return model, f64(params), f64((x, rng.standard_normal((BATCH, D_OUT))))


# name -> (scan logits, unrolled logits, params -> unrolled params, problem)
MODELS = {
    "stacked": (TM.stacked_mlp_logits, TM.unrolled_mlp_logits, TM.unstack_mlp, stacked_problem),
    "rnn": (TM.rnn_logits, TM.unrolled_rnn_logits, lambda p: p, rnn_problem),
}


def losses(name: str, variant: str = "plain", tag: bool = False):
    """``(scan loss, unrolled loss, to_unrolled, args)`` of a model."""
    scan_logits, loop_logits, to_unrolled, problem = MODELS[name]
    scan = _loss(scan_logits, variant, tag)
    loop = _loss(loop_logits, _loop_variant(variant), tag)
    return scan, loop, to_unrolled, problem()


def _loop_variant(variant: str) -> str:
    # Unrolled, a jitted or checkpointed body is the plain loop.
    return "reverse" if variant == "reverse" else "plain"


@functools.cache
def _loss(logits, variant, tag):
    # Cached: the estimator's trace cache is keyed on the function.
    return TM.loss_of_logits(logits, variant=variant, tag=tag)


def fast_jit(fun, **kwargs):
    """`jax.jit` with cheap XLA optimisation: compile time dominates these small programs."""
    return jax.jit(fun, compiler_options={"xla_backend_optimization_level": 0}, **kwargs)


def _both(transform, tagged, loss, args):
    """``transform`` of ``tagged`` and of ``loss`` at ``args``: one compilation for both."""
    return fast_jit(lambda *a: (transform(tagged)(*a), transform(loss)(*a)))(*args)


def unrolled_positions(params, to_unrolled) -> np.ndarray:
    """``perm`` with ``unrolled_flat = scan_flat[perm]`` (pytree-leaf order, row-major)."""
    leaves, tree = jax.tree_util.tree_flatten(params)
    offsets = np.cumsum([0] + [np.size(leaf) for leaf in leaves])
    index = [
        np.arange(o, o + np.size(leaf)).reshape(np.shape(leaf))
        for o, leaf in zip(offsets, leaves, strict=False)
    ]
    unrolled = to_unrolled(jax.tree_util.tree_unflatten(tree, index))
    return np.concatenate([np.ravel(a) for a in jax.tree_util.tree_leaves(unrolled)])


def estimate(loss, args, mode="ggn_exact", auto=True, vector=None, ctors=None) -> dict:
    """One jitted program: init, one update (ema 0, 1), the dense matrix and, given a
    ``vector``, the cache and inverse products (exact cached; approximate cached and
    fresh). No detection warning is allowed."""
    est = kfacx.BlockDiagonalCurvature(
        loss,
        layer_tag_to_block_ctor=ctors,
        default_estimation_mode=mode,
        auto_register_tags=auto,
        exact_powers_to_cache=(-1.0,),
        approx_powers_to_cache=(-1.0,),
    )

    def run(args, vector):
        state = est.init(KEY, args)
        state = est.update_curvature_matrix_estimate(state, 0.0, 1.0, None, KEY, args)
        products = {}
        if vector is not None:
            state = est.update_cache(state, DAMPING)
            inverse = functools.partial(est.multiply_inverse, state, vector, DAMPING)
            products = dict(
                exact=inverse(exact_power=True, use_cached=True),
                approx=inverse(use_cached=True),
                approx_fresh=inverse(use_cached=False),
            )
        return est.to_dense_matrix(state), products

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dense, products = fast_jit(run)(args, vector)
    return dict(estimator=est, dense=np.asarray(dense), **products)


# Hand-tagged models get full blocks for their dense layers: per-example gradients pair
# every input row with its cotangent row (Kronecker factors do not see the pairing).
FULL_DENSE = {"dense_tag": kfacx.blocks.Full}


@functools.cache
def model_estimates(name: str, variant: str, tag: bool = False, mode: str = "ggn_exact"):
    """``(scan model's estimate, unrolled model's estimate, perm, vector)`` (cached)."""
    scan_loss, loop_loss, to_unrolled, (params, batch) = losses(name, variant, tag)
    products = variant == "plain" and not tag
    v = random_like(params) if products else None
    ctors = FULL_DENSE if tag else None
    scan = estimate(scan_loss, (params, batch), mode, auto=not tag, vector=v, ctors=ctors)
    loop = _loop_estimate(name, _loop_variant(variant), tag, mode, products)
    return scan, loop, unrolled_positions(params, to_unrolled), v


@functools.cache
def _loop_estimate(name: str, variant: str, tag: bool, mode: str, products: bool):
    _, loop_loss, to_unrolled, (params, batch) = losses(name, variant, tag)
    v = to_unrolled(random_like(params)) if products else None
    args = (to_unrolled(params), batch)
    return estimate(loop_loss, args, mode, not tag, v, FULL_DENSE if tag else None)


def random_like(tree, seed: int = 3):
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_map(lambda a: jnp.asarray(rng.standard_normal(np.shape(a))), tree)


# ----------------------------------------------------------------------------- detection


@pytest.mark.parametrize("variant", TM.SCAN_VARIANTS)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_tagged_function_has_same_value_and_gradient(name, variant):
    loss, _, _, args = losses(name, variant)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tagged, report = kfacx.auto_register_tags(loss, args)
    assert report.unmatched == () and report.notes == ()
    assert_trees_close(*_both(jax.value_and_grad, tagged, loss, args))
    # The tags sit inside the scan's body.
    (scan,) = [e for e in jax.make_jaxpr(tagged)(*args).jaxpr.eqns if e.primitive.name == "scan"]
    assert kfacx._jaxpr.contains_tags(scan.params["jaxpr"].jaxpr)


@functools.cache
def layer_stack_estimates():
    """``(layer stack estimate, unrolled estimate, params, vector)`` of the Haiku model."""
    model, params, batch = haiku_problem()
    loss = TM.loss_of_logits(model.apply)
    loop_loss = TM.loss_of_logits(TM.unrolled_mlp_logits)
    unrolled = TM.haiku_stack_to_unrolled(params)
    assert_close(loop_loss(unrolled, batch), loss(params, batch))
    v = random_like(params)
    scan = estimate(loss, (params, batch), vector=v)
    loop = estimate(loop_loss, (unrolled, batch), vector=TM.haiku_stack_to_unrolled(v))
    return scan, loop, params, v


def test_layer_stack_report():
    est = layer_stack_estimates()[0]["estimator"]
    report = est.report
    assert report.unmatched == () and report.notes == ()
    stacked = "__layer_stack_no_per_layer/hidden"
    got = {e.path: (e.tag, e.source, e.uses, e.stack_size, e.block) for e in report.entries}
    edge = ("dense_tag", "dense_with_bias", 1, None, DENSE_KF)
    inner = ("dense_tag", "dense_with_bias", 1, DEPTH, f"StackedBlock({DENSE_KF})")
    assert got == {
        **{f"{m}/{p}": edge for m in ("inp", "out") for p in ("b", "w")},
        **{f"{stacked}/{p}": inner for p in ("b", "w")},
    }
    layers = {e.path: e.layer for e in report.entries}
    assert layers[f"{stacked}/w"] == layers[f"{stacked}/b"] == 1
    assert [repr(b).split("(")[0] for b in est.blocks] == [DENSE_KF, "StackedBlock", DENSE_KF]
    text = str(report)
    assert re.search(rf"^{stacked}/w\s+1 \({DEPTH} stacked\)\s+dense_tag", text, re.M), text
    assert "6/6 parameters matched" in text


def test_rnn_report_counts_one_use_per_step():
    est = model_estimates("rnn", "plain")[0]["estimator"]
    got = {e.path: (e.tag, e.uses, e.stack_size, e.block) for e in est.report.entries}
    dense = ("dense_tag", TIME, None, DENSE_KF)
    assert got == {
        "wx": dense,
        "wh": dense,
        "b": ("dense_tag", TIME, None, DENSE_KF),
        "wo": ("dense_tag", 1, None, DENSE_KF),
        "bo": ("dense_tag", 1, None, DENSE_KF),
    }
    layers = {e.path: e.layer for e in est.report.entries}
    assert layers["wh"] == layers["b"] != layers["wx"]
    assert [layer.num_uses for layer in est._traced.layers] == [TIME, TIME, 1]
    assert re.search(rf"^wh\s+\d \(x{TIME}\)\s+dense_tag", str(est.report), re.M)


# ----------------------------------------------------------------------------- curvature


@pytest.mark.parametrize("variant", TM.SCAN_VARIANTS)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_detected_curvature_equals_unrolled(name, variant):
    scan, loop, perm, _ = model_estimates(name, variant)
    assert len(scan["estimator"].blocks) == 3
    assert len(loop["estimator"].blocks) == 3 + (DEPTH - 1) * (name == "stacked")
    assert_close(scan["dense"][np.ix_(perm, perm)], loop["dense"])


@pytest.mark.parametrize("name", sorted(MODELS))
def test_hand_tagged_curvature_equals_unrolled(name):
    scan, loop, perm, _ = model_estimates(name, "reverse", tag=True, mode="fisher_empirical")
    assert scan["estimator"].report is None
    names = [b.block_name for b in scan["estimator"].blocks]
    assert names == ["Full", "StackedBlock(Full)", "Full"] if name == "stacked" else ["Full"] * 3
    assert_close(scan["dense"][np.ix_(perm, perm)], loop["dense"])


@pytest.mark.parametrize("name", sorted(MODELS))
def test_hand_tags_in_scan_are_kept_by_detection(name):
    loss, _, _, args = losses(name, tag=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tagged, report = kfacx.auto_register_tags(loss, args)
    assert {e.source for e in report.entries} == {"manual"}
    (scan,) = [e for e in jax.make_jaxpr(tagged)(*args).jaxpr.eqns if e.primitive.name == "scan"]
    body_tags = [e for e in scan.params["jaxpr"].jaxpr.eqns if e.primitive.name == "dense_tag"]
    assert len(body_tags) == (1 if name == "stacked" else 2)  # not tagged twice


def _check_products(scan, loop, vector, to_unrolled):
    # Exact power: the inverse of the damped dense matrix (vector layout == dense layout).
    flat_v = np.asarray(ravel_pytree(vector)[0])
    want = np.linalg.solve(scan["dense"] + DAMPING * np.eye(len(flat_v)), flat_v)
    assert_close(ravel_pytree(scan["exact"])[0], want)
    # Factored damping (per layer, i.e. per slice of a stack): as in the unrolled model.
    assert_trees_close(to_unrolled(scan["approx"]), loop["approx"])
    assert_trees_close(to_unrolled(scan["approx_fresh"]), loop["approx"])


@pytest.mark.parametrize("name", sorted(MODELS))
def test_inverse_products_equal_unrolled_and_dense(name):
    scan, loop, _, v = model_estimates(name, "plain")
    _check_products(scan, loop, v, MODELS[name][2])


def test_layer_stack_curvature_equals_unrolled():
    scan, loop, params, v = layer_stack_estimates()
    model, _, batch = haiku_problem()
    loss, est = TM.loss_of_logits(model.apply), scan["estimator"]
    tagged = est.tagged_func((params, batch))
    want = jax.value_and_grad(loss)(params, batch)
    assert_trees_close(fast_jit(jax.value_and_grad(tagged))(params, batch), want)
    perm = unrolled_positions(params, TM.haiku_stack_to_unrolled)
    assert_close(scan["dense"][np.ix_(perm, perm)], loop["dense"])
    _check_products(scan, loop, v, TM.haiku_stack_to_unrolled)


def test_layer_stack_end_to_end_under_jit():
    model, params, batch = haiku_problem()
    loss = TM.loss_of_logits(model.apply)
    est = kfacx.BlockDiagonalCurvature(loss)  # fisher_gradients: sampled cotangents

    @fast_jit
    def step(params, batch, rng):
        state = est.init(rng, (params, batch))
        state = est.update_curvature_matrix_estimate(state, 0.0, 1.0, None, rng, (params, batch))
        state = est.update_cache(state, DAMPING)
        grads = jax.grad(loss)(params, batch)
        return state, est.multiply_inverse(state, grads, DAMPING, use_cached=True), grads

    state, precond, grads = step(params, batch, KEY)
    assert all(np.all(np.isfinite(leaf)) for leaf in jax.tree_util.tree_leaves(precond))
    # A positive-definite preconditioner: a descent direction.
    assert float(ravel_pytree(precond)[0] @ ravel_pytree(grads)[0]) > 0
    eager = est.multiply_inverse(state, grads, DAMPING, use_cached=True)
    assert_trees_close(eager, precond, rtol=1e-8)


def _twice(logits):
    """The model applied to the batch and to twice its first two examples (tied uses with
    different batch sizes)."""

    def twice(params, x):
        return logits(params, x)[:2] + logits(params, 2.0 * x[:2])

    return twice


def test_stack_applied_twice_is_one_stacked_layer_with_two_uses():
    params, (x, t) = stacked_problem()
    args, loop_args = (params, (x, t[:2])), (TM.unstack_mlp(params), (x, t[:2]))
    mode = "fisher_empirical"
    scan = estimate(TM.loss_of_logits(_twice(TM.stacked_mlp_logits)), args, mode, ctors=FULL_DENSE)
    loop_loss = TM.loss_of_logits(_twice(TM.unrolled_mlp_logits))
    loop = estimate(loop_loss, loop_args, mode, ctors=FULL_DENSE)
    est = scan["estimator"]
    assert [b.block_name for b in est.blocks] == ["Full", "StackedBlock(Full)", "Full"]
    assert [layer.num_uses for layer in est._traced.layers] == [2, 2, 2]
    assert {(e.uses, e.stack_size) for e in est.report.entries if "hidden" in e.path} == {
        (2, DEPTH)
    }
    assert re.search(rf"^hidden/w\s+1 \(x2\) \({DEPTH} stacked\)", str(est.report), re.M)
    perm = unrolled_positions(params, TM.unstack_mlp)
    assert_close(scan["dense"][np.ix_(perm, perm)], loop["dense"])


# ----------------------------------------------------------------------------- generic tags


def _gain_logits(params, x, stacked: bool, scan: bool):
    """``DEPTH`` steps of ``h = tanh(h @ w) * g``, w a dense layer and g a generic
    parameter (tagged by hand); stacked (w [L, W, W], g [L, W]) or shared by all steps."""

    def step(h, p):
        w, g = p
        y = kfacx.register_dense(jnp.tensordot(h, w, axes=1), h, w)
        return jnp.tanh(y) * kfacx.register_generic(g)[None], None

    if scan and stacked:
        return jax.lax.scan(step, x, (params["w"], params["g"]))[0]
    if scan:
        return jax.lax.scan(lambda h, _: step(h, (params["w"], params["g"])), x, length=DEPTH)[0]
    h = x
    for i in range(DEPTH):
        layer = params["layers"][i] if stacked else params
        h = step(h, (layer["w"], layer["g"]))[0]
    return h


def _unstack_gain(params):
    return dict(layers=[dict(w=params["w"][i], g=params["g"][i]) for i in range(DEPTH)])


@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "shared"])
def test_generic_tag_inside_scan(stacked):
    rng = np.random.default_rng(0)
    lead = (DEPTH,) if stacked else ()
    params = f64(
        dict(
            w=rng.standard_normal(lead + (WIDTH, WIDTH)) / 2, g=rng.standard_normal(lead + (WIDTH,))
        )
    )
    batch = f64((rng.standard_normal((BATCH, WIDTH)), rng.standard_normal((BATCH, WIDTH))))
    to_unrolled = _unstack_gain if stacked else (lambda p: p)
    scan_loss = TM.loss_of_logits(_gain_logits, stacked=stacked, scan=True)
    loop_loss = TM.loss_of_logits(_gain_logits, stacked=stacked, scan=False)
    scan = estimate(scan_loss, (params, batch), auto=False)
    est, dense = scan["estimator"], scan["dense"]
    loop_dense = estimate(loop_loss, (to_unrolled(params), batch), auto=False)["dense"]
    want_blocks = ["StackedBlock(DenseTwoKroneckerFactored)", "StackedBlock(Diagonal)"]
    assert [b.block_name for b in est.blocks] == (
        want_blocks if stacked else [DENSE_KF, "Diagonal"]
    )
    perm = unrolled_positions(params, to_unrolled)
    assert_close(dense[np.ix_(perm, perm)], loop_dense)


# ----------------------------------------------------------------------------- tracer data


def test_layer_data_layout():
    """Stacked layers keep the layer axis first (samples before it in ``sampled``);
    layers shared by the steps have the steps folded into the batch axis, step-major."""
    cts = [jnp.ones((2, BATCH, D_OUT), jnp.float64)]

    @functools.partial(fast_jit, static_argnums=0)
    def data(loss, args):
        return kfacx.layer_tags_vjp(loss, args)[1].sampled(cts)

    loss, _, _, (params, batch) = losses("stacked", tag=True)
    _, hidden, _ = data(loss, (params, batch))
    assert hidden["inputs"][0].shape == (DEPTH, BATCH, WIDTH)
    assert [p.shape for p in hidden["params"]] == [(DEPTH, WIDTH, WIDTH), (DEPTH, WIDTH)]
    assert hidden["outputs_tangent"][0].shape == (2, DEPTH, BATCH, WIDTH)
    h = jnp.tanh(TM.dense(batch[0], params["inp"]["w"], params["inp"]["b"]))
    for i in range(DEPTH):
        assert_close(hidden["inputs"][0][i], h)
        h = jnp.tanh(TM.dense(h, params["hidden"]["w"][i], params["hidden"]["b"][i]))

    loss, _, _, (params, batch) = losses("rnn", variant="reverse", tag=True)
    wx, _, _ = data(loss, (params, batch))
    assert wx["inputs"][0].shape == (TIME * BATCH, D_IN)
    assert wx["outputs_tangent"][0].shape == (2, TIME * BATCH, WIDTH)
    # Row block t of the folded inputs is step t's input (slice t of xs, also in reverse).
    assert_close(wx["inputs"][0].reshape(TIME, BATCH, D_IN), jnp.swapaxes(batch[0], 0, 1))


# ----------------------------------------------------------------------------- unsupported


def warned(*patterns: str):
    """Records the warnings of a block; each pattern must match one of them."""
    return _Warned(patterns)


class _Warned(warnings.catch_warnings):
    def __init__(self, patterns):
        super().__init__(record=True)
        self.patterns = patterns

    def __enter__(self):
        self.caught = super().__enter__()
        warnings.simplefilter("always")
        return self.caught

    def __exit__(self, *exc):
        super().__exit__(*exc)
        if exc[0] is None:
            messages = [str(w.message) for w in self.caught]
            for pattern in self.patterns:
                assert any(re.search(pattern, m) for m in messages), (pattern, messages)


def _nested_loss(tag: bool):
    def loss(params, batch):
        x, t = batch

        def inner(h, w):
            y = jnp.tensordot(h, w, axes=1)
            return jnp.tanh(kfacx.register_dense(y, h, w) if tag else y), None

        h, _ = jax.lax.scan(lambda h, ws: jax.lax.scan(inner, h, ws), x, params["w"])
        return TM.loss_of_logits(lambda p, h: jnp.tensordot(h, p["out"], axes=1))(params, (h, t))

    return loss


def _nested_problem():
    rng = np.random.default_rng(0)
    params = dict(w=rng.standard_normal((2, DEPTH, WIDTH, WIDTH)) / 3)
    params["out"] = rng.standard_normal((WIDTH, D_OUT))
    return f64(params), f64((rng.standard_normal((BATCH, WIDTH)), np.ones((BATCH, D_OUT))))


def test_two_levels_of_stacking_raise_or_fall_back():
    """Nested scans that both run over a weight ``[2, DEPTH, ...]`` (layers within layers)
    are served by neither a stacked block nor folding; nested scans that close over the
    parameters at one level are (tests/test_nested_scans.py)."""
    args = _nested_problem()
    with pytest.raises(ValueError, match=r"dense_tag\[w\] sits in nested `scan`s that both run"):
        kfacx.BlockDiagonalCurvature(_nested_loss(True), auto_register_tags=False).init(KEY, args)
    loss = _nested_loss(False)
    with warned(r"two levels of stacking.*\['w'\]", r"no layer pattern matched.*\['w'\]"):
        tagged, report = kfacx.auto_register_tags(loss, args)
    assert report.unmatched == ("w",)
    assert {e.path: e.tag for e in report.entries} == {"w": "generic_tag", "out": "dense_tag"}
    assert_trees_close(*_both(jax.grad, tagged, loss, args))
    est = kfacx.BlockDiagonalCurvature(loss)
    with warned("two levels", r"no layer pattern matched.*\['w'\]"):
        est.init(KEY, args)
    assert [b.block_name for b in est.blocks] == ["Diagonal", DENSE_KF]


def _mixed_loss(tag: bool):
    """A dense layer in a scan whose weight is scanned over but whose bias is closed over."""

    def loss(params, batch):
        x, t = batch

        def body(h, w):
            y = TM.dense(h, w, params["b"])
            return jnp.tanh(kfacx.register_dense(y, h, w, params["b"]) if tag else y), None

        h, _ = jax.lax.scan(body, x, params["w"])
        return TM.loss_of_logits(lambda p, h: h)(params, (h, t))

    return loss


def test_mixed_stacked_and_shared_parameters_raise_or_are_split():
    rng = np.random.default_rng(0)
    params = f64(dict(w=rng.standard_normal((DEPTH, WIDTH, WIDTH)) / 3, b=np.ones(WIDTH)))
    args = (params, f64((rng.standard_normal((BATCH, WIDTH)), np.ones((BATCH, WIDTH)))))
    est = kfacx.BlockDiagonalCurvature(_mixed_loss(True), auto_register_tags=False)
    with pytest.raises(ValueError, match=r"\['w'\] as scanned-over.*\['b'\] as closed-over"):
        est.init(KEY, args)
    # Detection does not tag it as one layer: the weight and the bias become two layers.
    loss = _mixed_loss(False)
    with warned(r"runs over \(xs\).*closes over \(consts\).*'w'"):
        tagged, report = kfacx.auto_register_tags(loss, args)
    got = {e.path: (e.tag, e.source, e.stack_size, e.uses) for e in report.entries}
    assert got == {
        "w": ("dense_tag", "dense", DEPTH, 1),
        "b": ("scale_and_shift_tag", "shift", None, DEPTH),
    }
    assert_trees_close(*_both(jax.grad, tagged, loss, args))


def test_tags_in_while_loop_raise_and_carried_parameters_fall_back():
    params, (x, t) = stacked_problem()
    w = params["hidden"]["w"][0]

    def while_loss(params, batch):
        def body(c):
            i, h = c
            return i + 1, jnp.tanh(kfacx.register_dense(jnp.tensordot(h, params, 1), h, params))

        h = jax.lax.while_loop(lambda c: c[0] < 2, body, (0, batch[0]))[1]
        return TM.loss_of_logits(lambda p, h: h)(params, (h, batch[1]))

    batch = (jnp.ones((BATCH, WIDTH)), jnp.ones((BATCH, WIDTH)))
    with pytest.raises(ValueError, match=r"inside a `while` primitive"):
        kfacx.BlockDiagonalCurvature(while_loss, auto_register_tags=False).init(KEY, (w, batch))

    def carry_loss(params, batch):
        def body(c, _):
            h, w = c
            return (jnp.tanh(jnp.tensordot(h, w, 1)), 0.5 * w), None

        (h, _), _ = jax.lax.scan(body, (batch[0], params["w"]), None, length=2)
        return TM.loss_of_logits(lambda p, h: h)(params, (h, batch[1]))

    with warned(r"as its carry.*\['w'\]", r"no layer pattern matched.*\['w'\]"):
        tagged, report = kfacx.auto_register_tags(carry_loss, (dict(w=w), batch))
    assert report.unmatched == ("w",)
    assert_trees_close(*_both(jax.grad, tagged, carry_loss, (dict(w=w), batch)))


def test_tagged_scan_body_constants_become_const_operands():
    """A scan body holding constants (a `ClosedJaxpr` with consts) is rebound with the
    constants as leading const operands of the scan."""
    from kfacx.graph_matcher import _auto_register as AR

    rng = np.random.default_rng(0)
    mask, w = rng.standard_normal(WIDTH), f64(rng.standard_normal((DEPTH, WIDTH, WIDTH)) / 3)
    x = f64(rng.standard_normal((BATCH, WIDTH)))

    def f(w, x):
        return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w + jnp.asarray(mask)[None]), None), x, w)

    closed = jax.make_jaxpr(f)(w, x)
    (eqn,) = [e for e in closed.jaxpr.eqns if e.primitive.name == "scan"]
    nc, body = eqn.params["num_consts"], eqn.params["jaxpr"]
    assert nc == 1
    # Move the const operand into the body's own consts.
    values = dict(zip(closed.jaxpr.constvars, closed.consts, strict=True))
    inner = body.jaxpr.replace(constvars=body.jaxpr.invars[:nc], invars=body.jaxpr.invars[nc:])
    closed_body = jax.extend.core.ClosedJaxpr(inner, [values[v] for v in eqn.invars[:nc]])
    eqn = eqn.replace(
        invars=eqn.invars[nc:], params=dict(eqn.params, num_consts=0, jaxpr=closed_body)
    )
    want = kfacx._jaxpr.bind_eqn(eqn, [x, w])
    origins = kfacx._jaxpr.scan_body_origins(eqn, [None, 0])
    plan = AR._plan(inner, origins, list(kfacx.DEFAULT_GRAPH_PATTERNS), {}, [], True)
    assert [m.stacked for m in plan.matches] == [True]
    tagged = jax.make_jaxpr(lambda x, w: AR._rebind_scan(eqn, [x, w], plan))(x, w)
    (scan,) = tagged.jaxpr.eqns
    assert scan.params["num_consts"] == 1 and scan.params["jaxpr"].consts == []
    assert kfacx._jaxpr.contains_tags(scan.params["jaxpr"].jaxpr)
    got = jax.extend.core.jaxpr_as_fun(tagged)(x, w)
    for g, v in zip(got, want, strict=True):
        assert_close(g, v)


# ----------------------------------------------------------------------------- masks


def _masked_loss(logits_fn):
    """Softmax cross-entropy averaged over the real (mask 1) examples."""

    def loss(params, batch):
        x, labels, mask = batch
        logits = kfacx.register_softmax_cross_entropy_loss(logits_fn(params, x), labels, mask=mask)
        nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1)[:, 0]
        return jnp.sum(mask * nll) / jnp.maximum(jnp.sum(mask), 1.0)

    return loss


@pytest.mark.parametrize("name", sorted(MODELS))
def test_padding_mask_with_one_pass_statistics(name):
    """A padded batch with ``example_mask`` gives the statistics of its real examples
    only: the mask is shared by the slices of a stacked layer and repeated for every
    step of a layer applied at every step. Folding the statistics in equals an update."""
    params, (x, _) = MODELS[name][3]()
    real = np.array([1, 0, 1, 1], bool)
    labels = np.arange(BATCH) % D_OUT
    padded = (x, labels, f64(real.astype(float)))
    only_real = jax.tree_util.tree_map(lambda a: a[real], padded)
    loss = _masked_loss(functools.partial(MODELS[name][0], tag=True))
    est = kfacx.BlockDiagonalCurvature(
        loss, default_estimation_mode="ggn_exact", auto_register_tags=False
    )

    @fast_jit
    def run(padded, only_real):
        (v_pad, g_pad, s_pad), (v_real, g_real, s_real) = (
            est.value_grads_and_curvature_stats(KEY, (params, padded), example_mask=padded[2]),
            est.value_grads_and_curvature_stats(KEY, (params, only_real)),
        )
        state = est.init(KEY, (params, only_real))
        from_stats = est.update_curvature_estimate_from_stats(state, s_pad, 0.0, 1.0)
        updated = est.update_curvature_matrix_estimate(
            state, 0.0, 1.0, None, KEY, (params, only_real)
        )
        dense = (est.to_dense_matrix(from_stats), est.to_dense_matrix(updated))
        return (v_pad, g_pad, s_pad.blocks), (v_real, g_real, s_real.blocks), dense

    got, want, (from_stats, updated) = run(padded, only_real)
    if name == "stacked":
        assert [b.block_name for b in est.blocks][1] == f"StackedBlock({DENSE_KF})"
        assert got[2][1][0].shape[0] == DEPTH  # statistics with the layer axis
    assert_trees_close(got, want)
    assert_close(from_stats, updated)


def test_optimizer_trains_a_layer_stack():
    """`kfacx.Optimizer` (detection from ``jax.value_and_grad(loss)``) on the Haiku layer
    stack: stacked blocks, and the loss goes down."""
    model, params, (x, _) = haiku_problem()
    labels = np.arange(BATCH) % D_OUT
    loss = _masked_loss(model.apply)
    batch = (x, labels, jnp.ones(BATCH))
    opt = kfacx.Optimizer(
        jax.value_and_grad(loss),
        use_adaptive_learning_rate=True,
        use_adaptive_momentum=True,
        use_adaptive_damping=True,
        initial_damping=1.0,
    )
    state = opt.init(params, KEY, batch)
    assert opt.estimator.report.unmatched == ()
    assert f"StackedBlock({DENSE_KF})" in [b.block_name for b in opt.estimator.blocks]
    value = fast_jit(loss)  # one compilation instead of one per operation run eagerly
    start = value(params, batch)
    for i in range(5):
        params, state, _ = opt.step(params, state, jax.random.PRNGKey(i), batch=batch)
    assert float(value(params, batch)) < 0.7 * float(start)
