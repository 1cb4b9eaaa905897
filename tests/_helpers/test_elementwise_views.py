"""Parameters passed through an elementwise map before their layer.

A learned per-feature query scaler ``h * (c * softplus(s))``, a log-scale
``h * exp(log_scale)``, a weight scaled by a constant ``h @ (2.0 * w)``, a masked weight
``h @ (w * mask)``: the layer computes with ``w = f(theta)``. kfacx serves ``theta``
with the layer's own block built for ``w`` and carried through the map's diagonal
Jacobian ``D = diag(f'(theta))`` (`kfacx.blocks.MappedBlock`): in float64 under
``ggn_exact`` the curvature is ``D F_w D`` with ``F_w`` that of the model written with
``w`` as its leaf, the exact GGN's diagonal for a scale, and the damped inverse that of
``D F_w D`` where the block's form is exact (diagonal blocks, a constant scale).
"""

from __future__ import annotations

import functools
import warnings

import _models as TM
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kfacx

KEY = jax.random.PRNGKey(0)
B, DI, DH, DO = 6, 3, 4, 2
DAMPING = 0.1
MASK = np.tril(np.ones((DI, DH)))


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


def _squared_loss(out, targets):
    out = kfacx.register_squared_error_loss(out, targets)
    return jnp.mean(jnp.sum((out - targets) ** 2, -1))


#: The maps of the plain JAX model: leaf -> (f, f').
MAPS = {
    "w1": (lambda w: w * MASK, lambda w: jnp.broadcast_to(MASK, w.shape)),
    "s": (lambda s: 1.4 * jax.nn.softplus(s), lambda s: 1.4 * jax.nn.sigmoid(s)),
    "w2": (lambda w: 2.0 * w, lambda w: jnp.full(w.shape, 2.0)),
    "ls": (jnp.exp, jnp.exp),
}


def net(p, x, mapped=True):
    """A masked dense layer, a softplus query scaler, a scaled dense layer, a log-scale."""
    w = {k: MAPS[k][0](p[k]) if mapped else p[k] for k in MAPS}
    h = jnp.tanh(x @ w["w1"] + p["b1"][None])
    h = jnp.tanh((h * w["s"][None]) @ w["w2"])
    return (h * w["ls"][None]) @ p["w3"]


def loss(p, data, mapped=True):
    return _squared_loss(net(p, data[0], mapped), data[1])


def reference_loss(p, data):
    return loss(p, data, mapped=False)


def _random(rng, *shape, scale=1.0):
    return jnp.asarray(scale * rng.standard_normal(shape))


@functools.cache
def problem():
    """``(params, data, reference params, D)``: the reference's leaves are ``f(theta)``."""
    rng = np.random.default_rng(0)
    shapes = dict(w1=(DI, DH), b1=(DH,), s=(DH,), w2=(DH, DH), ls=(DH,), w3=(DH, DO))
    params = {k: _random(rng, *s, scale=0.5 if k == "ls" else 1.0) for k, s in shapes.items()}
    data = (_random(rng, B, DI), _random(rng, B, DO))

    @jax.jit  # one compilation instead of one per operation run eagerly
    def mapped(params):
        ref = dict(params, **{k: f(params[k]) for k, (f, _) in MAPS.items()})
        return ref, {k: MAPS[k][1](v) if k in MAPS else jnp.ones_like(v) for k, v in params.items()}

    ref, d = mapped(params)
    return params, data, ref, np.concatenate([np.ravel(a) for a in jax.tree_util.tree_leaves(d)])


def estimate(loss_fn, args, vector):
    """One jitted program: one ``ggn_exact`` update and refresh; the dense matrix, the
    exact damped inverse and the product of ``vector``. No warning allowed."""
    est = kfacx.BlockDiagonalCurvature(
        loss_fn, default_estimation_mode="ggn_exact", exact_powers_to_cache=(-1.0,)
    )

    def run(args, vector):
        state = est.init(KEY, args)
        state = est.update_curvature_matrix_estimate(state, 0.0, 1.0, None, KEY, args)
        state = est.update_cache(state, DAMPING)
        inverse = est.multiply_inverse(state, vector, DAMPING, exact_power=True, use_cached=True)
        return est.to_dense_matrix(state), inverse, est.multiply(state, vector, DAMPING)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dense, inverse, product = jax.jit(run)(args, vector)
    flat = [
        np.concatenate([np.ravel(a) for a in jax.tree_util.tree_leaves(t)])
        for t in (inverse, product)
    ]
    return est, np.asarray(dense), *flat


