"""Indexer scoring over packed MXFP4 key records vs the golden Indexer math (index_scores_ref, float64).

Tolerance, per output element: bitwise equal except where an fp32 sum (the D-term dot or the H-term
head sum) is inexact and lands next to a bf16 rounding boundary; such elements may be 1 bf16 ULP off
(plus the propagation of a 1-ULP head score through relu * w into the sum, bounded by
2^-8 * Σ_h |bf16(relu(s_h) w_h)|). We require that bound everywhere, -inf exactly where the golden
has it, and at least 99% bitwise equal elements. Measured (2026-11-30): bitwise equal in every case,
CPU interpreter and H200 (H=32, D=128, T=4096 and 1M, M=1 and 6); `-s` prints the mismatch counts.
"""

import pytest
import torch

from engine.kernels.indexer import index_scores, index_scores_batched, index_scores_rows
from engine.presets import full_config
from tests.kernels.numeric import assert_index_scores_close, index_problem

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _check(q, w, pool, slots, visible, min_equal=0.99):
    assert_index_scores_close(index_scores(q, w, pool, slots, visible), q, w, pool, slots, visible, min_equal)


@pytest.mark.parametrize("m,h,d,t", [(1, 2, 32, 37), (3, 4, 64, 100), (3, 2, 64, 37), (1, 4, 32, 100), (3, 2, 128, 37)])
def test_index_scores_matches_golden(m, h, d, t):
    _check(*index_problem(m, h, d, t, entries=t + 23))


def test_paged_pool_and_int64_slots():
    q, w, pool, slots, visible = index_problem(3, 4, 32, 37, entries=64, seed=1)
    _check(q, w, pool.view(16, 4, -1), slots.long(), visible)


def test_empty_request():
    q, w, pool, slots, visible = index_problem(1, 2, 32, 5, entries=8)
    assert index_scores(q, w, pool, slots[:0], visible * 0).shape == (1, 0)


def _causal_rows(m, h, d, t, device="cpu", seed=0):
    """A prefill chunk's queries: m consecutive positions whose visible counts rise to t (ratio 2: two queries per
    entry), the first ones seeing nothing."""
    q, w, pool, slots, _ = index_problem(m, h, d, t, entries=t + 23, seed=seed)
    visible = ((torch.arange(m) + 2 * t - m + 1) // 2).clamp(0, t)
    return [x.to(device) for x in (q, w, pool, slots, visible)]


@pytest.mark.parametrize("transposed", [True, False])
@pytest.mark.parametrize("m,h,d,t,per_program", [(37, 4, 64, 100, 4), (5, 2, 32, 37, 32), (64, 4, 32, 130, 8),
                                                 (9, 32, 128, 70, 2)])
def test_index_scores_rows_matches_golden(m, h, d, t, per_program, transposed):
    """Many queries at once (query groups, entry tiles no query sees, rows that see nothing): the golden's
    scores within test_indexer's tolerance, and bitwise index_scores' (the same tile math) on every row."""
    q, w, pool, slots, visible = _causal_rows(m, h, d, t, seed=m)
    visible[m // 2] = 0  # a row amid the chunk that sees nothing
    out = index_scores_rows(q, w, pool, slots, visible, block_t=16, queries_per_program=per_program,
                            transposed=transposed)
    assert_index_scores_close(out, q, w, pool, slots, visible)
    for r in range(0, m, 16):
        assert torch.equal(out[r:r + 16], index_scores(q[r:r + 16], w[r:r + 16], pool, slots, visible[r:r + 16]))


def test_index_scores_rows_empty():
    q, w, pool, slots, visible = _causal_rows(3, 2, 32, 5)
    assert index_scores_rows(q, w, pool, slots[:0], visible * 0).shape == (3, 0)
    assert index_scores_rows(q[:0], w[:0], pool, slots, visible[:0]).shape == (0, 5)


def _check_batched(b, h, d, t, device="cpu", seed=0):
    """Row r of index_scores_batched = index_scores of query r alone against its own entries (bitwise: the
    same tile math), whose oracle is the golden (_check); entries past a row's visible count are never
    read (poisoned with out-of-range slots here), and a row that sees nothing is all -inf."""
    g = torch.Generator().manual_seed(seed)
    q, w, pool, _, visible = index_problem(b, h, d, t, entries=t + 23, seed=seed)
    entries = torch.stack([torch.randperm(t + 23, generator=g)[:t] for _ in range(b)]).to(torch.int32)
    entries = torch.where(torch.arange(t) < visible[:, None], entries, 10**9)
    q, w, pool, entries, visible = (x.to(device) for x in (q, w, pool, entries, visible))
    out = index_scores_batched(q, w, pool, entries, visible)
    for r in range(b):
        n = int(visible[r])
        assert bool(torch.isneginf(out[r, n:].float()).all()), f"row {r}: past visible"
        if n:
            want = index_scores(q[r:r + 1], w[r:r + 1], pool, entries[r, :n].contiguous(), visible[r:r + 1])
            assert torch.equal(out[r, :n], want[0]), f"row {r}"
            _check(q[r:r + 1], w[r:r + 1], pool, entries[r, :n].contiguous(), visible[r:r + 1])


@pytest.mark.parametrize("b,h,d,t", [(1, 2, 32, 37), (4, 4, 64, 100), (3, 2, 128, 130)])
def test_index_scores_batched_rows_are_their_requests(b, h, d, t):
    _check_batched(b, h, d, t)


@gpu
@needs_cuda
@pytest.mark.parametrize("b,t", [(3, 4096), (17, 9000)])
def test_index_scores_batched_real_shape(b, t):
    cfg = full_config()
    _check_batched(b, cfg.index_n_heads, cfg.index_head_dim, t, device="cuda", seed=b)


@gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 6])
@pytest.mark.parametrize("t", [4096, 1 << 20])
def test_index_scores_real_shape(m, t):
    cfg = full_config()
    _check(*index_problem(m, cfg.index_n_heads, cfg.index_head_dim, t, entries=t + 1000, device="cuda", seed=m))


