"""Sparse MQA prefill attention over the packed pools vs the golden sparse_attn on unpacked records, and
vs the decode kernel. The prefill kernel needs head_dim % 128 == 0 (word-aligned records), so the CPU
tests run at D = 128 (and once at the real 512); `sparse_attn` sends D = 64 to the decode kernel.

Tolerance: the decode kernel's (tests/kernels/test_sparse_attention.py: assert_attn_close), per element

    |o - ref| <= 2 bf16 ULPs of ref + 2^-8 * A,   A[m, h, d] = Σ_r p_r |kv_r[d]| / denom

against `sparse_attn_paged_ref` (float64 math, bf16 output). Against the decode kernel `sparse_attn_paged`
(CPU interpreter): bitwise equal when both use the same tiles and the main list is one tile, because
the two kernels then do the same fp32 operations in the same order.
"""

import pytest
import torch

import engine.kernels.sparse_prefill as sp
from engine.kernels.sparse_attention import sparse_attn_paged, sparse_attn_paged_ref
from engine.kernels.sparse_prefill import DECODE_MAX_M, sparse_attn, sparse_attn_prefill
from benchmarks.kernel_benches.sparse_prefill import CONFIGS
from tests.kernels.numeric import assert_attn_close, sparse_attn_problem

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

D, KW = 128, 16
SCALE = D ** -0.5


def _args(m, h, km, kw=KW, seed=0, device="cpu"):
    return sparse_attn_problem(m, h, D, kw, km, swa_slots=64, main_slots=96, device=device, seed=seed)


# Every H and list length at M = 1 and 5 (5 rows hold each kind of sparse_attn_problem's rows: late window, all -1,
# duplicates, padding); M = 33 once per test: each program is one (row, head block), so more rows repeat the same
# program over more random rows, and one case of many rows keeps that covered.
SHAPES = [(m, h, km) for m in (1, 5) for h in (4, 16) for km in (8, 40)]


@pytest.mark.parametrize("m,h,km", SHAPES + [(33, 4, 8)])
def test_matches_golden_cpu(m, h, km):
    args = _args(m, h, km, seed=100 * m + 10 * h + km)
    o = sparse_attn_prefill(*args, SCALE, block_n=16)
    assert_attn_close(o, sparse_attn_paged_ref(*args, SCALE), args, SCALE, f"M={m} H={h} KW={KW} KM={km}")
    if m > 1:
        assert torch.equal(o[1], torch.zeros_like(o[1])), "an all -1 row must give 0"


@pytest.mark.parametrize("m,h,km", SHAPES + [(33, 16, 8)])
def test_bitwise_equals_decode_cpu(m, h, km):
    """Same tiles (block_n covers the main list, one split per list in the decode kernel)."""
    args = _args(m, h, km, seed=7 * m + h + km)
    bn = 16 if km <= 16 else 64
    dec = sparse_attn_paged(*args, SCALE, block_h=16, block_n=bn, rows_per_split=64)
    for prefetch in (True, False):
        o = sparse_attn_prefill(*args, SCALE, block_h=16, block_n=bn, prefetch=prefetch)
        assert o.abs().amax() > 0, "a vacuous comparison: all outputs 0"
        diff = (o.float() - dec.float()).abs()
        assert torch.equal(o.view(torch.int16), dec.view(torch.int16)), (
            f"M={m} H={h} KM={km} prefetch={prefetch}: {int((diff > 0).sum())} elements differ from "
            f"sparse_attn_paged, max {diff.max():.3g}")


def test_real_head_dim_cpu():
    """D = 512 (the record layout's real word counts), one main tile: bitwise vs decode, and vs golden."""
    d = 512
    args = sparse_attn_problem(3, 4, d, 16, 24, swa_slots=32, main_slots=48, seed=11)
    o = sparse_attn_prefill(*args, d ** -0.5, block_n=32)
    assert_attn_close(o, sparse_attn_paged_ref(*args, d ** -0.5), args, d ** -0.5, "D=512")
    dec = sparse_attn_paged(*args, d ** -0.5, block_h=16, block_n=32, rows_per_split=32)
    assert torch.equal(o.view(torch.int16), dec.view(torch.int16))


def test_launch_shapes_cpu():
    """Odd list lengths (tiles that end mid-tile), head blocks wider than H, several main tiles."""
    args = _args(3, 16, 45, kw=21, seed=5)
    ref = sparse_attn_paged_ref(*args, 0.125)
    for bh, bn, prefetch in ((16, 16, True), (32, 16, False), (16, 32, True), (64, 64, False)):
        o = sparse_attn_prefill(*args, 0.125, block_h=bh, block_n=bn, prefetch=prefetch)
        assert_attn_close(o, ref, args, 0.125, f"block_h={bh} block_n={bn} prefetch={prefetch}")
        assert torch.equal(o[1], torch.zeros_like(o[1]))


