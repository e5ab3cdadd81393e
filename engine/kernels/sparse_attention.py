"""Sparse MQA decode attention straight over the packed paged pools (engine.model.attention.sparse_attn
semantics on the rows that engine/core/runner.py `_attention` concatenates: window rows, then top-k rows).

For query m and head h, over the rows r of [swa_idx[m], main_idx[m]] whose slot is not -1:

    l_r = scale * q[m, h] · kv_r        mx = max(max_r l_r, -1e30)        p_r = exp(l_r - mx)
    o[m, h] = Σ_r bf16(p_r) kv_r / (Σ_r p_r + exp(sink[h] - mx))

kv_r is dequantised in registers from its record (cache_records): SWA = FP8 E4M3 x 2^(e - 127) per 32,
main = E2M1 x E4M3 per 16. Both products are exact in bf16, so the QK and PV MMAs take bf16 operands
with fp32 accumulation. All-invalid rows give 0 (the denominator is exp(sink + 1e30) = inf).

Matching the golden P rounding: the golden rounds p_r = exp(l_r - mx) with the *final* max to bf16.
A one-pass online softmax would round exp(l_r - running max) and rescale later, which is not the
same bf16 value. So the kernel makes two passes over the rows: pass 1 is an online (max, Σ p)
over all rows; pass 2 recomputes l_r, rounds exp(l_r - mx) to bf16 and accumulates P·V. The
denominator sums the unrounded p in fp32 (rescaled online: equal to Σ exp(l_r - mx) up to fp32
rounding). Differences from the float64 golden: fp32 logits (a bf16 rounding of p may land on the
other side of a tie) and fp32 summation order.

Launches (flash-decoding split, so that M = 1 still fills the GPU): the rows are cut into splits of
rows_per_split (window splits, then main splits); grid (M, H / BLOCK_H, splits).
  1. pass 1 per split: (max, Σp) -> stats.
  2. pass 2 per split: global max and Σp from all splits' stats, Σ bf16(exp(l - max)) kv -> fp32 partials.
  3. combine per (m, head block): partials summed in split order (deterministic), / (Σp + exp(sink - max)).
Memory traffic (the floor): M·(KW·528 + KM·288) record bytes + 4·M·(KW+KM) index bytes + 2·M·H·D (q)
+ 2·M·H·D (o). Pass 2 and the other head blocks of the same query re-read the same records (from L2),
plus 8·M·H·splits·(D + 1) bytes of fp32 partials. At decode shapes the kernel is latency-bound.

Interpreter (TRITON_INTERPRET=1): records are decoded with integer/fp32 bit operations (no fp8
casts), bf16 rounding is integer round-to-nearest-even, and the dots take fp32 operands (the same
exact products), since the interpreter's bf16 arithmetic is broken.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from engine.kernels.cache_records import (MAIN_KV_BLOCK, SWA_BLOCK, fp4_record_bytes, swa_record_bytes,
                                          unpack_main_kv, unpack_swa)
from engine.kernels.triton_common import e2m1_to_fp32, e4m3_to_fp32, round_bf16
from engine.model.attention import sparse_attn

SINK_FREE_MAX = tl.constexpr(-1e30)  # as engine.model.attention: running max seed


@triton.jit
def _load_rows(pool_ptr, idx_ptr, n0, n_rows, IS_MAIN: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr):
    """Rows n0 .. n0+BLOCK_N (< n_rows) of one query's slot list -> (dequantised fp32 [BLOCK_N, D], valid)."""
    offs = n0 + tl.arange(0, BLOCK_N)
    slot = tl.load(idx_ptr + offs, mask=offs < n_rows, other=-1)
    valid = slot >= 0
    ok = valid[:, None]
    if IS_MAIN:
        rec = tl.maximum(slot, 0).to(tl.int64) * (D // 2 + D // 16)
        b = tl.load(pool_ptr + rec[:, None] + tl.arange(0, D // 2)[None, :], mask=ok, other=0).to(tl.int32)
        code = tl.interleave(b & 15, b >> 4)  # [BN, D]: even element in the low nibble
        s = tl.load(pool_ptr + rec[:, None] + D // 2 + tl.arange(0, D // 16)[None, :], mask=ok, other=0)
        kv = tl.reshape(e2m1_to_fp32(code), (BLOCK_N, D // 16, 16)) * e4m3_to_fp32(s.to(tl.int32))[:, :, None]
    else:
        rec = tl.maximum(slot, 0).to(tl.int64) * (D + D // 32)
        b = tl.load(pool_ptr + rec[:, None] + tl.arange(0, D)[None, :], mask=ok, other=0).to(tl.int32)
        s = tl.load(pool_ptr + rec[:, None] + D + tl.arange(0, D // 32)[None, :], mask=ok, other=0).to(tl.int32)
        kv = tl.reshape(e4m3_to_fp32(b), (BLOCK_N, D // 32, 32)) * (s << 23).to(tl.float32, bitcast=True)[:, :, None]
    return tl.reshape(kv, (BLOCK_N, D)), valid


@triton.jit
def masked_logits(q, kv, valid, scale, DOT_F32: tl.constexpr):
    """q [BH, D], kv fp32 [BN, D] -> scale * q kv^T [BH, BN] fp32, -inf where the row is invalid."""
    if DOT_F32:
        s = tl.dot(q, tl.trans(kv), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(kv.to(tl.bfloat16)))
    return tl.where(valid[None, :], s * scale, float("-inf"))


@triton.jit
def _max_denom_pass(q, pool_ptr, idx_ptr, lo, hi, m_i, l_i, scale,
                    IS_MAIN: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr):
    for n0 in range(lo, hi, BLOCK_N):
        kv, valid = _load_rows(pool_ptr, idx_ptr, n0, hi, IS_MAIN, D, BLOCK_N)
        s = masked_logits(q, kv, valid, scale, DOT_F32)
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        l_i = l_i * tl.exp(m_i - m_new) + tl.sum(tl.exp(s - m_new[:, None]), axis=1)
        m_i = m_new
    return m_i, l_i


@triton.jit
def _pv_pass(q, pool_ptr, idx_ptr, lo, hi, m_i, acc, scale,
             IS_MAIN: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr):
    for n0 in range(lo, hi, BLOCK_N):
        kv, valid = _load_rows(pool_ptr, idx_ptr, n0, hi, IS_MAIN, D, BLOCK_N)
        p = round_bf16(tl.exp(masked_logits(q, kv, valid, scale, DOT_F32) - m_i[:, None]))  # golden: bf16(p)
        if DOT_F32:
            acc = tl.dot(p, kv, acc, input_precision="ieee")
        else:
            acc = tl.dot(p.to(tl.bfloat16), kv.to(tl.bfloat16), acc)
    return acc


@triton.jit
def _global_stats(stats_ptr, base, h_ok, S, l_off, BLOCK_S: tl.constexpr):
    """Per-split (max, Σp) at stats_ptr + {0 | l_off} + base[h] + s -> (global max, Σp rescaled to it) [BH].
    Heads past H (h_ok false) read nothing: their base lies past the stats of the last query."""
    sp = tl.arange(0, BLOCK_S)
    ok = h_ok[:, None] & (sp[None, :] < S)
    m_s = tl.load(stats_ptr + base[:, None] + sp[None, :], mask=ok, other=SINK_FREE_MAX)
    l_s = tl.load(stats_ptr + base[:, None] + sp[None, :] + l_off, mask=ok, other=0.0)
    m_g = tl.max(m_s, axis=1)
    return m_g, tl.sum(l_s * tl.exp(m_s - m_g[:, None]), axis=1)


@triton.jit
def _split_kernel(q_ptr, swa_ptr, swa_idx_ptr, main_ptr, main_idx_ptr, stats_ptr, part_ptr,
                  H, KW, KM, scale, n_sw, S, R, stats_stride,
                  D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr,
                  PV: tl.constexpr, DOT_F32: tl.constexpr):
    """Program (m, head block, split s). Splits 0..n_sw-1 cover window rows [sR, sR+R), the rest main rows.
    PV=False: write the split's (max, Σp). PV=True: read all splits' stats, write Σ bf16(p) kv in fp32."""
    m = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    s = tl.program_id(2)
    d = tl.arange(0, D)
    h_ok = heads < H
    q = tl.load(q_ptr + (m * H + heads).to(tl.int64)[:, None] * D + d[None, :], mask=h_ok[:, None], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    row = (m * H + heads).to(tl.int64) * S  # [BH] into stats [2, M*H*S]
    if PV:
        m_i, _ = _global_stats(stats_ptr, row, h_ok, S, stats_stride, BLOCK_S)
        acc = tl.zeros((BLOCK_H, D), tl.float32)
        if s < n_sw:
            acc = _pv_pass(q, swa_ptr, swa_idx_ptr + m.to(tl.int64) * KW, s * R, tl.minimum(s * R + R, KW), m_i,
                           acc, scale, False, D, BLOCK_N, DOT_F32)
        else:
            lo = (s - n_sw) * R
            acc = _pv_pass(q, main_ptr, main_idx_ptr + m.to(tl.int64) * KM, lo, tl.minimum(lo + R, KM), m_i,
                           acc, scale, True, D, BLOCK_N, DOT_F32)
        tl.store(part_ptr + (row + s)[:, None] * D + d[None, :], acc, mask=h_ok[:, None])
    else:
        m_i = tl.full((BLOCK_H,), SINK_FREE_MAX, tl.float32)
        l_i = tl.zeros((BLOCK_H,), tl.float32)
        if s < n_sw:
            m_i, l_i = _max_denom_pass(q, swa_ptr, swa_idx_ptr + m.to(tl.int64) * KW, s * R,
                                       tl.minimum(s * R + R, KW), m_i, l_i, scale, False, D, BLOCK_N, DOT_F32)
        else:
            lo = (s - n_sw) * R
            m_i, l_i = _max_denom_pass(q, main_ptr, main_idx_ptr + m.to(tl.int64) * KM, lo,
                                       tl.minimum(lo + R, KM), m_i, l_i, scale, True, D, BLOCK_N, DOT_F32)
        tl.store(stats_ptr + row + s, m_i, mask=h_ok)
        tl.store(stats_ptr + stats_stride + row + s, l_i, mask=h_ok)


@triton.jit
def _combine_kernel(stats_ptr, part_ptr, sink_ptr, o_ptr, H, S, stats_stride,
                    D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr):
    m = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, D)
    h_ok = heads < H
    row = (m * H + heads).to(tl.int64) * S
    m_i, l_i = _global_stats(stats_ptr, row, h_ok, S, stats_stride, BLOCK_S)
    acc = tl.zeros((BLOCK_H, D), tl.float32)
    for s in range(0, S):  # split order: deterministic
        acc += tl.load(part_ptr + (row + s)[:, None] * D + d[None, :], mask=h_ok[:, None], other=0.0)
    sink = tl.load(sink_ptr + heads, mask=h_ok, other=0.0)
    o = acc / (l_i + tl.exp(sink - m_i))[:, None]  # an all-invalid row: 0 / inf = 0
    u = o.to(tl.int32, bitcast=True)
    tl.store(o_ptr + (m * H + heads).to(tl.int64)[:, None] * D + d[None, :],
             ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).to(tl.int16), mask=h_ok[:, None])


def check_attn_args(q: Tensor, swa_pool: Tensor, swa_idx: Tensor, main_pool: Tensor, main_idx: Tensor,
                sink: Tensor) -> None:
    """The input contract of the sparse attention kernels (decode and prefill)."""
    M, H, D = q.shape
    assert q.dtype == torch.bfloat16 and q.is_contiguous(), f"q must be contiguous bf16, got {q.dtype}"
    assert D >= 32 and D & (D - 1) == 0, f"head_dim {D} must be a power of two >= 32"
    assert D % SWA_BLOCK == 0 and D % MAIN_KV_BLOCK == 0
    for pool, nbytes, name in ((swa_pool, swa_record_bytes(D), "swa_pool"),
                               (main_pool, fp4_record_bytes(D, MAIN_KV_BLOCK), "main_pool")):
        assert pool.dtype == torch.uint8 and pool.is_contiguous(), f"{name} must be contiguous uint8"
        assert pool.size(-1) == nbytes, f"{name} records of {pool.size(-1)} bytes, expected {nbytes}"
    for idx, name in ((swa_idx, "swa_idx"), (main_idx, "main_idx")):
        assert idx.dtype == torch.int32 and idx.is_contiguous(), f"{name} must be contiguous int32"
        assert idx.dim() == 2 and idx.size(0) == M, f"{name} {tuple(idx.shape)} must be [M={M}, K]"
    assert sink.dtype == torch.float32 and sink.shape == (H,), f"sink must be fp32 [{H}]"
    devs = {t.device for t in (q, swa_pool, swa_idx, main_pool, main_idx, sink)}
    assert len(devs) == 1, f"all inputs on one device, got {devs}"


def sparse_attn_paged(q: Tensor, swa_pool: Tensor, swa_idx: Tensor, main_pool: Tensor, main_idx: Tensor,
                      sink: Tensor, scale: float, block_h: int | None = None, block_n: int = 32, rows_per_split: int = 64,
                      num_warps: int = 8, num_stages: int = 1) -> Tensor:
    """q bf16 [M, H, D]; swa_pool uint8 [..., D + D/32]; swa_idx int32 [M, KW] flat slots (-1 = none);
    main_pool uint8 [..., D/2 + D/16]; main_idx int32 [M, KM] (-1 = none); sink fp32 [H] -> bf16 [M, H, D].

    Pools are the paged pools as stored ([num_blocks, slots_per_block, record] or already flat); a flat
    slot is block_id * slots_per_block + offset. Slots must be < the pool's slot count (not checked).
    block_h (heads per program) defaults to 16 for M <= 2 and 32 above: on an H200 (benchmarks/kernels.py,
    2026-11-30) 32 was faster at M = 6 (69 vs 92 us) and M = 32 (242 vs 384 us), 16 at M = 1 (58 vs 63 us).
    """
    check_attn_args(q, swa_pool, swa_idx, main_pool, main_idx, sink)
    M, H, D = q.shape
    block_h = block_h or (16 if M <= 2 else 32)
    assert block_h >= 16 and block_n >= 16, "tl.dot needs tiles of at least 16"
    assert rows_per_split % block_n == 0, f"rows_per_split {rows_per_split} must be a multiple of {block_n}"
    KW, KM, R = swa_idx.size(1), main_idx.size(1), rows_per_split
    n_sw = triton.cdiv(KW, R)
    S = n_sw + triton.cdiv(KM, R)
    if M == 0 or S == 0:
        return torch.zeros_like(q)
    out = torch.empty_like(q)
    stats = torch.empty(2, M * H * S, dtype=torch.float32, device=q.device)  # [max | Σp] per (m, h, split)
    part = torch.empty(M * H * S, D, dtype=torch.float32, device=q.device)
    block_s = triton.next_power_of_2(S)
    grid = (M, triton.cdiv(H, block_h), S)
    common = dict(D=D, BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_S=block_s, DOT_F32=not q.is_cuda,
                  num_warps=num_warps, num_stages=num_stages)
    for pv in (False, True):
        _split_kernel[grid](q, swa_pool, swa_idx, main_pool, main_idx, stats, part,
                            H, KW, KM, float(scale), n_sw, S, R, M * H * S, PV=pv, **common)
    _combine_kernel[grid[:2]](stats, part, sink, out.view(torch.int16), H, S, M * H * S, D=D, BLOCK_H=block_h,
                              BLOCK_S=block_s, num_warps=4)
    return out


def gather_rows_ref(q: Tensor, swa_pool: Tensor, swa_idx: Tensor, main_pool: Tensor, main_idx: Tensor
                    ) -> tuple[Tensor, Tensor]:
    """Unpacked rows per query -> (kv bf16 [M, KW+KM, D], idx [M, 1, KW+KM] into them, -1 = none)."""
    D = q.size(-1)
    swa = unpack_swa(swa_pool.view(-1, swa_pool.size(-1))[swa_idx.long().clamp_min(0)], D)  # [M, KW, D]
    main = unpack_main_kv(main_pool.view(-1, main_pool.size(-1))[main_idx.long().clamp_min(0)], D)  # [M, KM, D]
    ids = torch.cat([swa_idx, main_idx], dim=1)
    idx = torch.where(ids >= 0, torch.arange(ids.size(1), device=ids.device), -1)
    return torch.cat([swa, main], dim=1), idx.unsqueeze(1)


def sparse_attn_paged_ref(q: Tensor, swa_pool: Tensor, swa_idx: Tensor, main_pool: Tensor, main_idx: Tensor,
                          sink: Tensor, scale: float) -> Tensor:
    """The oracle: unpack the listed records with cache_records, then the golden sparse_attn (float64)."""
    kv, idx = gather_rows_ref(q, swa_pool, swa_idx, main_pool, main_idx)
    return sparse_attn(q.unsqueeze(1), kv, sink, idx, scale).squeeze(1)
