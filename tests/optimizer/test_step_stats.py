"""The stats dict of `kfacx.Optimizer.step`: the fields documented on docs/logging.md and in
the step's docstring are exactly the keys the step returns, with the documented dtypes,
and their values mean what the page says (checked against independent computations)."""

from __future__ import annotations

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _optimizer_cases import mlp_loss as loss_fn

import kfacx

PAGE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "logging.md"
NORMS = ("grad_norm", "precon_grad_norm", "update_norm")
N, L2 = 16, 1e-3


def page_fields() -> dict[str, str]:
    """``{field: dtype cell}`` of the table under "## The fields" on docs/logging.md."""
    section = PAGE.read_text().split("\n## The fields\n", 1)[1].split("\n#", 1)[0]
    return dict(re.findall(r"^\| `(\w+)` \| ([^|]*?) \|", section, re.M))


def docstring_fields() -> list[str]:
    """The fields the bullets of `kfacx.Optimizer.step`'s "Returns" section name."""
    returns = kfacx.Optimizer.step.__doc__.split("Returns:", 1)[1].split("Raises:", 1)[0]
    heads = re.findall(r"^\s*- (.*?): ", returns, re.M)
    return [name for head in heads for name in re.findall(r"``(\w+)``", head)]


# ----------------------------------------------------------------------------- a tiny model


def loss_with_aux(params, batch):
    return loss_fn(params, batch), {"first_w": params["w1"][0, 0]}


def problem(dtype=jnp.float32):
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    params = dict(
        w1=jax.random.normal(k1, (3, 4), dtype),
        b1=jnp.zeros(4, dtype),
        w2=jax.random.normal(k2, (4, 3), dtype),
        b2=jnp.zeros(3, dtype),
    )
    x = jax.random.normal(k3, (N, 3), dtype)
    return params, (x, (x[:, 0] > 0).astype(jnp.int32) + (x[:, 1] > 0))


DETERMINISTIC = dict(estimation_mode="fisher_empirical", num_burnin_steps=0)
PLAIN = dict(learning_rate_schedule=0.1, momentum_schedule=0.5, initial_damping=1e-2)
ADAPTIVE = dict(
    use_adaptive_learning_rate=True,
    use_adaptive_momentum=True,
    use_adaptive_damping=True,
    initial_damping=1.0,
    damping_adaptation_interval=2,
)
CONFIGS = {
    "plain": (loss_fn, PLAIN, False),
    "adaptive": (loss_fn, ADAPTIVE, False),
    "has_aux": (loss_with_aux, PLAIN, True),
    "rejection": (loss_fn, dict(ADAPTIVE, use_step_rejection=True), False),
}
#: Fields present only with an option: ``rejected`` (use_step_rejection, or adaptive
#: damping with the default long_step_ratio), ``aux``.
OPTIONAL = ("rejected", "aux")


def optimizer(name: str) -> kfacx.Optimizer:
    func, options, has_aux = CONFIGS[name]
    return kfacx.Optimizer(
        jax.value_and_grad(func, has_aux=has_aux),
        l2_reg=L2,
        add_l2_reg=True,
        value_func_has_aux=has_aux,
        **options,
        **DETERMINISTIC,
    )


def returned_stats(name: str, dtype=jnp.float32) -> dict:
    """The shapes and dtypes of the stats one step returns (init and step traced, not
    compiled)."""
    opt, (params, batch) = optimizer(name), problem(dtype)
    state = jax.eval_shape(opt.init, params, jax.random.key(0), batch)
    return jax.eval_shape(opt.unstaged_step, params, state, jax.random.key(1), batch)[-1]


# ----------------------------------------------------------------------------- the fields


def test_page_and_docstring_document_the_same_fields():
    assert list(page_fields()) == docstring_fields()
    assert list(page_fields())[-2:] == list(OPTIONAL)  # the fields that depend on the options


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_documented_fields_are_the_returned_keys_with_their_dtypes(name):
    stats, documented = returned_stats(name), page_fields()
    absent = {"aux"} if not CONFIGS[name][2] else set()
    options = CONFIGS[name][1]
    if not (options.get("use_step_rejection") or options.get("use_adaptive_damping")):
        absent.add("rejected")
    expected = set(documented) - absent
    assert set(stats) == expected
    for field, struct in stats.items():
        if field == "aux":
            assert struct == {"first_w": jax.ShapeDtypeStruct((), jnp.float32)}
            continue
        assert struct.shape == (), field
        assert str(struct.dtype) == documented[field].split()[0], field


