"""Routed experts at many pairs per expert (long prefill chunks): the pairs sorted by expert, then two grouped GEMMs
over them, by default on the FP4 weights as they are (engine/kernels/fp4_grouped_gemm.py: each tile dequantised in
registers), else (fused=False) on bf16 copies of the experts made once per call and torch's grouped GEMM
(`torch.nn.functional.grouped_mm`: bf16 tensor-core MMA, fp32 sums).

Why: the CUDA FP4 GEMVs (engine/kernels/moe_fp4.py) convert a weight element once per tile of <= 16 pairs and read
an expert once per tile; at 128 pairs an expert (8,192 tokens, 384 experts, top 6) they run at 65 TFLOP/s. The bf16
copies cost more than the GEMM they feed at prefill sizes (27 GB written and read again per call at the real
shapes); the FP4 grouped GEMM reads a weight as half a byte and converts it once per 128 rows of its expert: on an
H100 the routed experts of a 16,384-token chunk take 28.1 ms against 43.0 ms with the copies (2.7x at 4,096 tokens,
1.16x at 32,768; benchmarks/RESULTS.md, thirteenth session).

Math: moe_up / moe_down's (engine/kernels/moe.py), with the same exact products (A(x), A(h) and the dequantised
weights are exact in bf16):
    g, u = bf16 of fp32 sums                      h = A(bf16(w silu(min(g, L)) clamp(u, -L, L)))
    o    = bf16 of its fp32 sum                   (the grouped GEMMs write bf16; the golden rounds each expert's W2
                                                   output to bf16 before the combine too)
Only the fp32 summation order differs from the golden's.

Steps of routed_grouped (no host synchronisation: every count stays on the device):
  1. the pairs sorted by expert (stable; dropped pairs, id -1, last), each expert's end row, and the first and
     end row of each group of experts (fused: one group of all experts, cut into row blocks by row_blocks);
  2. A(x) once (fp8_act_qdq);
  3. per group of experts (fused: the one group; else as many as staging_bytes holds in bf16: all of a rank's 48
     at N = 8):
     a. (copies only) their W1|W3 and W2 dequantised into bf16 staging [G, 2I, D] and [G, D, I];
     b. the group's rows of A(x) gathered in sorted order;
     c. gu = rows x W13^T  bf16 [rows, 2I]  (fp4_grouped_gemm, or grouped_mm on the copies);
     d. h = the SwiGLU above with each row's routing weight, act-quantised per 32;
     e. og = h x W2^T      bf16 [rows, D];
     f. o[pair] = og[row] in fp32 (moe_down's layout by pair, for the combine).
   Steps b, d and f launch one program per possible row and read the group's row range from the device.
Memory traffic per call: fused, each expert's 3·I·D weights read as FP4 (0.53 B an element) once per 128 of its
rows, mostly from L2; with the copies, also written and read again as bf16 (4 B): 160 MB an expert at the real shapes.
The activations: 2·P·D (gather) + P·(4I + 2I + 2D) + 4·P·D (o), P pairs.
Transient device memory: P·(8D + 6I) bytes of rows (~55 KB a pair at the real shapes: 2.7 GB for a chunk of 8,192
tokens at top 6, 10.8 GB for 32,768), plus with the copies the staging (staging_bytes, rounded down to whole
experts).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from engine.kernels.fp4_grouped_gemm import BLOCK_M, fp4_grouped_gemm, row_blocks
from engine.kernels.fp8_linear import fp8_act_qdq
from engine.kernels.triton_common import (act_quant_blocks, bf16_bits, bf16_to_fp32, cdiv, e2m1_to_fp32, e8m0_to_fp32,
                                          round_bf16, swiglu)

STAGING_BYTES = 4 << 30  # bf16 copies of the experts in flight: 60 experts of the real shapes (70.8 MB each)
GROUPED_MIN_PAIRS = 128  # moe_forward takes this path from this many routed pairs an expert (on average): on an H100
#   1.12x the CUDA GEMVs at 128 (8,192 tokens at top 6 of 384), 0.62x at 64 (benchmarks/RESULTS.md, issue 23), both
#   with the bf16 copies. With the FP4 GEMMs it took 12.5 ms at 64 pairs an expert (thirteenth session), against
#   ~20 ms for the GEMVs in the ninth session's run: not compared in one run yet, so the threshold stays
FUSED_DEQUANT = True  # routed_grouped's default: fp4_grouped_gemm instead of the bf16 copies + grouped_mm
_ROW_BLOCK = 1024  # columns per program of the row kernels (a multiple of 32: whole act_quant blocks)
_grouped_mm = getattr(F, "grouped_mm", None) or torch._grouped_mm  # the private name in torches without the public one


@triton.jit
def _fp4_bf16_kernel(w_ptr, s_ptr, out_ptr, R, KB, BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr):
    """out[r, j] = the bf16 bits of elements 2j (low half) and 2j + 1 (high half) of row r: e2m1(nibble) *
    2^(s[r, j // 16] - 127), exact (<= 2 significant bits times a power of two), so the bits are the fp32's top
    half. w uint8 [R, KB] (KB = K/2 bytes, even element in the low nibble), s uint8 E8M0 [R, KB/16], out int32
    [R, KB]: one 4-byte store per byte read."""
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    ok = (rows < R)[:, None] & (cols < KB)[None, :]
    offs = rows[:, None] * KB + cols[None, :]
    b = tl.load(w_ptr + offs, mask=ok, other=0).to(tl.int32)
    s = e8m0_to_fp32(tl.load(s_ptr + rows[:, None] * (KB // 16) + (cols // 16)[None, :], mask=ok, other=127))
    lo = (e2m1_to_fp32(b & 15) * s).to(tl.int32, bitcast=True)
    hi = (e2m1_to_fp32(b >> 4) * s).to(tl.int32, bitcast=True)
    tl.store(out_ptr + offs, ((lo >> 16) & 0xFFFF) | (hi & -65536), mask=ok)


def dequant_fp4_bf16(w: Tensor, s: Tensor, out: Tensor | None = None) -> Tensor:
    """Packed FP4 uint8 [..., N, K/2] + E8M0 scales [..., N, K/32] -> bf16 [..., N, K] (into out when given),
    engine.quant.dequant_fp4_weight's values exactly, in one launch."""
    kb = w.size(-1)
    k = 2 * kb
    assert w.dtype == torch.uint8 and w.is_contiguous() and s.is_contiguous(), f"w {w.dtype}, contiguous w and s"
    assert k % 32 == 0 and s.shape == (*w.shape[:-1], k // 32), f"w {tuple(w.shape)} needs scales [..., K/32]"
    if out is None:
        out = torch.empty(*w.shape[:-1], k, dtype=torch.bfloat16, device=w.device)
    assert out.dtype == torch.bfloat16 and out.shape == (*w.shape[:-1], k) and out.is_contiguous()
    r = w.numel() // kb if w.numel() else 0
    if r:
        block_r, block_b = (32, 128) if w.is_cuda else (min(64, triton.next_power_of_2(r)),
                                                          min(256, triton.next_power_of_2(kb)))
        _fp4_bf16_kernel[(cdiv(r, block_r), cdiv(kb, block_b))](w, s.view(torch.uint8), out.view(torch.int32), r, kb,
                                                               BLOCK_R=block_r, BLOCK_B=block_b)
    return out


@triton.jit
def _group_rows(bounds_ptr):
    """The group's first sorted row and its number of rows (bounds[0], bounds[1] - bounds[0])."""
    start = tl.load(bounds_ptr)
    return start, tl.load(bounds_ptr + 1) - start


@triton.jit
def _gather_kernel(x_ptr, sorted_ptr, bounds_ptr, out_ptr, D, topk, BLOCK: tl.constexpr):
    """out[i] = x[token of the pair at sorted row start + i] for the group's rows i (int16 bits)."""
    i = tl.program_id(0)
    start, rows = _group_rows(bounds_ptr)
    if i < rows:
        tok = tl.load(sorted_ptr + start + i) // topk
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < D
        v = tl.load(x_ptr + tok.to(tl.int64) * D + offs, mask=ok)
        tl.store(out_ptr + i.to(tl.int64) * D + offs, v, mask=ok)


@triton.jit
def _swiglu_rows_kernel(gu_ptr, w_ptr, sorted_ptr, bounds_ptr, h_ptr, raw_ptr, N, limit, BLOCK: tl.constexpr,
                        WANT_RAW: tl.constexpr):
    """h[i] = A(bf16(w silu(min(g, L)) clamp(u, ±L))) for the group's rows i: gu bf16 [rows, 2N] = [g | u], w the
    routing weight of row i's pair (fp32 [T*k]); A = act_quant QDQ per 32 (BLOCK is whole 32-blocks). WANT_RAW:
    also raw[i] = the h before A (tests)."""
    i = tl.program_id(0)
    start, rows = _group_rows(bounds_ptr)
    if i < rows:
        rw = tl.load(w_ptr + tl.load(sorted_ptr + start + i))
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < N
        g = bf16_to_fp32(tl.load(gu_ptr + i.to(tl.int64) * 2 * N + offs, mask=ok, other=0))
        u = bf16_to_fp32(tl.load(gu_ptr + i.to(tl.int64) * 2 * N + N + offs, mask=ok, other=0))
        h = round_bf16(swiglu(g, u, limit) * rw)
        if WANT_RAW:
            tl.store(raw_ptr + i.to(tl.int64) * N + offs, bf16_bits(h), mask=ok)
        q, s = act_quant_blocks(tl.reshape(h, (1, BLOCK // 32, 32)))
        tl.store(h_ptr + i.to(tl.int64) * N + offs, bf16_bits(tl.reshape(q * s[:, :, None], (BLOCK,))), mask=ok)


@triton.jit
def _scatter_kernel(og_ptr, sorted_ptr, bounds_ptr, o_ptr, D, BLOCK: tl.constexpr, TO_FP32: tl.constexpr):
    """o[pair at sorted row start + i] = og[i] (bf16 bits; widened to fp32 when TO_FP32) for the group's rows i."""
    i = tl.program_id(0)
    start, rows = _group_rows(bounds_ptr)
    if i < rows:
        pair = tl.load(sorted_ptr + start + i)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < D
        v = tl.load(og_ptr + i.to(tl.int64) * D + offs, mask=ok, other=0)
        if TO_FP32:
            v = bf16_to_fp32(v)
        tl.store(o_ptr + pair.to(tl.int64) * D + offs, v, mask=ok)


def sort_pairs(ids: Tensor, num_experts: int) -> tuple[Tensor, Tensor]:
    """ids int32 [T, k] (-1: dropped) -> (sorted_pairs int32 [T*k]: pair ids by expert, stable, dropped pairs last;
    ends int32 [E]: each expert's end row in that order). Device ops only."""
    key = ids.reshape(-1).long()
    key = torch.where(key >= 0, key, num_experts)
    sorted_pairs = torch.sort(key, stable=True).indices.int()
    counts = torch.zeros(num_experts + 1, dtype=torch.int32, device=ids.device)
    counts.scatter_add_(0, key, torch.ones_like(key, dtype=torch.int32))
    return sorted_pairs, counts[:num_experts].cumsum(0).int()


def experts_per_group(experts, staging_bytes: int) -> int:
    """How many experts' bf16 copies (W1|W3 and W2) fit in staging_bytes (at least one)."""
    e, two_i, half_d = experts.w13.shape
    d, inter = 2 * half_d, two_i // 2
    per_expert = 2 * (two_i * d + d * inter)  # bf16 bytes
    return max(1, min(e, staging_bytes // per_expert))


def grouped_applies(x: Tensor, num_pairs: int, num_experts: int) -> bool:
    """Whether moe_forward should take this path: CUDA, not inside a CUDA-graph capture (the staging would stay in
    the graph's pool; decode graphs keep the GEMVs), and at least GROUPED_MIN_PAIRS pairs per expert on average
    (num_experts: the router's, over all ranks)."""
    return (x.is_cuda and num_pairs >= GROUPED_MIN_PAIRS * num_experts
            and not torch.cuda.is_current_stream_capturing())


def routed_grouped(x: Tensor, ids: Tensor, weights: Tensor, experts, limit: float,
                   staging_bytes: int = STAGING_BYTES, want_h: bool = False,
                   fused: bool | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """The routed experts (module docstring): x bf16 [T, D], ids int32 [T, k] (this rank's expert ids, -1 dropped),
    weights fp32 [T, k] -> o fp32 [T*k, D] by pair, bf16-valued (rows of dropped pairs are not written). want_h
    (tests): (o, h bf16 [T*k, I] by pair, the SwiGLU output before its act_quant). fused: steps 3a/c/e as
    fp4_grouped_gemm over all experts at once (no bf16 copies, no staging; staging_bytes is then unused); None:
    FUSED_DEQUANT."""
    t, d = x.shape
    e, two_i, half_d = experts.w13.shape
    inter, k = two_i // 2, ids.size(1)
    assert x.dtype == torch.bfloat16 and x.is_contiguous() and 2 * half_d == d, f"x {x.dtype} {tuple(x.shape)}"
    assert ids.dtype == torch.int32 and ids.shape == (t, k) and weights.shape == (t, k) and weights.is_contiguous()
    assert weights.dtype == torch.float32 and inter % 32 == 0, f"weights {weights.dtype}, I = {inter}"
    pairs = t * k
    o = torch.empty(pairs, d, dtype=torch.float32, device=x.device)
    h_by_pair = torch.empty(pairs, inter, dtype=torch.bfloat16, device=x.device) if want_h else None
    if pairs == 0:
        return (o, h_by_pair) if want_h else o
    fused = FUSED_DEQUANT if fused is None else fused
    sorted_pairs, ends = sort_pairs(ids.contiguous(), e)
    group = e if fused else experts_per_group(experts, staging_bytes)
    firsts = range(0, e, group)
    starts = torch.cat([ends.new_zeros(1), ends[group - 1:e - 1:group]])  # each group's first sorted row
    bounds = torch.stack([starts, torch.cat([starts[1:], ends[-1:]])], 1).contiguous()  # [groups, 2]: start, end
    xq = fp8_act_qdq(x).view(torch.int16)
    if fused:
        block_m = BLOCK_M if x.is_cuda else 16  # (the interpreter: small tiles)
        blocks = row_blocks(ends, pairs, block_m)
    else:
        w13 = torch.empty(min(group, e), two_i, d, dtype=torch.bfloat16, device=x.device)
        w2 = torch.empty(min(group, e), d, inter, dtype=torch.bfloat16, device=x.device)
    rows_x = torch.empty(pairs, d, dtype=torch.bfloat16, device=x.device)
    h = torch.empty(pairs, inter, dtype=torch.bfloat16, device=x.device)
    raw = torch.empty_like(h) if want_h else h  # the kernel writes it only when asked
    flat_w = weights.view(-1)
    for g, first in enumerate(firsts):
        last = min(first + group, e)
        n = last - first
        if not fused:
            dequant_fp4_bf16(experts.w13[first:last], experts.s13[first:last], w13[:n])
            dequant_fp4_bf16(experts.w2[first:last], experts.s2[first:last], w2[:n])
        b = bounds[g]
        offs = (ends[first:last] - b[0]).int()
        _gather_kernel[(pairs, cdiv(d, _ROW_BLOCK))](xq, sorted_pairs, b, rows_x.view(torch.int16), d, k,
                                                     BLOCK=_ROW_BLOCK)
        if fused:
            gu = fp4_grouped_gemm(rows_x, experts.w13, experts.s13, blocks, block_m=block_m)
        else:
            gu = _grouped_mm(rows_x, w13[:n].transpose(1, 2), offs=offs)  # [pairs, 2I], rows past the group unused
        _swiglu_rows_kernel[(pairs, cdiv(inter, _ROW_BLOCK))](gu.view(torch.int16), flat_w, sorted_pairs, b,
                                                              h.view(torch.int16), raw.view(torch.int16), inter,
                                                              float(limit), BLOCK=_ROW_BLOCK, WANT_RAW=want_h)
        if fused:
            og = fp4_grouped_gemm(h, experts.w2, experts.s2, blocks, block_m=block_m)
        else:
            og = _grouped_mm(h, w2[:n].transpose(1, 2), offs=offs)  # [pairs, D]
        _scatter_kernel[(pairs, cdiv(d, _ROW_BLOCK))](og.view(torch.int16), sorted_pairs, b, o, d, BLOCK=_ROW_BLOCK,
                                                      TO_FP32=True)
        if want_h:
            _scatter_kernel[(pairs, cdiv(inter, _ROW_BLOCK))](raw.view(torch.int16), sorted_pairs, b,
                                                              h_by_pair.view(torch.int16), inter, BLOCK=_ROW_BLOCK,
                                                              TO_FP32=False)
    return (o, h_by_pair) if want_h else o
