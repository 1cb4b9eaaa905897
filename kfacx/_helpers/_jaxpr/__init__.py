"""Jaxprs, with the public JAX API only (`jax.extend.core`).

* `eval_jaxpr` / `eval_eqns` (`_interpret`): the one jaxpr interpreter, a read / write
  loop over the equations with a hook per equation;
* `eqns_with_origins` / `bodies` (`_origins`): the one origin tracker, which follows
  labels of a jaxpr's inputs (parameter leaves) into call bodies, scan bodies (stacked
  slices, `ScanSlice`) and cond branches; `tag_sites` walks the tags with it;
* `eval_jaxpr_sites` (`_sites`): the tracer's evaluation, with a hook at every tag;
* `dce` / `sink_invariants` (`_passes`): jaxpr -> jaxpr passes run before detection.
"""

from kfacx._helpers._jaxpr._interpret import (
    CALL_BODY_PARAMS,
    EvalEqn,
    Jaxpr,
    JaxprEqn,
    bind_eqn,
    call_body,
    contains_tags,
    eval_eqns,
    eval_jaxpr,
    has_tagged_body,
    is_cond,
    is_scan,
    is_tag_eqn,
    read,
    scan_counts,
    scan_params,
    sub_jaxprs,
    unsupported_container,
)
from kfacx._helpers._jaxpr._origins import (
    TOP,
    Body,
    ScanSlice,
    Scope,
    TagSite,
    bodies,
    count_tag_sites,
    eqns_with_origins,
    leaf_origin,
    scan_body_origins,
    slice_levels,
    tag_sites,
)
from kfacx._helpers._jaxpr._passes import dce, loss_ancestors, sink_invariants, tag_ancestors
from kfacx._helpers._jaxpr._sites import OnTag, eval_jaxpr_sites

__all__ = [
    "Body",
    "CALL_BODY_PARAMS",
    "EvalEqn",
    "Jaxpr",
    "JaxprEqn",
    "OnTag",
    "ScanSlice",
    "Scope",
    "TOP",
    "TagSite",
    "bind_eqn",
    "bodies",
    "call_body",
    "contains_tags",
    "count_tag_sites",
    "dce",
    "loss_ancestors",
    "eqns_with_origins",
    "eval_eqns",
    "eval_jaxpr",
    "eval_jaxpr_sites",
    "has_tagged_body",
    "is_cond",
    "is_scan",
    "is_tag_eqn",
    "leaf_origin",
    "read",
    "scan_counts",
    "scan_params",
    "scan_body_origins",
    "sink_invariants",
    "tag_ancestors",
    "slice_levels",
    "sub_jaxprs",
    "tag_sites",
    "unsupported_container",
]
