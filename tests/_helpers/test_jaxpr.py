"""`kfacx._helpers._jaxpr`: the jaxpr interpreter, the origin tracker, tag-site evaluation and the
jaxpr -> jaxpr passes, on small jaxprs (a plain function, a scan, a cond, a jit call)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kfacx import tags
from kfacx._helpers import _jaxpr

X = np.arange(6, dtype=np.float32).reshape(2, 3) / 6
W = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
SQ = np.linspace(-1, 1, 9, dtype=np.float32).reshape(3, 3)


def _dense(x, w):
    return tags.register_dense(x @ w, x, w)


def _prims(jaxpr) -> list[str]:
    return [e.primitive.name for e in jaxpr.eqns]


# ----------------------------------------------------------------------------- interpreter


def test_eval_jaxpr_computes_the_function():
    def f(x, w):
        return jnp.tanh(x @ w) * 2.0, jnp.sum(x)

    closed = jax.make_jaxpr(f)(X, W)
    got = _jaxpr.eval_jaxpr(closed.jaxpr, closed.consts, [X, W])
    for g, want in zip(got, f(X, W), strict=True):
        np.testing.assert_allclose(g, want, rtol=1e-6)


def test_eval_jaxpr_hook_sees_every_equation_and_replaces_results():
    closed = jax.make_jaxpr(lambda x: jnp.sin(x) + 1.0)(X)
    seen = []

    def eval_eqn(eqn, invals):
        seen.append(eqn.primitive.name)
        if eqn.primitive.name == "sin":
            return [jnp.cos(*invals)]
        return _jaxpr.bind_eqn(eqn, invals)

    (got,) = _jaxpr.eval_jaxpr(closed.jaxpr, closed.consts, [X], eval_eqn)
    assert seen == ["sin", "add"]
    np.testing.assert_allclose(got, np.cos(X) + 1.0, rtol=1e-6)


def test_eval_jaxpr_writes_every_value_into_env():
    closed = jax.make_jaxpr(lambda x: jnp.exp(x) * 3.0)(X)
    env = {}
    _jaxpr.eval_jaxpr(closed.jaxpr, closed.consts, [X], env=env)
    (exp,) = closed.jaxpr.eqns[0].outvars
    np.testing.assert_allclose(_jaxpr.read(env, exp), np.exp(X), rtol=1e-6)
    assert _jaxpr.read(env, closed.jaxpr.eqns[1].invars[1]) == 3.0  # a literal


def test_eval_eqns_evaluates_a_list_of_equations():
    closed = jax.make_jaxpr(lambda x: jnp.exp(x) * 3.0 - x)(X)
    env = {closed.jaxpr.invars[0]: X}
    _jaxpr.eval_eqns(closed.jaxpr.eqns[:2], env)
    np.testing.assert_allclose(env[closed.jaxpr.eqns[1].outvars[0]], np.exp(X) * 3, rtol=1e-6)
    assert closed.jaxpr.outvars[0] not in env


def test_eval_jaxpr_checks_the_number_of_arguments():
    closed = jax.make_jaxpr(lambda x, w: x @ w)(X, W)
    with pytest.raises(ValueError):
        _jaxpr.eval_jaxpr(closed.jaxpr, closed.consts, [X])


def test_call_body_of_a_jit_call_and_none_for_others():
    closed = jax.make_jaxpr(lambda x: jax.jit(jnp.sin)(x) + 1)(X)
    call, add = closed.jaxpr.eqns
    body, consts = _jaxpr.call_body(call)
    assert _prims(body) == ["sin"] and list(consts) == []
    assert _jaxpr.call_body(add) is None


def test_contains_tags_looks_into_bodies():
    plain = jax.make_jaxpr(lambda x, w: jax.jit(lambda a, b: a @ b)(x, w))(X, W)
    tagged = jax.make_jaxpr(lambda x, w: jax.jit(_dense)(x, w))(X, W)
    assert not _jaxpr.contains_tags(plain.jaxpr)
    assert _jaxpr.contains_tags(tagged.jaxpr)
    assert _jaxpr.has_tagged_body(tagged.jaxpr.eqns[0])
    assert not _jaxpr.is_tag_eqn(tagged.jaxpr.eqns[0])


# ----------------------------------------------------------------------------- origins


def test_eqns_with_origins_labels_inputs_only():
    closed = jax.make_jaxpr(lambda x, w: jnp.tanh(x @ w) + 1.0)(X, W)
    got = list(_jaxpr.eqns_with_origins(closed.jaxpr, [None, 0]))
    assert [(e.primitive.name, ins) for e, ins in got] == [
        ("dot_general", [None, 0]),
        ("tanh", [None]),  # computed inside the function
        ("add", [None, None]),  # a literal
    ]


def _scan_fn(carry0, ws, b):
    def step(c, w):
        return jnp.tanh(c @ w + b[None]), c.sum()

    return jax.lax.scan(step, carry0, ws)


def test_bodies_of_a_scan_keep_consts_and_slice_xs():
    ws = np.stack([SQ, 2 * SQ])
    closed = jax.make_jaxpr(_scan_fn)(X, ws, np.ones(3, np.float32))
    (scan,) = [e for e in closed.jaxpr.eqns if _jaxpr.is_scan(e)]
    assert scan.params["num_consts"] == 1 and scan.params["num_carry"] == 1
    ins = ["b", "c", "ws"]  # origins of (consts, carry, xs)
    (body,) = _jaxpr.bodies(scan, ins, level=1)
    assert body.jaxpr is scan.params["jaxpr"].jaxpr and body.scan is scan
    assert body.origins == ["b", None, _jaxpr.ScanSlice("ws", 1)]
    assert _jaxpr.leaf_origin(body.origins[2]) == "ws"
    assert _jaxpr.slice_levels(_jaxpr.ScanSlice(_jaxpr.ScanSlice(0, 0), 1)) == (1, 0)
    assert _jaxpr.slice_levels(0) == ()
    scope = _jaxpr.TOP.enter(body)
    assert scope.scans == (scan,) and scope.branches == ()


def test_bodies_of_a_cond_are_its_branches_without_the_index():
    def f(i, x, w):
        return jax.lax.switch(i, [lambda x, w: x @ w, lambda x, w: -(x @ w)], x, w)

    closed = jax.make_jaxpr(f)(0, X, W)
    (cond,) = [e for e in closed.jaxpr.eqns if _jaxpr.is_cond(e)]
    got = _jaxpr.bodies(cond, ["i", "x", "w"])
    assert [b.branch for b in got] == [(cond, 0), (cond, 1)]
    assert all(b.origins == ["x", "w"] and b.scan is None for b in got)
    assert _jaxpr.TOP.enter(got[1]).branches == ((cond, 1),)


def test_bodies_of_a_jit_call_pass_origins_through_and_none_for_a_while():
    closed = jax.make_jaxpr(lambda x, w: jax.jit(jnp.matmul)(x, w))(X, W)
    (body,) = _jaxpr.bodies(closed.jaxpr.eqns[0], [None, 7])
    assert body.origins == [None, 7] and _prims(body.jaxpr) == ["dot_general"]
    loop = jax.make_jaxpr(lambda x: jax.lax.while_loop(lambda v: v.sum() < 9, jnp.exp, x))(X)
    assert _jaxpr.bodies(loop.jaxpr.eqns[0], [0]) is None
    assert _jaxpr.bodies(closed.jaxpr.eqns[0].params["jaxpr"].jaxpr.eqns[0], [0, 1]) is None


def _nested_tags(i, x, ws, w):
    def step(c, wl):
        return jax.lax.cond(i > 0, _dense, lambda a, b: a @ b, c, wl), None

    y, _ = jax.lax.scan(step, x, ws)
    y = jax.jit(_dense)(y, w)
    return tags.register_squared_error_loss(y, jnp.zeros_like(y))


def test_tag_sites_follow_origins_into_scans_conds_and_calls():
    ws = np.stack([SQ, -SQ])
    closed = jax.make_jaxpr(_nested_tags)(1, X, ws, SQ)
    sites = list(_jaxpr.tag_sites(closed.jaxpr, [None, None, "ws", "w"]))
    names = [s.eqn.primitive.name for s in sites]
    assert names[:2] == ["dense_tag", "dense_tag"] and len(sites) == 3
    stacked, top, loss = sites
    (scan,) = [e for e in closed.jaxpr.eqns if _jaxpr.is_scan(e)]
    assert stacked.scans == (scan,) and [b for _, b in stacked.branches] == [1]
    assert stacked.origins[2] == _jaxpr.ScanSlice("ws", 0)
    assert top.scans == () and top.branches == () and top.origins[2] == "w"
    assert tags.loss_tag_for(loss.eqn.primitive) is not None
    assert _jaxpr.count_tag_sites(closed.jaxpr) == 3


def test_tag_sites_reject_tags_in_a_while_loop():
    def f(x, w):
        return jax.lax.while_loop(lambda v: v.sum() < 9, lambda v: _dense(v, w), x)

    closed = jax.make_jaxpr(f)(X, SQ)
    with pytest.raises(ValueError, match="inside a `while` primitive"):
        list(_jaxpr.tag_sites(closed.jaxpr, [None, 0]))


# ----------------------------------------------------------------------------- tag sites


def _perturb(eqn, invals, site_input):
    """Adds ``site_input`` to a layer's output; returns its input as the site output."""
    if tags.layer_tag_for(eqn.primitive) is None:
        return invals[:1], invals[0]
    return [invals[0] + site_input], invals[1]


