"""Tests of `kfacx.optimizer._configs`: the Optimizer's config dataclasses and flat keyword
options."""

import dataclasses

import pytest

import kfacx
from kfacx._helpers import _checks
from kfacx.optimizer._configs import FLAT_NAMES, resolve_configs


def test_flat_options_replace_config_fields_in_their_group():
    curvature, lr, damping, batch = resolve_configs(
        kfacx.CurvatureConfig(curvature_ema=0.9),
        None,
        None,
        None,
        dict(inverse_update_period=3, initial_damping=0.5, num_microbatches=2),
    )
    assert (curvature.curvature_ema, curvature.inverse_update_period) == (0.9, 3)
    assert lr == kfacx.LearningRateConfig()
    assert damping.initial_damping == 0.5 and batch.num_microbatches == 2


@pytest.mark.parametrize(
    ("flat", "configs", "error", "match"),
    [
        (dict(distributed_precon_apply=False), {}, TypeError, "every device applies"),
        (dict(learning_rat=0.1), {}, TypeError, "unknown arguments \\['learning_rat'\\]"),
        ({}, dict(damping=kfacx.CurvatureConfig()), TypeError, "damping must be a DampingConfig"),
        (dict(curvature_ema=1.5), {}, ValueError, "curvature_ema must be in"),
    ],
)
def test_bad_options_name_the_argument(flat, configs, error, match):
    args = {**dict(curvature=None, learning_rate=None, damping=None, batch=None), **configs}
    with pytest.raises(error, match=match):
        resolve_configs(**args, flat=flat)


def test_every_field_has_one_flat_name():
    fields = [
        f.name
        for cls in (
            kfacx.CurvatureConfig,
            kfacx.LearningRateConfig,
            kfacx.DampingConfig,
            kfacx.BatchConfig,
        )
        for f in dataclasses.fields(cls)
    ]
    assert sorted(fields) == sorted(FLAT_NAMES)


def test_schedules_are_checked_when_the_config_is_made():
    with pytest.raises(TypeError, match="damping_schedule must be a number or a schedule"):
        kfacx.DampingConfig(damping_schedule="high")
    assert kfacx.LearningRateConfig(learning_rate_schedule="0.1").learning_rate_schedule == "0.1"
    assert _checks.as_schedule("0.1", "x")(7) == 0.1
    assert _checks.as_schedule(None, "x") is None
