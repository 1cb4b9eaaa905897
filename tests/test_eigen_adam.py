"""`kfacx.scale_by_kfac_eigen_adam` (Adam's second moment in the Kronecker eigenbasis)
against a NumPy reference, in float64.

The reference takes only the gradients and the curvature factors of every step from
the run (both are other code's, tested elsewhere): at every refresh it takes the
factors' eigenvectors with `np.linalg.eigh`, re-expresses the second moment with
``(R_A o R_A) nu (R_G o R_G)^T`` (or keeps it), rotates each gradient matrix into the
basis by hand, in the block's layout, and applies Adam's second moment there. Signs
of eigenvectors do not matter: the second moment squares them and the update rotates
back. One jitted program runs one model with a dense, a convolution, an embedding, a
scale-and-shift and a stacked (`lax.scan`) dense layer through the transformation
with and without ``rotate_second_moment``, the same model with diagonal blocks only,
and `optax.scale_by_adam` (``b1 = 0``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfacx
from kfacx import blocks
from kfacx._eigen_adam import ScaleByKfacEigenAdamState, scale_by_kfac_eigen_adam

B, STEPS, PERIOD, B2, EPS, LR = 24, 3, 2, 0.9, 1e-4, 0.05
TOL = 1e-8
COMPILER = {"xla_backend_optimization_level": 0}


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


def close(actual, expected, what: str, tol: float = TOL) -> None:
    """For every leaf of two pytrees of the same structure: float64, the same shape, and
    ``||actual - expected||_F <= tol ||expected||_F``."""

    def leaf(path, a, e):
        a, e, name = np.asarray(a), np.asarray(e), f"{what}{jax.tree_util.keystr(path)}"
        assert (a.dtype, a.shape) == (e.dtype, e.shape) and a.dtype == np.float64, name
        error, scale = np.linalg.norm(a - e), max(np.linalg.norm(e), 1e-300)
        assert error <= tol * scale, f"{name}: relative error {error / scale:.3g} > {tol:.3g}"

    jax.tree_util.tree_map_with_path(leaf, actual, expected)


# ----------------------------------------------------------------------------- the model


def _loss(p, batch):
    ids, img, y = batch
    e = p["emb"][ids].reshape(ids.shape[0], -1)
    c = jax.lax.conv_general_dilated(
        img, p["conv_w"], (1, 1), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )
    h = jnp.concatenate([e, (c + p["conv_b"][None, None, None]).reshape(ids.shape[0], -1)], axis=1)
    h = jnp.tanh(h * p["scale"][None] + p["shift"][None])
    h = jnp.tanh(h @ p["w"] + p["b"][None])
    h, _ = jax.lax.scan(lambda h, q: (jnp.tanh(h @ q["w"] + q["b"][None]), None), h, p["stack"])
    kfacx.register_squared_error_loss(h, y)
    return 0.5 * jnp.mean(jnp.sum((h - y) ** 2, axis=-1))


def _params():
    rng = np.random.default_rng(0)
    return dict(
        emb=rng.normal(size=(4, 3)),
        conv_w=0.5 * rng.normal(size=(2, 2, 1, 2)),
        conv_b=0.1 * rng.normal(size=(2,)),
        scale=1 + 0.1 * rng.normal(size=(11,)),
        shift=0.1 * rng.normal(size=(11,)),
        w=0.4 * rng.normal(size=(11, 3)),
        b=0.1 * rng.normal(size=(3,)),
        stack=dict(w=0.5 * rng.normal(size=(2, 3, 3)), b=0.1 * rng.normal(size=(2, 3))),
    )


def _batch(seed: int):
    rng = np.random.default_rng(100 + seed)
    return rng.integers(0, 4, (B, 1)), rng.normal(size=(B, 3, 3, 1)), rng.normal(size=(B, 3))


#: Per block kind: the gradient in the block's layout ``[groups, n, m]`` (embedding:
#: ``[vocab, dim]``; scale and shift: flat) from the gradient pytree, by hand.
LAYOUTS = {
    "EmbeddingKroneckerFactored": lambda g: g["emb"],
    "ConvTwoKroneckerFactored": lambda g: np.concatenate(
        [g["conv_w"].transpose(2, 0, 1, 3).reshape(4, 2), g["conv_b"][None]]
    )[None],
    "ScaleAndShiftDiagonal": lambda g: np.concatenate([g["scale"], g["shift"]]),
    "DenseTwoKroneckerFactored": lambda g: np.concatenate([g["w"], g["b"][None]])[None],
    "StackedBlock": lambda g: np.concatenate([g["stack"]["w"], g["stack"]["b"][:, None]], 1)[
        :, None
    ],
}


def _eigenvectors(m: np.ndarray) -> np.ndarray:
    return np.linalg.eigh(m)[1]


def _bases(kind: str, factors: list[np.ndarray]):
    """``(U_A or None, U_G or None)`` of the block's factors (None: the identity)."""
    if kind == "ScaleAndShiftDiagonal":
        return None, None
    if kind == "EmbeddingKroneckerFactored":
        return None, _eigenvectors(factors[1])
    return _eigenvectors(factors[0]), _eigenvectors(factors[1])