@pytest.mark.parametrize("kw,km", [(9, 0), (0, 13), (0, 0)])
def test_empty_lists_cpu(kw, km):
    args = _args(2, 4, km, kw=kw, seed=kw + km)  # M = 2: sparse_attn_problem's duplicate rows need both lists
    o = sparse_attn_prefill(*args, SCALE, block_n=16)
    ref = sparse_attn_paged_ref(*args, SCALE)
    if kw + km == 0:  # no rows: the golden gives 0 (the checker needs a row to take a max over)
        assert torch.equal(ref, torch.zeros_like(ref)) and torch.equal(o, ref)
    else:
        assert_attn_close(o, ref, args, SCALE, f"KW={kw} KM={km}")


def test_no_queries_cpu():
    q, swa_pool, swa_idx, main_pool, main_idx, sink = _args(2, 4, 8)
    o = sparse_attn_prefill(q[:0], swa_pool, swa_idx[:0], main_pool, main_idx[:0], sink, SCALE)
    assert o.shape == (0, 4, D) and o.dtype == torch.bfloat16


def test_contract_cpu():
    q, swa_pool, swa_idx, main_pool, main_idx, sink = _args(2, 4, 8)
    with pytest.raises(AssertionError, match="q must be contiguous bf16"):
        sparse_attn_prefill(q.float(), swa_pool, swa_idx, main_pool, main_idx, sink, SCALE)
    with pytest.raises(AssertionError, match="main_idx"):
        sparse_attn_prefill(q, swa_pool, swa_idx, main_pool, main_idx.long(), sink, SCALE)
    with pytest.raises(AssertionError, match="main_pool records"):
        sparse_attn_prefill(q, swa_pool, swa_idx, swa_pool, main_idx, sink, SCALE)
    with pytest.raises(AssertionError, match="M=2"):
        sparse_attn_prefill(q, swa_pool, swa_idx[:1], main_pool, main_idx, sink, SCALE)


def test_dispatch_cpu(monkeypatch):
    """sparse_attn: the decode kernel up to DECODE_MAX_M queries or at D = 64, the prefill kernel above."""
    calls = []
    monkeypatch.setattr(sp, "sparse_attn_paged", lambda *a: calls.append("decode") or sparse_attn_paged(*a))
    monkeypatch.setattr(sp, "sparse_attn_prefill", lambda *a: calls.append("prefill") or sparse_attn_prefill(*a))
    for m, d in ((1, D), (DECODE_MAX_M, D), (DECODE_MAX_M + 1, D), (DECODE_MAX_M + 1, 64)):
        args = sparse_attn_problem(m, 4, d, KW, 8, swa_slots=64, main_slots=96, seed=m)
        o = sparse_attn(*args, d ** -0.5)
        assert_attn_close(o, sparse_attn_paged_ref(*args, d ** -0.5), args, d ** -0.5, f"sparse_attn M={m} D={d}")
    assert calls == ["decode", "decode", "prefill", "decode"]


def test_head_dim_contract_cpu():
    args = sparse_attn_problem(2, 4, 64, KW, 8, swa_slots=64, main_slots=96)
    with pytest.raises(AssertionError, match="multiple of 4"):
        sparse_attn_prefill(*args, 0.125)


@gpu
@needs_cuda
@pytest.mark.parametrize("m", [64, 1024, 4096])
def test_matches_golden_real_shape_gpu(m):
    d = 512
    args = sparse_attn_problem(m, 64, d, 128, 512, swa_slots=4096, main_slots=8192, device="cuda", seed=m)
    o = sparse_attn_prefill(*args, d ** -0.5)
    ref = sparse_attn_paged_ref(*args, d ** -0.5)
    assert_attn_close(o, ref, args, d ** -0.5, f"GPU M={m} H=64 D=512 KW=128 KM=512")
    assert torch.equal(o[1], torch.zeros_like(o[1])), "an all -1 row must give 0"
    assert torch.equal(sparse_attn(*args, d ** -0.5), o), "sparse_attn must run the prefill kernel at this M"


@gpu
@needs_cuda
@pytest.mark.parametrize("config", CONFIGS[1:], ids=str)
def test_launch_configs_real_shape_gpu(config):
    """Every launch shape the benchmark sweeps gives an answer within the tolerance."""
    block_h, block_n, warps, stages, prefetch = config
    d = 512
    args = sparse_attn_problem(64, 64, d, 128, 512, swa_slots=4096, main_slots=8192, device="cuda", seed=3)
    o = sparse_attn_prefill(*args, d ** -0.5, block_h=block_h, block_n=block_n, num_warps=warps, num_stages=stages,
                            prefetch=prefetch)
    ref = sparse_attn_paged_ref(*args, d ** -0.5)
    assert_attn_close(o, ref, args, d ** -0.5, f"GPU config {config}")
