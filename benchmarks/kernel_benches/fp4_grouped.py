"""The grouped GEMM on FP4 weights (engine.kernels.fp4_grouped_gemm) against what moe_grouped did before it: every
expert dequantised to bf16 (dequant_fp4_bf16) and torch's grouped GEMM. The released layer's W1|W3 (384 experts of
[4608 x 5120]) and W2 ([5120 x 2304]), rows of random top-6 routes sorted by expert, eager (CUDA events).

    python benchmarks/kernels.py --only fp4_grouped

Then routed_grouped whole (gather, both GEMMs, SwiGLU, scatter) with fused=False / True; the CUDA FP4 GEMVs against
routed_grouped at 1K-8K tokens (where moe_forward should switch, GROUPED_MIN_PAIRS); and the fused GEMM's launch
shapes at 16,384 tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from benchmarks.gpu_timing import eager_time_us, sweep
from engine.kernels.fp4_grouped_gemm import fp4_grouped_gemm, row_blocks
from engine.kernels.moe import routed_fp4
from engine.kernels.moe_grouped import GROUPED_MIN_PAIRS, dequant_fp4_bf16, routed_grouped, sort_pairs
from engine.presets import full_config
from engine.tools.random_moe import random_moe

T_VALUES = (4096, 16384, 32768)
THRESHOLD_T = (1024, 2048, 4096, 8192)  # 16-128 pairs an expert
SWEEP_T = 16384
SWEEP = tuple((bm, bn, bk, w, st, True) for bm, bn, bk, w, st in (
    (128, 128, 64, 4, 2), (128, 128, 64, 4, 3), (128, 128, 64, 4, 4), (128, 64, 64, 4, 3), (64, 128, 64, 4, 3),
    (128, 128, 128, 4, 2), (128, 256, 64, 8, 2), (256, 128, 64, 8, 2), (128, 64, 128, 4, 3), (64, 64, 64, 4, 4)))
_grouped_mm = getattr(F, "grouped_mm", None) or torch._grouped_mm


def _sorted_rows(t: int, k: int, e: int, d: int, seed: int):
    """(rows bf16 [t*k, d] in expert order, ends int32 [e]) of random top-k routes."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    ids = torch.rand(t, e, generator=g, device="cuda").topk(k, dim=-1).indices.int()
    _, ends = sort_pairs(ids, e)
    return torch.randn(t * k, d, generator=g, device="cuda").bfloat16(), ends, ids


def _routed_tokens(t: int, k: int, e: int, d: int, seed: int):
    """routed_grouped's inputs: x bf16 [t, d], ids int32 [t, k] (random top-k routes), weights fp32 [t, k]."""
    _, _, ids = _sorted_rows(t, k, e, 8, seed)
    return torch.randn(t, d, device="cuda").bfloat16(), ids, torch.rand(t, k, device="cuda") * 0.5 + 0.1


def _staged(rows, w, s, ends, staging):
    """The old path for one GEMM: all experts to bf16, then torch's grouped GEMM."""
    dequant_fp4_bf16(w, s, staging)
    return _grouped_mm(rows, staging.transpose(1, 2), offs=ends)


def bench(copy_bw: float) -> None:
    cfg = full_config()
    d, k, e, inter = cfg.dim, cfg.n_activated_experts, cfg.n_routed_experts, cfg.moe_inter_dim
    moe, ex = random_moe(cfg)
    limit = moe.experts[0].limit
    print("\n## fp4_grouped: the routed experts' GEMMs on FP4 weights, us per eager call (W1|W3: [P, 5120] x "
          "[4608, 5120]^T; W2: [P, 2304] x [5120, 2304]^T; P = T x 6 rows)\n")
    print("| T | pairs per expert | GEMM | bf16 copies + grouped_mm us | fused us | speed-up | fused TFLOP/s |")
    print("|---|---|---|---|---|---|---|")
    for t in T_VALUES:
        for name, w, s, kdim in (("W1|W3", ex.w13, ex.s13, d), ("W2", ex.w2, ex.s2, inter)):
            rows, ends, _ = _sorted_rows(t, k, e, kdim, seed=t)
            n = w.size(1)
            staging = torch.empty(e, n, kdim, dtype=torch.bfloat16, device="cuda")
            blocks = row_blocks(ends, rows.size(0), 128)
            old = eager_time_us(lambda: _staged(rows, w, s, ends, staging))
            new = eager_time_us(lambda: fp4_grouped_gemm(rows, w, s, blocks))
            flops = 2 * rows.size(0) * n * kdim
            print(f"| {t} | {t * k / e:.0f} | {name} | {old:.0f} | {new:.0f} | {old / new:.2f} | "
                  f"{flops / new / 1e6:.0f} |", flush=True)
            staging = rows = None  # (freed before the next shape)
            torch.cuda.empty_cache()
    print("\n| T | routed_grouped (bf16 copies) us | fused us | speed-up |")
    print("|---|---|---|---|")
    for t in T_VALUES:
        x, ids, wts = _routed_tokens(t, k, e, d, seed=t)
        old = eager_time_us(lambda: routed_grouped(x, ids, wts, ex, limit, fused=False))
        new = eager_time_us(lambda: routed_grouped(x, ids, wts, ex, limit, fused=True))
        print(f"| {t} | {old:.0f} | {new:.0f} | {old / new:.2f} |", flush=True)
        torch.cuda.empty_cache()
    print(f"\n| T | pairs per expert | CUDA FP4 GEMVs us (moe_forward below {GROUPED_MIN_PAIRS} pairs an expert) | "
          "routed_grouped on the FP4 GEMMs us | GEMVs / grouped |")
    print("|---|---|---|---|---|")
    for t in THRESHOLD_T:  # where moe_forward should switch (moe_grouped.GROUPED_MIN_PAIRS)
        x, ids, wts = _routed_tokens(t, k, e, d, seed=t)
        gemv = eager_time_us(lambda: routed_fp4(x, ids, wts, ex, limit, once_per_token=True))
        grouped = eager_time_us(lambda: routed_grouped(x, ids, wts, ex, limit, fused=True))
        print(f"| {t} | {t * k / e:.0f} | {gemv:.0f} | {grouped:.0f} | {gemv / grouped:.2f} |", flush=True)
    rows, ends, _ = _sorted_rows(SWEEP_T, k, e, d, seed=1)
    flops = 2 * rows.size(0) * ex.w13.size(1) * d
    print(f"\nLaunch shapes of the W1|W3 GEMM at T = {SWEEP_T} ((block_m, block_n, block_k, warps, stages, "
          "dot_scaled): us)")
    res, best = sweep(SWEEP, f"T={SWEEP_T}", lambda c: eager_time_us(lambda: fp4_grouped_gemm(
        rows, ex.w13, ex.s13, row_blocks(ends, rows.size(0), c[0]), block_m=c[0], block_n=c[1], block_k=c[2],
        num_warps=c[3], num_stages=c[4], dot_scaled=c[5])))
    print("- " + "; ".join(f"{c}: {us:.0f}" for c, us in sorted(res.items(), key=lambda kv: kv[1])))
    if res:
        print(f"  best {best[0]}: {best[1]:.0f} us, {flops / best[1] / 1e6:.0f} TFLOP/s", flush=True)
