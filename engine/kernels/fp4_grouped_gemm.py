"""A grouped GEMM whose weights stay FP4 in memory: out[r] = A[r] @ W[e(r)]^T for rows sorted by expert, each
program upcasting its [BLOCK_N, BLOCK_K] tile of MXFP4 codes to bf16 in registers before the tensor-core MMA.

Why: the routed experts at prefill-chunk sizes (engine/kernels/moe_grouped.py) used to write every expert's bf16
copy first (the real layer's 384 experts: 27 GB written and read again per chunk, 20.9 ms a layer on an H200 against
12.8 ms of GEMM; benchmarks/RESULTS.md, twelfth session). Here a weight element is read as half a byte and converted
once per BLOCK_M rows of its expert. On an H100 (thirteenth session): W1|W3 of a 16,384-token chunk in 16.5 ms
(280 TFLOP/s) against 24.6 ms for the copies + torch's grouped GEMM; 2.96x at 4,096 tokens, 1.03x at 32,768.

The upcast: tl.dot_scaled (DOT_SCALED, the default on CUDA: Triton's own E2M1 x E8M0 -> bf16 conversion feeding the
MMA; 17.6 ms at the shape above) or this module's _dequant_tile (30.9 ms at its best launch shape; the CPU
interpreter's path, which has no dot_scaled).

Math: the same products as torch's grouped GEMM on dequant_fp4_bf16's copies (a weight is e2m1(code) * 2^(s - 127),
exact in bf16; A is bf16), summed in fp32 by the MMA, rounded once to bf16. Only the fp32 summation order differs.

Shapes: a bf16 [P, K] (rows sorted by expert: expert e's rows are ends[e-1] .. ends[e]-1), w uint8 [E, N, K/2] (the
even element in the low nibble), s E8M0 [E, N, K/32] -> out bf16 [P, N] (rows past ends[-1] are not written).
Scheduling: `row_blocks` cuts each expert's rows into blocks of BLOCK_M on the device (no host synchronisation);
the grid is an upper bound on the blocks (P / BLOCK_M + E) times the column tiles, and a program past the real
blocks runs no K step and stores nothing. Programs run column tile fastest: the programs in flight share a few row
blocks of A (read once from memory) and an expert's weight tiles are reused by its next row block from L2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from engine.kernels.triton_common import bf16_bits, bf16_to_fp32, cdiv, e2m1_to_fp32, e8m0_to_fp32

BLOCK_M, BLOCK_N, BLOCK_K, WARPS, STAGES = 128, 128, 64, 4, 3  # the launch defaults (benchmarks/kernels.py
# --only fp4_grouped sweeps them)
DOT_SCALED = True  # tl.dot_scaled's upcast (module docstring)


def row_blocks(ends: Tensor, num_rows: int, block_m: int) -> Tensor:
    """int32 [num_rows // block_m + E, 3]: per row block (expert, first row, end row) of the rows sorted by expert
    (ends int32 [E]: each expert's end row), every expert's rows cut into blocks of block_m; blocks past the real
    ones have expert -1. Device ops only: the bound on the block count is known on the host."""
    e = ends.numel()
    ends = ends.long()
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    per_expert = (ends - starts + block_m - 1) // block_m
    block_ends = per_expert.cumsum(0)
    index = torch.arange(num_rows // block_m + e, device=ends.device)
    expert = torch.searchsorted(block_ends, index, right=True)
    valid = expert < e
    which = expert.clamp(max=e - 1)
    first = starts[which] + (index - (block_ends[which] - per_expert[which])) * block_m
    end = torch.minimum(first + block_m, ends[which])
    return torch.stack([torch.where(valid, expert, -1), first, end], 1).int()


@triton.jit
def _dequant_tile(codes, scales, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """uint8 [BLOCK_N, BLOCK_K / 2] FP4 pairs + uint8 E8M0 [BLOCK_N, BLOCK_K / 32] -> fp32 [BLOCK_N, BLOCK_K]:
    dequant_fp4_bf16's values (e2m1 * 2^(s - 127), exact in bf16)."""
    b = codes.to(tl.int32)
    lo = e2m1_to_fp32(b & 15)
    hi = e2m1_to_fp32(b >> 4)
    v = tl.reshape(tl.join(lo, hi), (BLOCK_N, BLOCK_K // 32, 32))  # element 2j from the low nibble of byte j
    v = v * e8m0_to_fp32(scales)[:, :, None]  # <= 2 significant bits: a cast to bf16 is exact
    return tl.reshape(v, (BLOCK_N, BLOCK_K))


@triton.jit
def _fp4_grouped_kernel(a_ptr, w_ptr, s_ptr, out_ptr, blocks_ptr, N, K, n_tiles,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr,
                        DOT_SCALED: tl.constexpr):
    """a bf16 (int16 bits with DOT_F32), out as int16 bits. DOT_F32 (the CPU interpreter, whose bf16 dot and casts
    are wrong): fp32 operands holding the bf16 values and an integer round to nearest even at the end; else bf16
    operands on the tensor cores and the hardware's round-to-nearest-even cast (the same values). DOT_SCALED (GPU
    only): the packed tile handed to tl.dot_scaled, Triton's own E2M1 upcast to bf16 on sm_90 (the same exact
    values)."""
    pid = tl.program_id(0)
    blk, nt = pid // n_tiles, pid % n_tiles
    e = tl.load(blocks_ptr + blk * 3)
    real = e >= 0  # a block past the real ones: no K steps, no store (not an `if`: it would stop pipelining)
    e = tl.maximum(e, 0)
    first = tl.load(blocks_ptr + blk * 3 + 1)
    end = tl.load(blocks_ptr + blk * 3 + 2)
    rows = (first + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_ok = (rows < end) & real
    cols = nt * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    w_rows = e.to(tl.int64) * N + cols  # the expert's weight rows (output columns)
    kb = tl.arange(0, BLOCK_K // 2)
    ks = tl.arange(0, BLOCK_K // 32)
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, tl.where(real, K, 0), BLOCK_K):
        a = tl.load(a_ptr + rows[:, None] * K + (k0 + kk)[None, :], mask=row_ok[:, None], other=0.0)
        codes = tl.load(w_ptr + w_rows[:, None] * (K // 2) + (k0 // 2 + kb)[None, :], mask=col_ok[:, None],
                        other=0)
        scales = tl.load(s_ptr + w_rows[:, None] * (K // 32) + (k0 // 32 + ks)[None, :], mask=col_ok[:, None],
                         other=127)
        if DOT_SCALED:
            acc = tl.dot_scaled(a, None, "bf16", tl.trans(codes), scales, "e2m1",
                                acc)
        elif DOT_F32:
            wt = _dequant_tile(codes, scales, BLOCK_N, BLOCK_K)
            acc = tl.dot(bf16_to_fp32(a), tl.trans(wt), acc, input_precision="ieee")
        else:
            wt = _dequant_tile(codes, scales, BLOCK_N, BLOCK_K)
            acc = tl.dot(a, tl.trans(wt.to(tl.bfloat16)), acc)
    if DOT_F32:
        bits = bf16_bits(acc)
    else:
        bits = acc.to(tl.bfloat16).to(tl.int16, bitcast=True)
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], bits, mask=row_ok[:, None] & col_ok[None, :])


def fp4_grouped_gemm(a: Tensor, w: Tensor, s: Tensor, blocks: Tensor, out: Tensor | None = None,
                     block_m: int = BLOCK_M, block_n: int = BLOCK_N, block_k: int = BLOCK_K, num_warps: int = WARPS,
                     num_stages: int = STAGES, dot_scaled: bool = DOT_SCALED) -> Tensor:
    """out bf16 [P, N]: row r of a times W[e]^T for the expert e whose block holds r (module docstring); blocks from
    row_blocks(ends, P, block_m) with the same block_m. Rows in no block are left as they were. dot_scaled (CUDA
    only): tl.dot_scaled on the packed tile instead of this module's dequantisation."""
    p, k = a.shape
    e, n, half_k = w.shape
    assert a.dtype == torch.bfloat16 and a.is_contiguous() and 2 * half_k == k, f"a {a.dtype} {tuple(a.shape)}"
    assert w.dtype == torch.uint8 and w.is_contiguous() and s.is_contiguous() and s.shape == (e, n, k // 32), \
        f"w {w.dtype} {tuple(w.shape)}, scales {tuple(s.shape)}"
    while k % block_k and block_k > 32:  # K a multiple of 32 (the scale blocks), not of the default tile
        block_k //= 2
    assert k % block_k == 0 and block_k % 32 == 0, f"K {k} is not a multiple of block_k {block_k}"
    assert blocks.dtype == torch.int32 and blocks.shape == (p // block_m + e, 3), \
        f"blocks {tuple(blocks.shape)}: row_blocks(ends, {p}, {block_m})"
    if out is None:
        out = torch.empty(p, n, dtype=torch.bfloat16, device=a.device)
    assert out.dtype == torch.bfloat16 and out.shape == (p, n) and out.is_contiguous()
    if p:
        n_tiles = cdiv(n, block_n)
        a_arg = a if a.is_cuda else a.view(torch.int16)
        _fp4_grouped_kernel[(blocks.size(0) * n_tiles,)](a_arg, w, s.view(torch.uint8),
                                                         out.view(torch.int16), blocks, n, k, n_tiles,
                                                         BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                                                         DOT_F32=not a.is_cuda, DOT_SCALED=dot_scaled and a.is_cuda,
                                                         num_warps=num_warps,
                                                         num_stages=num_stages)
    return out
