"""`TiedKroneckerFactored`: one block for a 2-D weight used by dense and embedding layers.

Statistics against numpy recomputations from the estimation data, the fitted
Kronecker product against the nearest Kronecker product found by an SVD of the
rearranged sum (Van Loan and Pitsianis), and every product against the dense
matrix it stands for (float64).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kfacx import blocks

V, D, B, T = 5, 3, 4, 2
TRANSPOSED = (((1,), (1,)), ((), ()))
PLAIN = (((1,), (0,)), ((), ()))


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


def _role(tag, shapes, x_shape, y_shape, meta=None):
    return blocks.LayerInfo(
        tag_name=tag,
        parameter_paths=tuple(f"p{i}" for i in range(len(shapes))),
        parameter_shapes=tuple(shapes),
        parameter_dtypes=(jnp.float64,) * len(shapes),
        input_shapes=(x_shape,),
        output_shapes=(y_shape,),
        meta=meta or {},
    )


def _tied(roles, role_params, shapes):
    return blocks.LayerInfo(
        tag_name=blocks.TIED_TAG,
        parameter_paths=tuple(f"p{i}" for i in range(len(shapes))),
        parameter_shapes=tuple(shapes),
        parameter_dtypes=(jnp.float64,) * len(shapes),
        roles=tuple(roles),
        role_params=tuple(role_params),
    )


def lm_layer():
    """A table ``[V, D]`` used for the lookup and, transposed, for the logits."""
    embed = _role("embedding_tag", [(V, D)], (B, T), (B, T, D))
    head = _role("dense_tag", [(V, D)], (B * T, D), (B * T, V), {"dimension_numbers": TRANSPOSED})
    return _tied([embed, head], [(0,), (0,)], [(V, D)])


def autoencoder_layer():
    """``w [V, D]`` used as ``x @ w + b1`` and ``h @ w.T + b2``."""
    enc = _role("dense_tag", [(V, D), (D,)], (B, V), (B, D), {"dimension_numbers": PLAIN})
    dec = _role("dense_tag", [(V, D), (V,)], (B, D), (B, V), {"dimension_numbers": TRANSPOSED})
    return _tied([enc, dec], [(0, 1), (0, 2)], [(V, D), (D,), (V,)])


LAYERS = {"lm": lm_layer, "autoencoder": autoencoder_layer}


def _data(name, seed=0, mask=None):
    rng = np.random.default_rng(seed)
    s = 2  # cotangent samples
    if name == "lm":
        roles = (
            dict(
                inputs=(rng.integers(0, V, (B, T)),),
                outputs_tangent=(rng.normal(size=(s, B, T, D)),),
            ),
            dict(
                inputs=(rng.normal(size=(B * T, D)),),
                outputs_tangent=(rng.normal(size=(s, B * T, V)),),
            ),
        )
    else:
        roles = (
            dict(inputs=(rng.normal(size=(B, V)),), outputs_tangent=(rng.normal(size=(s, B, D)),)),
            dict(inputs=(rng.normal(size=(B, D)),), outputs_tangent=(rng.normal(size=(s, B, V)),)),
        )
    if mask is not None:
        roles = tuple(dict(r, mask=jnp.asarray(mask)) for r in roles)
    return dict(roles=roles)


def _reference_factors(name, data):
    """Per role ``(R_r, C_r)`` on the weight's (rows, cols) = (V, D) axes."""
    r0, r1 = data["roles"]
    if name == "lm":
        ids = np.asarray(r0["inputs"][0]).reshape(-1)
        counts = np.bincount(ids, minlength=V) / ids.size
        dy = np.asarray(r0["outputs_tangent"][0]).reshape(-1, D)
        h = np.asarray(r1["inputs"][0])
        g = np.asarray(r1["outputs_tangent"][0]).reshape(-1, V)
        return [(np.diag(counts), dy.T @ dy / B), (g.T @ g / B, h.T @ h / h.shape[0])]
    x, h = np.asarray(r0["inputs"][0]), np.asarray(r1["inputs"][0])
    g0 = np.asarray(r0["outputs_tangent"][0]).reshape(-1, D)
    g1 = np.asarray(r1["outputs_tangent"][0]).reshape(-1, V)
    return [(x.T @ x / B, g0.T @ g0 / B), (g1.T @ g1 / B, h.T @ h / B)]


