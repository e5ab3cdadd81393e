"""Lightning-indexer scan at decode: the CUDA C++ kernel of `cuda/indexer_scan.cu`.

Same contract and output as engine.kernels.indexer.index_scores (whose docstring states the math):

    s_h = bf16(q[m, h] · k_t),  score[m, t] = bf16(Σ_h bf16(relu(s_h) · w[m, h])),  -inf where t >= visible[m]

over the packed MXFP4 index-key records (68 B: 64 B of E2M1 pairs, even element in the low nibble, then one
UE8M0 scale byte per 32 of D = 128) at key_pool[slots[t]], for M <= 8 queries of H heads (H % 16 == 0,
M·H <= 256).

Why CUDA: the Triton kernel decodes every key element to fp32 on the CUDA cores and rounds its [M·H, BLOCK_T]
scores elementwise; it reaches 3-9% of the copy bandwidth at T = 1M. Here a key nibble becomes an f16 in ~2.5
integer operations (bits moved into place: value · 2^-14, exact), the queries are staged once per CTA in f16
(q / sa per row, sa a power of two: exact for every MXFP4 value and for every |q| >= amax·2^-32 of a bf16 row),
and mma.sync m16n8k16 computes each 32-block's exact dot products (queries on the M side, 8 entries on the N
side); the block sums are scaled by the key's block scale and accumulated in block order in fp32; the row's
power-of-two scale is folded into the head weight (w · sa · 2^14, exact), and the roundings are the golden's
(scale invariance of round-to-nearest). The header of cuda/indexer_scan.cu derives the exactness: the result
is bitwise the golden's wherever the 4-term block accumulation and the H-term head sum are exact in fp32
(the Triton kernel's condition as well).

Launch shape (ScanParams): a persistent grid of ctas_per_sm x SMs CTAs of `warps` warps; a warp step covers
`groups` x 8 entries, copied with 4-byte cp.async into the warp's ring of `stages` steps. The slots of the
next two steps are prefetched into registers. Programmatic dependent launch (pdl): the kernel waits for its
predecessor before its first read (every input may be the predecessor's output).

Memory traffic (the floor): T·(68 + slot bytes) + 2·M·H·D + 2·M·H + 2·M·T. Compute: 2·M·H·D flops per entry
on the tensor cores: at H = 32 memory-bound for M = 1 (8 kFLOP per 72 B); at M = 8 the mma.sync f16 rate
bounds the scan (~8x the M = 1 tensor work), whatever the memory path.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import Tensor

from engine.kernels.cache_records import INDEX_K_BLOCK, fp4_record_bytes
from engine.kernels.cuda_build import cuda_kernels_available, load, num_sms

HEAD_DIM = 128  # the only index_head_dim the kernel supports
RECORD_BYTES = fp4_record_bytes(HEAD_DIM, INDEX_K_BLOCK)  # 68
MAX_M = 8  # queries per launch
MAX_ROWS = 256  # M·H query rows staged in shared memory
MAX_T = 1 << 30
GROUP = 8  # entries per MMA (the N side)
_MAX_SMEM = 200 * 1024  # kMaxSmem in cuda/indexer_scan.cu
_SMEM_PER_SM = 227 * 1024  # the H100/H200 opt-in per SM
_MAX_WARPS = 8
_GROUPS = (1, 2, 4)
_STAGES = (2, 3, 4, 6)
_GROUP_WORDS = 4 * 32 + 8  # a stage's 8-entry group: 32 code words per block + one scale word per entry


@dataclass(frozen=True, slots=True)
class ScanParams:
    """Launch shape (see the module docstring)."""
    warps: int = 8
    groups: int = 2
    stages: int = 4
    ctas_per_sm: int = 2
    pdl: bool = True

    def entries_per_step(self) -> int:
        return GROUP * self.groups


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _a128(b: int) -> int:
    return _cdiv(b, 128) * 128


def smem_bytes(m: int, h: int, p: ScanParams) -> int:
    """Shared memory of one CTA (dsv41_indexer_scan_smem): the queries as f16 A fragments (M·H x 128), head weights
    times the row scales bf16 [M·H], visible counts int [8], and the warps' rings [warps, stages, groups · 136] u32."""
    rows = m * h
    b = _a128(rows * HEAD_DIM * 2)
    b = _a128(b + rows * 2)
    b = _a128(b + MAX_M * 4)
    return b + p.warps * p.stages * p.groups * _GROUP_WORDS * 4


