"""CUDA FP8 GEMV (engine/kernels/fp8_gemv.py, cuda/fp8_gemv.cu) at decode M vs the Triton fp8_linear and cuBLAS.

    python benchmarks/kernels.py --only fp8_gemv                                  # the table
    python benchmarks/kernel_benches/fp8_gemv.py [--sweep] [--shapes wkv,wq_a] [--m 1,8]   # + launch sweep

Per matrix of one decoder layer (layer_shapes(full_config())) and M in (1, 2, 4, 8), all in one run with the
CUDA-graph timing of benchmarks/gpu_timing.py (weights copied past 4x L2, so each call streams from HBM):
- gemv: fp8_gemv with pick_params (with programmatic dependent launch; "no PDL": without);
- triton: fp8_linear with an explicit pick_config (its Triton path; without a config it routes here);
- cuBLAS: F.linear on the dequantised bf16 weight (the baseline of issue 7's ">= 1.5x" target).
Bytes = the FP8 minimum traffic N·K + N·K/1024 + 2·M·K + 2·M·N (cuBLAS reads 2·N·K; its TB/s is on its own
bytes). "<= 1 ULP" = share of outputs within 1 bf16 ULP of fp8_linear_ref (the rest is checked by the test).

wo_a (the attention output projection, G = 8 groups of 1024 x 4096, fp8_gemv_grouped in the bf16-exact mode,
no activation quantisation) against the runner's baseline: torch.einsum("mgd,grd->mgr") of bf16 activations
and the dequantised bf16 weight copy (cuBLAS batched GEMM, 2 bytes per weight). "<= 1 ULP" there is against
fp8_gemv_bf16_ref (the golden model's float64 einsum); "bitwise" = share of outputs equal to it.

--sweep: stage 1 times (warps_n, warps_k, splits) at row_tiles 2, unroll 4; stage 2 times row_tiles x
unroll at the stage-1 winner; it prints the best few per (matrix, M) next to pick_params's choice.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.gpu_timing import calls_of, copies_for, gemv_bench_main, graph_time_us, sweep  # noqa: E402
from engine.kernels.fp8_gemv import (GemvParams, fp8_gemv, fp8_gemv_bf16_ref, fp8_gemv_grouped,  # noqa: E402
                                     pick_params, smem_bytes)
from engine.kernels.fp8_linear import fp8_linear, fp8_linear_ref, layer_shapes, pick_config  # noqa: E402
from engine.presets import full_config  # noqa: E402
from engine.quant import dequant_fp8_weight, quant_fp8_weight  # noqa: E402

M_VALUES = (1, 2, 4, 8)
WARP_SHAPES = ((8, 1), (4, 2), (2, 4), (1, 8), (4, 1), (2, 2), (1, 4))
SPLITS = (1, 2, 3, 4, 6, 8)


def _weights(n: int, k: int, copies: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    qw, sw = quant_fp8_weight(torch.randn(n, k, device="cuda") * 0.02)
    return [(qw.clone(), sw.clone()) for _ in range(copies)]


def _xs(m: int, k: int) -> list[torch.Tensor]:
    return [torch.randn(m, k, device="cuda").bfloat16() for _ in range(4)]


def _fp8_bytes(m: int, n: int, k: int) -> int:
    return n * k + math.ceil(n / 32) * (k // 32) + 2 * m * k + 2 * m * n


def _name(p: GemvParams) -> str:
    form = f"ring{p.ring}" if p.ring else f"u{p.unroll}"
    return f"rt{p.row_tiles} {form} {p.warps_n}x{p.warps_k}w s{p.splits}" + ("" if p.pdl else " no-pdl")


def _ring_shapes(k: int) -> list[GemvParams]:
    """The shared-memory ring form's launch shapes that the sweeps try (the register form's are staged)."""
    ring = {GemvParams(rt, 4, wn, wk, s, ring=st).normalised(k) for rt in (1, 2) for st in (2, 3, 4)
            for wn, wk in ((8, 1), (4, 2), (2, 4)) for s in (1, 2, 4, 6, 8)}
    return sorted((p for p in ring if smem_bytes(k, p) <= 200 * 1024), key=_name)


def _time_gemv(xs, wts, p: GemvParams | None) -> float:
    return graph_time_us(calls_of(lambda i: lambda: fp8_gemv(xs[i % 4], *wts[i], p), len(wts)))


def _within_ulp(m: int, n: int, k: int, qw: torch.Tensor, sw: torch.Tensor) -> float:
    x = torch.randn(m, k, device="cuda").bfloat16()
    y, ref = fp8_gemv(x, qw, sw).double(), fp8_linear_ref(x, qw, sw).double()
    ulp = torch.ldexp(torch.ones_like(ref), torch.frexp(ref.abs().clamp_min(2.0**-100))[1] - 8)
    return ((y - ref).abs() <= ulp).double().mean().item()


def wo_a_shape() -> tuple[int, int, int]:
    """(G, R, K) of wo_a: 8 groups of 1024 rows x 4096 (64 heads x 512 / 8 groups)."""
    cfg = full_config()
    return cfg.o_groups, cfg.o_lora_rank, cfg.n_heads * cfg.head_dim // cfg.o_groups


def _time_grouped(xs, wts, groups: int, p: GemvParams | None) -> float:
    return graph_time_us(calls_of(lambda i: lambda: fp8_gemv_grouped(xs[i % 4], *wts[i], groups, False, p),
                                  len(wts)))


def _bitwise_and_ulp(m: int, groups: int, r: int, k: int, qw: torch.Tensor, sw: torch.Tensor) -> tuple[float, float]:
    x = torch.randn(m, groups, k, device="cuda").bfloat16()
    y, ref = fp8_gemv_grouped(x, qw, sw, groups, False).double(), fp8_gemv_bf16_ref(x, qw, sw, groups).double()
    ulp = torch.ldexp(torch.ones_like(ref), torch.frexp(ref.abs().clamp_min(2.0**-100))[1] - 8)
    return (y == ref).double().mean().item(), ((y - ref).abs() <= ulp).double().mean().item()


def bench_wo_a(copy_bw: float, m_values: tuple[int, ...] = M_VALUES, sweep_params: bool = False) -> None:
    groups, r, k = wo_a_shape()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    n = groups * r
    print(f"\n## fp8_gemv grouped: wo_a ({groups} x {r} x {k}), bf16-exact, vs the bf16 einsum on the dequantised "
          "copy (CUDA graph replay)")
    print(f"copy bandwidth measured in this run: {copy_bw / 1e12:.2f} TB/s (read + write)\n")
    head = ("| M | gemv us | bytes | TB/s | % copy BW | gemv no PDL us | bf16 einsum us (TB/s) | speedup vs einsum | "
            "bitwise | <= 1 ULP | params |")
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    wts = _weights(n, k, copies_for(n * k))
    bf = [dequant_fp8_weight(*wts[0]).bfloat16().view(groups, r, k) for _ in range(copies_for(2 * n * k))]
    for m in m_values:
        xs = [torch.randn(m, groups, k, device="cuda").bfloat16() for _ in range(4)]
        p = pick_params(m, r, k, sms, groups).normalised(k)
        us = _time_grouped(xs, wts, groups, p)
        no_pdl = _time_grouped(xs, wts, groups, dataclasses.replace(p, pdl=False))
        ein = graph_time_us(calls_of(lambda i: lambda: torch.einsum("mgd,grd->mgr", xs[i % 4], bf[i]), len(bf)))
        nbytes = n * k + n // 32 * (k // 32) + 2 * m * groups * k + 2 * m * n  # FP8 + scales + x + y
        ein_bytes = 2 * (n * k + m * groups * k + m * n)
        bitwise, ulp = _bitwise_and_ulp(m, groups, r, k, *wts[0])
        print(f"| {m} | {us:.1f} | {nbytes / 1e6:.2f} MB | {nbytes / us / 1e6:.2f} | "
              f"{100 * nbytes / (us * 1e-6) / copy_bw:.0f}% | {no_pdl:.1f} | {ein:.1f} ({ein_bytes / ein / 1e6:.2f}) | "
              f"{ein / us:.2f}x | {100 * bitwise:.2f}% | {100 * ulp:.2f}% | {_name(p)} |", flush=True)
    del bf
    if sweep_params:
        print("\n## fp8_gemv grouped sweep: wo_a (us per call; auto = pick_params)")
        for m in (m_values if len(m_values) <= 2 else (1, 8)):
            xs = [torch.randn(m, groups, k, device="cuda").bfloat16() for _ in range(4)]
            auto = pick_params(m, r, k, sms, groups).normalised(k)
            stage1 = {GemvParams(2, 4, wn, wk, s).normalised(k) for wn, wk in WARP_SHAPES for s in SPLITS}
            stage1 = sorted((p for p in stage1 if smem_bytes(k, p) <= 200 * 1024), key=_name)
            res, (best, _) = sweep(stage1, f"wo_a M={m}", lambda p: _time_grouped(xs, wts, groups, p))
            if best is not None:
                stage2 = [GemvParams(rt, u, best.warps_n, best.warps_k, best.splits)
                          for rt in (1, 2) for u in (2, 4, 8)]
                res |= sweep(stage2, f"wo_a M={m}", lambda p: _time_grouped(xs, wts, groups, p))[0]
            res |= sweep(_ring_shapes(k), f"wo_a M={m} ring", lambda p: _time_grouped(xs, wts, groups, p))[0]
            auto_us = res.get(auto) or _time_grouped(xs, wts, groups, auto)
            top = sorted(res.items(), key=lambda kv: kv[1])[:6]
            print(f"- wo_a M={m}: auto ({_name(auto)}) {auto_us:.1f} us; best "
                  + "; ".join(f"{_name(p)}: {t:.1f}" for p, t in top), flush=True)
    del wts


def bench(copy_bw: float, sweep_params: bool = False, names: tuple[str, ...] | None = None,
          m_values: tuple[int, ...] = M_VALUES) -> None:
    if names is None or "wo_a" in names:
        bench_wo_a(copy_bw, m_values, sweep_params)
    shapes = {nm: s for nm, s in layer_shapes(full_config()).items() if names is None or nm in names}
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print("\n## fp8_gemv: CUDA FP8 GEMV at decode M vs Triton fp8_linear and cuBLAS bf16 (CUDA graph replay)")
    print(f"copy bandwidth measured in this run: {copy_bw / 1e12:.2f} TB/s (read + write)\n")
    head = ("| matrix (N x K) | M | gemv us | bytes | TB/s | % copy BW | gemv no PDL us | triton us | "
            "cuBLAS bf16 us (TB/s) | speedup vs cuBLAS | speedup vs triton | <= 1 ULP | params |")
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for name, (n, k) in shapes.items():
        wts = _weights(n, k, copies_for(n * k))
        bf = [dequant_fp8_weight(*wts[0]).bfloat16() for _ in range(copies_for(2 * n * k))]
        for m in m_values:
            xs = _xs(m, k)
            p = pick_params(m, n, k, sms).normalised(k)
            us = _time_gemv(xs, wts, p)
            no_pdl = _time_gemv(xs, wts, dataclasses.replace(p, pdl=False))
            cfg = pick_config(m, n, k, sms)
            tri = graph_time_us(calls_of(lambda i: lambda: fp8_linear(xs[i % 4], *wts[i], cfg), len(wts)))
            cub = graph_time_us(calls_of(lambda i: lambda: F.linear(xs[i % 4], bf[i]), len(bf)))
            nbytes, cub_bytes = _fp8_bytes(m, n, k), 2 * (n * k + m * k + m * n)
            print(f"| {name} ({n}x{k}) | {m} | {us:.1f} | {nbytes / 1e6:.2f} MB | {nbytes / us / 1e6:.2f} | "
                  f"{100 * nbytes / (us * 1e-6) / copy_bw:.0f}% | {no_pdl:.1f} | {tri:.1f} | "
                  f"{cub:.1f} ({cub_bytes / cub / 1e6:.2f}) | "
                  f"{cub / us:.2f}x | {tri / us:.2f}x | {100 * _within_ulp(m, n, k, *wts[0]):.2f}% | {_name(p)} |",
                  flush=True)
        del wts, bf
    if sweep_params and shapes:
        sweep_gemv(shapes, m_values if len(m_values) <= 2 else (1, 8))


def sweep_gemv(shapes: dict[str, tuple[int, int]], m_values: tuple[int, ...]) -> None:
    """Launch shapes of fp8_gemv, for tuning pick_params."""
    print("\n## fp8_gemv sweep (us per call; auto = pick_params)")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for name, (n, k) in shapes.items():
        wts = _weights(n, k, copies_for(n * k))
        for m in m_values:
            xs = _xs(m, k)
            auto = pick_params(m, n, k, sms).normalised(k)
            stage1 = {GemvParams(2, 4, wn, wk, s).normalised(k) for wn, wk in WARP_SHAPES for s in SPLITS}
            stage1 = sorted((p for p in stage1 if smem_bytes(k, p) <= 200 * 1024), key=_name)
            res, (best, _) = sweep(stage1, f"{name} M={m}", lambda p: _time_gemv(xs, wts, p))
            if best is not None:
                stage2 = [GemvParams(rt, u, best.warps_n, best.warps_k, best.splits)
                          for rt in (1, 2) for u in (2, 4, 8)]
                res |= sweep(stage2, f"{name} M={m}", lambda p: _time_gemv(xs, wts, p))[0]
            res |= sweep(_ring_shapes(k), f"{name} M={m} ring", lambda p: _time_gemv(xs, wts, p))[0]
            auto_us = res.get(auto) or _time_gemv(xs, wts, auto)
            top = sorted(res.items(), key=lambda kv: kv[1])[:6]
            print(f"- {name} M={m}: auto ({_name(auto)}) {auto_us:.1f} us; best "
                  + "; ".join(f"{_name(p)}: {t:.1f}" for p, t in top), flush=True)
        del wts


def main() -> None:
    gemv_bench_main(bench, __doc__.splitlines()[0], "default: wo_a and the six of layer_shapes", M_VALUES)

if __name__ == "__main__":
    main()
