"""The ratio-2 compressor's pooling for a batch of requests' chunks, with the main-KV store fused (spec 4.4).

Tokens pair by absolute position (2g, 2g+1) into group g. Per completed group, per channel c (fp32, the
reference's math; the golden does it in float64):

    m = max(s0, s1);  w_t = exp(s_t - m) / (exp(s0 - m) + exp(s1 - m))
    pooled = bf16(kv0 * w0 + kv1 * w1)
    latent = bf16(RMSNorm(pooled, norm))                               -> out [G, hd] (pre-RoPE)
    optionally: NVFP4 main-KV record of bf16(rope(latent) at 2g) at the group's flat slot

kv / score are the compressor's fp32 wkv / wgate outputs for the chunk's tokens (computed by the
caller). A chunk starting at an odd position completes the request's pending group with its first
token; a chunk ending at an odd position leaves its last token in the request's pending slot
(pending_kv / pending_score fp32 [slots, 2, hd], token 0), as engine.model.attention.Compressor does.

The index-key path (Indexer.index_keys then MXFP4) is `store_index_keys`: a torch bf16 matmul for wk
(512 -> 128) and one fused k_norm + RoPE + MXFP4 store (cache_store.store_index_k_fused).

Memory traffic per group: 4 * 4 * hd bytes read (two tokens' kv and score), 2 * hd written (latent)
plus the 288-byte record; per chunk ending mid-group 2 * 4 * hd more (the pending copy).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from engine.host_copy import to_device
from engine.kernels.cache_records import MAIN_KV_BLOCK, fp4_record_bytes
from engine.kernels.cache_store import store_index_k_fused, write_rows
from engine.kernels.rope import RopeTable
from engine.kernels.triton_common import bf16_bits, rms_norm_pairs, rope_pairs, round_bf16

RATIO = 2
_PLAN_COLS = 6  # src0, src1, out_row, group position, pending source row, pending slot


class Ratio2Chunk(NamedTuple):
    """One request's chunk: rows row..row+n-1 of kv/score hold positions start..start+n-1."""

    row: int
    n: int
    start: int
    pending_slot: int


def ratio2_groups(start: int, n: int) -> tuple[int, int]:
    """(first group, number of groups) that tokens start..start+n-1 complete."""
    return start // RATIO, (start + n) // RATIO - start // RATIO


@dataclass(frozen=True)
class Ratio2Plan:
    """Work items of one launch (int64 [W, 6] on the device) and, per chunk, (first group, count).
    Groups are numbered in chunk order: chunk i's are rows offsets[i] .. offsets[i] + count of the output."""

    items: Tensor
    groups: list[tuple[int, int]]
    positions: Tensor  # int64 [G] on the device: each group's RoPE position, 2 * group
    num_groups: int


def plan_ratio2(chunks: Sequence[Ratio2Chunk], device: torch.device | str) -> Ratio2Plan:
    """Host-side plan: one item per completed group; the pending write of a chunk that ends mid-group rides
    on the item that reads the pending slot (same program, after a barrier) or gets an item of its own."""
    slots = [c.pending_slot for c in chunks]
    assert len(set(slots)) == len(slots), f"two chunks share a pending slot: {slots}"
    rows, groups, positions, out = [], [], [], 0
    for c in chunks:
        assert c.n > 0 and c.start >= 0 and c.row >= 0 and c.pending_slot >= 0, f"bad chunk {c}"
        first, count = ratio2_groups(c.start, c.n)
        g = torch.arange(first, first + count, dtype=torch.int64)
        p0 = RATIO * g
        src0 = torch.where(p0 < c.start, torch.full_like(p0, -(c.pending_slot + 1)), c.row + p0 - c.start)
        item = torch.stack([src0, c.row + p0 + 1 - c.start, out + torch.arange(count), p0,
                            torch.full_like(p0, -1), torch.full_like(p0, -1)], dim=1)
        if (c.start + c.n) % RATIO:
            write = torch.tensor([c.row + c.n - 1, c.pending_slot])
            if c.start % RATIO:  # item 0 reads the pending token: it writes the new one after reading
                item[0, 4:] = write
            else:
                item = torch.cat([item, torch.cat([torch.tensor([-1, -1, -1, 0]), write])[None]])
        rows.append(item)
        groups.append((first, count))
        positions.append(p0)
        out += count
    items = torch.cat(rows) if rows else torch.empty(0, _PLAN_COLS, dtype=torch.int64)
    pos = torch.cat(positions) if positions else torch.empty(0, dtype=torch.int64)
    return Ratio2Plan(to_device(items.contiguous(), device), groups, to_device(pos, device), out)