def _t(x):
    return np.swapaxes(x, -1, -2)


def _rotate(v, bases, back=False):
    u_a, u_g = bases
    if u_g is not None:
        v = v @ (_t(u_g) if back else u_g)
    if u_a is not None:
        v = (u_a if back else _t(u_a)) @ v
    return v


def _change(nu, old, new):
    """``(R_A o R_A) nu (R_G o R_G)^T`` with ``R = U_new^T U_old`` (None: identity)."""
    for side in (1, 0):
        if new[side] is None:
            continue
        r = _t(new[side]) if old[side] is None else _t(new[side]) @ old[side]
        nu = nu @ _t(r**2) if side == 1 else r**2 @ nu
    return nu


def reference(layout, bases_of, steps: list[dict], index: int, rotate: bool):
    """Per step ``(nu, update)`` of the block ``index``, by hand: ``layout(grads)`` is its
    gradient in its layout, ``bases_of(factors)`` its eigenbases (None: identity)."""
    bases, nu, out = (None, None), None, []
    for t, step in enumerate(steps):
        v = layout(step["grads"])
        nu = np.zeros_like(v) if nu is None else nu
        if t % PERIOD == 0:
            new = bases_of(step["factors"][index])
            nu = _change(nu, bases, new) if rotate else nu
            bases = new
        c = _rotate(v, bases)
        nu = B2 * nu + (1 - B2) * c**2
        nu_hat = nu / (1 - B2 ** (t + 1))
        out.append((nu, _rotate(c / (np.sqrt(nu_hat) + EPS), bases, back=True)))
    return out


def _reference(kind: str, rotate: bool):
    steps = run()[1]
    return reference(LAYOUTS[kind], functools.partial(_bases, kind), steps, _block(kind), rotate)


# ----------------------------------------------------------------------------- one run


LAYER_TAGS = ("dense_tag", "conv_tag", "embedding_tag", "scale_and_shift_tag")


@functools.cache
def run():
    """``(kinds, steps, states)``: the block kinds; per step the gradient, every block's
    factors (after the step's update), the second moments and the updates of each
    transformation (``rotate``, ``keep``: rotate_second_moment True / False; ``diag``:
    diagonal blocks; ``adam``: `optax.scale_by_adam`); the last optimizer states."""
    with jax.enable_x64(True):
        params, args = _params(), (_params(), _batch(0))
        est = kfacx.BlockDiagonalCurvature(_loss)
        diag = kfacx.BlockDiagonalCurvature(
            _loss, layer_tag_to_block_ctor=dict.fromkeys(LAYER_TAGS, kfacx.Diagonal)
        )
        hyper = dict(b2=B2, eps=EPS, inverse_update_period=PERIOD)
        txs = dict(
            rotate=scale_by_kfac_eigen_adam(est, args, **hyper),
            keep=scale_by_kfac_eigen_adam(est, args, rotate_second_moment=False, **hyper),
            diag=scale_by_kfac_eigen_adam(diag, args, **hyper),
            adam=optax.scale_by_adam(b1=0.0, b2=B2, eps=EPS),
        )
        states = jax.jit(lambda p: {n: t.init(p) for n, t in txs.items()})(params)  # not eager

        @functools.partial(jax.jit, compiler_options=COMPILER)
        def step(params, states, key, batch):
            _, grads, stats = est.value_grads_and_curvature_stats(key, (params, batch))
            _, _, diag_stats = diag.value_grads_and_curvature_stats(key, (params, batch))
            updates, new_states = {}, {}
            for name, tx in txs.items():
                extra = {} if name == "adam" else dict(curvature_stats=stats)
                extra = dict(curvature_stats=diag_stats) if name == "diag" else extra
                updates[name], new_states[name] = tx.update(grads, states[name], params, **extra)
            params = jax.tree_util.tree_map(lambda p, u: p - LR * u, params, updates["rotate"])
            return params, new_states, grads, updates

        steps = []
        for t in range(STEPS):
            params, states, grads, updates = step(params, states, jax.random.key(t), _batch(t))
            factors = [
                [np.asarray(f.value) for f in s.factors]
                for s in states["rotate"].estimator_state.blocks
            ]
            nus = {n: jax.tree_util.tree_map(np.asarray, states[n].nu) for n in ("rotate", "keep")}
            steps.append(
                dict(
                    grads=jax.tree_util.tree_map(np.asarray, grads),
                    factors=factors,
                    nu=nus,
                    updates=jax.tree_util.tree_map(np.asarray, updates),
                )
            )
        kinds = [type(b).__name__ for b in est.blocks]
        return kinds, steps, states


