"""Detection of layers whose weight is concatenated from parameter leaves, and of the
concatenations it does not serve (they stay on the fallback block, with a note)."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kfacx

B, D, H = 3, 2, 4


def _loss(logits_fn):
    def loss(p, data):
        x, t = data
        out = logits_fn(p, x)
        kfacx.register_squared_error_loss(out, t)
        return 0.5 * jnp.sum((out - t) ** 2)

    return loss


def _detect(logits_fn, params, out=H):
    data = (jnp.ones((B, D)), jnp.zeros((B, out)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tagged, report = kfacx.auto_register_tags(_loss(logits_fn), (params, data))
    return report, [str(w.message) for w in caught], tagged, data


def _params(*names, rows=D, cols=H // 2):
    rng = np.random.default_rng(0)
    return {n: jnp.asarray(rng.standard_normal((rows, cols)), jnp.float32) for n in names}


def test_nested_concatenation_of_reshaped_leaves_is_one_layer():
    # [w_x; w_h] per gate, the gates side by side; one w_h stored flat.
    params = _params("xa", "xb") | _params("ha", rows=1) | {"hb": jnp.ones((H // 2,))}

    def logits(p, x):
        xh = jnp.concatenate([x, x[:, :1]], -1)
        gate_b = jnp.concatenate([p["xb"], p["hb"].reshape(1, H // 2)], 0)
        w = jnp.concatenate([jnp.concatenate([p["xa"], p["ha"]], 0), gate_b], 1)
        return xh @ w

    report, caught, tagged, data = _detect(logits, params)
    assert report.unmatched == () and report.notes == () and caught == []
    assert {e.layer for e in report.entries} == {0}
    assert {e.source for e in report.entries} == {"dense (concatenated)"}
    (tag,) = [
        e for e in jax.make_jaxpr(tagged)(params, data).eqns if e.primitive.name == "dense_tag"
    ]
    assert tag.params["param_views"][0][0] == "concat"
    # one compilation instead of one per operation run eagerly
    got, want = jax.jit(lambda *a: (tagged(*a), _loss(logits)(*a)))(params, data)
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_concatenation_with_a_non_parameter_gets_a_note_and_the_fallback():
    params = _params("w")

    def logits(p, x):
        return x @ jnp.concatenate([p["w"], jnp.full((D, H // 2), 0.5)], -1)

    report, caught, _, _ = _detect(logits, params)
    assert report.unmatched == ("w",)
    (note,) = report.notes
    assert "concatenated with values that are not parameters" in note and "['w']" in note
    assert any("no layer pattern matched parameters ['w']" in c for c in caught)


def test_a_leaf_read_twice_is_not_served():
    params = _params("w")
    report, caught, _, _ = _detect(lambda p, x: x @ jnp.concatenate([p["w"], p["w"]], -1), params)
    assert report.unmatched == ("w",) and report.notes == ()
    assert any("no layer pattern matched parameters ['w']" in c for c in caught)


def test_a_leaf_in_two_concatenations_serves_the_first_with_a_note():
    params = _params("a", "b", "c")

    def logits(p, x):
        first = x @ jnp.concatenate([p["a"], p["b"]], -1)
        return first + x @ jnp.concatenate([p["a"], p["c"]], -1)

    report, _, _, _ = _detect(logits, params)
    assert report.unmatched == ("c",)
    assert report.entries[0].layer == report.entries[1].layer != report.entries[2].layer
    (note,) = report.notes
    assert "reuses parameters of a different kind of layer" in note


@pytest.mark.parametrize("with_bias", [False, True])
def test_concatenated_weight_used_twice_is_one_layer_used_twice(with_bias):
    params = _params("a", "b") | {"c": jnp.zeros(H // 2), "d": jnp.ones(H // 2)}

    def logits(p, x):
        w = jnp.concatenate([p["a"], p["b"]], -1)
        b = jnp.concatenate([p["c"], p["d"]])[None] if with_bias else 0.0
        h = jnp.tanh(x @ w + b)
        return jnp.tanh(h[:, :D] @ w + b)

    if not with_bias:
        params = {k: params[k] for k in ("a", "b")}
    report, caught, _, _ = _detect(logits, params)
    assert report.unmatched == () and report.notes == () and caught == []
    assert {(e.layer, e.uses) for e in report.entries} == {(0, 2)}


def test_concatenated_scale_and_shift_is_one_layer_of_any_kind():
    rng = np.random.default_rng(1)
    params = {k: jnp.asarray(rng.standard_normal(H // 2), jnp.float32) for k in "abcd"}

    def logits(p, x):
        h = jnp.concatenate([x, x], -1)
        scale, shift = jnp.concatenate([p["a"], p["b"]]), jnp.concatenate([p["c"], p["d"]])
        return h * scale[None] + shift[None]

    report, caught, _, data = _detect(logits, params)
    assert report.unmatched == () and report.notes == () and caught == []
    assert {(e.tag, e.source) for e in report.entries} == {
        ("scale_and_shift_tag", "scale_and_shift (concatenated)")
    }

    def reference(p, x):
        return jnp.concatenate([x, x], -1) * p["scale"][None] + p["shift"][None]

    ref_params = {
        "scale": jnp.concatenate([params["a"], params["b"]]),
        "shift": jnp.concatenate([params["c"], params["d"]]),
    }
    (est, dense), (_, ref_dense) = (
        _ggn(_loss(f), (p, data)) for f, p in ((logits, params), (reference, ref_params))
    )
    assert [b.block_name for b in est.blocks] == ["ViewBlock(ScaleAndShiftDiagonal)"]
    # Leaves a, b, c, d are the reference's scale and shift, in order.
    np.testing.assert_allclose(dense, ref_dense, rtol=1e-6)
    assert np.abs(dense).max() > 0


def _ggn(loss, args):
    est = kfacx.BlockDiagonalCurvature(loss, default_estimation_mode="ggn_exact")
    key = jax.random.PRNGKey(0)

    @jax.jit
    def dense(args):
        state = est.init(key, args)
        state = est.update_curvature_matrix_estimate(state, 0.0, 1.0, None, key, args)
        return est.to_dense_matrix(state)

    return est, np.asarray(dense(args))


def test_slices_of_one_parameter_reordered_into_one_weight():
    params = _params("w", cols=H)
    k = H // 2

    def logits(p, x):  # gates stored in another order than the product's
        return jnp.tanh(x @ jnp.concatenate([p["w"][:, k:], p["w"][:, :k]], -1))

    report, caught, _, data = _detect(logits, params)
    assert report.unmatched == () and report.notes == () and caught == []
    assert [e.source for e in report.entries] == ["dense (sliced)"]
    est, dense = _ggn(_loss(logits), (params, data))
    assert [b.block_name for b in est.blocks] == ["ViewBlock(DenseTwoKroneckerFactored)"]
    reordered = {"w": jnp.concatenate([params["w"][:, k:], params["w"][:, :k]], -1)}
    _, ref_dense = _ggn(_loss(lambda p, x: jnp.tanh(x @ p["w"])), (reordered, data))
    perm = np.concatenate(
        [np.arange(D * H).reshape(D, H)[:, k:], np.arange(D * H).reshape(D, H)[:, :k]], -1
    ).ravel()
    np.testing.assert_allclose(dense[np.ix_(perm, perm)], ref_dense, rtol=1e-5, atol=1e-6)
