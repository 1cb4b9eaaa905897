"""``kfacx.kfac_jax`` exposes kfac-jax 0.0.8's public names; what it does not serve says
what to use in kfacx instead."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kfacx
import kfacx.kfac_jax as kfac_jax

#: kfac-jax 0.0.8's ``__all__`` (its ``__init__``), as released.
KFAC_JAX_ALL = [
    "utils",
    "patches_second_moment",
    "layers_and_loss_tags",
    "loss_functions",
    "tag_graph_matcher",
    "tracer",
    "curvature_blocks",
    "curvature_estimator",
    "optimizer",
    "patches_moments",
    "patches_moments_explicit",
    "LossTag",
    "LayerTag",
    "register_generic",
    "register_dense",
    "register_conv2d",
    "register_scale_and_shift",
    "auto_register_tags",
    "ProcessedJaxpr",
    "loss_tags_vjp",
    "loss_tags_jvp",
    "loss_tags_hvp",
    "layer_tags_vjp",
    "LossFunction",
    "NegativeLogProbLoss",
    "DistributionNegativeLogProbLoss",
    "NormalMeanNegativeLogProbLoss",
    "NormalMeanVarianceNegativeLogProbLoss",
    "MultiBernoulliNegativeLogProbLoss",
    "CategoricalLogitsNegativeLogProbLoss",
    "OneHotCategoricalLogitsNegativeLogProbLoss",
    "register_sigmoid_cross_entropy_loss",
    "register_multi_bernoulli_predictive_distribution",
    "register_softmax_cross_entropy_loss",
    "register_categorical_predictive_distribution",
    "register_squared_error_loss",
    "register_normal_predictive_distribution",
    "CurvatureBlock",
    "ScaledIdentity",
    "Diagonal",
    "Full",
    "KroneckerFactored",
    "NaiveDiagonal",
    "NaiveFull",
    "NaiveTNT",
    "DenseDiagonal",
    "DenseFull",
    "DenseTwoKroneckerFactored",
    "RepeatedDenseKroneckerFactored",
    "DenseTNT",
    "Conv2DDiagonal",
    "Conv2DFull",
    "Conv2DTwoKroneckerFactored",
    "Conv2DTNT",
    "ScaleAndShiftDiagonal",
    "ScaleAndShiftFull",
    "set_max_parallel_elements",
    "get_max_parallel_elements",
    "set_default_eigen_decomposition_threshold",
    "get_default_eigen_decomposition_threshold",
    "CurvatureEstimator",
    "BlockDiagonalCurvature",
    "ExplicitExactCurvature",
    "ImplicitExactCurvature",
    "set_default_tag_to_block_ctor",
    "get_default_tag_to_block_ctor",
    "Optimizer",
]

#: What FermiNet reaches beyond the top level (its sources, 2026).
FERMINET_NAMES = [
    "utils.Array",
    "utils.Scalar",
    "utils.Numeric",
    "utils.PRNGKey",
    "utils.psd_inv",
    "utils.product",
    "utils.pi_adjusted_kronecker_inverse",
    "utils.WeightedMovingAverage.zeros_array",
    "utils.replicate_all_local_devices",
    "utils.broadcast_all_local_devices",
    "utils.p_split",
    "utils.make_different_rng_key_on_all_devices",
    "utils.psum_if_pmap",
    "utils.pmean_if_pmap",
    "utils.wrap_if_pmap",
    "tag_graph_matcher._dense",
    "tag_graph_matcher._dense_parameter_extractor",
    "tag_graph_matcher.DEFAULT_GRAPH_PATTERNS",
    "tag_graph_matcher.GraphPattern",
    "layers_and_loss_tags.layer_tag",
    "optimizer.Optimizer",
    "Optimizer.State",
    "KroneckerFactored.State",
    "LayerVjpData",
]


def test_every_kfac_jax_name_is_there():
    assert sorted(kfac_jax.__all__) == sorted(KFAC_JAX_ALL)
    missing = [n for n in KFAC_JAX_ALL if not hasattr(kfac_jax, n)]
    assert missing == []


@pytest.mark.parametrize("name", FERMINET_NAMES)
def test_names_ferminet_reaches(name):
    obj = kfac_jax
    for part in name.split("."):
        obj = getattr(obj, part)


def _stubs():
    modules = [kfac_jax] + [m for m in vars(kfac_jax).values() if isinstance(m, types.ModuleType)]
    found = {}
    for module in modules:
        for name, obj in vars(module).items():
            if hasattr(obj, "kfacx_unsupported") and not name.startswith("_"):
                found[f"{module.__name__}.{name}"] = obj
    return found


STUBS = _stubs()


@pytest.mark.parametrize("name", sorted(STUBS))
def test_unsupported_names_say_what_to_use(name):
    stub = STUBS[name]
    assert "kfacx" in stub.kfacx_unsupported.split(":", 1)[1]
    with pytest.raises(NotImplementedError, match="not served by kfacx.kfac_jax"):
        stub()
    if isinstance(stub, type):
        with pytest.raises(NotImplementedError, match="not served by kfacx.kfac_jax"):
            type("Sub", (stub,), {})
        assert stub[int] is stub  # a generic in kfac-jax: annotations name it subscripted


def test_there_are_unsupported_names():
    assert len(STUBS) >= 10


@pytest.mark.parametrize(
    "name", ["Diagonal", "NaiveFull", "Conv2DTwoKroneckerFactored", "DenseTNT"]
)
def test_built_in_blocks_are_kfacx_blocks_and_cannot_be_subclassed(name):
    cls = getattr(kfac_jax, name)
    assert issubclass(kfac_jax.curvature_blocks.kfacx_block_ctor(cls), kfacx.CurvatureBlock)
    with pytest.raises(NotImplementedError, match="kfacx.blocks"):
        type("Sub", (cls,), {})


def test_default_table_is_keyed_by_variant(monkeypatch):
    table = dict(kfac_jax._block_diagonal._DEFAULT_TAG_TO_BLOCK_CTOR)
    monkeypatch.setattr(kfac_jax._block_diagonal, "_DEFAULT_TAG_TO_BLOCK_CTOR", table)
    assert kfac_jax.get_default_tag_to_block_ctor("dense") is kfac_jax.DenseTwoKroneckerFactored
    kfac_jax.set_default_tag_to_block_ctor("my_dense", kfac_jax.RepeatedDenseKroneckerFactored)
    ctors = kfac_jax.curvature_estimator.kfacx_block_ctors(None)
    assert "my_dense_tag" in ctors and ctors["dense_tag"] is kfacx.DenseTwoKroneckerFactored
    with pytest.raises(ValueError, match="without the '_tag' suffix"):
        kfac_jax.set_default_tag_to_block_ctor("dense_tag", kfacx.Diagonal)
    with pytest.raises(TypeError, match="class or factory"):
        kfac_jax.set_default_tag_to_block_ctor("my_dense", 3)


def test_pattern_errors_name_the_kfacx_way():
    gm = kfac_jax.tag_graph_matcher
    args = [np.zeros([5, 3]), [np.zeros([3, 2])]]
    with pytest.raises(NotImplementedError, match="tag_inputs_func"):
        gm.GraphPattern(
            "p",
            kfac_jax.layers_and_loss_tags.layer_tag,
            gm._dense,
            gm._dense_parameter_extractor,
            args,
            in_values_preprocessor=lambda *a: a,
        )
    with pytest.raises(NotImplementedError, match="kfacx.GraphPattern"):
        gm.GraphPattern(
            "q",
            kfac_jax.layers_and_loss_tags.layer_tag,
            lambda x, p: x * jax.numpy.sum(p[0]),
            gm._dense_parameter_extractor,
            args,
        )
    with pytest.raises(ValueError, match="LayerMetaData"):
        gm.GraphPattern(
            "r", kfac_jax.layers_and_loss_tags.layer_tag, gm._dense, lambda eqns: {}, args
        )
    with pytest.raises(TypeError, match="auto_register_kwargs"):
        gm.detection_kwargs(dict(graph_patterns=(), my_option=1))


def test_register_dense_variant_metadata_must_be_hashable():
    x, w = jax.numpy.ones((2, 3)), jax.numpy.ones((3, 4))
    with pytest.raises(TypeError, match="hashable"):
        kfac_jax.register_dense(x @ w, x, w, variant="my_variant", table=[1, 2])


def test_step_takes_one_of_batch_and_iterator():
    opt = kfac_jax.Optimizer(lambda p, b: (0.0, p), learning_rate_schedule=lambda t: 0.1)
    with pytest.raises(ValueError, match="exactly one"):
        opt.step({}, None, jax.random.PRNGKey(0))


def test_estimator_sync_and_none_entries_as_kfac_jax_tests_use_them():
    """kfac-jax's test utilities call ``estimator.sync(state, pmap_axis_name="i")`` under
    ``jax.jit`` (no pmap: nothing to average) and pass ``conv2d=None`` for a variant the
    model does not use (the default stays)."""
    ctors = kfac_jax.curvature_estimator.kfacx_block_ctors(dict(conv2d=None))
    default = kfac_jax.curvature_estimator.kfacx_block_ctors(None)
    assert {k: repr(v) for k, v in ctors.items()} == {k: repr(v) for k, v in default.items()}

    def loss(params, x):
        y = kfac_jax.register_dense(x @ params["w"], x, params["w"])
        kfac_jax.register_squared_error_loss(y, jnp.zeros_like(y))
        return jnp.sum(y**2)

    params, x = {"w": jnp.ones((3, 2))}, jnp.ones((4, 3))
    est = kfac_jax.BlockDiagonalCurvature(loss)

    @jax.jit
    def run(rng):
        state = est.init(rng, (params, x))
        state = est.update_curvature_matrix_estimate(state, 0.0, 1.0, 0.0, 4, rng, (params, x))
        return state, est.sync(state, pmap_axis_name="i")

    state, synced = run(jax.random.PRNGKey(0))
    (dense,) = est.to_diagonal_block_dense_matrix(state)
    assert jnp.allclose(dense, est.to_dense_matrix(state))
    same = jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), state, synced)
    assert all(jax.tree.leaves(same))

    n = jax.local_device_count()
    pmapped = jax.pmap(lambda s: est.sync(s, "i"), axis_name="i")
    one = jax.tree.map(lambda a: jnp.stack([a * (k + 1) for k in range(n)]), state)
    got = pmapped(one)
    want = jax.tree.map(lambda a: a * (n + 1) / 2, state.blocks[0].factors)
    for g, w in zip(jax.tree.leaves(got.blocks[0].factors), jax.tree.leaves(want), strict=True):
        assert jnp.allclose(g, w[None], rtol=1e-6)
