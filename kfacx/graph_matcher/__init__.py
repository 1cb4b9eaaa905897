"""Automatic layer detection: graph patterns over jaxprs.

`auto_register_tags` traces a loss function, finds every `GraphPattern` in its
jaxpr (dense, convolution and scale-and-shift layers by default, inside
`jax.jit`, `jax.checkpoint` and custom-derivative functions too) and returns
a function with layer tags inserted, plus a `RegistrationReport` that lists
every parameter with the tag it got.
"""

from kfacx.graph_matcher._auto_register import ON_UNMATCHED, auto_register_tags
from kfacx.graph_matcher._defaults import (
    DEFAULT_GRAPH_PATTERNS,
    conv_parameters_extractor,
    dense_parameters_extractor,
)
from kfacx.graph_matcher._graph import Match
from kfacx.graph_matcher._match import find_matches
from kfacx.graph_matcher._pattern import GraphPattern
from kfacx.graph_matcher._report import RegistrationEntry, RegistrationReport

__all__ = [
    "DEFAULT_GRAPH_PATTERNS",
    "ON_UNMATCHED",
    "GraphPattern",
    "Match",
    "RegistrationEntry",
    "RegistrationReport",
    "auto_register_tags",
    "conv_parameters_extractor",
    "dense_parameters_extractor",
    "find_matches",
]
