"""bf16-weight GEMV with fp32 output for decode shapes (M = 1..8): the CUDA C++ kernel of `cuda/bf16_gemv.cu`,
and `linear_fp32`, the runner's entry for the reference's fp32 linears (the LM head, the compressors' wkv /
wgate) on every device.

    y[m, n] = fp32( Σ_k x[m, k] · w[n, k] )      x bf16 [..., K], w bf16 [N, K] -> y fp32 [..., N]

The reference computes `F.linear(x.float(), w.float())`. A product of two bf16 values is exact in fp32, so
mma.sync bf16 x bf16 -> f32 computes the same math from the bf16 weight (streamed once, N·K·2 bytes, and no
fp32 copy of it kept anywhere); only the order of the fp32 additions differs. Error bound, stated in the
tests: |y - ref| <= 2^-22 · Σ_k |x_k w_k| for sign-mixed data (ref = the float64 sum rounded to fp32);
integer-valued data whose partial sums stay below 2^24 is exact in any order, so bit for bit.

The split-K reduction (warps through shared memory, then the CTAs of a thread-block cluster) runs in a fixed
order, so the result is deterministic. No workspace and no atomics: any stream, CUDA-graph capturable. With
programmatic dependent launch (GemvParams.pdl, default on) the first weight loads are issued before the
kernel waits for its predecessor on the stream; x is read and y written only after that wait.

Memory traffic (the floor): 2·N·K weight bytes + 2·M·K (x) + 4·M·N (y); each CTA also re-reads its K range
of x from L2 (2·M·K·N / rows per CTA bytes of L2 traffic).

Launch shape (GemvParams): a warp owns row_tiles x 16 rows; a CTA has warps_n x warps_k warps (warps_k
split the CTA's K range), a cluster of `splits` CTAs splits K further. unroll = 32-column blocks of weight
in flight per thread (16 bytes per row per block, rows g and g + 8 of each row tile).
"""

from __future__ import annotations

import ctypes
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import Tensor

from engine.kernels.cuda_build import cuda_kernels_available, load, num_sms
from engine.kernels.gemv_shapes import BLOCK, GemvParams, model_shape
from engine.kernels.gemv_shapes import MAX_SPLITS as _MAX_SPLITS
from engine.kernels.gemv_shapes import MAX_WARPS as _MAX_WARPS
from engine.kernels.gemv_shapes import cdiv as _cdiv

MAX_M = 8  # the MMA's N: tokens per launch
MAX_K = 65536  # 8 cluster splits of <= 8192 columns: every K up to this has a launch shape
INSTANCES = ((1, 2), (1, 4), (1, 8), (2, 2), (2, 4))  # compiled (row_tiles, unroll) pairs
_MAX_SMEM = 200 * 1024  # the launcher's opt-in limit (kMaxSmem in cuda/bf16_gemv.cu)
_CTA_OVERHEAD_BYTES = 8192  # pick_params: a CTA's start-up (x staging, reduction) in weight-byte terms