@functools.cache
def estimates():
    params, data, ref, _ = problem()
    rng = np.random.default_rng(7)
    vector = jax.tree_util.tree_map(lambda a: _random(rng, *a.shape), params)
    flat_v = np.concatenate([np.ravel(a) for a in jax.tree_util.tree_leaves(vector)])
    return (
        estimate(loss, (params, data), vector),
        estimate(reference_loss, (ref, data), vector),
        flat_v,
    )


def _layout(params):
    """Per leaf path: its slice of the flattened parameters."""
    out, start = {}, 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        out[jax.tree_util.keystr(path)[2:-2]] = slice(start, start + leaf.size)
        start += leaf.size
    return out


# ----------------------------------------------------------------------------- detection


def test_every_parameter_is_served_through_its_map():
    (est, *_), (ref_est, *_), _ = estimates()
    report = est.report
    assert report.unmatched == () and report.notes == ()
    found = {e.path: (e.source, e.block) for e in report.entries}
    view = "ViewBlock(MappedBlock({}))"
    assert found == {
        "w1": ("dense_with_bias (masked)", view.format("DenseTwoKroneckerFactored")),
        "b1": ("dense_with_bias (masked)", view.format("DenseTwoKroneckerFactored")),
        "s": ("scale (softplus, scaled)", view.format("ScaleAndShiftDiagonal")),
        "w2": ("dense (scaled)", view.format("DenseTwoKroneckerFactored")),
        "ls": ("scale (exp)", view.format("ScaleAndShiftDiagonal")),
        "w3": ("dense", "DenseTwoKroneckerFactored"),
    }
    layers = {e.path: e.layer for e in report.entries}
    assert layers == {e.path: e.layer for e in ref_est.report.entries}


def _form(fn, **shapes):
    return fn, {
        k: jnp.asarray(np.random.default_rng(1).standard_normal(s)) for k, s in shapes.items()
    }


def _norm(p, h):
    m, v = jnp.mean(h, -1, keepdims=True), jnp.var(h, -1, keepdims=True)
    return (h - m) * ((1 + p["g"])[None] * jax.lax.rsqrt(v + 1e-5)) + p["b"][None]


def _masked_in_scan(p, h):
    def step(carry, _):
        return jnp.tanh(carry @ (p["w"] * np.triu(np.ones((DI, DI))))), None

    return jax.lax.scan(step, h, None, length=2)[0]


def _masked_in_checkpoint(p, h):
    return jax.checkpoint(lambda w, h: h @ (w * MASK[:, :DO]))(p["w"], h)


#: name -> ((params, h) -> output, parameter shapes, the mapped parameter's "found by").
FORMS = {
    "sigmoid_gate": (
        lambda p, h: h * jax.nn.sigmoid(p["g"])[None],
        dict(g=(DI,)),
        "scale (sigmoid)",
    ),
    "shifted_scale": (lambda p, h: h * (p["g"] - 0.5)[None], dict(g=(DI,)), "scale (shifted)"),
    "squared_scale": (lambda p, h: h * jnp.square(p["g"])[None], dict(g=(DI,)), "scale (squared)"),
    "negated_divided": (lambda p, h: h @ (-p["w"] / 4.0), dict(w=(DI, DO)), "dense (scaled)"),
    "jnp_mask": (
        lambda p, h: h @ (p["w"] * jnp.tril(jnp.ones((DI, DO)))),
        dict(w=(DI, DO)),
        "dense (masked)",
    ),
    # (JAX passes a constant the body closes over as an operand of the scan, checkpoint)
    "mask_in_scan": (_masked_in_scan, dict(w=(DI, DI)), "dense (masked)"),
    "mask_in_checkpoint": (_masked_in_checkpoint, dict(w=(DI, DO)), "dense (masked)"),
    "scaled_then_cast": (
        lambda p, h: h.astype(jnp.float32) @ (2.0 * p["w"]).astype(jnp.float32),
        dict(w=(DI, DO)),
        "dense (scaled)",
    ),
    "cast": (
        lambda p, h: h.astype(jnp.float32) @ p["w"].astype(jnp.float32),
        dict(w=(DI, DO)),
        "dense",  # a cast is a shape-only operation: the weight is the leaf
    ),
    "offset_norm": (_norm, dict(g=(DI,), b=(DI,)), "offset_normalization"),
}


