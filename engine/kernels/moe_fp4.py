"""Routed-expert FP4 GEMVs (decode, and prefill chunks up to FP4_MAX_TOKENS): the CUDA C++ kernels of
`cuda/moe_fp4.cu`.

The same math and contract as engine.kernels.moe's moe_up / moe_down (whose docstring states it), for plans
with tiles of at most 32 pairs (moe_plan(ids, E, block_m) with block_m <= 32; a CTA computes its tile in
fragments of 8 pairs, each weight fragment converted once for all of them: the results do not depend on block_m):

    route_cuda(part, bias)   -> the router's top-k from the gate's partials (engine.kernels.moe.route_scores)
    quant_rows(x)            -> A(x): E4M3 codes (as f16, each group of 8 stored in the order 0 4 1 5 2 6 3 7)
                                and one power-of-two scale per 32 (act_quant bit for bit)
    plan_and_quant(x, ids)   -> moe_plan(ids, E, block_m) bit for bit and quant_rows(x), in one launch
    moe_up_fp4(...)          -> A(h) of h = bf16(w silu(min(g, L)) clamp(u, ±L)) by sorted row (and optionally
                                h itself), g / u = bf16 of the fp32 sums of exact products
    moe_down_fp4(...)        -> o = A(h) W2^T in fp32 by pair

Why CUDA: the Triton grouped GEMM (engine.kernels.moe) spends ~9 CUDA-core operations unpacking each E2M1
element and reaches 18-25% of the copy bandwidth at decode. Here a warp streams its weight rows through a
cp.async ring, ldmatrix hands each thread 8 consecutive elements of one 32-block of a row, and a nibble
becomes an f16 in ~2.5 integer operations (bits moved into place: value * 2^-14, exact; the 2^14 is folded
into the block scale), fed to mma.sync m16n8k16 with the activations' E4M3 codes.

Launch shape (Fp4Params): warps_n x warps_k warps per CTA (32 weight rows per warp: up = 16 outputs' W1 and
W3 rows, down = 32 outputs), a cluster of `splits` CTAs over K, `stages` chunks of 128 K in flight per warp.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import Tensor

from engine.kernels.cuda_build import cuda_kernels_available, load, num_sms

MAX_PAIRS_PER_TILE = 8  # the MMA's N: a decode tile (one fragment)
MAX_TILE_PAIRS = 32  # the widest tile: 4 fragments, each weight fragment converted once for all 4
CHUNK = 128  # K elements per pipeline stage
_MAX_SMEM = 200 * 1024
_SMEM_PER_SM = 228 * 1024
_STAGES = (2, 3, 4, 6, 8)
FP4_MAX_TOKENS = 8192  # moe_forward takes these kernels up to this many tokens (the default step budget), the
#   Triton grouped GEMM above: 0.40-0.66x its time at 64-8,192 tokens on an H100 (benchmarks/RESULTS.md, issue 23)
_PLAN_THREADS = 256  # plan_and_quant's block (cuda/moe_fp4.cu: kPlanThreads)
PLAN_MAX_EXPERTS = (48 * 1024 // 4 - _PLAN_THREADS) // 4  # its shared memory: 4 ints per expert + one per thread
_PERM8 = (0, 2, 4, 6, 1, 3, 5, 7)  # stored position of element e of an 8-group


@dataclass(frozen=True, slots=True)
class Fp4Params:
    """Launch shape of one expert GEMV (see the module docstring)."""

    warps_n: int
    warps_k: int
    splits: int
    stages: int
    pdl: bool = True

    def kc(self, k: int) -> int:
        """K elements per cluster rank (whole chunks)."""
        return CHUNK * _cdiv(k // CHUNK, self.splits)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """The C signatures of cuda/moe_fp4.cu's entry points on a loaded library (also used by the CPU tests)."""
    lib.dsv41_moe_fp4.restype = ctypes.c_int
    lib.dsv41_moe_fp4.argtypes = ([ctypes.c_int] + [ctypes.c_void_p] * 8 + [ctypes.c_int] + [ctypes.c_void_p] * 5
                                  + [ctypes.c_int] * 3 + [ctypes.c_float] + [ctypes.c_int] * 7 + [ctypes.c_void_p])
    lib.dsv41_moe_fp4_smem.restype = ctypes.c_size_t
    lib.dsv41_moe_fp4_smem.argtypes = [ctypes.c_int] * 5
    lib.dsv41_moe_plan_quant.restype = ctypes.c_int
    lib.dsv41_moe_plan_quant.argtypes = ([ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
                                         + [ctypes.c_void_p] * 5 + [ctypes.c_int] * 2 + [ctypes.c_void_p])
    lib.dsv41_moe_quant_rows.restype = ctypes.c_int
    lib.dsv41_moe_quant_rows.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 2 + [ctypes.c_void_p]
    lib.dsv41_moe_route.restype = ctypes.c_int
    lib.dsv41_moe_route.argtypes = ([ctypes.c_void_p] * 4 + [ctypes.c_int] * 4 + [ctypes.c_float, ctypes.c_int]
                                    + [ctypes.c_void_p])
    lib.dsv41_moe_fp4_error_string.restype = ctypes.c_char_p
    lib.dsv41_moe_fp4_error_string.argtypes = [ctypes.c_int]
    return lib


@lru_cache(maxsize=None)
def _lib() -> ctypes.CDLL:
    return declare(load("moe_fp4"))


def tile_pairs_held(x_rows: int) -> int:
    """The pairs a CTA computes for a tile of at most x_rows pairs: whole fragments of 8 (8, 16 or 32)."""
    assert 1 <= x_rows <= MAX_TILE_PAIRS, f"tiles of 1..{MAX_TILE_PAIRS} pairs, got {x_rows}"
    return 8 if x_rows <= 8 else 16 if x_rows <= 16 else 32


def fp4_tile_pairs(num_pairs: int, num_experts: int) -> int:
    """Pairs per plan tile for moe_forward: 8 while experts average at most 8 pairs (decode, chunks of up to
    ~512 tokens at 384 experts x top-6), then 16, so that an expert's weights are converted once per 16 of its
    pairs instead of once per 8. Never 32: on the H100 (kernels.py --only moe_tokens, 2026-12-07) tiles of 16 took
    0.87-0.95x the time of tiles of 8 from 1,024 to 8,192 tokens (1.07x at 512), and tiles of 32 1.7-3.7x at every
    size: their activations and partials fill the shared memory, so pick_params gives them more splits and fewer
    warps."""
    return 8 if num_pairs <= 8 * max(1, num_experts) else 16


def smem_bytes(k: int, x_rows: int, p: Fp4Params) -> int:
    """Shared memory of one CTA: activations f16 [x_rows, kc (+32)], scales, fp32 partials, the warps' rings."""
    kc = p.kc(k)
    stride = kc + 32 if kc % 64 == 0 else kc
    a128 = lambda b: _cdiv(b, 128) * 128  # noqa: E731
    m = tile_pairs_held(x_rows)
    b = a128(x_rows * stride * 2)
    b = a128(b + (kc // 32) * m * 4)
    b = a128(b + p.warps_k * m * p.warps_n * 32 * 4)
    return b + p.warps_n * p.warps_k * p.stages * (32 * 64 + 32 * 4)


def pick_params(up: bool, n: int, k: int, tiles: int, x_rows: int, num_sms: int = 132) -> Fp4Params:
    """8 warps of 32 weight rows each, K over a 2-CTA cluster, 2 stages per warp: the best shape for both
    GEMVs at T = 1 and T = 8 in the H200 sweep (benchmarks/kernel_benches/moe.py, 2026-11-30; deeper rings
    and more, smaller CTAs were slower). More splits only where shared memory needs them (two CTAs per SM), then
    (wide tiles: their activations and partials) fewer warps."""
    p = Fp4Params(8, 1, 2, 2)
    while smem_bytes(k, x_rows, p) > _MAX_SMEM // 2 and (p.splits < 8 or p.warps_n > 2):
        more = p.splits < 8
        p = Fp4Params(p.warps_n if more else p.warps_n // 2, p.warps_k, p.splits + 1 if more else p.splits, p.stages)
    return _normalised(p, k)


def _normalised(p: Fp4Params, k: int) -> Fp4Params:
    chunks = k // CHUNK
    per = _cdiv(chunks, min(p.splits, chunks))
    return Fp4Params(p.warps_n, p.warps_k, _cdiv(chunks, per), p.stages, p.pdl)


def _check(err: int, what: str) -> None:
    if err:
        raise RuntimeError(f"{what} failed: {_lib().dsv41_moe_fp4_error_string(err).decode()}")


def _stream(t: Tensor) -> int:
    return torch.cuda.current_stream(t.device).cuda_stream


def quant_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """act_quant of bf16 rows [R, K] for the kernels: (codes f16 [R, K] in the permuted order, scales fp32
    [R, K/32]). dequant_rows inverts it."""
    assert x.dtype == torch.bfloat16 and x.dim() == 2 and x.is_contiguous() and x.is_cuda, f"x: {x.dtype} {x.shape}"
    r, k = x.shape
    assert k % 32 == 0 and x.data_ptr() % 16 == 0, f"K = {k} must be a multiple of 32, x 16-byte aligned"
    xq = torch.empty(r, k, dtype=torch.float16, device=x.device)
    xs = torch.empty(r, k // 32, dtype=torch.float32, device=x.device)
    with torch.cuda.device(x.device):
        _check(_lib().dsv41_moe_quant_rows(x.data_ptr(), xq.data_ptr(), xs.data_ptr(), r, k, _stream(x)),
               "quant_rows")
    return xq, xs


ROUTE_MAX_EXPERTS = 1024  # route_kernel: one thread per expert
ROUTE_MAX_TOPK = 32


def route_cuda(part: Tensor, bias: Tensor, topk: int, route_scale: float, norm_topk: bool) -> tuple[Tensor, Tensor]:
    """engine.kernels.moe.route_scores on CUDA, one CTA per token and one thread per expert (4.4 us at T = 1 on the
    H200 against the Triton route's 5.2: a chain of block reductions): part fp32 [splits, T, E] (the gate's split
    partials), bias fp32 [E] -> (weights fp32 [T, k], ids int32 [T, k]). The same math: the splits summed in order,
    sqrt-softplus (log1p and sqrt to within an ulp of route_scores'), top-k of score + bias by repeated argmax with
    the lowest id among exact ties, weights normalised in slot order."""
    assert part.dtype == torch.float32 and part.dim() == 3 and part.is_contiguous() and part.is_cuda, (
        f"part: {part.dtype} {tuple(part.shape)}")
    splits, t, e = part.shape
    assert bias.dtype == torch.float32 and bias.shape == (e,) and bias.is_contiguous() and bias.device == part.device, (
        f"bias: {bias.dtype} {tuple(bias.shape)}")
    assert 1 <= e <= ROUTE_MAX_EXPERTS and 1 <= topk <= min(e, ROUTE_MAX_TOPK), f"E = {e}, topk = {topk}"
    weights = torch.empty(t, topk, dtype=torch.float32, device=part.device)
    ids = torch.empty(t, topk, dtype=torch.int32, device=part.device)
    with torch.cuda.device(part.device):
        _check(_lib().dsv41_moe_route(part.data_ptr(), bias.data_ptr(), weights.data_ptr(), ids.data_ptr(), splits,
                                      t, e, topk, float(route_scale), int(bool(norm_topk) and topk > 1), _stream(part)),
               "route_cuda")
    return weights, ids


def plan_and_quant(x: Tensor, ids: Tensor, num_experts: int, block_m: int = MAX_PAIRS_PER_TILE
                   ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """engine.kernels.moe.moe_plan(ids, num_experts, block_m), bit for bit, and quant_rows(x), in one launch
    (block 0 plans, the others quantise; the Triton plan is one ~9-15 us program at decode):
    (sorted_pairs int32 [R], tiles int32 [3, max_tiles] = expert, first sorted row, rows; xq, xs)."""
    assert ids.dtype == torch.int32 and ids.dim() == 2 and ids.is_contiguous() and ids.device == x.device, (
        f"ids: {ids.dtype} {tuple(ids.shape)}")
    assert x.dtype == torch.bfloat16 and x.dim() == 2 and x.is_contiguous() and x.is_cuda, f"x: {x.dtype} {x.shape}"
    assert x.size(1) % 32 == 0 and x.data_ptr() % 16 == 0 and 1 <= num_experts <= PLAN_MAX_EXPERTS
    r = ids.numel()
    max_tiles = min(num_experts, r) + r // block_m
    sorted_pairs = torch.empty(r, dtype=torch.int32, device=x.device)
    tiles = torch.empty(3, max_tiles, dtype=torch.int32, device=x.device)
    xq = torch.empty(x.shape, dtype=torch.float16, device=x.device)
    xs = torch.empty(x.size(0), x.size(1) // 32, dtype=torch.float32, device=x.device)
    with torch.cuda.device(x.device):
        _check(_lib().dsv41_moe_plan_quant(ids.data_ptr(), r, num_experts, block_m, max_tiles, sorted_pairs.data_ptr(),
                                           tiles.data_ptr(), x.data_ptr(), xq.data_ptr(), xs.data_ptr(), x.size(0),
                                           x.size(1), _stream(x)), "plan_and_quant")
    return sorted_pairs, tiles, xq, xs


def dequant_rows(xq: Tensor, xs: Tensor) -> Tensor:
    """(codes in the permuted order, scales) -> the QDQ values, fp32 [R, K] in natural order (exact)."""
    r, k = xq.shape
    natural = xq.view(r, k // 8, 8)[:, :, list(_PERM8)].reshape(r, k)
    return natural.float() * xs.repeat_interleave(32, dim=1)


def _launch(up: bool, w: Tensor, ws: Tensor, xq: Tensor, xs: Tensor, plan, rw: Tensor | None, outs: dict,
            n: int, k: int, limit: float, max_tile_rows: int | None, params: Fp4Params | None) -> None:
    tiles = plan.tile_rows.numel()
    if tiles == 0:
        return
    assert plan.block_m <= MAX_TILE_PAIRS, f"plan tiles of {plan.block_m} pairs; the kernels take <= {MAX_TILE_PAIRS}"
    assert k % CHUNK == 0 and n % 32 == 0, f"K = {k} must be a multiple of {CHUNK}, N = {n} of 32"
    bound = min(plan.block_m, plan.sorted_pairs.numel())
    x_rows = max(1, bound if max_tile_rows is None else min(max_tile_rows, bound))
    p = _normalised(params, k) if params else pick_params(up, n, k, tiles, x_rows,
                                                          num_sms(w.device.index or 0))
    assert p.stages in _STAGES and p.warps_n * p.warps_k <= 8 and 1 <= p.splits <= 8, f"bad launch shape {p}"
    assert not up or p.warps_n % 2 == 0, f"up needs an even warps_n (32-output quantisation blocks): {p}"
    smem = smem_bytes(k, x_rows, p)
    assert smem <= _MAX_SMEM, f"{p} needs {smem} B of shared memory"
    null = 0
    ptr = lambda t: t.data_ptr() if t is not None else null  # noqa: E731
    with torch.cuda.device(w.device):
        err = _lib().dsv41_moe_fp4(
            int(up), w.data_ptr(), ws.data_ptr(), xq.data_ptr(), xs.data_ptr(), plan.sorted_pairs.data_ptr(),
            plan.tile_expert.data_ptr(), plan.tile_start.data_ptr(), plan.tile_rows.data_ptr(), tiles, ptr(rw),
            ptr(outs.get("hq")), ptr(outs.get("hs")), ptr(outs.get("h")), ptr(outs.get("out")), n, k, plan.topk,
            float(limit), p.kc(k), x_rows, p.warps_n, p.warps_k, p.splits, p.stages, int(p.pdl), _stream(w))
    _check(err, f"moe_fp4 {'up' if up else 'down'} {p} N={n} K={k}")


def _check_common(experts, plan, xq: Tensor, xs: Tensor, k: int) -> None:
    assert xq.dtype == torch.float16 and xs.dtype == torch.float32 and xq.is_cuda, "activations from quant_rows"
    assert xq.dim() == 2 and xq.size(1) == k and xs.shape == (xq.size(0), k // 32), (xq.shape, xs.shape, k)
    assert xq.is_contiguous() and xs.is_contiguous() and xq.data_ptr() % 16 == 0
    for t in (experts.w13, experts.w2, experts.s13, experts.s2):
        assert t.is_contiguous() and t.device == xq.device and t.data_ptr() % 16 == 0, "experts: contiguous, aligned"
    for t in (plan.sorted_pairs, plan.tile_expert, plan.tile_start, plan.tile_rows):
        assert t.dtype == torch.int32 and t.device == xq.device


def moe_up_fp4(xq: Tensor, xs: Tensor, experts, plan, weights: Tensor, limit: float, want_h: bool = False,
               max_tile_rows: int | None = None, params: Fp4Params | None = None
               ) -> tuple[Tensor, Tensor, Tensor | None]:
    """Routed W1/W3 + SwiGLU of the plan's pairs: (xq, xs) = quant_rows(x) of the tokens [T, D], weights fp32
    [T, k] -> (hq f16 [T*k, I], hs fp32 [T*k, I/32], h bf16 [T*k, I] or None) by sorted row: A(h) for
    moe_down_fp4, and h itself when want_h. Rows of dropped pairs (id -1) are not written.
    max_tile_rows: a bound on the pairs of any tile that the caller guarantees (min(8, T) when no token
    names an expert twice, as the router's ids): the activation rows held in shared memory (default: the
    plan's bound, min(8, T*k))."""
    d = experts.w13.size(2) * 2
    inter = experts.inter
    _check_common(experts, plan, xq, xs, d)
    assert weights.dtype == torch.float32 and weights.is_contiguous() and weights.numel() == plan.sorted_pairs.numel()
    r = plan.sorted_pairs.numel()
    outs = {"hq": torch.empty(r, inter, dtype=torch.float16, device=xq.device),
            "hs": torch.empty(r, inter // 32, dtype=torch.float32, device=xq.device)}
    if want_h:
        outs["h"] = torch.empty(r, inter, dtype=torch.bfloat16, device=xq.device)
    _launch(True, experts.w13, experts.s13.view(torch.uint8), xq, xs, plan, weights, outs, inter, d, limit,
            max_tile_rows, params)
    return outs["hq"], outs["hs"], outs.get("h")


def moe_down_fp4(hq: Tensor, hs: Tensor, experts, plan, max_tile_rows: int | None = None,
                 params: Fp4Params | None = None) -> Tensor:
    """Routed W2: (hq, hs) by sorted row (moe_up_fp4's) -> fp32 [T*k, D] by pair (dropped pairs' rows are not
    written). max_tile_rows as for moe_up_fp4."""
    d, inter = experts.w2.size(1), experts.inter
    _check_common(experts, plan, hq, hs, inter)
    assert hq.size(0) == plan.sorted_pairs.numel()
    out = torch.empty(hq.size(0), d, dtype=torch.float32, device=hq.device)
    _launch(False, experts.w2, experts.s2.view(torch.uint8), hq, hs, plan, None, {"out": out}, d, inter, 0.0,
            max_tile_rows, params)
    return out


def fp4_applies(x: Tensor, experts) -> bool:
    """Whether moe_forward should use these kernels: CUDA (sm_90+, nvcc), the shapes the kernels take, and at most
    FP4_MAX_TOKENS tokens."""
    d, inter = experts.w13.size(2) * 2, experts.inter
    return (x.is_cuda and 0 < x.size(0) <= FP4_MAX_TOKENS and d % CHUNK == 0 and inter % CHUNK == 0
            and cuda_kernels_available(x.device.index or 0))
