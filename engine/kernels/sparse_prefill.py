"""Sparse MQA attention over the packed paged pools, prefill form (many queries per launch), and the
dispatcher `sparse_attn` that picks it or the decode form (engine/kernels/sparse_attention.py).

Same math and the same golden-matching P rounding as `sparse_attn_paged` (see its module docstring).
For query m and head h, over the rows r of [swa_idx[m], main_idx[m]] whose slot is not -1:

    l_r = scale * q[m, h] · kv_r        mx = max(max_r l_r, -1e30)        p_r = exp(l_r - mx)
    o[m, h] = Σ_r bf16(p_r) kv_r / (Σ_r p_r + exp(sink[h] - mx))

One launch, no split partials: program (m, head block) loads its BLOCK_H heads of q[m] once (the MMA's
M side: K = V = one shared head, so all 64 heads of one query share every row), then streams that
query's rows twice, dequantising each BLOCK_N-row tile of records in registers:
  pass 1: online (max, Σp) over the window rows, then separately over the main rows; the two are
          merged as the decode kernel merges its splits' stats (so the results can be compared bitwise);
  pass 2: Σ bf16(exp(l_r - mx)) kv_r over window then main rows into one fp32 [BLOCK_H, D] accumulator;
  then o = acc / (Σp + exp(sink - mx)), rounded to bf16 (integer round to nearest even) and stored.
Programs are numbered head block fastest, so the head blocks of one query run side by side and share
its records through L2. Records are read as int32 words (D % 128 == 0 keeps every record word-aligned)
and decoded with in-thread field splits and two exact multiplies per element (see _dequant); the slot
list is read two tiles ahead and, with prefetch, the next tile's record words one tile ahead.

Memory traffic (the floor): M·(KW·528 + KM·288) record bytes + 4·M·(KW+KM) index bytes + 2·M·H·D (q)
+ 2·M·H·D (o). Pass 2 re-reads the query's records (~218 KB at KW = 128, KM = 512: from L2), as does
every head block past the first. Tensor-core work: 2·M·H·(KW+KM)·D FLOPs per QK (done twice) plus the
same for PV. Offline sm_90a compile (triton 3.6 + ptxas, no GPU; 2026-11-30) of the default launch shape:
255 registers, ~2 KB of spill stores, 0.9-1.5 K SASS instructions per thread per 32-row tile (mostly the
dequant; the decode kernel's loops: 1.7-2.3 K), so expect the CUDA cores, not HBM, to bound it.

Bitwise equal to `sparse_attn_paged` (same block_h and block_n, rows_per_split >= both lists) whenever
the main list is at most one tile: both then make the same fp32 operations in the same order.

Interpreter (TRITON_INTERPRET=1): the dots take fp32 operands (DOT_F32), as in the decode kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from engine.kernels.sparse_decode import decode_applies, sparse_attn_decode
from engine.kernels.sparse_attention import SINK_FREE_MAX, check_attn_args, masked_logits, sparse_attn_paged
from engine.kernels.triton_common import e4m3_to_fp32, round_bf16

# Queries per call up to which `sparse_attn` runs the decode kernel: its row splits (10 programs per
# query and head block at KW = 128, KM = 512) keep the 132 SMs busy when M·H/64 programs would not.
# Measured on the H200 (benchmarks/kernel_benches/sparse_prefill.py, 2026-11-30, full shapes): decode
# 103 / 146 / 240 us at M = 8 / 16 / 32, prefill 206 / 206 / 209 us: the crossover lies between 16 and 32.
# Default launch (64 heads, 32 rows, 8 warps, 3 stages, no prefetch) from the same run's sweep.
DECODE_MAX_M = 16


@triton.jit
def _halves(x, BITS: tl.constexpr):
    """int32 [...] -> [..., 2]: the low and high BITS-wide fields of each (joined in-thread)."""
    return tl.join(x & ((1 << BITS) - 1), (x >> BITS) & ((1 << BITS) - 1))


@triton.jit
def _fetch(pool_ptr, slot, IS_MAIN: tl.constexpr, D: tl.constexpr):
    """The records at slot [BLOCK_N] (-1: nothing loaded) as int32 words -> (code words [BLOCK_N, W],
    the word holding each code word's scale byte [BLOCK_N, W]). Main: W = D/8 words of 8 E2M1 codes, then
    D/16 E4M3 scale bytes (one per 2 code words). SWA: W = D/4 words of 4 E4M3 codes, then D/32 UE8M0 scale
    bytes (one per 8 code words)."""
    ok = (slot >= 0)[:, None]
    if IS_MAIN:
        wi = tl.arange(0, D // 8)
        rec = tl.maximum(slot, 0).to(tl.int64) * ((D // 2 + D // 16) // 4)
        scale_word = D // 8 + wi // 8
    else:
        wi = tl.arange(0, D // 4)
        rec = tl.maximum(slot, 0).to(tl.int64) * ((D + D // 32) // 4)
        scale_word = D // 4 + wi // 32
    codes = tl.load(pool_ptr + rec[:, None] + wi[None, :], mask=ok, other=0)
    scales = tl.load(pool_ptr + rec[:, None] + scale_word[None, :], mask=ok, other=0)  # each word: an L1 hit
    return codes, scales


@triton.jit
def _dequant(codes, scales, IS_MAIN: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr):
    """Record words -> kv fp32 [BLOCK_N, D], the same values as cache_records' unpack (exact products).

    A code's sign and magnitude bits are placed in an fp32 so that it reads code * 2^-126 (E2M1: the
    exponent and mantissa bits land on fp32's, E2M1 subnormals on fp32 subnormals) or code * 2^-120
    (E4M3); one multiply by 2^126 / 2^120 makes it exact, a second applies the block scale. The fields
    are split off with in-thread joins, so each thread's 8 (main) or 4 (SWA) values are consecutive."""
    if IS_MAIN:
        wi = tl.arange(0, D // 8)
        s = e4m3_to_fp32((scales >> (8 * ((wi // 2) % 4))[None, :]) & 255)  # [BN, D/8]
        c = _halves(_halves(_halves(codes, 16), 8), 4)  # [BN, D/8, 2, 2, 2]: element 8w + 4h + 2b + n
        x = (((c & 8) << 28) | ((c & 7) << 22)).to(tl.float32, bitcast=True) * 8.507059173023462e37  # 2^126
        kv = x * s[:, :, None, None, None]
    else:
        wi = tl.arange(0, D // 4)
        s = (((scales >> (8 * ((wi // 8) % 4))[None, :]) & 255) << 23).to(tl.float32, bitcast=True)  # 2^(e-127)
        c = _halves(_halves(codes, 16), 8)  # [BN, D/4, 2, 2]: element 4w + 2h + b
        x = (((c & 0x80) << 24) | ((c & 0x7F) << 20)).to(tl.float32, bitcast=True) * 1.329227995784916e36  # 2^120
        kv = x * s[:, :, None, None]
    return tl.reshape(kv, (BLOCK_N, D))


@triton.jit
def _list_pass(q, pool_ptr, idx_ptr, K, scale, m_i, l_i, acc,
               PV: tl.constexpr, IS_MAIN: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
               PREFETCH: tl.constexpr, DOT_F32: tl.constexpr):
    """One pass over the K rows of one list. PV=False: online (max m_i, Σp l_i). PV=True (m_i final):
    acc += bf16(exp(l - m_i)) kv. The slots of tile i+2 are loaded while tile i is processed (so a
    tile's record loads never wait on its slot load); PREFETCH also loads tile i+1's record words then
    (register double buffering: hides the gather latency, costs registers)."""
    offs = tl.arange(0, BLOCK_N)
    slot = tl.load(idx_ptr + offs, mask=offs < K, other=-1)
    slot_next = tl.load(idx_ptr + BLOCK_N + offs, mask=offs + BLOCK_N < K, other=-1)
    if PREFETCH:
        codes, scales = _fetch(pool_ptr, slot, IS_MAIN, D)
    for n0 in range(0, K, BLOCK_N):
        after = n0 + 2 * BLOCK_N + offs
        slot_after = tl.load(idx_ptr + after, mask=after < K, other=-1)
        if PREFETCH:
            codes_next, scales_next = _fetch(pool_ptr, slot_next, IS_MAIN, D)
        else:
            codes, scales = _fetch(pool_ptr, slot, IS_MAIN, D)
        kv = _dequant(codes, scales, IS_MAIN, D, BLOCK_N)
        s = masked_logits(q, kv, slot >= 0, scale, DOT_F32)
        if PV:
            p = round_bf16(tl.exp(s - m_i[:, None]))  # golden: bf16(p) with the final max
            if DOT_F32:
                acc = tl.dot(p, kv, acc, input_precision="ieee")
            else:
                acc = tl.dot(p.to(tl.bfloat16), kv.to(tl.bfloat16), acc)
        else:
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            l_i = l_i * tl.exp(m_i - m_new) + tl.sum(tl.exp(s - m_new[:, None]), axis=1)
            m_i = m_new
        slot, slot_next = slot_next, slot_after
        if PREFETCH:
            codes, scales = codes_next, scales_next
    return m_i, l_i, acc


@triton.jit
def _prefill_kernel(q_ptr, swa_ptr, swa_idx_ptr, main_ptr, main_idx_ptr, sink_ptr, o_ptr,
                    H, KW, KM, scale, n_hb,
                    D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, PREFETCH: tl.constexpr,
                    DOT_F32: tl.constexpr):
    """Program pid = m * n_hb + head block: the whole attention of BLOCK_H heads of query m.
    swa_ptr / main_ptr: the pools as int32 words."""
    pid = tl.program_id(0)
    m = (pid // n_hb).to(tl.int64)
    heads = (pid % n_hb) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, D)
    h_ok = heads < H
    row = m * H + heads  # [BH] int64 rows of q / o viewed as [M*H, D]
    q = tl.load(q_ptr + row[:, None] * D + d[None, :], mask=h_ok[:, None], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    swa_idx = swa_idx_ptr + m * KW
    main_idx = main_idx_ptr + m * KM

    seed = tl.full((BLOCK_H,), SINK_FREE_MAX, tl.float32)
    zero = tl.zeros((BLOCK_H,), tl.float32)
    m_w, l_w, _ = _list_pass(q, swa_ptr, swa_idx, KW, scale, seed, zero, zero,
                             False, False, D, BLOCK_N, PREFETCH, DOT_F32)
    m_m, l_m, _ = _list_pass(q, main_ptr, main_idx, KM, scale, seed, zero, zero,
                             False, True, D, BLOCK_N, PREFETCH, DOT_F32)
    m_i = tl.maximum(m_w, m_m)
    l_i = l_w * tl.exp(m_w - m_i) + l_m * tl.exp(m_m - m_i)  # the decode kernel's merge of two splits

    acc = tl.zeros((BLOCK_H, D), tl.float32)
    _, _, acc = _list_pass(q, swa_ptr, swa_idx, KW, scale, m_i, l_i, acc, True, False, D, BLOCK_N, PREFETCH, DOT_F32)
    _, _, acc = _list_pass(q, main_ptr, main_idx, KM, scale, m_i, l_i, acc, True, True, D, BLOCK_N, PREFETCH, DOT_F32)

    sink = tl.load(sink_ptr + heads, mask=h_ok, other=0.0)
    o = acc / (l_i + tl.exp(sink - m_i))[:, None]  # an all-invalid row: 0 / inf = 0
    u = o.to(tl.int32, bitcast=True)
    tl.store(o_ptr + row[:, None] * D + d[None, :], ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).to(tl.int16),
             mask=h_ok[:, None])


def _words(pool: Tensor) -> Tensor:
    """A pool of whole-word records as flat int32 words (records start on 4-byte boundaries)."""
    assert pool.data_ptr() % 16 == 0, "pool storage must be 16-byte aligned"
    return pool.view(-1).view(torch.int32)


def sparse_attn_prefill(q: Tensor, swa_pool: Tensor, swa_idx: Tensor, main_pool: Tensor, main_idx: Tensor,
                        sink: Tensor, scale: float, block_h: int | None = None, block_n: int = 32,
                        num_warps: int = 8, num_stages: int = 3, prefetch: bool = False) -> Tensor:
    """q bf16 [M, H, D]; swa_pool uint8 [..., D + D/32]; swa_idx int32 [M, KW] flat slots (-1 = none);
    main_pool uint8 [..., D/2 + D/16]; main_idx int32 [M, KM] (-1 = none); sink fp32 [H] -> bf16 [M, H, D].

    Same contract and result as `sparse_attn_paged` (slots must be < the pool's slot count, not checked);
    one launch of M * ceil(H / block_h) programs; D must be a multiple of 128. block_h defaults to
    min(64, H) rounded up to a power of two >= 16: at H = 64 one program holds all heads, so each record
    is dequantised once per pass. prefetch: load tile i+1's records while tile i is computed.
    """
    check_attn_args(q, swa_pool, swa_idx, main_pool, main_idx, sink)
    M, H, D = q.shape
    assert D % 128 == 0, f"head_dim {D}: records are read as int32 words, so D + D/32 must be a multiple of 4"
    block_h = block_h or min(64, max(16, triton.next_power_of_2(H)))
    assert block_h >= 16 and block_n >= 16, "tl.dot needs tiles of at least 16"
    assert block_h & (block_h - 1) == 0 and block_n & (block_n - 1) == 0, "block_h, block_n: powers of two"
    KW, KM = swa_idx.size(1), main_idx.size(1)
    if M == 0 or KW + KM == 0:
        return torch.zeros_like(q)
    out = torch.empty_like(q)
    n_hb = triton.cdiv(H, block_h)
    _prefill_kernel[(M * n_hb,)](q, _words(swa_pool), swa_idx, _words(main_pool), main_idx, sink,
                                 out.view(torch.int16), H, KW, KM, float(scale), n_hb, D=D, BLOCK_H=block_h,
                                 BLOCK_N=block_n, PREFETCH=prefetch, DOT_F32=not q.is_cuda, num_warps=num_warps,
                                 num_stages=num_stages)
    return out


def sparse_attn(q: Tensor, swa_pool: Tensor, swa_idx: Tensor, main_pool: Tensor, main_idx: Tensor,
                sink: Tensor, scale: float) -> Tensor:
    """Sparse MQA attention over the packed pools (arguments as `sparse_attn_prefill`): for M <= DECODE_MAX_M
    queries the one-launch CUDA decode kernel (engine/kernels/sparse_decode.py) where it applies (sm_90, D 512),
    else the Triton decode split kernel, also for a head_dim that is not a multiple of 128 (the tiny model's
    64: its SWA records are not word-aligned); the one-launch prefill kernel otherwise."""
    if q.size(0) <= DECODE_MAX_M and decode_applies(q, swa_pool, swa_idx, main_pool, main_idx, DECODE_MAX_M):
        return sparse_attn_decode(q, swa_pool, swa_idx, main_pool, main_idx, sink, scale)
    if q.size(0) <= DECODE_MAX_M or q.size(-1) % 128:
        return sparse_attn_paged(q, swa_pool, swa_idx, main_pool, main_idx, sink, scale)
    return sparse_attn_prefill(q, swa_pool, swa_idx, main_pool, main_idx, sink, scale)
