"""Tags: JAX primitives that mark layers and losses inside a jaxpr.

`LayerTag` marks a layer (its outputs, inputs, parameters and static metadata);
`LossTag` marks the prediction of a registered loss. Both are identities: a
tagged function computes exactly what the untagged one does.
"""

from kfacx.tags._conv import conv, conv_meta, register_conv, register_conv2d
from kfacx.tags._dense import (
    dense,
    dense_meta,
    dense_slice_meta,
    dense_stack_size,
    register_dense,
    stacked_input_axis,
)
from kfacx.tags._layer_tags import LayerTag, generic, layer_tag_for, register_generic
from kfacx.tags._loss_tags import (
    LossTag,
    ctc,
    loss_tag_for,
    normal_predictive,
    register_ctc_loss,
    register_normal_predictive_distribution,
    register_sigmoid_cross_entropy_loss,
    register_softmax_cross_entropy_loss,
    register_squared_error_loss,
    sigmoid_cross_entropy,
    softmax_cross_entropy,
)
from kfacx.tags._norm_embedding import (
    embedding,
    register_embedding,
    register_scale_and_shift,
    scale_and_shift,
)

__all__ = [
    "LayerTag",
    "LossTag",
    "conv",
    "conv_meta",
    "ctc",
    "dense",
    "dense_meta",
    "dense_slice_meta",
    "dense_stack_size",
    "embedding",
    "generic",
    "layer_tag_for",
    "loss_tag_for",
    "normal_predictive",
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
    "scale_and_shift",
    "stacked_input_axis",
    "sigmoid_cross_entropy",
    "softmax_cross_entropy",
]
