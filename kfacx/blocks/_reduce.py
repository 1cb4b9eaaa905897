"""K-FAC-reduce blocks for layers applied over shared positions.

A dense layer over a sequence, or a convolution over output pixels, shares its
weight across positions. The default blocks ("K-FAC-expand",
`DenseTwoKroneckerFactored`, `ConvTwoKroneckerFactored`) treat every
(example, position) pair as an example of its own:

    A = sum over rows of x x^T / (number of rows),  G = sum over rows of dy dy^T / B.

K-FAC-reduce (Eschenhagen et al., NeurIPS 2023, "Kronecker-Factored Approximate
Curvature for Modern Neural Network Architectures") reduces over the positions
first: each example's inputs are averaged and its output cotangents summed,

    a_n = mean_t x_{n,t},  g_{s,n} = sum_t dy_{s,n,t},
    A = sum_n a_n a_n^T / B,  G = sum_{s,n} g_{s,n} g_{s,n}^T / B

(``s`` the estimator's samples, whose second moments are summed; a bias adds a 1
to ``a_n``; padding examples, mask 0, leave ``A`` as in the other blocks). It is
exact for a linear layer whose outputs are reduced over the positions before the
loss, at batch size 1, where expand is not; with one position the two are equal.
The factors have the same sizes as expand's, so products, refreshes and norms are
the base class's, and the statistics cost a mean and a sum over the positions less
than expand's.

The uses of a layer applied several times with the same weights (a `lax.scan`
closing over them, tied uses of one kind: `kfacx.blocks.LayerInfo.num_uses`) are
folded into the batch axis by the tracer, so these blocks reduce over the positions
within each use and treat the uses as examples ("expand" over uses). EKFAC
(`kfacx.blocks.DenseEKFAC`) sums an example's gradient over its uses as well.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp

from kfacx.blocks._kronecker import (
    ConvTwoKroneckerFactored,
    DenseTwoKroneckerFactored,
    _input_second_moment,
    _second_moment,
    _with_ones,
)


class DenseTwoKroneckerFactoredReduce(DenseTwoKroneckerFactored):
    """K-FAC-reduce block of a dense layer (see the module docstring): the input
    factor from each example's inputs averaged over its positions (the free axes of
    ``x`` after the first, the example axis), the output factor from its output
    cotangents summed over them. Without positions it equals
    `DenseTwoKroneckerFactored`."""

    def compute_statistics(self, estimation_data: Mapping[str, Sequence[jax.Array]], batch_size):
        (x,) = estimation_data["inputs"]
        (dy,) = estimation_data["outputs_tangent"]
        x_axes = tuple(a % x.ndim for a in self.x_axes)
        x = jnp.moveaxis(x, x_axes, tuple(range(x.ndim - len(x_axes), x.ndim)))
        examples = x.shape[0] if x.ndim > len(x_axes) else 1
        x = x.reshape(examples, -1, self._in).astype(self.dtype)
        a = jnp.mean(x, axis=1)[:, None, :]
        if self.has_bias:
            a = _with_ones(a)
        # dy: [samples, *x's free axes, *w's free axes]: one row per sample and example.
        dy = dy.astype(self.dtype).reshape(-1, x.shape[1], self._out)
        g = jnp.sum(dy, axis=1)[:, None, :]
        return _input_second_moment(a, estimation_data), _second_moment(g, batch_size)


class ConvTwoKroneckerFactoredReduce(ConvTwoKroneckerFactored):
    """K-FAC-reduce block of a convolution (see the module docstring): the input
    factor from each example's patches averaged over the output positions, the
    output factor from its output cotangents summed over them, per feature group.
    With one output position it equals `ConvTwoKroneckerFactored`."""

    def compute_statistics(self, estimation_data, batch_size):
        (x,) = estimation_data["inputs"]
        (dy,) = estimation_data["outputs_tangent"]
        examples = x.shape[self.dnums.lhs_spec[0]]
        rows = self.patches(x.astype(self.dtype))
        a = jnp.mean(rows.reshape(examples, -1, *rows.shape[1:]), axis=1)
        if self.has_bias:
            a = _with_ones(a)
        # dy: [samples, *output_shape] -> [samples, batch, *positions, features].
        out_batch, out_feature = self.dnums.out_spec[:2]
        dy = jnp.moveaxis(dy.astype(self.dtype), (out_batch + 1, out_feature + 1), (1, -1))
        positions = rows.shape[0] // examples
        g = jnp.sum(dy.reshape(-1, positions, self.groups, self.out_per_group), axis=1)
        return _input_second_moment(a, estimation_data), _second_moment(g, batch_size)
