"""Detection rejects bad input with errors that say what is wrong and how to fix it."""

from __future__ import annotations

import uuid

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kfacx
from kfacx import graph_matcher, tags


def _loss(params, batch):
    x, t = batch
    y = x @ params["w"] + jnp.broadcast_to(params["b"], (x.shape[0], 2))
    y = kfacx.register_squared_error_loss(y, t)
    return jnp.mean(jnp.sum((y - t) ** 2, -1))


def _problem():
    params = dict(w=np.ones((3, 2), np.float32), b=np.zeros(2, np.float32))
    return params, (np.ones((4, 3), np.float32), np.zeros((4, 2), np.float32))


def _problem_args():
    params, batch = _problem()
    return (params, batch)


def _pattern(name, precedence, compute=lambda x, p: x @ p[0] + p[1], example_args=None):
    return kfacx.GraphPattern(
        name=name,
        tag_primitive=tags.dense,
        compute_func=compute,
        parameters_extractor_func=graph_matcher.dense_parameters_extractor,
        example_args=example_args or [np.zeros((2, 3)), [np.zeros((3, 4)), np.zeros(4)]],
        precedence=precedence,
    )


def test_pattern_whose_example_args_fail_to_trace():
    bad = _pattern(
        "bad_shapes", 50, example_args=[np.zeros((2, 3)), [np.zeros((5, 4)), np.zeros(4)]]
    )
    with pytest.raises(ValueError, match=r"GraphPattern 'bad_shapes': compute_func fails"):
        kfacx.auto_register_tags(_loss, _problem_args(), graph_patterns=(bad,))


def test_two_patterns_of_equal_precedence_claiming_the_same_parameter():
    first, second = _pattern("mine", 50), _pattern("also_mine", 50)
    with pytest.raises(ValueError, match=r"'mine' and 'also_mine'.*Parameters: \['w', 'b'\]"):
        kfacx.auto_register_tags(_loss, _problem_args(), graph_patterns=(first, second))
    # With distinct precedences the higher one wins, silently and deterministically.
    _, report = kfacx.auto_register_tags(
        _loss, _problem_args(), graph_patterns=(_pattern("low", 1), _pattern("high", 2))
    )
    assert {e.source for e in report.entries} == {"high"}


@pytest.mark.parametrize("container", ["scan", "cond"])
def test_loss_registered_inside_a_scan_or_a_cond_branch(container):
    def loss(params, batch):
        x, t = batch

        def body(carry, xt):
            y = kfacx.register_squared_error_loss(xt[0] @ params["w"], xt[1])
            return carry + jnp.sum((y - xt[1]) ** 2), None

        if container == "cond":
            return jax.lax.cond(jnp.sum(x) > 0, body, lambda c, xt: (c, None), 0.0, (x, t))[0]
        total, _ = jax.lax.scan(body, 0.0, (x[:, None], t[:, None]))
        return total

    params, batch = _problem()
    est = kfacx.BlockDiagonalCurvature(loss, auto_register_kwargs=dict(on_unmatched="full"))
    with pytest.raises(ValueError, match=rf"loss tag .* sits inside a `{container}`.*Register"):
        est.init(jax.random.PRNGKey(0), ({"w": params["w"]}, batch))


@pytest.mark.parametrize("auto", [True, False])
def test_parameter_that_is_not_a_float_array(auto):
    params, batch = _problem()
    params = dict(params, step=np.zeros((), np.int32))
    est = kfacx.BlockDiagonalCurvature(_loss, auto_register_tags=auto)
    with pytest.raises(TypeError, match=r"Parameter 'step' has dtype int32.*floating-point"):
        est.init(jax.random.PRNGKey(0), (params, batch))


def test_custom_tag_names_are_unique():
    name = f"tag_{uuid.uuid4().hex}"
    tags.LayerTag(name, 1, 1)
    with pytest.raises(ValueError, match="exists already"):
        tags.LayerTag(name, 1, 1)


def test_unmatched_warning_points_at_the_users_call():
    def loss(params, batch):
        y = jnp.broadcast_to(jnp.sin(params["w"]), batch.shape) * batch
        y = kfacx.register_squared_error_loss(y, batch)
        return jnp.sum(y)

    est = kfacx.BlockDiagonalCurvature(loss)
    with pytest.warns(UserWarning, match=r"no layer pattern matched parameters \['w'\]") as rec:
        est.init(
            jax.random.PRNGKey(0), ({"w": np.ones(3, np.float32)}, np.ones((2, 3), np.float32))
        )
    assert rec[0].filename == __file__
