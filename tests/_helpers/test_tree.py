"""Tests of `kfacx._helpers._tree`: pytree algebra and the non-finite guard of the step."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kfacx._helpers import _tree


def test_tree_dot_equals_the_sum_over_leaves_with_small_leaves_concatenated():
    rng = np.random.default_rng(0)
    shapes = [(70, 80), (80,), (3,), (5000,), (2, 3, 4)]  # big, small, small, big, small
    a = [jnp.asarray(rng.normal(size=s), jnp.float32) for s in shapes]
    b = [jnp.asarray(rng.normal(size=s), jnp.float32) for s in shapes]
    a[2], b[2] = a[2].astype(jnp.bfloat16), b[2].astype(jnp.bfloat16)  # widened, not overflowed
    expected = sum(
        float(np.sum(np.asarray(x, np.float64) * np.asarray(y, np.float64)))
        for x, y in zip(a, b, strict=True)
    )
    got = jax.jit(_tree.tree_dot)(a, b)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(float(got), expected, rtol=1e-5)
    # One small leaf alone, and a non-finite entry in a small leaf, still show.
    np.testing.assert_allclose(float(_tree.tree_dot(a[1:2], b[1:2])), float(a[1] @ b[1]))
    a[1] = a[1].at[3].set(jnp.nan)
    assert not np.isfinite(float(_tree.tree_dot(a, b)))


def test_tree_gram_is_every_pairwise_tree_dot():
    rng = np.random.default_rng(1)
    shapes = [(70, 80), (80,), (3,), (5000,), (2, 3, 4)]
    trees = [[jnp.asarray(rng.normal(size=s), jnp.float32) for s in shapes] for _ in range(3)]
    trees[1][2] = trees[1][2].astype(jnp.bfloat16)  # widened before the products
    with jax.enable_x64(True):
        exact = [[np.asarray(x, np.float64) for x in tree] for tree in trees]
        expected = np.array(
            [[sum(np.sum(x * y) for x, y in zip(a, b, strict=True)) for b in exact] for a in exact]
        )
    got = jax.jit(_tree.tree_gram)(trees)
    assert got.shape == (3, 3) and got.dtype == jnp.float32
    scale = np.sqrt(np.outer(np.diag(expected), np.diag(expected)))  # float32 rounding
    np.testing.assert_allclose(np.asarray(got), expected, rtol=0, atol=1e-6 * scale.max())
    np.testing.assert_array_equal(np.asarray(got), np.asarray(got).T)
    # A non-finite entry shows in its row and column.
    trees[2][1] = trees[2][1].at[0].set(jnp.inf)
    got = np.asarray(_tree.tree_gram(trees))
    assert not np.isfinite(got[2]).any() and np.isfinite(got[:2, :2]).all()


def test_tree_gram_in_float64_matches_tree_dot_to_rounding():
    with jax.enable_x64(True):
        rng = np.random.default_rng(2)
        trees = [
            {"w": jnp.asarray(rng.normal(size=(90, 60))), "b": jnp.asarray(rng.normal(size=60))}
            for _ in range(2)
        ]
        got = _tree.tree_gram(trees)
        assert got.dtype == jnp.float64
        for i in range(2):
            for j in range(2):
                np.testing.assert_allclose(
                    float(got[i, j]), float(_tree.tree_dot(trees[i], trees[j])), rtol=1e-12
                )


@pytest.mark.parametrize("select_small", [False, True])
@pytest.mark.parametrize("ok", [True, False])
def test_keep_unless_returns_either_tree_bit_for_bit(ok, select_small):
    """Large leaves go through a select, small ones through one lax.cond (or a select
    each, ``select_small``): every way gives exactly one of the two trees, dtypes and
    None leaves included."""

    def tree(seed):
        r = np.random.default_rng(seed)
        return dict(
            w=jnp.asarray(r.normal(size=(100, 50)), jnp.float32),
            b=jnp.asarray(r.normal(size=(50,)), jnp.bfloat16),
            count=jnp.asarray(r.integers(0, 9), jnp.int32),
            none=None,
        )

    new, old = tree(2), tree(3)
    new["w"] = new["w"].at[0, 0].set(jnp.nan)  # a select must not mix NaN into the old tree
    fn = functools.partial(_tree.keep_unless, select_small=select_small)
    out = jax.jit(fn)(jnp.asarray(ok), new, old)
    primitives = {e.primitive.name for e in jax.make_jaxpr(fn)(jnp.asarray(ok), new, old).eqns}
    assert ("cond" in primitives) is not select_small, primitives
    want = new if ok else old
    assert out["none"] is None
    for key in ("w", "b", "count"):
        assert out[key].dtype == want[key].dtype
        np.testing.assert_array_equal(np.asarray(out[key]), np.asarray(want[key]))


def test_guard_non_finite_keeps_the_old_tree_when_a_checked_value_is_not_finite():
    new, old = {"w": jnp.ones(3)}, {"w": jnp.zeros(3)}
    finite, out = _tree.guard_non_finite((jnp.float32(1.0), None), new, old)
    assert bool(finite) and np.all(np.asarray(out["w"]) == 1.0)
    finite, out = _tree.guard_non_finite((jnp.float32(jnp.inf), jnp.arange(2)), new, old)
    assert not bool(finite) and np.all(np.asarray(out["w"]) == 0.0)


def test_axpy_and_scale_keep_each_leaf_dtype():
    x = {"a": jnp.ones(2, jnp.bfloat16), "b": jnp.ones(3)}
    y = {"a": jnp.ones(2, jnp.bfloat16), "b": jnp.zeros(3)}
    out = _tree.tree_axpy(2.0, x, y)
    assert out["a"].dtype == jnp.bfloat16 and float(out["a"][0]) == 3.0
    np.testing.assert_array_equal(_tree.tree_scale(0.5, x)["b"], 0.5)
    assert _tree.tree_scale(0.5, x)["a"].dtype == jnp.bfloat16


def test_leaves_changed_reads_which_leaves_a_function_passes_on():
    def update(tree, x):
        return dict(a=tree["a"], b=tree["b"] * x, c=jnp.where(x > 0, tree["c"], 0.0))

    tree = dict(a=jnp.ones(2), b=jnp.ones(3), c=jax.ShapeDtypeStruct((4,), jnp.float32))
    assert _tree.leaves_changed(update, tree, 1.0) == [False, True, True]
    assert _tree.leaves_changed(lambda t: t, tree) == [False, False, False]
    with pytest.raises(ValueError, match="expected that of its first argument"):
        _tree.leaves_changed(lambda t: (t["a"],), tree)
