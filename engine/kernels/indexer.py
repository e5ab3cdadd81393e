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

A prefill chunk's queries (index_scores_rows): grid (entry tiles, groups of 32 queries); a program decodes its
tile once and scores it against its group 4 queries (128 MMA rows at H = 32) at a time, with the MMA as keys x
queries so that each query's head sum stays within a thread and its quad, and the roundings done by the GPU's
round-to-nearest-even casts (the same values as the integer form), two elements at a time by bf16x2 instructions
(_weighted_relu_packed). Measured on an H200 (benchmarks/RESULTS.md, 2026-12-07, twelfth session): the packed
epilogue 1.11-1.16x the single-element casts (4,745 us at 2,048 queries x 64K entries, 9,662 at 512 x 512K, 4,200 at
8,192 x 16K: 4.4x, 1.2x and 16x the looped decode scan); still bound by the epilogue (~30% of the bf16 MMA peak),
not by the MMA or HBM.

Interpreter (TRITON_INTERPRET=1): records are decoded with integer/fp32 bit operations, the dot takes
fp32 operands (the same exact products) and bf16 rounding is integer round-to-nearest-even.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from engine.kernels.cache_records import INDEX_K_BLOCK, fp4_record_bytes, unpack_index_k
from engine.kernels.triton_common import e2m1_to_fp32, round_bf16


# index_scores_rows' launch defaults, from benchmarks/kernels.py --only indexer_rows (H100 and H200, 2026-12-07): MMAs
# of 128 rows (4 queries x 32 heads at the real shape), 64-entry tiles, each tile's records decoded once for 64
# queries (3-8% faster than 32 on an H200; the GPU tests at real shapes passed at 16 and 64, 2026-12-07), 4 warps,
# the MMA as keys x queries, rounding by casts two elements at a time (packed).
ROWS_MMA_ROWS, ROWS_BLOCK_T, ROWS_QUERIES, ROWS_WARPS = 128, 64, 64, 4


