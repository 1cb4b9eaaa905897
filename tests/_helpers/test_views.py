"""`kfacx._helpers._views`: view expressions, their shapes, gather and transpose."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kfacx._helpers import _views

# w = concatenate([a, reshape(b, (2, 3))], 1) and a bias c, as one layer's parameters.
SHAPES = ((2, 2), (6,), (5,))
VIEWS = (("concat", 1, (("leaf", 0), ("reshape", (2, 3), ("leaf", 1)))), ("leaf", 2))


def _operands():
    return [
        np.arange(np.prod(s), dtype=np.float32).reshape(s) + 10 * i for i, s in enumerate(SHAPES)
    ]


def test_evaluate_and_shape():
    a, b, c = _operands()
    w, bias = _views.effective(_operands(), VIEWS, np)
    np.testing.assert_array_equal(w, np.concatenate([a, b.reshape(2, 3)], 1))
    np.testing.assert_array_equal(bias, c)
    assert [_views.shape(e, SHAPES) for e in VIEWS] == [(2, 5), (5,)]
    sliced = ("slice", (0, 1), (2, 3), ("leaf", 0))
    assert _views.shape(sliced, SHAPES) == (2, 2)
    assert _views.is_sliced(("concat", 0, (sliced,))) and not _views.is_sliced(VIEWS[0])
    with pytest.raises(ValueError, match="Unknown parameter view"):
        _views.evaluate(("transpose", ("leaf", 0)), _operands())


def test_scatter_inverts_a_permutation_and_positions_follow_it():
    ops = [jnp.asarray(o) for o in _operands()]
    assert _views.is_permutation(VIEWS, SHAPES)
    back = _views.scatter(_views.effective(ops, VIEWS), VIEWS, ops)
    for x, y in zip(back, ops, strict=True):
        np.testing.assert_array_equal(x, y)
    flat = np.concatenate([np.ravel(o) for o in _operands()])
    gathered = np.concatenate([np.ravel(p) for p in _views.effective(_operands(), VIEWS, np)])
    np.testing.assert_array_equal(flat[_views.positions(VIEWS, SHAPES)], gathered)
    # The transpose adds what a leaf read twice gives; such views are no permutation.
    twice = (("concat", 0, (("leaf", 0), ("leaf", 0))),)
    assert not _views.is_permutation(twice, [(2, 2)])
    (sum_back,) = _views.scatter(
        [jnp.ones((4, 2))], twice, [jax.ShapeDtypeStruct((2, 2), jnp.float32)]
    )
    np.testing.assert_array_equal(sum_back, 2 * np.ones((2, 2)))


def test_describe_and_metadata():
    names = ("w_i", "w_f", "b")
    assert _views.describe(VIEWS[0], names) == "concat[1](w_i, w_f)"
    assert _views.describe(("slice", (0,), (3,), ("leaf", 2)), names) == "b[0:3]"
    meta = {"dimension_numbers": 1, _views.VIEWS: VIEWS}
    assert _views.views_of(meta) == VIEWS and _views.without_views(meta) == {"dimension_numbers": 1}
    assert _views.views_of({}) is None


def test_boxes_of_slices():
    left = ("slice", (0, 0), (2, 2), ("leaf", 0))
    right = ("slice", (0, 2), (2, 5), ("leaf", 0))
    both = ("concat", 0, (left, ("reshape", (2, 3), right)))
    assert _views.read_boxes(both) == [(0, (0, 0), (2, 2)), (0, (0, 2), (2, 5))]
    assert _views.read_boxes(("slice", (0,), (1,), ("reshape", (6,), ("leaf", 1)))) is None
    boxes = _views.all_boxes((left, right))
    assert _views.disjoint(boxes) and _views.covers(boxes, 0, (2, 5))
    assert not _views.covers(boxes[:1], 0, (2, 5))
    assert not _views.disjoint([*boxes, (0, (1, 1), (2, 3))])
    assert _views.overlap((0, None, None), boxes[0]) and not _views.overlap(
        (1, None, None), boxes[0]
    )
    assert _views.renumber_boxes(boxes[:1], ["w"]) == [("w", (0, 0), (2, 2))]