@pytest.mark.parametrize("name", sorted(FORMS))
def test_forms_of_maps_are_found(name):
    fn, shapes, source = FORMS[name]
    params = {
        k: jnp.asarray(np.random.default_rng(1).standard_normal(s)) for k, s in shapes.items()
    }
    out = fn(params, jnp.zeros((B, DI))).shape[-1]

    def loss_fn(p, data):
        return _squared_loss(fn(p, data[0]).astype(jnp.float64), data[1])

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, report = kfacx.auto_register_tags(
            loss_fn, (params, (jnp.ones((B, DI)), jnp.ones((B, out))))
        )
    assert report.unmatched == () and report.notes == ()
    assert {e.source for e in report.entries} == {source}


# ----------------------------------------------------------------------------- curvature


def test_curvature_is_the_effective_layers_carried_through_d():
    (_, dense, *_), (_, ref_dense, *_), _ = estimates()
    d = problem()[3]
    np.testing.assert_allclose(dense, d[:, None] * ref_dense * d[None, :], rtol=1e-10, atol=1e-12)


def test_scales_are_the_exact_ggn_diagonal():
    params, data, _, _ = problem()
    (_, dense, *_), _, _ = estimates()
    flat, unravel = jax.flatten_util.ravel_pytree(params)
    # jitted: one compilation instead of one per operation run eagerly
    jac = jax.jit(jax.jacfwd(lambda f: net(unravel(f), data[0]).reshape(-1)))(flat)
    ggn = 2.0 / B * jac.T @ jac  # mean over the batch of sum((out - t)^2)
    layout = _layout(params)
    for name in ("s", "ls"):
        part = layout[name]
        np.testing.assert_allclose(np.diag(dense)[part], np.diag(ggn)[part], rtol=1e-10)


def test_product_is_exact_and_inverse_exact_where_the_form_is():
    (_, dense, inverse, product), _, v = estimates()
    np.testing.assert_allclose(product, (dense + DAMPING * np.eye(len(dense))) @ v, rtol=1e-10)
    layout = _layout(problem()[0])
    for name in ("s", "ls", "w2"):  # diagonal blocks, and a weight scaled by a constant
        part = layout[name]
        block = dense[part, part] + DAMPING * np.eye(part.stop - part.start)
        np.testing.assert_allclose(inverse[part], np.linalg.solve(block, v[part]), rtol=1e-10)


def test_batched_refresh_equals_each_blocks_own(monkeypatch):
    # The batched refresh inverts the inner Kronecker factors at the damping l / m
    # (`MappedBlock.inverse_refresh`), as each block's own `update_cache` does.
    params, data, *_ = problem()
    est = kfacx.BlockDiagonalCurvature(loss, default_estimation_mode="ggn_exact")
    vector = jax.tree_util.tree_map(jnp.ones_like, params)

    def run(args):
        state = est.init(KEY, args)
        state = est.update_curvature_matrix_estimate(state, 0.0, 1.0, None, KEY, args)
        state = est.update_cache(state, DAMPING)
        return est.multiply_inverse(state, vector, DAMPING, use_cached=True)

    batched = jax.jit(run)((params, data))
    monkeypatch.setattr(kfacx.estimator._refresh, "BATCH_INVERSES", False)
    own = jax.jit(run)((params, data))
    for a, b in zip(
        jax.tree_util.tree_leaves(batched), jax.tree_util.tree_leaves(own), strict=True
    ):
        np.testing.assert_allclose(a, b, rtol=1e-9)


# ----------------------------------------------------------------------------- Flax, training


class QueryScaler(nn.Module):
    """A dense layer, a learned per-feature scale ``softplus(scale)``, a dense head."""

    mapped: bool = True

    @nn.compact
    def __call__(self, x):
        h = jnp.tanh(nn.Dense(DH, param_dtype=jnp.float64)(x))
        scale = self.param("scale", nn.initializers.normal(1.0, jnp.float64), (DH,))
        h = h * (jax.nn.softplus(scale) if self.mapped else scale)[None]
        return nn.Dense(DO, param_dtype=jnp.float64)(h)


