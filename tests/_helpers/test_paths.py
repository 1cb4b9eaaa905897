"""`kfacx._helpers._paths`: parameter paths, dtype checks and where parameter leaves sit."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kfacx._helpers import _paths


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class _Layer:
    w: jax.Array
    b: jax.Array


def _paths_of(tree) -> list[str]:
    return [_paths.path_to_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def test_path_to_str_joins_dict_keys_sequence_indices_and_attributes():
    tree = {"mlp/~/linear_0": {"w": 1.0, "b": 2.0}, "blocks": [3.0, _Layer(4.0, 5.0)]}
    assert _paths_of(tree) == [
        "blocks/0",
        "blocks/1/w",
        "blocks/1/b",
        "mlp/~/linear_0/b",
        "mlp/~/linear_0/w",
    ]


def test_path_to_str_of_the_root_is_empty():
    assert _paths_of(1.0) == [""]


def test_check_float_params_accepts_floats_and_names_the_first_other_leaf():
    _paths.check_float_params(["a", "b"], [np.zeros(2, np.float32), jnp.zeros((), jnp.bfloat16)])
    with pytest.raises(TypeError, match=r"Parameter 'count' has dtype int32"):
        _paths.check_float_params(["w", "count", "mask"], [np.zeros(2), np.int32(0), True])


def test_checked_param_paths():
    params = {"w": np.zeros((2, 3), np.float32), "b": np.zeros(3, np.float32)}
    assert _paths.checked_param_paths(params) == ("b", "w")
    with pytest.raises(TypeError, match="'step'"):
        _paths.checked_param_paths({"w": np.zeros(2, np.float32), "step": np.int32(1)})


def test_param_leaf_range_and_origins():
    args = ({"s": 0.0}, {"w": 1.0, "b": 2.0}, [3.0, 4.0, 5.0])
    assert _paths.param_leaf_range(args, 1) == (1, 3)
    assert _paths.param_leaf_range(args, 0) == (0, 1)
    assert _paths.param_origins(args, 1, 6) == [None, 0, 1, None, None, None]
    assert _paths.param_origins(args, 2, 6) == [None, None, None, 0, 1, 2]