def smem_bytes(k: int, p: GemvParams) -> int:
    """Shared memory of one CTA: x as bf16 [8, kc (+32 pad)] and fp32 partials [warps_k, 8, rows]."""
    kc = _cdiv(k // BLOCK, p.splits) * BLOCK
    stride = kc + 32 if kc % 64 == 0 else kc
    return MAX_M * stride * 2 + p.warps_k * MAX_M * p.rows_per_cta * 4


@lru_cache(maxsize=1024)
def pick_params(m: int, n: int, k: int, num_sms: int = 132) -> GemvParams:
    """gemv_shapes.model_shape with 2-byte weights (2 CTAs per SM: the kernel's register budget)."""
    return model_shape(m, n, k, weight_bytes=2, smem_bytes=smem_bytes, max_smem=_MAX_SMEM,
                       overhead_bytes=_CTA_OVERHEAD_BYTES, num_sms=num_sms)


@lru_cache(maxsize=None)
def _lib() -> ctypes.CDLL:
    lib = load("bf16_gemv")
    lib.dsv41_bf16_gemv.restype = ctypes.c_int
    lib.dsv41_bf16_gemv.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 9 + [ctypes.c_void_p]
    lib.dsv41_bf16_gemv_smem.restype = ctypes.c_size_t
    lib.dsv41_bf16_gemv_smem.argtypes = [ctypes.c_int] * 5
    lib.dsv41_bf16_gemv_error_string.restype = ctypes.c_char_p
    lib.dsv41_bf16_gemv_error_string.argtypes = [ctypes.c_int]
    return lib


def gemv_applies(x: Tensor, w: Tensor) -> bool:
    """Whether linear_fp32 routes this call to bf16_gemv: CUDA, bf16, 1..MAX_M rows, K % 32 == 0,
    K <= MAX_K, contiguous and 16-byte aligned, buildable."""
    k = x.size(-1)
    m = x.numel() // max(1, k)
    return (x.is_cuda and x.dtype == torch.bfloat16 and w.dtype == torch.bfloat16 and w.dim() == 2
            and w.size(1) == k and 0 < m <= MAX_M and k % BLOCK == 0 and 0 < k <= MAX_K
            and x.is_contiguous() and w.is_contiguous() and x.data_ptr() % 16 == 0 and w.data_ptr() % 16 == 0
            and w.device == x.device and cuda_kernels_available(x.device.index or 0))


def bf16_gemv(x: Tensor, w: Tensor, params: GemvParams | None = None) -> Tensor:
    """y = x @ w^T in fp32: bf16 [..., K] x bf16 [N, K] -> fp32 [..., N], at most MAX_M rows of x (the
    leading dims flattened); K % 32 == 0, K <= MAX_K; both contiguous, 16-byte aligned, on one CUDA device.
    Within 2^-22 · Σ_k |x_k w_k| of bf16_gemv_ref (see the module docstring)."""
    assert x.dtype == torch.bfloat16 and w.dtype == torch.bfloat16, f"bf16_gemv takes bf16, got {x.dtype}, {w.dtype}"
    assert w.dim() == 2 and x.dim() >= 1, f"weight must be [N, K], got {tuple(w.shape)}"
    n, k = w.shape
    assert x.size(-1) == k, f"x [..., {x.size(-1)}] does not match weight [{n}, {k}]"
    assert x.is_contiguous() and w.is_contiguous(), "x and weight must be contiguous"
    assert k % BLOCK == 0 and 0 < k <= MAX_K, f"K = {k} must be a multiple of {BLOCK} in (0, {MAX_K}]"
    m = x.numel() // k
    assert m <= MAX_M, f"bf16_gemv takes at most {MAX_M} rows, got {m} (use linear_fp32)"
    assert x.is_cuda and w.device == x.device, (
        f"bf16_gemv needs x and weight on one CUDA device, got {x.device}, {w.device}")
    assert x.data_ptr() % 16 == 0 and w.data_ptr() % 16 == 0, "x and weight must be 16-byte aligned"
    assert 0 < n < 2**31, f"N = {n} outside int32"
    y = torch.empty(*x.shape[:-1], n, dtype=torch.float32, device=x.device)
    if m == 0:
        return y
    p = (params or pick_params(m, n, k, num_sms(x.device.index or 0))).normalised(k)
    assert (p.row_tiles, p.unroll) in INSTANCES and p.ring == 0, f"no kernel instance for {p}"
    assert p.warps_n * p.warps_k <= _MAX_WARPS and 1 <= p.splits <= _MAX_SPLITS, f"bad launch shape {p}"
    assert smem_bytes(k, p) <= _MAX_SMEM, f"{p} needs {smem_bytes(k, p)} B of shared memory for K = {k}"
    lib = _lib()
    with torch.cuda.device(x.device):
        err = lib.dsv41_bf16_gemv(x.data_ptr(), w.data_ptr(), y.data_ptr(), m, n, k, p.row_tiles, p.unroll,
                                  p.warps_n, p.warps_k, p.splits, int(p.pdl),
                                  torch.cuda.current_stream(x.device).cuda_stream)
    if err:
        raise RuntimeError(f"bf16_gemv launch {p} for M={m} N={n} K={k} failed: "
                           f"{lib.dsv41_bf16_gemv_error_string(err).decode()}")
    return y


def bf16_gemv_ref(x: Tensor, w: Tensor, chunk: int = 8192) -> Tensor:
    """The test oracle: Σ_k x·w in float64 (every bf16 product and their sum exact to ~2^-53), rounded once
    to fp32; [..., K] x [N, K] -> fp32 [..., N]. Weight rows in chunks (bounded float64 temporaries)."""
    xd = x.reshape(-1, x.size(-1)).double()
    out = torch.cat([xd @ w[i:i + chunk].double().T for i in range(0, w.size(0), chunk)], dim=1)
    return out.float().view(*x.shape[:-1], w.size(0))


def linear_fp32(x: Tensor, w: Tensor) -> Tensor:
    """x [..., K] @ w [N, K]^T in fp32 -> fp32 [..., N]: the reference's fp32 linears (LM head, compressor
    wkv / wgate), which upcast bf16 x and w to fp32. On CUDA with bf16 operands: bf16_gemv for <= MAX_M rows,
    else cuBLAS bf16 x bf16 -> fp32 (`torch.mm(..., out_dtype=torch.float32)`: exact products, fp32
    accumulation, fp32 output); neither keeps an fp32 weight copy. Elsewhere (CPU, fp32 operands) the
    reference's own math, F.linear(x.float(), w.float())."""
    assert w.dim() == 2 and x.size(-1) == w.size(1), f"x {tuple(x.shape)} does not match weight {tuple(w.shape)}"
    if x.is_cuda and x.dtype == torch.bfloat16 and w.dtype == torch.bfloat16:
        if not x.is_contiguous():
            x = x.contiguous()
        if gemv_applies(x, w):
            return bf16_gemv(x, w)
        y = torch.mm(x.view(-1, x.size(-1)), w.t(), out_dtype=torch.float32)
        return y.view(*x.shape[:-1], w.size(0))
    return F.linear(x.float(), w.float())
