"""The indexer's exact top-k and candidate-block selection (engine.model.attention: the end of
Indexer.forward, stable_topk, select_candidate_blocks), bitwise equal to the golden, ties included.

Order. Each bf16 score s (after the masks) gets a 16-bit key u(s), strictly increasing in s:

    b = bits(s);  -0 -> +0;  any NaN -> 0x7FC0      (torch.sort: -0 == +0, NaN above +inf, NaNs tie)
    u = b | 0x8000 if b < 0x8000 else 0xFFFF - b    (-inf -> 0x007F, +0 -> 0x8000, +inf -> 0xFF80)

The golden's order is "larger u first, and among equal u the lower index first" (stable descending
sort). So the top kk = min(k, T) of a row are: every entry with u > thr, plus the `need` lowest-index
entries with u == thr, where thr is the kk-th largest u and need = kk - #{u > thr} >= 1. Picks are
returned in position order with -1 where the picked score is -inf (or NaN), as the golden does.

Selection (radix select on the 16-bit key, then a stream compaction in index order; no sort):
  1. hist_hi: 256-bin histogram of u >> 8 per row (tl.histogram per chunk, integer atomics to [M, 256]).
  2. hist_lo: from hist_hi, the high byte of thr and #{hi > thr_hi}; 256-bin histogram of u & 255 over
     the entries whose high byte is thr_hi.
  3. count:   from both histograms, thr and need; per chunk #{u > thr} and #{u == thr} -> [M, chunks, 2].
  4. write:   per chunk, the counts of the earlier chunks give the output offset; an in-chunk prefix sum
     places each pick (ids), or marks it (block mask).
Every pass reads the scores once (2 B per entry; the candidate mask adds 1 B per entry, or 1 B per
block in the block form), so the floor is 2·M·T bytes and the kernels read ~4x that (from L2 when the
scores fit: 12 MB at M = 6, T = 1M) plus 4·M·kk bytes of ids. Integer atomics only: deterministic.
Launches: a memset of the [M, 512] histograms and the 4 kernels, grid (chunks, M). Rows of at most
row_max_t entries (default ROW_MAX_T) instead take one program per row that runs passes 1, 2 and a
fused 3+4 (running counts) over its row: one launch, 3 reads of the row, no atomics.

candidate_block_mask: one pass computes the block-max key per block of `block` entries (key max ==
key of the max; padding is -inf), forces the block of each query's newest visible entry to +inf,
then the same selection over the [M, nb] block keys (int32) marks the kept blocks: top
min(topk_blocks, nb) with the same tie rule, and only blocks whose max is > -inf.

index_topk(method="keys") is the simpler alternative: unique int64 keys u << 32 | (2^32 - 1 - t),
torch.topk on them (unique keys: no tie ambiguity), then a sort of the ids. Kept for the benchmark.

Interpreter (TRITON_INTERPRET=1): scores are loaded as int16 bits and only integer ops are used, so
the interpreter's bf16 bugs do not apply; the same code runs on the GPU.
"""

from __future__ import annotations

from typing import Literal

import torch
import triton
import triton.language as tl
from torch import Tensor

from engine.model.attention import select_candidate_blocks, stable_topk

U_NEG_INF = 0x007F  # u(-inf)
U_POS_INF = 0xFF80  # u(+inf)
U_NAN = 0xFFC0  # u(NaN), every NaN canonicalised to 0x7FC0
# Launch defaults from the H200 sweep (benchmarks/kernel_benches/topk.py, 2026-11-30): top-512 over 16K-128K
# entries was fastest as the multi-program form with 1024-entry chunks (12.7-24.7 us vs 37.8 with 4096-entry
# chunks and one program per row); candidate blocks (2048-16K blocks) with 1024-entry chunks, one program per
# row up to a few thousand blocks.
CHUNK = 1024
# index_topk over many scores (M x T >= 2^19: T = 1M at M = 1 and 6, T = 128K at M = 6) was fastest with 2048-entry
# chunks of 4 warps (H200, 2026-11-30, eighth pass: T = 1M, M = 6 147.9 -> 106.4 us; M = 1 33.8 -> 30.1 us).
BIG_SCORES, BIG_CHUNK, BIG_WARPS = 1 << 19, 2048, 4
ROW_MAX_T = 0  # index_topk: rows up to this length use one program per row (0: never)
BLOCK_ROW_MAX_T = 4096  # candidate_block_mask: rows of up to this many blocks use one program per row
_K_NEG_INF: tl.constexpr = tl.constexpr(U_NEG_INF)
_K_POS_INF: tl.constexpr = tl.constexpr(U_POS_INF)
_K_NAN: tl.constexpr = tl.constexpr(U_NAN)


