"""Sparse MQA decode attention over the packed pools vs the golden sparse_attn on unpacked records.

Tolerance, per output element, against `sparse_attn_paged_ref` (float64 math, bf16 output):

    |o - ref| <= 2 bf16 ULPs of ref + 2^-8 * A,   A[m, h, d] = Σ_r p_r |kv_r[d]| / denom

The kernel rounds p = exp(l - mx) to bf16 with the same final max as the golden (two passes), so the
only differences are fp32 logits (a p within ~1e-6 of a bf16 tie may round the other way: at most
one bf16 ULP, 2^-8 relative, of that p's share of A), fp32 sums (split order) and the final bf16
rounding (the ULPs). Measured on CPU: bitwise equal with one split per list; within 1 ULP with several.
"""

import pytest
import torch

from engine.kernels.sparse_attention import sparse_attn_paged, sparse_attn_paged_ref
from tests.kernels.numeric import assert_attn_close, sparse_attn_problem

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("m,h,d,kw,km", [(1, 2, 64, 7, 13), (3, 4, 128, 5, 37), (3, 2, 64, 33, 19)])
def test_matches_golden_cpu(m, h, d, kw, km):
    args = sparse_attn_problem(m, h, d, kw, km, swa_slots=64, main_slots=96, seed=m * 100 + d + kw)
    scale = d ** -0.5
    o = sparse_attn_paged(*args, scale, block_n=16, rows_per_split=16 * (1 + m % 2))
    ref = sparse_attn_paged_ref(*args, scale)
    assert_attn_close(o, ref, args, scale, f"M={m} H={h} D={d} KW={kw} KM={km}")
    if m > 1:
        assert torch.equal(o[1], torch.zeros_like(o[1])), "an all -1 row must give 0"


def test_launch_shapes_cpu():
    """Head blocks wider than H, splits that end mid-tile, one split for everything."""
    args = sparse_attn_problem(3, 4, 64, 21, 45, swa_slots=64, main_slots=96, seed=5)
    ref = sparse_attn_paged_ref(*args, 0.125)
    for bh, bn, rps in ((32, 16, 48), (16, 32, 64), (64, 16, 16)):
        o = sparse_attn_paged(*args, 0.125, block_h=bh, block_n=bn, rows_per_split=rps)
        assert_attn_close(o, ref, args, 0.125, f"block_h={bh} block_n={bn} rows_per_split={rps}")


def test_empty_main_list_cpu():
    args = sparse_attn_problem(2, 2, 64, 9, 0, swa_slots=32, main_slots=32)
    o = sparse_attn_paged(*args, 0.125, block_n=16, rows_per_split=16)
    assert_attn_close(o, sparse_attn_paged_ref(*args, 0.125), args, 0.125, "KM=0")


@gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 6])
def test_matches_golden_real_shape_gpu(m):
    d = 512
    args = sparse_attn_problem(m, 64, d, 128, 512, swa_slots=4096, main_slots=8192, device="cuda", seed=m)
    o = sparse_attn_paged(*args, d ** -0.5)
    ref = sparse_attn_paged_ref(*args, d ** -0.5)
    assert_attn_close(o, ref, args, d ** -0.5, f"GPU M={m} H=64 D=512 KW=128 KM=512")
    if m > 1:
        assert torch.equal(o[1], torch.zeros_like(o[1]))
