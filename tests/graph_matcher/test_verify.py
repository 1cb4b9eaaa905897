"""The numerical check of structural matches, answered for a whole graph at once.

`kfacx.graph_matcher._verify.prefetch` evaluates the checks of all of a graph's
structural matches in one compiled function; its answers must be the ones each check
gives on its own, and a check that cannot be traced must fail alone.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _compiles import compiled_programs

import kfacx
from kfacx._helpers import _compile
from kfacx.graph_matcher import _match, _verify

WIDTHS = (5, 7, 6, 4)


def _params():
    rng = np.random.default_rng(0)
    return {
        f"layer_{i}": {
            "w": jnp.asarray(rng.standard_normal((a, b)) / np.sqrt(a), jnp.float32),
            "b": jnp.zeros((b,), jnp.float32),
            "scale": jnp.ones((b,), jnp.float32),
        }
        for i, (a, b) in enumerate(zip(WIDTHS[:-1], WIDTHS[1:], strict=True))
    }


def _loss(params, x):
    """Three dense layers of different shapes, each followed by a scale (one check each)."""
    for i in range(len(WIDTHS) - 1):
        layer = params[f"layer_{i}"]
        x = jnp.tanh((x @ layer["w"] + layer["b"][None]) * layer["scale"][None])
    kfacx.register_squared_error_loss(x, jnp.zeros_like(x))
    return 0.5 * jnp.mean(jnp.sum(x**2, axis=-1))


def _args():
    x = jnp.asarray(np.random.default_rng(1).standard_normal((8, WIDTHS[0])), jnp.float32)
    return _params(), x


@pytest.fixture
def fresh_answers(monkeypatch):
    """An empty answer cache for the test (the process's is left as it was)."""
    monkeypatch.setattr(_verify, "_VERIFIED", {})


def _count_check_programs(fn, every_program=False):
    result, compiled = compiled_programs(fn)
    return result, {k: v for k, v in compiled.items() if every_program or "evaluate" in k}


def test_a_graph_s_checks_compile_as_one_program(fresh_answers):
    (_, report), programs = _count_check_programs(lambda: kfacx.auto_register_tags(_loss, _args()))
    dense_layers = {e.layer for e in report.entries if e.tag == "dense_tag"}
    assert len(dense_layers) == 3, report
    assert report.unmatched == ()
    assert programs == {"jit(evaluate_all)": 1}, programs
    assert len(_verify._VERIFIED) >= 3


def _probe_loss(params, x):
    """A dense layer, a parameter used through a broadcast only (the tag's input is
    ``jnp.zeros_like`` of its output), and a dense layer on both."""
    h = jnp.tanh(x @ params["w"])
    probe = params["probe"]
    h = jnp.concatenate([h, jnp.broadcast_to(probe, (x.shape[0], probe.size))], axis=1)
    y = h @ params["v"]
    kfacx.register_squared_error_loss(y, jnp.zeros_like(y))
    return 0.5 * jnp.mean(jnp.sum(y**2, axis=-1))


def test_checks_made_while_tracing_compile_one_program_and_nothing_else(fresh_answers):
    """Detection runs while the step is traced: its checks must still run now, as one
    program, with their constant parts (``jnp.zeros_like`` in a tag's inputs) inside it
    rather than compiled and run op by op."""
    rng = np.random.default_rng(2)
    params = {
        "w": jnp.asarray(rng.standard_normal((5, 6)), jnp.float32),
        "probe": jnp.ones((7,), jnp.float32),
        "v": jnp.asarray(rng.standard_normal((13, 4)), jnp.float32),
    }
    # Odd shapes: an operation another test ran op by op would be compiled already.
    x = jnp.asarray(rng.standard_normal((11, 5)), jnp.float32)

    def outer(params, x):
        tagged, report = kfacx.auto_register_tags(_probe_loss, (params, x))
        assert report.unmatched == ()
        return tagged(params, x)

    _compile.one_off_compile_options("cpu")  # its one-time probe of the compiler
    _, programs = _count_check_programs(lambda: jax.jit(outer).trace(params, x), every_program=True)
    assert programs == {"jit(evaluate_all)": 1}, programs


def test_checks_run_on_this_process_cpu_whatever_the_default_device(monkeypatch, fresh_answers):
    results = []
    run_once = _compile.run_once
    monkeypatch.setattr(
        _compile, "run_once", lambda fn, *args: results.append(run_once(fn, *args)) or results[-1]
    )
    with jax.default_device(jax.devices()[-1]):
        kfacx.auto_register_tags(_loss, _args())
    assert results
    devices = {d for out in results for leaf in jax.tree.leaves(out) for d in leaf.devices()}
    assert devices == {jax.local_devices(backend="cpu")[0]}


def _captured(monkeypatch):
    """The graph and structural matches `find_matches` hands to `prefetch`."""
    seen = []
    monkeypatch.setattr(_match, "prefetch", lambda graph, matches: seen.append((graph, matches)))
    kfacx.auto_register_tags(_loss, _args())
    _verify._VERIFIED.clear()  # the answers `verified` found one by one meanwhile
    ((graph, matches),) = [(g, m) for g, m in seen if m]
    return graph, matches


def _alone(graph, match):
    todo = _todo(graph, match)
    return _verify._check_numerically(match, todo, _verify._constants(graph, todo))


def test_prefetched_answers_are_each_check_s_own(monkeypatch, fresh_answers):
    graph, matches = _captured(monkeypatch)
    assert len(matches) >= 4  # the dense layers, and the scale and shift candidates
    _verify.prefetch(graph, matches)
    together = [_verify.verified(m, graph) for m in matches]
    assert [_alone(graph, m) for m in matches] == together
    assert any(together)


def test_a_check_that_cannot_be_traced_fails_alone(monkeypatch, fresh_answers):
    graph, matches = _captured(monkeypatch)
    broken = matches[0]
    evaluator = _verify._evaluator

    def failing(match, todo, consts):
        if match is broken:
            raise TypeError("cannot trace this check")
        return evaluator(match, todo, consts)

    monkeypatch.setattr(_verify, "_evaluator", failing)
    _verify.prefetch(graph, matches)
    monkeypatch.setattr(_verify, "_evaluator", evaluator)
    assert _verify.verified(broken, graph) is False
    others = [m for m in matches[1:] if _key(graph, m) != _key(graph, broken)]
    assert [_verify.verified(m, graph) for m in others] == [_alone(graph, m) for m in others]


def _todo(graph, match):
    return _verify._subgraph_eqns(graph, match.eqns, match.param_vars, match.view_eqns)


def _key(graph, match):
    return _verify._structure(match, _todo(graph, match))