KINDS = list(LAYOUTS)


def _block(kind: str) -> int:
    kinds = run()[0]
    assert sorted(kinds) == sorted(KINDS), kinds
    return kinds.index(kind)


@pytest.mark.parametrize("rotate", [True, False], ids=["rotate", "keep"])
@pytest.mark.parametrize("kind", KINDS)
def test_second_moment_is_the_average_of_the_rotated_squared_gradients(kind, rotate):
    """After every step, ``nu`` is ``b2``'s average of ``(U_A^T V U_G)^2`` with numpy's
    eigenvectors of the factors, re-expressed at the refresh (step 2) or kept."""
    index, steps = _block(kind), run()[1]
    name = "rotate" if rotate else "keep"
    for t, (nu, _) in enumerate(_reference(kind, rotate)):
        close(steps[t]["nu"][name][index], nu, f"{kind} nu after step {t}")


@pytest.mark.parametrize("rotate", [True, False], ids=["rotate", "keep"])
@pytest.mark.parametrize("kind", KINDS)
def test_update_is_the_scaled_direction_rotated_back(kind, rotate):
    """Every step's output is ``U_A (V' / (sqrt(nu_hat) + eps)) U_G^T``."""
    steps = run()[1]
    name = "rotate" if rotate else "keep"
    for t, (_, update) in enumerate(_reference(kind, rotate)):
        got = LAYOUTS[kind](steps[t]["updates"][name])
        close(got, update, f"{kind} update of step {t}")


def test_rotating_the_second_moment_at_a_refresh_changes_it():
    """The refresh of step 2 moves the bases, so re-expressing ``nu`` matters (else the
    two tests above would not tell the options apart)."""
    steps = run()[1]
    index = _block("DenseTwoKroneckerFactored")
    rotated, kept = steps[2]["nu"]["rotate"][index], steps[2]["nu"]["keep"][index]
    assert np.linalg.norm(rotated - kept) > 1e-3 * np.linalg.norm(kept)
    close(steps[1]["nu"]["rotate"][index], steps[1]["nu"]["keep"][index], "before", 0.0)


def test_identity_basis_is_optax_adam_without_first_moment():
    """Diagonal blocks (identity basis) give `optax.scale_by_adam(b1=0)`'s updates: for
    the whole model served by diagonal blocks, and for the scale-and-shift layer of the
    Kronecker model."""
    for t, step in enumerate(run()[1]):
        updates = step["updates"]
        close(updates["diag"], updates["adam"], f"diagonal blocks, step {t}", 1e-12)
        for name in ("scale", "shift"):
            close(updates["rotate"][name], updates["adam"][name], f"{name}, step {t}", 1e-12)


def test_estimator_state_finds_it_inside_a_chain():
    states = run()[2]
    chained = (optax.EmptyState(), states["rotate"], optax.TraceState(trace=()))
    assert isinstance(states["rotate"], ScaleByKfacEigenAdamState)
    assert kfacx.estimator_state(chained) is states["rotate"].estimator_state


