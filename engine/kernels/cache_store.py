"""Fused quantise-and-store into the paged caches (spec 4.4, 4.7): the kernel forms of engine.kernels.paged's
store_swa / store_main_kv / store_index_k, optionally with the RMSNorm and RoPE that precede them.

One program stores BLOCK_R rows; a row is held as its interleaved pairs (e, o) = (x[2j], x[2j+1]) in fp32,
which is the RoPE layout and the FP4 packing layout at once. Per row, in order (each step optional):

    y = bf16((w * x) * 1/sqrt(mean(x^2) + eps))                        RMSNorm (fp32, w * x exact; golden: float64)
    y = bf16(rope(y) at the row's position)                             last rd dims, engine.kernels.rope
    record at flat slot (slot -1: row skipped):
      SWA   (FP8 E4M3 per element + UE8M0 per 32; D + D/32 bytes)       = cache_records.pack_swa
      main  (E2M1 pairs, even element low nibble + E4M3 scale per 16)   = cache_records.pack_main_kv
      index (E2M1 pairs + UE8M0 scale per 32, MXFP4)                    = cache_records.pack_index_k
      bf16  (plain [N, D] output: `norm_rope`, the values the fused stores quantise)
      qdq   (plain bf16 [N, D] output of the MXFP4 QDQ values, fp4_qdq(y, 32, "ue8m0"): `rope_mxfp4_qdq`, the
             indexer's queries; rows may share a position, H rows per token)

Quantisation is exact integer/fp32 arithmetic (no fp8 casts), so a record is bitwise pack_*(y) on the
GPU and in the CPU interpreter alike. The fused forms' y can differ from the golden's bf16 value by one
ULP (fp32 vs float64 norm and rotation), and then so can the record: see tests/kernels/test_rope_store.py.

Memory traffic per row: 2*D bytes read (bf16), the record written (D + D/32, D/2 + D/16 or D/2 + D/32
bytes), 8 bytes of slot, plus (RoPE) rd*4 bytes of table and (RMSNorm) the D*2-byte weight, shared
by all rows (cached).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from engine.kernels.cache_records import (INDEX_K_BLOCK, MAIN_KV_BLOCK, SWA_BLOCK, fp4_record_bytes,
                                          swa_record_bytes)
from engine.kernels.rope import RopeTable, check_positions
from engine.kernels.triton_common import (INV_FP8_MAX, bf16_bits, bf16_to_fp32, e4m3_code, rms_norm_pairs,
                                          rope_pairs, round_e4m3)

FMT_BF16, FMT_SWA, FMT_MAIN, FMT_INDEX, FMT_QDQ = 0, 1, 2, 3, 4
_INV_FP4_MAX = tl.constexpr(1.0 / 6.0)  # rounded to fp32 where used, as engine.quant.fp4_quant's fp32(1/6)
_NVFP4_AMIN = tl.constexpr(6 * 2.0**-9)  # amax floors (engine.quant._fp4_codes_and_scales)
_MXFP4_AMIN = tl.constexpr(6 * 2.0**-126)

assert SWA_BLOCK == 32 and MAIN_KV_BLOCK == 16 and INDEX_K_BLOCK == 32  # the kernels' group shapes


@triton.jit
def _load_pairs(ptr, row_off, mask, D: tl.constexpr):
    """bf16 rows (int16 view) at element offsets row_off [R, 1] -> (even, odd) fp32 [R, D/2]."""
    j = tl.arange(0, D // 2)[None, :]
    e = bf16_to_fp32(tl.load(ptr + row_off + 2 * j, mask=mask, other=0))
    o = bf16_to_fp32(tl.load(ptr + row_off + 2 * j + 1, mask=mask, other=0))
    return e, o


@triton.jit
def _e2m1_code(v):
    """fp32 already divided by its scale and clamped to ±6 -> int32 E2M1 code (engine.quant.e2m1_encode):
    round to nearest, ties to the even code (0.75 -> 1.0, 1.75 -> 2, 3.5 -> 4 go up; 0.25, 1.25, 2.5, 5 down)."""
    a = tl.abs(v)
    c = ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32) + (a >= 1.75).to(tl.int32)
         + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32) + (a > 5.0).to(tl.int32))
    return c | (((v.to(tl.int32, bitcast=True) >> 31) & 1) << 3)


@triton.jit
def _ue8m0(amax, inv_qmax):
    """Per-group amax (clamped by the caller) -> (biased exponent e of s = 2^ceil(log2(amax*inv_qmax)), 1/s)."""
    y = (amax * inv_qmax).to(tl.int32, bitcast=True)
    ex = ((y >> 23) & 0xFF) + ((y & 0x7FFFFF) != 0).to(tl.int32)
    return ex, ((254 - ex) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _e2m1_value(c):
    """int32 E2M1 code -> its fp32 value (engine.quant.e2m1_decode; code 8 is -0.0)."""
    m = c & 7
    v = tl.where(m < 2, m.to(tl.float32) * 0.5,
                 tl.where(m < 4, 1.0 + (m - 2).to(tl.float32) * 0.5,
                          tl.where(m < 6, (m - 2).to(tl.float32), 4.0 + (m - 6).to(tl.float32) * 2.0)))
    return (v.to(tl.int32, bitcast=True) | ((c & 8) << 28)).to(tl.float32, bitcast=True)  # sign bit (-0.0 too)


@triton.jit
def _mxfp4_codes(e, o, D: tl.constexpr, R: tl.constexpr):
    """Rows as pairs -> MXFP4 per 32 (16 pairs): (biased UE8M0 exponents [R, D/32], E2M1 codes of the even and
    the odd elements [R, D/32, 16])."""
    e3 = tl.reshape(e, (R, D // 32, 16))
    o3 = tl.reshape(o, (R, D // 32, 16))
    amax = tl.maximum(tl.maximum(tl.max(tl.abs(e3), axis=2), tl.max(tl.abs(o3), axis=2)), _MXFP4_AMIN)
    ex, inv_s = _ue8m0(amax, _INV_FP4_MAX)
    ce = _e2m1_code(tl.minimum(tl.maximum(e3 * inv_s[:, :, None], -6.0), 6.0))
    co = _e2m1_code(tl.minimum(tl.maximum(o3 * inv_s[:, :, None], -6.0), 6.0))
    return ex, ce, co


@triton.jit
def write_rows(e, o, out_ptr, rec, mask, D: tl.constexpr, R: tl.constexpr, FMT: tl.constexpr):
    """Rows as pairs -> FMT at out_ptr + rec [R, 1] (record byte offset; element offset for FMT_BF16)."""
    j = tl.arange(0, D // 2)[None, :]
    if FMT == 0:  # bf16 [N, D] (int16 view)
        tl.store(out_ptr + rec + 2 * j, bf16_bits(e), mask=mask)
        tl.store(out_ptr + rec + 2 * j + 1, bf16_bits(o), mask=mask)
    elif FMT == 1:  # SWA: E4M3 codes in element order, then UE8M0 per 32 (16 pairs)
        e3 = tl.reshape(e, (R, D // 32, 16))
        o3 = tl.reshape(o, (R, D // 32, 16))
        amax = tl.maximum(tl.maximum(tl.max(tl.abs(e3), axis=2), tl.max(tl.abs(o3), axis=2)), 1e-4)
        ex, inv_s = _ue8m0(amax, INV_FP8_MAX)
        qe = e4m3_code(round_e4m3(tl.minimum(tl.maximum(e3 * inv_s[:, :, None], -448.0), 448.0)))
        qo = e4m3_code(round_e4m3(tl.minimum(tl.maximum(o3 * inv_s[:, :, None], -448.0), 448.0)))
        tl.store(out_ptr + rec + 2 * j, tl.reshape(qe, (R, D // 2)), mask=mask)
        tl.store(out_ptr + rec + 2 * j + 1, tl.reshape(qo, (R, D // 2)), mask=mask)
        tl.store(out_ptr + rec + D + tl.arange(0, D // 32)[None, :], ex.to(tl.uint8), mask=mask)
    elif FMT == 2:  # main KV: E2M1 pairs, then E4M3 scale per 16 (8 pairs): s = e4m3(amax / 6), v = x / s
        e3 = tl.reshape(e, (R, D // 16, 8))
        o3 = tl.reshape(o, (R, D // 16, 8))
        amax = tl.maximum(tl.maximum(tl.max(tl.abs(e3), axis=2), tl.max(tl.abs(o3), axis=2)), _NVFP4_AMIN)
        s = round_e4m3(tl.minimum(tl.math.div_rn(amax, 6.0), 448.0))
        ce = _e2m1_code(tl.minimum(tl.maximum(tl.math.div_rn(e3, s[:, :, None]), -6.0), 6.0))
        co = _e2m1_code(tl.minimum(tl.maximum(tl.math.div_rn(o3, s[:, :, None]), -6.0), 6.0))
        tl.store(out_ptr + rec + j, tl.reshape(ce | (co << 4), (R, D // 2)).to(tl.uint8), mask=mask)
        tl.store(out_ptr + rec + D // 2 + tl.arange(0, D // 16)[None, :], e4m3_code(s), mask=mask)
    elif FMT == 4:  # MXFP4 QDQ values as bf16 [N, D] (int16 view): e2m1(x / s) · s, exact in bf16
        ex, ce, co = _mxfp4_codes(e, o, D, R)
        s = (ex << 23).to(tl.float32, bitcast=True)[:, :, None]
        tl.store(out_ptr + rec + 2 * j, bf16_bits(tl.reshape(_e2m1_value(ce) * s, (R, D // 2))), mask=mask)
        tl.store(out_ptr + rec + 2 * j + 1, bf16_bits(tl.reshape(_e2m1_value(co) * s, (R, D // 2))), mask=mask)
    else:  # index K (MXFP4): E2M1 pairs, then UE8M0 scale per 32 (16 pairs)
        ex, ce, co = _mxfp4_codes(e, o, D, R)
        tl.store(out_ptr + rec + j, tl.reshape(ce | (co << 4), (R, D // 2)).to(tl.uint8), mask=mask)
        tl.store(out_ptr + rec + D // 2 + tl.arange(0, D // 32)[None, :], ex.to(tl.uint8), mask=mask)


@triton.jit
def _store_rows_kernel(x_ptr, w_ptr, pos_ptr, cs_ptr, slot_ptr, out_ptr, N, eps,
                       D: tl.constexpr, RD: tl.constexpr, REC: tl.constexpr, BLOCK_R: tl.constexpr,
                       NORM: tl.constexpr, ROPE: tl.constexpr, FMT: tl.constexpr, HEADS: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    in_range = rows < N
    if FMT == 0 or FMT == 4:
        ok = in_range
        rec = rows.to(tl.int64) * D
    else:
        slot = tl.load(slot_ptr + rows, mask=in_range, other=-1).to(tl.int64)
        ok = in_range & (slot >= 0)
        rec = slot * REC
    ok = ok[:, None]
    e, o = _load_pairs(x_ptr, rows.to(tl.int64)[:, None] * D, ok, D)
    if NORM:
        e, o = rms_norm_pairs(e, o, w_ptr, eps, D)
    if ROPE:
        pos = tl.load(pos_ptr + rows // HEADS, mask=in_range, other=0).to(tl.int64)[:, None]  # HEADS rows a token
        e, o = rope_pairs(e, o, pos, cs_ptr, ok, D, RD)
    write_rows(e, o, out_ptr, rec[:, None], ok, D, BLOCK_R, FMT)


def rows_per_program(d: int) -> int:
    return max(1, min(64, 2048 // d))


def _check_pool(pool: Tensor, rec_bytes: int, slots: Tensor, n: int, device: torch.device) -> Tensor:
    assert pool.dtype == torch.uint8 and pool.size(-1) == rec_bytes, (
        f"pool must be uint8 [..., {rec_bytes}], got {pool.dtype} {tuple(pool.shape)}")
    assert pool.is_contiguous(), "pool must be contiguous"
    assert pool.device == device, f"pool on {pool.device}, data on {device}"
    assert slots.dim() == 1 and slots.numel() == n, f"slots must be [{n}], got {tuple(slots.shape)}"
    assert slots.dtype in (torch.int32, torch.int64), f"slots must be int32/int64, got {slots.dtype}"
    if slots.device.type == "cpu" and n:
        total = pool.numel() // rec_bytes
        assert int(slots.min()) >= -1 and int(slots.max()) < total, f"slots outside -1..{total - 1}"
    return slots.to(device).contiguous()


def _launch(x: Tensor, out: Tensor, slots: Tensor | None, fmt: int, rec_bytes: int, norm_w: Tensor | None,
            eps: float, positions: Tensor | None, table: RopeTable | None, heads: int = 1) -> None:
    assert x.dtype == torch.bfloat16 and x.dim() == 2 and x.is_contiguous(), (
        f"rows must be contiguous bf16 [N, D], got {x.dtype} {tuple(x.shape)}")
    n, d = x.shape
    assert d % 32 == 0 and d & (d - 1) == 0, f"D = {d} must be a power of two >= 32"
    if norm_w is not None:
        assert norm_w.dtype == torch.bfloat16 and tuple(norm_w.shape) == (d,) and norm_w.is_contiguous(), (
            f"norm weight must be contiguous bf16 [{d}], got {norm_w.dtype} {tuple(norm_w.shape)}")
        assert norm_w.device == x.device, f"norm weight on {norm_w.device}, rows on {x.device}"
    rope = positions is not None
    assert rope == (table is not None), "RoPE needs both positions and a table"
    rd = 2
    if rope:
        rd = table.rd
        assert rd <= d and rd & (rd - 1) == 0, f"rope dim {rd} must be a power of two <= D = {d}"
        positions = check_positions(positions, n // heads, table, x.device)
    if slots is not None:
        slots = _check_pool(out, rec_bytes, slots, n, x.device)
    if n == 0:
        return
    block_r = rows_per_program(d)
    dummy = x.view(torch.int16)
    _store_rows_kernel[(triton.cdiv(n, block_r),)](
        x.view(torch.int16), dummy if norm_w is None else norm_w.view(torch.int16),
        positions if rope else dummy, table.cs if rope else dummy, dummy if slots is None else slots,
        out, n, eps, D=d, RD=rd, REC=rec_bytes, BLOCK_R=block_r, NORM=norm_w is not None, ROPE=rope, FMT=fmt,
        HEADS=heads)


def store_swa(pool: Tensor, slots: Tensor, kv: Tensor) -> None:
    """kv bf16 [N, D] (normed, post-RoPE) -> FP8 records at flat slots [N] (-1 = skip); = paged.store_swa."""
    _launch(kv, pool, slots, FMT_SWA, swa_record_bytes(kv.size(-1)), None, 0.0, None, None)


def store_swa_fused(kv: Tensor, norm_w: Tensor, eps: float, positions: Tensor, table: RopeTable, pool: Tensor,
                    slots: Tensor) -> None:
    """The window KV path after wkv: kv bf16 [N, D] (pre-norm) -> RMSNorm(kv_norm) -> RoPE at positions [N]
    -> FP8 records at slots [N] (-1 = skip). = paged.store_swa(pool, slots, norm_rope(kv, ...))."""
    _launch(kv, pool, slots, FMT_SWA, swa_record_bytes(kv.size(-1)), norm_w, eps, positions, table)


def store_main_kv(pool: Tensor, slots: Tensor, latent: Tensor, positions: Tensor | None = None,
                  table: RopeTable | None = None) -> None:
    """latent bf16 [N, D] -> NVFP4 main-KV records at slots [N] (-1 = skip); = paged.store_main_kv.
    With positions [N] and table: RoPE first (the pre-RoPE compressor latent at its group positions)."""
    _launch(latent, pool, slots, FMT_MAIN, fp4_record_bytes(latent.size(-1), MAIN_KV_BLOCK), None, 0.0,
            positions, table)


def store_index_k(pool: Tensor, slots: Tensor, keys: Tensor) -> None:
    """keys bf16 [N, Di] (post-RoPE) -> MXFP4 index-key records at slots [N] (-1 = skip); = paged.store_index_k."""
    _launch(keys, pool, slots, FMT_INDEX, fp4_record_bytes(keys.size(-1), INDEX_K_BLOCK), None, 0.0, None, None)


def store_index_k_fused(keys: Tensor, norm_w: Tensor, eps: float, positions: Tensor, table: RopeTable,
                        pool: Tensor, slots: Tensor) -> None:
    """The index-key path after wk: keys bf16 [N, Di] -> RMSNorm(k_norm) -> RoPE at (group) positions [N]
    -> MXFP4 records at slots [N]. = paged.store_index_k(pool, slots, norm_rope(keys, ...))."""
    _launch(keys, pool, slots, FMT_INDEX, fp4_record_bytes(keys.size(-1), INDEX_K_BLOCK), norm_w, eps,
            positions, table)


def norm_rope(x: Tensor, norm_w: Tensor | None, eps: float, positions: Tensor | None = None,
              table: RopeTable | None = None) -> Tensor:
    """bf16 [N, D] -> bf16 [N, D]: RMSNorm (if norm_w) then RoPE (if positions), the same code and bits as
    the fused stores before they quantise."""
    out = torch.empty_like(x)
    _launch(x, out.view(torch.int16), None, FMT_BF16, 0, norm_w, eps, positions, table)
    return out


def rope_mxfp4_qdq(x: Tensor, positions: Tensor, table: RopeTable) -> Tensor:
    """The indexer's query after wq_b: x bf16 [N, H, D] -> RoPE of each head at positions [N] -> MXFP4 QDQ
    (blocks of 32, UE8M0 scales), bf16 [N, H, D]: one launch, bitwise fp4_qdq(apply_rope(x, positions, table),
    32, "ue8m0") (the same rotation code; the quantisation is store_index_k's)."""
    assert x.dim() == 3 and x.is_contiguous(), f"x must be contiguous [N, H, D], got {tuple(x.shape)}"
    n, h, d = x.shape
    out = torch.empty_like(x)
    _launch(x.view(n * h, d), out.view(torch.int16).view(n * h, d), None, FMT_QDQ, 0, None, 0.0, positions, table,
            heads=h)
    return out
