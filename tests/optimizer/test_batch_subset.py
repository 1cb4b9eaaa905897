"""A batch whose arrays do not all run over its examples: a graph batch (nodes and their
graph index ``[graphs * nodes]``, targets ``[graphs]``) with ``batch_size_extractor``.

The curvature subset and the micro-batches cut the batch by its examples (the
extractor's size), never by the first array's rows; a batch that cannot be cut that way
is a clear error, or the user cuts it (``curvature_subset_extractor``). The quadratic
model's curvature products are always the whole batch's. References are built by hand,
in float64.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kfacx

GRAPHS, NODES, FEATURES, HIDDEN, OUT = 40, 5, 3, 4, 2
SUBSET = 20  # curvature_batch_fraction=0.5 of the 40 graphs


@pytest.fixture
def x64():
    with jax.enable_x64(True):
        yield


def graph_loss(params, batch):
    """Nodes through a dense layer, summed per graph, a dense readout, squared error."""
    h = jnp.tanh(batch["nodes"] @ params["w1"] + params["b1"][None, :])
    graphs = batch["targets"].shape[0]
    pooled = jax.ops.segment_sum(h, batch["node_graph"], num_segments=graphs)
    out = pooled @ params["w2"] + params["b2"][None, :]
    kfacx.register_squared_error_loss(out, batch["targets"])
    return 0.5 * jnp.mean(jnp.sum((out - batch["targets"]) ** 2, axis=-1))


def labels_loss(params, batch):
    """`graph_loss` for the same batch with ``targets`` named ``labels`` (first leaf)."""
    return graph_loss(params, {**batch, "targets": batch["labels"]})


def make_params():
    rng = np.random.default_rng(0)
    return {
        "w1": jnp.asarray(rng.normal(size=(FEATURES, HIDDEN))),
        "b1": jnp.asarray(0.1 * rng.normal(size=(HIDDEN,))),
        "w2": jnp.asarray(0.3 * rng.normal(size=(HIDDEN, OUT))),
        "b2": jnp.zeros((OUT,)),
    }


def make_batch():
    rng = np.random.default_rng(1)
    return {
        "nodes": jnp.asarray(rng.normal(size=(GRAPHS * NODES, FEATURES))),
        "node_graph": jnp.repeat(jnp.arange(GRAPHS), NODES),
        "targets": jnp.asarray(rng.normal(size=(GRAPHS, OUT))),
    }


def first_graphs(batch, m):
    """The batch of its first ``m`` graphs, with their nodes (nodes are graph-sorted)."""
    return {
        "nodes": batch["nodes"][: m * NODES],
        "node_graph": batch["node_graph"][: m * NODES],
        "targets": batch["targets"][:m],
    }


def count_graphs(batch):
    return batch["targets"].shape[0]


def make_opt(loss=graph_loss, **kwargs):
    return kfacx.Optimizer(
        jax.value_and_grad(loss),
        learning_rate_schedule=0.1,
        damping_schedule=1e-2,
        estimation_mode="fisher_empirical",
        num_burnin_steps=0,
        **kwargs,
    )


def one_step(opt, batch):
    params = make_params()
    state = opt.init(params, jax.random.key(0), batch)
    new_params, _, _ = opt.step(params, state, jax.random.key(1), batch)
    return new_params


def test_default_fraction_takes_the_whole_graph_batch(x64):
    """40 graphs (200 nodes) are a batch of 40 examples: the default rule takes all of
    them, whatever the keys are named (before: 128 of the 200 node rows, graphs 26-39
    empty, a step 0.11 away)."""
    batch = make_batch()
    default = one_step(make_opt(batch_size_extractor=count_graphs), batch)
    whole = one_step(
        make_opt(batch_size_extractor=count_graphs, curvature_batch_fraction=1.0), batch
    )
    for name in default:
        np.testing.assert_array_equal(default[name], whole[name])
    renamed = {
        "labels": batch["targets"],
        "node_graph": batch["node_graph"],
        "nodes": batch["nodes"],
    }
    labels_first = one_step(make_opt(labels_loss), renamed)
    for name in default:
        np.testing.assert_allclose(labels_first[name], whole[name], rtol=1e-12, atol=1e-14)


def test_a_subset_of_a_graph_batch_without_a_subset_extractor_is_an_error(x64):
    batch = make_batch()
    opt = make_opt(batch_size_extractor=count_graphs, curvature_batch_fraction=0.5)
    state = opt.init(make_params(), jax.random.key(0), batch)
    with pytest.raises(ValueError, match=r"batch\['nodes'\] \(shape \(200, 3\)\)") as info:
        opt.step(make_params(), state, jax.random.key(1), batch)
    message = str(info.value)
    for text in ("batch['node_graph']", "40 examples", "curvature_batch_fraction=1.0"):
        assert text in message
    assert "curvature_subset_extractor=lambda batch, m:" in message
    # Without the extractor the first array (node_graph, 200 rows) is the batch size:
    # the targets are then the array that cannot be cut, and the fix names the extractor.
    opt = make_opt(curvature_batch_fraction=0.5)
    state = opt.init(make_params(), jax.random.key(0), batch)
    with pytest.raises(ValueError, match=r"batch\['targets'\].*batch_size_extractor"):
        opt.step(make_params(), state, jax.random.key(1), batch)


def test_microbatches_of_a_graph_batch_are_an_error_naming_the_arrays(x64):
    opt = make_opt(batch_size_extractor=count_graphs, num_microbatches=2)
    with pytest.raises(ValueError, match=r"batch\['node_graph'\].*num_microbatches=1"):
        opt.init(make_params(), jax.random.key(0), make_batch())


def test_subset_extractor_statistics_are_those_of_the_first_graphs(x64):
    """With ``curvature_subset_extractor`` the factors are the statistics of the batch
    restricted by hand to its first 20 graphs (20 = 0.5 of 40)."""
    params, batch = make_params(), make_batch()
    opt = make_opt(
        batch_size_extractor=count_graphs,
        curvature_subset_extractor=first_graphs,
        curvature_batch_fraction=0.5,
        curvature_ema=0.0,
    )
    state = opt.init(params, jax.random.key(0), batch)
    state, _ = opt.burnin(1, params, state, jax.random.key(1), iter([batch]))
    restricted = first_graphs(batch, SUBSET)
    estimator = kfacx.BlockDiagonalCurvature(graph_loss, default_estimation_mode="fisher_empirical")
    estimator.init(jax.random.key(0), (params, restricted))
    stats = jax.jit(estimator.compute_curvature_stats)(jax.random.key(0), (params, restricted))
    assert stats.batch_size == SUBSET
    for block_state, block_stats in zip(state.estimator_state.blocks, stats.blocks, strict=True):
        for factor, stat in zip(block_state.factors, block_stats, strict=True):
            np.testing.assert_allclose(factor.value, stat, rtol=1e-12, atol=1e-14)
    # The quadratic model's exact curvature products are the whole batch's (they pair
    # with the whole batch's gradient), not the subset's.
    vectors = (params, jax.tree.map(lambda p: jnp.cos(p) + 1.0, params))
    whole = make_opt(batch_size_extractor=count_graphs, curvature_batch_fraction=1.0)
    whole.init(params, jax.random.key(0), batch)

    def gram(o, b):
        return jax.jit(o._passes.curvature_gram)(params, None, jax.random.key(2), b, vectors)

    np.testing.assert_allclose(gram(opt, batch), gram(whole, batch), rtol=1e-12)
    assert not np.allclose(gram(opt, batch), gram(whole, restricted), rtol=1e-3)


def test_subset_extractor_must_return_the_requested_number_of_examples(x64):
    batch = make_batch()
    opt = make_opt(
        batch_size_extractor=count_graphs,
        curvature_subset_extractor=lambda b, m: first_graphs(b, m + 1),
        curvature_batch_fraction=0.5,
    )
    state = opt.init(make_params(), jax.random.key(0), batch)
    with pytest.raises(ValueError, match=r"curvature_subset_extractor\(batch, 20\).* 21 examples"):
        opt.burnin(1, make_params(), state, jax.random.key(1), iter([batch]))


def test_extractors_must_be_functions_and_sizes_known_when_traced():
    with pytest.raises(TypeError, match="curvature_subset_extractor must be None or a function"):
        kfacx.BatchConfig(curvature_subset_extractor=0.5)
    with pytest.raises(TypeError, match="batch_size_extractor must be None or a function"):
        kfacx.Optimizer(jax.value_and_grad(graph_loss), batch_size_extractor=40)
    batch = make_batch()
    traced = make_opt(batch_size_extractor=lambda b: jnp.sum(b["targets"][:, 0] * 0 + 1))
    state = traced.init(make_params(), jax.random.key(0), batch)
    with pytest.raises(TypeError, match=r"batch_size_extractor returned .*shape\[0\]"):
        traced.burnin(1, make_params(), state, jax.random.key(1), iter([batch]))