def test_eval_jaxpr_sites_in_a_scan_stacks_site_inputs_and_outputs():
    def f(x, ws):
        return jax.lax.scan(lambda c, w: (_dense(c, w), None), x, ws)[0]

    ws = np.stack([SQ, -SQ, SQ.T])
    closed = jax.make_jaxpr(f)(X, ws)
    bumps = np.ones((3, 2, 3), np.float32)
    (out,), (site_x,), (active,) = _jaxpr.eval_jaxpr_sites(
        closed.jaxpr, closed.consts, [X, ws], _perturb, [bumps]
    )
    want, xs = X, []
    for w in ws:
        xs.append(want)
        want = want @ w + 1
    np.testing.assert_allclose(out, want, rtol=1e-5)
    np.testing.assert_allclose(site_x, np.stack(xs), rtol=1e-5)
    assert active is None


@pytest.mark.parametrize("index", [0, 1])
def test_eval_jaxpr_sites_in_a_cond_flags_the_branch_taken(index):
    def f(i, x, w):
        return jax.lax.switch(i, [lambda x, w: x @ w, _dense], x, w)

    closed = jax.make_jaxpr(f)(index, X, SQ)
    (out,), (site_x,), (active,) = _jaxpr.eval_jaxpr_sites(
        closed.jaxpr, closed.consts, [index, X, SQ], _perturb, [np.float32(5)]
    )
    np.testing.assert_allclose(out, X @ SQ + 5 * index, rtol=1e-5)
    np.testing.assert_allclose(site_x, X * index)
    assert float(active) == index


