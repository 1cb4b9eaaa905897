"""kfacx: K-FAC second-order optimization for JAX.

Mark layers with the ``register_*`` functions (or let detection find them),
register the loss on the model output, and precondition gradients with
`BlockDiagonalCurvature`.
"""

from kfacx import blocks, graph_matcher, linalg, losses, parallel, tags, tracer
from kfacx._helpers._compile import enable_compilation_cache, fast_compile_options
from kfacx.blocks import (
    ConvEKFAC,
    ConvTNT,
    ConvTwoKroneckerFactored,
    ConvTwoKroneckerFactoredReduce,
    CurvatureBlock,
    DenseEKFAC,
    DenseTNT,
    DenseTwoKroneckerFactored,
    DenseTwoKroneckerFactoredReduce,
    Diagonal,
    EmbeddingEKFAC,
    EmbeddingKroneckerFactored,
    Full,
    LayerInfo,
    ScaleAndShiftDiagonal,
    ScaleAndShiftFull,
    TwoKroneckerFactored,
)
from kfacx.estimator import (
    DEFAULT_LAYER_TAG_TO_BLOCK_CTOR,
    ESTIMATION_MODES,
    BlockDiagonalCurvature,
    CurvatureStats,
    EstimatorState,
)
from kfacx.estimator._sharded_checkpoint import shard_estimator_state
from kfacx.estimator._sharded_curvature import gather_estimator_state
from kfacx.graph_matcher import (
    DEFAULT_GRAPH_PATTERNS,
    GraphPattern,
    RegistrationReport,
    auto_register_tags,
)
from kfacx.losses import (
    CTCLoss,
    LossFunction,
    NormalPredictiveLoss,
    SigmoidCrossEntropyLoss,
    SoftmaxCrossEntropyLoss,
)
from kfacx.optimizer import (
    BatchConfig,
    CurvatureConfig,
    DampingConfig,
    LearningRateConfig,
    Optimizer,
    OptimizerState,
)
from kfacx.tags import (
    LayerTag,
    LossTag,
    register_conv,
    register_conv2d,
    register_ctc_loss,
    register_dense,
    register_embedding,
    register_generic,
    register_normal_predictive_distribution,
    register_scale_and_shift,
    register_sigmoid_cross_entropy_loss,
    register_softmax_cross_entropy_loss,
    register_squared_error_loss,
)
from kfacx.tracer import layer_tags_vjp, loss_tags_jvp, loss_tags_vjp
from kfacx.transform import (
    AccumulateCurvatureStatsState,
    ScaleByKfacState,
    accumulate_curvature_stats,
    estimator_state,
    flag_non_finite_stats,
    precondition,
    scale_by_kfac,
)
from kfacx.transform._aliases import kfac_adamw, kfac_soap
from kfacx.transform._eigen_adam import ScaleByKfacEigenAdamState, scale_by_kfac_eigen_adam
from kfacx.transform._graft import GraftState, graft
from kfacx.transform._partition import block_labels

__version__ = "0.1.0.dev0"

__all__ = [
    "AccumulateCurvatureStatsState",
    "BatchConfig",
    "CurvatureConfig",
    "DampingConfig",
    "LearningRateConfig",
    "Optimizer",
    "OptimizerState",
    "CurvatureStats",
    "ScaleByKfacState",
    "ScaleByKfacEigenAdamState",
    "accumulate_curvature_stats",
    "block_labels",
    "estimator_state",
    "flag_non_finite_stats",
    "gather_estimator_state",
    "shard_estimator_state",
    "GraftState",
    "kfac_adamw",
    "kfac_soap",
    "graft",
    "precondition",
    "scale_by_kfac",
    "scale_by_kfac_eigen_adam",
    "DEFAULT_GRAPH_PATTERNS",
    "DEFAULT_LAYER_TAG_TO_BLOCK_CTOR",
    "ESTIMATION_MODES",
    "BlockDiagonalCurvature",
    "CTCLoss",
    "ConvEKFAC",
    "ConvTNT",
    "ConvTwoKroneckerFactored",
    "ConvTwoKroneckerFactoredReduce",
    "CurvatureBlock",
    "DenseEKFAC",
    "DenseTNT",
    "DenseTwoKroneckerFactored",
    "DenseTwoKroneckerFactoredReduce",
    "Diagonal",
    "EmbeddingEKFAC",
    "EmbeddingKroneckerFactored",
    "EstimatorState",
    "Full",
    "GraphPattern",
    "LayerInfo",
    "LayerTag",
    "LossFunction",
    "LossTag",
    "NormalPredictiveLoss",
    "RegistrationReport",
    "ScaleAndShiftDiagonal",
    "ScaleAndShiftFull",
    "SigmoidCrossEntropyLoss",
    "SoftmaxCrossEntropyLoss",
    "TwoKroneckerFactored",
    "auto_register_tags",
    "blocks",
    "enable_compilation_cache",
    "fast_compile_options",
    "graph_matcher",
    "layer_tags_vjp",
    "linalg",
    "loss_tags_jvp",
    "loss_tags_vjp",
    "losses",
    "parallel",
    "register_conv",
    "register_conv2d",
    "register_ctc_loss",
    "register_dense",
    "register_embedding",
    "register_generic",
    "register_normal_predictive_distribution",
    "register_scale_and_shift",
    "register_sigmoid_cross_entropy_loss",
    "register_softmax_cross_entropy_loss",
    "register_squared_error_loss",
    "tags",
    "tracer",
]
