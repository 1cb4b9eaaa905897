"""`kfacx.tracer._layer_info`: the LayerInfo of a tag equation, also inside `lax.scan`s."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from kfacx import tags
from kfacx._helpers import _jaxpr
from kfacx.blocks import LayerInfo
from kfacx.tracer import _layer_info

L, B, D, E = 3, 2, 4, 5
INFO = LayerInfo("dense_tag", ("w", "b"), ((D, E), (E,)), ("float32",) * 2, ((B, D),), ((B, E),))


def _scans(*lengths):
    """Scan equations of the given lengths (the layer's scans, outermost first)."""

    def f(x):
        return [jax.lax.scan(lambda c, _: (c, None), x, None, length=n)[0] for n in lengths]

    return tuple(e for e in jax.make_jaxpr(f)(1.0).jaxpr.eqns if _jaxpr.is_scan(e))


def test_outside_scans_nothing_changes():
    assert _layer_info.scan_layer_info(INFO, [0, 1], ()) == (INFO, (), None)


def test_parameters_closed_over_make_uses_of_one_layer():
    info, lengths, level = _layer_info.scan_layer_info(INFO, [0, 1], _scans(L, 2))
    assert (lengths, level, info.num_uses, info.stack_size) == ((L, 2), None, 2 * L, None)


def test_parameters_scanned_over_make_a_stacked_layer():
    origins = [_jaxpr.ScanSlice(0, 1), _jaxpr.ScanSlice(1, 1)]
    info, lengths, level = _layer_info.scan_layer_info(INFO, origins, _scans(2, L))
    assert (lengths, level, info.stack_size, info.num_uses) == ((2, L), 1, L, 2)
    assert info.parameter_shapes == ((L, D, E), (L, E)) and info.input_shapes == ((L, B, D),)


@pytest.mark.parametrize(
    "origins, match",
    [
        ([_jaxpr.ScanSlice(0, 0), 1], "as scanned-over inputs"),
        ([_jaxpr.ScanSlice(0, 0), _jaxpr.ScanSlice(1, 1)], "slices of different scans"),
        ([_jaxpr.ScanSlice(_jaxpr.ScanSlice(0, 0), 1), 1], "two levels of stacking"),
    ],
)
def test_unservable_stacking_is_an_error(origins, match):
    with pytest.raises(ValueError, match=match):
        _layer_info.scan_layer_info(INFO, origins, _scans(2, L))


def test_a_stacked_dense_layer_in_a_scan_is_an_error():
    stacked = LayerInfo("dense_tag", ("w",), ((L, D, E),), ("float32",), stack_size=L)
    with pytest.raises(ValueError, match="stacked dense layer .* inside a `scan`"):
        _layer_info.scan_layer_info(stacked, [0], _scans(2))


def _tag_site(f, *args):
    closed = jax.make_jaxpr(f)(*args)
    (site,) = [s for s in _jaxpr.tag_sites(closed.jaxpr, [None, 0, 1][: len(args)])]
    return site


def test_layer_info_of_a_dense_tag():
    x, w, b = np.zeros((B, D), np.float32), np.zeros((D, E), np.float32), np.zeros(E, np.float32)
    site = _tag_site(lambda x, w, b: tags.register_dense(x @ w + b[None], x, w, b), x, w, b)
    info, leaves = _layer_info.layer_info(tags.dense, site.eqn, site.origins, ("w", "b"))
    assert leaves == (0, 1) and info.parameter_paths == ("w", "b")
    assert info.input_shapes == ((B, D),) and info.output_shapes == ((B, E),)
    assert info.compute is tags.dense.compute and info.stack_size is None


def test_layer_info_of_a_stacked_dense_tag_describes_one_slice():
    x, w = np.zeros((L, B, D), np.float32), np.zeros((L, D, E), np.float32)
    dnums = (((2,), (1,)), ((0,), (0,)))

    def f(x, w):
        return tags.register_dense(jax.lax.dot_general(x, w, dnums), x, w, dimension_numbers=dnums)

    site = _tag_site(f, x, w)
    info, _ = _layer_info.layer_info(tags.dense, site.eqn, site.origins, ("w",))
    assert info.stack_size == L and info.input_shapes == ((L, B, D),)
    assert info.meta == tags.dense_slice_meta(dnums)


def test_layer_info_rejects_computed_parameters():
    x, w = np.zeros((B, D), np.float32), np.zeros((D, E), np.float32)
    site = _tag_site(lambda x, w: tags.register_dense(x @ (2 * w), x, 2 * w), x, w)
    with pytest.raises(ValueError, match="parameter operand 0 is computed inside the function"):
        _layer_info.layer_info(tags.dense, site.eqn, site.origins, ("w",))
