"""kfac-jax `Optimizer` arguments that kfacx does not take, or takes with one value only
(read by `kfacx.optimizer._configs.resolve_configs`, so that a port gets a reason
instead of a generic "unknown argument")."""

from __future__ import annotations

# kfac-jax Optimizer arguments kfacx does not take, and why (a port gets this
# instead of a generic "unknown argument").
KFAC_JAX_ONLY = {
    "include_per_param_norms_in_stats": (
        "not supported; the stats have the whole model's grad, precon_grad and update "
        "norms, and per-parameter norms of params and of the update (new minus old "
        "params) can be computed from step's inputs and outputs"
    ),
    "distributed_precon_apply": (
        "every device applies the preconditioner (cheap next to the refresh, which is "
        "distributed with distributed_inverses=True)"
    ),
    "batch_process_func": (
        "apply it at the start of the loss function (it then runs inside the compiled "
        "step), or to the batch before calling step"
    ),
    "register_only_generic": "use auto_register_tags=False (and register layers by hand)",
    "patterns_to_skip": "pass auto_register_kwargs=dict(graph_patterns=...) without them",
    "forbid_setting_attributes_after_finalize": "kfacx optimizers have no finalize step",
    "modifiable_attribute_exceptions": "kfacx optimizers have no finalize step",
    "invalid_metric_value": "stats of skipped steps are reported as computed, with skipped=True",
}

# kfac-jax Optimizer options whose value is fixed in kfacx: taken with that value (a
# port may keep them), an error with any other.
KFAC_JAX_FIXED = {
    "always_use_exact_qmodel_for_damping_adjustment": (
        True,
        "the damping adaptation always uses the exact quadratic model",
    ),
    "include_norms_in_stats": (
        True,
        "the grad, precon_grad and update norms are always in the stats",
    ),
    "should_vmap_estimator_samples": (True, "the estimator's samples are always vmapped"),
}
