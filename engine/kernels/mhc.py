"""Manifold-constrained hyper-connections (mHC, spec 4.2): the mixes with their Sinkhorn epilogue, the
collapse (alone or fused with the sublayer's RMSNorm) and the expansion, on rows = tokens.

hc_mixes (engine.model.mhc.hc_mixes), x bf16 [N, hc, D] flattened to [N, K = hc·D]:

    r[n]      = rsqrt(mean_k x[n, k]^2 + norm_eps)
    m[n, j]   = r[n] · Σ_k x[n, k] fn[j, k]                    j < mix = (2 + hc)·hc = 24
    pre       = sigmoid(m[:hc]·s0 + b[:hc]) + hc_eps          post = 2·sigmoid(m[hc:2hc]·s1 + b[hc:2hc])
    comb      = softmax_rows(m[2hc:]·s2 + b[2hc:]) + hc_eps, then a column normalisation, then iters - 1
                rounds of (row, column) normalisation (x / (sum + hc_eps))

  Split-K GEMM [N, K] x [K, 24 -> 32] on tensor cores as two tf32 MMAs (x is exact in tf32, fn is split
  into hi + lo tf32 parts: each product within 2^-21 relative, fp32 accumulation), the sum of squares on
  the same x tiles. Each split writes fp32 partials [32] per row (the 24 sums, Σx² in column 24); the last
  program of a row tile (an atomic ticket, as in fp8_linear) sums them in split-chunk order
  (deterministic), then runs the sigmoid / softmax / Sinkhorn epilogue in registers on the row's 24
  values viewed as [8 groups, hc]: group 0 pre, 1 post, 2..5 the comb rows, 6 Σx². One launch, no memset.
  Memory traffic (the floor): 2·N·K (x) + 4·24·K (fn, 1.97 MB at D = 5120) + 4·N·(2hc + hc²) bytes, plus
  128·splits·N bytes of partials.

hc_pre / hc_pre_norm (engine.model.mhc.hc_pre, then RMSNorm):

    c[n, :] = bf16(Σ_k pre[n, k] · x[n, k, :])   (fp32 FMAs)          y = rms_norm(c, w, eps) (fp32 math)

  hc_pre_norm: one program per row keeps c in registers: 2·N·hc·D + 4·N·hc + 2·D + 2·N·D bytes.
  hc_pre alone tiles D (many programs at N = 1).

hc_post (engine.model.mhc.hc_post):  out[n, k, :] = bf16(post[n, k]·y[n, :] + Σ_j comb[n, j, k]·R[n, j, :])
  tiles D; traffic 2·N·D + 2·N·hc·D (R) + 4·N·(hc + hc²) + 2·N·hc·D (out) bytes.

hc_post_mixes: hc_post fused with the NEXT sublayer's hc_mixes (block.py: X = hc_post(...), then
  hc_mixes(X, ffn)): the split-K programs of the mixes GEMM produce their X tiles [BM, hc, BD] from y and R,
  store them (bf16) and feed the rounded values to the GEMM from registers, so X is never read back:
  saves 2·N·hc·D bytes and one launch over hc_post + hc_mixes. Same epilogue and numerics.

Numerics vs the float64 golden (stated and checked in tests/kernels/test_norm_mhc.py): the bf16 outputs
are the golden's or one bf16 ULP away (fp32 sums of a few exact-ish products); pre/post/comb differ by
the fp32 GEMM error (~1e-6 relative to r·Σ|x||fn|) times the epilogue's gain, plus fp32 rounding in the
20 Sinkhorn rounds.

Interpreter (TRITON_INTERPRET=1): inputs are upcast right after loading, bf16 outputs are rounded with
integer round-to-nearest-even, and its dot ignores input_precision (plain fp32 numpy matmul).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from engine.kernels.fp8_linear import MAX_TICKETS, split_k_tickets
from engine.kernels.mhc_cuda import hc_mixes_cuda, mixes_cuda_applies
from engine.kernels.norm import row_warps
from engine.kernels.triton_common import bf16_bits, cdiv, launch_sms, rms_normalize, round_bf16
from engine.model import mhc as golden
from engine.model.layers import RMSNorm


@triton.jit
def _dot_x_fn(x, f, acc):
    """acc + x @ f^T for x fp32 holding bf16 values (exact in tf32) and fp32 f: two tf32 MMAs over
    f = hi + lo, hi = f rounded to tf32 (11 significant bits), lo = f - hi exact (|lo| <= 2^-11 |f|), which
    the MMA truncates to tf32: each product within 2^-21 of x·f, accumulated in fp32."""
    hi = ((f.to(tl.int32, bitcast=True) + 0x1000) & -8192).to(tl.float32, bitcast=True)
    acc = tl.dot(x, tl.trans(hi), acc, input_precision="tf32")
    return tl.dot(x, tl.trans(f - hi), acc, input_precision="tf32")


@triton.jit
def _sinkhorn_epilogue(t, offs_m, M, K, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, hc_eps, norm_eps,
                       HC: tl.constexpr, G: tl.constexpr, ITERS: tl.constexpr, BLOCK_M: tl.constexpr):
    """t fp32 [BLOCK_M, G·HC]: Σ x fn in columns < (2 + HC)·HC, Σ x² in column (2 + HC)·HC -> pre, post, comb."""
    v = tl.reshape(t, (BLOCK_M, G, HC))
    g = tl.arange(0, G)[None, :, None]  # group: 0 pre, 1 post, 2 .. 2+HC-1 comb rows, 2+HC Σx²
    j = tl.arange(0, HC)[None, None, :]
    sq = tl.sum(tl.sum(tl.where((g == 2 + HC) & (j == 0), v, 0.0), axis=2), axis=1)  # [BM]
    rstd = 1.0 / tl.sqrt_rn(sq / K + norm_eps)
    is_mix = g < 2 + HC
    is_comb = (g >= 2) & is_mix
    s = tl.where(g == 0, tl.load(scale_ptr), tl.where(g == 1, tl.load(scale_ptr + 1), tl.load(scale_ptr + 2)))
    b = tl.load(base_ptr + g * HC + j, mask=is_mix, other=0.0)  # [1, G, HC]
    z = tl.where(is_mix, (v * rstd[:, None, None]) * s + b, 0.0)  # m = mixes · rstd (fp32), then affine
    sig = 1.0 / (1.0 + tl.exp(-z))
    e = tl.exp(z - tl.max(z, axis=2)[:, :, None])
    comb = tl.where(is_comb, e / tl.sum(e, axis=2)[:, :, None] + hc_eps, 0.0)  # softmax over each comb row
    comb = comb / (tl.sum(comb, axis=1)[:, None, :] + hc_eps)  # columns
    for _ in range(ITERS - 1):
        comb = comb / (tl.sum(comb, axis=2)[:, :, None] + hc_eps)  # rows (non-comb groups stay 0)
        comb = comb / (tl.sum(comb, axis=1)[:, None, :] + hc_eps)  # columns
    m = offs_m[:, None, None].to(tl.int64)
    pre = tl.sum(tl.where(g == 0, sig, 0.0), axis=1) + hc_eps  # [BM, HC]
    post = 2.0 * tl.sum(tl.where(g == 1, sig, 0.0), axis=1)
    m2, j2 = offs_m[:, None].to(tl.int64), tl.arange(0, HC)[None, :]
    tl.store(pre_ptr + m2 * HC + j2, pre, mask=m2 < M)
    tl.store(post_ptr + m2 * HC + j2, post, mask=m2 < M)
    tl.store(comb_ptr + m * (HC * HC) + (g - 2) * HC + j, comb, mask=(m < M) & is_comb)


@triton.jit
def _finish_mixes(acc, sq, pid_m, pid_k, offs_m, M, K, num_splits, part_ptr, ticket_ptr, scale_ptr, base_ptr,
                  pre_ptr, post_ptr, comb_ptr, hc_eps, norm_eps, HC: tl.constexpr, G: tl.constexpr,
                  ITERS: tl.constexpr, BLOCK_M: tl.constexpr, SPLIT_CHUNK: tl.constexpr):
    """This split's Σ x fn [BM, G·HC] (columns >= MIX ignored) and Σ x² [BM] -> pre, post, comb, through
    the split-K partials when num_splits > 1 (the last program of the row tile runs the epilogue)."""
    MIX: tl.constexpr = (2 + HC) * HC
    W: tl.constexpr = G * HC
    cols = tl.arange(0, W)
    t = tl.where(cols[None, :] == MIX, sq[:, None], tl.where(cols[None, :] < MIX, acc, 0.0))
    if num_splits == 1:
        _sinkhorn_epilogue(t, offs_m, M, K, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, hc_eps, norm_eps,
                           HC, G, ITERS, BLOCK_M)
    else:
        ok = (offs_m < M)[:, None]
        tl.store(part_ptr + (pid_k * M + offs_m[:, None]) * W + cols[None, :], t, mask=ok)
        tl.debug_barrier()  # every thread's partial is issued before the ticket releases it
        ticket = tl.atomic_add(ticket_ptr + pid_m, 1, sem="acq_rel")
        if ticket == num_splits - 1:  # the last split of this row tile: reduce in chunk order
            tl.debug_barrier()
            e = tl.arange(0, BLOCK_M * W)  # the tile's partials are contiguous: [BM rows x W]
            e_ok = (pid_m * BLOCK_M + e // W < M)[None, :]
            total = tl.zeros((BLOCK_M * W,), dtype=tl.float32)
            for s0 in range(0, num_splits, SPLIT_CHUNK):
                s = s0 + tl.arange(0, SPLIT_CHUNK)
                p = tl.load(part_ptr + (s[:, None] * M + pid_m * BLOCK_M) * W + e[None, :],
                            mask=(s < num_splits)[:, None] & e_ok, other=0.0, cache_modifier=".cg")
                total += tl.sum(p, axis=0)
            _sinkhorn_epilogue(tl.reshape(total, (BLOCK_M, W)), offs_m, M, K, scale_ptr, base_ptr, pre_ptr,
                               post_ptr, comb_ptr, hc_eps, norm_eps, HC, G, ITERS, BLOCK_M)
            tl.atomic_xchg(ticket_ptr + pid_m, 0)


@triton.jit
def _hc_mixes_kernel(x_ptr, fn_ptr, scale_ptr, base_ptr, part_ptr, ticket_ptr, pre_ptr, post_ptr, comb_ptr,
                     M, K, k_per_split, num_splits, hc_eps, norm_eps,
                     HC: tl.constexpr, G: tl.constexpr, ITERS: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_K: tl.constexpr, SPLIT_CHUNK: tl.constexpr):
    MIX: tl.constexpr = (2 + HC) * HC
    W: tl.constexpr = G * HC  # padded row of partials: MIX sums, Σx², zeros
    # program id -> (row tile, split), row tiles fastest: the tiles reading the same fn slice run together
    pid = tl.program_id(0)
    num_m_tiles = tl.cdiv(M, BLOCK_M)
    pid_m = pid % num_m_tiles
    pid_k = pid // num_m_tiles
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    rows_m = tl.minimum(offs_m, M - 1).to(tl.int64)  # clamped: loads need no mask
    rows_f = tl.minimum(tl.arange(0, W), MIX - 1)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)  # multiples of BLOCK_K (host contract)

    x_ptrs = x_ptr + rows_m[:, None] * K + offs_k[None, :]  # [BM, BK] bf16
    f_ptrs = fn_ptr + rows_f[:, None] * K + offs_k[None, :]  # [W, BK] fp32 (rows past MIX repeat the last)
    acc = tl.zeros((BLOCK_M, W), dtype=tl.float32)
    sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k in range(k_lo, k_hi, BLOCK_K):
        xv = tl.load(x_ptrs + k).to(tl.float32)
        sq += tl.sum(xv * xv, axis=1)
        acc = _dot_x_fn(xv, tl.load(f_ptrs + k), acc)
    _finish_mixes(acc, sq, pid_m, pid_k, offs_m, M, K, num_splits, part_ptr, ticket_ptr, scale_ptr, base_ptr,
                  pre_ptr, post_ptr, comb_ptr, hc_eps, norm_eps, HC, G, ITERS, BLOCK_M, SPLIT_CHUNK)


@triton.jit
def _hc_post_mixes_kernel(y_ptr, res_ptr, post_ptr, comb_ptr, out_ptr, fn_ptr, scale_ptr, base_ptr, part_ptr,
                          ticket_ptr, npre_ptr, npost_ptr, ncomb_ptr, M, D, d_per_split, num_splits, hc_eps,
                          norm_eps, HC: tl.constexpr, G: tl.constexpr, ITERS: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, SPLIT_CHUNK: tl.constexpr):
    """hc_post's X tile [BM, HC, BD] computed, rounded to bf16 and stored, then fed to the mixes GEMM of
    the next sublayer from registers (X is written once and not read back)."""
    MIX: tl.constexpr = (2 + HC) * HC
    W: tl.constexpr = G * HC
    pid = tl.program_id(0)
    num_m_tiles = tl.cdiv(M, BLOCK_M)
    pid_m = pid % num_m_tiles
    pid_k = pid // num_m_tiles
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows_m = tl.minimum(offs_m, M - 1).to(tl.int64)  # clamped: loads need no mask
    rows_f = tl.minimum(tl.arange(0, W), MIX - 1)
    kk = tl.arange(0, HC)
    dd = tl.arange(0, BLOCK_D)
    K = HC * D
    d_lo = pid_k * d_per_split
    d_hi = tl.minimum(d_lo + d_per_split, D)  # multiples of BLOCK_D (host contract)

    post = tl.load(post_ptr + rows_m[:, None] * HC + kk[None, :])  # [BM, HC]
    m_ok = (offs_m < M)[:, None, None]
    acc = tl.zeros((BLOCK_M, W), dtype=tl.float32)
    sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for d0 in range(d_lo, d_hi, BLOCK_D):
        d = d0 + dd
        y = tl.load(y_ptr + rows_m[:, None] * D + d[None, :]).to(tl.float32)  # [BM, BD]
        xk = post[:, :, None] * y[:, None, :]  # [BM, HC, BD]: X[m, k, d], as _hc_post_kernel
        for j in tl.static_range(HC):
            cj = tl.load(comb_ptr + rows_m[:, None] * (HC * HC) + j * HC + kk[None, :])  # comb[m, j, k]
            rj = tl.load(res_ptr + (rows_m[:, None] * HC + j) * D + d[None, :]).to(tl.float32)
            xk += cj[:, :, None] * rj[:, None, :]
        xk = round_bf16(xk)  # the stream is bf16: the mixes see the rounded values
        tl.store(out_ptr + (rows_m[:, None, None] * HC + kk[None, :, None]) * D + d[None, None, :],
                 bf16_bits(xk), mask=m_ok)
        x2 = tl.reshape(xk, (BLOCK_M, HC * BLOCK_D))
        sq += tl.sum(x2 * x2, axis=1)
        f = tl.load(fn_ptr + rows_f[:, None, None] * K + (kk * D)[None, :, None] + d[None, None, :])  # [W, HC, BD]
        acc = _dot_x_fn(x2, tl.reshape(f, (W, HC * BLOCK_D)), acc)
    _finish_mixes(acc, sq, pid_m, pid_k, offs_m, M, K, num_splits, part_ptr, ticket_ptr, scale_ptr, base_ptr,
                  npre_ptr, npost_ptr, ncomb_ptr, hc_eps, norm_eps, HC, G, ITERS, BLOCK_M, SPLIT_CHUNK)


@triton.jit
def _hc_pre_kernel(x_ptr, pre_ptr, w_ptr, out_ptr, D, eps, HC: tl.constexpr, BLOCK_D: tl.constexpr,
                   NORM: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    dd = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = dd < D
    c = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for k in tl.static_range(HC):
        xk = tl.load(x_ptr + (row * HC + k) * D + dd, mask=ok, other=0.0).to(tl.float32)
        c += tl.load(pre_ptr + row * HC + k) * xk
    c = round_bf16(c)  # the collapse is a bf16 tensor in the reference
    if NORM:  # one program holds the row (BLOCK_D >= D)
        c = rms_normalize(c, w_ptr, D, eps, BLOCK_D)
    tl.store(out_ptr + row * D + dd, bf16_bits(c), mask=ok)


@triton.jit
def _hc_post_kernel(y_ptr, res_ptr, post_ptr, comb_ptr, out_ptr, D, HC: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    dd = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = dd < D
    kk = tl.arange(0, HC)
    y = tl.load(y_ptr + row * D + dd, mask=ok, other=0.0).to(tl.float32)
    acc = tl.load(post_ptr + row * HC + kk)[:, None] * y[None, :]  # [HC, BD]
    for j in tl.static_range(HC):
        cj = tl.load(comb_ptr + row * (HC * HC) + j * HC + kk)  # comb[j, k] over k: consumed transposed
        rj = tl.load(res_ptr + (row * HC + j) * D + dd, mask=ok, other=0.0).to(tl.float32)
        acc += cj[:, None] * rj[None, :]
    tl.store(out_ptr + (row * HC + kk[:, None]) * D + dd[None, :], bf16_bits(acc), mask=ok[None, :])


# --- host wrappers -----------------------------------------------------------------------------------------------

def _check_stream(x: Tensor, hc: int, what: str) -> tuple[int, int]:
    assert x.dtype == torch.bfloat16, f"{what} must be bf16, got {x.dtype}"
    assert x.dim() == 3 and x.size(1) == hc, f"{what} must be [N, {hc}, D], got {tuple(x.shape)}"
    assert x.is_contiguous(), f"{what} must be contiguous, got strides {x.stride()}"
    assert hc & (hc - 1) == 0, f"hc = {hc} must be a power of two"
    return x.size(0), x.size(2)


def _check_f32(t: Tensor, shape: tuple[int, ...], device: torch.device, what: str) -> None:
    assert t.dtype == torch.float32 and tuple(t.shape) == shape, (
        f"{what} must be fp32 {shape}, got {t.dtype} {tuple(t.shape)}")
    assert t.is_contiguous() and t.device == device, f"{what} must be contiguous on {device}"


def _check_post(y: Tensor, residual: Tensor, post: Tensor, comb: Tensor) -> tuple[int, int, int]:
    assert y.dtype == torch.bfloat16 and y.dim() == 2 and y.is_contiguous(), (
        f"y must be contiguous bf16 [N, D], got {y.dtype} {tuple(y.shape)}")
    hc = residual.size(1) if residual.dim() == 3 else -1
    n, d = _check_stream(residual, hc, "residual")
    assert tuple(y.shape) == (n, d), f"y {tuple(y.shape)} does not match residual {tuple(residual.shape)}"
    assert y.device == residual.device, f"devices differ: {y.device} {residual.device}"
    _check_f32(post, (n, hc), y.device, "post")
    _check_f32(comb, (n, hc, hc), y.device, "comb")
    return n, d, hc


def _d_block(n: int, d: int, num_sms: int) -> int:
    """Largest power-of-two D tile in [128, 1024] that still gives >= 2 programs per SM."""
    bd = 1024
    while bd > 128 and n * cdiv(d, bd) < 2 * num_sms:
        bd //= 2
    return min(bd, triton.next_power_of_2(d))


def _block_m(m: int) -> int:
    return 16 if m <= 16 else 32 if m <= 32 else 64


def mixes_launch_shape(m: int, k: int, num_sms: int = 132) -> tuple[int, int, int]:
    """(block_m, block_k, splits) for hc_mixes. Tiles sized to compile without register spills for sm_90 at
    4 warps (ptxas -v, triton 3.6): [16, 64 or 128] and [32 or 64, 64]. From the H200 sweep (2026-11-30,
    K = 20480): up to 64 rows, 16-row tiles with K split 80 ways (~1.25 programs per SM; 10.3 / 11.0 /
    15.1 us at N = 1 / 6 / 64, against 11.7 / 12.3 / 25.5 with 2 programs per SM and K >= 512 per split);
    at 4096 rows 64-row tiles with K split until ~2 programs per SM (176 us)."""
    if m <= 64:
        block_m, block_k, splits = 16, 64, max(1, min(80, k // 256))
    else:
        block_m, block_k = _block_m(m), 64
        splits = max(1, min(2 * num_sms // max(1, cdiv(m, block_m)), k // 512))
    while k % block_k:
        block_k //= 2
    return block_m, block_k, splits


def post_mixes_launch_shape(m: int, d: int, hc: int, num_sms: int = 132) -> tuple[int, int, int]:
    """(block_m, block_d, splits) for hc_post_mixes: hc·block_d = 64 (block_m <= 32) or 32 values of K per
    step, the sizes that compile without register spills for sm_90 at 8 warps (ptxas -v, triton 3.6); D is
    split as hc_mixes splits K."""
    block_m = _block_m(m)
    block_d = max(4, (64 if block_m <= 32 else 32) // hc)
    while d % block_d:
        block_d //= 2
    return block_m, block_d, max(1, min(2 * num_sms // max(1, cdiv(m, block_m)), hc * d // 512))


def interpreter_launch_shape(m: int, k: int, most: int) -> tuple[int, int, int]:
    """(block_m, block_k or block_d, splits) of hc_mixes / hc_post_mixes off the GPU (TRITON_INTERPRET=1), where
    each op of each program costs ~0.1 ms of Python: up to 64 rows a tile, the largest power-of-two step <= most
    that divides k, no split."""
    step = min(most, triton.next_power_of_2(k))
    while k % step:
        step //= 2
    return min(64, max(16, triton.next_power_of_2(m))), step, 1


def _interpreter_d_block(d: int) -> int:
    """hc_pre / hc_post's D tile off the GPU: one program a row."""
    return triton.next_power_of_2(d)


