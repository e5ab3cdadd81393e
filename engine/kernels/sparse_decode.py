"""Sparse MQA decode attention over the packed paged pools in ONE launch: the CUDA C++ kernel of
`cuda/sparse_decode.cu` (the decode form of `sparse_attn`, M = 1..16 queries, H heads, D = 512).

Same math, contract and golden P rounding as `sparse_attn_paged` (engine/kernels/sparse_attention.py):

    l_r = scale * q[m, h] · kv_r        mx = max(max_r l_r, -1e30)        p_r = exp(l_r - mx)
    o[m, h] = Σ_r bf16(p_r) kv_r / (Σ_r p_r + exp(sink[h] - mx))

over the rows r of [swa_idx[m], main_idx[m]] whose slot is not -1 (all-invalid query: 0).

Why one launch: the Triton kernel is latency-bound at decode shapes (58 us at M = 1 for ~0.35 MB of records:
3 launches, records dequantised in both passes, fp32 tiles in registers at D = 512). Here the `splits` CTAs of
one (query, head block) form a thread-block cluster; each dequantises its contiguous range of rows ONCE into
shared memory as bf16 (exact for both record formats), computes its logits with mma.sync (kept in shared
memory), exchanges (max, Σp) with the other ranks through distributed shared memory (rank order: every rank
gets the same fp32 global max and Σp), rounds p = exp(l - global max) to bf16 (the golden rule: the FINAL
max, so one pass over the records suffices) and does P·V with mma.sync into fp32 partials [heads, 512]; the
ranks then sum the partials in rank order (DSMEM) for disjoint slices, divide and write bf16. Deterministic,
no workspace, no atomics, CUDA-graph capturable; optional programmatic dependent launch. See the .cu header
for the fragment layouts and the shared-memory budget.

Differences from the float64 golden (tests/kernels/test_sparse_decode.py, the tolerance of
test_sparse_attention.py): fp32 logits (the MMA's fp32 sums over 4 D quarters), fp32 Σp, and the bf16
rounding of an fp32 p that lies within ~1e-7 of a bf16 tie.

Memory traffic (the floor): M·(KW·528 + KM·288) record bytes + 4·M·(KW+KM) index bytes + 2·M·H·D (q) +
2·M·H·D (o); the H / heads_per_cta head blocks of one query re-read its records from L2.

Launch shape (DecodeParams): heads_per_cta (16 or 32: the MMA's M side, heads per CTA), splits (CTAs per
cluster, <= 8; rows per CTA = the rows rounded up to 16 / splits), pdl.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import Tensor

from engine.kernels.cuda_build import cuda_kernels_available, load, num_sms
from engine.kernels.sparse_attention import check_attn_args

HEAD_DIM = 512  # the kernel's D (a compile-time constant)
MAX_SPLITS = 8  # portable cluster size
MAX_M = 65535  # the grid's z dimension
MAX_SMEM = 227 * 1024  # kMaxSmem in cuda/sparse_decode.cu
HEADS_PER_CTA = (16, 32)
ROW_TILE = 16  # rows per split are a multiple of this (the MMA's K in P·V)
_KV_STRIDE = HEAD_DIM + 8  # bf16 per shared kv / q row
_PART_STRIDE = HEAD_DIM + 8  # fp32 per shared partial row
_D_QUARTERS = 4


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class DecodeParams:
    """Launch shape of sparse_attn_decode (see the module docstring); `normalised` fixes the rows per split
    for a row count and drops splits that would own no rows."""

    heads_per_cta: int = 16  # 16 or 32
    splits: int = 8  # CTAs per (query, head block): the cluster size, 1..8
    pdl: bool = True  # programmatic dependent launch (the kernel waits for its predecessor before any load)

    def rows_per_split(self, n_rows: int) -> int:
        return ROW_TILE * _cdiv(_cdiv(max(n_rows, 1), self.splits), ROW_TILE)

    def normalised(self, n_rows: int) -> DecodeParams:
        return DecodeParams(self.heads_per_cta, _cdiv(max(n_rows, 1), self.rows_per_split(n_rows)), self.pdl)


def smem_bytes(heads_per_cta: int, rows_per_split: int) -> int:
    """Shared memory of one CTA (mirrors layout() in cuda/sparse_decode.cu): kv bf16 [R, 520] aliased with the
    fp32 partials [HB, 520], q bf16 [HB, 520], logit quarters fp32 [4, HB, R], p bf16 [HB, R + 8], slots
    int32 [R], two fp32 pairs per head."""
    hb, r = heads_per_cta, rows_per_split
    return (max(r * _KV_STRIDE * 2, hb * _PART_STRIDE * 4) + hb * _KV_STRIDE * 2 + _D_QUARTERS * hb * r * 4
            + hb * (r + 8) * 2 + r * 4 + 16 * hb)


def params_fit(p: DecodeParams, h: int, n_rows: int) -> bool:
    """Whether the kernel has an instance for p at H = h heads and n_rows = KW + KM rows."""
    p = p.normalised(n_rows)
    return (p.heads_per_cta in HEADS_PER_CTA and heads_fit(h, p.heads_per_cta) and 1 <= p.splits <= MAX_SPLITS
            and smem_bytes(p.heads_per_cta, p.rows_per_split(n_rows)) <= MAX_SMEM)


def heads_fit(h: int, heads_per_cta: int) -> bool:
    """Whole head blocks, or one partial 16-head block (H < 16: a rank's heads under tensor parallelism; the
    kernel computes the missing heads on zero queries and stores none of them)."""
    return h % heads_per_cta == 0 or (heads_per_cta == 16 and 1 <= h < 16)


@lru_cache(maxsize=1024)
def pick_params(m: int, h: int, n_rows: int, num_sms: int = 132) -> DecodeParams:
    """8 splits (the most parallelism per query: ~80 rows per CTA at KW + KM = 640); 16 heads per CTA while
    M·H/16·8 CTAs fit in one wave of SMs (M <= 4 at H = 64 on 132 SMs), else 32 (one CTA per SM: ~124 / ~163 KB of
    shared memory); above 8 queries 6 splits first. Falls back to the other head count, then to fewer splits,
    where shared memory or H do not allow it. H200 sweep (benchmarks/kernel_benches/sparse_decode.py --sweep,
    2026-11-30): best hb16 s8 at M = 1 (11.7 us), hb32 s8 at M = 6 (15.6), hb32 s6 at M = 16 (37.3; s8 44.7)."""
    prefer = 16 if m * _cdiv(h, 16) * MAX_SPLITS <= num_sms else 32
    for splits in ([6] if m > 8 else []) + list(range(MAX_SPLITS, 0, -1)):
        for hb in (prefer, 48 - prefer):
            p = DecodeParams(hb, splits).normalised(n_rows)
            if params_fit(p, h, n_rows):
                return p
    raise ValueError(f"no sparse_decode launch shape for H = {h}, {n_rows} rows")


@lru_cache(maxsize=None)
def _lib() -> ctypes.CDLL:
    lib = load("sparse_decode")
    lib.dsv41_sparse_decode.restype = ctypes.c_int
    lib.dsv41_sparse_decode.argtypes = ([ctypes.c_void_p] * 7 + [ctypes.c_int] * 4 + [ctypes.c_float]
                                        + [ctypes.c_int] * 4 + [ctypes.c_void_p])
    lib.dsv41_sparse_decode_smem.restype = ctypes.c_size_t
    lib.dsv41_sparse_decode_smem.argtypes = [ctypes.c_int] * 2
    lib.dsv41_sparse_decode_error_string.restype = ctypes.c_char_p
    lib.dsv41_sparse_decode_error_string.argtypes = [ctypes.c_int]
    return lib


def decode_applies(q: Tensor, swa_pool: Tensor, swa_idx: Tensor, main_pool: Tensor, main_idx: Tensor,
                   max_m: int = 16) -> bool:
    """Whether `sparse_attn` should route this call here: CUDA sm_90+, 1..max_m queries, D = 512, an H with
    a launch shape, at least one row, 16-byte aligned q and pools, buildable. (The caller still owns the
    contract that check_attn_args asserts.)"""
    if not q.is_cuda or q.dim() != 3:
        return False
    m, h, d = q.shape
    n_rows = swa_idx.size(-1) + main_idx.size(-1)
    if not (0 < m <= max_m and d == HEAD_DIM and heads_fit(h, 16) and n_rows > 0):
        return False
    if q.data_ptr() % 16 or swa_pool.data_ptr() % 16 or main_pool.data_ptr() % 16:
        return False
    if not cuda_kernels_available(q.device.index or 0):
        return False
    try:
        pick_params(m, h, n_rows, num_sms(q.device.index or 0))
    except ValueError:
        return False
    return True


def sparse_attn_decode(q: Tensor, swa_pool: Tensor, swa_idx: Tensor, main_pool: Tensor, main_idx: Tensor,
                       sink: Tensor, scale: float, params: DecodeParams | None = None) -> Tensor:
    """q bf16 [M, H, 512]; swa_pool uint8 [..., 528]; swa_idx int32 [M, KW] flat slots (-1 = none);
    main_pool uint8 [..., 288]; main_idx int32 [M, KM] (-1 = none); sink fp32 [H] -> bf16 [M, H, 512].

    The contract of `sparse_attn_paged` (check_attn_args; slots must be < the pool's slot count, not checked),
    on one CUDA device, with D = 512, H a multiple of 16 or below 16 and q / pools 16-byte aligned. params: the launch
    shape (default pick_params). Raises RuntimeError when the launch fails.
    """
    check_attn_args(q, swa_pool, swa_idx, main_pool, main_idx, sink)
    m, h, d = q.shape
    assert d == HEAD_DIM, f"sparse_attn_decode is built for head_dim {HEAD_DIM}, got {d}"
    assert heads_fit(h, 16), f"heads {h} must be a multiple of 16 or below 16"
    assert q.is_cuda, f"sparse_attn_decode needs a CUDA device, got {q.device}"
    assert m <= MAX_M, f"at most {MAX_M} queries, got {m}"
    assert q.data_ptr() % 16 == 0 and swa_pool.data_ptr() % 16 == 0 and main_pool.data_ptr() % 16 == 0, \
        "q and the pools must be 16-byte aligned"
    kw, km = swa_idx.size(1), main_idx.size(1)
    n_rows = kw + km
    out = torch.empty_like(q)
    if m == 0 or n_rows == 0:
        return out.zero_()
    p = (params or pick_params(m, h, n_rows, num_sms(q.device.index or 0))).normalised(n_rows)
    assert params_fit(p, h, n_rows), f"no kernel instance for {p} at H = {h}, {n_rows} rows"
    r = p.rows_per_split(n_rows)
    lib = _lib()
    with torch.cuda.device(q.device):
        err = lib.dsv41_sparse_decode(q.data_ptr(), swa_pool.data_ptr(), swa_idx.data_ptr(), main_pool.data_ptr(),
                                      main_idx.data_ptr(), sink.data_ptr(), out.data_ptr(), m, h, kw, km,
                                      float(scale), p.heads_per_cta, r, p.splits, int(p.pdl),
                                      torch.cuda.current_stream(q.device).cuda_stream)
    if err:
        raise RuntimeError(f"sparse_decode launch {p} (R = {r}) for M={m} H={h} KW={kw} KM={km} failed: "
                           f"{lib.dsv41_sparse_decode_error_string(err).decode()}")
    return out
