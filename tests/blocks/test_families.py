"""Block families chosen for the whole model (``curvature_block``,
`kfacx.blocks.CURVATURE_BLOCKS`): the estimator and the Optimizer build them, the
registration report shows them, a tag's own block class wins, bad names are errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kfacx
from kfacx import blocks


def _seq_loss(params, batch):
    x, labels = batch
    h = jnp.tanh(x @ params["w1"])  # [batch, positions, hidden]: a layer over positions
    logits = jnp.mean(h, axis=1) @ params["w2"]
    kfacx.register_softmax_cross_entropy_loss(logits, labels)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1))


@pytest.mark.parametrize("family", sorted(blocks.CURVATURE_BLOCKS))
def test_curvature_block_chooses_the_family_for_the_whole_model_and_the_report_shows_it(family):
    block_cls = blocks.CURVATURE_BLOCKS[family]["dense_tag"]
    rng = np.random.default_rng(0)
    params = {
        k: jnp.asarray(rng.standard_normal(s), jnp.float32)
        for k, s in (("w1", (3, 4)), ("w2", (4, 2)))
    }
    batch = (jnp.asarray(rng.standard_normal((6, 5, 3)), jnp.float32), jnp.zeros(6, jnp.int32))
    opt = kfacx.Optimizer(
        jax.value_and_grad(_seq_loss),
        curvature_block=family,
        learning_rate_schedule=0.1,
        initial_damping=0.1,
        num_burnin_steps=0,
    )
    state = opt.init(params, jax.random.key(0), batch)
    assert [type(b) for b in opt.estimator.blocks] == [block_cls, block_cls]
    assert str(opt.estimator.report).count(f" {block_cls.__name__}\n") == 2
    new_params, _, stats = opt.step(params, state, jax.random.key(1), batch)
    assert np.isfinite(float(stats["loss"])) and not bool(stats["skipped"])
    assert not np.allclose(new_params["w1"], params["w1"])


def test_a_tags_own_block_class_wins_and_bad_names_are_errors():
    params = dict(w1=jnp.ones((3, 4)), w2=jnp.ones((4, 2)))
    batch = (jnp.ones((6, 5, 3)), jnp.zeros(6, jnp.int32))
    est = kfacx.BlockDiagonalCurvature(
        _seq_loss,
        curvature_block="kfac_reduce",
        layer_tag_to_block_ctor={"dense_tag": blocks.DenseTwoKroneckerFactored},
    )
    est.init(jax.random.key(0), (params, batch))
    assert {type(b) for b in est.blocks} == {blocks.DenseTwoKroneckerFactored}
    for bad in ("reduce", None):
        with pytest.raises(ValueError, match=r"curvature_block must be one of \['ekfac', 'kfac'"):
            kfacx.BlockDiagonalCurvature(_seq_loss, curvature_block=bad)
    with pytest.raises(ValueError, match="curvature_block must be one of"):
        kfacx.Optimizer(jax.value_and_grad(_seq_loss), curvature_block="shampoo")