def _check_mix_params(fn: Tensor, scale: Tensor, base: Tensor, hc: int, d: int, iters: int,
                      device: torch.device) -> None:
    mix = (2 + hc) * hc
    _check_f32(fn, (mix, hc * d), device, "fn")
    _check_f32(scale, (3,), device, "scale")
    _check_f32(base, (mix,), device, "base")
    assert iters >= 1, f"iters = {iters}"
    assert mix * hc * d < 2**31, f"fn offsets: K = {hc * d}"


def _mixes_buffers(n: int, hc: int, tiles: int, num_splits: int, device: torch.device):
    """(pre, post, comb, split-K partials, tickets, groups G): the outputs and the split-K scratch."""
    g = triton.next_power_of_2(2 + hc + 1)  # groups of hc: pre, post, hc comb rows, Σx²
    pre = torch.empty(n, hc, dtype=torch.float32, device=device)
    post = torch.empty(n, hc, dtype=torch.float32, device=device)
    comb = torch.empty(n, hc, hc, dtype=torch.float32, device=device)
    if num_splits > 1:
        assert tiles <= MAX_TICKETS, f"{tiles} row tiles exceed the {MAX_TICKETS} split-K tickets"
        part = torch.empty(num_splits, n, g * hc, dtype=torch.float32, device=device)
    else:
        part = pre  # not read or written without a split
    return pre, post, comb, part, split_k_tickets(device), g


