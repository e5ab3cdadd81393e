"""FP8 block-scaled linear with fused activation quantisation (DeepSeek's `fp8_gemm` semantics).

    y[m, n] = bf16( Σ_kb Σ_{k in kb} (qa[m, k] · sa[m, kb]) · (qw[n, k] · sw[n // 32, kb]) )

- (qa, sa) = act_quant(x): FP8 E4M3 per 32 along K with a UE8M0 (power-of-two) scale, bit for bit
  `engine.quant.act_quant`. For decode M it is computed inside the GEMM (no extra launch); for prefill
  M one `fp8_act_qdq` launch quantises x first, so the weight tiles do not each re-quantise it.
- qw: FP8 E4M3 weight [N, K], one E8M0 scale per 32x32 block ([ceil(N/32), K/32]).
- Products: both operands are dequantised in registers. qa·sa and qw·sw are exact in bf16 (<= 4
  significant bits times a power of two), so a bf16 tensor-core MMA with fp32 accumulation sums the
  exact products of the reference's block sums; only the fp32 summation order differs from the
  reference kernel (which scales each 32-block's FP8-MMA partial and accumulates in K order). FP8
  MMAs were the first design: Hopper's FP8 MMA accumulates with ~14 bits, and even with a promotion
  per 32-block it measured errors up to ~5e-4 · Σ|a||w| at M = 1 (hundreds of bf16 ULPs on small
  outputs) and was no faster; the bf16 path is ~fp32-accurate and the weight still streams as FP8.

Prefill on CUDA (M >= DEQUANT_MIN_M): `dequant_linear` instead, x QDQ'd once and the weight dequantised once to
bf16 (both exact), then one cuBLAS bf16 GEMM with fp32 sums (its bf16 split-K reduction switched off): the same
exact products, another fp32 order, a transient bf16 copy of the weight. The Triton kernel ran at
0.24-0.57x cuBLAS bf16 at M = 512..4096 on an H100; this path 0.46-1.01x, 1.2-2.4x the Triton kernel (RESULTS.md).

fp32 output (out_dtype=torch.float32): y is the fp32 sum itself, before the bf16 rounding, bit for bit the
bf16 form's pre-rounding value (same launch shape, same order): a row-parallel product's partial, summed over
the model's shards and rounded once (engine/core/kernel_ops.py `row_parallel`).

Memory traffic (the floor): N·K weight bytes + N·K/1024 scale bytes + 2·M·K (x) + 2·M·N (y; 4·M·N in fp32), plus
8·splits·M·N bytes of fp32 partials when K is split. At decode M the weight is everything, so the
kernel is a weight stream: swap-AB tiles put BLOCK_N weight rows on the MMA's M side and the tokens
(padded to BLOCK_M >= 16) on its N side, and a small matrix is split along K so that a few waves of
programs keep HBM busy. The last program of an output tile to finish (an atomic ticket) sums the
fp32 partials in split order (deterministic) and writes bf16, then resets its ticket: one launch,
no memset.

Interpreter notes (TRITON_INTERPRET=1): its fp32 -> fp8 cast misrounds when the carry reaches the
exponent, its fp32 -> bf16 cast truncates and its bf16 dot is broken, so the E4M3 rounding is done in
exact integer/fp32 steps (the same bits on the GPU), bf16 outputs are rounded with integer
round-to-nearest-even, and the interpreter's dot takes fp32 operands (same exact products).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from engine.config import ModelConfig
from engine.kernels.fp8_gemv import fp8_gemv, gemv_applies
from engine.kernels.triton_common import act_quant_blocks, bf16_bits, cdiv, e4m3_code, e8m0_to_fp32, launch_sms
from engine.model.layers import Linear
from engine.quant import BLOCK, act_quant, cat_8bit, check_fp8_linear_args

MAX_TICKETS = 1 << 16
DEQUANT_MIN_M = 512  # from this many rows on CUDA: the weight dequantised once, then cuBLAS (dequant_linear); at
# 512 it beat the Triton kernel on every layer matrix on an H100 (1.2-1.8x), at 128 it lost on the large ones (wq_b,
# wo_b, shared W1|W3, Engram wkv: 0.46-0.76x; benchmarks/kernel_benches/fp8_prefill.py, RESULTS.md)
_TICKETS: dict[tuple[torch.device, int], Tensor] = {}  # (device, stream) -> its tickets


@triton.jit
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, R, K, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, QDQ: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    ok = (rows < R)[:, None]
    offs = rows[:, None] * K + cols[None, :]
    x = tl.load(x_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    q, s = act_quant_blocks(tl.reshape(x, (BLOCK_R, BLOCK_K // 32, 32)))
    if QDQ:  # bf16 q * s (exact), the prefill GEMM's input
        tl.store(q_ptr + offs, bf16_bits(tl.reshape(q * s[:, :, None], (BLOCK_R, BLOCK_K))), mask=ok)
    else:
        tl.store(q_ptr + offs, tl.reshape(e4m3_code(q), (BLOCK_R, BLOCK_K)), mask=ok)
        s_cols = tl.program_id(1) * (BLOCK_K // 32) + tl.arange(0, BLOCK_K // 32)
        tl.store(s_ptr + rows[:, None] * (K // 32) + s_cols[None, :], s, mask=ok)


@triton.jit
def _fp8_linear_kernel(
    x_ptr, w_ptr, ws_ptr, y_ptr, part_ptr, ticket_ptr,
    M, N, K, k_per_split, num_splits,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    QUANT_X: tl.constexpr, DOT_F32: tl.constexpr, OUT_F32: tl.constexpr,
):
    # program id -> (n tile, split, m tile), m fastest: the splits of one tile run side by side
    pid = tl.program_id(0)
    num_m_tiles = tl.cdiv(M, BLOCK_M)
    pid_m = pid % num_m_tiles
    pid_k = (pid // num_m_tiles) % num_splits
    pid_n = pid // (num_m_tiles * num_splits)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    # clamped rows: loads need no mask (rows past the end repeat the last one and are not stored)
    rows_n = tl.minimum(offs_n, N - 1)
    rows_m = tl.minimum(offs_m, M - 1)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)  # both multiples of BLOCK_K (host contract)

    w_ptrs = w_ptr + rows_n[:, None] * K + offs_k[None, :]  # [BN, BK] fp8
    x_ptrs = x_ptr + rows_m[:, None] * K + offs_k[None, :]  # [BM, BK] bf16: x (QUANT_X) or its QDQ
    ws_ptrs = ws_ptr + (rows_n // 32)[:, None] * (K // 32) + tl.arange(0, BLOCK_K // 32)[None, :]  # [BN, G]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k in range(k_lo, k_hi, BLOCK_K):
        # dequantise in registers: qw * sw and q * sa are exact in bf16 (<= 4 significant bits, power-of-two
        # scales), so one 16-bit MMA with fp32 accumulation sums the exact block products
        sw = e8m0_to_fp32(tl.load(ws_ptrs + k // 32))  # [BN, G]
        w = tl.reshape(tl.load(w_ptrs + k).to(tl.float32), (BLOCK_N, BLOCK_K // 32, 32)) * sw[:, :, None]
        w = tl.reshape(w, (BLOCK_N, BLOCK_K))
        if QUANT_X:
            q, sa = act_quant_blocks(tl.reshape(tl.load(x_ptrs + k).to(tl.float32), (BLOCK_M, BLOCK_K // 32, 32)))
            xq = tl.reshape(q * sa[:, :, None], (BLOCK_M, BLOCK_K))
        else:
            xq = tl.load(x_ptrs + k)
        if DOT_F32:  # the interpreter: no bf16 arithmetic there
            acc = tl.dot(w, tl.trans(xq.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(w.to(tl.bfloat16), tl.trans(xq.to(tl.bfloat16)), acc)

    mask = (offs_n < N)[:, None] & (offs_m < M)[None, :]
    out = offs_m[None, :] * N + offs_n[:, None]  # [BN, BM] into row-major [M, N]
    if num_splits == 1:
        tl.store(y_ptr + out, acc if OUT_F32 else bf16_bits(acc), mask=mask)
    else:
        tl.store(part_ptr + pid_k * M * N + out, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial is issued before the ticket releases it
        ticket = tl.atomic_add(ticket_ptr + pid_n * num_m_tiles + pid_m, 1, sem="acq_rel")
        if ticket == num_splits - 1:  # the last split of this tile to finish: reduce in split order
            tl.debug_barrier()
            total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for s in range(num_splits):
                total += tl.load(part_ptr + s * M * N + out, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(y_ptr + out, total if OUT_F32 else bf16_bits(total), mask=mask)
            tl.atomic_xchg(ticket_ptr + pid_n * num_m_tiles + pid_m, 0)


@triton.jit
def _weight_bf16_kernel(w_ptr, s_ptr, out_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[n, k] = bf16(qw[n, k] * sw[n // 32, k // 32]): exact (<= 4 significant bits times a power of two)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    ok = (rows < N)[:, None] & (cols < K)[None, :]
    offs = rows.to(tl.int64)[:, None] * K + cols[None, :]
    w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    sw = e8m0_to_fp32(tl.load(s_ptr + (rows // 32)[:, None] * (K // 32) + (cols // 32)[None, :], mask=ok, other=127))
    tl.store(out_ptr + offs, bf16_bits(w * sw), mask=ok)


@dataclass(frozen=True, slots=True)
class Fp8LinearConfig:
    """Launch shape. block_k is halved until it divides K; split_k is a request (K per split is rounded
    to block_k). fuse_quant: quantise x inside the GEMM (else one fp8_act_qdq launch first)."""

    block_n: int
    block_m: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int
    fuse_quant: bool


def pick_config(m: int, n: int, k: int, num_sms: int = 132) -> Fp8LinearConfig:
    """Launch shape by M (tuned with `benchmarks/kernels.py --sweep` on an H200, 2026-11-30).

    - m <= 16: x quantised inside the GEMM; 128-row weight tiles on 8 warps; K split until ~2 waves
      of programs stream the weight (fp32 partials capped at a quarter of the weight bytes).
    - 16 < m <= 64: x quantised once by fp8_act_qdq (re-quantising 64 rows per weight tile made the
      fused form 2x slower); 64-row tiles; partials capped at the weight bytes.
    - m > 64 (prefill): x quantised once, 128x128 tiles; K split (>= 1024 per split) while the tiles fill
      less than a wave (at M = 512 wq_a has 40 tiles and wkv 16 on 132 SMs).
    """
    if m > 64:
        tiles = cdiv(n, 128) * cdiv(m, 128)
        split = max(1, min(num_sms // tiles, k // 1024))
        return Fp8LinearConfig(128, 128, 64, split, num_warps=8, num_stages=3, fuse_quant=False)
    fused = m <= 16
    block_n, block_m = (128, 16) if fused else (64, 32 if m <= 32 else 64)
    tiles = cdiv(n, block_n) * cdiv(m, block_m)
    split = max(1, min(2 * num_sms // tiles, k // ((32 if fused else 8) * m)))
    return Fp8LinearConfig(block_n, block_m, 128, split, num_warps=8 if fused else 4, num_stages=3,
                           fuse_quant=fused)


def interpreter_config(m: int, n: int, k: int) -> Fp8LinearConfig:
    """Launch shape off the GPU (TRITON_INTERPRET=1): the fewest programs and loop steps. The interpreter's cost is
    per op and program (each op ~0.1 ms of Python; numpy does a tile's elements at once), so one program covers up
    to 256 output rows x 64 tokens with x quantised inside it, and K in steps of up to 512; no split."""
    return Fp8LinearConfig(min(256, max(16, triton.next_power_of_2(n))), min(64, max(16, triton.next_power_of_2(m))),
                           512, 1, num_warps=4, num_stages=1, fuse_quant=True)


def split_k_tickets(device: torch.device) -> Tensor:
    """The split-K tickets of `device`'s current stream, zero between launches (the last program of a tile
    resets its own). One buffer per stream: kernels running concurrently on two streams (the decode step's
    side-stream shared expert beside the main stream's GEMMs) never share a ticket.

    A stream's buffer is made (zeroed) on its first eager use: made inside a CUDA-graph capture, its zeroing would be
    a node of that one graph, so every other graph using the stream's tickets would start from uninitialised memory
    until that graph first replayed (a tile whose ticket is not 0 never reduces: its output is never written). Warm
    up on the stream you capture on (DecodeStep.capture does)."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device, stream)
    if key not in _TICKETS:
        assert not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()), (
            f"split-K tickets of stream {stream:#x} made during a CUDA-graph capture: warm up on the capture stream")
        _TICKETS[key] = torch.zeros(MAX_TICKETS, dtype=torch.int32, device=device)
    return _TICKETS[key]


