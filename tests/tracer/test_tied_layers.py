"""`kfacx.tracer._tied_layers`: layer tags that share parameters join one layer."""

from __future__ import annotations

import pytest

from kfacx.blocks import TIED_TAG, LayerInfo
from kfacx.tracer import _tied_layers

B, D, E = 2, 4, 5


def _info(tag, paths, shapes, **kw):
    return LayerInfo(tag, tuple(paths), tuple(shapes), tuple(["float32"] * len(paths)), **kw)


def test_join_layer_same_kind_is_one_more_use():
    dense = _info("dense_tag", ["w"], [(D, E)], input_shapes=((B, D),), output_shapes=((B, E),))
    layers, leaves_of = [dense], [(0,)]
    again = _info("dense_tag", ["w"], [(D, E)], input_shapes=((7, D),), output_shapes=((7, E),))
    assert _tied_layers.same_kind(dense, (0,), again, (0,))
    assert _tied_layers.join_layer({0}, layers, leaves_of, again, (0,)) == (0, 0)
    assert layers[0].num_uses == 2 and leaves_of == [(0,)]


def test_join_layer_other_kind_makes_a_tied_layer():
    embed = _info("embedding_tag", ["table"], [(E, D)])
    dense = _info("dense_tag", ["table", "b"], [(E, D), (D,)])
    layers, leaves_of = [embed], [(0,)]
    assert not _tied_layers.same_kind(embed, (0,), dense, (0, 1))
    assert _tied_layers.join_layer({0}, layers, leaves_of, dense, (0, 1)) == (0, 1)
    (tied,) = layers
    assert tied.tag_name == TIED_TAG and tied.roles == (embed, dense)
    assert tied.role_params == ((0,), (0, 1)) and tied.parameter_paths == ("table", "b")
    assert leaves_of == [(0, 1)]
    with pytest.raises(ValueError, match="shares parameters with several other layer tags"):
        _tied_layers.join_layer({0, 1}, [tied, embed], [(0, 1), (2,)], dense, (0, 2))


def test_join_layer_of_disjoint_slices_makes_a_sliced_layer():
    from kfacx._helpers import _views

    def sliced(start, stop):
        view = (("slice", (0, start), (D, stop), ("leaf", 0)),)
        return _info("dense_tag", ["w"], [(D, E)], meta={_views.VIEWS: view})

    layers, leaves_of = [sliced(0, 2)], [(0,)]
    assert _tied_layers.join_layer({0}, layers, leaves_of, sliced(2, E), (0,)) == (0, 1)
    assert layers[0].tag_name == "sliced" and len(layers[0].roles) == 2
    with pytest.raises(ValueError, match="overlapping slices"):
        _tied_layers.join_layer({0}, layers, leaves_of, sliced(1, 3), (0,))
