"""The grouped GEMM on FP4 weights (engine.kernels.fp4_grouped_gemm) against per-expert products of the golden
dequantisation (engine.quant.dequant_fp4_weight), in float64.

Tolerance: out is bf16 of an fp32 sum of exact products (bf16 A times weights exact in bf16), so per element
|out - ref| <= 1 ULP of ref + eps * S with S = sum |A| |W| (the fp32 summation error: eps 2^-20 on the CPU, K <= 128
terms; 2^-16 on the GPU, K up to 5,120), and at least 95% of elements bitwise bf16(ref).
"""

from __future__ import annotations

import pytest
import torch

from engine.kernels.fp4_grouped_gemm import fp4_grouped_gemm, row_blocks
from engine.quant import dequant_fp4_weight
from tests.kernels.numeric import bf16_ulp

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def problem(counts: list[int], n: int, k: int, extra_rows: int = 0, device: str = "cpu", seed: int = 0):
    """Experts with these row counts (sorted), random FP4 codes and scales; extra_rows rows past the last expert."""
    g = torch.Generator().manual_seed(seed)
    e = len(counts)
    w = torch.randint(0, 256, (e, n, k // 2), generator=g, dtype=torch.uint8)
    s = torch.randint(112, 132, (e, n, k // 32), generator=g, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    a = torch.randn(sum(counts) + extra_rows, k, generator=g).bfloat16()
    ends = torch.tensor(counts, dtype=torch.int64).cumsum(0).int()
    return a.to(device), w.to(device), s.to(device), ends.to(device)


def assert_grouped_gemm_close(out, a, w, s, ends, eps: float) -> None:
    a, w, s, ends = a.cpu(), w.cpu(), s.cpu(), ends.cpu().tolist()
    first = 0
    for e, end in enumerate(ends):
        wd = dequant_fp4_weight(w[e], s[e]).double()
        ref = a[first:end].double() @ wd.T
        bound = a[first:end].double().abs() @ wd.abs().T
        got = out[first:end].cpu().double()
        err = (got - ref).abs()
        allowed = bf16_ulp(ref) + eps * bound
        assert bool((err <= allowed).all()), f"expert {e}: worst excess {(err - allowed).max().item():.3g}"
        if end > first:
            same = (got == ref.float().bfloat16().double()).double().mean().item()
            assert same >= 0.95, f"expert {e}: only {same:.1%} bitwise bf16 of the reference"
        first = end


def test_row_blocks_cut_each_expert_into_blocks():
    ends = torch.tensor([7, 7, 47, 48, 67], dtype=torch.int32)  # expert 1 has no rows
    blocks = row_blocks(ends, 70, 16).tolist()
    assert len(blocks) == 70 // 16 + 5
    real = [b for b in blocks if b[0] >= 0]
    assert real == [[0, 0, 7], [2, 7, 23], [2, 23, 39], [2, 39, 47], [3, 47, 48], [4, 48, 64], [4, 64, 67]]
    assert all(b[0] == -1 for b in blocks[len(real):]), "the unused blocks come last"


@pytest.mark.parametrize("counts,n,k,block_m,block_n,block_k", [
    ([7, 0, 40, 1, 19], 96, 128, 16, 32, 64),   # an expert with no rows; N not a multiple of block_n
    ([33], 32, 96, 16, 32, 64),                 # K a multiple of 32, not of block_k: the tile shrinks
    ([5, 12], 48, 64, 32, 16, 32),
])
def test_grouped_gemm_matches_the_golden_dequant(counts, n, k, block_m, block_n, block_k):
    a, w, s, ends = problem(counts, n, k, extra_rows=3, seed=n + k)
    out = torch.full((a.size(0), n), 7.0, dtype=torch.bfloat16)
    fp4_grouped_gemm(a, w, s, row_blocks(ends, a.size(0), block_m), out, block_m=block_m, block_n=block_n,
                     block_k=block_k, num_warps=4)
    assert_grouped_gemm_close(out, a, w, s, ends, 2.0 ** -20)
    assert bool((out[sum(counts):] == 7).all()), "rows past the last expert were written"


def test_grouped_gemm_rejects_mismatched_blocks():
    a, w, s, ends = problem([30, 34], 32, 64)
    with pytest.raises(AssertionError, match="row_blocks"):
        fp4_grouped_gemm(a, w, s, row_blocks(ends, a.size(0), 16), block_m=32)


@gpu
@needs_cuda
@pytest.mark.parametrize("n,k", [(4608, 5120), (5120, 2304)])  # the released experts' W1|W3 and W2
def test_grouped_gemm_real_shapes_gpu(n, k):
    counts = [0, 300, 1, 129, 640, 77, 256, 3]
    a, w, s, ends = problem(counts, n, k, extra_rows=5, device="cuda", seed=k)
    out = fp4_grouped_gemm(a, w, s, row_blocks(ends, a.size(0), 128))
    assert_grouped_gemm_close(out, a, w, s, ends, 2.0 ** -16)
    assert torch.equal(out[:sum(counts)], fp4_grouped_gemm(a, w, s, row_blocks(ends, a.size(0), 128))[:sum(counts)])