def _block_k(k: int, want: int = 128) -> int:
    while k % want:
        want //= 2
    return want


def _act_quant_launch(x2: Tensor, qdq: bool) -> tuple[Tensor, Tensor]:
    r, k = x2.shape
    assert k % BLOCK == 0, f"last dim {k} is not a multiple of {BLOCK}"
    if qdq:
        q, s = torch.empty(r, k, dtype=torch.bfloat16, device=x2.device), x2  # s unused
    else:
        q = torch.empty(r, k, dtype=torch.float8_e4m3fn, device=x2.device)
        s = torch.empty(r, k // BLOCK, dtype=torch.float32, device=x2.device)
    if r:
        block_r, block_k = 16, _block_k(k)
        _act_quant_kernel[(cdiv(r, block_r), k // block_k)](
            x2, q.view(torch.int16) if qdq else q.view(torch.uint8), s, r, k,
            BLOCK_R=block_r, BLOCK_K=block_k, QDQ=qdq)
    return q, s


def fp8_act_quant(x: Tensor) -> tuple[Tensor, Tensor]:
    """Kernel form of engine.quant.act_quant (same bits): bf16 [..., K] -> (float8_e4m3fn [..., K],
    fp32 scales [..., K/32])."""
    assert x.dtype == torch.bfloat16, f"x must be bf16, got {x.dtype}"
    assert x.is_contiguous(), f"x must be contiguous, got strides {x.stride()}"
    k = x.size(-1)
    q, s = _act_quant_launch(x.view(-1, k), qdq=False)
    return q.view(x.shape), s.view(*x.shape[:-1], k // BLOCK)


def fp8_act_qdq(x: Tensor) -> Tensor:
    """Kernel form of engine.quant.act_quant_qdq (same bits): bf16 [..., K] -> bf16 q * s [..., K]."""
    assert x.dtype == torch.bfloat16, f"x must be bf16, got {x.dtype}"
    assert x.is_contiguous(), f"x must be contiguous, got strides {x.stride()}"
    return _act_quant_launch(x.view(-1, x.size(-1)), qdq=True)[0].view(x.shape)


def fp8_weight_bf16(weight: Tensor, scale: Tensor) -> Tensor:
    """The FP8 weight dequantised: float8_e4m3fn [N, K] x E8M0 [ceil(N/32), K/32] -> bf16 [N, K], exactly
    engine.quant.dequant_fp8_weight's values (each is exact in bf16), in one launch."""
    n, k = weight.shape
    assert weight.dtype == torch.float8_e4m3fn and k % BLOCK == 0, f"weight {weight.dtype} [{n}, {k}]"
    out = torch.empty(n, k, dtype=torch.bfloat16, device=weight.device)
    if n:
        block_n, block_k = (32, 256) if weight.is_cuda else (min(256, triton.next_power_of_2(n)), 512)
        _weight_bf16_kernel[(cdiv(n, block_n), cdiv(k, block_k))](
            weight, scale.view(torch.uint8), out.view(torch.int16), n, k, BLOCK_N=block_n, BLOCK_K=block_k)
    return out


@contextmanager
def _exact_bf16_reduction() -> Iterator[None]:
    """cuBLAS without its reduced-precision (bf16) split-K reduction for the calls inside: every partial sum in fp32."""
    saved = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = saved


def dequant_linear(x2: Tensor, weight: Tensor, scale: Tensor, out_dtype: torch.dtype) -> Tensor:
    """Prefill's FP8 linear on CUDA (M >= DEQUANT_MIN_M): x quantised and dequantised once (fp8_act_qdq, exact in
    bf16), the weight dequantised once to bf16 (fp8_weight_bf16, exact), then one cuBLAS bf16 GEMM with fp32
    accumulation: the exact block products summed in fp32 (cuBLAS's order), as the Triton kernel's bf16 MMAs do.
    Costs a transient bf16 copy of the weight (2 bytes per weight byte written and read): worth it where the GEMM
    is compute-bound, not at decode M."""
    xq, w = fp8_act_qdq(x2), fp8_weight_bf16(weight, scale)
    if out_dtype == torch.float32:
        return torch.mm(xq, w.t(), out_dtype=torch.float32)
    with _exact_bf16_reduction():
        return torch.mm(xq, w.t())


def fp8_linear(x: Tensor, weight: Tensor, scale: Tensor, config: Fp8LinearConfig | None = None,
               out_dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """y = act_quant(x) @ weight^T with per-block scales: bf16 [..., K] x FP8 [N, K] -> bf16 [..., N], or with
    out_dtype=torch.float32 the fp32 sum before that rounding (fp32 [..., N]).

    weight float8_e4m3fn [N, K] (K % 32 == 0), scale float8_e8m0fnu [ceil(N/32), K/32]; all contiguous
    and on one device. Matches fp8_linear_ref to fp32 summation order (the tolerance is stated in
    tests/kernels/test_fp8_linear.py). Launches on different streams use different split-K tickets.
    """
    check_fp8_linear_args(x, weight, scale)
    assert out_dtype in (torch.bfloat16, torch.float32), f"out_dtype must be bf16 or fp32, got {out_dtype}"
    n, k = weight.shape
    x2 = x.view(-1, k)
    m = x2.size(0)
    if config is None and gemv_applies(x, weight):
        return fp8_gemv(x, weight, scale, out_dtype=out_dtype)  # decode shapes: the CUDA GEMV (cuda/fp8_gemv.cu)
    if config is None and x.is_cuda and m >= DEQUANT_MIN_M:
        return dequant_linear(x2, weight, scale, out_dtype).view(*x.shape[:-1], n)  # prefill: cuBLAS bf16
    assert max(n, m) * max(k, n) < 2**31, f"int32 offsets: M={m} N={n} K={k} too large"
    out_f32 = out_dtype == torch.float32
    y = torch.empty(m, n, dtype=out_dtype, device=x.device)
    if m == 0:
        return y.view(*x.shape[:-1], n)
    cfg = config or (pick_config(m, n, k, launch_sms(x.device)) if x.is_cuda else interpreter_config(m, n, k))
    block_k = _block_k(k, cfg.block_k)
    k_per_split = block_k * cdiv(k // block_k, max(1, cfg.split_k))
    num_splits = cdiv(k, k_per_split)
    tiles = cdiv(n, cfg.block_n) * cdiv(m, cfg.block_m)
    xq = x2 if cfg.fuse_quant else fp8_act_qdq(x2)
    tickets = split_k_tickets(x.device)
    if num_splits > 1:
        assert tiles <= MAX_TICKETS, f"{tiles} tiles exceed the {MAX_TICKETS} split-K tickets"
        part = torch.empty(num_splits, m, n, dtype=torch.float32, device=x.device)
    else:
        part = tickets.view(torch.float32)  # not read or written without a split
    _fp8_linear_kernel[(tiles * num_splits,)](
        xq, weight, scale.view(torch.uint8), y if out_f32 else y.view(torch.int16), part, tickets,
        m, n, k, k_per_split, num_splits,
        BLOCK_N=cfg.block_n, BLOCK_M=cfg.block_m, BLOCK_K=block_k, QUANT_X=cfg.fuse_quant,
        DOT_F32=not x.is_cuda, OUT_F32=out_f32, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return y.view(*x.shape[:-1], n)


def fp8_linear_ref(x: Tensor, weight: Tensor, scale: Tensor, out_dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """The test oracle, in the reference kernel's order: bf16 [..., K] x FP8 [N, K] -> bf16 [..., N] (out_dtype
    fp32: the accumulator before its rounding).

    Per K block kb: the exact 32-term product sum rounded once to fp32 (what an fp32-accumulating block
    product approximates), times sa·sw (exact), added to an fp32 accumulator in K order; then bf16.
    engine.quant.linear (the golden model) instead rounds the exact sum over all of K once to fp32,
    so the two differ only by the fp32 rounding of the KB-term accumulation: almost always bitwise
    equal after bf16 rounding, at most ~1 bf16 ULP apart where the output nearly cancels.
    """
    n, k = weight.shape
    qa, sa = act_quant(x.reshape(-1, k))  # [M, K] fp8, [M, KB] fp32
    a = qa.double().view(-1, k // BLOCK, BLOCK)
    w = weight.double().view(n, k // BLOCK, BLOCK)
    sw = scale.float().repeat_interleave(BLOCK, dim=0)[:n]  # [N, KB]
    acc = torch.zeros(a.size(0), n, dtype=torch.float32, device=x.device)
    for kb in range(k // BLOCK):
        acc += (a[:, kb] @ w[:, kb].T).float() * (sa[:, kb, None] * sw[None, :, kb])
    return acc.to(out_dtype).view(*x.shape[:-1], n)


_STACKED: dict[tuple[int, int], tuple[Linear, Linear, Linear]] = {}  # (id(a), id(b)) -> (a, b, stacked)


def stacked_fp8(a: Linear, b: Linear) -> Linear | None:
    """One FP8 Linear whose rows are a's then b's (a.out_features % 32 == 0, the same in_features), so that two
    linears of the same x run as one launch; a's and b's buffers become views of the stack (the weights exist once;
    the modules still work). None where the two do not stack (another format, rows that split a scale block)."""
    if a.fmt != "fp8" or b.fmt != "fp8" or a.in_features != b.in_features or a.out_features % 32:
        return None
    hit = _STACKED.get((id(a), id(b)))
    if hit is None or hit[0] is not a or hit[1] is not b:
        fused = Linear(a.in_features, a.out_features + b.out_features, "fp8")
        fused.weight, fused.scale = cat_8bit(a.weight, b.weight), cat_8bit(a.scale, b.scale)
        na, sa = a.out_features, a.out_features // 32
        a.weight, b.weight = fused.weight[:na], fused.weight[na:]
        a.scale, b.scale = fused.scale[:sa], fused.scale[sa:]
        hit = _STACKED[(id(a), id(b))] = (a, b, fused)
    return hit[2]


def layer_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(N, K) = (out, in) of one decoder layer's FP8 linears, and the Engram layers' wkv (tests and benchmarks
    use the same set)."""
    return {
        "wq_a": (cfg.q_lora_rank, cfg.dim),
        "wq_b": (cfg.n_heads * cfg.head_dim, cfg.q_lora_rank),
        "wkv": (cfg.head_dim, cfg.dim),
        "wo_b": (cfg.dim, cfg.o_groups * cfg.o_lora_rank),
        "shared_w13": (2 * cfg.moe_inter_dim, cfg.dim),  # W1 and W3 stacked: one launch (moe.shared_expert)
        "shared_w2": (cfg.dim, cfg.moe_inter_dim),
        "engram_wkv": (cfg.dim * (cfg.hc_mult + 1), cfg.n_hash_cols * cfg.engram_head_dim),  # Engram layers only
    }