def valid_params(m: int, h: int, p: ScanParams) -> bool:
    """Whether the launcher accepts p for M queries of H heads."""
    return (1 <= m <= MAX_M and h >= 16 and h % 16 == 0 and m * h <= MAX_ROWS and 1 <= p.warps <= _MAX_WARPS
            and p.groups in _GROUPS and p.stages in _STAGES and p.ctas_per_sm >= 1
            and smem_bytes(m, h, p) <= _MAX_SMEM)


def pick_params(m: int, h: int, t: int, num_sms: int = 132) -> ScanParams:
    """Launch shape by query rows: 2 CTAs of 8 warps per SM, 16-entry steps; 4 stages for few rows (M·H <= 64:
    memory-bound; 3 steps = 3.3 KB in flight per warp), 3 for more (tensor-bound). From the H200 sweep of
    2026-11-30 (benchmarks/kernel_benches/indexer_cuda.py --sweep, T = 1M): at M = 1 every shape with 16-entry
    steps was within 5%; at M = 8 (8, 2, 3, 2) took 422 us and the 32-entry step (8, 4, 3, 1, ~234 registers)
    500. CTAs per SM are lowered until they fit the SM's shared memory."""
    p = ScanParams(8, 2, 4, 2) if m * h <= 64 else ScanParams(8, 2, 3, 2)
    while p.ctas_per_sm > 1 and p.ctas_per_sm * (smem_bytes(m, h, p) + 1024) > _SMEM_PER_SM:
        p = ScanParams(p.warps, p.groups, p.stages, p.ctas_per_sm - 1, p.pdl)
    return p


def grid_size(t: int, p: ScanParams, sms: int) -> int:
    """CTAs of the persistent grid: ctas_per_sm per SM, no more than there are warp steps for."""
    return max(1, min(p.ctas_per_sm * sms, _cdiv(_cdiv(t, p.entries_per_step()), p.warps)))


def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """The C signatures of cuda/indexer_scan.cu's entry points on a loaded library (also used by the CPU tests)."""
    lib.dsv41_indexer_scan.restype = ctypes.c_int
    lib.dsv41_indexer_scan.argtypes = ([ctypes.c_void_p] * 4 + [ctypes.c_int] + [ctypes.c_void_p] * 2
                                       + [ctypes.c_int] * 8 + [ctypes.c_void_p])
    lib.dsv41_indexer_scan_smem.restype = ctypes.c_size_t
    lib.dsv41_indexer_scan_smem.argtypes = [ctypes.c_int] * 5
    lib.dsv41_indexer_scan_error_string.restype = ctypes.c_char_p
    lib.dsv41_indexer_scan_error_string.argtypes = [ctypes.c_int]
    return lib


@lru_cache(maxsize=None)
def _lib() -> ctypes.CDLL:
    return declare(load("indexer_scan"))


def shape_supported(m: int, h: int, d: int, t: int) -> bool:
    """The kernel's shapes: D = 128, H % 16 == 0, 1 <= M <= 8, M·H <= 256, T < 2^30."""
    return d == HEAD_DIM and h >= 16 and h % 16 == 0 and 1 <= m <= MAX_M and m * h <= MAX_ROWS and 0 <= t <= MAX_T


