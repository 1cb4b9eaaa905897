"""The passes of `kfacx.Optimizer`'s step over a batch of the user's loss function.

`LossCall` is how the user's function is called (kfac-jax's conventions: optional
function state, rng and aux output). `BatchPasses` evaluates it over a batch, split
into micro-batches folded by `jax.lax.scan` when asked, averaging over the real
(unmasked) examples:

* `BatchPasses.value_grads_stats`: the loss, the gradient and the curvature
  statistics (on the leading ``curvature_batch_fraction`` of each micro-batch);
* `BatchPasses.loss_at`: the loss alone (for the damping adaptation);
* `BatchPasses.curvature_gram`: exact curvature products ``v_i^T C v_j`` (for the
  quadratic model) over the whole batch, from the estimator's linearized losses.

They are what the step needs of the loss function; the curvature itself is the
estimator's business (`kfacx.BlockDiagonalCurvature`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from kfacx._helpers._tree import tree_scale
from kfacx.estimator import BlockDiagonalCurvature, CurvatureStats
from kfacx.estimator._statistics import ggn_gram_upper, gram_from_upper
from kfacx.optimizer._batch_layout import leading_subset, num_examples, split_microbatches
from kfacx.optimizer._configs import AUTO_CURVATURE_EXAMPLES, BatchConfig


@dataclasses.dataclass(frozen=True, eq=False)
class LossCall:
    """How the user's function is called and how its output is read (as kfac-jax).

    Attributes:
      value_and_grad_func: ``jax.value_and_grad(loss_fn, has_aux=...)``; only its
        value is used, unless ``BatchConfig.use_func_gradients``.
      has_aux: ``loss_fn`` returns an aux output.
      has_state: ``loss_fn`` takes a state after the parameters and returns a new one.
      has_rng: ``loss_fn`` takes an rng key before the batch.
    """

    value_and_grad_func: Callable[..., Any]
    has_aux: bool
    has_state: bool
    has_rng: bool

    @property
    def has_aux_output(self) -> bool:
        """Whether ``loss_fn`` returns ``(loss, something)``."""
        return self.has_aux or self.has_state

    def value(self, *args):
        """``loss_fn(*args)``."""
        out, _ = self.value_and_grad_func(*args)
        return out

    def args(self, params, func_state, rng, batch) -> tuple:
        """``loss_fn``'s arguments."""
        args = [params]
        if self.has_state:
            args.append(func_state)
        if self.has_rng:
            args.append(rng)
        args.append(batch)
        return tuple(args)

    def split_output(self, value):
        """``loss_fn`` output -> ``(loss, func_state, aux)``, as kfac-jax reads it."""
        if not self.has_aux_output:
            return value, None, None
        loss, other = value
        if self.has_aux and self.has_state:
            return loss, other[0], other[1]
        if self.has_state:
            return loss, other, None
        return loss, None, other


