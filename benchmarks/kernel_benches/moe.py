"""Routed-expert MoE kernels (engine.kernels.moe) at the released layer shape, with a naive torch baseline.

    python benchmarks/kernels.py --only moe

One MoE layer of DeepSeek-V4.1-Flash: 384 FP4 experts (W1, W3 [2304 x 5120], W2 [5120 x 2304], E8M0 per 32:
18.8 MB each), top-6, FP8 shared expert. Per token count T:
- routed up+down: for given (ids, weights): at T <= 64 on CUDA the FP4 GEMVs of engine/kernels/moe_fp4.py
  (moe_plan with 8-pair tiles + quant_rows + moe_up_fp4 + moe_down_fp4; moe_forward runs the fused
  plan_and_quant instead of the first two, timed separately in the sweep section), else the
  Triton GEMMs (moe_plan + moe_up, x act-quantised inside at decode, + moe_down); the Triton time is also
  printed at every T for comparison. Decode rows
  (T <= 8) route every token to 6 distinct experts, distinct across the batch; consecutive calls take the
  next experts, so the 7.2 GB expert stack streams from HBM. T = 64, 512: random top-6 per token.
- moe_forward: router + the above + shared expert + combine (router picks from a fresh x per call).
- the router alone: gate_scores, then the Triton or the CUDA route (T = 1, 6, 64).
- baseline: what a naive implementation does: per used expert (host-side list), index_select of its tokens,
  F.linear on dequantised bf16 [W1; W3] and W2 (cuBLAS), the clamped SwiGLU and weight in torch, index_add.
Bytes (the floor): each used expert's FP4 weights + scales once (U x 18.8 MB) + x (2 T D) + the fp32 expert
outputs (4 T k D); moe_forward adds the gate (2 E D), the shared expert (FP8 + scales) and y (2 T D).
"""

from __future__ import annotations

from dataclasses import astuple

import torch
import torch.nn.functional as F

from benchmarks.gpu_timing import eager_time_us, graph_time_us, sweep
from engine.kernels.moe import (ExpertWeights, MoeGemmConfig, gate_scores, moe_down, moe_forward, moe_plan, moe_route,
                                moe_up, pick_block_m, route_scores, routed_fp4)
from engine.kernels.moe_fp4 import (FP4_MAX_TOKENS, Fp4Params, fp4_applies, fp4_tile_pairs, moe_down_fp4, moe_up_fp4,
                                    plan_and_quant, quant_rows, route_cuda)
from engine.kernels.moe_grouped import STAGING_BYTES, dequant_fp4_bf16, experts_per_group, routed_grouped
from engine.presets import full_config
from engine.tools.random_moe import random_moe
from engine.quant import dequant_fp4_weight

T_VALUES = (1, 2, 4, 8, 64, 512)
DECODE_COPIES = 64  # 64 calls x 6 experts = all 384 experts at T = 1: no L2 reuse between calls
SWEEP_T = (1, 8)
SWEEP_CONFIGS = tuple(MoeGemmConfig(bn, bk, split, warps, stages, ds)
                      for bn, bk, split, warps, stages, ds in (
                          (128, 128, 1, 8, 3, False), (128, 128, 2, 8, 3, False), (128, 128, 4, 8, 3, False),
                          (64, 128, 1, 4, 3, False), (64, 128, 2, 4, 4, False), (128, 256, 1, 8, 2, False),
                          (128, 128, 1, 4, 3, False), (128, 128, 1, 8, 3, True), (128, 128, 2, 8, 3, True)))


