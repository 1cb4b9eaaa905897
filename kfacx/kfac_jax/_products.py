"""`PowerProducts`: kfac-jax's ``multiply`` and ``multiply_inverse`` of an estimator, as
its ``multiply_matpower`` with the power 1 and -1."""

from __future__ import annotations

from typing import Any


class PowerProducts:
    """``multiply`` and ``multiply_inverse`` (kfac-jax's signatures) from the class's
    ``multiply_matpower(state, vector, identity_weight, power, exact_power, use_cached)``."""

    def multiply(
        self,
        state: Any,
        parameter_structured_vector: Any,
        identity_weight: Any,
        exact_power: bool = False,
        use_cached: bool = False,
        pmap_axis_name: str | None = None,
        norm_to_scale_identity_weight_per_block: str | None = None,
    ) -> Any:
        """``(C + identity_weight I) v``."""
        del pmap_axis_name, norm_to_scale_identity_weight_per_block
        return self.multiply_matpower(  # type: ignore[attr-defined]
            state, parameter_structured_vector, identity_weight, 1, exact_power, use_cached
        )

    def multiply_inverse(
        self,
        state: Any,
        parameter_structured_vector: Any,
        identity_weight: Any,
        exact_power: bool = False,
        use_cached: bool = False,
        pmap_axis_name: str | None = None,
        norm_to_scale_identity_weight_per_block: str | None = None,
    ) -> Any:
        """``(C + identity_weight I)^-1 v``."""
        del pmap_axis_name, norm_to_scale_identity_weight_per_block
        return self.multiply_matpower(  # type: ignore[attr-defined]
            state, parameter_structured_vector, identity_weight, -1, exact_power, use_cached
        )
