"""`kfacx.tags._primitive._IdentityTag`: an identity primitive on its marked operands that
survives tracing, differentiation, vmap and jit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kfacx.tags._primitive import _IdentityTag

TAG = _IdentityTag("test_identity_tag", 2)
A = np.arange(3, dtype=np.float32)
B = np.ones((2, 2), np.float32)
INFO = np.float32(7)


def test_bind_returns_the_marked_operands_and_is_in_the_jaxpr():
    out = TAG.bind(A, B, INFO, kind="k")
    assert len(out) == 2
    np.testing.assert_array_equal(out[0], A)
    np.testing.assert_array_equal(out[1], B)
    jaxpr = jax.make_jaxpr(lambda a, b, c: TAG.bind(a, b, c, kind="k"))(A, B, INFO).jaxpr
    (eqn,) = jaxpr.eqns
    assert eqn.primitive is TAG.primitive and eqn.params == {"kind": "k"}
    assert TAG.name == eqn.primitive.name == "test_identity_tag"


def test_split_operands_and_repr():
    assert TAG.split_operands([1, 2, 3, 4]) == ((1, 2), (3, 4))
    assert repr(TAG) == "_IdentityTag('test_identity_tag')"


def test_only_marked_operands_carry_derivatives():
    def f(a, c):
        x, _ = TAG.bind(a * a, B, c)
        return jnp.sum(x) + 0 * c

    grad_a, grad_c = jax.grad(f, argnums=(0, 1))(A, INFO)
    np.testing.assert_allclose(grad_a, 2 * A)
    assert grad_c == 0.0
    _, tangent = jax.jvp(lambda a: TAG.bind(a, B)[0], (A,), (np.ones(3, np.float32),))
    np.testing.assert_array_equal(tangent, np.ones(3))


def test_vmap_and_jit():
    batched = jax.vmap(lambda a: TAG.bind(a, B)[0])(np.stack([A, 2 * A]))
    np.testing.assert_array_equal(batched, np.stack([A, 2 * A]))
    jitted = jax.jit(lambda a, b: TAG.bind(a + 1, b))(A, B)
    np.testing.assert_array_equal(jitted[0], A + 1)


def test_invalid_tags_and_too_few_operands():
    with pytest.raises(TypeError, match="non-empty string name"):
        _IdentityTag("", 1)
    with pytest.raises(ValueError, match="must mark at least one array"):
        _IdentityTag("test_marks_nothing", 0)
    with pytest.raises(ValueError, match="needs at least 2 operands, got 1"):
        TAG.bind(A)
