"""What the sharded curvature state relies on (`kfacx.estimator._sharded_units`): a
block's refresh (`update_cache`) passes its moving averages on unchanged, so a refresh
rewrites only the cache's rows. Read from each block's traced refresh, for every block
of the shared table (tests/blocks/_block_table.py) and each kind of cache; the wrappers
and the other families are checked on the model of
tests/estimator/test_refresh_buckets.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from kfacx._helpers import _tree

from ._block_table import CASES, _ids

#: The caches the estimator asks for: the default inverse, an exact power, eigenvalues.
SPECS = {
    "inverse": dict(approx_powers_to_cache=(-1.0,)),
    "exact_power": dict(exact_powers_to_cache=(-0.5,)),
    "eigenvalues": dict(cache_eigenvalues=True),
}


@pytest.mark.parametrize("case", CASES, ids=_ids(CASES))
def test_a_refresh_passes_the_moving_averages_on_unchanged(case):
    block = case.block()
    for name, spec in SPECS.items():
        state = jax.eval_shape(lambda spec=spec: block.init(jax.random.key(0), **spec))
        changed = _tree.leaves_changed(block.update_cache, state, jnp.float32(0.1))
        num_factors = len(jax.tree.leaves(state.factors))
        assert not any(changed[:num_factors]), (name, changed)
