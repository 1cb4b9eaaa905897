"""`kfacx.tracer._layer_data`: folding a layer's scan iterations and uses into the batch axis."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from kfacx.tracer import _layer_data

L, B, D, E = 3, 2, 4, 5


def _use(lead=(L,), batch=B, seed=0):
    rng = np.random.default_rng(seed)

    def normal(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    return dict(
        inputs=(normal(*lead, batch, D),),
        outputs=(normal(*lead, batch, E),),
        params=(normal(D, E),),
        outputs_tangent=(normal(*lead, batch, E),),
    )


def test_fold_scans_folds_iterations_into_the_batch_axis_iteration_major():
    use = _use()
    folded, ran = _layer_data.fold_scans(use, 0, (L,), None, None)
    assert ran is None and "mask" not in folded
    np.testing.assert_array_equal(folded["inputs"][0], use["inputs"][0].reshape(L * B, D))
    np.testing.assert_array_equal(folded["outputs_tangent"][0][B], use["outputs_tangent"][0][1, 0])
    mask = np.array([1.0, 0.0])
    folded, _ = _layer_data.fold_scans(use, 0, (L,), None, mask)
    np.testing.assert_array_equal(folded["mask"], np.tile(mask, L))


def test_fold_scans_keeps_the_stacked_axis_in_front():
    use = _use(lead=(2, L))  # an outer scan of 2 iterations around the stacking scan
    folded, _ = _layer_data.fold_scans(use, 0, (2, L), 1, None)
    assert folded["inputs"][0].shape == (L, 2 * B, D)
    np.testing.assert_array_equal(folded["inputs"][0][2, B:], use["inputs"][0][1, 2])


def test_fold_scans_in_a_branch_masks_the_iterations_that_did_not_run():
    use = dict(_use(), active=jnp.array([1.0, 0.0, 1.0]))
    folded, ran = _layer_data.fold_scans(use, 0, (L,), None, None)
    np.testing.assert_array_equal(folded["mask"], [1, 1, 0, 0, 1, 1])
    assert float(ran) == 1.0
    _, ran = _layer_data.fold_scans(use, 0, (L,), 0, None)
    np.testing.assert_array_equal(ran, [1, 0, 1])


def test_fold_scans_sums_the_gradients_of_a_generic_tag():
    grads = np.arange(L * D, dtype=np.float32).reshape(1, L, D)  # [samples, L, ...]
    use = dict(inputs=(), outputs=(), params=(np.zeros(D, np.float32),), outputs_tangent=(grads,))
    folded, _ = _layer_data.fold_scans(use, 1, (L,), None, None)
    np.testing.assert_array_equal(folded["outputs_tangent"][0], grads.sum(axis=1))
    assert folded["outputs"] is use["params"]


def test_fold_uses_concatenates_along_the_batch_axis_with_masks():
    first, second = _use(lead=(), seed=1), _use(lead=(), batch=3, seed=2)
    second["mask"] = np.array([1.0, 0.0, 1.0])
    folded = _layer_data.fold_uses([first, second], 0)
    assert folded["inputs"][0].shape == (B + 3, D)
    np.testing.assert_array_equal(folded["mask"], [1, 1, 1, 0, 1])
    assert folded["params"] is first["params"]
    assert _layer_data.fold_uses([first], 0) is first