def _nearest_kronecker(pairs):
    """The Kronecker product nearest (Frobenius) to ``sum_r kron(R_r, C_r)``, by an SVD of
    the rearranged matrix ``sum_r vec(R_r) vec(C_r)^T``."""
    x = sum(np.outer(r.reshape(-1), c.reshape(-1)) for r, c in pairs)
    u, s, vt = np.linalg.svd(x)
    m, n = pairs[0][0].shape[0], pairs[0][1].shape[0]
    return np.kron(s[0] * u[:, 0].reshape(m, m), vt[0].reshape(n, n))


@functools.cache
def _state(name, max_full_size=1024):
    block = blocks.TiedKroneckerFactored(LAYERS[name](), max_full_size=max_full_size)
    state = block.init(jax.random.PRNGKey(0), exact_powers_to_cache=(-1.0,))

    @jax.jit  # one compilation instead of one per operation run eagerly
    def update(state, data):
        state = block.update_curvature_matrix_estimate(state, data, 0.0, 1.0, B)
        return block.update_cache(state, 0.0)

    return block, update(state, _data(name))


@pytest.mark.parametrize("name", LAYERS)
def test_statistics_equal_reference(name):
    block, state = _state(name)
    want = _reference_factors(name, _data(name))
    got = [np.asarray(f.value) for f in state.factors]
    for r, (rows, cols) in enumerate(want):
        np.testing.assert_allclose(got[2 * r], rows, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(got[2 * r + 1], cols, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", LAYERS)
def test_weight_block_is_the_nearest_kronecker_product(name):
    block, state = _state(name)
    pairs = _reference_factors(name, _data(name))
    dense = np.asarray(block.to_dense_matrix(state))
    np.testing.assert_allclose(dense[: V * D, : V * D], _nearest_kronecker(pairs), atol=1e-10)
    # No better Kronecker product exists: perturbing the fit's factors moves it away.
    total = sum(np.kron(r, c) for r, c in pairs)
    fit = np.linalg.norm(dense[: V * D, : V * D] - total)
    rows, cols = (np.asarray(f) for f in block.fitted_factors(state))
    for eps in (1e-3, -1e-3):
        worse = np.kron(rows * (1 + eps), cols + eps * np.eye(D))
        assert np.linalg.norm(worse - total) > fit


def test_biases_get_their_roles_output_factor():
    block, state = _state("autoencoder")
    (_, enc_out), (dec_out, _) = _reference_factors("autoencoder", _data("autoencoder"))
    dense = np.asarray(block.to_dense_matrix(state))
    n = V * D
    np.testing.assert_allclose(dense[n : n + D, n : n + D], enc_out, atol=1e-12)
    np.testing.assert_allclose(dense[n + D :, n + D :], dec_out, atol=1e-12)
    assert not dense[:n, n:].any() and not dense[n : n + D, n + D :].any()


def _vector(block, seed=3):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.normal(size=s)) for s in block.parameters_shapes)


def _flat(vector):
    return np.concatenate([np.ravel(np.asarray(v)) for v in vector])


# (power, exact_power, use_cached)
CONFIGS = [
    (1, False, False),
    (-1, True, True),
    (-1, False, False),
    (-1, True, False),
    (-0.5, True, False),
    (-0.5, False, False),
]


@functools.cache
def _products(name, max_full_size, damping=0.3):
    """``(block, dense matrix, vector, [product of each of CONFIGS])``: one jitted program
    (eager products are compared with jitted ones in `test_jit_products_match_eager`)."""
    block, state = _state(name, max_full_size)
    vector = _vector(block)

    @jax.jit  # one compilation instead of one per operation run eagerly
    def run(state, vector):
        products = [block.multiply_matpower(state, vector, damping, *c) for c in CONFIGS]
        return block.to_dense_matrix(state), products

    dense, products = run(state, vector)
    return block, np.asarray(dense), vector, products


@pytest.mark.parametrize("max_full_size", [1024, 4, 0], ids=["full", "rows_diagonal", "diagonal"])
@pytest.mark.parametrize("name", LAYERS)
@pytest.mark.parametrize(("power", "exact", "cached"), CONFIGS)
def test_products_equal_the_dense_matrix_power(name, max_full_size, power, exact, cached):
    damping = 0.3
    _, dense, vector, products = _products(name, max_full_size, damping)
    got = products[CONFIGS.index((power, exact, cached))]
    vals, vecs = np.linalg.eigh(dense)
    want = vecs @ ((np.clip(vals, 0, None) + damping) ** power * (vecs.T @ _flat(vector)))
    np.testing.assert_allclose(_flat(got), want, rtol=1e-9, atol=1e-10)