def hc_mixes(x: Tensor, fn: Tensor, scale: Tensor, base: Tensor, hc: int, iters: int, hc_eps: float,
             norm_eps: float, launch: tuple[int, int, int] | None = None, beside: bool = False
             ) -> tuple[Tensor, Tensor, Tensor]:
    """x bf16 [N, hc, D], fn fp32 [(2+hc)·hc, hc·D], scale fp32 [3], base fp32 [(2+hc)·hc] ->
    (pre fp32 [N, hc], post fp32 [N, hc], comb fp32 [N, hc, hc]).

    At decode on sm_90 (N <= 8, hc = 4, no launch given) the CUDA kernel of engine.kernels.mhc_cuda runs
    instead, with fewer CTAs when the call runs beside other kernels (beside=True, on a side stream). launch =
    (block_m, block_k, splits) overrides mixes_launch_shape (tests, sweeps) and keeps the Triton kernel. The
    Triton kernel's split-K tickets are its stream's (fp8_linear.split_k_tickets); the CUDA kernel's are shared
    by every CUDA mixes call, so those must not run on two streams at once."""
    n, d = _check_stream(x, hc, "x")
    k = hc * d
    _check_mix_params(fn, scale, base, hc, d, iters, x.device)
    if launch is None and mixes_cuda_applies(x, hc):
        return hc_mixes_cuda(x, fn, scale, base, hc, iters, hc_eps, norm_eps, beside=beside)
    block_m, block_k, splits = launch or (mixes_launch_shape(n, k, launch_sms(x.device)) if x.is_cuda
                                          else interpreter_launch_shape(n, k, 4096))
    assert k % block_k == 0 and block_k >= 16, f"block_k = {block_k} must divide K = {k} (and be >= 16)"
    k_per_split = block_k * cdiv(k // block_k, max(1, splits))
    num_splits, tiles = cdiv(k, k_per_split), cdiv(n, block_m)
    pre, post, comb, part, tickets, g = _mixes_buffers(n, hc, tiles, num_splits, x.device)
    if n:
        _hc_mixes_kernel[(tiles * num_splits,)](
            x, fn, scale, base, part, tickets, pre, post, comb, n, k, k_per_split, num_splits, hc_eps, norm_eps,
            HC=hc, G=g, ITERS=iters, BLOCK_M=block_m, BLOCK_K=block_k,
            SPLIT_CHUNK=max(1, 8192 // (block_m * g * hc)), num_warps=4, num_stages=3)
    return pre, post, comb


def hc_post_mixes(y: Tensor, residual: Tensor, post: Tensor, comb: Tensor, fn: Tensor, scale: Tensor,
                  base: Tensor, iters: int, hc_eps: float, norm_eps: float,
                  launch: tuple[int, int, int] | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """hc_post then the next sublayer's hc_mixes in one pass (the stream is written once, not re-read):
    -> (X = hc_post(y, residual, post, comb) bf16 [N, hc, D], *hc_mixes(X, fn, scale, base, ...)).

    X is bitwise hc_post's on the interpreter (same fp32 operation order); the mixes obey hc_mixes's
    bounds. launch = (block_m, block_d, splits) overrides post_mixes_launch_shape."""
    n, d, hc = _check_post(y, residual, post, comb)
    _check_mix_params(fn, scale, base, hc, d, iters, y.device)
    block_m, block_d, splits = launch or (post_mixes_launch_shape(n, d, hc, launch_sms(y.device)) if y.is_cuda
                                          else interpreter_launch_shape(n, d, 1024))
    assert d % block_d == 0 and hc * block_d >= 16, f"block_d = {block_d} must divide D = {d} (hc·block_d >= 16)"
    d_per_split = block_d * cdiv(d // block_d, max(1, splits))
    num_splits, tiles = cdiv(d, d_per_split), cdiv(n, block_m)
    out = torch.empty_like(residual)
    npre, npost, ncomb, part, tickets, g = _mixes_buffers(n, hc, tiles, num_splits, y.device)
    if n:
        _hc_post_mixes_kernel[(tiles * num_splits,)](
            y, residual, post, comb, out.view(torch.int16), fn, scale, base, part, tickets, npre, npost, ncomb,
            n, d, d_per_split, num_splits, hc_eps, norm_eps, HC=hc, G=g, ITERS=iters, BLOCK_M=block_m,
            BLOCK_D=block_d, SPLIT_CHUNK=max(1, 8192 // (block_m * g * hc)), num_warps=8, num_stages=2)
    return out, npre, npost, ncomb


def _collapse(x: Tensor, pre: Tensor, w: Tensor | None, eps: float) -> Tensor:
    hc = x.size(1) if x.dim() == 3 else -1
    n, d = _check_stream(x, hc, "x")
    _check_f32(pre, (n, hc), x.device, "pre")
    out = torch.empty(n, d, dtype=torch.bfloat16, device=x.device)
    if n == 0:
        return out
    if w is None:
        bd = _d_block(n, d, launch_sms(x.device)) if x.is_cuda else _interpreter_d_block(d)
        _hc_pre_kernel[(n, cdiv(d, bd))](x, pre, x, out.view(torch.int16), d, 0.0, HC=x.size(1), BLOCK_D=bd,
                                          NORM=False, num_warps=4)
    else:
        assert w.dtype == torch.bfloat16 and tuple(w.shape) == (d,), (
            f"w must be bf16 [{d}], got {w.dtype} {tuple(w.shape)}")
        assert w.is_contiguous() and w.device == x.device, f"w must be contiguous on {x.device}"
        bd = triton.next_power_of_2(d)
        _hc_pre_kernel[(n, 1)](x, pre, w, out.view(torch.int16), d, eps, HC=x.size(1), BLOCK_D=bd, NORM=True,
                               num_warps=row_warps(bd))
    return out


def hc_pre(x: Tensor, pre: Tensor) -> Tensor:
    """Collapse: x bf16 [N, hc, D], pre fp32 [N, hc] -> bf16 [N, D] = bf16(Σ_k pre_k x_k) (fp32 math)."""
    return _collapse(x, pre, None, 0.0)


def hc_pre_norm(x: Tensor, pre: Tensor, w: Tensor, eps: float) -> Tensor:
    """rms_norm(hc_pre(x, pre), w, eps) in one pass: bf16 [N, hc, D], fp32 [N, hc], bf16 [D] -> bf16 [N, D]."""
    return _collapse(x, pre, w, eps)


def hc_post(y: Tensor, residual: Tensor, post: Tensor, comb: Tensor) -> Tensor:
    """Expand: y bf16 [N, D], residual bf16 [N, hc, D], post fp32 [N, hc], comb fp32 [N, hc, hc] ->
    bf16 [N, hc, D], out[:, k] = post[:, k]·y + Σ_j comb[:, j, k]·residual[:, j] (fp32 math)."""
    n, d, hc = _check_post(y, residual, post, comb)
    out = torch.empty_like(residual)
    if n:
        bd = _d_block(n, d, launch_sms(y.device)) if y.is_cuda else _interpreter_d_block(d)
        _hc_post_kernel[(n, cdiv(d, bd))](y, residual, post, comb, out.view(torch.int16), d, HC=hc, BLOCK_D=bd,
                                           num_warps=4)
    return out


# --- test oracles: the golden model's float64 math ------------------------------------------------------------

def hc_mixes_ref(x: Tensor, fn: Tensor, scale: Tensor, base: Tensor, hc: int, iters: int, hc_eps: float,
                 norm_eps: float) -> tuple[Tensor, Tensor, Tensor]:
    pre, post, comb = golden.hc_mixes(x.unsqueeze(0), fn, scale, base, hc, iters, hc_eps, norm_eps)
    return pre[0], post[0], comb[0]


def hc_pre_ref(x: Tensor, pre: Tensor) -> Tensor:
    return golden.hc_pre(x.unsqueeze(0), pre.unsqueeze(0))[0]


def hc_pre_norm_ref(x: Tensor, pre: Tensor, w: Tensor, eps: float) -> Tensor:
    norm = RMSNorm(w.size(0), eps).to(x.device)
    norm.weight.copy_(w)
    return norm(hc_pre_ref(x, pre))


def hc_post_ref(y: Tensor, residual: Tensor, post: Tensor, comb: Tensor) -> Tensor:
    return golden.hc_post(y.unsqueeze(0), residual.unsqueeze(0), post.unsqueeze(0), comb.unsqueeze(0))[0]
