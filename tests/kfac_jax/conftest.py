"""The kfac-jax API tests run in float64 (``jax.enable_x64``), to compare with kfacx's
own API to rounding."""

import jax
import pytest


@pytest.fixture(autouse=True)
def _x64():
    with jax.enable_x64(True):
        yield
