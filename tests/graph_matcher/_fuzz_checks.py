"""What the detection fuzzer checks on each model of tests/graph_matcher/_fuzz_models.py.

* `check_detection`: `kfacx.auto_register_tags` finishes, or raises kfacx's own
  ValueError/TypeError (raised by kfacx's code, never JAX's or an internal error of
  another type); its report lists every parameter leaf exactly once.
* `check_products`: in float64, with every layer served by a `kfacx.blocks.Full` block
  (mode ``ggn_exact``), the estimator's product equals the dense exact GGN restricted to
  the matched layers (the same estimation mode, computed by `jax.jacrev`): with full
  blocks a correctly tagged layer holds its exact GGN block.
* `check_step`: `kfacx.Optimizer` ``init`` and one ``step`` give finite values.

Models with a ``while`` wrapper are detected only: reverse-mode autodiff (the
estimator, the optimizer's gradient) does not run through `jax.lax.while_loop`.
"""

from __future__ import annotations

import dataclasses
import os
import traceback
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from _models import output_hessian  # tests/_models.py (tests/ is on the path)
from jax.flatten_util import ravel_pytree

import kfacx

from . import _fuzz_models as F

#: Every layer tag served by a full block: a correctly tagged layer then holds its exact
#: GGN block (per-example gradients, not Kronecker factors).
FULL_BLOCKS = {tag: kfacx.blocks.Full for tag in kfacx.DEFAULT_LAYER_TAG_TO_BLOCK_CTOR}
_KFACX = os.path.dirname(os.path.abspath(kfacx.__file__))


def has_while(ops: tuple[F.Op, ...]) -> bool:
    return any(op.kind == "while" or has_while(op.body) for op in ops)


def _documented(error: Exception) -> bool:
    """Whether ``error`` is kfacx's own ValueError/TypeError: raised by a ``raise``
    statement of kfacx's code (the innermost frame of its traceback), with a message. An
    error Python raises in kfacx's code (a failed unpacking) is an internal error."""
    if type(error) not in (ValueError, TypeError) or not str(error):
        return False
    frames = traceback.extract_tb(error.__traceback__)
    if not frames or not os.path.abspath(frames[-1].filename).startswith(_KFACX):
        return False
    return (frames[-1].line or "").lstrip().startswith("raise ")


def _leaf_paths(params: Any) -> list[str]:
    paths = jax.tree_util.tree_flatten_with_path(params)[0]
    return ["/".join(str(k.key) for k in path) for path, _ in paths]


def check_detection(model: F.Model, on_unmatched: str = "warn"):
    """Detection of ``model``: ``(report, warnings)``, or ``(None, error)`` for kfacx's
    documented ValueError/TypeError; any other exception propagates."""
    params, batch = F.init_params(model), F.make_batch(model)
    loss = F.loss_fn(model)
    jax.eval_shape(loss, params, batch)  # the model itself traces (else: a generator bug)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            _, report = kfacx.auto_register_tags(loss, (params, batch), on_unmatched=on_unmatched)
        except (ValueError, TypeError) as e:
            if not _documented(e):
                raise
            return None, e
    paths = [e.path for e in report.entries]
    assert paths == _leaf_paths(params), (paths, _leaf_paths(params), str(report))
    assert set(report.unmatched) <= set(paths), str(report)
    return report, [str(w.message) for w in caught]


def check_error_option(model: F.Model, report) -> None:
    """With ``on_unmatched="error"``, the fallbacks of ``report`` are an error naming the
    parameters."""
    if not report.unmatched:
        return
    error = check_detection(model, on_unmatched="error")[1]
    assert isinstance(error, ValueError), (error, str(report))
    assert all(repr(path) in str(error) for path in report.unmatched), (str(error), str(report))


def _blocks(report) -> list[list[int]]:
    """Leaf indices of each matched layer used once (sliced uses share the layer index).
    Fallback, stacked and repeated layers are left out: a full block then holds no exact
    GGN block (it ignores the coupling of a stacked layer's slices, and sums one outer
    product per use, not the outer product of the uses' sum)."""
    layers: dict[int, list[int]] = {}
    for i, e in enumerate(report.entries):
        if e.tag != "generic_tag" and e.stack_size is None and e.uses == 1:
            layers.setdefault(e.layer, []).append(i)
    return list(layers.values())