@triton.jit
def _key_tile(pool_ptr, slot, t_ok, D: tl.constexpr, BLOCK_T: tl.constexpr):
    """The records at slot [BLOCK_T] (t_ok: which to read; the others are 0) decoded to fp32 [BLOCK_T, D]."""
    REC: tl.constexpr = D // 2 + D // 32
    rec = slot.to(tl.int64) * REC
    b = tl.load(pool_ptr + rec[:, None] + tl.arange(0, D // 2)[None, :], mask=t_ok[:, None], other=0)
    b = b.to(tl.int32)
    code = tl.interleave(b & 15, b >> 4)  # [BT, D]: even element in the low nibble
    s = tl.load(pool_ptr + rec[:, None] + D // 2 + tl.arange(0, D // 32)[None, :], mask=t_ok[:, None],
                other=0).to(tl.int32)
    k = tl.reshape(e2m1_to_fp32(code), (BLOCK_T, D // 32, 32)) * (s << 23).to(tl.float32, bitcast=True)[:, :, None]
    return tl.reshape(k, (BLOCK_T, D))


@triton.jit
def _scores_of(q, w, k, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr,
               DOT_F32: tl.constexpr, CAST_ROUND: tl.constexpr = False, PACKED: tl.constexpr = False):
    """Scores [BLOCK_M, BLOCK_T] of the queries q [BLOCK_M * BLOCK_H, D] (head weights w [BLOCK_M * BLOCK_H] fp32)
    against the keys k fp32 [BLOCK_T, D] (DOT_F32: an fp32 dot of fp32 q, the interpreter's; else bf16 operands,
    which hold MXFP4 values exactly, and an fp32-accumulating MMA). The roundings to bf16 are integer
    round-to-nearest-even, or with CAST_ROUND (GPU only: the interpreter's bf16 casts are not exact) the
    hardware's round-to-nearest-even casts: the same values (PACKED: two at a time, _weighted_relu_packed)."""
    if DOT_F32:
        sh = tl.dot(q, tl.trans(k), input_precision="ieee")  # [MH, BT]
    else:
        sh = tl.dot(q, tl.trans(k.to(tl.bfloat16)))
    p = _weighted_relu(sh, w[:, None], CAST_ROUND, PACKED)
    return _to_bf16(tl.sum(tl.reshape(p, (BLOCK_M, BLOCK_H, BLOCK_T)), axis=1), CAST_ROUND)  # [BM, BT]


@triton.jit
def _scores_of_t(q, w, k, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr,
                 DOT_F32: tl.constexpr, CAST_ROUND: tl.constexpr, PACKED: tl.constexpr = False):
    """_scores_of transposed: [BLOCK_T, BLOCK_M], from the MMA k [BLOCK_T, D] x q^T [D, BLOCK_M * BLOCK_H], so that
    a query's heads are columns of one accumulator row (the head sum stays within a thread and its quad)."""
    if DOT_F32:
        sh = tl.dot(k, tl.trans(q), input_precision="ieee")  # [BT, MH]
    else:
        sh = tl.dot(k.to(tl.bfloat16), tl.trans(q))
    p = _weighted_relu(sh, w[None, :], CAST_ROUND, PACKED)
    return _to_bf16(tl.sum(tl.reshape(p, (BLOCK_T, BLOCK_M, BLOCK_H)), axis=2), CAST_ROUND)  # [BT, BM]


@triton.jit
def _to_bf16(x, CAST_ROUND: tl.constexpr):
    """fp32 -> fp32 holding bf16(x), round to nearest even: the GPU's cast, or integer ops (round_bf16)."""
    if CAST_ROUND:
        return x.to(tl.bfloat16).to(tl.float32)
    return round_bf16(x)


@triton.jit
def _weighted_relu(s, w, CAST_ROUND: tl.constexpr, PACKED: tl.constexpr = False):
    """bf16(relu(bf16(s)) * w) in fp32, w fp32 holding bf16 values (the product is exact in fp32, then rounded).
    PACKED (sm_90 only): the same values two elements at a time, by _weighted_relu_packed."""
    if PACKED:
        return _weighted_relu_packed(s, w)
    return _to_bf16(tl.maximum(_to_bf16(s, CAST_ROUND), 0.0) * w, CAST_ROUND)


@triton.jit
def _weighted_relu_packed(s, w):
    """_weighted_relu by packed bf16x2 instructions, for two elements at a time: the fp32 pair rounded to bf16x2
    (cvt.rn: round to nearest even), relu (max.bf16x2 with +0), times w (mul.rn.bf16x2: the exact product rounded
    once to bf16, as the product of two bf16 values exact in fp32 then rounded), and back to two fp32 values (a bf16
    is an fp32's high half). In the sm_90 build of the rows kernel this removes every single-element F2F.BF16.F32
    (128 per thread per 64 x 128 MMA tile) for 48 more F2FP.PACK_AB and 32 each of HMNMX2 and HMUL2."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 sp, wp, z, r;
        mov.b32 z, 0;
        cvt.rn.bf16x2.f32 sp, $3, $2;
        cvt.rn.bf16x2.f32 wp, $5, $4;
        max.bf16x2 sp, sp, z;
        mul.rn.bf16x2 r, sp, wp;
        shl.b32 $0, r, 16;
        and.b32 $1, r, 0xffff0000;
        }""",
        constraints="=r,=r,r,r,r,r",
        args=[s.to(tl.int32, bitcast=True), tl.broadcast_to(w, s.shape).to(tl.int32, bitcast=True)],
        dtype=tl.int32, is_pure=True, pack=2).to(tl.float32, bitcast=True)


@triton.jit
def _tile_scores(q, w, pool_ptr, slot, t_ok, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr,
                 BLOCK_T: tl.constexpr, DOT_F32: tl.constexpr):
    """Scores [BLOCK_M, BLOCK_T] of the queries q [BLOCK_M * BLOCK_H, D] (head weights w [BLOCK_M * BLOCK_H] fp32)
    against the records at slot [BLOCK_T] (t_ok: which to read), before the visibility mask."""
    return _scores_of(q, w, _key_tile(pool_ptr, slot, t_ok, D, BLOCK_T), BLOCK_M, BLOCK_H, BLOCK_T, DOT_F32)


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


@triton.jit
def _index_scores_rows_kernel(q_ptr, w_ptr, pool_ptr, slot_ptr, vis_ptr, out_ptr, M, H, T,
                              D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr,
                              M_TILES: tl.constexpr, DOT_F32: tl.constexpr, CAST_ROUND: tl.constexpr,
                              TRANSPOSED: tl.constexpr, PACKED: tl.constexpr):
    """Program (entry tile, query group of M_TILES x BLOCK_M queries): the tile's records are decoded once and
    scored against each query tile in turn (one MMA [BLOCK_M * BLOCK_H, D] x [D, BLOCK_T] each); records no
    query of the group sees are not read, and a query tile that sees none of the tile only writes -inf."""
    MH: tl.constexpr = BLOCK_M * BLOCK_H
    t0 = tl.program_id(0) * BLOCK_T
    t = t0 + tl.arange(0, BLOCK_T)
    m_first = tl.program_id(1) * (M_TILES * BLOCK_M)
    group = m_first + tl.arange(0, M_TILES * BLOCK_M)
    group_vis = tl.max(tl.load(vis_ptr + group, mask=group < M, other=0))
    k = tl.zeros((BLOCK_T, D), tl.float32)
    if t0 < group_vis:
        t_ok = (t < group_vis) & (t < T)
        k = _key_tile(pool_ptr, tl.load(slot_ptr + t, mask=t_ok, other=0), t_ok, D, BLOCK_T)
    rows = tl.arange(0, MH)
    m_of, h_of = rows // BLOCK_H, rows % BLOCK_H
    dd = tl.arange(0, D)
    for i in range(M_TILES):
        mm = m_first + i * BLOCK_M + tl.arange(0, BLOCK_M)
        vis = tl.load(vis_ptr + mm, mask=mm < M, other=0)
        out = out_ptr + mm.to(tl.int64)[:, None] * T + t[None, :]  # [BM, BT]
        out_ok = (mm[:, None] < M) & (t[None, :] < T)
        if t0 < tl.max(vis):
            m = (m_first + i * BLOCK_M + m_of).to(tl.int64)
            row_ok = (m < M) & (h_of < H)
            q = tl.load(q_ptr + (m * H + h_of)[:, None] * D + dd[None, :], mask=row_ok[:, None], other=0.0)
            if DOT_F32:
                q = q.to(tl.float32)
            w = tl.load(w_ptr + m * H + h_of, mask=row_ok, other=0.0).to(tl.float32)
            if TRANSPOSED:
                score_t = _scores_of_t(q, w, k, BLOCK_M, BLOCK_H, BLOCK_T, DOT_F32, CAST_ROUND, PACKED)  # [BT, BM]
                score_t = tl.where(t[:, None] < vis[None, :], score_t, float("-inf"))
                tl.store(tl.trans(out), score_t.to(out_ptr.dtype.element_ty), mask=tl.trans(out_ok))
            else:
                score = _scores_of(q, w, k, BLOCK_M, BLOCK_H, BLOCK_T, DOT_F32, CAST_ROUND, PACKED)
                score = tl.where(t[None, :] < vis[:, None], score, float("-inf"))
                tl.store(out, score.to(out_ptr.dtype.element_ty), mask=out_ok)
        else:
            tl.store(out, tl.full((BLOCK_M, BLOCK_T), float("-inf"), tl.float32).to(out_ptr.dtype.element_ty),
                     mask=out_ok)


def _request_args(q: Tensor, w: Tensor, key_pool: Tensor, slots: Tensor, visible: Tensor) -> tuple[Tensor, int]:
    """index_scores' and index_scores_rows' contract (one request's queries and entries) -> (flat pool, T)."""
    M, H, D = q.shape
    assert q.dtype == torch.bfloat16 and w.dtype == torch.bfloat16 and w.shape == (M, H), (q.dtype, w.shape)
    assert D % INDEX_K_BLOCK == 0 and D & (D - 1) == 0, f"index_head_dim {D} must be a power of two >= 32"
    pool = key_pool.reshape(-1, key_pool.size(-1))
    assert pool.dtype == torch.uint8 and pool.size(-1) == fp4_record_bytes(D, INDEX_K_BLOCK) and pool.is_contiguous()
    assert slots.dim() == 1 and slots.dtype in (torch.int32, torch.int64)
    assert visible.shape == (M,)
    return pool, slots.numel()


def index_scores(q: Tensor, w: Tensor, key_pool: Tensor, slots: Tensor, visible: Tensor,
                 block_t: int = 64, num_warps: int = 8, programs_per_sm: int = 2) -> Tensor:
    """Indexer scores over packed MXFP4 key records.

    q bf16 [M, H, D] (MXFP4-QDQ values), w bf16 [M, H], key_pool uint8 [E, D/2 + D/32] (flat, or paged
    [blocks, block_size, rec] viewed flat), slots int32/int64 [T] (the request's entries in order),
    visible int [M] (entries visible per query) -> bf16 [M, T], -inf where t >= visible[m].
    """
    M, H, D = q.shape
    assert 1 <= M <= 16, f"M = {M}: the kernel keeps all M*H query rows in registers (decode shapes)"
    pool, T = _request_args(q, w, key_pool, slots, visible)
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


def index_scores_rows(q: Tensor, w: Tensor, key_pool: Tensor, slots: Tensor, visible: Tensor,
                      block_t: int = ROWS_BLOCK_T, queries_per_program: int = ROWS_QUERIES, num_warps: int = ROWS_WARPS,
                      cast_rounding: bool = True, transposed: bool = True, packed: bool = True) -> Tensor:
    """index_scores for many queries of one request (a prefill chunk's rows): the same arguments, result and
    rounding path, any M. Grid (entry tiles, query groups): each program decodes its tile of records once for
    queries_per_program queries, as MMAs of (128 / H) queries x H heads rows, so the key bytes are read
    M / queries_per_program times (from L2 mostly) and the work is the [M * H, D] x [D, T] product on tensor
    cores plus the exact-rounding epilogue on each of its M * H * T elements (CUDA cores; cast_rounding: its
    roundings by the GPU's casts, see _scores_of; packed: those casts, the relu and the product two elements at a time
    by bf16x2 instructions, from sm_90 (ignored on the CPU and older GPUs); transposed: the MMA as keys x queries,
    _scores_of_t). Entry tiles past every query's visible count are not read.
    Memory: the output, 2 * M * T bytes."""
    M, H, D = q.shape
    pool, T = _request_args(q, w, key_pool, slots, visible)
    out = torch.empty(M, T, dtype=torch.bfloat16, device=q.device)
    if T == 0 or M == 0:
        return out
    interp = q.device.type == "cpu"
    block_h = triton.next_power_of_2(H)
    block_m = max(1, (2 if interp else ROWS_MMA_ROWS) // block_h)  # the MMA's rows: block_m queries x block_h heads
    assert queries_per_program & (queries_per_program - 1) == 0, f"queries_per_program {queries_per_program}"
    m_tiles = max(1, min(queries_per_program // block_m, triton.next_power_of_2(triton.cdiv(M, block_m))))
    grid = (triton.cdiv(T, block_t), triton.cdiv(M, block_m * m_tiles))
    _index_scores_rows_kernel[grid](q.contiguous(), w.contiguous(), pool, slots.contiguous(),
                                    visible.to(torch.int32).contiguous(), out, M, H, T,
                                    D=D, BLOCK_M=block_m, BLOCK_H=block_h, BLOCK_T=block_t, M_TILES=m_tiles,
                                    DOT_F32=interp, CAST_ROUND=cast_rounding and not interp, TRANSPOSED=transposed,
                                    PACKED=packed and cast_rounding and not interp and _has_bf16x2_mul(q.device),
                                    num_warps=num_warps)
    return out


@functools.cache
def _has_bf16x2_mul(device: torch.device) -> bool:
    """mul.rn.bf16x2 (the packed epilogue) needs sm_90 or later."""
    return torch.cuda.get_device_capability(device) >= (9, 0)


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
