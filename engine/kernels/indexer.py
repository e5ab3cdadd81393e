"""Lightning-indexer scoring straight over the packed MXFP4 index-key records (engine.model.attention
Indexer.forward semantics, before the top-k).

For query m and entry t (record at key_pool[slots[t]]):

    s_h   = bf16(q[m, h] · k_t)                 (golden: float64 dot, then bf16)
    score = bf16(Σ_h bf16(relu(s_h) * w[m, h]))  (golden: bf16 product, float64 sum, then bf16)
    score = -inf where t >= visible[m]

k_t is decoded in registers from its 68 B record (E2M1 pairs, even element in the low nibble, then one
UE8M0 scale byte per 32). q and k are MXFP4 values (2 significant bits times a power of two), so every
product q_hd k_td is exact in fp32 and in a bf16 MMA with fp32 accumulation. Rounding path vs the
float64 golden: (1) the 128-term dot is accumulated in fp32 (exact unless the terms span > ~20 binary
orders), then rounded to bf16 with integer round-to-nearest-even; (2) relu(s_h) * w_h is a product of
two bf16 values, exact in fp32, rounded to bf16 as the golden does; (3) the H products are summed in
fp32 (the golden sums in float64; both are exact unless the terms span > ~16 binary orders), then
rounded to bf16. So the result is bitwise the golden's except when an fp32 sum is inexact and lands
next to a bf16 rounding boundary: then one bf16 ULP of that head's score or of the final score.

Launch: a persistent grid over tiles of BLOCK_T entries. Each program keeps all M*H query rows
([BLOCK_M * BLOCK_H, D], M <= 8 at decode) in registers and streams its tiles' records once, so the
key bytes are read from HBM exactly once for all queries: one MMA [M*H, D] x [D, BLOCK_T] per tile.
Memory traffic (the floor): T * (68 + slot bytes) + 2*M*H*D (q) + 2*M*H (w) + 2*M*T (out).
Measured on the H200 (benchmarks/RESULTS.md, 2026-11-30): bitwise equal to the golden, but 200-700 us
at T = 1M (3-9% of copy bandwidth): bound by the per-element fp32 decode of each [BLOCK_T, D] tile and
the exact-rounding epilogue on the [M*H, BLOCK_T] scores (CUDA-core work), not by HBM.

Interpreter (TRITON_INTERPRET=1): records are decoded with integer/fp32 bit operations, the dot takes
fp32 operands (the same exact products) and bf16 rounding is integer round-to-nearest-even.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from engine.kernels.cache_records import INDEX_K_BLOCK, fp4_record_bytes, unpack_index_k
from engine.kernels.triton_common import e2m1_to_fp32, round_bf16


@triton.jit
def _tile_scores(q, w, pool_ptr, slot, t_ok, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr,
                 BLOCK_T: tl.constexpr, DOT_F32: tl.constexpr):
    """Scores [BLOCK_M, BLOCK_T] of the queries q [BLOCK_M * BLOCK_H, D] (head weights w [BLOCK_M * BLOCK_H] fp32)
    against the records at slot [BLOCK_T] (t_ok: which to read), before the visibility mask."""
    REC: tl.constexpr = D // 2 + D // 32
    rec = slot.to(tl.int64) * REC
    b = tl.load(pool_ptr + rec[:, None] + tl.arange(0, D // 2)[None, :], mask=t_ok[:, None], other=0)
    b = b.to(tl.int32)
    code = tl.interleave(b & 15, b >> 4)  # [BT, D]: even element in the low nibble
    s = tl.load(pool_ptr + rec[:, None] + D // 2 + tl.arange(0, D // 32)[None, :], mask=t_ok[:, None],
                other=0).to(tl.int32)
    k = tl.reshape(e2m1_to_fp32(code), (BLOCK_T, D // 32, 32)) * (s << 23).to(tl.float32, bitcast=True)[:, :, None]
    k = tl.reshape(k, (BLOCK_T, D))
    if DOT_F32:
        sh = tl.dot(q, tl.trans(k), input_precision="ieee")  # [MH, BT]
    else:
        sh = tl.dot(q, tl.trans(k.to(tl.bfloat16)))
    p = round_bf16(round_bf16(tl.maximum(round_bf16(sh), 0.0)) * w[:, None])  # bf16(relu(bf16 s) * w)
    return round_bf16(tl.sum(tl.reshape(p, (BLOCK_M, BLOCK_H, BLOCK_T)), axis=1))  # [BM, BT]


@triton.jit
def _index_scores_kernel(q_ptr, w_ptr, pool_ptr, slot_ptr, vis_ptr, out_ptr, M, H, T, num_tiles,
                         D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr,
                         DOT_F32: tl.constexpr):
    MH: tl.constexpr = BLOCK_M * BLOCK_H
    rows = tl.arange(0, MH)
    m_of, h_of = rows // BLOCK_H, rows % BLOCK_H
    row_ok = (m_of < M) & (h_of < H)
    dd = tl.arange(0, D)
    q = tl.load(q_ptr + (m_of * H + h_of)[:, None] * D + dd[None, :], mask=row_ok[:, None], other=0.0)
    w = tl.load(w_ptr + m_of * H + h_of, mask=row_ok, other=0.0).to(tl.float32)  # [MH]
    if DOT_F32:
        q = q.to(tl.float32)
    mm = tl.arange(0, BLOCK_M)
    vis = tl.load(vis_ptr + mm, mask=mm < M, other=0)  # [BLOCK_M]
    t_next = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    slot_next = tl.load(slot_ptr + t_next, mask=t_next < T, other=0)
    for tile in range(tl.program_id(0), num_tiles, tl.num_programs(0)):
        t = tile * BLOCK_T + tl.arange(0, BLOCK_T)
        t_ok = t < T
        slot = slot_next
        t_next = t + tl.num_programs(0) * BLOCK_T  # prefetch the next tile's slots: one round trip per tile
        slot_next = tl.load(slot_ptr + t_next, mask=t_next < T, other=0)
        score = _tile_scores(q, w, pool_ptr, slot, t_ok, D, BLOCK_M, BLOCK_H, BLOCK_T, DOT_F32)
        score = tl.where(t[None, :] < vis[:, None], score, float("-inf"))
        tl.store(out_ptr + mm[:, None] * T + t[None, :], score.to(out_ptr.dtype.element_ty),
                 mask=(mm[:, None] < M) & t_ok[None, :])


@triton.jit
def _index_scores_batched_kernel(q_ptr, w_ptr, pool_ptr, ent_ptr, vis_ptr, out_ptr, H, T,
                              D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr, DOT_F32: tl.constexpr):
    """Program (tile, row): one query row against its own entries ent[row, :]; tiles past the row's visible
    entries only write -inf (no record is read)."""
    row = tl.program_id(1).to(tl.int64)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    vis = tl.load(vis_ptr + row)
    out = out_ptr + row * T + t
    if tl.program_id(0) * BLOCK_T < vis:
        h = tl.arange(0, BLOCK_H)
        h_ok = h < H
        q = tl.load(q_ptr + (row * H + h)[:, None] * D + tl.arange(0, D)[None, :], mask=h_ok[:, None], other=0.0)
        if DOT_F32:
            q = q.to(tl.float32)
        w = tl.load(w_ptr + row * H + h, mask=h_ok, other=0.0).to(tl.float32)
        t_ok = t < vis
        slot = tl.load(ent_ptr + row * T + t, mask=t_ok, other=0)
        score = tl.reshape(_tile_scores(q, w, pool_ptr, slot, t_ok, D, 1, BLOCK_H, BLOCK_T, DOT_F32), (BLOCK_T,))
        tl.store(out, tl.where(t_ok, score, float("-inf")).to(out_ptr.dtype.element_ty), mask=t < T)
    else:
        tl.store(out, tl.full((BLOCK_T,), float("-inf"), tl.float32).to(out_ptr.dtype.element_ty), mask=t < T)


def index_scores(q: Tensor, w: Tensor, key_pool: Tensor, slots: Tensor, visible: Tensor,
                 block_t: int = 64, num_warps: int = 8, programs_per_sm: int = 2) -> Tensor:
    """Indexer scores over packed MXFP4 key records.

    q bf16 [M, H, D] (MXFP4-QDQ values), w bf16 [M, H], key_pool uint8 [E, D/2 + D/32] (flat, or paged
    [blocks, block_size, rec] viewed flat), slots int32/int64 [T] (the request's entries in order),
    visible int [M] (entries visible per query) -> bf16 [M, T], -inf where t >= visible[m].
    """
    M, H, D = q.shape
    assert q.dtype == torch.bfloat16 and w.dtype == torch.bfloat16 and w.shape == (M, H), (q.dtype, w.shape)
    assert D % INDEX_K_BLOCK == 0 and D & (D - 1) == 0, f"index_head_dim {D} must be a power of two >= 32"
    assert 1 <= M <= 16, f"M = {M}: the kernel keeps all M*H query rows in registers (decode shapes)"
    pool = key_pool.reshape(-1, key_pool.size(-1))
    assert pool.dtype == torch.uint8 and pool.size(-1) == fp4_record_bytes(D, INDEX_K_BLOCK) and pool.is_contiguous()
    assert slots.dim() == 1 and slots.dtype in (torch.int32, torch.int64)
    assert visible.shape == (M,)
    T = slots.numel()
    out = torch.empty(M, T, dtype=torch.bfloat16, device=q.device)
    if T == 0:
        return out
    interp = q.device.type == "cpu"
    block_h = max(triton.next_power_of_2(H), 1 if interp else 16)
    block_m = triton.next_power_of_2(M)
    if not interp:
        block_m = max(block_m, 16 // block_h) if block_h < 16 else block_m
    num_tiles = triton.cdiv(T, block_t)
    if interp:
        grid = (1,)  # one program walks every tile: exercises the persistent loop and the slot prefetch
    else:
        grid = (min(num_tiles, programs_per_sm * torch.cuda.get_device_properties(q.device).multi_processor_count),)
    _index_scores_kernel[grid](q.contiguous(), w.contiguous(), pool, slots.contiguous(),
                               visible.to(torch.int32).contiguous(), out, M, H, T, num_tiles,
                               D=D, BLOCK_M=block_m, BLOCK_H=block_h, BLOCK_T=block_t, DOT_F32=interp,
                               num_warps=num_warps)
    return out


def index_scores_ref(q: Tensor, w: Tensor, key_pool: Tensor, slots: Tensor, visible: Tensor) -> Tensor:
    """Golden Indexer math (float64 dots and head sum, bf16 roundings) on the unpacked records."""
    D = q.size(-1)
    pool = key_pool.reshape(-1, key_pool.size(-1))
    k = unpack_index_k(pool[slots.long()], D)  # bf16 [T, D]
    score = torch.einsum("mhd,td->mht", q.double(), k.double()).to(q.dtype)  # bf16 [M, H, T]
    score = (score.relu() * w.unsqueeze(-1)).double().sum(dim=1).to(q.dtype)  # [M, T]
    t = torch.arange(k.size(0), device=q.device)
    return score.masked_fill(t >= visible.to(q.device).unsqueeze(-1), float("-inf"))


def index_scores_batched(q: Tensor, w: Tensor, key_pool: Tensor, entries: Tensor, visible: Tensor,
                      block_t: int = 64, num_warps: int = 4) -> Tensor:
    """index_scores for B rows of different requests (the batched decode step): row b's query scores its
    own entries. q bf16 [B, H, D], w bf16 [B, H], entries int32/int64 [B, T] (flat slots; entries at or past
    visible[b] are never read, so they may hold anything), visible int [B] -> bf16 [B, T], -inf where
    t >= visible[b]. Rounding as index_scores (bitwise the same scores for the same row)."""
    B, H, D = q.shape
    assert q.dtype == torch.bfloat16 and w.dtype == torch.bfloat16 and w.shape == (B, H), (q.dtype, w.shape)
    assert D % INDEX_K_BLOCK == 0 and D & (D - 1) == 0, f"index_head_dim {D} must be a power of two >= 32"
    pool = key_pool.reshape(-1, key_pool.size(-1))
    assert pool.dtype == torch.uint8 and pool.size(-1) == fp4_record_bytes(D, INDEX_K_BLOCK) and pool.is_contiguous()
    assert entries.dim() == 2 and entries.size(0) == B and entries.dtype in (torch.int32, torch.int64)
    assert visible.shape == (B,)
    T = entries.size(1)
    out = torch.empty(B, T, dtype=torch.bfloat16, device=q.device)
    if T == 0 or B == 0:
        return out
    interp = q.device.type == "cpu"
    block_h = max(triton.next_power_of_2(H), 1 if interp else 16)
    _index_scores_batched_kernel[(triton.cdiv(T, block_t), B)](
        q.contiguous(), w.contiguous(), pool, entries.contiguous(), visible.to(torch.int32).contiguous(), out, H, T,
        D=D, BLOCK_H=block_h, BLOCK_T=block_t, DOT_F32=interp, num_warps=num_warps)
    return out