def test_flax_softplus_scale_is_served_through_its_map():
    params, data, *_ = problem()
    model = QueryScaler()
    theta = jax.jit(model.init)(KEY, data[0])  # one compilation
    ref = jax.tree_util.tree_map(lambda a: a, theta)
    ref["params"]["scale"] = jax.nn.softplus(theta["params"]["scale"])
    d = jax.tree_util.tree_map(jnp.ones_like, theta)
    d["params"]["scale"] = jax.nn.sigmoid(theta["params"]["scale"])
    d = np.concatenate([np.ravel(a) for a in jax.tree_util.tree_leaves(d)])

    def flax_loss(module):
        return lambda p, data: _squared_loss(module.apply(p, data[0]), data[1])

    vector = jax.tree_util.tree_map(jnp.ones_like, theta)
    est, dense, *_ = estimate(flax_loss(model), (theta, data), vector)
    _, ref_dense, *_ = estimate(flax_loss(QueryScaler(mapped=False)), (ref, data), vector)
    scale = [e for e in est.report.entries if e.path.endswith("scale")]
    assert [(e.source, e.block) for e in scale] == [
        ("scale (softplus)", "ViewBlock(MappedBlock(ScaleAndShiftDiagonal))")
    ]
    assert est.report.unmatched == ()
    np.testing.assert_allclose(dense, d[:, None] * ref_dense * d[None, :], rtol=1e-10, atol=1e-12)


def test_optimizer_steps_lower_the_loss():
    # The exact curvature, not a sample of it: with 6 examples and a fixed rate, whether
    # a sampled step overshoots depends on the random stream, not on the views.
    params, data, *_ = problem()
    _, losses = TM.fixed_rate_run(
        loss, params, data, steps=3, learning_rate=0.2, estimation_mode="ggn_exact"
    )
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0], losses


def _stacked_loss(mapped):
    """Three layers stacked by a `lax.scan` over their parameters (`hk.layer_stack`)."""

    def loss_fn(p, data):
        def step(h, w):
            weight, scale = (2.0 * w["w"], jnp.exp(w["ls"])) if mapped else (w["w"], w["ls"])
            return jnp.tanh((h @ weight) * scale[None]), None

        return _squared_loss(jax.lax.scan(step, data[0], p)[0], data[0][::-1])

    return loss_fn


def test_stacked_layers_are_served_through_their_maps():
    _, data, *_ = problem()
    rng = np.random.default_rng(3)
    params = dict(w=_random(rng, 3, DI, DI), ls=_random(rng, 3, DI, scale=0.3))
    ref = dict(w=2.0 * params["w"], ls=jnp.exp(params["ls"]))
    vector = jax.tree_util.tree_map(jnp.ones_like, params)
    est, dense, *_ = estimate(_stacked_loss(True), (params, data), vector)
    _, ref_dense, *_ = estimate(_stacked_loss(False), (ref, data), vector)
    blocks = {e.path: e.block for e in est.report.entries}
    assert blocks == {
        "ls": "StackedBlock(ViewBlock(MappedBlock(ScaleAndShiftDiagonal)))",
        "w": "StackedBlock(ViewBlock(MappedBlock(DenseTwoKroneckerFactored)))",
    }
    d = np.concatenate([np.ravel(ref["ls"]), np.full(params["w"].size, 2.0)])
    np.testing.assert_allclose(dense, d[:, None] * ref_dense * d[None, :], rtol=1e-10, atol=1e-12)


def test_a_scanned_softplus_scale_is_found_through_the_optimizers_value_and_grad():
    """The optimizer detects layers in ``value_and_grad(loss)``'s forward pass. There a
    scanned ``softplus(s)`` is a jit that also takes its backward pass's constants (as
    scan consts); they are dropped with the residuals, so the scale is served through
    its map, as the estimator of ``loss`` itself serves it (it was a diagonal block)."""
    _, data, *_ = problem()
    params = dict(s=_random(np.random.default_rng(4), 3, DI))

    def loss_fn(p, data):
        scale = lambda h, s: (h * jax.nn.softplus(s)[None], None)  # noqa: E731
        return _squared_loss(jax.lax.scan(scale, data[0], p["s"])[0], data[0][::-1])

    opt = kfacx.Optimizer(jax.value_and_grad(loss_fn), num_burnin_steps=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no parameter falls back to a diagonal block
        opt.init(params, KEY, data)
    blocks = {e.path: e.block for e in opt.estimator.report.entries}
    assert blocks == {"s": "StackedBlock(ViewBlock(MappedBlock(ScaleAndShiftDiagonal)))"}