class BatchPasses:
    """The step's passes over a batch (see the module's description).

    Args:
      call: how to call the loss function.
      estimator: the curvature estimator of ``call.value``.
      config: the batch options (micro-batches, masks, batch sizes).
      curvature_batch_fraction: see `kfacx.CurvatureConfig`.
    """

    def __init__(
        self,
        call: LossCall,
        estimator: BlockDiagonalCurvature,
        config: BatchConfig,
        curvature_batch_fraction: float | None,
    ):
        self.call = call
        self.estimator = estimator
        self.config = config
        self.curvature_batch_fraction = curvature_batch_fraction

    def batch_size(self, batch) -> int:
        """The examples in ``batch`` (``batch_size_extractor``, or the leading size;
        see `kfacx.optimizer._batch_layout.num_examples`)."""
        return num_examples(batch, self.config.batch_size_extractor)

    def examples_seen(self, batch, axis) -> jax.Array:
        """Real examples in ``batch`` (all devices): the mask's sum if there is one."""
        mask = self.mask(batch)
        if mask is None:
            n = jnp.asarray(self.batch_size(batch), jnp.int32)
        else:
            n = jnp.sum(mask).round().astype(jnp.int32)
        return n if axis is None else jax.lax.psum(n, axis)

    def mask(self, batch):
        """The examples' mask (``example_mask_extractor``), or None."""
        fn = self.config.example_mask_extractor
        return None if fn is None else jnp.asarray(fn(batch), jnp.float32)

    def microbatch(self, batch):
        """One micro-batch's worth of ``batch`` (shapes only matter)."""
        if self.config.num_microbatches == 1:
            return batch
        return jax.tree.map(lambda x: x[0], self.split_batch(batch))

    def split_batch(self, batch):
        """``batch`` with its leading axis split into ``[num_microbatches, n / k]``.

        Raises:
          ValueError: if ``num_microbatches`` does not divide the batch, or an array's
            leading size is not the batch size (see `kfacx.optimizer._batch_layout`).
        """
        k = self.config.num_microbatches
        return split_microbatches(batch, k, self.config.batch_size_extractor)

    def scan_batch(self, batch, func_state, init, body):
        """Folds ``body(carry, chunk, func_state, index) -> (carry, func_state)`` over
        the micro-batches (one call with the whole batch when there is one)."""
        if self.config.num_microbatches == 1:
            return body(init, batch, func_state, 0)

        def step(carry, xs):
            acc, state = carry
            chunk, index = xs
            return body(acc, chunk, state, index), None

        chunks = self.split_batch(batch)
        indices = jnp.arange(self.config.num_microbatches)
        (acc, state), _ = jax.lax.scan(step, (init, func_state), (chunks, indices))
        return acc, state

    def chunk_keys(self, rng, index):
        """``(model key, curvature key)`` of micro-batch ``index``: ``rng`` split in two,
        after folding the index in when there are several micro-batches. Every pass over
        the batch (gradient, loss, curvature products) gives the model the same key.

        A model that takes no key (``value_func_has_rng=False``) gets ``None``, and the
        curvature estimator the key itself, unsplit: it is then the key's only user.
        Each `jax.random` call is a threefry loop of its own on the CPU (about 20 kernels
        to compile), so none is made that changes nothing.
        """
        if self.config.num_microbatches > 1:
            rng = jax.random.fold_in(rng, index)
        if not self.call.has_rng:
            return None, rng
        model_rng, curv_rng = jax.random.split(rng)
        return model_rng, curv_rng

    def weight(self, chunk):
        """``(mask or None, number of real examples)`` of a (micro-)batch."""
        mask = self.mask(chunk)
        if mask is not None:
            return mask, jnp.sum(mask)
        return None, jnp.asarray(self.batch_size(chunk), jnp.float32)

    def value_grads_stats(
        self, params, func_state, rng, batch, with_stats: bool, estimator_state=None
    ):
        """Loss, gradient (and curvature statistics) averaged over the real examples
        (``estimator_state`` for the blocks whose statistics need it)."""
        est = self.estimator
        zero_stats = est.zero_curvature_stats()
        fraction = self.curvature_fraction(batch)

        def body(acc, chunk, state, index):
            loss_sum, grad_sum, stats_sum, total, stats_total, _ = acc
            model_rng, curv_rng = self.chunk_keys(rng, index)
            args = self.call.args(params, state, model_rng, chunk)
            mask, n = self.weight(chunk)
            if self.config.use_func_gradients:
                value, grads = self.call.value_and_grad_func(*args)
                stats = zero_stats
                if with_stats and fraction == 1.0:
                    stats = est.compute_curvature_stats(
                        curv_rng,
                        args,
                        example_mask=mask,
                        has_aux=self.call.has_aux_output,
                        estimator_state=estimator_state,
                    )
                elif with_stats:
                    stats = self.subset_stats(
                        params, state, model_rng, curv_rng, chunk, fraction, estimator_state
                    )
            elif with_stats and fraction == 1.0:
                value, grads, stats = est.value_grads_and_curvature_stats(
                    curv_rng,
                    args,
                    self.call.has_aux_output,
                    example_mask=mask,
                    estimator_state=estimator_state,
                )
            else:
                value, grads = jax.value_and_grad(
                    lambda p: _first(est.tagged_func(args)(p, *args[1:]), self.call.has_aux_output),
                    has_aux=True,
                )(params)
                value = value[1]
                stats = zero_stats
                if with_stats:
                    stats = self.subset_stats(
                        params, state, model_rng, curv_rng, chunk, fraction, estimator_state
                    )
            loss, new_state, aux = self.call.split_output(value)
            loss_sum, grad_sum = _add_weighted((loss_sum, grad_sum), n, (loss, grads))
            m = stats.batch_size
            stats_sum = _add_weighted(stats_sum, m, stats.blocks)
            return (loss_sum, grad_sum, stats_sum, total + n, stats_total + m, aux), new_state

        zero_grads = jax.tree.map(jnp.zeros_like, params)
        aux0 = self._aux_shape(params, func_state, rng, batch)
        zero = jnp.zeros((), jnp.float32)
        init = (zero, zero_grads, zero_stats.blocks, zero, zero, aux0)
        (loss_sum, grad_sum, stats_sum, total, stats_total, aux), new_state = self.scan_batch(
            batch, func_state, init, body
        )
        safe = jnp.where(total > 0, total, 1.0)
        loss = loss_sum / safe
        grads = tree_scale(1.0 / safe, grad_sum)
        stats_safe = jnp.where(stats_total > 0, stats_total, 1.0)
        stats = CurvatureStats(jax.tree.map(lambda s: s / stats_safe, stats_sum), stats_total)
        return loss, grads, stats, new_state, aux

    def curvature_fraction(self, batch) -> float:
        """The fraction of each (micro-)batch the curvature is estimated on:
        ``curvature_batch_fraction``, or by default 1/8 of the batch but at least
        `AUTO_CURVATURE_EXAMPLES` examples (all of a smaller batch)."""
        fraction = self.curvature_batch_fraction
        if fraction is not None:
            return float(fraction)
        n = self.batch_size(batch)
        return max(math.ceil(n / 8), min(n, AUTO_CURVATURE_EXAMPLES)) / n

    def subset_stats(
        self, params, func_state, model_rng, curv_rng, chunk, fraction, estimator_state=None
    ):
        """Curvature statistics of the leading ``fraction`` of ``chunk``."""
        sub = self.subset(chunk, fraction)
        args = self.call.args(params, func_state, model_rng, sub)
        return self.estimator.compute_curvature_stats(
            curv_rng,
            args,
            example_mask=self.mask(sub),
            has_aux=self.call.has_aux_output,
            estimator_state=estimator_state,
        )

    def subset(self, chunk, fraction: float):
        """The leading ``fraction`` of ``chunk``'s examples (``curvature_subset_extractor``,
        or the leading rows; see `kfacx.optimizer._batch_layout.leading_subset`)."""
        cfg = self.config
        m = _subset_size(chunk, fraction, cfg.batch_size_extractor)
        return leading_subset(chunk, m, cfg.batch_size_extractor, cfg.curvature_subset_extractor)

    def _aux_shape(self, params, func_state, rng, batch):
        """Zeros shaped like ``func``'s aux output on one micro-batch (scan carry)."""
        if not self.call.has_aux:
            return None
        args = self.call.args(params, func_state, rng, self.microbatch(batch))
        out = jax.eval_shape(self.call.value, *args)
        _, _, aux = self.call.split_output(out)
        return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), aux)

    def loss_at(self, params, func_state, rng, batch) -> jax.Array:
        """The loss (averaged over the real examples) at ``params``."""

        def body(acc, chunk, state, index):
            loss_sum, total = acc
            model_rng, _ = self.chunk_keys(rng, index)
            args = self.call.args(params, state, model_rng, chunk)
            loss, new_state, _ = self.call.split_output(self.call.value(*args))
            _, n = self.weight(chunk)
            return (_add_weighted(loss_sum, n, loss), total + n), new_state

        (loss_sum, total), _ = self.scan_batch(
            batch, func_state, (jnp.zeros(()), jnp.zeros(())), body
        )
        return loss_sum / jnp.where(total > 0, total, 1.0)

    def curvature_gram(self, params, func_state, rng, batch, vectors) -> jax.Array:
        """``G[i, j] = v_i^T C v_j`` with ``C`` the exact Gauss-Newton (= Fisher for the
        registered losses) averaged over the real examples of the whole batch.

        Always the whole batch, whatever ``curvature_batch_fraction``: the quadratic model
        pairs these products with the gradient's inner products, which are the whole
        batch's, and both must come from the same examples. With the products of a subset
        and the gradient of the batch, the model's step along a direction the subset
        barely curves is far too long: late in training, when a few examples carry the
        loss, that multiplied the loss by 1e20 (docs/numerics.md)."""
        est = self.estimator
        k = len(vectors)

        def body(acc, chunk, state, index):
            gram_sum, total = acc
            model_rng, _ = self.chunk_keys(rng, index)
            args = self.call.args(params, state, model_rng, chunk)
            losses, jvp = est.linearized_losses(args)
            mask, n = self.weight(chunk)
            # Each chunk's curvature is a mean over its losses' own rows (which need not be
            # the batch's leading axis: logits flattened to [batch * positions, vocab]);
            # the chunks are then averaged by their real examples, like the loss.
            gram = ggn_gram_upper(losses, jvp, vectors, mask)
            return (_add_weighted(gram_sum, n, gram), total + n), state

        num = k * (k + 1) // 2
        (gram_sum, total), _ = self.scan_batch(
            batch, func_state, (jnp.zeros((num,)), jnp.zeros(())), body
        )
        return gram_from_upper(gram_sum / jnp.where(total > 0, total, 1.0), k)


def _add_weighted(total: Any, weight: jax.Array, value: Any) -> Any:
    """``total + weight * value``, leaving ``total`` alone when ``weight`` is 0 (a
    micro-batch of padding only, whose masked mean loss may be 0/0)."""
    return jax.tree.map(
        lambda t, v: t + jnp.where(weight > 0, weight * v, 0).astype(t.dtype), total, value
    )


def _first(value, has_aux):
    """``func`` output -> ``(loss, value)`` for `jax.value_and_grad` with aux."""
    return (value[0] if has_aux else value), value


def _subset_size(chunk, fraction: float, size_extractor=None) -> int:
    """The examples in the leading ``fraction`` of ``chunk`` (at least one)."""
    return max(1, math.ceil(fraction * num_examples(chunk, size_extractor)))