def test_eval_jaxpr_sites_checks_the_number_of_site_inputs():
    closed = jax.make_jaxpr(jax.jit(_dense))(X, SQ)
    with pytest.raises(ValueError, match="2 site inputs for 1 tag sites"):
        _jaxpr.eval_jaxpr_sites(closed.jaxpr, closed.consts, [X, SQ], _perturb, [0, 0])
    (out,), _, _ = _jaxpr.eval_jaxpr_sites(closed.jaxpr, closed.consts, [X, SQ], _perturb, [1])
    np.testing.assert_allclose(out, X @ SQ + 1, rtol=1e-5)


# ----------------------------------------------------------------------------- passes


def test_dce_drops_unused_work_but_keeps_tags():
    def f(x, w):
        unused = jnp.exp(x)  # noqa: F841
        _dense(x, w)  # a tag whose result is unused
        return jax.jit(lambda a: (jnp.sin(a), jnp.cos(a)))(x)[0]

    closed = jax.make_jaxpr(f)(X, SQ)
    pruned = _jaxpr.dce(closed)
    assert "exp" in _prims(closed.jaxpr) and "exp" not in _prims(pruned.jaxpr)
    assert "dense_tag" in _prims(pruned.jaxpr)
    (call,) = [e for e in pruned.jaxpr.eqns if _jaxpr.call_body(e) is not None]
    assert _prims(_jaxpr.call_body(call)[0]) == ["sin"]
    assert _jaxpr.dce(pruned) is pruned  # nothing left to drop


def test_dce_drops_the_operands_a_jit_and_a_scan_no_longer_read():
    """Differentiated inside a scan, ``softplus`` (a jit) takes its backward pass's
    constants, which the scan takes as consts; once the residuals are dropped, neither
    reads them, and the value is computed from the scale alone."""

    def loss(s, x):
        h, _ = jax.lax.scan(lambda h, s: (h * jax.nn.softplus(s)[None], None), x, s)
        return jnp.sum(h)

    s = np.stack([W[0], W[1]])[:, :3]
    closed = jax.make_jaxpr(lambda s, x: jax.value_and_grad(loss)(s, x)[0])(s, X)
    pruned = _jaxpr.dce(closed)
    (scan,) = [e for e in pruned.jaxpr.eqns if _jaxpr.is_scan(e)]
    assert _jaxpr.scan_counts(scan.params)[0] == 0  # no consts left
    (call,) = [e for e in scan.params["jaxpr"].jaxpr.eqns if e.primitive.name in ("jit", "pjit")]
    assert len(call.invars) == 1 and call.params["name"] == "softplus"
    assert len(call.params["in_shardings"]) == 1
    assert [e.primitive.name for e in pruned.jaxpr.eqns] == ["scan", "reduce_sum"]
    np.testing.assert_allclose(
        _jaxpr.eval_jaxpr(pruned.jaxpr, pruned.consts, [s, X])[0], loss(s, X), rtol=1e-6
    )
    # A jit asked to keep its unused operands keeps them.
    for keep_unused, operands in ((False, 1), (True, 2)):
        two = jax.jit(lambda a, b: (jnp.sin(a), jnp.cos(b)), keep_unused=keep_unused)
        (call,) = _jaxpr.dce(jax.make_jaxpr(lambda a, b, two=two: two(a, b)[0])(X, X)).jaxpr.eqns
        assert len(call.invars) == operands and len(call.outvars) == 1