def test_long_sides_keep_only_diagonals():
    """A vocabulary longer than max_full_size never gets a vocab x vocab matrix."""
    block, state = _state("lm", max_full_size=4)
    assert block.factor_shapes() == ((V,), (D, D), (V,), (D, D))
    pairs = _reference_factors("lm", _data("lm"))
    got = [np.asarray(f.value) for f in state.factors]
    np.testing.assert_allclose(got[2], np.diag(pairs[1][0]), atol=1e-12)
    np.testing.assert_allclose(got[0], np.diag(pairs[0][0]), atol=1e-12)


def test_padding_examples_leave_the_statistics_unchanged():
    block = blocks.TiedKroneckerFactored(lm_layer())
    mask = np.array([1.0, 1.0, 1.0, 0.0])
    data = _data("lm", mask=mask)
    # The estimator zeroes the cotangents of padding examples; do the same here.
    roles = []
    for role in data["roles"]:
        (t,) = role["outputs_tangent"]
        rows = np.repeat(mask, t.shape[1] // B)
        t = np.asarray(t) * rows.reshape((1, -1) + (1,) * (t.ndim - 2))
        inputs = role["inputs"]
        roles.append(dict(role, outputs_tangent=(t,), inputs=inputs))
    masked = block.compute_statistics(dict(roles=tuple(roles)), 3)
    # The same three real examples, without padding.
    trimmed = []
    for padded in roles:
        (x,) = padded["inputs"]
        (t,) = padded["outputs_tangent"]
        k = x.shape[0] * 3 // B
        trimmed.append(dict(inputs=(x[:k],), outputs_tangent=(t[:, :k],)))
    want = block.compute_statistics(dict(roles=tuple(trimmed)), 3)
    for a, b in zip(masked, want, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-12)


def test_jit_products_match_eager():
    block, state = _state("autoencoder")
    vector = _vector(block)
    eager = block.multiply_matpower(state, vector, 0.1, -1, True, True)
    jitted = jax.jit(lambda s, v: block.multiply_matpower(s, v, 0.1, -1, True, True))(state, vector)
    np.testing.assert_allclose(_flat(jitted), _flat(eager), rtol=1e-12)


@pytest.mark.parametrize(
    ("layer", "match"),
    [
        (
            lambda: _tied(
                [_role("dense_tag", [(V, D)], (B, V), (B, D), {"dimension_numbers": PLAIN})],
                [(0,)],
                [(V, D)],
            ),
            "uses are",
        ),
        (
            lambda: _tied(
                [
                    _role(
                        "dense_tag", [(V, D), (D,)], (B, V), (B, D), {"dimension_numbers": PLAIN}
                    ),
                    _role(
                        "dense_tag", [(V, D), (D,)], (B, V), (B, D), {"dimension_numbers": PLAIN}
                    ),
                ],
                [(0, 1), (0, 1)],
                [(V, D), (D,)],
            ),
            "bias is shared",
        ),
        (
            lambda: _tied(
                [
                    _role("embedding_tag", [(V, D)], (B,), (B, D)),
                    _role("conv_tag", [(V, D)], (B, V), (B, D)),
                ],
                [(0,), (0,)],
                [(V, D)],
            ),
            "conv_tag",
        ),
    ],
    ids=["one_role", "shared_bias", "conv_role"],
)
def test_unserved_sharing_raises_naming_the_layer(layer, match):
    with pytest.raises(ValueError, match=rf"TiedKroneckerFactored\(tied\[p0.*{match}"):
        blocks.TiedKroneckerFactored(layer())


def test_cached_power_without_cache_raises():
    block = blocks.TiedKroneckerFactored(lm_layer())
    state = block.init(jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match="exact_powers_to_cache"):
        block.multiply_matpower(state, _vector(block), 0.1, -1, True, True)
    with pytest.raises(ValueError, match="power 2"):
        block.multiply_matpower(state, _vector(block), 0.1, 2, False, False)


@pytest.mark.parametrize(
    ("value", "error"), [(-1, ValueError), (2.5, TypeError), (True, TypeError)]
)
def test_bad_max_full_size_raises_naming_the_layer(value, error):
    with pytest.raises(error, match=r"TiedKroneckerFactored\(tied\[p0\]\): max_full_size"):
        blocks.TiedKroneckerFactored(lm_layer(), max_full_size=value)