# ----------------------------------------------------------------------------- a small MLP


def _mlp_loss(p, batch):
    x, y = batch
    h = jnp.tanh(x @ p["w1"] + p["b1"][None])
    out = h @ p["w2"] + p["b2"][None]
    kfacx.register_squared_error_loss(out, y)
    return 0.5 * jnp.mean(jnp.sum((out - y) ** 2, axis=-1))


def _mlp(seed: int = 0):
    rng = np.random.default_rng(seed)
    params = dict(
        w1=rng.normal(size=(3, 4)),
        b1=0.1 * rng.normal(size=(4,)),
        w2=rng.normal(size=(4, 2)),
        b2=0.1 * rng.normal(size=(2,)),
    )
    batch = (rng.normal(size=(16, 3)), rng.normal(size=(16, 2)))
    return params, batch


@functools.cache
def _mlp_estimator(curvature_block: str = "kfac"):
    return kfacx.BlockDiagonalCurvature(_mlp_loss, curvature_block=curvature_block)


def test_jit_matches_eager():
    params, batch = _mlp()
    est = _mlp_estimator()
    tx = scale_by_kfac_eigen_adam(est, (params, batch), b2=B2, eps=EPS, inverse_update_period=1)
    stats_fn = jax.jit(lambda p, k: est.value_grads_and_curvature_stats(k, (p, batch)))
    update = jax.jit(tx.update)
    eager_state = jit_state = tx.init(params)
    for t in range(2):
        _, grads, stats = stats_fn(params, jax.random.key(t))
        eager, eager_state = tx.update(grads, eager_state, curvature_stats=stats)
        jitted, jit_state = update(grads, jit_state, curvature_stats=stats)
        close(jitted, eager, f"step {t}", 1e-12)


def test_ekfac_blocks_use_their_own_basis():
    """EKFAC's cached basis is the eigenbasis of its K-FAC factors at the refresh: the
    same reference holds, with the statistics taken in the basis of the optax state."""
    params, batch = _mlp()
    est = _mlp_estimator("ekfac")
    tx = scale_by_kfac_eigen_adam(
        est, (params, batch), b2=B2, eps=EPS, inverse_update_period=PERIOD
    )

    @functools.partial(jax.jit, compiler_options=COMPILER)
    def step(params, state, key):
        _, grads, stats = est.value_grads_and_curvature_stats(
            key, (params, batch), estimator_state=kfacx.estimator_state(state)
        )
        updates, state = tx.update(grads, state, curvature_stats=stats)
        return (
            jax.tree_util.tree_map(lambda p, u: p - LR * u, params, updates),
            state,
            grads,
            updates,
        )

    state, steps = tx.init(params), []
    for t in range(STEPS):
        params, state, grads, updates = step(params, state, jax.random.key(t))
        factors = [[np.asarray(f.value) for f in s.factors] for s in state.estimator_state.blocks]
        as_numpy = functools.partial(jax.tree_util.tree_map, np.asarray)
        steps.append(dict(grads=as_numpy(grads), factors=factors, updates=as_numpy(updates)))
        steps[-1]["nu"] = as_numpy(state.nu)
    for index, (w, b) in enumerate([("w1", "b1"), ("w2", "b2")]):

        def layout(g, w=w, b=b):
            return np.concatenate([g[w], g[b][None]])[None]

        bases_of = functools.partial(_bases, "DenseEKFAC")
        for t, (nu, update) in enumerate(reference(layout, bases_of, steps, index, True)):
            close(steps[t]["nu"][index], nu, f"{w} nu, step {t}")
            close(layout(steps[t]["updates"]), update, f"{w} update, step {t}")


# ----------------------------------------------------------------------------- blocks


def _random_psd(rng, shape) -> np.ndarray:
    x = rng.normal(size=(*shape[:-1], 2 * shape[-1] + 1))
    return x @ _t(x) / x.shape[-1]


