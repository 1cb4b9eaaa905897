"""Fixtures of the detection tests."""

import jax
import pytest


@pytest.fixture
def x64():
    """Float64 arrays (``jax.enable_x64``) for the test's duration."""
    with jax.enable_x64(True):
        yield
