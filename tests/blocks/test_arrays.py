"""The blocks' array helpers (`kfacx.blocks._arrays`)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from kfacx.blocks._arrays import cast_to, flatten_params, row_mask, unflatten_params


def test_flatten_is_row_major_and_unflatten_inverts_it():
    w, b = np.arange(6.0).reshape(2, 3), np.array([6.0, 7.0])
    flat = flatten_params((w, b))
    np.testing.assert_array_equal(flat, np.arange(8.0))
    back = unflatten_params(flat, [(2, 3), (2,)])
    np.testing.assert_array_equal(back[0], w)
    np.testing.assert_array_equal(back[1], b)


def test_row_mask_repeats_each_example_for_its_rows():
    assert row_mask({}, 6) is None
    got = row_mask({"mask": jnp.array([1.0, 0.0])}, 6)
    np.testing.assert_array_equal(got, [1, 1, 1, 0, 0, 0])


def test_cast_to_a_narrower_float_saturates_instead_of_overflowing():
    x = jnp.array([1e6, -1e6, 1.5], jnp.float32)
    got = cast_to(x, jnp.float16)
    assert got.dtype == jnp.float16
    np.testing.assert_array_equal(np.asarray(got, np.float32), [65504.0, -65504.0, 1.5])
    assert cast_to(x, jnp.float32).dtype == jnp.float32
