"""Multi-device statistics of the optax side: per-device statistics averaged with
``weighted_mean_stats`` and `kfacx.scale_by_kfac` under ``pmap`` equal the single-device
computation on all the devices' real examples.
"""

from __future__ import annotations

import jax
import numpy as np
from _models import init_mlp
from _optax_cases import (
    DAMPING,
    KEY,
    SIZES,
    _without_xla_optimizations,  # noqa: F401  (autouse fixture)
    assert_trees_close,
    max_rel_diff,
    mlp_data,
    mlp_estimator,
    take,
    to64,
)

import kfacx
from kfacx.estimator import weighted_mean_stats

# ----------------------------------------------------------------------------- multi-device

NUM_DEVICES = 4


def _sharded(batch, masks):
    """Splits a batch into ``[devices, slots, ...]`` shards with the given masks."""
    x, labels, _ = batch
    shape = masks.shape
    return (
        x.reshape(shape + x.shape[1:]),
        labels.reshape(shape),
        masks.astype(x.dtype),
    )


def _real_examples(sharded):
    x, labels, mask = sharded
    keep = np.flatnonzero(mask.reshape(-1))
    x, labels = x.reshape((-1,) + x.shape[2:])[keep], labels.reshape(-1)[keep]
    return x, labels, np.ones((len(keep),))


def test_pmap_weighted_mean_stats_equal_stats_of_concatenated_batch():
    """Per-device statistics averaged with ``weighted_mean_stats`` (directly, and through
    ``update_curvature_estimate_from_stats(..., pmap_axis_name)``) are the statistics of
    all the devices' real examples, whether or not the devices hold as many."""
    assert jax.local_device_count() >= NUM_DEVICES
    equal = np.ones((NUM_DEVICES, 3), bool)
    uneven = np.array([[1, 1, 1], [1, 0, 1], [0, 1, 0], [0, 0, 0]], bool)  # 3, 2, 1, 0 real
    with jax.enable_x64(True):
        params = to64(init_mlp(SIZES, seed=60))
        est = mlp_estimator()
        est.set_up((params, take(_sharded(mlp_data(12, seed=0), equal), 0)))

        def per_device(x, labels, mask):
            args = (params, (x, labels, mask))
            _, _, stats = est.value_grads_and_curvature_stats(KEY, args, example_mask=mask)
            state = est.init(KEY, args)
            folded = est.update_curvature_estimate_from_stats(state, stats, 0.0, 1.0, "i")
            return weighted_mean_stats(stats, "i"), jax.lax.pmean(stats.blocks, "i"), folded

        pooled_stats = jax.pmap(per_device, axis_name="i")
        for masks in (equal, uneven):
            shards = _sharded(mlp_data(12, seed=61), masks)
            real = _real_examples(shards)
            pooled, naive, folded = jax.device_get(pooled_stats(*shards))
            est_single = mlp_estimator()

            @jax.jit
            def single(real=real, est_single=est_single):
                _, _, stats = est_single.value_grads_and_curvature_stats(KEY, (params, real))
                state = est_single.init(KEY, (params, real))
                return stats, est_single.update_curvature_estimate_from_stats(
                    state, stats, 0.0, 1.0
                )

            want, single_state = single()
            for d in range(NUM_DEVICES):
                assert float(pooled.batch_size[d]) == masks.sum()
                assert_trees_close(take(pooled.blocks, d), want.blocks)
                assert_trees_close(take(folded, d), single_state)
            if masks is uneven:
                # The unweighted device mean is wrong here: weighting matters.
                assert max_rel_diff(take(naive, 0), want.blocks) > 1e-2


def test_pmap_scale_by_kfac_update_equals_single_device_update():
    """Each device has its own shard (all real and no example_mask, or padded); the
    gradients are averaged over the devices by the test (weighted by the real examples),
    the statistics by ``scale_by_kfac(..., pmap_axis_name=...)``."""
    assert jax.local_device_count() >= NUM_DEVICES
    kwargs = dict(damping=DAMPING, curvature_ema=0.6, inverse_update_period=1)
    equal = np.ones((NUM_DEVICES, 2), bool)
    uneven = np.array([[1, 1], [1, 0], [0, 1], [1, 1]], bool)
    with jax.enable_x64(True):
        params = to64(init_mlp(SIZES, seed=70))
        est = mlp_estimator()
        shard = take(_sharded(mlp_data(8, seed=0), equal), 0)
        tx = kfacx.scale_by_kfac(est, (params, shard), pmap_axis_name="i", **kwargs)

        def device_step(state, x, labels, mask, example_mask):
            args = (params, (x, labels, mask))
            _, grads, stats = est.value_grads_and_curvature_stats(
                KEY, args, example_mask=example_mask
            )
            n = stats.batch_size
            grads = jax.tree_util.tree_map(
                lambda g: jax.lax.psum(n * g, "i") / jax.lax.psum(n, "i"), grads
            )
            return tx.update(grads, state, params, curvature_stats=stats)

        step = jax.pmap(device_step, axis_name="i")
        for masks in (equal, uneven):
            batches = [_sharded(mlp_data(8, seed=71 + t), masks) for t in range(2)]
            reals = [_real_examples(b) for b in batches]
            est_single = mlp_estimator()
            tx_single = kfacx.scale_by_kfac(est_single, (params, reals[0]), **kwargs)

            @jax.jit
            def single_step(state, batch, est_single=est_single, tx_single=tx_single):
                _, grads, stats = est_single.value_grads_and_curvature_stats(KEY, (params, batch))
                return tx_single.update(grads, state, params, curvature_stats=stats)

            state = jax.device_get(jax.jit(tx.init)(params))
            state = jax.tree_util.tree_map(lambda a: np.stack([a] * NUM_DEVICES), state)
            single_state = jax.jit(tx_single.init)(params)
            for batch, real in zip(batches, reals, strict=True):
                example_mask = None if masks is equal else batch[2]
                got, state = jax.device_get(step(state, *batch, example_mask))
                want, single_state = single_step(single_state, real)
                for d in range(NUM_DEVICES):
                    assert_trees_close(take(got, d), want)
                    assert_trees_close(take(state, d), single_state)