def test_norms_follow_float64_parameters_and_the_loss_stays_float32():
    with jax.enable_x64():
        stats = returned_stats("plain", jnp.float64)
    for field, dtype in page_fields().items():
        if field not in OPTIONAL:
            expected = "float64" if field in NORMS else dtype.split()[0]
            assert str(stats[field].dtype) == expected, field


# ----------------------------------------------------------------------------- the values


def sq_norm(tree) -> float:
    # on the host: an eager jnp.vdot compiles a program per leaf shape
    return float(sum(np.vdot(v, v) for v in map(np.asarray, jax.tree.leaves(tree))))


def preconditioned_gradient(delta, velocity, stats):
    """``p`` from the update ``delta = -learning_rate * p + momentum * velocity``."""
    lr, mom = float(stats["learning_rate"]), float(stats["momentum"])
    return jax.tree.map(lambda d, v: (mom * v - d) / lr, delta, velocity)


def run(name: str, steps: int):
    """``[(params before, state before, stats, params after)]`` of ``steps`` steps."""
    opt, (params, batch) = optimizer(name), problem()
    state = opt.init(params, jax.random.key(0), batch)
    out = []
    for i in range(steps):
        new_params, new_state, stats = opt.step(params, state, jax.random.key(i), batch)
        out.append((params, state, stats, new_params))
        params, state = new_params, new_state
    return out, batch


def test_adaptive_stats_are_what_the_page_says():
    history, batch = run("adaptive", 4)
    value_and_grad = jax.jit(jax.value_and_grad(loss_fn))
    for i, (params, state, stats, new_params) in enumerate(history):
        assert int(stats["step"]) == i and int(stats["data_seen"]) == N * (i + 1)
        assert not bool(stats["skipped"])
        loss, grads = value_and_grad(params, batch)
        np.testing.assert_allclose(stats["loss"], loss, rtol=1e-6)
        assert float(stats["damping"]) == float(state.damping)  # the one used, not the next
        grads = jax.tree.map(lambda g, p: g + L2 * p, grads, params)
        np.testing.assert_allclose(stats["grad_norm"], sq_norm(grads) ** 0.5, rtol=1e-5)
        delta = jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b), new_params, params)
        np.testing.assert_allclose(stats["update_norm"], sq_norm(delta) ** 0.5, rtol=1e-5)
        precon = preconditioned_gradient(delta, state.velocities, stats)
        np.testing.assert_allclose(stats["precon_grad_norm"], sq_norm(precon) ** 0.5, rtol=1e-4)
        quad = float(stats["quad_model_change"])
        assert quad < 0
        if (i + 1) % 2:
            assert np.isnan(float(stats["rho"]))
            continue
        # kfac-jax's new_loss, and rho from it: the page's definition.
        new_loss = float(value_and_grad(new_params, batch)[0])
        reg = 0.5 * L2 * (sq_norm(new_params) - sq_norm(params))
        np.testing.assert_allclose(stats["rho"], (new_loss - stats["loss"] + reg) / quad, rtol=1e-3)
    assert float(history[0][2]["momentum"]) == 0.0
    assert float(history[2][2]["damping"]) < float(history[1][2]["damping"])  # adapted


def test_given_coefficients_are_reported_and_the_model_is_not_computed():
    history, _ = run("plain", 2)
    for _, _, stats, _ in history:
        np.testing.assert_allclose(
            [stats["learning_rate"], stats["momentum"], stats["damping"]], [0.1, 0.5, 1e-2]
        )
        assert np.isnan(float(stats["rho"])) and np.isnan(float(stats["quad_model_change"]))
    first = history[0][2]  # no velocity yet: the update is learning_rate * p
    np.testing.assert_allclose(first["update_norm"], 0.1 * first["precon_grad_norm"], rtol=1e-5)