@triton.jit
def _order_key(b):
    """bf16 bits (int32 holding 0..0xFFFF) -> order-preserving 16-bit key (int32)."""
    b = tl.where(b == 0x8000, 0, b)  # -0 ties with +0
    b = tl.where((b & 0x7FFF) > 0x7F80, 0x7FC0, b)  # all NaNs tie, above +inf
    return tl.where(b >= 0x8000, 0xFFFF - b, b | 0x8000)


@triton.jit
def _load_keys(src_ptr, cand_ptr, row, idx, T, NC, SRC_KEYS: tl.constexpr, CAND: tl.constexpr,
               CBLOCK: tl.constexpr):
    """Keys of entries idx of `row` and their validity (idx < T).

    SRC_KEYS: src is int32 keys [M, T]; else int16 bf16 bits [M, T]. CAND: 0 none, 1 uint8 mask
    [M, NC] over blocks of CBLOCK entries (NC = ceil(T / CBLOCK)); entries outside it score -inf."""
    valid = idx < T
    off = row.to(tl.int64) * T + idx
    if SRC_KEYS:
        u = tl.load(src_ptr + off, mask=valid, other=0)
    else:
        b = tl.load(src_ptr + off, mask=valid, other=0).to(tl.int32) & 0xFFFF
        if CAND:
            c = tl.load(cand_ptr + row.to(tl.int64) * NC + idx // CBLOCK, mask=valid, other=0)
            b = tl.where(c != 0, b, 0xFF80)
        u = _order_key(b)
    return u, valid


@triton.jit
def _level(h, kk):
    """From a 256-bin histogram h: the largest bin b with #{bin >= b} >= kk, and #{bin > b}."""
    ge = tl.sum(h, 0) - tl.cumsum(h, 0) + h  # #{bin >= b}
    b = tl.sum((ge >= kk).to(tl.int32), 0) - 1
    gt = tl.sum(tl.where(tl.arange(0, 256) > b, h, 0), 0)
    return b, gt


@triton.jit
def _threshold(hist_ptr, kk):
    """thr = the kk-th largest key of the row, need = how many entries equal to thr are picked."""
    hi, gt_hi = _level(tl.load(hist_ptr + tl.arange(0, 256)), kk)
    lo, gt_lo = _level(tl.load(hist_ptr + 256 + tl.arange(0, 256)), kk - gt_hi)
    return hi * 256 + lo, kk - gt_hi - gt_lo


@triton.jit
def _pick(u, valid, thr, need, eq_before):
    """Picks of a chunk given #{u == thr} in earlier chunks; also returns this chunk's #{u == thr}."""
    eq = (valid & (u == thr)).to(tl.int32)
    eq_rank = eq_before + tl.cumsum(eq, 0) - eq  # among equal keys, lower index first
    pick = (valid & (u > thr)) | ((eq != 0) & (eq_rank < need))
    return pick, tl.sum(eq, 0)


@triton.jit
def _emit(out_ptr, row, idx, u, valid, pick, sel_before, T, kk, OUT_MASK: tl.constexpr):
    """OUT_MASK: out uint8 [M, T], 1 where picked and > -inf. Else out int32 [M, kk]: picks in position
    order (sel_before picks precede this chunk), -1 where the picked score is -inf / NaN."""
    finite = (u != _K_NEG_INF) & (u != _K_NAN)
    if OUT_MASK:
        tl.store(out_ptr + row.to(tl.int64) * T + idx, (pick & finite).to(tl.uint8), mask=valid)
    else:
        p = pick.to(tl.int32)
        pos = sel_before + tl.cumsum(p, 0) - p
        tl.store(out_ptr + row.to(tl.int64) * kk + pos, tl.where(finite, idx, -1), mask=pick)


@triton.jit
def _hist_hi_kernel(src_ptr, cand_ptr, hist_ptr, T, NC, SRC_KEYS: tl.constexpr, CAND: tl.constexpr,
                    CBLOCK: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(1)
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    u, valid = _load_keys(src_ptr, cand_ptr, row, idx, T, NC, SRC_KEYS, CAND, CBLOCK)
    h = tl.histogram(u >> 8, 256, mask=valid)
    tl.atomic_add(hist_ptr + row * 512 + tl.arange(0, 256), h, mask=h > 0)


@triton.jit
def _hist_lo_kernel(src_ptr, cand_ptr, hist_ptr, T, NC, kk, SRC_KEYS: tl.constexpr, CAND: tl.constexpr,
                    CBLOCK: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(1)
    hi, _ = _level(tl.load(hist_ptr + row * 512 + tl.arange(0, 256)), kk)
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    u, valid = _load_keys(src_ptr, cand_ptr, row, idx, T, NC, SRC_KEYS, CAND, CBLOCK)
    h = tl.histogram(u & 255, 256, mask=valid & ((u >> 8) == hi))
    tl.atomic_add(hist_ptr + row * 512 + 256 + tl.arange(0, 256), h, mask=h > 0)


@triton.jit
def _count_kernel(src_ptr, cand_ptr, hist_ptr, cnt_ptr, T, NC, kk, SRC_KEYS: tl.constexpr, CAND: tl.constexpr,
                  CBLOCK: tl.constexpr, BLOCK: tl.constexpr):
    row, chunk = tl.program_id(1), tl.program_id(0)
    thr, _ = _threshold(hist_ptr + row * 512, kk)
    idx = chunk * BLOCK + tl.arange(0, BLOCK)
    u, valid = _load_keys(src_ptr, cand_ptr, row, idx, T, NC, SRC_KEYS, CAND, CBLOCK)
    n_gt = tl.sum((valid & (u > thr)).to(tl.int32), 0)
    n_eq = tl.sum((valid & (u == thr)).to(tl.int32), 0)
    base = cnt_ptr + (row * tl.num_programs(0) + chunk) * 2
    tl.store(base, n_gt)
    tl.store(base + 1, n_eq)


@triton.jit
def _write_kernel(src_ptr, cand_ptr, hist_ptr, cnt_ptr, out_ptr, T, NC, kk, SRC_KEYS: tl.constexpr,
                  CAND: tl.constexpr, CBLOCK: tl.constexpr, BLOCK: tl.constexpr, CHUNKS_P2: tl.constexpr,
                  OUT_MASK: tl.constexpr):
    row, chunk = tl.program_id(1), tl.program_id(0)
    thr, need = _threshold(hist_ptr + row * 512, kk)
    prev = tl.arange(0, CHUNKS_P2)
    cbase = cnt_ptr + (row * tl.num_programs(0) + prev) * 2
    gt_before = tl.sum(tl.load(cbase, mask=prev < chunk, other=0), 0)
    eq_before = tl.sum(tl.load(cbase + 1, mask=prev < chunk, other=0), 0)
    idx = chunk * BLOCK + tl.arange(0, BLOCK)
    u, valid = _load_keys(src_ptr, cand_ptr, row, idx, T, NC, SRC_KEYS, CAND, CBLOCK)
    pick, _ = _pick(u, valid, thr, need, eq_before)
    _emit(out_ptr, row, idx, u, valid, pick, gt_before + tl.minimum(eq_before, need), T, kk, OUT_MASK)


@triton.jit
def _select_row_kernel(src_ptr, cand_ptr, out_ptr, T, NC, kk, SRC_KEYS: tl.constexpr, CAND: tl.constexpr,
                       CBLOCK: tl.constexpr, BLOCK: tl.constexpr, OUT_MASK: tl.constexpr):
    """Passes 1-4 in one program per row (short rows: one launch, histograms in registers, running
    counts instead of the count pass)."""
    row = tl.program_id(0)
    h = tl.zeros([256], dtype=tl.int32)
    for start in range(0, T, BLOCK):
        u, valid = _load_keys(src_ptr, cand_ptr, row, start + tl.arange(0, BLOCK), T, NC, SRC_KEYS, CAND, CBLOCK)
        h += tl.histogram(u >> 8, 256, mask=valid)
    hi, gt_hi = _level(h, kk)
    h = tl.zeros([256], dtype=tl.int32)
    for start in range(0, T, BLOCK):
        u, valid = _load_keys(src_ptr, cand_ptr, row, start + tl.arange(0, BLOCK), T, NC, SRC_KEYS, CAND, CBLOCK)
        h += tl.histogram(u & 255, 256, mask=valid & ((u >> 8) == hi))
    lo, gt_lo = _level(h, kk - gt_hi)
    thr, need = hi * 256 + lo, kk - gt_hi - gt_lo
    n_sel = tl.zeros([], dtype=tl.int32)
    n_eq = tl.zeros([], dtype=tl.int32)
    for start in range(0, T, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        u, valid = _load_keys(src_ptr, cand_ptr, row, idx, T, NC, SRC_KEYS, CAND, CBLOCK)
        pick, c_eq = _pick(u, valid, thr, need, n_eq)
        _emit(out_ptr, row, idx, u, valid, pick, n_sel, T, kk, OUT_MASK)
        n_sel += tl.sum(pick.to(tl.int32), 0)
        n_eq += c_eq


@triton.jit
def _keys_kernel(src_ptr, cand_ptr, out_ptr, T, NC, CAND: tl.constexpr, CBLOCK: tl.constexpr, BLOCK: tl.constexpr):
    """Unique int64 keys u << 32 | (2^32 - 1 - t) for torch.topk."""
    row = tl.program_id(1)
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    u, valid = _load_keys(src_ptr, cand_ptr, row, idx, T, NC, False, CAND, CBLOCK)
    key = ((u.to(tl.int64) + 1) << 32) - 1 - idx.to(tl.int64)
    tl.store(out_ptr + row.to(tl.int64) * T + idx, key, mask=valid)


@triton.jit
def _block_keys_kernel(src_ptr, vis_ptr, out_ptr, T, NB, BLOCK_B: tl.constexpr, CBLOCK: tl.constexpr,
                       CBLOCK_P2: tl.constexpr):
    """Block-max keys [M, NB] int32 (padding is -inf); the newest visible entry's block -> +inf."""
    row = tl.program_id(1)
    blk = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    j = tl.arange(0, CBLOCK_P2)
    idx = blk[:, None] * CBLOCK + j[None, :]
    ok = (idx < T) & (j[None, :] < CBLOCK)
    b = tl.load(src_ptr + row.to(tl.int64) * T + idx, mask=ok, other=0).to(tl.int32) & 0xFFFF
    u = tl.max(tl.where(ok, _order_key(b), _K_NEG_INF), 1)  # [BLOCK_B]
    vis = tl.load(vis_ptr + row)
    newest = tl.where(vis > 0, (vis - 1) // CBLOCK, -1)  # golden: floor((vis - 1) / block)
    u = tl.where(blk == newest, _K_POS_INF, u)
    tl.store(out_ptr + row.to(tl.int64) * NB + blk, u, mask=blk < NB)


def _select(src: Tensor, cand: Tensor | None, cblock: int, kk: int, out: Tensor, src_keys: bool, block: int,
            num_warps: int, row_max_t: int) -> None:
    """Launch passes 1-4 over src [M, T] (int16 bf16 bits, or int32 keys); writes out. Rows of at most
    row_max_t entries take the one-program-per-row kernel."""
    M, T = src.shape
    chunks = triton.cdiv(T, block)
    c = cand if cand is not None else src  # unused pointer when CAND is off
    nc = cand.size(1) if cand is not None else 1
    if T <= row_max_t:
        _select_row_kernel[(M,)](src, c, out, T, nc, kk, SRC_KEYS=src_keys, CAND=cand is not None, CBLOCK=cblock,
                                 BLOCK=block, OUT_MASK=out.dtype == torch.uint8, num_warps=num_warps)
        return
    assert M < 65536, f"M = {M}: grid dim 1 is the row (split the rows, or raise row_max_t)"
    hist = torch.zeros(M, 512, dtype=torch.int32, device=src.device)
    cnt = torch.empty(M, chunks, 2, dtype=torch.int32, device=src.device)
    meta = dict(SRC_KEYS=src_keys, CAND=cand is not None, CBLOCK=cblock, BLOCK=block, num_warps=num_warps)
    grid = (chunks, M)
    _hist_hi_kernel[grid](src, c, hist, T, nc, **meta)
    _hist_lo_kernel[grid](src, c, hist, T, nc, kk, **meta)
    _count_kernel[grid](src, c, hist, cnt, T, nc, kk, **meta)
    _write_kernel[grid](src, c, hist, cnt, out, T, nc, kk, CHUNKS_P2=triton.next_power_of_2(chunks),
                        OUT_MASK=out.dtype == torch.uint8, **meta)


def _check_candidates(candidates: Tensor | None, M: int, T: int, block: int) -> Tensor | None:
    if candidates is None:
        return None
    assert block >= 1 and candidates.dtype == torch.bool, (block, candidates.dtype)
    assert candidates.shape == (M, triton.cdiv(T, block)), (tuple(candidates.shape), M, T, block)
    return candidates.contiguous().view(torch.uint8)


def index_topk(score: Tensor, k: int, candidates: Tensor | None = None, block: int = 1,
               method: Literal["radix", "keys"] = "radix", chunk: int | None = None, num_warps: int | None = None,
               row_max_t: int = ROW_MAX_T) -> Tensor:
    """Top min(k, T) entries per row, ties to the lower index, in position order, -1 where -inf.

    score bf16 [M, T] (invisible entries already -inf); candidates bool [M, ceil(T / block)] or None:
    entries t with candidates[m, t // block] False score -inf first (block = 1: a per-entry mask
    [M, T]; block = candidate_block_size: candidate_block_mask's output). -> int32 [M, min(k, T)].
    chunk / num_warps None: the measured defaults for the score count (CHUNK and 8 warps, or BIG_CHUNK and
    BIG_WARPS from BIG_SCORES scores on).
    """
    assert score.dim() == 2 and score.dtype == torch.bfloat16, (score.shape, score.dtype)
    big = score.numel() >= BIG_SCORES
    chunk = chunk if chunk is not None else (BIG_CHUNK if big else CHUNK)
    num_warps = num_warps if num_warps is not None else (BIG_WARPS if big else 8)
    assert k >= 1 and chunk >= 16 and chunk & (chunk - 1) == 0, (k, chunk)
    M, T = score.shape
    kk = min(k, T)
    out = torch.empty(M, kk, dtype=torch.int32, device=score.device)
    if M == 0 or kk == 0:
        return out
    assert T < 2**31 - chunk
    cand = _check_candidates(candidates, M, T, block)
    bits = score.contiguous().view(torch.int16)
    if method == "radix":
        _select(bits, cand, block, kk, out, False, chunk, num_warps, row_max_t)
        return out
    assert method == "keys", method
    keys = torch.empty(M, T, dtype=torch.int64, device=score.device)
    _keys_kernel[(triton.cdiv(T, chunk), M)](bits, cand if cand is not None else bits, keys, T,
                                             cand.size(1) if cand is not None else 1, CAND=cand is not None,
                                             CBLOCK=block, BLOCK=chunk, num_warps=num_warps)
    top = torch.topk(keys, kk, dim=-1, sorted=False).values  # unique keys: an exact set
    ids, order = (0xFFFFFFFF - (top & 0xFFFFFFFF)).sort(dim=-1)
    u = (top >> 32).gather(-1, order)
    return torch.where((u != U_NEG_INF) & (u != U_NAN), ids, -1).to(torch.int32)


def candidate_block_mask(score: Tensor, visible: Tensor, topk_blocks: int, block: int, chunk: int = CHUNK,
                         num_warps: int = 8, row_max_t: int = BLOCK_ROW_MAX_T) -> Tensor:
    """Level one of the two-level top-k, block form: score bf16 [M, T] (invisible already -inf), visible
    int [M] -> bool [M, ceil(T / block)], True for the min(topk_blocks, nb) best blocks by block max
    (the newest visible entry's block forced in; ties to the lower block) whose max is > -inf."""
    assert score.dim() == 2 and score.dtype == torch.bfloat16, (score.shape, score.dtype)
    assert topk_blocks >= 1 and block >= 1 and chunk >= 16 and chunk & (chunk - 1) == 0, (topk_blocks, block, chunk)
    M, T = score.shape
    assert visible.shape == (M,), (tuple(visible.shape), M)
    nb = triton.cdiv(T, block)
    out = torch.empty(M, nb, dtype=torch.uint8, device=score.device)
    if M == 0 or nb == 0:
        return out.view(torch.bool)
    keys = torch.empty(M, nb, dtype=torch.int32, device=score.device)
    block_b = max(1, 1024 // triton.next_power_of_2(block))
    _block_keys_kernel[(triton.cdiv(nb, block_b), M)](score.contiguous().view(torch.int16),
                                                       visible.to(device=score.device, dtype=torch.int32).contiguous(),
                                                       keys, T, nb, BLOCK_B=block_b, CBLOCK=block,
                                                       CBLOCK_P2=triton.next_power_of_2(block), num_warps=4)
    _select(keys, None, 1, min(topk_blocks, nb), out, True, chunk, num_warps, row_max_t)
    return out.view(torch.bool)


def candidate_blocks(score: Tensor, visible: Tensor, topk_blocks: int, block: int, chunk: int = CHUNK,
                     num_warps: int = 8, row_max_t: int = BLOCK_ROW_MAX_T) -> Tensor:
    """select_candidate_blocks for one batch row: score bf16 [M, T], visible int [M] -> bool [M, T]."""
    mask = candidate_block_mask(score, visible, topk_blocks, block, chunk, num_warps, row_max_t)
    T = score.size(1)
    return mask.unsqueeze(-1).expand(*mask.shape, block).reshape(mask.size(0), mask.size(1) * block)[:, :T]


@triton.jit
def _entry_slots_kernel(ids_ptr, entries_ptr, out_ptr, K, W, entries_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK)
    ids = tl.load(ids_ptr + row * K + j, mask=j < K, other=-1)
    ok = ids >= 0
    slot = tl.load(entries_ptr + row * entries_stride + tl.where(ok, ids, 0), mask=ok, other=-1)
    tl.store(out_ptr + row * W + j, tl.where(ok, slot, -1), mask=j < W)


def entry_slots(ids: Tensor, entries: Tensor, out: Tensor) -> None:
    """out int32 [m, W] (contiguous) = entries[ids] where ids >= 0, else -1; columns >= K are -1 too.
    ids int32/int64 [m, K] (K <= W) of a request's top-k (-1 = none), entries int32 [E] (its slots), or
    [m, E] (row i's own entries: the batched decode step's rows of different requests). One launch for
    torch's clamp, gather, compare, where and slice copy."""
    m, k = ids.shape
    assert out.dim() == 2 and out.size(0) == m and out.size(1) >= k and out.dtype == torch.int32, (
        f"out {out.dtype} {tuple(out.shape)} for ids {tuple(ids.shape)}")
    assert out.is_contiguous() and ids.is_contiguous() and entries.dtype == torch.int32, "contiguous, int32 entries"
    assert ids.dtype in (torch.int32, torch.int64) and ids.device == entries.device == out.device
    assert entries.dim() == 1 or (entries.dim() == 2 and entries.size(0) == m and entries.is_contiguous()), (
        f"entries {tuple(entries.shape)} for {m} rows")
    stride = entries.size(1) if entries.dim() == 2 else 0
    if m and out.size(1):
        _entry_slots_kernel[(m,)](ids, entries, out, k, out.size(1), stride, BLOCK=triton.next_power_of_2(out.size(1)))


def index_topk_ref(score: Tensor, k: int, candidates: Tensor | None = None, block: int = 1) -> Tensor:
    """The golden end of Indexer.forward (stable_topk, position order, -1 for -inf picks) -> int32."""
    T = score.size(-1)
    if candidates is not None:
        score = score.masked_fill(~candidates.repeat_interleave(block, dim=-1)[:, :T], float("-inf"))
    values, indices = stable_topk(score, min(k, T))
    order = indices.sort(dim=-1)
    picked = values.gather(-1, order.indices)
    return torch.where(picked > float("-inf"), order.values, -1).to(torch.int32)


def candidate_blocks_ref(score: Tensor, visible: Tensor, topk_blocks: int, block: int) -> Tensor:
    """The golden select_candidate_blocks on [M, T] -> bool [M, T]."""
    return select_candidate_blocks(score.unsqueeze(0), visible.to(score.device), topk_blocks, block)[0]