def test_sink_invariants_moves_a_hoisted_broadcast_into_the_scan_body():
    def f(x, ws, b):
        bb = jnp.broadcast_to(b, (2, 3))
        return jax.lax.scan(lambda c, w: (c @ w + bb, None), x, ws)[0]

    ws, b = np.stack([SQ, -SQ]), np.arange(3, dtype=np.float32)
    closed = jax.make_jaxpr(f)(X, ws, b)
    sunk = _jaxpr.sink_invariants(closed)
    (scan,) = [e for e in sunk.jaxpr.eqns if _jaxpr.is_scan(e)]
    assert "broadcast_in_dim" in _prims(scan.params["jaxpr"].jaxpr)
    assert scan.invars[0] is sunk.jaxpr.invars[2]  # the bias itself enters the scan
    (got,) = _jaxpr.eval_jaxpr(sunk.jaxpr, sunk.consts, [X, ws, b])
    np.testing.assert_allclose(got, f(X, ws, b), rtol=1e-6)


@pytest.mark.parametrize("call", ["jit", "checkpoint"])
def test_sink_invariants_moves_a_cast_into_a_call_body(call):
    """A parameter cast before a call (a bfloat16 table entering `jnp.take`, a jit) enters
    the call itself, and the body casts it; the values are unchanged."""
    wrap = {"jit": jax.jit, "checkpoint": jax.checkpoint}[call]

    def f(x, w):
        return wrap(lambda a, v: jnp.tanh(a @ v))(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16))

    closed = jax.make_jaxpr(f)(X, SQ)
    sunk = _jaxpr.sink_invariants(closed)
    (eqn,) = [e for e in sunk.jaxpr.eqns if _jaxpr.call_body(e) is not None]
    assert list(eqn.invars) == list(sunk.jaxpr.invars)  # x and w themselves enter the call
    body = _jaxpr.call_body(eqn)[0]
    assert _prims(body)[:2] == ["convert_element_type", "convert_element_type"]
    (got,) = _jaxpr.eval_jaxpr(sunk.jaxpr, sunk.consts, [X, SQ])
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(f(X, SQ), np.float32))
    assert _jaxpr.sink_invariants(sunk) is sunk  # nothing left to move


def test_sink_invariants_leaves_custom_derivative_calls_alone():
    """A custom_jvp function's rule is written for its operands' types: no cast moves in."""
    f = jax.custom_jvp(lambda a: jnp.tanh(a))
    f.defjvp(lambda p, t: (f(p[0]), t[0] * (1 - jnp.tanh(p[0]) ** 2)))
    closed = jax.make_jaxpr(lambda x: f(x.astype(jnp.bfloat16)))(X)
    assert _jaxpr.sink_invariants(closed) is closed


def test_scan_params_rebind_a_scan_with_one_more_const():
    """`_jaxpr.scan_counts` / `scan_params` read and rewrite a scan's operand groups on
    every supported JAX (``num_consts``/``num_carry`` up to jax 0.11, ``ft_in``/``ft_out``
    in 0.12): a scan given one more (unused) const operand computes the same."""

    def f(c, xs, w):
        return jax.lax.scan(lambda c, x: (c * w + x, (c + x, c * x)), c, xs)

    args = (jnp.float32(1.0), jnp.arange(3.0, dtype=jnp.float32), jnp.float32(0.5))
    closed = jax.make_jaxpr(f)(*args)
    (eqn,) = [e for e in closed.jaxpr.eqns if _jaxpr.is_scan(e)]
    assert _jaxpr.scan_counts(eqn.params) == (1, 1)
    body = eqn.params["jaxpr"]
    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in body.jaxpr.invars]
    wider = jax.make_jaxpr(lambda extra, *a: _jaxpr.eval_jaxpr(body.jaxpr, body.consts, a))(
        jax.ShapeDtypeStruct((2,), jnp.float32), *avals
    )
    params = _jaxpr.scan_params(
        dict(eqn.params, jaxpr=wider), 2, len(eqn.invars) + 1, len(eqn.outvars)
    )
    assert _jaxpr.scan_counts(params) == (2, 1)
    invals = [args[2], args[0], args[1]]  # const, carry, xs (the scan's operand order)
    want = _jaxpr.bind_eqn(eqn, invals)
    got = _jaxpr.bind_eqn(eqn.replace(params=params), [jnp.ones(2, jnp.float32), *invals])
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
