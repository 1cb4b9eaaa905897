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

Block-level checks and a small MLP are in tests/transform/test_eigen_adam_blocks.py; shared helpers
in tests/_eigen_adam_cases.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _eigen_adam_cases import (
    B2,
    COMPILER,
    EPS,
    LR,
    PERIOD,
    STEPS,
    B,
    _bases,
    _mlp,
    _mlp_estimator,
    _mlp_loss,
    close,
    reference,
    x64,  # noqa: F401  (autouse fixture)
)

import kfacx
from kfacx.transform._eigen_adam import ScaleByKfacEigenAdamState, scale_by_kfac_eigen_adam

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
