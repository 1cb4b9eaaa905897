"""The batched inverses of `kfacx.linalg` against float64 numpy references: size
buckets, padded stacks, their diagonal sums and damping vectors, block inverses.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _linalg_cases import _close, _f32, _indefinite, _matpower_ref, _psd, lapack_batches

from kfacx import linalg
from kfacx.linalg import _inverse

# ----------------------------------------------------------------------------- batched inverses


def test_size_buckets_group_sizes_within_the_growth_bound():
    assert linalg.size_buckets([785, 1000, 31, 1001, 30]) == [
        (1001, [3, 1]),
        (785, [0]),
        (64, [2, 4]),  # Small sizes share one bucket of min_size.
    ]
    # 8 * 1.05 < 9: no bucket; equal sizes always share one; ties keep the input order.
    assert linalg.size_buckets([8, 9, 9, 3], min_size=1) == [(9, [1, 2]), (8, [0]), (3, [3])]
    assert linalg.size_buckets([8, 9], max_growth=1.2, min_size=1) == [(9, [1, 0])]
    assert linalg.size_buckets([8, 9, 70], min_size=16) == [(70, [2]), (16, [1, 0])]
    assert linalg.size_buckets([]) == []


def test_diagonal_sums_and_floored_damping_vector_match_each_matrix():
    """One pass over all diagonals gives each stack's traces and ``|diag|`` sums, and the
    flat vector of floored dampings equals `floored_damping` of each stack."""
    rng = np.random.default_rng(5)
    matrices = [_f32(_psd(rng, 5, k=2)), _f32(-np.eye(3)), _f32(_psd(rng, 4) * 1e-30)]
    traces, absolute = linalg.diagonal_sums(matrices)
    for m, t, a in zip(matrices, traces, absolute, strict=True):
        assert t.shape == m.shape[:-2]
        np.testing.assert_allclose(t, np.trace(m, axis1=-2, axis2=-1), rtol=1e-6)
        np.testing.assert_allclose(a, np.abs(np.diagonal(m, axis1=-2, axis2=-1)).sum(-1), rtol=1e-6)
    dampings = [_f32([0.5, 1e-12]), 0.0, 0.0]
    flat = linalg.floored_damping_vector(matrices, dampings)
    each = [
        np.broadcast_to(linalg.floored_damping(m, d), m.shape[:-2]).reshape(-1)
        for m, d in zip(matrices, dampings, strict=True)
    ]
    np.testing.assert_allclose(flat, np.concatenate(each), rtol=1e-6)
    # The dampings may be a function of the flat vector of traces.
    by_trace = linalg.floored_damping_vector(matrices, lambda tr: tr * 0 + 0.25)
    np.testing.assert_allclose(by_trace, 0.25)
    traces_seen = []
    linalg.floored_damping_vector(matrices, lambda tr: traces_seen.append(tr) or 1.0)
    np.testing.assert_allclose(traces_seen[0], np.concatenate([np.ravel(t) for t in traces]))
    assert linalg.floored_damping_vector([], []).shape == (0,)


def test_block_inverse_above_the_base_matches_float64(monkeypatch):
    """Matrices larger than the block base (here 16: sizes 37 and 70 recurse two and three
    levels, with odd halves) are inverted by block elimination to float32 accuracy,
    for a single matrix and a stack, ill-conditioned included; an indefinite matrix
    gives NaN everywhere (so that `psd_inverse` takes its eigh fallback)."""
    monkeypatch.setattr(_inverse, "_BLOCK_INVERSE_BASE", 16)
    # One program per shape, as in use; a new function, so that no trace made with
    # another base is reused.
    inverse = jax.jit(lambda m: _inverse._inverse_by_cholesky(m))
    rng = np.random.default_rng(8)
    for n in (37, 70):
        x = rng.standard_normal((3 * n, n)) * np.logspace(0, -2, n)
        a = x.T @ x / (3 * n) + 1e-3 * np.eye(n)
        stack = np.stack([a, _psd(rng, n) + 0.1 * np.eye(n)])
        out = inverse(_f32(stack))
        for o, m in zip(np.asarray(out, np.float64), stack, strict=True):
            expected = np.linalg.inv(np.asarray(_f32(m), np.float64))
            assert np.abs(o - expected).max() <= 2e-4 * np.abs(expected).max()
            assert np.abs(o - o.T).max() <= 1e-5 * np.abs(expected).max()
        plain = jax.jit(jnp.linalg.inv)(_f32(a))  # an independent float32 inverse, for scale
        assert np.abs(np.asarray(out[0]) - np.asarray(plain)).max() < 1e-2 * np.abs(plain).max()
        # Like the Cholesky path, only the lower triangle is read.
        skewed = np.tril(a) + np.triu(rng.standard_normal((n, n)), 1)
        np.testing.assert_array_equal(inverse(_f32(skewed)), inverse(_f32(a)))
    q, _ = np.linalg.qr(rng.standard_normal((40, 40)))
    indefinite = (q * np.linspace(-1.0, 2.0, 40)) @ q.T
    assert np.all(np.isnan(np.asarray(inverse(_f32(indefinite)))))
    # A new function: no trace made with another base is reused.
    out = jax.jit(lambda m, d: linalg.psd_inverse(m, d))(_f32(indefinite), 0.1)
    _close(out, _matpower_ref(np.asarray(_f32(indefinite), np.float64), -1.0, 0.1), rtol=1e-4)


def test_failed_block_inverse_is_caught_from_its_diagonal(monkeypatch):
    """`_finite_inverse` reads only the diagonal of each inverse: a matrix whose leading
    block is indefinite, one whose Schur complement is (the leading block positive
    definite), and one that is singular to float32 are all flagged, like a check of
    every entry; the good matrix of the stack is not."""
    monkeypatch.setattr(_inverse, "_BLOCK_INVERSE_BASE", 16)
    rng = np.random.default_rng(9)
    n = 37
    good = _psd(rng, n) + 0.1 * np.eye(n)
    lead_bad = good.copy()
    lead_bad[:5, :5] -= 50.0 * np.eye(5)  # inside the leading 18 x 18 block
    schur_bad = good.copy()
    schur_bad[-5:, -5:] -= 50.0 * np.eye(5)  # in the trailing block only
    assert np.linalg.eigvalsh(schur_bad[:18, :18]).min() > 0
    v = rng.standard_normal((n, 3))
    singular = v @ v.T  # rank 3
    stack = _f32(np.stack([good, lead_bad, schur_bad, singular]))

    @jax.jit  # a new function (no trace made with another base); one compilation
    def run(stack):
        out = _inverse._inverse_by_cholesky(stack)
        padded = linalg.pad_stack([stack], jnp.full((4,), 1e-30), 40)
        return out, _inverse._finite_inverse(out), linalg.cholesky_inverse_padded(padded)[1]

    out, finite, ok = run(stack)
    every_entry = np.isfinite(np.asarray(out)).all(axis=(-2, -1))
    np.testing.assert_array_equal(every_entry, [True, False, False, False])
    np.testing.assert_array_equal(finite, every_entry)
    np.testing.assert_array_equal(ok, [1.0, 0.0, 0.0, 0.0])


def test_psd_inverse_padded_equals_psd_inverse_of_each_matrix():
    """Stacks of several sizes and dampings padded to one size and inverted together equal
    `psd_inverse` of each; an indefinite matrix in the group still takes the eigh
    fallback (with its own damping floor, not the padded matrix's)."""
    rng = np.random.default_rng(3)
    bad, bad64 = _indefinite()  # 3 x 3
    matrices = [
        _f32(_psd(rng, 5, rank=2, k=2)),
        _f32(_psd(rng, 4)),
        _f32(np.stack([bad, _psd(rng, 3)])[None]),  # [1, 2, 3, 3]
    ]
    dampings = [_f32([0.5, 0.25]), 1e-3, _f32([[0.1, 0.2]])]

    @jax.jit  # one compilation instead of one per operation run eagerly
    def inverses(matrices):
        out = linalg.crop_padded(linalg.psd_inverse_padded(matrices, dampings, 5), matrices)
        each = [
            linalg.psd_inverse(m, jnp.broadcast_to(jnp.asarray(d, jnp.float32), m.shape[:-2]))
            for m, d in zip(matrices, dampings, strict=True)
        ]
        return out, each

    out, each = inverses(matrices)
    for m, o, want in zip(matrices, out, each, strict=True):
        assert o.shape == m.shape and o.dtype == m.dtype
        _close(o, want, rtol=1e-5)
    _close(out[2][0, 0], _matpower_ref(bad64, -1.0, 0.1), rtol=1e-5)
    # On the CPU, one factorisation per group, in a loop: no batched LAPACK call.
    cpu = (
        jax.jit(lambda *m: linalg.psd_inverse_padded(m, dampings, 5))
        .trace(*matrices)
        .lower(lowering_platforms=("cpu",))
        .as_text()
    )
    assert cpu.count("custom_call @lapack_spotrf") == 1 and "stablehlo.while" in cpu


def test_padded_stack_functions_reject_bad_shapes_and_counts():
    square = jnp.eye(3)
    with pytest.raises(ValueError, match=r"pad_stack: matrices\[1\] is 5 x 5, larger than"):
        linalg.pad_stack([square, jnp.eye(5)], [1.0, 1.0], 4)
    with pytest.raises(ValueError, match=r"matrices\[0\] has shape \(3, 2\); expected a stack"):
        linalg.pad_stack([jnp.ones((3, 2))], [1.0], 4)
    with pytest.raises(ValueError, match="got 1 dampings for 2 matrices"):
        linalg.pad_stack([square, square], [1.0], 4)
    with pytest.raises(ValueError, match=r"floors has shape \(3,\); .* shape \(2,\)"):
        linalg.pad_stack([square, square], jnp.ones(3), 4)
    with pytest.raises(ValueError, match="no matrices"):
        linalg.pad_stack([], [], 4)
    with pytest.raises(TypeError, match="takes a PaddedStack"):
        linalg.cholesky_inverse_padded(jnp.ones((1, 3, 3)))
    with pytest.raises(ValueError, match="psd_inverse_padded: .* larger than the padded size 2"):
        linalg.psd_inverse_padded([square], [1.0], 2)
    with pytest.raises(ValueError, match="floored_damping_vector: got 2 dampings for 1"):
        linalg.floored_damping_vector([square], [1.0, 2.0])
    with pytest.raises(ValueError, match=r"dampings function returned shape \(2,\); .* \(1,\)"):
        linalg.floored_damping_vector([square], lambda traces: jnp.ones(2))
    with pytest.raises(ValueError, match="floored_dampings: got 0 dampings for 1"):
        linalg.floored_dampings([square], [])


def test_pi_damping_vector_equals_the_split_of_each_pair():
    """The vectorised pi split over a flat vector of traces equals
    `pi_damping_from_traces` pair by pair, including the pi = 1 cases (a zero, negative
    or non-finite trace)."""
    traces_a = _f32([4.0, 0.0, 3.0, np.inf])
    traces_g = _f32([0.5, 2.0, -1.0, 1.0])
    dims_a, dims_g = 5, 3
    # Flat layout: the four a-traces, then the four g-traces.
    traces = jnp.concatenate([traces_a, traces_g])
    a, g = np.arange(4), np.arange(4, 8)
    first = np.concatenate([a, a])
    second = np.concatenate([g, g])
    dims = np.array([dims_a] * 4 + [dims_g] * 4)
    got = linalg.pi_damping_vector(traces, dims, first, second, 0.3)
    d_a, d_g = linalg.pi_damping_from_traces(traces_a, traces_g, dims_a, dims_g, 0.3, jnp.float32)
    np.testing.assert_array_equal(got, np.concatenate([d_a, d_g]))
    np.testing.assert_allclose(got[0] * got[4], 0.3, rtol=1e-6)
    np.testing.assert_allclose(got[1:4], np.sqrt(0.3), rtol=1e-6)  # pi = 1


def test_stack_padded_and_pi_damping_reject_bad_input():
    from kfacx.blocks import InverseRefresh
    from kfacx.estimator import _refresh

    with pytest.raises(ValueError, match=r"stack_padded: matrices\[0\] is 3 x 3, larger than"):
        linalg.stack_padded([jnp.eye(3)], 2)
    lone = InverseRefresh((jnp.eye(3),), linalg.PiDamping(1.0), lambda inverses: None)
    with pytest.raises(ValueError, match="PiDamping needs exactly two matrices"):
        _refresh._floors([lone], [jnp.eye(3)], None)
    # Sums and padded stacks agree with the unpadded diagonals.
    stacks = [linalg.stack_padded([_f32(np.diag([1.0, -2.0]))], 4)]
    np.testing.assert_allclose(linalg.padded_diagonal_sums(stacks), [[-1.0], [3.0]])


def test_accelerators_invert_a_bucket_in_one_batched_call_and_the_cpu_by_blocks():
    """`cholesky_inverse_padded` is lowered per backend: on the CPU a loop over the
    matrices, each by block recursion above `_BLOCK_INVERSE_BASE`; on an accelerator
    (lowered for CUDA here, no GPU needed) one batched Cholesky of the stack and no
    loop, whose kernel launches would cost more than the work. Both compute the same
    inverses (float64, to 1e-10)."""
    n = _inverse._BLOCK_INVERSE_BASE + 45  # one level of recursion, odd halves
    stack = linalg.pad_stack([jnp.ones((3, n, n))], jnp.full((3,), 0.5), n)
    lowered = {
        platform: jax.jit(lambda s: linalg.cholesky_inverse_padded(s)[0])
        .trace(stack)
        .lower(lowering_platforms=(platform,))
        .as_text()
        for platform in ("cpu", "cuda")
    }
    assert lowered["cpu"].count("stablehlo.while") == 1
    assert lowered["cpu"].count("custom_call @lapack_spotrf") == 2  # the two halves
    assert "stablehlo.while" not in lowered["cuda"]
    assert lowered["cuda"].count("custom_call @cusolver_potrf") == 1
    rng = np.random.default_rng(3)
    with jax.enable_x64(True):
        a = np.stack([_psd(rng, n) + 0.1 * np.eye(n) for _ in range(3)])
        blocks, plain = jax.jit(
            lambda m: (_inverse._block_inverse(m), _inverse._unblocked_inverse(m))
        )(a)
        np.testing.assert_allclose(blocks, plain, rtol=1e-10, atol=1e-10 * np.abs(plain).max())
        np.testing.assert_allclose(
            plain, np.linalg.inv(a), rtol=1e-8, atol=1e-8 * np.abs(plain).max()
        )


# ----------------------------------------------------------------------------- one at a time


def test_cpu_decomposes_a_stack_one_matrix_at_a_time():
    """On the CPU no LAPACK call takes more than one matrix: a batched call blocks a
    thread of XLA's pool until its pieces are done, and two at once on two cores hang
    (`kfacx.linalg._common.one_at_a_time_on_cpu`). The results are the batched calls'
    (float64: the same LAPACK routine on each matrix)."""
    rng = np.random.default_rng(7)
    with jax.enable_x64(True):
        stack = np.stack([_psd(rng, 70) for _ in range(4)]).reshape(2, 2, 70, 70)
        programs = {
            "psd_inverse": lambda m: linalg.psd_inverse(m, 0.1),
            "psd_matpower": lambda m: linalg.psd_matpower(m, -0.5, 0.1),
            "safe_eigh": linalg.safe_eigh,
        }
        for name, fn in programs.items():
            compiled = jax.jit(fn).lower(stack).compile()
            batches = lapack_batches(compiled.as_text())
            assert batches and set(batches) == {1}, (name, batches)
        vals, vecs = jax.jit(linalg.safe_eigh)(stack)
        np.testing.assert_allclose(vals, np.linalg.eigvalsh(stack), rtol=1e-10, atol=1e-10)
        rebuilt = (vecs * vals[..., None, :]) @ np.swapaxes(vecs, -1, -2)
        np.testing.assert_allclose(rebuilt, stack, rtol=1e-10, atol=1e-10)
        inverse = jax.jit(_inverse._unblocked_inverse)(stack)
        np.testing.assert_allclose(inverse, np.linalg.inv(stack), rtol=1e-8, atol=1e-8)
        # Lowered for an accelerator (no GPU needed), the stack is one batched call.
        cuda = jax.jit(linalg.safe_eigh).trace(stack).lower(lowering_platforms=("cuda",))
        assert "stablehlo.while" not in cuda.as_text()