def scan_applies(q: Tensor, w: Tensor, key_pool: Tensor, slots: Tensor, visible: Tensor) -> bool:
    """Whether index_scores_cuda can take this call: a CUDA device of compute capability >= 9.0 with nvcc, the
    kernel's shapes (shape_supported) and dtypes (the caller still owns the rest of index_scores's contract)."""
    if q.dim() != 3 or not q.is_cuda:
        return False
    m, h, d = q.shape
    return (shape_supported(m, h, d, slots.numel()) and q.dtype == torch.bfloat16 and w.dtype == torch.bfloat16
            and key_pool.dtype == torch.uint8 and key_pool.size(-1) == RECORD_BYTES
            and slots.dtype in (torch.int32, torch.int64)
            and all(x.device == q.device for x in (w, key_pool, slots, visible))
            and cuda_kernels_available(q.device.index or 0))


def index_scores_cuda(q: Tensor, w: Tensor, key_pool: Tensor, slots: Tensor, visible: Tensor,
                      params: ScanParams | None = None) -> Tensor:
    """Indexer scores over packed MXFP4 key records (engine.kernels.indexer.index_scores's contract).

    q bf16 [M, H, 128] (MXFP4-QDQ values; any bf16 is accepted, see the module docstring), w bf16 [M, H],
    key_pool uint8 [E, 68] (flat, or paged [blocks, block_size, 68]; contiguous), slots int32/int64 [T] (the
    request's entries in order), visible int [M] -> bf16 [M, T], -inf where t >= visible[m].
    1 <= M <= 8, H % 16 == 0, M·H <= 256; all on one CUDA device.
    """
    M, H, D = q.shape
    assert q.dtype == torch.bfloat16 and w.dtype == torch.bfloat16 and w.shape == (M, H), (q.dtype, w.shape)
    assert D == HEAD_DIM, f"index_head_dim {D}: the CUDA scan takes {HEAD_DIM}"
    assert 1 <= M <= MAX_M and H >= 16 and H % 16 == 0 and M * H <= MAX_ROWS, (
        f"M = {M}, H = {H}: the CUDA scan takes 1 <= M <= {MAX_M}, H % 16 == 0, M·H <= {MAX_ROWS}")
    pool = key_pool.reshape(-1, key_pool.size(-1))
    assert pool.dtype == torch.uint8 and pool.size(-1) == RECORD_BYTES and pool.is_contiguous(), (
        f"key_pool {pool.dtype} {tuple(key_pool.shape)}: uint8 [..., {RECORD_BYTES}] contiguous")
    assert slots.dim() == 1 and slots.dtype in (torch.int32, torch.int64), (slots.dtype, slots.shape)
    assert visible.shape == (M,), visible.shape
    assert q.is_cuda and all(x.device == q.device for x in (w, pool, slots, visible)), "one CUDA device"
    T = slots.numel()
    assert T <= MAX_T, f"T = {T} > {MAX_T}"
    out = torch.empty(M, T, dtype=torch.bfloat16, device=q.device)
    if T == 0:
        return out
    q = q.contiguous()
    if q.data_ptr() % 16:
        q = q.clone()
    w = w.contiguous()
    slots = slots.contiguous()
    vis = visible.to(torch.int32).contiguous()
    p = params or pick_params(M, H, T, num_sms(q.device.index or 0))
    assert valid_params(M, H, p), f"bad launch shape {p} for M = {M}, H = {H} ({smem_bytes(M, H, p)} B smem)"
    grid = grid_size(T, p, num_sms(q.device.index or 0))
    lib = _lib()
    with torch.cuda.device(q.device):
        err = lib.dsv41_indexer_scan(q.data_ptr(), w.data_ptr(), pool.data_ptr(), slots.data_ptr(),
                                     int(slots.dtype == torch.int64), vis.data_ptr(), out.data_ptr(), M, H, T,
                                     p.warps, p.groups, p.stages, grid, int(p.pdl),
                                     torch.cuda.current_stream(q.device).cuda_stream)
    if err:
        raise RuntimeError(f"indexer_scan launch {p} (grid {grid}) for M={M} H={H} T={T} failed: "
                           f"{lib.dsv41_indexer_scan_error_string(err).decode()}")
    return out
