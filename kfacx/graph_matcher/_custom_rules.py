"""Whether a custom-derivative function's rule agrees with its body's derivative.

Detection tags layers inside ``custom_jvp`` / ``custom_vjp`` bodies, and the tracer
evaluates a tagged body in place, so the gradient it computes is the body's own
derivative. Where the function's rule computes another one (e.g. FermiNet's energy,
whose rule is the score-function estimator), the user is warned; the check is one JVP
by the rule and one by the body at random inputs, once per equation.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from kfacx._helpers import _jaxpr

_CHECKED_RULES: dict[int, tuple[Any, bool]] = {}


def rule_differs(eqn) -> bool:
    """Whether a custom-derivative call's rule gives another JVP than its body, at random
    float inputs and tangents of its operands' shapes (True when that cannot be checked:
    operands that are not float or integer arrays)."""
    body, consts = _jaxpr.call_body(eqn)
    rng = np.random.default_rng(0)
    primals, tangents = [], []
    for v in eqn.invars:
        dtype = np.dtype(v.aval.dtype) if hasattr(v.aval, "dtype") else None
        if dtype is None or not (
            np.issubdtype(dtype, np.floating) or np.issubdtype(dtype, np.integer)
        ):
            return True
        if np.issubdtype(dtype, np.floating):
            primals.append(rng.standard_normal(v.aval.shape).astype(dtype))
            tangents.append(rng.standard_normal(v.aval.shape).astype(dtype))
        else:
            primals.append(np.zeros(v.aval.shape, dtype))
            tangents.append(np.zeros(v.aval.shape, jax.dtypes.float0))
    try:
        with jax.ensure_compile_time_eval():  # eagerly, also under the tagged function's trace
            _, by_rule = jax.jvp(lambda *a: _jaxpr.bind_eqn(eqn, list(a)), primals, tangents)
            _, by_body = jax.jvp(lambda *a: _jaxpr.eval_jaxpr(body, consts, a), primals, tangents)
            by_rule, by_body = jax.device_get((by_rule, by_body))
    except Exception:  # noqa: BLE001 - a rule that cannot run here is not checked
        return True
    return not all(
        np.allclose(np.asarray(r, np.float64), np.asarray(b, np.float64), rtol=1e-3, atol=1e-5)
        for r, b in zip(by_rule, by_body, strict=True)
    )


def first_check_differs(eqn) -> bool:
    """`rule_differs` the first time ``eqn`` is checked in this process, False after
    (one warning per equation)."""
    if id(eqn) in _CHECKED_RULES:  # the equation is kept, so its id stays its own
        return False
    _CHECKED_RULES[id(eqn)] = (eqn, rule_differs(eqn))
    return _CHECKED_RULES[id(eqn)][1]