def check_products(model: F.Model) -> int:
    """The full-block estimator's product against the dense exact GGN on the matched
    layers, in float64; returns how many parameter entries were compared."""
    with jax.enable_x64(True), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _products(dataclasses.replace(model, dtype="float64"))


def _products(model: F.Model) -> int:
    params, batch = F.init_params(model), F.make_batch(model)
    loss, key = F.loss_fn(model), jax.random.PRNGKey(0)
    est = kfacx.BlockDiagonalCurvature(
        loss, layer_tag_to_block_ctor=FULL_BLOCKS, default_estimation_mode="ggn_exact"
    )
    state = est.init(key, (params, batch))
    flat, unravel = ravel_pytree(params)
    sizes = [int(np.size(leaf)) for leaf in jax.tree_util.tree_leaves(params)]
    offsets = np.cumsum([0, *sizes])
    blocks = [
        np.concatenate([np.arange(offsets[i], offsets[i + 1]) for i in b])
        for b in _blocks(est.report)
    ]
    matched = np.zeros(len(flat), bool)
    for idx in blocks:
        matched[idx] = True
    if not matched.any():
        return 0
    v = np.where(matched, np.random.default_rng(2).standard_normal(len(flat)), 0.0)

    @jax.jit
    def run(state, args, v, flat):
        state = est.update_curvature_matrix_estimate(state, 0.0, 1.0, None, key, args)
        out = F.logits(model, F._Params(unravel(flat), jnp.float64), args[1][0])
        jac = jax.jacrev(lambda f: F.logits(model, F._Params(unravel(f), jnp.float64), args[1][0]))(
            flat
        )
        return est.multiply(state, unravel(v)), out, jac

    product, z, jac = run(state, (params, batch), v, flat)
    shapes = jax.tree.map(jnp.shape, params)
    assert jax.tree.map(jnp.shape, product) == shapes, (jax.tree.map(jnp.shape, product), shapes)
    got, z, jac = (np.asarray(a, np.float64) for a in (ravel_pytree(product)[0], z, jac))
    ggn = sum(
        j.T @ output_hessian(_kind(model), zb, 1.0) @ j for zb, j in zip(z, jac, strict=True)
    ) / len(z)
    mask = np.zeros_like(ggn, bool)
    for idx in blocks:
        mask[np.ix_(idx, idx)] = True
    want = np.where(mask, ggn, 0.0) @ v
    # Rounding of the float64 sums J^T H J v (|H| <= 2): the absolute tolerance (a product
    # that is zero up to rounding, e.g. of a saturated softmax, has no relative precision).
    # A model may compute NaN (ln of one feature, ...): NaN must then sit at the same
    # entries of both (assert_allclose's equal_nan), and the scale ignores it.
    scale = np.nanmax(np.abs(jac), initial=0.0)
    atol = 1e-12 * scale**2 * jac.shape[1] * np.abs(v).sum() + 1e-300
    # rtol: the models' float32 round trips ("cast", "convert") round the reference's
    # cotangents where kfacx reads a cast as shape-only (relative 1e-7 each).
    np.testing.assert_allclose(got[matched], want[matched], rtol=1e-5, atol=atol)
    return int(matched.sum())


def _kind(model: F.Model) -> str:
    return "softmax" if model.loss == "softmax" else "squared"


def check_step(model: F.Model) -> None:
    """`kfacx.Optimizer` ``init`` and one ``step``: finite parameters, loss and statistics."""
    params, batch = F.init_params(model), F.make_batch(model)
    opt = kfacx.Optimizer(
        jax.value_and_grad(F.loss_fn(model)),
        l2_reg=0.0,
        use_adaptive_learning_rate=True,
        use_adaptive_momentum=True,
        use_adaptive_damping=True,
        initial_damping=1.0,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state = opt.init(params, jax.random.PRNGKey(1), batch)
        new_params, _, stats = opt.step(params, state, jax.random.PRNGKey(2), batch)
    leaves = [*jax.tree.leaves(new_params), stats["loss"]]
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in leaves), (new_params, stats)


def check_model(model: F.Model, products: bool = True, step: bool = False) -> dict:
    """Every check that applies to ``model``; returns what ran (for the long run's tally)."""
    report, extra = check_detection(model)
    done = {"detected": report is not None, "error": None if report else str(extra)}
    if report is None or has_while(model.ops):
        return done
    if products:
        check_error_option(model, report)
        done["compared"] = check_products(model)
    if step:
        check_step(model)
        done["stepped"] = True
    return done
