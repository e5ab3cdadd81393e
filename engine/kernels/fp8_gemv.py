"""FP8 block-scaled GEMV for decode shapes (M = 1..8): the CUDA C++ kernel of `cuda/fp8_gemv.cu`.

Two entry points: `fp8_gemv` (one matrix, activation quantisation fused: fp8_linear's math) and
`fp8_gemv_grouped` (G matrices stacked in one FP8 weight, each applied to its own slice of x; activations
either act_quant-ed or used exactly as bf16: the attention output projection wo_a). fp8_gemv is
fp8_gemv_grouped(x, weight, scale, 1, quant_x=True): the same kernel instance and launch.

fp8_gemv (quant_x=True):

Same math and contract as engine.kernels.fp8_linear.fp8_linear (whose docstring states it), with the
activation quantisation fused (act_quant bit for bit, per CTA, into shared memory):

    y[m, n] = bf16( Σ_kb (Σ_{k in kb} qa[m, k] · qw[n, k]) · (sa[m, kb] · sw[n // 32, kb]) )

Block sums are exact products summed in fp32 (mma.sync f16 x f16 -> f32: E4M3 values are exact in f16),
scaled per 32-block in fp32 and accumulated in K order, as fp8_linear_ref does; the split-K reduction
(warps through shared memory, then the CTAs of a thread-block cluster) runs in a fixed order, so the
result is deterministic. No workspace and no atomics: any stream, CUDA-graph capturable. With
programmatic dependent launch (GemvParams.pdl, default on) the first weight loads are issued before the
kernel waits for its predecessor on the stream; x is read and y written only after that wait.

fp8_gemv_grouped(x, weight, scale, G, quant_x=False): the bf16-exact mode (see fp8_gemv_bf16_ref):

    y[m, g, r] = bf16( Σ_d x[m, g, d] · w[g·R + r, d] ),   w = qw · sw (the exact FP8 weight)

with no activation quantisation. The kernel stages each 32-block of x in f16 as x / sa, sa =
2^max(floor(log2 amax) - 15, -126) (all-zero block: sa = 1): every element with |x| >= amax·2^-32 is exact
(see `bf16_exact_stage` and the header of cuda/fp8_gemv.cu for the derivation); a smaller one is rounded
to the f16 quantum, an absolute error <= 2^-40·amax of its block. The f16 x E4M3 products are exact, so the
only other error is the fp32 accumulation (the same as fp8_gemv's).

Both entry points take out_dtype=torch.float32: y is then the fp32 sum before its bf16 rounding (the same
launch, products, sums and order; bf16(y_fp32) is bit for bit the bf16 form's y): the partial of a
row-parallel product, summed over the model's shards and rounded once (engine/core/kernel_ops.py).

Memory traffic (the floor): N·K weight bytes + N·K/1024 scale bytes + 2·M·K (x) + 2·M·N (y); each CTA
also re-reads its K range of x from L2 (2·M·K·N / rows per CTA bytes of L2 traffic).

Launch shape (GemvParams): a warp owns row_tiles x 16 rows; a CTA has warps_n x warps_k warps (warps_k
split the CTA's K range), a cluster of `splits` CTAs splits K further. Two forms of the weight path, with the
same products, sums and order (bitwise equal results): ring = 0, unroll = 32-blocks of weight loaded into
registers per warp per step (8 bytes per thread per row per block); ring = 2..4, the weights staged through a
per-warp shared-memory ring of that many stages of 4 blocks (cp.async), so that ring - 1 stages are in flight
while one is computed.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache

import torch
from torch import Tensor

from engine.kernels.cuda_build import cuda_kernels_available, load, num_sms
from engine.kernels.gemv_shapes import MAX_SPLITS as _MAX_SPLITS
from engine.kernels.gemv_shapes import MAX_WARPS as _MAX_WARPS
from engine.kernels.gemv_shapes import GemvParams, model_shape
from engine.kernels.gemv_shapes import cdiv as _cdiv
from engine.quant import BLOCK, check_fp8_linear_args, dequant_fp8_weight

MAX_M = 8  # the MMA's N: tokens per launch
MAX_K = 65536  # 8 cluster splits of <= 8192 columns: every K up to this has a launch shape
MAX_GROUPS = 65535  # the grid's z dimension
_MAX_SMEM = 200 * 1024  # the launcher's opt-in limit (kMaxSmem in cuda/fp8_gemv.cu)
_CTA_OVERHEAD_BYTES = 4096  # pick_params: a CTA's start-up (x quantisation, reduction) in weight-byte terms


def smem_bytes(k: int, p: GemvParams) -> int:
    """Shared memory of one CTA: x as f16 [8, kc (+32 pad)], sa [kc/32, 8], fp32 partials [warps_k, 8, rows]; the
    ring form adds, 128-byte aligned, each warp's ring of p.ring stages of 128 bytes per row."""
    kbc = _cdiv(k // BLOCK, p.splits)
    kc = kbc * BLOCK
    stride = kc + 32 if kc % 64 == 0 else kc
    b = MAX_M * stride * 2 + kbc * MAX_M * 4 + p.warps_k * MAX_M * p.rows_per_cta * 4
    if p.ring:
        b = _cdiv(b, 128) * 128 + p.warps_n * p.warps_k * p.ring * p.row_tiles * 16 * 4 * BLOCK
    return b


# Launch shapes of the V4.1 matrices from the H200 sweep (benchmarks/kernel_benches/fp8_gemv.py --sweep,
# 2026-11-30), (N, K) -> (shape for M <= 4, shape for M > 4); us at M = 1 / 8 against the model's pick:
# wq_a 6.1 / 6.4 (8.8 / 10.5), wq_b 15.9 / 17.0 (the model's), wo_b 18.0 / 19.5 (25.0 / 27.4),
# shared w2 8.0 / 8.3 (11.3 / 12.0; 11.1 / 8.6 in a later run); the Engram layers' wkv 59.9 / 62.4 (67.9 / 71.3;
# `--sweep --shapes engram_wkv --m 1,8`, 2026-11-30, later session). The ring form (the same sweep with ring
# shapes, 2026-11-30, fourth and fifth sessions) then took wq_b 14.7 / 16.2, wo_b 17.1 / 17.3 and the Engram wkv
# 53.0 / 57.1, and every layer 5-20 us at T = 1 (benchmarks/RESULTS.md, seventh pass). Other shapes use the model.
# The shared expert's shapes (stacked W1|W3 4608 x 5120, w2) run on a side stream beside the router and the
# routed-expert GEMVs, with ~90 us of slack at T = 1. They take narrow grids, so that the critical path's small
# kernels (the route) and the expert GEMVs keep SMs: the ring form, W1|W3 rt2 ring2 8x1w s4 (72 CTAs; 13.7 us in
# the layer), w2 rt2 ring2 8x1w s2 (40 CTAs). Every layer was 5-8 us faster at T = 1 than with the model's W1|W3
# shape (252 CTAs) and w2's isolated best (480 CTAs); narrow register grids (36 or 108 CTAs) gained nothing (H200,
# 2026-11-30, fifth session). Earlier, W1|W3's isolated best (rt2 u8 4x2w s6: 11.7 / 12.6 us) had made the layer
# slower (223 -> 238-241 us at T = 1).
_TUNED: dict[tuple[int, int], tuple[GemvParams, GemvParams]] = {
    (1280, 5120): (GemvParams(2, 4, 2, 4, 8), GemvParams(2, 2, 2, 4, 8)),
    (32768, 1280): (GemvParams(2, 4, 8, 1, 1, ring=3), GemvParams(2, 4, 8, 1, 1, ring=3)),
    (5120, 8192): (GemvParams(1, 2, 8, 1, 8, ring=3), GemvParams(1, 2, 8, 1, 8, ring=3)),
    (4608, 5120): (GemvParams(2, 4, 8, 1, 4, ring=2), GemvParams(2, 4, 8, 1, 4, ring=2)),
    (5120, 2304): (GemvParams(2, 4, 8, 1, 2, ring=2), GemvParams(2, 4, 8, 1, 2, ring=2)),
    (25600, 6144): (GemvParams(2, 4, 8, 1, 2, ring=4), GemvParams(2, 4, 8, 1, 2, ring=4)),
}


# Grouped shapes, (groups, N per group, K) -> (shape for M <= 4, shape for M > 4), from the H200 sweep
# (`benchmarks/kernel_benches/fp8_gemv.py --sweep --shapes wo_a --m 1,8`, 2026-11-30): wo_a in the ring form
# 12.7 / 13.8 us at M = 1 / 6 (the register form's best, rt2 u2 8x1w s6: 14.5 / 15.1; the model's rt2 u4 8x1w s8:
# 20.4 / 21.2); every layer 4-10 us faster at T = 1 (benchmarks/RESULTS.md, seventh pass).
_TUNED_GROUPED: dict[tuple[int, int, int], tuple[GemvParams, GemvParams]] = {
    (8, 1024, 4096): (GemvParams(2, 4, 4, 2, 2, ring=4), GemvParams(2, 4, 4, 2, 2, ring=3)),
}


@lru_cache(maxsize=1024)
def pick_params(m: int, n: int, k: int, num_sms: int = 132, groups: int = 1) -> GemvParams:
    """The swept shape for the V4.1 matrices (_TUNED, _TUNED_GROUPED), else gemv_shapes.model_shape (x read
    as 2-byte elements, counted at the FP8 weight's 1 byte: it comes from L2). n is the rows of one group; the
    groups multiply the CTAs (the grid's z dimension)."""
    if groups == 1 and (n, k) in _TUNED:
        return _TUNED[(n, k)][m > 4]
    if (groups, n, k) in _TUNED_GROUPED:
        return _TUNED_GROUPED[(groups, n, k)][m > 4]
    return model_shape(m, n, k, weight_bytes=1, smem_bytes=smem_bytes, max_smem=_MAX_SMEM,
                       overhead_bytes=_CTA_OVERHEAD_BYTES, num_sms=num_sms, groups=groups)


@lru_cache(maxsize=None)
def _lib() -> ctypes.CDLL:
    lib = load("fp8_gemv")
    lib.dsv41_fp8_gemv.restype = ctypes.c_int
    lib.dsv41_fp8_gemv.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 9 + [ctypes.c_void_p]
    lib.dsv41_fp8_gemv_grouped.restype = ctypes.c_int
    lib.dsv41_fp8_gemv_grouped.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 12 + [ctypes.c_void_p]
    lib.dsv41_fp8_gemv_smem.restype = ctypes.c_size_t
    lib.dsv41_fp8_gemv_smem.argtypes = [ctypes.c_int] * 5
    lib.dsv41_fp8_gemv_ring.restype = ctypes.c_int
    lib.dsv41_fp8_gemv_ring.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 12 + [ctypes.c_void_p]
    lib.dsv41_fp8_gemv_ring_smem.restype = ctypes.c_size_t
    lib.dsv41_fp8_gemv_ring_smem.argtypes = [ctypes.c_int] * 6
    lib.dsv41_cuda_error_string.restype = ctypes.c_char_p
    lib.dsv41_cuda_error_string.argtypes = [ctypes.c_int]
    return lib


def gemv_applies(x: Tensor, weight: Tensor) -> bool:
    """Whether fp8_linear should route this call here: CUDA, 1..MAX_M rows, 16-byte aligned, buildable."""
    m = x.numel() // max(1, x.size(-1))
    return (x.is_cuda and 0 < m <= MAX_M and x.size(-1) <= MAX_K and x.data_ptr() % 16 == 0
            and weight.data_ptr() % 16 == 0 and cuda_kernels_available(x.device.index or 0))


def grouped_gemv_applies(x: Tensor, weight: Tensor, groups: int) -> bool:
    """Whether fp8_gemv_grouped can take this call: CUDA, 1..MAX_M rows of G·K, 16-byte aligned, R % 32 == 0
    for G > 1, buildable (the caller still owns the dtype/shape contract that fp8_gemv_grouped asserts)."""
    k = x.size(-1)
    m = x.numel() // max(1, groups * k)
    return (x.is_cuda and 0 < m <= MAX_M and k <= MAX_K and 1 <= groups <= MAX_GROUPS
            and weight.size(0) % groups == 0 and (groups == 1 or (weight.size(0) // groups) % BLOCK == 0)
            and x.data_ptr() % 16 == 0 and weight.data_ptr() % 16 == 0 and cuda_kernels_available(x.device.index or 0))


def _launch(x: Tensor, weight: Tensor, scale: Tensor, y: Tensor, m: int, n: int, k: int, groups: int,
            quant_x: bool, params: GemvParams | None) -> None:
    """Launch the kernel on contract-checked tensors (n = rows per group; y bf16, or fp32 for the unrounded
    sums); raises RuntimeError on failure."""
    p = (params or pick_params(m, n, k, num_sms(x.device.index or 0), groups)).normalised(k)
    assert p.row_tiles in (1, 2) and (p.unroll in (2, 4, 8) if p.ring == 0 else 2 <= p.ring <= 4), (
        f"no kernel instance for {p}")
    assert p.warps_n * p.warps_k <= _MAX_WARPS and 1 <= p.splits <= _MAX_SPLITS, f"bad launch shape {p}"
    assert smem_bytes(k, p) <= _MAX_SMEM, f"{p} needs {smem_bytes(k, p)} B of shared memory for K = {k}"
    lib = _lib()
    with torch.cuda.device(x.device):
        launch = lib.dsv41_fp8_gemv_ring if p.ring else lib.dsv41_fp8_gemv_grouped
        err = launch(x.data_ptr(), weight.data_ptr(), scale.data_ptr(), y.data_ptr(), m, n, k, groups, int(quant_x),
                     int(y.dtype == torch.float32), p.row_tiles, p.ring or p.unroll, p.warps_n, p.warps_k, p.splits,
                     int(p.pdl), torch.cuda.current_stream(x.device).cuda_stream)
    if err:
        raise RuntimeError(f"fp8_gemv launch {p} for M={m} N={n} K={k} G={groups} quant_x={quant_x} {y.dtype} failed: "
                           f"{lib.dsv41_cuda_error_string(err).decode()}")


def check_out_dtype(out_dtype: torch.dtype) -> None:
    assert out_dtype in (torch.bfloat16, torch.float32), f"out_dtype must be bf16 or fp32, got {out_dtype}"


def fp8_gemv(x: Tensor, weight: Tensor, scale: Tensor, params: GemvParams | None = None,
             out_dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """y = act_quant(x) @ weight^T with per-block scales: bf16 [..., K] x FP8 [N, K] -> bf16 [..., N] (fp32
    with out_dtype=torch.float32: the sums before their rounding).

    At most MAX_M rows of x (the leading dims flattened); weight float8_e4m3fn [N, K] (K % 32 == 0),
    scale float8_e8m0fnu [ceil(N/32), K/32]; all contiguous, 16-byte aligned and on one CUDA device.
    Matches fp8_linear_ref within the tolerance of tests/kernels/test_fp8_linear.py (GPU_EPS).
    """
    check_fp8_linear_args(x, weight, scale)
    check_out_dtype(out_dtype)
    n, k = weight.shape
    m = x.numel() // k
    assert m <= MAX_M, f"fp8_gemv takes at most {MAX_M} rows, got {m} (use fp8_linear)"
    assert x.is_cuda, f"fp8_gemv needs a CUDA device, got {x.device}"
    assert x.data_ptr() % 16 == 0 and weight.data_ptr() % 16 == 0, "x and weight must be 16-byte aligned"
    assert n < 2**31 and k < 2**31, f"N = {n}, K = {k} exceed int32"
    y = torch.empty(*x.shape[:-1], n, dtype=out_dtype, device=x.device)
    if m == 0:
        return y
    _launch(x, weight, scale, y, m, n, k, 1, True, params)
    return y


def fp8_gemv_grouped(x: Tensor, weight: Tensor, scale: Tensor, groups: int, quant_x: bool,
                     params: GemvParams | None = None, out_dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """Grouped GEMV: y[..., g, r] = Σ_d stage(x)[..., g, d] · w[g·R + r, d] -> bf16 [..., G, R] (fp32 with
    out_dtype=torch.float32: the sums before their rounding).

    x bf16 [..., G, K] (for G = 1 also [..., K]: y is then [..., R]); weight float8_e4m3fn [G·R, K]
    (K % 32 == 0; R % 32 == 0 when G > 1) with scale float8_e8m0fnu [ceil(G·R/32), K/32] (the checkpoint's
    layout of the stacked groups); at most MAX_M tokens (x's leading dims flattened); all contiguous,
    16-byte aligned, on one CUDA device. quant_x=True: act_quant(x) per 32 (fp8_gemv's math, per group:
    fp8_linear_ref on each group's rows); quant_x=False: bf16-exact (fp8_gemv_bf16_ref within 1 bf16 ULP +
    the fp32 accumulation + the tiny-element rounding of the module docstring).
    """
    check_fp8_linear_args(x, weight, scale)
    check_out_dtype(out_dtype)
    rows, k = weight.shape
    assert isinstance(groups, int) and 1 <= groups <= MAX_GROUPS, f"groups must be 1..{MAX_GROUPS}, got {groups}"
    assert rows % groups == 0, f"weight rows {rows} are not {groups} equal groups"
    n = rows // groups
    assert groups == 1 or n % BLOCK == 0, f"rows per group {n} must be a multiple of {BLOCK} when groups > 1"
    assert groups == 1 or (x.dim() >= 2 and x.size(-2) == groups), (
        f"x {tuple(x.shape)} must be [..., {groups}, {k}] for {groups} groups")
    m = x.numel() // (groups * k)
    assert m <= MAX_M, f"fp8_gemv_grouped takes at most {MAX_M} tokens, got {m}"
    assert x.is_cuda, f"fp8_gemv_grouped needs a CUDA device, got {x.device}"
    assert x.data_ptr() % 16 == 0 and weight.data_ptr() % 16 == 0, "x and weight must be 16-byte aligned"
    assert rows < 2**31 and k < 2**31, f"N = {rows}, K = {k} exceed int32"
    y = torch.empty(*x.shape[:-1], n, dtype=out_dtype, device=x.device)
    if m == 0:
        return y
    _launch(x, weight, scale, y, m, n, k, groups, bool(quant_x), params)
    return y


def bf16_exact_stage(x: Tensor) -> tuple[Tensor, Tensor]:
    """The bf16-exact mode's staging of x, in torch (the kernel's, bit for bit): bf16 [..., K] ->
    (xs float16 [..., K], sa float32 [..., K/32]) with xs = f16_rn(x / sa) per 32-block and
    sa = 2^max(floor(log2 amax) - 15, -126) (1 for an all-zero block). s·xs == x for every |x| >= amax·2^-32."""
    assert x.dtype == torch.bfloat16 and x.size(-1) % BLOCK == 0, f"bf16 [..., K % 32 == 0], got {x.dtype} {x.shape}"
    xg = x.float().unflatten(-1, (-1, BLOCK))
    amax_bits = xg.abs().amax(dim=-1).view(torch.int32)
    biased = torch.where(amax_bits == 0, 127, ((amax_bits >> 23) - 15).clamp_min(1))
    sa = (biased << 23).view(torch.float32)
    inv = ((254 - biased) << 23).view(torch.float32)
    xs = (xg * inv.unsqueeze(-1)).to(torch.float16)
    return xs.flatten(-2), sa


def fp8_gemv_bf16_ref(x: Tensor, weight: Tensor, scale: Tensor, groups: int = 1) -> Tensor:
    """The bf16-exact mode's oracle, the golden model's wo_a math (engine/model/attention.py `output`):
    y[..., g, r] = bf16( Σ_d x[..., g, d] · w[g·R + r, d] ) with w = dequant(weight, scale) exact, the sum in
    float64 and rounded once. x bf16 [..., G, K] (or [..., K] for G = 1) -> bf16 [..., G, R] ([..., R])."""
    rows, k = weight.shape
    n = rows // groups
    w = dequant_fp8_weight(weight, scale).double().view(groups, n, k)
    y = torch.einsum("mgd,grd->mgr", x.double().reshape(-1, groups, k), w)
    return y.to(torch.bfloat16).view(*x.shape[:-1], n)
