"""The indexer over a prefill chunk's queries (engine/kernels/indexer.py: index_scores_rows) on one GPU.

    python benchmarks/kernels.py --only indexer_rows

Shape from full_config(): H = 32 index heads x D = 128, MXFP4 key records (68 B) at random slots of one request's
index-key pool. M queries of one chunk at the end of a T-entry context (each sees all T entries but the last
few: ratio-2 causality). Rates: FLOP = 2·M·H·T·D (the QK products), as a share of the measured ~790 TFLOP/s dense
bf16 peak; scores written = 2·M·T bytes. Baseline in the same run: what the kernel path did before
(kernel_ops.index_scores_any with ROWS_MIN_M out of reach: the CUDA scan 8 queries a launch, looped). Also
the top-k of the same scores (engine/kernels/topk.py: index_topk, top-512), which follows every pass.
Eager timing (benchmarks.gpu_timing.eager_time_us): the baseline is a Python loop of launches.
"""

from __future__ import annotations

import torch

from benchmarks.gpu_timing import eager_time_us, sweep
from engine.core import kernel_ops
from engine.kernels.indexer import index_scores_rows
from engine.kernels.topk import index_topk
from engine.presets import full_config
from tests.kernels.numeric import index_problem

PEAK_BF16 = 790e12  # dense bf16 matmul measured on the H200 (shared/spec/environment.md)
SHAPES = ((2048, 65536), (512, 524288), (8192, 16384))  # (queries M, entries T): 128K and 1M contexts at ratio 2
# block_t, queries_per_program, num_warps, cast_rounding, transposed, packed; the first is index_scores_rows' default
CONFIGS = ((64, 32, 4, True, True, True), (64, 32, 4, True, True, False), (64, 64, 4, True, True, True),
           (64, 32, 4, True, False, True), (64, 32, 8, True, True, True), (128, 32, 4, True, True, True),
           (128, 32, 8, True, True, True), (64, 32, 4, True, False, False), (32, 32, 4, True, True, True),
           (64, 32, 8, True, True, False), (128, 32, 4, True, True, False))


def bench(copy_bw: float) -> None:
    cfg = full_config()
    h, d = cfg.index_n_heads, cfg.index_head_dim
    print(f"\n## indexer_rows: a prefill chunk's index scores (H={h}, D={d}); us, eager; baseline = the looped scan")
    print("| M queries | T entries | rows kernel (best config) | TFLOP/s | % bf16 peak | scores GB/s "
          "| looped scan (before) | speed-up | top-512 of the scores |")
    print("|---|---|---|---|---|---|---|---|---|")
    for m, t in SHAPES:
        q, w, pool, slots, _ = index_problem(m, h, d, t, entries=t + 1000, device="cuda", seed=m)
        visible = (t - m // 2 + (torch.arange(m, device="cuda") + 1) // 2).clamp(max=t).to(torch.int32)
        runs, (best, us) = sweep(CONFIGS, f"M={m} T={t}", lambda c: eager_time_us(
            lambda: index_scores_rows(q, w, pool, slots, visible, block_t=c[0], queries_per_program=c[1],
                                      num_warps=c[2], cast_rounding=c[3], transposed=c[4],
                                      packed=c[5]), reps=3))
        default = runs.get(CONFIGS[0], float("nan"))
        old_min = kernel_ops.ROWS_MIN_M
        kernel_ops.ROWS_MIN_M = 1 << 30
        try:
            before = eager_time_us(lambda: kernel_ops.index_scores_any(q, w, pool, slots, visible), reps=2)
        finally:
            kernel_ops.ROWS_MIN_M = old_min
        score = index_scores_rows(q, w, pool, slots, visible)
        topk_us = eager_time_us(lambda: index_topk(score, cfg.index_topk), reps=3)
        flop = 2 * m * h * t * d
        print(f"| {m:,} | {t:,} | {us:,.0f} {best} (default {default:,.0f}) | {flop / us / 1e6:,.0f} "
              f"| {100 * flop / us / 1e-6 / PEAK_BF16:.0f}% | {2 * m * t / us / 1e3:,.0f} | {before:,.0f} "
              f"| {before / us:.1f}x | {topk_us:,.0f} |")
        print("  configs: " + ", ".join(f"{c}: {v:,.0f}" for c, v in runs.items()))
