"""Shared toy data of the documentation snippets (not shown in the docs)."""

import numpy as np


def classification(n: int = 128, dim: int = 8, seed: int = 0):
    """``(x, labels)``: Gaussian inputs, 3 classes from the signs of two features."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, dim)).astype(np.float32)
    labels = ((x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 0)).astype(np.int32)
    return x, labels