@triton.jit
def _pool(k0_ptr, s0_ptr, k1_ptr, s1_ptr, offs):
    """bf16(kv0 * w0 + kv1 * w1) with w = softmax(s0, s1) per channel, fp32 (as the reference's torch ops)."""
    s0 = tl.load(s0_ptr + offs)
    s1 = tl.load(s1_ptr + offs)
    m = tl.maximum(s0, s1)
    e0 = tl.exp(s0 - m)
    e1 = tl.exp(s1 - m)
    den = e0 + e1
    w0 = tl.math.div_rn(e0, den)
    w1 = tl.math.div_rn(e1, den)
    return round_bf16(tl.load(k0_ptr + offs) * w0 + tl.load(k1_ptr + offs) * w1)


@triton.jit
def _ratio2_kernel(kv_ptr, sc_ptr, pkv_ptr, psc_ptr, plan_ptr, w_ptr, cs_ptr, slot_ptr, lat_ptr, pool_ptr, eps,
                   HD: tl.constexpr, RD: tl.constexpr, REC: tl.constexpr, STORE_MAIN: tl.constexpr):
    p = plan_ptr + tl.program_id(0).to(tl.int64) * 6
    src0 = tl.load(p)
    src1 = tl.load(p + 1)
    out_row = tl.load(p + 2)
    psrc = tl.load(p + 4)
    if src1 >= 0:  # a completed group
        j = tl.arange(0, HD // 2)[None, :]
        if src0 >= 0:
            k0_ptr = kv_ptr + src0 * HD
            s0_ptr = sc_ptr + src0 * HD
        else:  # the request's pending token (slot -src0-1, token 0)
            k0_ptr = pkv_ptr + (-src0 - 1) * (2 * HD)
            s0_ptr = psc_ptr + (-src0 - 1) * (2 * HD)
        k1_ptr = kv_ptr + src1 * HD
        s1_ptr = sc_ptr + src1 * HD
        pe = _pool(k0_ptr, s0_ptr, k1_ptr, s1_ptr, 2 * j)
        po = _pool(k0_ptr, s0_ptr, k1_ptr, s1_ptr, 2 * j + 1)
        ye, yo = rms_norm_pairs(pe, po, w_ptr, eps, HD)
        tl.store(lat_ptr + out_row * HD + 2 * j, bf16_bits(ye))
        tl.store(lat_ptr + out_row * HD + 2 * j + 1, bf16_bits(yo))
        if STORE_MAIN:
            one = tl.zeros((1, 1), dtype=tl.int64)
            slot = one + tl.load(slot_ptr + out_row).to(tl.int64)
            ok = slot >= 0
            re, ro = rope_pairs(ye, yo, one + tl.load(p + 3), cs_ptr, ok, HD, RD)
            write_rows(re, ro, pool_ptr, slot * REC, ok, HD, 1, 2)  # 2 = FMT_MAIN
    if psrc >= 0:  # this chunk ends mid-group: its last token waits in the pending slot
        tl.debug_barrier()  # the pending token above was read by every thread before it is overwritten
        pslot = tl.load(p + 5)
        c = tl.arange(0, HD)
        tl.store(pkv_ptr + pslot * (2 * HD) + c, tl.load(kv_ptr + psrc * HD + c))
        tl.store(psc_ptr + pslot * (2 * HD) + c, tl.load(sc_ptr + psrc * HD + c))


def compress_ratio2(kv: Tensor, score: Tensor, pending_kv: Tensor, pending_score: Tensor, plan: Ratio2Plan,
                    norm_w: Tensor, eps: float, main_pool: Tensor | None = None, main_slots: Tensor | None = None,
                    table: RopeTable | None = None) -> Tensor:
    """Pool the chunks of `plan` -> latents bf16 [G, hd] (pre-RoPE, normed), groups in chunk order; updates
    pending_kv / pending_score in place. With main_pool, main_slots [G] (-1 = skip) and table: also writes
    each group's NVFP4 main-KV record (RoPE at 2g), = paged.store_main_kv(rotate_latent(latent)).

    kv, score fp32 [N, hd] contiguous; pending_* fp32 [slots, 2, hd] contiguous; norm_w bf16 [hd]."""
    assert kv.dtype == score.dtype == torch.float32 and kv.dim() == 2 and kv.shape == score.shape, (
        f"kv and score must be fp32 [N, hd], got {kv.dtype} {tuple(kv.shape)}, {score.dtype} {tuple(score.shape)}")
    n, hd = kv.shape
    assert hd % 32 == 0 and hd & (hd - 1) == 0, f"hd = {hd} must be a power of two >= 32"
    assert pending_kv.dtype == pending_score.dtype == torch.float32 and pending_kv.shape == pending_score.shape \
        and pending_kv.dim() == 3 and tuple(pending_kv.shape[1:]) == (RATIO, hd), (
            f"pending state must be fp32 [slots, 2, {hd}], got {tuple(pending_kv.shape)} {tuple(pending_score.shape)}")
    assert norm_w.dtype == torch.bfloat16 and tuple(norm_w.shape) == (hd,), f"norm weight must be bf16 [{hd}]"
    for t in (kv, score, pending_kv, pending_score, norm_w):
        assert t.is_contiguous(), "all inputs must be contiguous"
        assert t.device == kv.device, f"inputs on {t.device} and {kv.device}"
    assert plan.items.device == kv.device, f"plan on {plan.items.device}, data on {kv.device}"
    store = main_pool is not None
    assert store == (main_slots is not None) == (table is not None), "the main-KV store needs pool, slots and table"
    latent = torch.empty(plan.num_groups, hd, dtype=torch.bfloat16, device=kv.device)
    rec = fp4_record_bytes(hd, MAIN_KV_BLOCK)
    if store:
        assert main_pool.dtype == torch.uint8 and main_pool.size(-1) == rec and main_pool.is_contiguous(), (
            f"main pool must be contiguous uint8 [..., {rec}], got {main_pool.dtype} {tuple(main_pool.shape)}")
        assert main_slots.dim() == 1 and main_slots.numel() == plan.num_groups, (
            f"main_slots must be [{plan.num_groups}], got {tuple(main_slots.shape)}")
        assert table.rd <= hd and table.cs.device == kv.device, "rope table: rd <= hd, same device"
        main_slots = main_slots.to(kv.device).contiguous()
    if plan.items.size(0) == 0:
        return latent
    dummy = latent.view(torch.int16)
    _ratio2_kernel[(plan.items.size(0),)](
        kv, score, pending_kv, pending_score, plan.items, norm_w.view(torch.int16),
        table.cs if store else dummy, main_slots if store else dummy, latent.view(torch.int16),
        main_pool if store else dummy, eps, HD=hd, RD=table.rd if store else 2, REC=rec, STORE_MAIN=store)
    return latent


def store_index_keys(latent: Tensor, wk: Tensor, k_norm_w: Tensor, eps: float, positions: Tensor, table: RopeTable,
                     pool: Tensor, slots: Tensor) -> None:
    """Indexer.index_keys + MXFP4 store: keys = latent bf16 [G, hd] @ wk bf16 [Di, hd]^T (torch bf16 GEMM,
    fp32 accumulation), then k_norm, RoPE at positions [G] and the MXFP4 records at slots [G]."""
    assert latent.dtype == wk.dtype == torch.bfloat16, f"latent and wk must be bf16, got {latent.dtype} {wk.dtype}"
    store_index_k_fused(torch.matmul(latent, wk.t()).contiguous(), k_norm_w, eps, positions, table, pool, slots)
