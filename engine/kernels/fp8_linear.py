"""FP8 block-scaled linear with fused activation quantisation (DeepSeek's `fp8_gemm` semantics).

    y[m, n] = bf16( Σ_kb ( Σ_{k in kb} qa[m, k] · qw[n, k] ) · sa[m, kb] · sw[n // 32, kb] )

- (qa, sa) = act_quant(x): FP8 E4M3 per 32 along K with a UE8M0 (power-of-two) scale, bit for bit
  `engine.quant.act_quant`. For M <= 64 it is computed inside the GEMM (no extra launch); for larger M
  the wrapper runs `fp8_act_quant` once, so each weight tile does not re-quantise every row.
- qw: FP8 E4M3 weight [N, K], one E8M0 scale per 32x32 block ([ceil(N/32), K/32]).
- Each 32-wide K block is one FP8 tensor-core product; its fp32 result is multiplied by sa·sw (exact:
  powers of two) and added to an fp32 accumulator in K order, as the reference kernel does. Split-K
  programs (below) sum their partials in split order, so the result is deterministic.

Memory traffic (the floor): N·K weight bytes + N·K/1024 scale bytes + 2·M·K (x) + 2·M·N (y), plus
8·splits·M·N bytes of fp32 partials when K is split. At decode M the weight is everything, so the
kernel is a weight stream: swap-AB tiles put BLOCK_N weight rows on the MMA's M side and the tokens
(padded to BLOCK_M >= 16) on its N side, and a small matrix is split along K so that a few waves of
programs keep HBM busy. The last program of an output tile to finish (an atomic ticket) sums the
fp32 partials and writes bf16, then resets its ticket: one launch, no memset.

Interpreter notes (TRITON_INTERPRET=1): its fp32 -> fp8 cast misrounds when the carry reaches the
exponent and its fp32 -> bf16 cast truncates, so the E4M3 rounding has a bit-exact integer form
(used off-GPU) and the bf16 output is always rounded with integer round-to-nearest-even.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from engine.quant import BLOCK, act_quant

_INV_FP8_MAX = tl.constexpr(1.0 / 448.0)  # rounded to fp32 where used, as engine.quant._fp32(1/448)
_MAX_TICKETS = 1 << 16
_TICKETS: dict[torch.device, Tensor] = {}


@triton.jit
def _e8m0_to_fp32(u8):
    """uint8 E8M0 codes -> fp32 2^(u - 127) (codes 1..254; weights never use 0 or the NaN code 255)."""
    return (u8.to(tl.int32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_exact(v):
    """fp32 in [-448, 448] -> float8e4nv, round to nearest even, in integer and exact fp32 steps."""
    bits = v.to(tl.int32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    e = tl.maximum(mag >> 23, 121)  # biased exponent; E4M3 subnormals share 2^-6's quantum 2^-9
    magic = ((e + 20) << 23).to(tl.float32, bitcast=True)  # ulp(magic) = E4M3 quantum at exponent e
    r = (mag.to(tl.float32, bitcast=True) + magic) - magic  # |v| rounded to that quantum, RNE, exact
    rb = r.to(tl.int32, bitcast=True)
    normal = (((rb >> 23) - 120) << 3) | ((rb >> 20) & 7)
    code = tl.where(rb >= (121 << 23), normal, (r * 512.0).to(tl.int32)) | ((bits >> 24) & 0x80)
    return code.to(tl.uint8).to(tl.float8e4nv, bitcast=True)


@triton.jit
def _quant_rows(x, HW_CAST: tl.constexpr):
    """fp32 [R, 32] -> (float8e4nv [R, 32], fp32 scales [R]) exactly as engine.quant.act_quant."""
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-4)
    y = (amax * _INV_FP8_MAX).to(tl.int32, bitcast=True)
    e = ((y >> 23) & 0xFF) + ((y & 0x7FFFFF) != 0).to(tl.int32)  # 2^ceil(log2 y) from the bits
    s = (e << 23).to(tl.float32, bitcast=True)
    inv_s = ((254 - e) << 23).to(tl.float32, bitcast=True)  # 1/s, exact, so x * inv_s == x / s
    v = tl.minimum(tl.maximum(x * inv_s[:, None], -448.0), 448.0)
    if HW_CAST:
        q = v.to(tl.float8e4nv)  # cvt.rn.satfinite: RNE, the same bits as _e4m3_exact
    else:
        q = _e4m3_exact(v)
    return q, s


@triton.jit
def _bf16_bits(x):
    """fp32 -> int16 bit pattern of bf16(x), round to nearest even (finite x)."""
    u = x.to(tl.int32, bitcast=True)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).to(tl.int16)


@triton.jit
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, R, K, BLOCK_R: tl.constexpr, HW_CAST: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    kb = tl.program_id(1)
    cols = kb * 32 + tl.arange(0, 32)
    ok = rows < R
    offs = rows[:, None] * K + cols[None, :]
    q, s = _quant_rows(tl.load(x_ptr + offs, mask=ok[:, None], other=0.0).to(tl.float32), HW_CAST)
    tl.store(q_ptr + offs, q, mask=ok[:, None])
    tl.store(s_ptr + rows * (K // 32) + kb, s, mask=ok)


@triton.jit
def _fp8_linear_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, y_ptr, part_ptr, ticket_ptr,
    M, N, K, blocks_per_split, num_splits,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, SUB: tl.constexpr,
    QUANT_X: tl.constexpr, HW_CAST: tl.constexpr,
):
    # program id -> (n tile, split, m tile), m fastest: the splits of one tile run side by side
    pid = tl.program_id(0)
    num_m_tiles = tl.cdiv(M, BLOCK_M)
    pid_m = pid % num_m_tiles
    pid_k = (pid // num_m_tiles) % num_splits
    pid_n = pid // (num_m_tiles * num_splits)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, 32)
    # clamped rows: loads need no mask (rows past the end repeat the last one and are not stored)
    rows_n = tl.minimum(offs_n, N - 1)
    rows_m = tl.minimum(offs_m, M - 1)
    num_kb = K // 32
    kb_lo = pid_k * blocks_per_split
    kb_hi = tl.minimum(kb_lo + blocks_per_split, num_kb)  # both multiples of SUB (host contract)

    w_ptrs = w_ptr + rows_n[:, None] * K + offs_k[None, :]  # [BN, 32] fp8
    x_ptrs = x_ptr + rows_m[:, None] * K + offs_k[None, :]  # [BM, 32] bf16 (QUANT_X) or fp8
    ws_ptrs = ws_ptr + (rows_n // 32) * num_kb  # [BN] E8M0 codes of this row's 32x32 blocks
    xs_ptrs = xs_ptr + rows_m * num_kb  # [BM] fp32 act scales (not QUANT_X)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for kb0 in range(kb_lo, kb_hi, SUB):
        for j in tl.static_range(SUB):
            kb = kb0 + j
            w = tl.load(w_ptrs + kb * 32)
            if QUANT_X:
                q, sa = _quant_rows(tl.load(x_ptrs + kb * 32).to(tl.float32), HW_CAST)
            else:
                q = tl.load(x_ptrs + kb * 32)
                sa = tl.load(xs_ptrs + kb)
            sw = _e8m0_to_fp32(tl.load(ws_ptrs + kb))
            part = tl.dot(w, tl.trans(q))  # [BN, BM] fp32: one 32-deep block product
            acc += part * (sw[:, None] * sa[None, :])

    mask = (offs_n < N)[:, None] & (offs_m < M)[None, :]
    out = offs_m[None, :] * N + offs_n[:, None]  # [BN, BM] into row-major [M, N]
    if num_splits == 1:
        tl.store(y_ptr + out, _bf16_bits(acc), mask=mask)
    else:
        tl.store(part_ptr + pid_k * M * N + out, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial is issued before the ticket releases it
        ticket = tl.atomic_add(ticket_ptr + pid_n * num_m_tiles + pid_m, 1, sem="acq_rel")
        if ticket == num_splits - 1:  # the last split of this tile to finish: reduce in split order
            tl.debug_barrier()
            total = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            for s in range(num_splits):
                total += tl.load(part_ptr + s * M * N + out, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(y_ptr + out, _bf16_bits(total), mask=mask)
            tl.atomic_xchg(ticket_ptr + pid_n * num_m_tiles + pid_m, 0)


@dataclass(frozen=True, slots=True)
class Fp8LinearConfig:
    """Launch shape. split_k is a request: the K blocks per split are rounded to the unroll (SUB)."""

    block_n: int
    block_m: int
    split_k: int
    num_warps: int
    num_stages: int


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def pick_config(m: int, n: int, k: int, num_sms: int = 132) -> Fp8LinearConfig:
    """Decode (m <= 64): 64-row weight tiles, K split until ~4 waves of programs stream the weight,
    capped so the fp32 partials stay under a quarter of the weight bytes. Prefill: 128x128 tiles."""
    if m > 64:
        return Fp8LinearConfig(block_n=128, block_m=128, split_k=1, num_warps=8, num_stages=3)
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n = 64
    tiles = _cdiv(n, block_n) * _cdiv(m, block_m)
    split = max(1, min(4 * num_sms // tiles, k // (32 * m)))
    return Fp8LinearConfig(block_n=block_n, block_m=block_m, split_k=split, num_warps=4, num_stages=4)


def _tickets(device: torch.device) -> Tensor:
    """Per-device split-K tickets, zero between launches (the last program of a tile resets its own).
    One stream at a time: two launches running concurrently on different streams would share them."""
    if device not in _TICKETS:
        _TICKETS[device] = torch.zeros(_MAX_TICKETS, dtype=torch.int32, device=device)
    return _TICKETS[device]


def fp8_act_quant(x: Tensor, *, hw_cast: bool | None = None) -> tuple[Tensor, Tensor]:
    """Kernel form of engine.quant.act_quant: bf16 [..., K] -> (float8_e4m3fn [..., K], fp32 [..., K/32]).

    hw_cast: round with the GPU's fp32 -> e4m3 conversion (default on CUDA) or the integer form
    (default elsewhere: the interpreter misrounds); both give act_quant's bits.
    """
    assert x.dtype == torch.bfloat16, f"x must be bf16, got {x.dtype}"
    assert x.is_contiguous(), f"x must be contiguous, got strides {x.stride()}"
    k = x.size(-1)
    assert k % BLOCK == 0, f"last dim {k} is not a multiple of {BLOCK}"
    x2 = x.view(-1, k)
    q = torch.empty(x2.shape, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(x2.size(0), k // BLOCK, dtype=torch.float32, device=x.device)
    if x2.size(0):
        block_r = 16
        hw = x.is_cuda if hw_cast is None else hw_cast
        _act_quant_kernel[(_cdiv(x2.size(0), block_r), k // BLOCK)](x2, q, s, x2.size(0), k, BLOCK_R=block_r,
                                                                    HW_CAST=hw)
    return q.view(x.shape), s.view(*x.shape[:-1], k // BLOCK)


def fp8_linear(x: Tensor, weight: Tensor, scale: Tensor, config: Fp8LinearConfig | None = None) -> Tensor:
    """y = act_quant(x) @ weight^T with per-block scales: bf16 [..., K] x FP8 [N, K] -> bf16 [..., N].

    weight float8_e4m3fn [N, K] (K % 32 == 0), scale float8_e8m0fnu [ceil(N/32), K/32]; all contiguous
    and on one device. Within `assert_fp8_linear_close`'s tolerance of `fp8_linear_ref`.
    """
    assert x.dtype == torch.bfloat16, f"x must be bf16, got {x.dtype}"
    assert weight.dtype == torch.float8_e4m3fn and weight.dim() == 2, (
        f"weight must be 2-D float8_e4m3fn, got {weight.dtype} {tuple(weight.shape)}")
    assert scale.dtype == torch.float8_e8m0fnu, f"scale must be float8_e8m0fnu, got {scale.dtype}"
    n, k = weight.shape
    assert x.size(-1) == k, f"x {tuple(x.shape)} does not match weight {tuple(weight.shape)}"
    assert k % BLOCK == 0, f"K = {k} is not a multiple of {BLOCK}"
    assert tuple(scale.shape) == (_cdiv(n, BLOCK), k // BLOCK), (
        f"weight {tuple(weight.shape)} needs scale {(_cdiv(n, BLOCK), k // BLOCK)}, got {tuple(scale.shape)}")
    assert x.is_contiguous() and weight.is_contiguous() and scale.is_contiguous(), "x, weight, scale must be contiguous"
    assert x.device == weight.device == scale.device, f"devices differ: {x.device} {weight.device} {scale.device}"
    x2 = x.view(-1, k)
    m = x2.size(0)
    assert max(n, m) * max(k, n) < 2**31, f"int32 offsets: M={m} N={n} K={k} too large"
    y = torch.empty(m, n, dtype=torch.bfloat16, device=x.device)
    if m == 0:
        return y.view(*x.shape[:-1], n)
    cfg = config or pick_config(m, n, k, _num_sms(x.device))
    num_kb = k // BLOCK
    sub = 4 if num_kb % 4 == 0 else 2 if num_kb % 2 == 0 else 1
    blocks_per_split = sub * _cdiv(num_kb, max(1, cfg.split_k) * sub)
    num_splits = _cdiv(num_kb, blocks_per_split)
    tiles = _cdiv(n, cfg.block_n) * _cdiv(m, cfg.block_m)
    hw = x.is_cuda
    quant_x = m <= 64
    if quant_x:
        xq, xs = x2, x2  # xs unused
    else:
        xq, xs = fp8_act_quant(x2, hw_cast=hw)
    tickets = _tickets(x.device)
    if num_splits > 1:
        assert tiles <= _MAX_TICKETS, f"{tiles} tiles exceed the {_MAX_TICKETS} split-K tickets"
        part = torch.empty(num_splits, m, n, dtype=torch.float32, device=x.device)
    else:
        part = tickets.view(torch.float32)  # not read or written without a split
    _fp8_linear_kernel[(tiles * num_splits,)](
        xq, xs, weight, scale.view(torch.uint8), y.view(torch.int16), part, tickets,
        m, n, k, blocks_per_split, num_splits,
        BLOCK_N=cfg.block_n, BLOCK_M=cfg.block_m, SUB=sub, QUANT_X=quant_x, HW_CAST=hw,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return y.view(*x.shape[:-1], n)


def fp8_linear_ref(x: Tensor, weight: Tensor, scale: Tensor) -> Tensor:
    """The test oracle, in the reference kernel's order: bf16 [..., K] x FP8 [N, K] -> bf16 [..., N].

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
    return acc.to(torch.bfloat16).view(*x.shape[:-1], n)
