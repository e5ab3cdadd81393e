"""The decode step's metadata and inputs in two launches (engine/core/decode_step.py; issue 19).

Per row b of a decode step (one request at position pos[b], its window blocks in a ring, its global block table):

  decode_inputs:  ids[b]   = last_ids[from_row[b]] (a token the previous step drew on the device) or the staged id;
                  hashes[b, l, col] = Engram's n-gram hash ids of the n-grams ending at pos[b] (engram_tables
                  .hash_ngrams at one position: the id's and its look-back's compressed ids, blocked at position
                  0 and at DEAD, XOR-rolled products with each layer's multipliers, mod each column's prime).
  decode_meta:    write[b]      = the window slot pos[b] writes (-1: its block is not in the ring);
                  swa[d, b, w]  = the window slot of position pos - W + 1 + w, -1 below the row's floor
                                  (d = 0: swa_floor, d = 1: the decoder's floor) or past the ring;
                  per compress ratio r in (1, 2), per_block = G / r:
                  entries_r[b, e] = gtable[b, e / per_block] * per_block + e % per_block (0 where no block: never
                                  read, index scores stop at visible), e < C / r;
                  visible_r[b]  = (pos + 1) / r;  slot_r[b] = the entry the step completes (-1: none);
                  ratio 2 also: gpos[b] = 2 (pos / 2) and the pooling item [b, 6] of compressor.Ratio2Plan.

They replace ~35 (Engram) and ~60 per (ratio, floor) pair (metadata) small torch launches with 2: on the tiny
model that was ~400 of ~800 kernels of a decode graph. decode_meta_torch / decode_inputs_torch are the torch
references (the graph body's old code). Memory traffic: the entries, 4 * B * C (1 + 1/2) bytes written, are all
that grows with the context; the rest is O(B * (W + R)).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from engine.engram_tables import DEAD, EngramTables, hash_ngrams
from engine.kernels.triton_common import cdiv

BLOCK_ENTRIES = 1024
DEAD_ID = tl.constexpr(DEAD)  # a compiled kernel reads module globals only as constexprs


@dataclass(slots=True)
class DecodeMeta:
    """The decode step's metadata (see the module docstring); ratio r's tensors are None where the model has none."""

    write: Tensor  # int64 [B]
    swa: Tensor  # int32 [2, B, W]: [0] with swa_floor, [1] with the decoder's floor
    entries: dict[int, Tensor]  # r -> int32 [B, C / r]
    visible: dict[int, Tensor]  # r -> int32 [B]
    slots: dict[int, Tensor]  # r -> int64 [B]
    gpos: dict[int, Tensor]  # r -> int64 [B]: RoPE positions of the completed entries
    items: Tensor | None  # int64 [B, 6]: ratio 2's pooling items


@triton.jit
def _decode_meta_kernel(pos_ptr, swa_floor_ptr, dec_floor_ptr, gfrom_ptr, pending_ptr, ring_ptr, ring_s0, ring_s1,
                        gtable_ptr, gtable_s0, write_ptr, swa_ptr, ent1_ptr, vis1_ptr, slot1_ptr, ent2_ptr, vis2_ptr,
                        slot2_ptr, gpos2_ptr, items_ptr, B, C,
                        W: tl.constexpr, S: tl.constexpr, R: tl.constexpr, G: tl.constexpr, HAS_R1: tl.constexpr,
                        HAS_R2: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_E: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    pos = tl.load(pos_ptr + b)
    e = j * BLOCK_E + tl.arange(0, BLOCK_E).to(tl.int64)
    if HAS_R1:  # per_block = G
        ok = e < C
        blk = tl.load(gtable_ptr + b * gtable_s0 + e // G, mask=ok, other=-1)
        tl.store(ent1_ptr + b * C + e, tl.where(blk >= 0, blk * G + e % G, 0).to(tl.int32), mask=ok)
    if HAS_R2:  # per_block = G / 2
        ok = e < C // 2
        blk = tl.load(gtable_ptr + b * gtable_s0 + e // (G // 2), mask=ok, other=-1)
        tl.store(ent2_ptr + b * (C // 2) + e, tl.where(blk >= 0, blk * (G // 2) + e % (G // 2), 0).to(tl.int32),
                 mask=ok)
    if j == 0:
        lo = tl.maximum(pos - W + 1, 0) // S  # the ring's first block
        blk_w = pos // S - lo  # in [0, R) by the ring's construction, checked all the same
        held = tl.load(ring_ptr + b * ring_s0 + tl.minimum(blk_w, R - 1) * ring_s1)
        tl.store(write_ptr + b, tl.where((blk_w < R) & (held >= 0), held * S + pos % S, -1))
        w = tl.arange(0, BLOCK_W)
        wpos = pos - W + 1 + w
        p = tl.maximum(wpos, 0)
        wb = p // S - lo
        inside = (w < W) & (wb >= 0) & (wb < R)
        held = tl.load(ring_ptr + b * ring_s0 + tl.minimum(tl.maximum(wb, 0), R - 1) * ring_s1, mask=inside, other=-1)
        slot = tl.where(inside & (held >= 0), held * S + p % S, -1)
        floor = tl.maximum(tl.load(swa_floor_ptr + b), 0)
        tl.store(swa_ptr + b * W + w, tl.where(wpos >= floor, slot, -1).to(tl.int32), mask=w < W)
        floor = tl.maximum(tl.load(dec_floor_ptr + b), 0)
        tl.store(swa_ptr + (B + b) * W + w, tl.where(wpos >= floor, slot, -1).to(tl.int32), mask=w < W)
        writes = tl.load(gfrom_ptr + b) <= pos
        if HAS_R1:
            held = tl.load(gtable_ptr + b * gtable_s0 + pos // G)
            tl.store(slot1_ptr + b, tl.where(writes & (held >= 0), held * G + pos % G, -1))
            tl.store(vis1_ptr + b, (pos + 1).to(tl.int32))
        if HAS_R2:
            group = pos // 2
            done = writes & (pos % 2 == 1)  # the group's second token: it completes now
            wait = writes & (pos % 2 == 0)  # its first: it waits in the pending slot
            held = tl.load(gtable_ptr + b * gtable_s0 + group // (G // 2))
            tl.store(slot2_ptr + b, tl.where(done & (held >= 0), held * (G // 2) + group % (G // 2), -1))
            tl.store(vis2_ptr + b, ((pos + 1) // 2).to(tl.int32))
            tl.store(gpos2_ptr + b, 2 * group)
            pending = tl.load(pending_ptr + b)
            item = items_ptr + b * 6
            tl.store(item, tl.where(done, -(pending + 1), -1))
            tl.store(item + 1, tl.where(done, b, -1))
            tl.store(item + 2, tl.where(done, b, -1))
            tl.store(item + 3, 2 * group)
            tl.store(item + 4, tl.where(wait, b, -1))
            tl.store(item + 5, tl.where(wait, pending, -1))


def _check_rows(pos: Tensor, *rows: Tensor) -> None:
    assert pos.dim() == 1 and pos.dtype == torch.int64, f"pos must be int64 [B], got {pos.dtype} {tuple(pos.shape)}"
    for t in rows:
        assert t.shape == pos.shape and t.dtype == torch.int64, f"row fields must be int64 [{pos.numel()}]"
        assert t.device == pos.device, "inputs must be on one device"


def decode_meta(pos: Tensor, swa_floor: Tensor, dec_floor: Tensor, global_from: Tensor, pending: Tensor,
                ring: Tensor, gtable: Tensor, window: int, swa_block: int, global_block: int,
                ratios: tuple[int, ...]) -> DecodeMeta:
    """One launch: the rows' DecodeMeta (module docstring). pos, floors, global_from, pending: int64 [B];
    ring int64 [B, R] window block ids of blocks lo .. lo + R - 1 (any strides); gtable int64 [B, C / global_block]
    (rows contiguous), -1 = no block; ratios: the compress ratios present (0, 1, 2 only)."""
    _check_rows(pos, swa_floor, dec_floor, global_from, pending)
    B, R = ring.shape
    assert B == pos.numel() and ring.dtype == gtable.dtype == torch.int64 and gtable.size(0) == B
    assert gtable.stride(1) == 1, "gtable rows must be contiguous"
    assert set(ratios) <= {0, 1, 2}, f"the decode step handles compress ratios 0, 1 and 2, not {ratios}"
    assert global_block % 2 == 0 and (R - 1) * swa_block >= window - 1, "the ring must cover the window"
    C = gtable.size(1) * global_block
    dev = pos.device
    has1, has2 = 1 in ratios, 2 in ratios
    write = torch.empty(B, dtype=torch.int64, device=dev)
    swa = torch.empty(2, B, window, dtype=torch.int32, device=dev)
    ent = {r: torch.empty(B, C // r, dtype=torch.int32, device=dev) for r in (1, 2) if r in ratios}
    vis = {r: torch.empty(B, dtype=torch.int32, device=dev) for r in ent}
    slots = {r: torch.empty(B, dtype=torch.int64, device=dev) for r in ent}
    gpos = {1: pos} if has1 else {}
    items = None
    if has2:
        gpos[2] = torch.empty(B, dtype=torch.int64, device=dev)
        items = torch.empty(B, 6, dtype=torch.int64, device=dev)
    dummy = write  # pointers of the ratios the model lacks: never touched (HAS_R* off)
    n_blocks = cdiv(C, BLOCK_ENTRIES) if ent else 1
    _decode_meta_kernel[(B, n_blocks)](
        pos, swa_floor, dec_floor, global_from, pending, ring, ring.stride(0), ring.stride(1), gtable,
        gtable.stride(0), write, swa, ent.get(1, dummy), vis.get(1, dummy), slots.get(1, dummy), ent.get(2, dummy),
        vis.get(2, dummy), slots.get(2, dummy), gpos.get(2, dummy), dummy if items is None else items, B, C,
        W=window, S=swa_block, R=R, G=global_block, HAS_R1=has1, HAS_R2=has2,
        BLOCK_W=triton.next_power_of_2(window), BLOCK_E=BLOCK_ENTRIES)
    return DecodeMeta(write, swa, ent, vis, slots, gpos, items)


def decode_meta_torch(pos: Tensor, swa_floor: Tensor, dec_floor: Tensor, global_from: Tensor, pending: Tensor,
                      ring: Tensor, gtable: Tensor, window: int, swa_block: int, global_block: int,
                      ratios: tuple[int, ...]) -> DecodeMeta:
    """decode_meta in torch ops (the reference; the decode step's graph body before the kernel)."""
    W, S, R, dev = window, swa_block, ring.size(1), pos.device
    B, C = pos.numel(), gtable.size(1) * global_block
    lo = (pos - W + 1).clamp_min(0) // S

    def window_slots(p: Tensor, valid: Tensor) -> Tensor:  # positions [B, n] -> flat window slots, -1 = none
        blk = p.div(S, rounding_mode="floor") - lo[:, None]
        ok = valid & (blk >= 0) & (blk < R)
        block = ring.gather(1, blk.clamp(0, R - 1))
        return torch.where(ok & (block >= 0), block * S + p.remainder(S), -1)

    write = window_slots(pos[:, None], torch.ones_like(pos[:, None], dtype=torch.bool))[:, 0]
    wpos = pos[:, None] - W + 1 + torch.arange(W, device=dev)
    swa = torch.stack([window_slots(wpos, wpos >= f.clamp_min(0)[:, None]) for f in (swa_floor, dec_floor)])
    meta = DecodeMeta(write, swa.to(torch.int32), {}, {}, {}, {}, None)
    writes = global_from <= pos
    rows = torch.arange(B, device=dev)
    for r in (r for r in (1, 2) if r in ratios):
        per_block = global_block // r

        def entry_slot(e: Tensor, none: int) -> Tensor:  # entry ids [B, n] -> flat slots (`none` where no block)
            block = gtable.gather(1, e // per_block)
            return torch.where(block >= 0, block * per_block + e % per_block, none)

        meta.entries[r] = entry_slot(torch.arange(C // r, device=dev).expand(B, C // r), 0).to(torch.int32)
        meta.visible[r] = ((pos + 1) // r).to(torch.int32)
        if r == 1:
            meta.slots[1] = torch.where(writes, entry_slot(pos[:, None], -1)[:, 0], -1)
            meta.gpos[1] = pos
            continue
        group = pos // 2
        done, wait = writes & (pos % 2 == 1), writes & (pos % 2 == 0)
        none = torch.full_like(pos, -1)
        meta.items = torch.stack([torch.where(done, -(pending + 1), none), torch.where(done, rows, none),
                                  torch.where(done, rows, none), 2 * group, torch.where(wait, rows, none),
                                  torch.where(wait, pending, none)], dim=1)
        meta.slots[2] = torch.where(done, entry_slot(group[:, None], -1)[:, 0], -1)
        meta.gpos[2] = 2 * group
    return meta


@triton.jit
def _decode_inputs_kernel(ids_ptr, from_row_ptr, last_ptr, out_ids_ptr, pos_ptr, prev_ptr, prev_s0, prev_s1,
                          token_map_ptr, mult_ptr, primes_ptr, offsets_ptr, hash_ptr, pad_id,
                          LOOKBACK: tl.constexpr, K: tl.constexpr, NL: tl.constexpr, H: tl.constexpr,
                          HAS_ENGRAM: tl.constexpr, BLOCK_L: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    from_row = tl.load(from_row_ptr + b)
    drawn = tl.maximum(tl.load(last_ptr + tl.maximum(from_row, 0)), 0)
    tok = tl.where(from_row >= 0, drawn, tl.load(ids_ptr + b))
    tl.store(out_ids_ptr + b, tok)
    if HAS_ENGRAM:
        pos = tl.load(pos_ptr + b)
        lay = tl.arange(0, BLOCK_L)
        in_l = lay < NL
        COLS: tl.constexpr = K * H
        src = tl.load(token_map_ptr + tok)  # shift 0: the position's own token
        blocked = src == DEAD_ID
        rolling = tl.where(blocked, pad_id, src) * tl.load(mult_ptr + lay * (K + 1), mask=in_l, other=0)
        for shift in tl.static_range(1, K + 1):  # the token `shift` positions back
            prev = tl.load(prev_ptr + b * prev_s0 + (LOOKBACK - shift) * prev_s1)
            src = tl.where(prev >= 0, tl.load(token_map_ptr + tl.maximum(prev, 0)), DEAD_ID)
            blocked = blocked | (pos < shift) | (src == DEAD_ID)
            rolling = rolling ^ (tl.where(blocked, pad_id, src)
                                 * tl.load(mult_ptr + lay * (K + 1) + shift, mask=in_l, other=0))
            for h in tl.static_range(H):  # rolling now hashes the (shift + 1)-gram
                col = (shift - 1) * H + h
                prime = tl.load(primes_ptr + lay * COLS + col, mask=in_l, other=1)
                value = rolling % prime + tl.load(offsets_ptr + lay * COLS + col, mask=in_l, other=0)
                tl.store(hash_ptr + (b * NL + lay) * COLS + col, value, mask=in_l)


def decode_inputs(ids: Tensor, from_row: Tensor, last_ids: Tensor, pos: Tensor, prev: Tensor,
                  tables: EngramTables | None) -> tuple[Tensor, Tensor | None]:
    """One launch: the step's input ids int64 [B] (last_ids[from_row] where from_row >= 0, else ids) and, with
    Engram tables, the hash ids int64 [B, layers, cols] of the n-grams ending at pos. prev int64 [B, LOOKBACK]: raw
    ids before the position, oldest first (any strides), -1 where no n-gram reaches: before position 0, and an
    image-span position (DEAD: it blocks its n-grams and every longer one); the tables on the rows' device."""
    _check_rows(pos, ids, from_row)
    assert last_ids.dtype == torch.int64 and prev.dtype == torch.int64 and prev.size(0) == pos.numel()
    B = pos.numel()
    out = torch.empty(B, dtype=torch.int64, device=pos.device)
    hashes, K, NL, H = None, 1, 1, 1
    engram = (out, out, out, out, out, 0)  # never read without Engram (HAS_ENGRAM off)
    if tables is not None:
        K, NL, H = tables.max_ngram_size - 1, tables.num_layers, tables.n_heads
        assert K <= prev.size(1), f"Engram looks {K} tokens back; prev holds {prev.size(1)}"
        assert tables.token_map.device == pos.device, "the Engram tables must be on the rows' device"
        hashes = torch.empty(B, NL, K * H, dtype=torch.int64, device=pos.device)
        engram = (tables.token_map, tables.multipliers.contiguous(), tables.primes.contiguous(),
                  tables.offsets.contiguous(), hashes, tables.pad_id)
    _decode_inputs_kernel[(B,)](ids, from_row, last_ids, out, pos, prev, prev.stride(0), prev.stride(1), *engram,
                                LOOKBACK=prev.size(1), K=K, NL=NL, H=H, HAS_ENGRAM=tables is not None,
                                BLOCK_L=triton.next_power_of_2(NL))
    return out, hashes


def decode_inputs_torch(ids: Tensor, from_row: Tensor, last_ids: Tensor, pos: Tensor, prev: Tensor,
                        tables: EngramTables | None) -> tuple[Tensor, Tensor | None]:
    """decode_inputs in torch ops (the reference: engram_tables.hash_ngrams at one position)."""
    tok = torch.where(from_row >= 0, last_ids[from_row.clamp_min(0)].clamp_min(0), ids)
    if tables is None:
        return tok, None
    K = tables.max_ngram_size - 1
    back = prev[:, prev.size(1) - K:]
    history = torch.where(back >= 0, tables.token_map[back.clamp_min(0)], DEAD)  # [B, K]
    return tok, hash_ngrams(tables, tok[:, None].contiguous(), history.contiguous(), pos)[:, 0]
