"""Out-of-bounds memory accesses of the kernels, found with the interpreter bounds checker (bounds_check.py).

The bug these guard (2026-11-30): on an H200, test_cuda_layers_teacher_forced hit "an illegal memory access"
only after other tests had run. sparse_attn_paged's `_global_stats` (pass 2 of `_split_kernel`, and
`_combine_kernel`) loaded every split's (max, Σp) for all BLOCK_H heads of a program, masked only by split:
with H < BLOCK_H (the tiny preset: H = 4, BLOCK_H = 16 or 32) the rows of heads H..BLOCK_H-1 of the last
query lie up to (BLOCK_H - H)·S floats past `stats` (and its Σp half past that), so the read faulted
whenever the caching allocator had put `stats` at the end of a mapped segment. Now masked by head too.
"""

import pytest
import torch
import triton
import triton.language as tl

from engine.kernels.sparse_attention import sparse_attn_paged, sparse_attn_paged_ref
from tests.kernels.bounds_check import BoundsChecker
from tests.kernels.numeric import assert_attn_close, sparse_attn_problem

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@triton.jit
def _copy_kernel(x_ptr, y_ptr, n, EXTRA, BLOCK: tl.constexpr):
    """y[i] = x[i + EXTRA] for i < n (EXTRA > 0 reads past x: the checker's own test)."""
    i = tl.arange(0, BLOCK)
    tl.store(y_ptr + i, tl.load(x_ptr + i + EXTRA, mask=i < n), mask=i < n)


def test_checker_sees_oob_and_ignores_masked_lanes():
    x, y = torch.arange(10, dtype=torch.float32), torch.zeros(10)
    with BoundsChecker() as bc:
        _copy_kernel[(1,)](x, y, 10, 0, BLOCK=16)  # 6 masked lanes past the end: fine
    assert not bc.violations and bc.launches == 1, bc.report()
    assert torch.equal(y, x)
    big = torch.zeros(64)  # x is a view at the start of a larger storage: the tensor's extent counts
    xv = big[:10]
    with BoundsChecker() as bc:
        _copy_kernel[(1,)](xv, y, 10, 3, BLOCK=16)
    assert [(v.kernel, v.op, v.arg, v.count, v.min_off, v.max_off) for v in bc.violations.values()] == [
        ("_copy_kernel", "load", "x_ptr", 3, 10, 12)], bc.report()
    with BoundsChecker(storage_ok=True) as bc:  # relaxed: anywhere in the storage
        _copy_kernel[(1,)](xv, y, 10, 3, BLOCK=16)
    assert not bc.violations, bc.report()
    with BoundsChecker() as bc:  # a store past y
        _copy_kernel[(1,)](x, y[:8], 10, 0, BLOCK=16)
    assert {(v.op, v.arg, v.min_off, v.max_off) for v in bc.violations.values()} == {("store", "y_ptr", 8, 9)}


@pytest.mark.parametrize("m,h,block_h,rows_per_split", [(1, 4, 16, 16), (3, 4, 32, 16), (2, 4, 16, 64)])
def test_sparse_attn_paged_in_bounds_cpu(m, h, block_h, rows_per_split):
    """The tiny preset's decode attention (H = 4 heads of 64 in a head block of 16 or 32, several splits):
    every access inside its tensors, and the output still the golden's."""
    kw, km, d = 19, 23, 64
    args = sparse_attn_problem(m, h, d, kw, km, swa_slots=32, main_slots=48, seed=7 + m)
    scale = d ** -0.5
    with BoundsChecker() as bc:
        o = sparse_attn_paged(*args, scale, block_h=block_h, block_n=16, rows_per_split=rows_per_split)
    assert bc.launches == 3
    assert not bc.violations, bc.report()
    assert_attn_close(o, sparse_attn_paged_ref(*args, scale), args, scale, f"M={m} H={h} BLOCK_H={block_h}")


@gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 3, 8])
def test_sparse_attn_paged_tiny_heads_cuda(m):
    """The tiny preset's H = 4 with the default head blocks on CUDA, against the golden. An out-of-bounds
    read faults on the GPU only by allocation layout: run this under `compute-sanitizer --tool memcheck`
    to check the accesses themselves (the CPU tests above check them exactly)."""
    kw, km, d, h = 19, 23, 64, 4
    args = sparse_attn_problem(m, h, d, kw, km, swa_slots=32, main_slots=48, device="cuda", seed=7 + m)
    scale = d ** -0.5
    o = sparse_attn_paged(*args, scale)
    torch.cuda.synchronize()
    ref = sparse_attn_paged_ref(*[a.cpu() for a in args], scale)
    assert_attn_close(o.cpu(), ref, [a.cpu() for a in args], scale, f"M={m} H={h}")