@gpu
@needs_cuda
@pytest.mark.parametrize("cast_rounding,transposed,packed", [(True, True, False), (True, False, False),
                                                              (False, True, False), (False, False, False),
                                                              (True, True, True), (True, False, True)])
@pytest.mark.parametrize("m,t", [(1000, 4096), (130, 70000)])
def test_index_scores_rows_real_shape(m, t, cast_rounding, transposed, packed):
    cfg = full_config()
    q, w, pool, slots, visible = _causal_rows(m, cfg.index_n_heads, cfg.index_head_dim, t, device="cuda", seed=m)
    out = index_scores_rows(q, w, pool, slots, visible, cast_rounding=cast_rounding, transposed=transposed,
                            packed=packed)
    assert_index_scores_close(out, q, w, pool, slots, visible)
    for r in (0, m // 2, m - 8):
        assert torch.equal(out[r:r + 8], index_scores(q[r:r + 8], w[r:r + 8], pool, slots, visible[r:r + 8]))


@gpu
@needs_cuda
@pytest.mark.parametrize("cast_rounding,transposed,packed", [(True, True, False), (True, False, False),
                                                              (False, True, False), (True, True, True),
                                                              (True, False, True)])
@pytest.mark.parametrize("m,t", [(5, 50), (40, 120), (130, 300)])
def test_index_scores_rows_tiny_shapes_gpu(m, t, cast_rounding, transposed, packed):
    """The tiny test model's indexer (4 heads of 64): the rows kernel in every form equals the decode kernel row for
    row (the GPU teacher-forced tests run the tiny model through both)."""
    q, w, pool, slots, visible = _causal_rows(m, 4, 64, t, device="cuda", seed=m + t)
    out = index_scores_rows(q, w, pool, slots, visible, cast_rounding=cast_rounding, transposed=transposed,
                            packed=packed)
    assert_index_scores_close(out, q, w, pool, slots, visible)
    want = torch.cat([index_scores(q[r:r + 1], w[r:r + 1], pool, slots, visible[r:r + 1]) for r in range(m)])
    bad = (out != want).any(1).nonzero().flatten().tolist()
    assert not bad, f"rows {bad[:8]} differ from the decode kernel"


@gpu
@needs_cuda
@pytest.mark.parametrize("queries_per_program", [16, 64])
@pytest.mark.parametrize("m,t", [(1000, 4096), (130, 70000)])
def test_index_scores_rows_real_shape_queries_per_program(m, t, queries_per_program):
    cfg = full_config()
    q, w, pool, slots, visible = _causal_rows(m, cfg.index_n_heads, cfg.index_head_dim, t, device="cuda", seed=m)
    out = index_scores_rows(q, w, pool, slots, visible, queries_per_program=queries_per_program)
    assert_index_scores_close(out, q, w, pool, slots, visible)
    for r in (0, m // 2, m - 8):
        assert torch.equal(out[r:r + 8], index_scores(q[r:r + 8], w[r:r + 8], pool, slots, visible[r:r + 8]))
