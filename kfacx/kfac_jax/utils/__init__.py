"""``kfac_jax.utils``: kfac-jax's utilities, served on kfacx and public JAX.

The data-parallel helpers (`p_split`, `replicate_all_local_devices`,
`broadcast_all_local_devices`, `make_different_rng_key_on_all_devices`,
`pmean_if_pmap`, ...), the math helpers blocks use (`psd_inv`,
`pi_adjusted_kronecker_inverse`, `product`, ...), the state classes
(`WeightedMovingAverage`, `State`, `register_state_class`) and the type aliases.
"""

from kfacx.kfac_jax._unsupported import unsupported as _unsupported
from kfacx.kfac_jax.utils._math import (
    cosine_similarity,
    get_special_case_zero_inv,
    get_use_cholesky_inversion,
    inner_product,
    inverse_sqrt_psd_matrices,
    invert_psd_matrices,
    kronecker_eigen_basis_axis_mul_v,
    kronecker_product_axis_mul_v,
    norm,
    outer_product,
    pi_adjusted_kronecker_factors,
    pi_adjusted_kronecker_inverse,
    product,
    psd_inv,
    psd_matrix_norm,
    psd_solve,
    rearrange,
    safe_psd_eigh,
    scalar_div,
    scalar_mul,
    set_special_case_zero_inv,
    set_use_cholesky_inversion,
    squared_norm,
    stable_sqrt,
    sum_of_objects,
    weighted_sum_of_objects,
)
from kfacx.kfac_jax.utils._misc import (
    Array,
    ArrayTree,
    AssumedFuncOutput,
    Batch,
    DType,
    Finalizable,
    Func,
    FuncArgs,
    FuncAux,
    FuncOuts,
    FuncState,
    Numeric,
    Params,
    PRNGKey,
    PyTree,
    PyTreeDef,
    Scalar,
    ScheduleType,
    Shape,
    TArrayTree,
    ValueAndGradFunc,
    ValueFunc,
    auto_scope_function,
    auto_scope_method,
    call_func_with_conditional_kwargs,
    default_batch_size_extractor,
    fake_element_from_iterator,
    filter_sequence,
    first_dim_is_size,
    replace_char,
    to_tuple_or_repeat,
    tree_is_empty,
)
from kfacx.kfac_jax.utils._parallel import (
    broadcast_all_local_devices,
    copy_array,
    copy_obj,
    get_first,
    get_mean,
    get_sum,
    host_all_gather,
    host_mean,
    host_sync,
    in_pmap,
    jit_sync_and_divide_value,
    jit_zeros_like,
    make_different_rng_key_on_all_devices,
    p_split,
    p_split_num,
    pmap_copy_obj,
    pmap_mean,
    pmap_sum,
    pmap_sync_and_divide_value,
    pmap_zeros_like,
    pmean_if_pmap,
    psum_if_pmap,
    replicate_all_local_devices,
    wrap_if_pmap,
)
from kfacx.kfac_jax.utils._state import (
    STATE_CLASSES_SERIALIZATION_DICT,
    State,
    WeightedMovingAverage,
    default_add_function,
    register_state_class,
)


def using_legacy_pmap() -> bool:
    """Whether `jax.pmap` is the legacy implementation (False on the JAX kfacx runs on)."""
    return False


_NO_STAGING = (
    "kfacx.kfac_jax.Optimizer compiles its own step; jit or pmap your own functions "
    "with jax.jit / jax.pmap"
)
staged = _unsupported("utils.staged", _NO_STAGING)
WithStagedMethods = _unsupported("utils.WithStagedMethods", _NO_STAGING)
MultiChunkAccumulator = _unsupported(
    "utils.MultiChunkAccumulator",
    "accumulate micro-batches with kfacx.accumulate_curvature_stats or "
    "Optimizer(num_microbatches=...)",
)
serialize_state_tree = _unsupported(
    "utils.serialize_state_tree",
    "kfacx states are pytrees of arrays; checkpoint them with orbax or numpy as they are",
)
deserialize_state_tree = _unsupported(
    "utils.deserialize_state_tree",
    "kfacx states are pytrees of arrays; checkpoint them with orbax or numpy as they are",
)
distribute_thunks = _unsupported(
    "utils.distribute_thunks",
    "kfacx distributes the inverse refresh itself (Optimizer(distributed_inverses=True))",
)
