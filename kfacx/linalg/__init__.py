"""Robust linear algebra for symmetric positive semi-definite (PSD) factors.

All functions accept a stack of matrices ``[..., n, n]`` (``damping`` broadcasts
over the stack axes) and return arrays of the input's dtype; they never return
NaN or Inf for a finite, non-negative ``damping``. The rules, shared by every
curvature block (see ``docs/numerics.md``):

- **Symmetry.** The Cholesky path reads the lower triangle of ``m`` (symmetric
  up to rounding); the eigendecomposition paths use ``(m + m^T) / 2``.
- **Damping floor.** The damping actually used for a matrix ``m`` of size ``n``
  is `floored_damping`::

      max(damping, n * eps * mean(|diag(m)|), sqrt(tiny))

  with ``eps`` and ``tiny`` of ``m``'s dtype (float32: ``eps = 1.2e-7``,
  ``sqrt(tiny) = 1.1e-19``). ``n * eps * mean(|diag(m)|) = eps * trace(m)`` is at
  least ``eps`` times the largest eigenvalue, the size of the rounding noise in
  the eigenvalues of ``m``: below it the damped system is not numerically
  positive definite. ``sqrt(tiny)`` keeps ``damping**p`` finite for ``p >= -2``
  when ``m`` is zero. A non-finite diagonal counts as zero.
- **Fallback chain** of `psd_inverse`: a Cholesky factorisation first; for the
  matrices of the stack where its result is not finite, an eigendecomposition
  with eigenvalues clipped at zero (`safe_eigh`), computed in float64 when
  ``jax_enable_x64`` is on and the input is float32 or narrower; if that is not
  finite either (e.g. ``m`` has NaN entries), ``(1 / damping) I``. The fallback
  is a `jax.lax.cond`, so it costs nothing when no matrix needs it (under
  `jax.vmap` the condition is batched and both branches run).
- **Many matrices at once.** `size_buckets`, `stack_padded` / `pad_stack`,
  `cholesky_inverse_padded` and `repair_padded` invert the factors of many
  blocks in a few loops (one per size bucket) with one shared fallback;
  `padded_diagonal_sums` (or `diagonal_sums`), `pi_damping_vector` and
  `floored_damping_vector` compute their traces, pi-split dampings and damping
  floors in one pass. XLA compiles a kernel per distinct shape and operation
  (about 20 ms each on the CPU, several times more for small matrices), so
  this is what keeps the compilation of a K-FAC step short.
- **Eigendecompositions** (`safe_eigh`) that come out non-finite are replaced by
  zero eigenvalues and identity eigenvectors, so that only the damping acts.
- **One matrix at a time on the CPU.** A stack is factorised or decomposed in a loop
  over its matrices there (one batched call on accelerators): jaxlib's batched LAPACK
  calls block threads of XLA's pool, and two of them at once can hang the program
  (``docs/numerics.md``).

Inputs narrower than float32 (bfloat16, float16) are computed in float32 and
cast back.
"""

from __future__ import annotations

from kfacx.linalg._common import add_to_diagonal, symmetrize
from kfacx.linalg._damping import (
    PiDamping,
    diagonal_sums,
    floor_damping,
    floored_damping,
    floored_damping_vector,
    floored_dampings,
    min_damping,
    pi_adjusted_damping,
    pi_damping_from_traces,
    pi_damping_vector,
    split_flat,
)
from kfacx.linalg._inverse import clip_eigenvalues, psd_inverse, psd_matpower, safe_eigh
from kfacx.linalg._padded import (
    PaddedStack,
    cholesky_inverse_padded,
    crop_padded,
    pad_stack,
    padded_diagonal_sums,
    psd_inverse_padded,
    repair_padded,
    size_buckets,
    stack_padded,
    stack_sizes,
)

__all__ = [
    "PaddedStack",
    "PiDamping",
    "add_to_diagonal",
    "cholesky_inverse_padded",
    "clip_eigenvalues",
    "crop_padded",
    "diagonal_sums",
    "floor_damping",
    "floored_damping",
    "floored_damping_vector",
    "floored_dampings",
    "min_damping",
    "pad_stack",
    "padded_diagonal_sums",
    "pi_adjusted_damping",
    "pi_damping_from_traces",
    "pi_damping_vector",
    "psd_inverse",
    "psd_inverse_padded",
    "psd_matpower",
    "repair_padded",
    "safe_eigh",
    "size_buckets",
    "split_flat",
    "stack_padded",
    "stack_sizes",
    "symmetrize",
]