def _refreshed(block, seed: int):
    """A state whose factors are random PSD matrices (diagonal factors: positive vectors),
    refreshed: its cache holds their eigenbases."""
    rng = np.random.default_rng(seed)
    state = block.init(jax.random.key(0), (), (), True)
    factors = tuple(
        blocks.WeightedMovingAverage(
            jnp.ones_like(f.weight),
            _random_psd(rng, s) if len(s) >= 2 and s[-1] == s[-2] else rng.random(s),
        )
        for f, s in zip(state.factors, block.factor_shapes(), strict=True)
    )
    # one compilation instead of one per operation run eagerly
    return jax.jit(block.update_cache)(state._replace(factors=factors), 1.0)


def _vector(block, seed: int = 7):
    rng = np.random.default_rng(seed)
    return tuple(rng.normal(size=s) for s in block.parameters_shapes)


def _dense_layer():
    return blocks.LayerInfo.from_params(
        "dense_tag", [jnp.zeros((3, 2), jnp.float64), jnp.zeros((2,), jnp.float64)]
    )


def _tied_layer():
    """``w [4, 3]`` used as ``x @ w + b1`` and ``h @ w.T + b2`` (a tied autoencoder)."""

    def role(shapes, dnums):
        return blocks.LayerInfo.from_params(
            "dense_tag",
            [jnp.zeros(s, jnp.float64) for s in shapes],
            meta={"dimension_numbers": (dnums, ((), ()))},
        )

    enc, dec = role([(4, 3), (3,)], ((1,), (0,))), role([(4, 3), (4,)], ((1,), (1,)))
    params = [jnp.zeros(s, jnp.float64) for s in ((4, 3), (3,), (4,))]
    return blocks.LayerInfo.from_params(
        blocks.TIED_TAG, params, roles=(enc, dec), role_params=((0, 1), (0, 2))
    )


def _full_bases(block, state):
    return [(_eigenvectors(np.asarray(state.factors[0].value)), None)]


def _tied_bases(block, state):
    rows, cols = (np.asarray(f) for f in jax.jit(block.fitted_factors)(state))
    b1, b2 = (np.asarray(f) for f in jax.jit(block._bias_factors)(state))
    return [
        (_eigenvectors(rows), _eigenvectors(cols)),
        (_eigenvectors(b1), None),
        (_eigenvectors(b2), None),
    ]


def _kron_bases(block, state):
    return [tuple(_eigenvectors(np.asarray(f.value)) for f in state.factors)]


BLOCKS = {
    "full": (lambda: kfacx.Full(_dense_layer()), _full_bases),
    "tied": (lambda: blocks.TiedKroneckerFactored(_tied_layer()), _tied_bases),
    "dense": (lambda: kfacx.DenseTwoKroneckerFactored(_dense_layer()), _kron_bases),
}


def _as_parts(block, x) -> list:
    """The coordinates (or parameters) as one array per basis of ``*_bases``."""
    if isinstance(block, blocks.TiedKroneckerFactored):
        return list(x)
    if isinstance(block, kfacx.Full):
        return [blocks.flatten_params(x) if isinstance(x, tuple) else x]
    return [block.params_to_matrix(x) if isinstance(x, tuple) else x]


@pytest.mark.parametrize("name", list(BLOCKS))
def test_block_rotation_and_basis_change_by_hand(name):
    """For a full block, a tied weight and a dense block: the coordinates are numpy's
    ``U^T v`` (up to the eigenvectors' signs: compared squared), ``from_eigenbasis``
    inverts ``to_eigenbasis``, and ``eigenbasis_change`` is ``(R o R)`` per side."""
    make, bases_of = BLOCKS[name]
    block = make()
    old, new = _refreshed(block, 1), _refreshed(block, 2)
    v = _vector(block)
    coordinates = jax.jit(block.to_eigenbasis)(new, v)
    parts, bases = _as_parts(block, coordinates), bases_of(block, new)
    for got, x, basis in zip(parts, _as_parts(block, v), bases, strict=True):
        close(np.square(got), np.square(_rotate(np.asarray(x), basis)), f"{name} coordinates")
    close(jax.jit(block.from_eigenbasis)(new, coordinates), v, f"{name} round trip", 1e-12)
    rng = np.random.default_rng(3)
    diagonal = jax.tree_util.tree_map(lambda c: rng.random(c.shape), coordinates)
    changed = _as_parts(block, jax.jit(block.eigenbasis_change)(old, new, diagonal))
    old_bases = bases_of(block, old)
    for got, d, o, n in zip(changed, _as_parts(block, diagonal), old_bases, bases, strict=True):
        close(got, _change(np.asarray(d), o, n), f"{name} basis change")