def _routes(t: int, k: int, e: int, copies: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(ids int32 [T, k], weights fp32 [T, k]) per call."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = []
    for i in range(copies):
        if t * k <= e:  # decode: distinct experts, the next ones each call
            ids = ((torch.arange(t * k, device="cuda") + i * t * k) % e).view(t, k)
        else:
            ids = torch.rand(t, e, generator=g, device="cuda").topk(k, dim=-1).indices
        w = torch.rand(t, k, generator=g, device="cuda") * 0.5 + 0.1
        out.append((ids.to(torch.int32).contiguous(), w))
    return out


# launch shapes around the default (8, 1, 2, 2); the first sweep (2026-11-30, 45 shapes of 1-8 warps,
# 1-4 splits, 2-8 stages) is in benchmarks/RESULTS.md
FP4_SWEEP = tuple(Fp4Params(wn, wk, sp, st) for wn, wk, sp, st in (
    (8, 1, 1, 2), (8, 1, 3, 2), (8, 1, 4, 2), (4, 1, 2, 2), (6, 1, 2, 2), (8, 1, 2, 3), (4, 2, 2, 2), (2, 2, 2, 2)))
FP4_SWEEP_DOWN = FP4_SWEEP


def _routed(x, ids, w, ex: ExpertWeights, limit: float, config: MoeGemmConfig | None = None) -> torch.Tensor:
    """The Triton grouped GEMMs."""
    e = ex.w13.size(0)
    plan = moe_plan(ids, e, pick_block_m(ids.numel(), e))
    return moe_down(moe_up(x, ex, plan, w, limit, config=config), ex, plan, config=config)


def _routed_fp4(x, ids, w, ex: ExpertWeights, limit: float, up: Fp4Params | None = None,
                down: Fp4Params | None = None, skip_down: bool = False):
    """The CUDA FP4 GEMVs, as moe_forward runs them (router ids: one expert per token once)."""
    plan = moe_plan(ids, ex.w13.size(0), 8)
    rows = min(8, x.size(0))
    hq, hs, _ = moe_up_fp4(*quant_rows(x), ex, plan, w, limit, max_tile_rows=rows, params=up)
    return hq if skip_down else moe_down_fp4(hq, hs, ex, plan, max_tile_rows=rows, params=down)


def _routed_fp4_fused(x, ids, w, ex: ExpertWeights, limit: float, block: int | None = None):
    """The CUDA path as moe_forward runs it (moe.routed_fp4: plan_and_quant, up, down); tiles of `block` pairs
    (default: fp4_tile_pairs, moe_forward's choice)."""
    return routed_fp4(x, ids, w, ex, limit, once_per_token=True, block=block)


TOKEN_SWEEP_T = (64, 128, 256, 512, 1024, 2048, 4096, 8192)
GEMM_SWEEP_T = (2048, 8192)
TILE_SWEEP_T = (256, 512, 1024, 2048, 4096, 8192)
TILE_SWEEP = (8, 16, 32)
GROUPED_T = (4096, 8192, 16384, 32768)
STAGING_SWEEP_GB = (2, 4, 8, 28)  # 28: all 384 experts' bf16 copies (27.2 GB) at once
GEMM_SWEEP = tuple((bm, bn, bk, w, st) for bm in (64, 128) for bn, bk in ((128, 64), (128, 128), (256, 64))
                   for w, st in ((4, 3), (8, 3), (8, 4)))


def _routed_shape(x, ids, w, ex: ExpertWeights, limit: float, shape: tuple[int, int, int, int, int]):
    """The Triton grouped GEMMs at a launch shape (block_m, block_n, block_k, warps, stages), no K split."""
    block_m, block_n, block_k, warps, stages = shape
    plan = moe_plan(ids, ex.w13.size(0), block_m)
    cfg = MoeGemmConfig(block_n, block_k, 1, warps, stages, fuse_quant=False)
    return moe_down(moe_up(x, ex, plan, w, limit, config=cfg), ex, plan, config=cfg)


def bench_tokens(copy_bw: float) -> None:
    """Where the CUDA FP4 GEMVs stop beating the Triton grouped GEMM (moe_fp4.FP4_MAX_TOKENS): the routed path
    (plan + up + down, random top-6 routes) on each at prefill-chunk token counts, and moe_forward as dispatched;
    then the Triton GEMM's launch shapes at GEMM_SWEEP_T tokens (where neither reaches tensor-core rates)."""
    cfg = full_config()
    d, k, e = cfg.dim, cfg.n_activated_experts, cfg.n_routed_experts
    moe, ex = random_moe(cfg)
    limit = moe.experts[0].limit
    print(f"\n## moe_tokens: routed experts at prefill-chunk sizes, us per call in a CUDA graph (CUDA GEMVs up to "
          f"FP4_MAX_TOKENS = {FP4_MAX_TOKENS} in moe_forward)\n")
    print("| T | pairs per expert | Triton GEMMs us | CUDA GEMVs us | CUDA / Triton | moe_forward us |")
    print("|---|---|---|---|---|---|")
    copies = 4  # every call reads all 384 experts (7.2 GB): no L2 reuse between calls
    for t in TOKEN_SWEEP_T:
        routes = _routes(t, k, e, copies, seed=t)
        xs = [torch.randn(t, d, device="cuda").bfloat16() for _ in range(copies)]
        triton_us = graph_time_us([lambda i=i: _routed(xs[i], *routes[i], ex, limit) for i in range(copies)])
        cuda_us = graph_time_us([lambda i=i: _routed_fp4_fused(xs[i], *routes[i], ex, limit) for i in range(copies)])
        fwd_us = graph_time_us([lambda i=i: moe_forward(xs[i], moe, ex) for i in range(copies)])
        print(f"| {t} | {t * k / e:.1f} | {triton_us:.1f} | {cuda_us:.1f} | {cuda_us / triton_us:.2f} | {fwd_us:.1f} |",
              flush=True)
        del routes, xs
    print("\n## moe_tokens: the CUDA GEMVs' tile width (pairs per tile, each weight fragment converted once for all "
          "of them), us per call of plan + up + down\n")
    print("| T | pairs per expert | " + " | ".join(f"tiles of {b}" for b in TILE_SWEEP) + " | fp4_tile_pairs picks |")
    print("|---|---|" + "---|" * (len(TILE_SWEEP) + 1))
    for t in TILE_SWEEP_T:
        routes = _routes(t, k, e, copies, seed=t)
        xs = [torch.randn(t, d, device="cuda").bfloat16() for _ in range(copies)]
        us = [graph_time_us([lambda i=i: _routed_fp4_fused(xs[i], *routes[i], ex, limit, b) for i in range(copies)])
              for b in TILE_SWEEP]
        print(f"| {t} | {t * k / e:.1f} | " + " | ".join(f"{u:.1f}" for u in us)
              + f" | {fp4_tile_pairs(t * k, e)} |", flush=True)
        del routes, xs
    print("\n## moe_tokens: the Triton grouped GEMM's launch shapes at prefill sizes (plan + up + down, us per call; "
          "(block_m, block_n, block_k, warps, stages), x quantised by one launch first)")
    for t in GEMM_SWEEP_T:
        routes = _routes(t, k, e, 2, seed=t)
        xs = [torch.randn(t, d, device="cuda").bfloat16() for _ in range(2)]
        flops = 2 * t * k * 3 * cfg.moe_inter_dim * d
        res, best = sweep(GEMM_SWEEP, f"T={t}", lambda c: graph_time_us(
            [lambda i=i: _routed_shape(xs[i], *routes[i], ex, limit, c) for i in range(2)], replays=3))
        print(f"- T={t}: " + "; ".join(f"{c}: {us:.0f}" for c, us in sorted(res.items(), key=lambda kv: kv[1])))
        if res:
            print(f"  best {best[0]}: {best[1]:.0f} us, {flops / best[1] / 1e6:.0f} TFLOP/s", flush=True)
        del routes, xs


def bench_grouped(copy_bw: float) -> None:
    """engine.kernels.moe_grouped (bf16 copies + torch's grouped GEMM) against the CUDA FP4 GEMVs, eager (CUDA
    events; the grouped path allocates its staging and is never captured), and its staging budget."""
    cfg = full_config()
    d, k, e = cfg.dim, cfg.n_activated_experts, cfg.n_routed_experts
    moe, ex = random_moe(cfg)
    limit = moe.experts[0].limit
    flop_per_pair = 2 * 3 * cfg.moe_inter_dim * d
    bf16 = torch.empty(e, 2 * ex.inter, d, dtype=torch.bfloat16, device="cuda")
    dq_us = eager_time_us(lambda: dequant_fp4_bf16(ex.w13, ex.s13, bf16))
    dq_bytes = ex.w13.numel() * (1 + 4) + ex.s13.numel()
    del bf16
    print("\n## moe_tokens: the grouped path (engine/kernels/moe_grouped.py, staging "
          f"{STAGING_BYTES / 2**30:.0f} GiB = "
          f"{experts_per_group(ex, STAGING_BYTES)} experts a group), us per eager call\n")
    print(f"Dequantising all W1|W3 to bf16: {dq_us:.0f} us ({dq_bytes / dq_us / 1e6:.2f} TB/s read + written, "
          f"{dq_bytes / dq_us / copy_bw * 1e6:.0%} of the copy rate).\n")
    print("| T | pairs per expert | CUDA GEMVs us | grouped us | GEMVs / grouped | grouped TFLOP/s |")
    print("|---|---|---|---|---|---|")
    for t in GROUPED_T:
        ids, w = _routes(t, k, e, 1, seed=t)[0]
        x = torch.randn(t, d, device="cuda").bfloat16()
        grouped_us = eager_time_us(lambda: routed_grouped(x, ids, w, ex, limit))
        gemv_us = (eager_time_us(lambda: _routed_fp4_fused(x, ids, w, ex, limit)) if t <= FP4_MAX_TOKENS
                   else float("nan"))
        print(f"| {t} | {t * k / e:.1f} | {gemv_us:.0f} | {grouped_us:.0f} | {gemv_us / grouped_us:.2f} | "
              f"{t * k * flop_per_pair / grouped_us / 1e6:.0f} |", flush=True)
        del ids, w, x
        torch.cuda.empty_cache()
    t = FP4_MAX_TOKENS
    ids, w = _routes(t, k, e, 1, seed=t)[0]
    x = torch.randn(t, d, device="cuda").bfloat16()
    row = [eager_time_us(lambda gb=gb: routed_grouped(x, ids, w, ex, limit, staging_bytes=gb << 30))
           for gb in STAGING_SWEEP_GB]
    print(f"\nStaging budget at T = {t}: " + ", ".join(f"{gb} GiB ({experts_per_group(ex, gb << 30)} experts a group) "
                                                   f"{us:.0f} us" for gb, us in zip(STAGING_SWEEP_GB, row)))


class _Baseline:
    """Per-expert F.linear on dequantised bf16 weights (27 GB for the 384 experts)."""

    def __init__(self, ex: ExpertWeights, limit: float):
        e, two_i, half_d = ex.w13.shape
        self.inter, self.limit = two_i // 2, limit
        self.w13 = torch.empty(e, two_i, 2 * half_d, dtype=torch.bfloat16, device="cuda")
        self.w2 = torch.empty(e, 2 * half_d, self.inter, dtype=torch.bfloat16, device="cuda")
        for i in range(e):
            self.w13[i] = dequant_fp4_weight(ex.w13[i], ex.s13[i]).bfloat16()
            self.w2[i] = dequant_fp4_weight(ex.w2[i], ex.s2[i]).bfloat16()

    def prepare(self, ids: torch.Tensor, w: torch.Tensor) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """Host-side grouping (outside the timed graph): (expert, token rows, their weights) per used expert."""
        out = []
        for e in torch.unique(ids).tolist():
            rows, slot = torch.where(ids == e)
            out.append((e, rows, w[rows, slot].unsqueeze(1)))
        return out

    def __call__(self, x: torch.Tensor, groups) -> torch.Tensor:
        y = torch.zeros(x.size(0), x.size(1), dtype=torch.float32, device=x.device)
        for e, rows, we in groups:
            gu = F.linear(x.index_select(0, rows), self.w13[e]).float()
            g, u = gu[:, :self.inter].clamp(max=self.limit), gu[:, self.inter:].clamp(-self.limit, self.limit)
            h = (F.silu(g) * u * we).bfloat16()
            y.index_add_(0, rows, F.linear(h, self.w2[e]).float())
        return y


def _rate(nbytes: int, us: float, copy_bw: float) -> str:
    return f"{nbytes / us / 1e6:.2f} | {100 * nbytes / (us * 1e-6) / copy_bw:.0f}%"


def router(moe) -> None:
    """The router alone: the gate's split-K partials (gate_scores), then the Triton route (route_scores) or the
    CUDA route that moe_forward runs at decode (moe_fp4.route_cuda), each in its own CUDA graph."""
    g = moe.gate
    print("\n## moe: the router (sqrt-softplus + biased top-k), us per call in a CUDA graph\n")
    print("| T | gate splits | gate_scores us | + route_scores (Triton) us | + route_cuda us |")
    print("|---|---|---|---|---|")
    for t in (1, 6, 64):
        xs = [torch.randn(t, g.weight.size(1), device="cuda").bfloat16() for _ in range(DECODE_COPIES)]
        parts = [gate_scores(x, g.weight) for x in xs]
        gate_us = graph_time_us([lambda i=i: gate_scores(xs[i], g.weight) for i in range(DECODE_COPIES)])
        times = [graph_time_us([lambda i=i: route(gate_scores(xs[i], g.weight), g.bias, g.topk, g.route_scale,
                                                  g.norm_topk) for i in range(DECODE_COPIES)])
                 for route in (route_scores, route_cuda)]
        print(f"| {t} | {parts[0].size(0)} | {gate_us:.1f} | {times[0]:.1f} | {times[1]:.1f} |", flush=True)


def bench(copy_bw: float) -> None:
    cfg = full_config()
    d, inter, k, e = cfg.dim, cfg.moe_inter_dim, cfg.n_activated_experts, cfg.n_routed_experts
    moe, ex = random_moe(full_config())
    limit = moe.experts[0].limit
    expert_bytes = 3 * inter * d // 2 + 3 * inter * d // 32
    shared_bytes = 3 * inter * d + 3 * (inter // 32) * (d // 32)
    print(f"\n## moe: routed FP4 experts (E={e}, top-{k}, D={d}, I={inter}; {expert_bytes / 1e6:.1f} MB per expert; "
          "CUDA graph replay, weights from HBM)")
    print(f"copy bandwidth measured in this run: {copy_bw / 1e12:.2f} TB/s (read + write)\n")
    head = ("| T | experts read | routed up+down us | bytes | TB/s | % copy BW | Triton GEMMs us | torch per-expert bf16 us |"
            " speedup | moe_forward us | fwd bytes | fwd TB/s | fwd % copy BW |")
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    base = _Baseline(ex, limit)
    for t in T_VALUES:
        copies = DECODE_COPIES if t * k <= e else 8
        routes = _routes(t, k, e, copies, seed=t)
        xs = [torch.randn(t, d, device="cuda").bfloat16() for _ in range(copies)]
        used = sum(int(torch.unique(ids).numel()) for ids, _ in routes) / copies
        nbytes = int(used * expert_bytes) + 2 * t * d + 4 * t * k * d
        triton_us = graph_time_us([lambda i=i: _routed(xs[i], *routes[i], ex, limit) for i in range(copies)])
        us = triton_us
        if fp4_applies(xs[0], ex):
            us = graph_time_us([lambda i=i: _routed_fp4(xs[i], *routes[i], ex, limit) for i in range(copies)])
        groups = [base.prepare(*routes[i]) for i in range(copies)]
        n_base = copies if t <= 8 else 4
        base_us = graph_time_us([lambda i=i: base(xs[i], groups[i]) for i in range(n_base)], replays=5)
        fwd_us = graph_time_us([lambda i=i: moe_forward(xs[i], moe, ex) for i in range(copies)])
        g = moe.gate
        fwd_used = sum(int(torch.unique(moe_route(x, g.weight, g.bias, k, g.route_scale, g.norm_topk)[1]).numel())
                       for x in xs) / copies  # the experts the router picked
        fwd_bytes = int(fwd_used * expert_bytes) + 2 * t * d + 4 * t * k * d + 2 * e * d + shared_bytes + 2 * t * d
        print(f"| {t} | {used:.0f} | {us:.1f} | {nbytes / 1e6:.1f} MB | {_rate(nbytes, us, copy_bw)} | {triton_us:.1f} | {base_us:.1f} | "
              f"{base_us / us:.1f}x | {fwd_us:.1f} | {fwd_bytes / 1e6:.1f} MB | {_rate(fwd_bytes, fwd_us, copy_bw)} |",
              flush=True)
        del routes, xs, groups
    del base

    router(moe)

    print("\n## moe: launch shapes of the CUDA FP4 GEMVs (Fp4Params warps_n, warps_k, splits, stages), us per call "
          "of plan + quant_rows + up + down; up swept with down on auto, then down with up on auto")
    for t in SWEEP_T:
        routes = _routes(t, k, e, DECODE_COPIES, seed=t)
        xs = [torch.randn(t, d, device="cuda").bfloat16() for _ in range(DECODE_COPIES)]
        nbytes = k * t * expert_bytes + 2 * t * d + 4 * t * k * d
        up_only = graph_time_us([lambda i=i: _routed_fp4(xs[i], *routes[i], ex, limit, skip_down=True)
                                 for i in range(DECODE_COPIES)])
        plan_us = graph_time_us([lambda i=i: moe_plan(routes[i][0], e, 8) for i in range(DECODE_COPIES)])
        quant_us = graph_time_us([lambda i=i: quant_rows(xs[i]) for i in range(DECODE_COPIES)])
        fused_us = graph_time_us([lambda i=i: plan_and_quant(xs[i], routes[i][0], e, 8) for i in range(DECODE_COPIES)])
        print(f"- T={t}: plan + quant_rows + up (auto) alone: {up_only:.1f} us; plan alone {plan_us:.1f} us, "
              f"quant_rows alone {quant_us:.1f} us, the fused plan_and_quant (what moe_forward runs) {fused_us:.1f} us")
        for which, space in (("up", FP4_SWEEP), ("down", FP4_SWEEP_DOWN)):
            res, best = sweep((None, *space), f"fp4 {which} T={t}", lambda p: graph_time_us(
                [lambda i=i: _routed_fp4(xs[i], *routes[i], ex, limit, **{which: p}) for i in range(DECODE_COPIES)]))
            print(f"- T={t} {which}: " + "; ".join(f"{astuple(p)[:4] if p else 'auto'}: {us:.1f}"
                                                   for p, us in res.items()))
            if res:
                print(f"  best {which} {best[0] or 'auto'}: {best[1]:.1f} us for the whole routed path, "
                      f"{100 * nbytes / (best[1] * 1e-6) / copy_bw:.0f}% of copy BW")
