"""Where a batch's examples are: how many there are, a subset of them, micro-batches.

By default the examples run along the leading axis of every array of the batch,
and the first array's leading size is the batch size. A batch laid out otherwise
(a graph batch: nodes ``[total_nodes, ...]`` with a ``node_graph`` index, targets
``[graphs, ...]``) says how many examples it has with ``batch_size_extractor``.
Cutting such a batch is never guessed: an array whose leading size is not the
batch size (and that is not a scalar) is a `ValueError` naming it, unless the user
cuts the batch (``curvature_subset_extractor``, or micro-batches of their own).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

SizeExtractor = Callable[[Any], int] | None
SubsetExtractor = Callable[[Any, int], Any] | None


def num_examples(batch: Any, size_extractor: SizeExtractor) -> int:
    """The examples in ``batch``: ``size_extractor(batch)``, or the first array's
    leading size.

    Raises:
      TypeError: if ``size_extractor`` does not return an int known at trace time.
      ValueError: for a batch whose size cannot be read, or a size below 1.
    """
    if size_extractor is None:
        leaves = jax.tree.leaves(batch)
        if not leaves or not jnp.ndim(leaves[0]):
            raise ValueError(
                "The batch has no array with a leading (examples) axis first; pass "
                "batch_size_extractor=lambda batch: <its number of examples>."
            )
        return int(jnp.shape(leaves[0])[0])
    value = size_extractor(batch)
    try:
        n = operator.index(value)
    except TypeError:
        raise TypeError(
            f"batch_size_extractor returned {value!r}; it must return the number of examples "
            "as an int read from the arrays' shapes (known when the step is traced), e.g. "
            "batch_size_extractor=lambda batch: batch['targets'].shape[0]."
        ) from None
    if n < 1:
        raise ValueError(f"batch_size_extractor returned {n}; a batch needs at least one example.")
    return n


def leading_subset(
    batch: Any, m: int, size_extractor: SizeExtractor, subset_extractor: SubsetExtractor
) -> Any:
    """``m`` of ``batch``'s examples: ``subset_extractor(batch, m)``, or the first ``m``
    rows of every array (scalars kept whole).

    Raises:
      ValueError: if an array's leading size is not the batch size (without
        ``subset_extractor``), or ``subset_extractor`` returns another number of
        examples than ``m``.
    """
    if subset_extractor is not None:
        sub = subset_extractor(batch, m)
        got = num_examples(sub, size_extractor)
        if got != m:
            raise ValueError(
                f"curvature_subset_extractor(batch, {m}) returned a batch of {got} examples "
                f"({_size_source(size_extractor)}); it must return a batch of exactly {m} "
                "of the batch's examples."
            )
        return sub
    n = num_examples(batch, size_extractor)
    _check_per_example(
        batch,
        n,
        size_extractor,
        f"the curvature is estimated on {m} of its {n} examples (curvature_batch_fraction, "
        "by default 1/8 of the batch but at least 128 examples)",
        "Pass curvature_batch_fraction=1.0 to estimate it on the whole batch, or cut the "
        "subset yourself: curvature_subset_extractor=lambda batch, m: <the batch of its "
        "first m examples> (kfacx.BatchConfig).",
    )
    return jax.tree.map(lambda x: x[:m] if jnp.ndim(x) else x, batch)


def split_microbatches(batch: Any, k: int, size_extractor: SizeExtractor) -> Any:
    """``batch`` with every array's leading axis split into ``[k, n / k]`` (scalars
    repeated ``k`` times), for `jax.lax.scan`.

    Raises:
      ValueError: if ``k`` does not divide the batch size, or an array's leading
        size is not the batch size.
    """
    n = num_examples(batch, size_extractor)
    if n % k:
        raise ValueError(
            f"num_microbatches={k} does not divide the batch's leading dimension {n} "
            f"({_size_source(size_extractor)}); use a batch size divisible by it."
        )
    _check_per_example(
        batch,
        n,
        size_extractor,
        f"num_microbatches={k} splits it into micro-batches of {n // k} examples",
        "Pass num_microbatches=1 and hand the optimizer batches of the micro-batch size "
        "instead, or lay every array out with its examples along its leading axis.",
    )

    def split(x):
        if not jnp.ndim(x):
            return jnp.broadcast_to(x, (k,))
        return jnp.reshape(x, (k, n // k, *jnp.shape(x)[1:]))

    return jax.tree.map(split, batch)


def _check_per_example(batch, n, size_extractor, what: str, fix: str) -> None:
    """Raises a ValueError naming the arrays whose leading size is not ``n``."""
    bad = [
        f"batch{jax.tree_util.keystr(path)} (shape {tuple(jnp.shape(leaf))})"
        for path, leaf in jax.tree_util.tree_flatten_with_path(batch)[0]
        if jnp.ndim(leaf) and jnp.shape(leaf)[0] != n
    ]
    if bad:
        raise ValueError(
            f"{', '.join(bad)}: the leading axis is not the batch's {n} examples "
            f"({_size_source(size_extractor)}), and {what}: which rows belong to which "
            f"example is not known. {fix}"
        )


def _size_source(size_extractor: SizeExtractor) -> str:
    if size_extractor is None:
        return "the first array's leading size; pass batch_size_extractor if it is not"
    return "by batch_size_extractor"