@pytest.mark.parametrize("name", ["dense", "tied", "full"])
def test_basis_before_the_first_refresh_is_the_identity(name):
    block = BLOCKS[name][0]()
    state = block.init(jax.random.key(0), (), (), True)
    v = _vector(block)
    close(_as_parts(block, block.to_eigenbasis(state, v)), _as_parts(block, v), name, 0.0)


def test_stacked_block_rotates_each_slice_by_its_own_basis():
    layer = blocks.LayerInfo.from_params(
        "dense_tag",
        [jnp.zeros((2, 3, 2), jnp.float64), jnp.zeros((2, 2), jnp.float64)],
        stack_size=2,
    )
    block = blocks.StackedBlock(layer, kfacx.DenseTwoKroneckerFactored)
    state = _refreshed(block, 4)
    v = _vector(block)
    coordinates = np.asarray(jax.jit(block.to_eigenbasis)(state, v))
    for l in range(2):
        a, g = (_eigenvectors(np.asarray(f.value)[l, 0]) for f in state.factors)
        matrix = np.concatenate([v[0][l], v[1][l][None]])
        close(np.square(coordinates[l, 0]), np.square(_rotate(matrix, (a, g))), f"slice {l}")
    close(jax.jit(block.from_eigenbasis)(state, coordinates), v, "round trip", 1e-12)


def test_a_cache_without_eigenbasis_is_an_error():
    block = kfacx.DenseTwoKroneckerFactored(_dense_layer())
    state = block.init(jax.random.key(0), (), (-1,), False)
    with pytest.raises(ValueError, match="cache_eigenvalues=True"):
        block.to_eigenbasis(state, _vector(block))


# ----------------------------------------------------------------------------- bad input


class _NoEigenbasis(kfacx.Diagonal):
    """A diagonal block that does not say that its eigenbasis is the identity."""

    eigenbasis_is_identity = False


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(b2=1.0), r"b2 must be a number in \[0, 1\).*b2=0\.999"),
        (dict(b2=-0.1), r"b2 must be a number in \[0, 1\)"),
        (dict(b2="0.9x"), r"b2 must be a number"),
        (dict(eps=0.0), r"eps must be a finite number > 0.*eps=1e-8\)"),
        (dict(eps=-1e-8), r"eps must be a finite number > 0"),
        (dict(curvature_ema=1.0), r"curvature_ema must be in \[0, 1\)"),
        (dict(inverse_update_period=0), r"inverse_update_period"),
    ],
)
def test_bad_hyperparameters_are_rejected(kwargs, match):
    args = _mlp()
    with pytest.raises(ValueError, match=match):
        scale_by_kfac_eigen_adam(_mlp_estimator(), args, **kwargs)


def test_bad_arguments_are_rejected():
    params, batch = _mlp()
    with pytest.raises(TypeError, match="estimator must be a kfacx.BlockDiagonalCurvature"):
        scale_by_kfac_eigen_adam(_mlp_loss, (params, batch))
    with pytest.raises(TypeError, match="rotate_second_moment must be True"):
        scale_by_kfac_eigen_adam(_mlp_estimator(), (params, batch), rotate_second_moment="yes")
    tx = scale_by_kfac_eigen_adam(_mlp_estimator(), (params, batch))
    state = tx.init(params)
    with pytest.raises(TypeError, match=r"needs the keyword argument curvature_stats=\.\.\."):
        tx.update(params, state)
    masked = optax.masked(tx, dict(w1=True, b1=True, w2=False, b2=False))
    with pytest.raises(ValueError, match="does not run inside optax.masked"):
        masked.init(params)
    with pytest.raises(ValueError, match="cannot run inside optax.MultiSteps"):
        optax.MultiSteps(tx, every_k_schedule=2).init(params)


def test_a_block_without_eigenbasis_is_rejected_at_construction():
    est = kfacx.BlockDiagonalCurvature(
        _mlp_loss, layer_tag_to_block_ctor={"dense_tag": _NoEigenbasis}
    )
    with pytest.raises(NotImplementedError, match="does not define the eigenbasis.*kfacx.Diagonal"):
        scale_by_kfac_eigen_adam(est, _mlp())
